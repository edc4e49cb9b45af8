#include "dist/store_protocol.h"

#include <algorithm>

#include "core/error.h"

namespace mn::dist::protocol {

namespace {
std::string checked_key(net::Reader& in) {
  const uint32_t size = in.u32();
  MN_CHECK(size <= kMaxStoreKeyBytes, RuntimeError, "malformed store request: a key of ", size,
           " bytes (limit ", kMaxStoreKeyBytes, ")");
  // Byte by byte: the Reader checks each one is inside the frame.
  std::string key(size, '\0');
  for (uint32_t i = 0; i < size; ++i) key[i] = static_cast<char>(in.u8());
  return key;
}
}  // namespace

Request decode_request(const std::vector<uint8_t>& payload) {
  net::Reader in(payload);
  Request r;
  const uint8_t op = in.u8();
  MN_CHECK(op >= static_cast<uint8_t>(Op::Set) && op <= static_cast<uint8_t>(Op::Delete), RuntimeError,
           "malformed store request: unknown operation ", int(op));
  r.op = static_cast<Op>(op);
  switch (r.op) {
    case Op::Set:
      r.keys.push_back(checked_key(in));
      r.value = in.bytes();
      MN_CHECK(r.value.size() <= kMaxStoreValueBytes, RuntimeError, "malformed store request: a value of ",
               r.value.size(), " bytes (limit ", kMaxStoreValueBytes, ")");
      break;
    case Op::Get:
    case Op::Delete:
      r.keys.push_back(checked_key(in));
      break;
    case Op::Add:
      r.keys.push_back(checked_key(in));
      r.delta = in.i64();
      break;
    case Op::Wait: {
      const uint64_t ms = in.u64();
      r.timeout = Milliseconds(static_cast<int64_t>(std::min<uint64_t>(ms, kMaxStoreWaitTimeout.count())));
      [[fallthrough]];
    }
    case Op::Check: {
      const uint32_t n = in.u32();
      MN_CHECK(n <= kMaxStoreKeysPerRequest, RuntimeError, "malformed store request: ", n, " keys (limit ",
               kMaxStoreKeysPerRequest, ")");
      for (uint32_t i = 0; i < n; ++i) r.keys.push_back(checked_key(in));
      break;
    }
  }
  MN_CHECK(in.at_end(), RuntimeError, "malformed store request: trailing bytes after the fields");
  return r;
}

}  // namespace mn::dist::protocol
