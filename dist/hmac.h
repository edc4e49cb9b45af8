#pragma once
// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the store's job-token challenge-response
// (dist/store.cpp). Small and dependency-free; checked against the FIPS 180-4 examples and the RFC 4231
// test vectors (tests/test_store_auth.cpp). Not meant for bulk hashing speed.
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mn::dist::crypto {

using Digest = std::array<uint8_t, 32>;

// Incremental SHA-256: update() any number of times, then finish() once.
class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t size);
  void update(const std::string& s) { update(s.data(), s.size()); }
  Digest finish();

 private:
  void compress(const uint8_t* block);
  std::array<uint32_t, 8> state_;
  std::array<uint8_t, 64> buffer_{};
  size_t buffered_ = 0;
  uint64_t total_bytes_ = 0;
};

Digest sha256(const void* data, size_t size);
inline Digest sha256(const std::string& s) { return sha256(s.data(), s.size()); }

// HMAC-SHA256(key, message); keys longer than the 64-byte block are hashed first, as RFC 2104 says.
Digest hmac_sha256(const void* key, size_t key_size, const void* message, size_t message_size);
inline Digest hmac_sha256(const std::string& key, const std::vector<uint8_t>& message) {
  return hmac_sha256(key.data(), key.size(), message.data(), message.size());
}

// Equality whose time depends only on the sizes, not on where the first difference is.
bool constant_time_equal(const uint8_t* a, const uint8_t* b, size_t size);

// `size` bytes from the kernel's CSPRNG (getrandom, or /dev/urandom where it is missing); RuntimeError
// if neither works.
std::vector<uint8_t> random_bytes(size_t size);

std::string to_hex(const uint8_t* data, size_t size);
inline std::string to_hex(const Digest& d) { return to_hex(d.data(), d.size()); }

}  // namespace mn::dist::crypto
