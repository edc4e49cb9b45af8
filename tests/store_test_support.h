#pragma once
// Helpers shared by the store tests (tests/test_store_auth.cpp, tests/test_store_hardening.cpp): store
// options that ignore the environment's token, raw connections that speak parts of the protocol by hand,
// the process's descriptor and thread counts, and a capture of what the server logs on stderr.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dist/socket.h"
#include "dist/store.h"
#include "dist/store_protocol.h"

namespace mn::store_test {

using namespace mn::dist;
using namespace std::chrono_literals;

inline TcpStoreOptions server_options(std::optional<std::string> token,
                               Milliseconds handshake_timeout = kDefaultStoreHandshakeTimeout) {
  TcpStoreOptions o;
  o.handshake_timeout = handshake_timeout;
  o.port = 0;
  o.is_server = true;
  o.timeout = 5000ms;
  o.token = std::move(token);
  o.token_from_env = false;
  return o;
}

inline TcpStoreOptions client_options(uint16_t port, std::optional<std::string> token, Milliseconds timeout = 5000ms) {
  TcpStoreOptions o;
  o.port = port;
  o.timeout = timeout;
  o.token = std::move(token);
  o.token_from_env = false;
  return o;
}

inline size_t open_descriptors() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

inline size_t threads() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// Waits until `condition` holds or `limit` passes; true when it held.
template <class F>
inline bool eventually(F condition, Milliseconds limit = 5000ms) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (condition()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return condition();
}

inline net::Socket raw_connect(uint16_t port) {
  return net::connect_with_retry("127.0.0.1", port, net::Clock::now() + 5000ms);
}

// True when the server closed the connection within `limit` (whatever it sent before is read and discarded).
inline bool closed_by_server(const net::Socket& s, Milliseconds limit = 3000ms) {
  const auto end = net::Clock::now() + limit;
  uint8_t buffer[256];
  while (net::Clock::now() < end) {
    pollfd p{s.fd(), POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = ::recv(s.fd(), buffer, sizeof(buffer), 0);
    if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
  }
  return false;
}

inline void send_frame(const net::Socket& s, const std::vector<uint8_t>& payload) {
  net::send_frame(s.fd(), payload, net::Clock::now() + 2000ms, "the test server");
}

// Hello and auth without a token, by hand; returns the challenge.
inline std::vector<uint8_t> open_handshake(const net::Socket& s) {
  net::Writer hello;
  hello.u32(protocol::kMagic).u32(protocol::kVersion);
  send_frame(s, hello.data());
  std::vector<uint8_t> challenge = net::recv_frame(s.fd(), net::Clock::now() + 2000ms, "the test server");
  send_frame(s, {0});
  return challenge;
}

// Captures what this process writes to stderr while alive.
class StderrCapture {
 public:
  StderrCapture() : path_(std::filesystem::temp_directory_path() / ("mn_store_log_" + std::to_string(getpid()))) {
    std::fflush(stderr);
    saved_ = ::dup(2);
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    ::dup2(fd, 2);
    ::close(fd);
  }
  ~StderrCapture() { restore(); }
  std::string text() {
    restore();
    std::ifstream in(path_);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

 private:
  void restore() {
    if (saved_ < 0) return;
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    saved_ = -1;
  }
  std::filesystem::path path_;
  int saved_ = -1;
};

}  // namespace mn::store_test
