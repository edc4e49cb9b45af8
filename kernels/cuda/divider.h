#pragma once
// Index division for the CUDA kernels. Kernels turn a linear element index into coordinates with
// one division and one remainder per dimension. GPUs have no integer divide instruction: nvcc turns
// each `/` or `%` on int64_t into a test of the operands' high words and a call to a 32-bit or a
// 64-bit software division (the 32-bit one alone is a float reciprocal plus a dozen or more
// correction instructions), which makes broadcast, im2col and pooling kernels spend most of their
// instructions on index arithmetic. A Divider is built on the host for one divisor and an upper
// bound on the dividends it will see; when both fit in 31 bits it divides with a 32-bit
// multiply-high, an add and a shift (the round-up method of Granlund and Montgomery, "Division by
// invariant integers using multiplication", 1994), else it falls back to the 64-bit operators. The
// choice is made once on the host, so the branch is uniform across a warp.
//
// Plain C++ as well (no CUDA needed), so the CPU tests check it exhaustively against `/` and `%`.
#include <cstdint>

#include "core/host_device.h"

namespace mn::cuda {

class Divider {
 public:
  // Largest divisor and dividend bound of the 32-bit path.
  static constexpr int64_t kNarrowLimit = (int64_t{1} << 31) - 1;

  Divider() = default;  // divides by 1

  // Divides non-negative dividends n < dividend_bound by `divisor`. A divisor below 1 only arises
  // for empty shapes, whose kernels never run; it is stored as 1 so that construction cannot fail.
  Divider(int64_t divisor, int64_t dividend_bound) : divisor_(divisor < 1 ? 1 : divisor) {
    narrow_ = divisor_ <= kNarrowLimit && dividend_bound <= kNarrowLimit;
    if (!narrow_) return;
    const uint64_t d = static_cast<uint64_t>(divisor_);
    uint32_t shift = 0;
    while ((uint64_t{1} << shift) < d) ++shift;  // ceil(log2 d), at most 31
    shift_ = shift;
    // m = floor(2^32 (2^shift - d) / d) + 1 < 2^32 for d < 2^32; then n / d = (mulhi(n, m) + n) >> shift
    // for every n < 2^31 (the sum cannot overflow 32 bits because mulhi(n, m) < n).
    multiplier_ = static_cast<uint32_t>((((uint64_t{1} << shift) - d) << 32) / d + 1);
  }

  MN_HOST_DEVICE int64_t divisor() const { return divisor_; }
  MN_HOST_DEVICE bool narrow() const { return narrow_; }

  MN_HOST_DEVICE int64_t div(int64_t n) const {
    if (!narrow_) return n / divisor_;
    const uint32_t x = static_cast<uint32_t>(n);
#if defined(__CUDA_ARCH__)
    const uint32_t t = __umulhi(x, multiplier_);
#else
    const uint32_t t = static_cast<uint32_t>((static_cast<uint64_t>(x) * multiplier_) >> 32);
#endif
    return static_cast<int64_t>((t + x) >> shift_);
  }

  // q = n / divisor, r = n % divisor.
  MN_HOST_DEVICE void divmod(int64_t n, int64_t* q, int64_t* r) const {
    *q = div(n);
    *r = n - *q * divisor_;
  }

  MN_HOST_DEVICE int64_t mod(int64_t n) const { return n - div(n) * divisor_; }

 private:
  int64_t divisor_ = 1;
  uint32_t multiplier_ = 1;  // with shift 0: mulhi(n, 1) = 0, so n / 1 = n
  uint32_t shift_ = 0;
  bool narrow_ = true;
};

}  // namespace mn::cuda
