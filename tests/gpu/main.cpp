// Entry point of the GPU tests: exits with 77 (ctest: skipped) when no CUDA device is usable, so a
// machine without a GPU never reports these tests as passed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "core/device.h"
#ifdef MN_WITH_CUDA
#include <cuda_runtime.h>
#endif

int main(int argc, char** argv) {
  const int devices = mn::cuda_device_count();
  if (devices == 0) {
    std::printf("no CUDA device (cuda_device_count() == 0): GPU tests skipped\n");
#ifdef MN_WITH_CUDA
    // Say why: on a GPU host this is a driver older than the toolkit (cudaErrorInsufficientDriver),
    // CUDA_VISIBLE_DEVICES, or a missing /dev/nvidia*, and every GPU test would silently "skip".
    int n = 0;
    const cudaError_t status = cudaGetDeviceCount(&n);
    std::printf("cudaGetDeviceCount: %s (%s)\n", cudaGetErrorName(status), cudaGetErrorString(status));
#endif
    return 77;
  }
  std::printf("%d CUDA device(s)\n", devices);
  doctest::Context context(argc, argv);
  return context.run();
}
