#pragma once
// Counter-based random numbers (Philox4x32-10). A value is a pure function of
// (seed, stream key, offset, element index): the same numbers come out on CPU and CUDA, on every rank,
// in every run and for every thread count. Element i of a fill uses counter block offset + i / 4 and
// lane i % 4; normals pair lanes (0,1) and (2,3) through Box-Muller, so a fill of n values consumes
// ceil(n / 4) counter blocks.
#include <cstdint>
#include <memory>
#include <mutex>
#include <string_view>

#include "core/philox.h"  // Distribution, PhiloxState and the per-block transforms shared with CUDA

namespace mn {

// Counter blocks consumed by a fill of n values.
inline uint64_t philox_blocks(int64_t n) { return static_cast<uint64_t>((n + 3) / 4); }

// Throws ValueError unless the parameters suit `dist`: Uniform needs finite lo <= hi, Normal a finite
// mean and finite std >= 0, Bernoulli p in [0, 1]; Rademacher ignores them. Every fill (CPU or CUDA)
// checks through this before drawing.
void check_distribution_params(Distribution dist, double p1, double p2);

// CPU fills (OpenMP-parallel; results independent of the thread count). The float fill's values are
// philox_block_floats, the int64 fill's philox_block_int64 (core/philox.h).
void philox_fill(float* out, int64_t n, Distribution dist, double p1, double p2, const PhiloxState& st);
void philox_fill(int64_t* out, int64_t n, Distribution dist, double p1, double p2, const PhiloxState& st);

// 64-bit FNV-1a of a name, used to derive stream keys from names (e.g. mapper group names).
uint64_t stream_key(std::string_view name);

// A seed plus a running offset. Each fill reserves its counter blocks, so consecutive draws never
// overlap and a generator's state is two integers (checkpointable).
class Generator {
 public:
  explicit Generator(uint64_t seed = 0x5eed, uint64_t stream = 0) : seed_(seed), stream_(stream) {}
  void manual_seed(uint64_t seed);
  uint64_t seed() const;
  uint64_t offset() const;
  void set_offset(uint64_t offset);
  uint64_t stream() const { return stream_; }
  // Reserves philox_blocks(n) blocks and returns where the fill starts.
  PhiloxState reserve(int64_t n);
  // Expires when this generator is destroyed (a capture graph checks it before drawing again).
  std::weak_ptr<const void> lifetime() const { return alive_; }

 private:
  mutable std::mutex mutex_;
  uint64_t seed_;
  uint64_t stream_;
  uint64_t offset_ = 0;
  std::shared_ptr<const int> alive_ = std::make_shared<const int>(0);
};

// The process-wide default generator used by rand/randn/dropout when none is given.
Generator& default_generator();
// Reseeds the default generator and resets its offset to 0.
void manual_seed(uint64_t seed);

}  // namespace mn
