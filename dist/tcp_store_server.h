#pragma once
// The TcpStore's server (internal to dist/; TcpStore owns one on rank 0). One thread polls the listening
// socket, a wake-up pipe and every client; it never blocks on a client except for a bounded send of a
// reply. Each connection goes hello -> auth -> ready (dist/store_protocol.h); until ready it may send only
// handshake-sized frames and must finish within the handshake timeout. A WAIT is answered when its keys
// exist or its deadline passes.
#include <atomic>
#include <list>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dist/socket.h"
#include "dist/store.h"
#include "dist/store_protocol.h"

namespace mn::dist {

class TcpStoreServer {
 public:
  struct Options {
    std::string host;
    uint16_t port = 0;
    std::optional<std::string> token;
    Milliseconds handshake_timeout = kDefaultStoreHandshakeTimeout;
    size_t max_connections = kDefaultStoreMaxConnections;
  };

  explicit TcpStoreServer(Options options);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  uint16_t port() const { return port_; }
  size_t connections() const { return connection_count_.load(); }
  size_t max_connections() const { return max_connections_; }

 private:
  enum class State { Hello, Auth, Ready };
  struct Client {
    net::Socket socket;
    std::string peer;  // "address:port", for the log
    State state = State::Hello;
    net::Deadline handshake_deadline;
    std::vector<uint8_t> nonce;  // the challenge's server nonce
    std::vector<uint8_t> input;  // received bytes not yet parsed into frames (at most one frame + a chunk)
    bool waiting = false;        // a WAIT is pending: a synchronous client sends nothing until it is answered
  };
  struct Waiter {
    int fd;
    std::vector<std::string> keys;
    net::Deadline deadline;
  };

  void serve();
  void accept_clients();
  void read_client(int fd);
  // Parses and handles every complete frame in the client's input; false: drop the client (already logged).
  bool consume_frames(int fd, Client& client);
  bool handle_handshake(int fd, Client& client, const std::vector<uint8_t>& payload);
  bool handle_request(int fd, Client& client, const std::vector<uint8_t>& payload);
  void reply(int fd, net::Writer& w);
  bool all_present(const std::vector<std::string>& keys) const;
  void answer_waiters(bool expired);
  void expire_handshakes();
  void drop(int fd);
  void refuse(const std::string& peer, const std::string& why);
  // Prints how many refusals the rate limit hid, once their window has passed (or `now`).
  void report_suppressed(bool now);

  Options options_;
  size_t max_connections_ = 0;
  net::Socket listener_;
  net::Socket wake_read_;
  net::Socket wake_write_;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<size_t> connection_count_{0};
  std::thread thread_;
  // Touched only by the server thread.
  std::map<int, Client> clients_;
  std::list<Waiter> waiters_;
  std::vector<int> to_drop_;
  std::list<std::pair<net::Socket, net::Deadline>> closing_;  // refused as busy, closed a moment later
  std::map<std::string, Bytes> data_;
  net::Deadline listen_paused_until_{};  // after EMFILE: stop accepting for a moment instead of spinning
  // The refusal log's rate limit.
  net::Deadline log_window_start_{};
  int log_lines_in_window_ = 0;
  size_t log_suppressed_ = 0;
};

}  // namespace mn::dist
