#pragma once
// The two 16-bit floating-point storage types and their exact conversions, shared by the host and
// device code (C++17, no <bit>): bf16 (8-bit exponent, 7-bit mantissa: f32's range, ~3 significant
// digits) and f16 (IEEE binary16: 5-bit exponent, 10-bit mantissa, largest finite 65504).
// Narrowing rounds to nearest, ties to even, as PyTorch does; a NaN stays a NaN (bf16 gives 0x7FC0,
// f16 keeps the sign and gives the quiet pattern 0x7E00, PyTorch's choices). Widening is exact.
// Arithmetic is never done in 16 bits: kernels widen to f32, compute, and narrow the result.
#include <cstdint>
#include <cstring>

#include "core/host_device.h"

namespace mn {

namespace half_bits {

MN_HOST_DEVICE inline uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

MN_HOST_DEVICE inline float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

MN_HOST_DEVICE inline uint16_t bf16_from_f32(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;  // NaN
  // Adding 0x7FFF plus the lowest kept bit rounds to nearest-even; infinities stay infinite and the
  // largest finite values round up to infinity, as IEEE rounding requires.
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

MN_HOST_DEVICE inline float f32_from_bf16(uint16_t b) { return f32_from_bits(static_cast<uint32_t>(b) << 16); }

MN_HOST_DEVICE inline uint16_t f16_from_f32(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);  // NaN
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 (and inf): infinity
  if (a >= 0x38800000u) {                                               // normal in f16 (>= 2^-14)
    uint32_t r = (a - 0x38000000u) >> 13;                              // rebias 127 -> 15, keep 10 bits
    const uint32_t rest = a & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (r & 1u))) ++r;         // a carry may raise the exponent
    return static_cast<uint16_t>(sign | r);
  }
  if (a <= 0x33000000u) return static_cast<uint16_t>(sign);  // <= 2^-25: rounds to zero (the tie too)
  // Subnormal in f16: value = r * 2^-24 with r = mantissa24 * 2^(e - 126), e the f32 biased exponent.
  const uint32_t e = a >> 23;
  const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - e;  // 14..24
  uint32_t r = m >> shift;
  const uint32_t rest = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1u);
  if (rest > halfway || (rest == halfway && (r & 1u))) ++r;  // may reach 0x400, the smallest normal
  return static_cast<uint16_t>(sign | r);
}

MN_HOST_DEVICE inline float f32_from_f16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in f32
    const float v = static_cast<float>(m) * 5.9604644775390625e-08f;
    return sign != 0 ? -v : v;
  }
  if (e == 31) return f32_from_bits(sign | 0x7F800000u | (m << 13));
  return f32_from_bits(sign | ((e + 112u) << 23) | (m << 13));
}

}  // namespace half_bits

// Storage types: a tensor of dtype bf16 / f16 holds these. Conversions are explicit so that no
// arithmetic happens in 16 bits by accident.
struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  MN_HOST_DEVICE explicit BFloat16(float f) : bits(half_bits::bf16_from_f32(f)) {}
  MN_HOST_DEVICE explicit operator float() const { return half_bits::f32_from_bf16(bits); }
  MN_HOST_DEVICE static BFloat16 from_bits(uint16_t b) {
    BFloat16 v;
    v.bits = b;
    return v;
  }
};

struct Half {
  uint16_t bits = 0;
  Half() = default;
  MN_HOST_DEVICE explicit Half(float f) : bits(half_bits::f16_from_f32(f)) {}
  MN_HOST_DEVICE explicit operator float() const { return half_bits::f32_from_f16(bits); }
  MN_HOST_DEVICE static Half from_bits(uint16_t b) {
    Half v;
    v.bits = b;
    return v;
  }
};

static_assert(sizeof(BFloat16) == 2 && sizeof(Half) == 2, "16-bit storage types must be 2 bytes");

}  // namespace mn
