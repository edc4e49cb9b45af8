#include "dist/tcp_store_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "core/error.h"
#include "dist/hmac.h"
#include "dist/job_token.h"

namespace mn::dist {

using net::Clock;
using net::Deadline;
using protocol::Op;

namespace {

// Bound on sending one reply to a client that does not read; it is then dropped.
constexpr Milliseconds kServerSendTimeout{10'000};
// The refusal log: at most this many lines per window; the others are counted and reported later.
constexpr int kLogLinesPerWindow = 10;
constexpr Milliseconds kLogWindow{10'000};
// Connections refused as "busy" are closed this long after the answer, at most this many at a time.
constexpr Milliseconds kClosingDelay{200};
constexpr size_t kMaxClosing = 64;

// Reads and discards whatever the peer has sent, so close() ends with a FIN rather than a reset.
void drain(int fd) {
  uint8_t scratch[4096];
  while (::recv(fd, scratch, sizeof(scratch), MSG_DONTWAIT) > 0) {
  }
}

uint32_t frame_size(const std::vector<uint8_t>& input) {
  return uint32_t(input[0]) | uint32_t(input[1]) << 8 | uint32_t(input[2]) << 16 | uint32_t(input[3]) << 24;
}

std::string peer_text(const sockaddr_storage& address) {
  char text[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (address.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&address);
    inet_ntop(AF_INET, &a->sin_addr, text, sizeof(text));
    port = ntohs(a->sin_port);
  } else if (address.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&address);
    inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof(text));
    port = ntohs(a->sin6_port);
  }
  return str(text, ":", port);
}

// Half the soft open-file limit: the rest stays for the process (its own files, Gloo's sockets).
size_t descriptor_budget() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return SIZE_MAX;
  return std::max<size_t>(16, static_cast<size_t>(limit.rlim_cur) / 2);
}

}  // namespace

TcpStoreServer::TcpStoreServer(Options options) : options_(std::move(options)) {
  max_connections_ = std::max<size_t>(1, std::min(options_.max_connections, descriptor_budget()));
  listener_ = net::listen_on(options_.host, options_.port, &port_);
  int fds[2];
  MN_CHECK(::pipe2(fds, O_CLOEXEC | O_NONBLOCK) == 0, RuntimeError, "pipe2 failed: ", std::strerror(errno));
  wake_read_ = net::Socket(fds[0]);
  wake_write_ = net::Socket(fds[1]);
  thread_ = std::thread([this] { serve(); });
}

TcpStoreServer::~TcpStoreServer() {
  stop_.store(true);
  const char byte = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_write_.fd(), &byte, 1);
  if (thread_.joinable()) thread_.join();
}

void TcpStoreServer::serve() {
  while (!stop_.load()) {
    const bool listening = Clock::now() >= listen_paused_until_;
    std::vector<pollfd> fds{{listening ? listener_.fd() : -1, POLLIN, 0}, {wake_read_.fd(), POLLIN, 0}};
    for (const auto& [fd, client] : clients_) fds.push_back({fd, POLLIN, 0});
    int timeout_ms = 1000;
    for (const Waiter& w : waiters_) timeout_ms = std::min(timeout_ms, net::poll_timeout_ms(w.deadline));
    for (const auto& [fd, client] : clients_)
      if (client.state != State::Ready)
        timeout_ms = std::min(timeout_ms, net::poll_timeout_ms(client.handshake_deadline));
    if (!listening) timeout_ms = std::min(timeout_ms, net::poll_timeout_ms(listen_paused_until_));
    if (!closing_.empty()) timeout_ms = std::min(timeout_ms, net::poll_timeout_ms(closing_.front().second));
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
    answer_waiters(true);
    expire_handshakes();
    while (!closing_.empty() && Clock::now() >= closing_.front().second) {
      drain(closing_.front().first.fd());
      closing_.pop_front();
    }
    for (int fd : to_drop_) drop(fd);
    to_drop_.clear();
    report_suppressed(false);
  }
  clients_.clear();
  closing_.clear();
  connection_count_.store(0);
  report_suppressed(true);
}

void TcpStoreServer::report_suppressed(bool now) {
  if (log_suppressed_ == 0 || (!now && Clock::now() - log_window_start_ < kLogWindow)) return;
  std::fprintf(stderr, "mn store (port %u): %zu more refused connection(s) not shown\n", unsigned(port_),
               log_suppressed_);
  log_suppressed_ = 0;
}

void TcpStoreServer::accept_clients() {
  while (true) {
    sockaddr_storage address{};
    socklen_t length = sizeof(address);
    int fd = ::accept4(listener_.fd(), reinterpret_cast<sockaddr*>(&address), &length, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        refuse("(pending connection)", str("cannot accept: ", std::strerror(errno)));
        listen_paused_until_ = Clock::now() + Milliseconds(100);
      }
      return;  // EAGAIN: no more pending connections (other errors leave the listener usable)
    }
    net::Socket socket(fd);
    const std::string peer = peer_text(address);
    if (clients_.size() >= max_connections_) {
      // Tell it why (a store client retries until its deadline), then close a moment later: closing with
      // its hello unread would reset the connection and could discard the answer.
      net::Writer busy;
      busy.u32(4 + 4 + 1).u32(protocol::kMagic).u32(protocol::kVersion).u8(protocol::kModeBusy);
      [[maybe_unused]] ssize_t n = ::send(fd, busy.data().data(), busy.data().size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      ::shutdown(fd, SHUT_WR);
      if (closing_.size() < kMaxClosing)
        closing_.push_back({std::move(socket), Clock::now() + kClosingDelay});
      else
        drain(fd);
      refuse(peer, str("the store already serves its maximum of ", max_connections_, " connections"));
      continue;
    }
    net::set_no_delay(fd);
    Client& client = clients_[fd];
    client.socket = std::move(socket);
    client.peer = peer;
    client.handshake_deadline = Clock::now() + options_.handshake_timeout;
    connection_count_.store(clients_.size());
  }
}

void TcpStoreServer::read_client(int fd) {
  auto it = clients_.find(fd);
  if (it == clients_.end()) return;
  Client& client = it->second;
  uint8_t chunk[65536];
  while (true) {
    ssize_t n = ::recv(fd, chunk, sizeof(chunk), MSG_DONTWAIT);
    if (n > 0) {
      client.input.insert(client.input.end(), chunk, chunk + n);
      if (!consume_frames(fd, client)) {
        to_drop_.push_back(fd);
        return;
      }
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    to_drop_.push_back(fd);  // closed by the client (a rank finished or died) or broken
    return;
  }
}

bool TcpStoreServer::consume_frames(int fd, Client& client) {
  try {
    size_t offset = 0;
    bool keep = true;
    while (keep && client.input.size() - offset >= 4) {
      std::vector<uint8_t> header(client.input.begin() + static_cast<ptrdiff_t>(offset),
                                  client.input.begin() + static_cast<ptrdiff_t>(offset + 4));
      const uint32_t size = frame_size(header);
      const bool ready = client.state == State::Ready;
      const uint32_t limit = ready ? protocol::kMaxFrameBytes : protocol::kMaxHandshakeFrameBytes;
      if (size > limit) {
        refuse(client.peer, str("a frame of ", size, " bytes ", ready ? "(limit " : "during the handshake (limit ",
                                limit, ")"));
        return false;
      }
      if (client.input.size() - offset < 4 + size) break;
      std::vector<uint8_t> payload(client.input.begin() + static_cast<ptrdiff_t>(offset + 4),
                                   client.input.begin() + static_cast<ptrdiff_t>(offset + 4 + size));
      offset += 4 + size;
      keep = ready ? handle_request(fd, client, payload) : handle_handshake(fd, client, payload);
    }
    client.input.erase(client.input.begin(), client.input.begin() + static_cast<ptrdiff_t>(offset));
    return keep;
  } catch (const std::exception& e) {
    refuse(client.peer, e.what());  // a malformed request, or a client that does not read its replies
    return false;
  }
}

void TcpStoreServer::reply(int fd, net::Writer& w) {
  net::send_frame(fd, w.data(), Clock::now() + kServerSendTimeout, "a store client");
}

bool TcpStoreServer::handle_handshake(int fd, Client& client, const std::vector<uint8_t>& payload) {
  net::Reader in(payload);
  if (client.state == State::Hello) {
    if (payload.size() != protocol::kHelloBytes || in.u32() != protocol::kMagic) {
      refuse(client.peer, "not the store's handshake (another protocol, or garbage)");
      return false;
    }
    const uint32_t version = in.u32();
    net::Writer out;
    out.u32(protocol::kMagic).u32(protocol::kVersion);
    if (version != protocol::kVersion) {
      reply(fd, out);  // the client names both versions
      refuse(client.peer, str("store protocol version ", version, ", this server speaks ", protocol::kVersion));
      return false;
    }
    client.nonce = crypto::random_bytes(kAuthNonceBytes);
    out.u8(options_.token ? protocol::kModeToken : protocol::kModeOpen);
    out.data().insert(out.data().end(), client.nonce.begin(), client.nonce.end());  // fixed size: no length
    reply(fd, out);
    client.state = State::Auth;
    return true;
  }
  // State::Auth
  const bool has_token = !payload.empty() && payload[0] == 1;
  if (payload.empty() || payload[0] > 1 || payload.size() != (has_token ? protocol::kAuthBytesWithToken : 1u)) {
    refuse(client.peer, "a malformed authentication message");
    return false;
  }
  if (!options_.token) {
    if (has_token) {
      refuse(client.peer, "the client has a job token but this store has none (start every node with the same "
                          "MN_JOB_TOKEN / MN_JOB_TOKEN_FILE)");
      return false;
    }
    client.state = State::Ready;
    return true;
  }
  if (!has_token) {
    refuse(client.peer, "no job token (this store requires one)");
    return false;
  }
  const std::vector<uint8_t> client_nonce(payload.begin() + 1, payload.begin() + 1 + kAuthNonceBytes);
  const crypto::Digest expected = client_auth_proof(*options_.token, client.nonce, client_nonce);
  net::Writer out;
  if (!crypto::constant_time_equal(expected.data(), payload.data() + 1 + kAuthNonceBytes, expected.size())) {
    out.u8(0);
    try {
      reply(fd, out);
    } catch (const std::exception&) {
    }
    refuse(client.peer, "wrong job token");
    return false;
  }
  const crypto::Digest proof = server_auth_proof(*options_.token, client.nonce, client_nonce);
  out.u8(1);
  out.data().insert(out.data().end(), proof.begin(), proof.end());
  reply(fd, out);
  client.state = State::Ready;
  return true;
}

bool TcpStoreServer::handle_request(int fd, Client& client, const std::vector<uint8_t>& payload) {
  if (client.waiting) {
    refuse(client.peer, "a request while its WAIT is pending (store clients send one request at a time)");
    return false;
  }
  protocol::Request r = protocol::decode_request(payload);
  net::Writer out;
  switch (r.op) {
    case Op::Set:
      data_[r.keys[0]] = std::move(r.value);
      out.u8(1);
      reply(fd, out);
      answer_waiters(false);
      return true;
    case Op::Get: {
      auto it = data_.find(r.keys[0]);
      out.u8(it != data_.end());
      if (it != data_.end()) out.bytes(it->second);
      reply(fd, out);
      return true;
    }
    case Op::Add: {
      Bytes& slot = data_[r.keys[0]];
      int64_t value = 0;
      if (!protocol::parse_counter(slot, value)) {
        out.u8(0).str(str("store key '", r.keys[0], "' holds a value that is not an integer counter"));
      } else {
        slot = protocol::counter_text(value + r.delta);
        out.u8(1).i64(value + r.delta);
      }
      reply(fd, out);
      answer_waiters(false);
      return true;
    }
    case Op::Check:
      out.u8(all_present(r.keys));
      reply(fd, out);
      return true;
    case Op::Wait:
      if (all_present(r.keys)) {
        out.u8(1);
        reply(fd, out);
      } else {
        waiters_.push_back({fd, std::move(r.keys), Clock::now() + r.timeout});
        client.waiting = true;
      }
      return true;
    case Op::Delete:
      out.u8(data_.erase(r.keys[0]) > 0);
      reply(fd, out);
      return true;
  }
  return false;
}

bool TcpStoreServer::all_present(const std::vector<std::string>& keys) const {
  return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return data_.count(k) > 0; });
}

void TcpStoreServer::answer_waiters(bool expired) {
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
      if (auto c = clients_.find(it->fd); c != clients_.end()) c->second.waiting = false;
      it = waiters_.erase(it);
    } else {
      ++it;
    }
  }
}

void TcpStoreServer::expire_handshakes() {
  const auto now = Clock::now();
  for (const auto& [fd, client] : clients_)
    if (client.state != State::Ready && now >= client.handshake_deadline) {
      refuse(client.peer, str("no complete handshake within ", options_.handshake_timeout.count(), " ms"));
      to_drop_.push_back(fd);
    }
}

void TcpStoreServer::drop(int fd) {
  waiters_.remove_if([fd](const Waiter& w) { return w.fd == fd; });
  clients_.erase(fd);  // closes the socket
  connection_count_.store(clients_.size());
}

void TcpStoreServer::refuse(const std::string& peer, const std::string& why) {
  const auto now = Clock::now();
  if (now - log_window_start_ >= kLogWindow) {
    log_window_start_ = now;
    log_lines_in_window_ = 0;
  }
  if (log_lines_in_window_ >= kLogLinesPerWindow) {
    ++log_suppressed_;
    return;
  }
  ++log_lines_in_window_;
  report_suppressed(true);
  const std::string line = str("mn store (port ", port_, "): refused the connection from ", peer, ": ", why);
  std::fprintf(stderr, "%s\n", line.c_str());
}

}  // namespace mn::dist
