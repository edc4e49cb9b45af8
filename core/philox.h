#pragma once
// Philox4x32-10 and the value transforms built on it, header-only so that the CPU fill
// (core/random.cpp) and the CUDA kernels compile the very same code. A value depends only on
// (seed, stream, block, lane, distribution, parameters), never on who computes it.
//
// Agreement between CPU and CUDA:
//  * Philox words, Uniform, Bernoulli and Rademacher are bit-identical: integer math, one
//    explicitly fused multiply-add (fmaf is correctly rounded everywhere), exact comparisons.
//  * Normal goes through logf/cosf/sinf. glibc and CUDA's (non-fast-math) versions are each within
//    about 1-2 ulp of the true value but not always the same float, so CPU and CUDA normals agree to a
//    few ulp, not bitwise. sqrtf is correctly rounded on both, and the remaining products are single
//    roundings written so that no compiler can contract them into different FMAs.
//  * Fast-math changes the transcendental functions (CUDA swaps in __logf/__sinf and flushes
//    denormals, GCC may vectorise through libmvec), so it is refused below rather than silently
//    breaking reproducibility. nvcc 13 no longer defines __USE_FAST_MATH__ for --use_fast_math, so on
//    the CUDA side the guard cannot see it: .cu files that include this header must be built without
//    --use_fast_math, -ftz=true, -prec-div=false and -prec-sqrt=false (-fmad=true is harmless: every
//    multiply-add here is an explicit fmaf/fma and no other product feeds an add).
#include <cmath>
#include <cstdint>

#include "core/host_device.h"

#if defined(__USE_FAST_MATH__) || defined(__FAST_MATH__)
#error "core/philox.h: fast-math changes logf/sinf/cosf, so CPU and CUDA random numbers would differ"
#endif

namespace mn {

// Lives here rather than in core/random.h so that CUDA code can use it without the host-only
// Generator; core/random.h includes this header, so its users see no difference.
enum class Distribution : uint8_t {
  Uniform,     // [lo, hi) with lo = p1, hi = p2
  Normal,      // mean p1, std p2
  Rademacher,  // +1 / -1 with equal probability
  Bernoulli,   // 1 with probability p1, else 0
};

// Philox position of one fill.
struct PhiloxState {
  uint64_t seed = 0;
  uint64_t stream = 0;  // independent sequences for one seed (e.g. hash of a mapper group name)
  uint64_t offset = 0;  // first counter block
};

struct Philox4 {
  uint32_t x[4];
};

namespace philox_detail {

constexpr uint32_t kMul0 = 0xD2511F53u;
constexpr uint32_t kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u;  // golden ratio
constexpr uint32_t kWeyl1 = 0xBB67AE85u;  // sqrt(3) - 1
constexpr int kRounds = 10;

constexpr float kTwoPow24Inv = 1.0f / 16777216.0f;          // 2^-24
constexpr double kTwoPow32Inv = 1.0 / 4294967296.0;         // 2^-32
constexpr float kTwoPi = 6.28318530717958647692f;

MN_HOST_DEVICE inline uint32_t lo32(uint64_t v) { return static_cast<uint32_t>(v); }
MN_HOST_DEVICE inline uint32_t hi32(uint64_t v) { return static_cast<uint32_t>(v >> 32); }

}  // namespace philox_detail

// Philox4x32 with 10 rounds: a bijection of the 128-bit counter for each 64-bit key.
MN_HOST_DEVICE inline Philox4 philox4x32_10(const uint32_t counter[4], const uint32_t key[2]) {
  using namespace philox_detail;
  uint32_t c0 = counter[0], c1 = counter[1], c2 = counter[2], c3 = counter[3];
  uint32_t k0 = key[0], k1 = key[1];
  for (int round = 0; round < kRounds; ++round) {
    // A 64-bit product gives both halves; nvcc lowers this to mul.lo/mul.hi.
    const uint64_t prod0 = static_cast<uint64_t>(kMul0) * c0;
    const uint64_t prod1 = static_cast<uint64_t>(kMul1) * c2;
    const uint32_t next0 = hi32(prod1) ^ c1 ^ k0;
    const uint32_t next1 = lo32(prod1);
    const uint32_t next2 = hi32(prod0) ^ c3 ^ k1;
    const uint32_t next3 = lo32(prod0);
    c0 = next0;
    c1 = next1;
    c2 = next2;
    c3 = next3;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// The Philox output for counter block `block` of a (seed, stream) sequence.
MN_HOST_DEVICE inline Philox4 philox_block(uint64_t seed, uint64_t stream, uint64_t block) {
  using namespace philox_detail;
  const uint32_t counter[4] = {lo32(block), hi32(block), lo32(stream), hi32(stream)};
  const uint32_t key[2] = {lo32(seed), hi32(seed)};
  return philox4x32_10(counter, key);
}

// ---- value transforms -------------------------------------------------------------------------

// [0, 1) from the top 24 bits: every result is exactly representable, so no rounding can reach 1.
MN_HOST_DEVICE inline float philox_uniform01(uint32_t u) {
  return static_cast<float>(u >> 8) * philox_detail::kTwoPow24Inv;
}

// (0, 1]: the Box-Muller radius takes log of this, and log(0) would be -inf.
MN_HOST_DEVICE inline float philox_uniform01_open_low(uint32_t u) {
  return static_cast<float>((u >> 8) + 1u) * philox_detail::kTwoPow24Inv;
}

// [0, 1) with all 32 bits, in double: the int64 path needs more resolution than a float holds.
MN_HOST_DEVICE inline double philox_uniform01_f64(uint32_t u) {
  return static_cast<double>(u) * philox_detail::kTwoPow32Inv;
}

// Two independent standard normals from two words (Box-Muller); the cos branch goes to the even lane.
MN_HOST_DEVICE inline void philox_box_muller(uint32_t u_radius, uint32_t u_angle, float& z_cos, float& z_sin) {
  const float u1 = philox_uniform01_open_low(u_radius);
  const float u2 = philox_uniform01(u_angle);
  // Separate statements: each product is one rounding and there is no add for FMA contraction.
  const float minus_two_log = -2.0f * logf(u1);
  const float radius = sqrtf(minus_two_log);
  const float angle = philox_detail::kTwoPi * u2;
  z_cos = radius * cosf(angle);
  z_sin = radius * sinf(angle);
}

// +1 / -1 from the top bit.
MN_HOST_DEVICE inline float philox_rademacher(uint32_t u) { return (u & 0x80000000u) ? 1.0f : -1.0f; }

// 1 with probability p; the comparison is done in double so p is not rounded to float first.
MN_HOST_DEVICE inline bool philox_bernoulli(uint32_t u, double p) {
  return static_cast<double>(philox_uniform01(u)) < p;
}

// Affine map of a [0, 1) float onto [lo, hi). fmaf is correctly rounded on host and device, so the
// result is the same float everywhere; the clamp keeps rounding from producing hi itself.
MN_HOST_DEVICE inline float philox_uniform_range(float u01, float lo, float span, float hi) {
  float v = fmaf(span, u01, lo);
  if (v >= hi && lo < hi) v = nextafterf(hi, lo);
  return v;
}

// ---- one block of values ---------------------------------------------------------------------
// Parameters are the same doubles the CPU fill receives (p1, p2 as in Distribution); they are
// converted here so both sides round them identically. Arguments are assumed valid (the host checks
// them with mn::check_distribution_params before launching anything).

// The four float values of counter block `block`: in a fill starting at block b, element
// (block - b) * 4 + j is out[j].
MN_HOST_DEVICE inline void philox_block_floats(uint64_t seed, uint64_t stream, uint64_t block, Distribution dist,
                                               double p1, double p2, float out[4]) {
  const Philox4 r = philox_block(seed, stream, block);
  switch (dist) {
    case Distribution::Uniform: {
      const float lo = static_cast<float>(p1);
      const float hi = static_cast<float>(p2);
      const float span = static_cast<float>(p2 - p1);
      for (int lane = 0; lane < 4; ++lane) out[lane] = philox_uniform_range(philox_uniform01(r.x[lane]), lo, span, hi);
      break;
    }
    case Distribution::Normal: {
      const float mean = static_cast<float>(p1);
      const float stddev = static_cast<float>(p2);
      float z[4];
      philox_box_muller(r.x[0], r.x[1], z[0], z[1]);
      philox_box_muller(r.x[2], r.x[3], z[2], z[3]);
      for (int lane = 0; lane < 4; ++lane) out[lane] = fmaf(stddev, z[lane], mean);
      break;
    }
    case Distribution::Rademacher:
      for (int lane = 0; lane < 4; ++lane) out[lane] = philox_rademacher(r.x[lane]);
      break;
    case Distribution::Bernoulli:
      for (int lane = 0; lane < 4; ++lane) out[lane] = philox_bernoulli(r.x[lane], p1) ? 1.0f : 0.0f;
      break;
  }
}

// The four int64 values of counter block `block`. Uniform is floor of a double in [lo, hi) drawn from
// all 32 bits of the lane (randint semantics for integer lo, hi); Normal is the float normal
// truncated toward zero; Bernoulli gives 0/1 and Rademacher +-1 (the same draws as the float path).
MN_HOST_DEVICE inline void philox_block_int64(uint64_t seed, uint64_t stream, uint64_t block, Distribution dist,
                                              double p1, double p2, int64_t out[4]) {
  if (dist == Distribution::Uniform) {
    const Philox4 r = philox_block(seed, stream, block);
    const double span = p2 - p1;
    for (int lane = 0; lane < 4; ++lane) {
      double v = fma(span, philox_uniform01_f64(r.x[lane]), p1);
      if (v >= p2 && p1 < p2) v = nextafter(p2, p1);
      out[lane] = static_cast<int64_t>(floor(v));
    }
    return;
  }
  float values[4] = {};  // every lane is written; GCC 12 cannot tell through the distribution switch
  philox_block_floats(seed, stream, block, dist, p1, p2, values);
  for (int lane = 0; lane < 4; ++lane) out[lane] = static_cast<int64_t>(values[lane]);
}

// Element i of the fill that starts at `st`: block st.offset + i / 4, lane i % 4. Computes a whole
// block for one value, so loops should prefer philox_block_floats.
MN_HOST_DEVICE inline float philox_float_at(const PhiloxState& st, int64_t i, Distribution dist, double p1,
                                            double p2) {
  float values[4];
  philox_block_floats(st.seed, st.stream, st.offset + static_cast<uint64_t>(i / 4), dist, p1, p2, values);
  return values[i % 4];
}

MN_HOST_DEVICE inline int64_t philox_int64_at(const PhiloxState& st, int64_t i, Distribution dist, double p1,
                                              double p2) {
  int64_t values[4];
  philox_block_int64(st.seed, st.stream, st.offset + static_cast<uint64_t>(i / 4), dist, p1, p2, values);
  return values[i % 4];
}

}  // namespace mn
