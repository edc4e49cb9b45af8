#pragma once
// The main() of the CUDA-only benchmark programs: without a device they print why and exit 0, so
// `./mn bench` and `./mn gpu-check` treat them as skipped.
#include <benchmark/benchmark.h>

#include <cstdio>

#include "core/device.h"

namespace mn_bench {

inline int run_cuda_benchmarks(int argc, char** argv, const char* what) {
  if (mn::cuda_device_count() == 0) {
    std::printf("no CUDA device (cuda_device_count() == 0): %s skipped\n", what);
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace mn_bench
