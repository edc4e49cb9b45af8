#include "dist/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "core/error.h"

namespace mn::dist::net {

namespace {

std::string errno_text(int err) { return std::strerror(err); }

std::string address_text(const std::string& host, uint16_t port) { return str(host, ":", port); }

// IPv4 first: MASTER_ADDR is normally a dotted address or a name that resolves to one.
struct AddressList {
  addrinfo* head = nullptr;
  ~AddressList() {
    if (head) freeaddrinfo(head);
  }
};

void resolve(const std::string& host, uint16_t port, bool passive, AddressList& out) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  const std::string service = std::to_string(port);
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &out.head);
  if (rc != 0) {
    hints.ai_family = AF_UNSPEC;
    rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &out.head);
  }
  MN_CHECK(rc == 0, RuntimeError, "cannot resolve the address '", host, "': ", gai_strerror(rc),
           " (check MASTER_ADDR)");
}

}  // namespace

int poll_timeout_ms(Deadline deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 3'600'000));
}

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = other.release();
  }
  return *this;
}

void Socket::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void set_non_blocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  MN_CHECK(flags >= 0 && fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0, RuntimeError,
           "fcntl(O_NONBLOCK) failed: ", errno_text(errno));
}

void set_no_delay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // latency only; failure is harmless
}

Socket listen_on(const std::string& host, uint16_t port, uint16_t* bound_port) {
  AddressList addresses;
  resolve(host, port, true, addresses);
  std::string last_error = "no address";
  for (addrinfo* a = addresses.head; a != nullptr; a = a->ai_next) {
    Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
    if (!s.valid()) {
      last_error = errno_text(errno);
      continue;
    }
    int one = 1;
    // A restarted job must be able to take the port back while old connections sit in TIME_WAIT.
    setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(s.fd(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(s.fd(), SOMAXCONN) != 0) {
      last_error = errno_text(errno);
      continue;
    }
    set_non_blocking(s.fd());
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    getsockname(s.fd(), reinterpret_cast<sockaddr*>(&bound), &len);
    uint16_t real_port = port;
    if (bound.ss_family == AF_INET) real_port = ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    if (bound.ss_family == AF_INET6) real_port = ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
    if (bound_port) *bound_port = real_port;
    return s;
  }
  throw RuntimeError(str("store server cannot listen on ", address_text(host, port), ": ", last_error,
                         " (is MASTER_PORT already in use by another job?)"));
}

uint16_t free_port(const std::string& host) {
  uint16_t port = 0;
  listen_on(host, 0, &port);  // the socket closes at once
  return port;
}

Socket connect_with_retry(const std::string& host, uint16_t port, Deadline deadline) {
  const auto start = Clock::now();
  auto pause = std::chrono::milliseconds(10);
  std::string last_error;
  while (true) {
    AddressList addresses;
    resolve(host, port, false, addresses);
    for (addrinfo* a = addresses.head; a != nullptr; a = a->ai_next) {
      Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
      if (!s.valid()) {
        last_error = errno_text(errno);
        continue;
      }
      set_non_blocking(s.fd());
      int rc = ::connect(s.fd(), a->ai_addr, a->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        pollfd p{s.fd(), POLLOUT, 0};
        int ready = ::poll(&p, 1, std::min(poll_timeout_ms(deadline), 1000));
        if (ready <= 0) {
          last_error = ready == 0 ? "connection attempt timed out" : errno_text(errno);
          continue;
        }
        int err = 0;
        socklen_t len = sizeof(err);
        getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
        rc = err == 0 ? 0 : -1;
        errno = err;
      }
      if (rc == 0) {
        set_no_delay(s.fd());
        return s;
      }
      last_error = errno_text(errno);
    }
    if (Clock::now() + pause >= deadline) break;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(250));
  }
  const double waited = std::chrono::duration<double>(Clock::now() - start).count();
  throw RuntimeError(str("could not connect to the store at ", address_text(host, port), " within ", waited,
                         " s (last error: ", last_error,
                         "); is rank 0 running, and are MASTER_ADDR/MASTER_PORT the same on every rank?"));
}

void send_exact(int fd, const void* data, size_t size, Deadline deadline, const std::string& peer) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    if (n > 0) {
      p += n;
      size -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    MN_CHECK(n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK), RuntimeError, "sending to ", peer,
             " failed: ", errno_text(errno));
    pollfd pfd{fd, POLLOUT, 0};
    int ready = ::poll(&pfd, 1, poll_timeout_ms(deadline));
    MN_CHECK(ready != 0, RuntimeError, "sending to ", peer, " timed out");
    MN_CHECK(ready > 0 || errno == EINTR, RuntimeError, "poll on the connection to ", peer,
             " failed: ", errno_text(errno));
  }
}

void recv_exact(int fd, void* data, size_t size, Deadline deadline, const std::string& peer) {
  auto* p = static_cast<uint8_t*>(data);
  while (size > 0) {
    ssize_t n = ::recv(fd, p, size, 0);
    if (n > 0) {
      p += n;
      size -= static_cast<size_t>(n);
      continue;
    }
    MN_CHECK(n != 0, RuntimeError, peer, " closed the connection");
    if (errno == EINTR) continue;
    MN_CHECK(errno == EAGAIN || errno == EWOULDBLOCK, RuntimeError, "receiving from ", peer,
             " failed: ", errno_text(errno));
    pollfd pfd{fd, POLLIN, 0};
    int ready = ::poll(&pfd, 1, poll_timeout_ms(deadline));
    MN_CHECK(ready != 0, RuntimeError, "no reply from ", peer, " before the deadline");
    MN_CHECK(ready > 0 || errno == EINTR, RuntimeError, "poll on the connection to ", peer,
             " failed: ", errno_text(errno));
  }
}

void send_frame(int fd, const std::vector<uint8_t>& payload, Deadline deadline, const std::string& peer) {
  MN_CHECK(payload.size() <= kMaxFrameBytes, ValueError, "store message of ", payload.size(),
           " bytes exceeds the limit of ", kMaxFrameBytes, " bytes");
  Writer header;
  header.u32(static_cast<uint32_t>(payload.size()));
  send_exact(fd, header.data().data(), header.data().size(), deadline, peer);
  send_exact(fd, payload.data(), payload.size(), deadline, peer);
}

std::vector<uint8_t> recv_frame(int fd, Deadline deadline, const std::string& peer, uint32_t max_size) {
  uint8_t header[4];
  recv_exact(fd, header, sizeof(header), deadline, peer);
  const uint32_t size =
      uint32_t(header[0]) | uint32_t(header[1]) << 8 | uint32_t(header[2]) << 16 | uint32_t(header[3]) << 24;
  MN_CHECK(size <= max_size, RuntimeError, peer, " sent a frame of ", size, " bytes (limit ", max_size,
           "); is it really a store?");
  std::vector<uint8_t> payload(size);
  recv_exact(fd, payload.data(), size, deadline, peer);
  return payload;
}

Writer& Writer::u32(uint32_t v) {
  for (int i = 0; i < 4; ++i) bytes_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  return *this;
}

Writer& Writer::u64(uint64_t v) {
  for (int i = 0; i < 8; ++i) bytes_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  return *this;
}

Writer& Writer::blob(const void* data, size_t size) {
  MN_CHECK(size <= kMaxFrameBytes, ValueError, "store field of ", size, " bytes exceeds the limit of ",
           kMaxFrameBytes, " bytes");
  u32(static_cast<uint32_t>(size));
  const auto* p = static_cast<const uint8_t*>(data);
  bytes_.insert(bytes_.end(), p, p + size);
  return *this;
}

void Reader::need(size_t n) const {
  MN_CHECK(bytes_.size() - pos_ >= n, RuntimeError, "malformed store frame: needed ", n, " more bytes at offset ",
           pos_, " of ", bytes_.size());
}

uint8_t Reader::u8() {
  need(1);
  return bytes_[pos_++];
}

uint32_t Reader::u32() {
  need(4);
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t(bytes_[pos_++]) << (8 * i);
  return v;
}

uint64_t Reader::u64() {
  need(8);
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t(bytes_[pos_++]) << (8 * i);
  return v;
}

std::vector<uint8_t> Reader::bytes() {
  const uint32_t n = u32();
  need(n);
  std::vector<uint8_t> out(bytes_.begin() + static_cast<ptrdiff_t>(pos_),
                           bytes_.begin() + static_cast<ptrdiff_t>(pos_ + n));
  pos_ += n;
  return out;
}

std::string Reader::str() {
  std::vector<uint8_t> b = bytes();
  return std::string(b.begin(), b.end());
}

}  // namespace mn::dist::net
