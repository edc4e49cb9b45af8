#pragma once
// Small POSIX TCP helpers for the store (internal to dist/). Every blocking step takes a deadline and
// uses poll(), so nothing waits forever; failures throw mn::RuntimeError naming the peer and the errno.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mn::dist::net {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// Remaining milliseconds until the deadline for poll() (0 when passed, capped at one hour).
int poll_timeout_ms(Deadline deadline);

// Owns one file descriptor (closed on destruction).
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() { close(); }
  Socket(Socket&& other) noexcept : fd_(other.release()) {}
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void close();

 private:
  int fd_ = -1;
};

// A non-blocking listening socket bound to host:port (port 0: the system picks one; `bound_port`
// receives the real port).
Socket listen_on(const std::string& host, uint16_t port, uint16_t* bound_port);
// A port nobody listens on right now on `host` (binds port 0, reads the port back, closes it). Another
// process may take it before it is used: for tests and benchmarks that must name a port in advance.
uint16_t free_port(const std::string& host);
// Connects to host:port, retrying refused or unreachable attempts with a growing pause until the
// deadline; then RuntimeError naming the address, the time spent and the last error. The socket is
// non-blocking with TCP_NODELAY.
Socket connect_with_retry(const std::string& host, uint16_t port, Deadline deadline);

void set_non_blocking(int fd);
void set_no_delay(int fd);

// Sends / receives exactly `size` bytes before the deadline (poll + non-blocking I/O). `peer` names the
// other side in errors. recv_exact throws when the peer closes the connection.
void send_exact(int fd, const void* data, size_t size, Deadline deadline, const std::string& peer);
void recv_exact(int fd, void* data, size_t size, Deadline deadline, const std::string& peer);

// ---- frames: u32 little-endian payload length, then the payload ----
inline constexpr uint32_t kMaxFrameBytes = 1u << 30;

void send_frame(int fd, const std::vector<uint8_t>& payload, Deadline deadline, const std::string& peer);
// A frame announcing more than max_size bytes is refused (RuntimeError) before anything is allocated.
std::vector<uint8_t> recv_frame(int fd, Deadline deadline, const std::string& peer,
                                uint32_t max_size = kMaxFrameBytes);

// Little-endian encoding of the fields inside a frame.
class Writer {
 public:
  Writer& u8(uint8_t v) {
    bytes_.push_back(v);
    return *this;
  }
  Writer& u32(uint32_t v);
  Writer& u64(uint64_t v);
  Writer& i64(int64_t v) { return u64(static_cast<uint64_t>(v)); }
  Writer& blob(const void* data, size_t size);  // u32 length + bytes
  Writer& str(const std::string& s) { return blob(s.data(), s.size()); }
  Writer& bytes(const std::vector<uint8_t>& b) { return blob(b.data(), b.size()); }
  std::vector<uint8_t>& data() { return bytes_; }

 private:
  std::vector<uint8_t> bytes_;
};

// Reads fields back; a frame shorter than its fields claim throws RuntimeError ("malformed frame").
class Reader {
 public:
  explicit Reader(const std::vector<uint8_t>& bytes) : bytes_(bytes) {}
  uint8_t u8();
  uint32_t u32();
  uint64_t u64();
  int64_t i64() { return static_cast<int64_t>(u64()); }
  std::vector<uint8_t> bytes();
  std::string str();
  bool at_end() const { return pos_ == bytes_.size(); }

 private:
  void need(size_t n) const;
  const std::vector<uint8_t>& bytes_;
  size_t pos_ = 0;
};

}  // namespace mn::dist::net
