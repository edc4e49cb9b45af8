// Entry point of the GPU tests: exits with 77 (ctest: skipped) when no CUDA device is usable, so a
// machine without a GPU never reports these tests as passed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "core/device.h"

int main(int argc, char** argv) {
  const int devices = mn::cuda_device_count();
  if (devices == 0) {
    std::printf("no CUDA device (cuda_device_count() == 0): GPU tests skipped\n");
    return 77;
  }
  std::printf("%d CUDA device(s)\n", devices);
  doctest::Context context(argc, argv);
  return context.run();
}
