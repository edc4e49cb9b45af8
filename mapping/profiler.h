#pragma once
// Memory and time profiling of parameter generation, read from the caching allocator's own counters:
// exact bytes on CPU and CUDA alike, per device, reset before each measurement. (The reference
// library traced Python-level allocations on CPU, which cannot see tensor storage, and read a
// device-global CUDA counter.)
//
//   auto [tree, peak] = profile_peak_memory([&] { return gen.generate_parameters(); });
//   auto stats = benchmark_strategies(target_spec("guide"), 64);
//   std::cout << strategy_table(stats);
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <type_traits>
#include <utility>

#include "core/allocator.h"
#include "mapping/parameter_spec.h"

namespace mn::mapping {

// Runs fn() and measures the most memory it had allocated at once on `device`: the allocator's peak
// of allocated bytes during the call minus the bytes allocated before it, i.e. exactly what the call
// added at its worst moment. Bytes are counted as the allocator hands blocks out (PyTorch's
// memory_allocated convention: requests rounded up to 512 B), never cached-but-free memory. Memory
// the returned value still holds is included, temporaries freed inside the call are included at the
// moment they were alive; allocations on other devices are not. Resets the device's peak statistic.
// Not meaningful while other threads allocate on the same device.
//   non-void fn: returns std::pair{result, peak_bytes};
//   void fn:     returns peak_bytes.
template <class F>
auto profile_peak_memory(F&& fn, Device device = kCPU) {
  using Result = std::remove_cvref_t<std::invoke_result_t<F>>;
  reset_peak_memory_stats(device);
  const int64_t before = memory_stats(device).allocated_bytes.current;
  if constexpr (std::is_void_v<std::invoke_result_t<F>>) {
    std::invoke(std::forward<F>(fn));
    return memory_stats(device).allocated_bytes.peak - before;
  } else {
    Result result = std::invoke(std::forward<F>(fn));
    const int64_t peak = memory_stats(device).allocated_bytes.peak - before;
    return std::pair<Result, int64_t>(std::move(result), peak);
  }
}

struct StrategyStats {
  int64_t peak_bytes = 0;       // max over the measured calls of each call's own peak (see above)
  double generate_time_ms = 0;  // median wall time of one generate_parameters() call
  int64_t fixed_bytes = 0;      // the generator's fixed mapper factors, held before any call
  // What the same maps take stored densely (sum over groups of rows x L x 4 bytes): the matrices the
  // reference Python library materialises. Set also when the strategy fails (N x L x 4).
  int64_t dense_bytes = 0;
  std::string error;            // non-empty when the strategy could not be built or run
  bool ok() const { return error.empty(); }
  double build_time_ms = 0;     // wall time of building the generator (its fixed mapper matrices)
};

// Builds a generator per strategy ("slvt", "layerwise", "lazy_layerwise") for `spec` - without
// parameter scaling, with the default mapper and seed 0 - and times generate_parameters(): n_warmup
// discarded calls, then n_repeat measured ones, each after a peak reset, with the previous call's
// tree already released. Generation runs with gradients enabled, as in training (the latents require
// grad, so the autograd graph and the tensors it saves count towards the peak); no backward is run.
// A strategy that fails (e.g. slvt's projection-size guard, an out-of-memory) records `error` instead
// of throwing; allow_large lifts that guard (GeneratorOptions::allow_large); `mapper` is the mapper
// family (GeneratorOptions::mapper). On CUDA every timed call ends with a device-to-host copy of one value, so the time
// covers the queued kernels; the copy is not counted in the peak.
std::map<std::string, StrategyStats> benchmark_strategies(const ParameterSpec& spec, int64_t latent_dim = 64,
                                                          Device device = kCPU, int n_warmup = 2,
                                                          int n_repeat = 5, bool allow_large = false,
                                                          const std::string& mapper = "block");

// The scaling guide's table, one line per strategy in the order slvt, layerwise, lazy_layerwise (then
// any others): "slvt                  peak=  12.34 MB  time=  0.83 ms  (12,340,224 B)  fixed=1.3 MB
// vs dense-equivalent 92.0 GB" - MB = 1e6 bytes, then the exact bytes, the fixed mapper bytes and the
// dense maps' size (kB/MB/GB, 1e3 steps); failed strategies print their error.
std::string strategy_table(const std::map<std::string, StrategyStats>& results);

}  // namespace mn::mapping
