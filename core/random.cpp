#include "core/random.h"

#include <cmath>

#include "core/error.h"
#include "core/parallel.h"

namespace mn {

namespace {

// Below this many blocks a parallel region costs more than it saves.
constexpr int64_t kMinBlocksForThreads = 1024;

// Largest |z| Box-Muller can return: u1 >= 2^-24 bounds the radius by sqrt(48 ln 2) ~ 5.77.
constexpr double kMaxAbsNormal = 5.8;

// 2^63: the first double past the int64 range.
constexpr double kInt64Limit = 9223372036854775808.0;

const char* distribution_name(Distribution dist) {
  switch (dist) {
    case Distribution::Uniform: return "uniform";
    case Distribution::Normal: return "normal";
    case Distribution::Rademacher: return "rademacher";
    case Distribution::Bernoulli: return "bernoulli";
  }
  return "unknown";
}

void check_fill_args(const void* out, int64_t n) {
  MN_CHECK(n >= 0, ValueError, "philox_fill: n must be >= 0, got ", n);
  MN_CHECK(n == 0 || out != nullptr, ValueError, "philox_fill: out must not be null for n = ", n);
}

// Every block writes its own disjoint slice of out, and a block's values depend only on its
// counter, so any thread schedule yields the same bytes.
template <class T, class BlockFn>
void fill_blocks(T* out, int64_t n, const PhiloxState& st, BlockFn block_values) {
  const int64_t full_blocks = n / 4;
  const int64_t tail = n % 4;
  const int team = full_blocks >= kMinBlocksForThreads ? get_num_threads_in_use() : 1;
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
  for (int64_t b = 0; b < full_blocks; ++b) {
    block_values(st.offset + static_cast<uint64_t>(b), out + 4 * b);
  }
  if (tail > 0) {
    T values[4];
    block_values(st.offset + static_cast<uint64_t>(full_blocks), values);
    for (int64_t lane = 0; lane < tail; ++lane) out[4 * full_blocks + lane] = values[lane];
  }
}

}  // namespace

void check_distribution_params(Distribution dist, double p1, double p2) {
  switch (dist) {
    case Distribution::Uniform:
      MN_CHECK(std::isfinite(p1) && std::isfinite(p2), ValueError, "uniform: lo and hi must be finite, got lo = ", p1,
               ", hi = ", p2);
      MN_CHECK(p1 <= p2, ValueError, "uniform: lo must be <= hi, got lo = ", p1, ", hi = ", p2);
      return;
    case Distribution::Normal:
      MN_CHECK(std::isfinite(p1), ValueError, "normal: mean must be finite, got ", p1);
      MN_CHECK(std::isfinite(p2) && p2 >= 0.0, ValueError, "normal: std must be finite and >= 0, got ", p2);
      return;
    case Distribution::Rademacher:
      return;
    case Distribution::Bernoulli:
      // A NaN p fails both comparisons, so it is rejected too.
      MN_CHECK(p1 >= 0.0 && p1 <= 1.0, ValueError, "bernoulli: p must be in [0, 1], got ", p1);
      return;
  }
  throw ValueError(str("philox_fill: unknown distribution ", static_cast<int>(dist)));
}

void philox_fill(float* out, int64_t n, Distribution dist, double p1, double p2, const PhiloxState& st) {
  check_fill_args(out, n);
  check_distribution_params(dist, p1, p2);
  fill_blocks(out, n, st, [&](uint64_t block, float* dst) {
    philox_block_floats(st.seed, st.stream, block, dist, p1, p2, dst);
  });
}

void philox_fill(int64_t* out, int64_t n, Distribution dist, double p1, double p2, const PhiloxState& st) {
  check_fill_args(out, n);
  check_distribution_params(dist, p1, p2);
  // Converting a double outside the int64 range is undefined, so refuse parameters that could get there.
  if (dist == Distribution::Uniform) {
    MN_CHECK(p1 >= -kInt64Limit && p2 <= kInt64Limit, ValueError, "int64 ", distribution_name(dist),
             ": lo and hi must lie in [-2^63, 2^63], got lo = ", p1, ", hi = ", p2);
  } else if (dist == Distribution::Normal) {
    MN_CHECK(std::fabs(p1) + kMaxAbsNormal * p2 < 0.5 * kInt64Limit, ValueError, "int64 ", distribution_name(dist),
             ": |mean| + 5.8 * std must be below 2^62, got mean = ", p1, ", std = ", p2);
  }
  fill_blocks(out, n, st, [&](uint64_t block, int64_t* dst) {
    philox_block_int64(st.seed, st.stream, block, dist, p1, p2, dst);
  });
}

uint64_t stream_key(std::string_view name) {
  constexpr uint64_t kFnvOffsetBasis = 0xcbf29ce484222325ull;
  constexpr uint64_t kFnvPrime = 0x100000001b3ull;
  uint64_t hash = kFnvOffsetBasis;
  for (const char c : name) {
    hash ^= static_cast<uint8_t>(c);
    hash *= kFnvPrime;
  }
  return hash;
}

void Generator::manual_seed(uint64_t seed) {
  std::lock_guard<std::mutex> lock(mutex_);
  seed_ = seed;
  offset_ = 0;
}

uint64_t Generator::seed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return seed_;
}

uint64_t Generator::offset() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return offset_;
}

void Generator::set_offset(uint64_t offset) {
  std::lock_guard<std::mutex> lock(mutex_);
  offset_ = offset;
}

PhiloxState Generator::reserve(int64_t n) {
  MN_CHECK(n >= 0, ValueError, "Generator::reserve: n must be >= 0, got ", n);
  std::lock_guard<std::mutex> lock(mutex_);
  PhiloxState st{seed_, stream_, offset_};
  offset_ += philox_blocks(n);
  return st;
}

Generator& default_generator() {
  static Generator generator;
  return generator;
}

void manual_seed(uint64_t seed) { default_generator().manual_seed(seed); }

}  // namespace mn
