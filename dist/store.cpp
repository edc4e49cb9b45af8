#include "dist/store.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <list>

#include "core/error.h"
#include "dist/socket.h"

namespace mn::dist {

namespace {

using net::Clock;
using net::Deadline;

// "MNST": a client that reaches some other service on MASTER_PORT fails at the handshake, clearly.
constexpr uint32_t kMagic = 0x4D4E5354;
constexpr uint32_t kProtocolVersion = 1;
// Extra time a client allows the server beyond a wait's own timeout before calling it unresponsive.
constexpr Milliseconds kReplyGrace{10'000};
// Bound on sending one reply to a client that does not read; it is then dropped.
constexpr Milliseconds kServerSendTimeout{10'000};

enum class Op : uint8_t { Set = 1, Get = 2, Add = 3, Check = 4, Wait = 5, Delete = 6 };

std::string seconds_text(Milliseconds ms) { return str(static_cast<double>(ms.count()) / 1000.0, " s"); }

std::string join_keys(const std::vector<std::string>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size(); ++i) out += (i ? ", '" : "'") + keys[i] + "'";
  return out;
}

Bytes counter_text(int64_t value) {
  std::string s = std::to_string(value);
  return Bytes(s.begin(), s.end());
}

// The counter held by `value` (empty = 0); false when it is not decimal text.
bool parse_counter(const Bytes& value, int64_t& out) {
  if (value.empty()) {
    out = 0;
    return true;
  }
  const char* begin = reinterpret_cast<const char*>(value.data());
  auto [end, ec] = std::from_chars(begin, begin + value.size(), out);
  return ec == std::errc() && end == begin + value.size();
}

}  // namespace

void throw_store_timeout(const std::vector<std::string>& missing, Milliseconds timeout, const std::string& where) {
  throw RuntimeError(str("timed out after ", seconds_text(timeout), " waiting for key(s) ", join_keys(missing),
                         " in the ", where,
                         " (a rank may have exited or not started; check the other ranks' output)"));
}

// ---------------------------------------------------------------------------------------------------
// HashStore

void HashStore::set(const std::string& key, const Bytes& value) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    data_[key] = value;
  }
  changed_.notify_all();
}

Bytes HashStore::get(const std::string& key) {
  wait({key}, timeout());
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = data_.find(key);
  MN_CHECK(it != data_.end(), RuntimeError, "key '", key, "' was deleted from the HashStore while being read");
  return it->second;
}

int64_t HashStore::add(const std::string& key, int64_t delta) {
  int64_t value = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Bytes& slot = data_[key];
    MN_CHECK(parse_counter(slot, value), ValueError, "HashStore key '", key,
             "' holds a value that is not an integer counter");
    value += delta;
    slot = counter_text(value);
  }
  changed_.notify_all();
  return value;
}

void HashStore::wait(const std::vector<std::string>& keys, Milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto all_present = [&] {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return data_.count(k) > 0; });
  };
  if (changed_.wait_for(lock, timeout, all_present)) return;
  std::vector<std::string> missing;
  for (const auto& k : keys)
    if (!data_.count(k)) missing.push_back(k);
  throw_store_timeout(missing, timeout, "HashStore");
}

bool HashStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return data_.count(k) > 0; });
}

bool HashStore::delete_key(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  return data_.erase(key) > 0;
}

// ---------------------------------------------------------------------------------------------------
// TcpStoreServer: one thread, poll() over the listening socket, a wake-up pipe and the clients. A WAIT
// is answered when its keys exist or its deadline passes, so the thread itself never blocks on a client
// (except for a bounded send of a reply).

class TcpStoreServer {
 public:
  TcpStoreServer(const std::string& host, uint16_t port) {
    listener_ = net::listen_on(host, port, &port_);
    int fds[2];
    MN_CHECK(::pipe2(fds, O_CLOEXEC | O_NONBLOCK) == 0, RuntimeError, "pipe2 failed: ", std::strerror(errno));
    wake_read_ = net::Socket(fds[0]);
    wake_write_ = net::Socket(fds[1]);
    thread_ = std::thread([this] { serve(); });
  }

  ~TcpStoreServer() {
    stop_.store(true);
    const char byte = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_write_.fd(), &byte, 1);
    if (thread_.joinable()) thread_.join();
  }

  uint16_t port() const { return port_; }

 private:
  struct Client {
    net::Socket socket;
    std::vector<uint8_t> input;
    bool handshaken = false;
  };
  struct Waiter {
    int fd;
    std::vector<std::string> keys;
    Deadline deadline;
  };

  void serve() {
    while (!stop_.load()) {
      std::vector<pollfd> fds{{listener_.fd(), POLLIN, 0}, {wake_read_.fd(), POLLIN, 0}};
      for (const auto& [fd, client] : clients_) fds.push_back({fd, POLLIN, 0});
      int timeout_ms = 1000;
      for (const Waiter& w : waiters_) timeout_ms = std::min(timeout_ms, net::poll_timeout_ms(w.deadline));
      int ready = ::poll(fds.data(), fds.size(), timeout_ms);
      if (ready < 0 && errno != EINTR) break;  // cannot happen with valid descriptors; stop rather than spin
      if (stop_.load()) break;
      if (ready > 0) {
        if (fds[0].revents & POLLIN) accept_clients();
        for (size_t i = 2; i < fds.size(); ++i)
          if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) read_client(fds[i].fd);
      }
      for (int fd : to_drop_) drop(fd);
      to_drop_.clear();
      expire_waiters();
    }
  }

  void accept_clients() {
    while (true) {
      int fd = ::accept4(listener_.fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;  // EAGAIN: no more pending connections (errors leave the listener usable)
      net::set_no_delay(fd);
      clients_[fd].socket = net::Socket(fd);
    }
  }

  void read_client(int fd) {
    auto it = clients_.find(fd);
    if (it == clients_.end()) return;
    Client& client = it->second;
    uint8_t chunk[65536];
    while (true) {
      ssize_t n = ::recv(fd, chunk, sizeof(chunk), MSG_DONTWAIT);
      if (n > 0) {
        client.input.insert(client.input.end(), chunk, chunk + n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      to_drop_.push_back(fd);  // closed by the client (a rank finished or died) or broken
      return;
    }
    try {
      while (client.input.size() >= 4) {
        const uint32_t size = uint32_t(client.input[0]) | uint32_t(client.input[1]) << 8 |
                              uint32_t(client.input[2]) << 16 | uint32_t(client.input[3]) << 24;
        // Before the handshake only the 8-byte hello is acceptable; stray traffic is dropped early.
        if ((!client.handshaken && size != 8) || size > net::kMaxFrameBytes) {
          to_drop_.push_back(fd);
          return;
        }
        if (client.input.size() < 4 + size) break;
        std::vector<uint8_t> payload(client.input.begin() + 4, client.input.begin() + 4 + size);
        client.input.erase(client.input.begin(), client.input.begin() + 4 + size);
        if (!handle(fd, client, payload)) {
          to_drop_.push_back(fd);
          return;
        }
      }
    } catch (const std::exception&) {
      to_drop_.push_back(fd);  // malformed request or a client that does not read its replies
    }
  }

  void reply(int fd, net::Writer& w) {
    net::send_frame(fd, w.data(), Clock::now() + kServerSendTimeout, "a store client");
  }

  // False: drop the client.
  bool handle(int fd, Client& client, const std::vector<uint8_t>& payload) {
    net::Reader in(payload);
    if (!client.handshaken) {
      if (in.u32() != kMagic) return false;
      const uint32_t version = in.u32();
      net::Writer out;
      out.u32(kMagic).u32(kProtocolVersion);
      reply(fd, out);
      client.handshaken = version == kProtocolVersion;
      return client.handshaken;
    }
    net::Writer out;
    switch (static_cast<Op>(in.u8())) {
      case Op::Set: {
        std::string key = in.str();
        data_[key] = in.bytes();
        out.u8(1);
        reply(fd, out);
        wake_waiters();
        return true;
      }
      case Op::Get: {
        auto it = data_.find(in.str());
        out.u8(it != data_.end());
        if (it != data_.end()) out.bytes(it->second);
        reply(fd, out);
        return true;
      }
      case Op::Add: {
        std::string key = in.str();
        const int64_t delta = in.i64();
        Bytes& slot = data_[key];
        int64_t value = 0;
        if (!parse_counter(slot, value)) {
          out.u8(0).str(str("store key '", key, "' holds a value that is not an integer counter"));
        } else {
          slot = counter_text(value + delta);
          out.u8(1).i64(value + delta);
        }
        reply(fd, out);
        wake_waiters();
        return true;
      }
      case Op::Check: {
        out.u8(all_present(read_keys(in)));
        reply(fd, out);
        return true;
      }
      case Op::Wait: {
        const auto timeout = Milliseconds(static_cast<int64_t>(in.u64()));
        std::vector<std::string> keys = read_keys(in);
        if (all_present(keys)) {
          out.u8(1);
          reply(fd, out);
        } else {
          waiters_.push_back({fd, std::move(keys), Clock::now() + timeout});
        }
        return true;
      }
      case Op::Delete: {
        out.u8(data_.erase(in.str()) > 0);
        reply(fd, out);
        return true;
      }
    }
    return false;  // unknown request: not our protocol
  }

  static std::vector<std::string> read_keys(net::Reader& in) {
    const uint32_t n = in.u32();
    std::vector<std::string> keys;
    for (uint32_t i = 0; i < n; ++i) keys.push_back(in.str());
    return keys;
  }

  bool all_present(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return data_.count(k) > 0; });
  }

  void answer_waiters(bool expired) {
    const auto now = Clock::now();
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      const bool ready = all_present(it->keys);
      if (ready || (expired && now >= it->deadline)) {
        net::Writer out;
        out.u8(ready);
        try {
          reply(it->fd, out);
        } catch (const std::exception&) {
          to_drop_.push_back(it->fd);
        }
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }
  void wake_waiters() { answer_waiters(false); }
  void expire_waiters() { answer_waiters(true); }

  void drop(int fd) {
    waiters_.remove_if([fd](const Waiter& w) { return w.fd == fd; });
    clients_.erase(fd);  // closes the socket
  }

  net::Socket listener_;
  net::Socket wake_read_;
  net::Socket wake_write_;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  // Touched only by the server thread.
  std::map<int, Client> clients_;
  std::list<Waiter> waiters_;
  std::vector<int> to_drop_;
  std::map<std::string, Bytes> data_;
};

// ---------------------------------------------------------------------------------------------------
// TcpStore (client side; rank 0 also owns the server)

TcpStore::TcpStore(TcpStoreOptions options) : Store(options.timeout), options_(std::move(options)) {
  port_ = options_.port;
  if (options_.is_server) {
    server_ = std::make_unique<TcpStoreServer>(options_.listen_host.empty() ? options_.host : options_.listen_host,
                                               options_.port);
    port_ = server_->port();
  }
  MN_CHECK(port_ != 0, ValueError, "TcpStore client needs a port (got 0; only the server may pick one)");
  const Deadline deadline = Clock::now() + options_.timeout;
  net::Socket s = net::connect_with_retry(options_.host, port_, deadline);
  net::Writer hello;
  hello.u32(kMagic).u32(kProtocolVersion);
  net::send_frame(s.fd(), hello.data(), deadline, where());
  std::vector<uint8_t> answer;
  try {
    answer = net::recv_frame(s.fd(), deadline, where());
  } catch (const RuntimeError& e) {
    throw RuntimeError(str("no store handshake from ", options_.host, ":", port_, " (", e.what(),
                           "); is another service listening on MASTER_PORT?"));
  }
  net::Reader in(answer);
  const uint32_t magic = answer.size() == 8 ? in.u32() : 0;
  MN_CHECK(magic == kMagic, RuntimeError, "the service at ", options_.host, ":", port_,
           " is not an mn store (bad handshake); is another service listening on MASTER_PORT?");
  const uint32_t version = in.u32();
  MN_CHECK(version == kProtocolVersion, RuntimeError, "store protocol version mismatch: the server at ",
           options_.host, ":", port_, " speaks version ", version, ", this client speaks ", kProtocolVersion,
           " (are all ranks running the same build?)");
  socket_ = s.release();
}

TcpStore::~TcpStore() {
  if (socket_ >= 0) ::close(socket_);
  server_.reset();  // joins the server thread; remaining clients see their connection close
}

std::string TcpStore::where() const { return str("TcpStore at ", options_.host, ":", port_); }

Bytes TcpStore::round_trip(const Bytes& request, Deadline reply_deadline) {
  std::lock_guard<std::mutex> lock(mutex_);
  MN_CHECK(socket_ >= 0, RuntimeError, "the connection to the ", where(),
           " was lost by an earlier failure; the store cannot be used any more");
  try {
    net::send_frame(socket_, request, Clock::now() + timeout(), where());
    return net::recv_frame(socket_, reply_deadline, where());
  } catch (const RuntimeError& e) {
    // A half-sent request or half-read reply leaves the stream out of step: never reuse it.
    ::close(socket_);
    socket_ = -1;
    throw RuntimeError(str(e.what(), " (did rank 0, which serves the store, exit?)"));
  }
}

void TcpStore::set(const std::string& key, const Bytes& value) {
  net::Writer w;
  w.u8(static_cast<uint8_t>(Op::Set)).str(key).bytes(value);
  round_trip(w.data(), Clock::now() + timeout());
}

Bytes TcpStore::get(const std::string& key) {
  wait({key}, timeout());
  net::Writer w;
  w.u8(static_cast<uint8_t>(Op::Get)).str(key);
  Bytes answer = round_trip(w.data(), Clock::now() + timeout());
  net::Reader in(answer);
  MN_CHECK(in.u8() == 1, RuntimeError, "key '", key, "' was deleted from the ", where(), " while being read");
  return in.bytes();
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  net::Writer w;
  w.u8(static_cast<uint8_t>(Op::Add)).str(key).i64(delta);
  Bytes answer = round_trip(w.data(), Clock::now() + timeout());
  net::Reader in(answer);
  if (in.u8() != 1) throw ValueError(in.str());
  return in.i64();
}

void TcpStore::wait(const std::vector<std::string>& keys, Milliseconds timeout) {
  net::Writer w;
  w.u8(static_cast<uint8_t>(Op::Wait)).u64(static_cast<uint64_t>(std::max<int64_t>(timeout.count(), 0)));
  w.u32(static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) w.str(k);
  Bytes answer = round_trip(w.data(), Clock::now() + timeout + kReplyGrace);
  if (net::Reader(answer).u8() == 1) return;
  std::vector<std::string> missing;
  for (const auto& k : keys)
    if (!check({k})) missing.push_back(k);
  throw_store_timeout(missing.empty() ? keys : missing, timeout, where());
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  net::Writer w;
  w.u8(static_cast<uint8_t>(Op::Check)).u32(static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) w.str(k);
  return net::Reader(round_trip(w.data(), Clock::now() + timeout())).u8() == 1;
}

bool TcpStore::delete_key(const std::string& key) {
  net::Writer w;
  w.u8(static_cast<uint8_t>(Op::Delete)).str(key);
  return net::Reader(round_trip(w.data(), Clock::now() + timeout())).u8() == 1;
}

// ---------------------------------------------------------------------------------------------------
// PrefixStore

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> store)
    : Store(store ? store->timeout() : kDefaultStoreTimeout), prefix_(std::move(prefix)), store_(std::move(store)) {
  MN_CHECK(store_ != nullptr, ValueError, "PrefixStore('", prefix_, "') needs an underlying store, got null");
}

std::vector<std::string> PrefixStore::full_keys(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(full_key(k));
  return out;
}

void PrefixStore::set(const std::string& key, const Bytes& value) { store_->set(full_key(key), value); }
Bytes PrefixStore::get(const std::string& key) { return store_->get(full_key(key)); }
int64_t PrefixStore::add(const std::string& key, int64_t delta) { return store_->add(full_key(key), delta); }
void PrefixStore::wait(const std::vector<std::string>& keys, Milliseconds timeout) {
  store_->wait(full_keys(keys), timeout);
}
bool PrefixStore::check(const std::vector<std::string>& keys) { return store_->check(full_keys(keys)); }
bool PrefixStore::delete_key(const std::string& key) { return store_->delete_key(full_key(key)); }

// ---------------------------------------------------------------------------------------------------
// World-size agreement

namespace {
constexpr const char* kWorldSizeKey = "mn/world_size/rank0";
std::string world_size_ack_key(int rank) { return str("mn/world_size/rank", rank); }
}  // namespace

void check_world_size(Store& store, int rank, int world_size, Milliseconds timeout) {
  MN_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, ValueError, "check_world_size: rank ", rank,
           " is not in [0, ", world_size, ")");
  if (rank == 0) {
    store.set(kWorldSizeKey, std::to_string(world_size));
    // In rank order; a disagreeing rank ends the wait early, and the ranks already heard from are listed.
    for (int r = 1; r < world_size; ++r) {
      store.wait({world_size_ack_key(r)}, timeout);
      if (store.get_string(world_size_ack_key(r)) == std::to_string(world_size)) continue;
      std::vector<std::string> disagree;
      for (int q = r; q < world_size; ++q)
        if (store.check({world_size_ack_key(q)})) {
          const std::string theirs = store.get_string(world_size_ack_key(q));
          if (theirs != std::to_string(world_size)) disagree.push_back(str("rank ", q, " has ", theirs));
        }
      throw ValueError(str("the ranks disagree on WORLD_SIZE: rank 0 has ", world_size, ", ", joined(disagree),
                           "; start every rank with the same WORLD_SIZE (mn-run sets it for each rank it starts)"));
    }
    return;
  }
  // Read rank 0's size before publishing ours: rank 0 may fail (and close its store) as soon as it sees ours.
  store.wait({kWorldSizeKey}, timeout);
  const std::string theirs = store.get_string(kWorldSizeKey);
  store.set(world_size_ack_key(rank), std::to_string(world_size));
  MN_CHECK(theirs == std::to_string(world_size), ValueError, "the ranks disagree on WORLD_SIZE: rank ", rank,
           " has ", world_size, " but rank 0 has ", theirs,
           "; start every rank with the same WORLD_SIZE (mn-run sets it for each rank it starts)");
}

}  // namespace mn::dist
