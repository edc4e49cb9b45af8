#pragma once
// The TcpStore wire protocol (internal to dist/: store.cpp is the client, tcp_store_server.cpp the server,
// store_protocol.cpp decodes requests).
//
// Every message is a frame: u32 little-endian payload length, then the payload (dist/socket.h).
// Handshake, version 2:
//   client -> server  hello      u32 magic "MNST", u32 version                         (8 bytes, as in v1)
//   server -> client  challenge  u32 magic, u32 version, u8 mode, 32-byte server nonce  (41 bytes)
//                                mode 0: no job token, 1: job token required;
//                     or busy    u32 magic, u32 version, u8 mode 2 (at its connection limit; retry later)
//                     or, for another version: u32 magic, u32 its version, then it closes
//   client -> server  auth       u8 has_token [, 32-byte client nonce, 32-byte client proof]  (1 or 65 bytes)
//   server -> client  (mode 1 and a token only) u8 1 + 32-byte server proof, or u8 0 (refused) and close
// With mode 0 and no token the client does not wait for an answer: its first request follows the auth
// frame. Proofs: dist/job_token.h. Any other combination is refused by both sides with a clear error.
//
// Requests after the handshake: u8 op, then the op's fields (Writer/Reader encoding); decode_request
// checks them against the limits in store.h and refuses trailing bytes.
#include <algorithm>
#include <charconv>
#include <cstdint>
#include <string>
#include <vector>

#include "dist/socket.h"
#include "dist/store.h"

namespace mn::dist::protocol {

// "MNST": a client that reaches some other service on MASTER_PORT fails at the handshake, clearly.
inline constexpr uint32_t kMagic = 0x4D4E5354;
inline constexpr uint32_t kVersion = 2;  // 2: job token challenge-response and the busy answer

inline constexpr uint8_t kModeOpen = 0;
inline constexpr uint8_t kModeToken = 1;
inline constexpr uint8_t kModeBusy = 2;

inline constexpr uint32_t kHelloBytes = 8;
inline constexpr uint32_t kChallengeBytes = 9 + 32;
inline constexpr uint32_t kAuthBytesWithToken = 1 + 32 + 32;
// Nothing before the end of the handshake may announce more than this.
inline constexpr uint32_t kMaxHandshakeFrameBytes = 128;
// The largest request or reply: a SET of the longest key and the largest value, with its field headers.
inline constexpr uint32_t kMaxFrameBytes = 1 + 4 + kMaxStoreKeyBytes + 4 + kMaxStoreValueBytes;

enum class Op : uint8_t { Set = 1, Get = 2, Add = 3, Check = 4, Wait = 5, Delete = 6 };

struct Request {
  Op op = Op::Get;
  std::vector<std::string> keys;  // one for Set/Get/Add/Delete
  Bytes value;                    // Set
  int64_t delta = 0;              // Add
  Milliseconds timeout{0};        // Wait (clamped to kMaxStoreWaitTimeout)
};

// The request in `payload`; RuntimeError ("malformed store request: ...") for an unknown op, a field
// past the end, trailing bytes, or a key, value or key count over the limits.
Request decode_request(const std::vector<uint8_t>& payload);

inline Bytes counter_text(int64_t value) {
  std::string s = std::to_string(value);
  return Bytes(s.begin(), s.end());
}

// The counter held by `value` (empty = 0); false when it is not decimal text.
inline bool parse_counter(const Bytes& value, int64_t& out) {
  if (value.empty()) {
    out = 0;
    return true;
  }
  const char* begin = reinterpret_cast<const char*>(value.data());
  auto [end, ec] = std::from_chars(begin, begin + value.size(), out);
  return ec == std::errc() && end == begin + value.size();
}

}  // namespace mn::dist::protocol
