#pragma once
// Rendezvous key-value stores. Ranks meet here before any collective exists: each rank publishes its
// transport address (Gloo) or rank 0 publishes the NCCL unique id, and the others block until the key
// appears. Blocking calls always end: at the latest when the store's timeout passes, with an error that
// names the keys and the timeout.
//
//   TcpStore   rank 0 serves the keys from a background thread on MASTER_PORT; every rank (rank 0 too)
//              talks to it over one TCP connection (length-prefixed binary frames, magic/version handshake);
//   HashStore  in-process (threads as ranks, unit tests);
//   PrefixStore namespaces another store ("<prefix>/<key>") so several groups can share one server.
//
// Counters made by add() are stored as decimal text, so get() on a counter returns e.g. "3".
//
// TcpStore security (issue 20 section 5; the wire protocol is in dist/store_protocol.h):
//   - an optional job token (dist/job_token.h: MN_JOB_TOKEN or MN_JOB_TOKEN_FILE) that every client proves
//     by challenge-response before its first request, and the server proves back; the token never crosses
//     the wire. A server with a token refuses clients without it and vice versa, both with clear errors;
//   - the limits below: a frame that announces more is refused before anything is allocated for it and
//     the connection is dropped; a client must finish the handshake within handshake_timeout; at most
//     max_connections connections at once (further ones get a "busy" answer and are closed);
//   - refused connections are logged on the server's stderr (at most 10 lines per 10 s, the rest counted).
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace mn::dist {

using Bytes = std::vector<uint8_t>;
using Milliseconds = std::chrono::milliseconds;

// torch's default store timeout.
inline constexpr Milliseconds kDefaultStoreTimeout{300'000};

// TcpStore limits. What the ranks keep in the store is small (a Gloo address is ~100 bytes, the NCCL
// unique id 128, counters a few digits); the value limit leaves room for user data far beyond that while
// capping what one request can make the server hold. A key names a thing, so 4 KiB is plenty.
inline constexpr uint32_t kMaxStoreKeyBytes = 4096;
inline constexpr uint32_t kMaxStoreValueBytes = 64u << 20;  // 64 MiB
inline constexpr uint32_t kMaxStoreKeysPerRequest = 65536;  // check() / wait() on this many keys at most
inline constexpr Milliseconds kMaxStoreWaitTimeout{365LL * 24 * 3600 * 1000};  // longer waits are clamped
inline constexpr Milliseconds kDefaultStoreHandshakeTimeout{5000};
inline constexpr size_t kDefaultStoreMaxConnections = 1024;  // setup_ddp adds the world size

class Store {
 public:
  explicit Store(Milliseconds timeout = kDefaultStoreTimeout) : timeout_(timeout) {}
  virtual ~Store() = default;
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  virtual void set(const std::string& key, const Bytes& value) = 0;
  // Blocks until the key exists, at most timeout(); then RuntimeError naming the key and the timeout.
  virtual Bytes get(const std::string& key) = 0;
  // Atomically adds delta to the counter (created at 0) and returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Blocks until every key exists, at most `timeout`; then RuntimeError naming the missing keys.
  virtual void wait(const std::vector<std::string>& keys, Milliseconds timeout) = 0;
  // True when every key exists (does not block).
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // True when the key existed.
  virtual bool delete_key(const std::string& key) = 0;

  void wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }
  void set(const std::string& key, const std::string& value) { set(key, Bytes(value.begin(), value.end())); }
  std::string get_string(const std::string& key) {
    Bytes b = get(key);
    return std::string(b.begin(), b.end());
  }

  virtual Milliseconds timeout() const { return timeout_; }
  virtual void set_timeout(Milliseconds timeout) { timeout_ = timeout; }

 private:
  Milliseconds timeout_;
};

// The store's error for a wait that ran out of time (shared by the implementations).
[[noreturn]] void throw_store_timeout(const std::vector<std::string>& missing, Milliseconds timeout,
                                      const std::string& where);

// The first step of a rendezvous: every rank checks that it was started with the WORLD_SIZE rank 0 was
// started with, so a launch mistake is one clear error instead of a backend failure deep inside its own
// rendezvous (Gloo: "enforce fail at address.cc") or a wait until the timeout. Rank 0 publishes its size;
// every other rank reads it, then publishes its own. A rank whose size differs throws naming both sizes;
// rank 0 throws once it has seen a disagreeing rank, naming every rank it has heard from that disagrees.
// Call it once per store (its keys live under "mn/world_size/").
void check_world_size(Store& store, int rank, int world_size, Milliseconds timeout);

// The next step (setup_ddp calls it before building the backend's group, so a rank whose build lacks the
// backend cannot strand the others): every rank publishes its backend; rank 0 compares them all and
// publishes a verdict that every rank reads. A disagreement throws ValueError on every rank, naming the
// ranks and their backends ("rank 1 chose backend 'nccl' but rank 0 chose 'gloo'"). Keys: "mn/backend/".
void check_backend_agreement(Store& store, int rank, int world_size, const std::string& backend,
                             Milliseconds timeout);

class HashStore final : public Store {
 public:
  explicit HashStore(Milliseconds timeout = kDefaultStoreTimeout) : Store(timeout) {}
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  void wait(const std::vector<std::string>& keys, Milliseconds timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  using Store::set;
  using Store::wait;

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, Bytes> data_;
};

struct TcpStoreOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 29500;   // the server binds it; 0 lets the system pick (see TcpStore::port())
  bool is_server = false;  // rank 0 serves
  Milliseconds timeout = kDefaultStoreTimeout;  // connecting, get, wait
  // ---- job token and limits (issue 20 section 5) ----
  // The job secret (dist/job_token.h). Unset with token_from_env: job_token_from_env() is read when the
  // store is built (MN_JOB_TOKEN or MN_JOB_TOKEN_FILE), so callers need no change. Unset without it: no
  // token. The server and rank 0's own client use the same one.
  std::optional<std::string> token;
  bool token_from_env = true;
  // Server: a connection that has not finished the handshake by then is dropped (and logged).
  Milliseconds handshake_timeout = kDefaultStoreHandshakeTimeout;
  // Server: connections served at once; also capped at half the process's open-file limit (RLIMIT_NOFILE)
  // so a flood cannot take the descriptors the rank itself needs.
  size_t max_connections = kDefaultStoreMaxConnections;
  // The server's bind address when it differs from `host` (which its own client connects to): "0.0.0.0"
  // serves every interface, as mn-run's node 0 does for a job spanning nodes. Empty: `host`.
  std::string listen_host;
};

class TcpStoreServer;

class TcpStore final : public Store {
 public:
  explicit TcpStore(TcpStoreOptions options);
  ~TcpStore() override;

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  void wait(const std::vector<std::string>& keys, Milliseconds timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  using Store::set;
  using Store::wait;

  const std::string& host() const { return options_.host; }
  uint16_t port() const { return port_; }  // the real port (after a server picked one for port 0)
  bool is_server() const { return server_ != nullptr; }
  bool has_token() const { return token_.has_value(); }
  // Server only (0 otherwise): the connections it holds now, this store's own included.
  size_t server_connections() const;

 private:
  // One request/reply round trip; `reply_deadline` bounds the wait for the reply.
  Bytes round_trip(const Bytes& request, std::chrono::steady_clock::time_point reply_deadline);
  std::string where() const;
  void connect_and_authenticate();

  TcpStoreOptions options_;
  std::optional<std::string> token_;  // resolved from options_ (and the environment)
  uint16_t port_ = 0;
  std::unique_ptr<TcpStoreServer> server_;
  std::mutex mutex_;  // one request at a time on the connection
  int socket_ = -1;
};

class PrefixStore final : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> store);
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  void wait(const std::vector<std::string>& keys, Milliseconds timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  using Store::set;
  using Store::wait;
  Milliseconds timeout() const override { return store_->timeout(); }
  void set_timeout(Milliseconds timeout) override { store_->set_timeout(timeout); }
  const std::shared_ptr<Store>& underlying() const { return store_; }

 private:
  std::string full_key(const std::string& key) const { return prefix_ + "/" + key; }
  std::vector<std::string> full_keys(const std::vector<std::string>& keys) const;
  std::string prefix_;
  std::shared_ptr<Store> store_;
};

}  // namespace mn::dist
