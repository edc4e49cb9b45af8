// Runs only on a machine with a CUDA device (see main.cpp). The CUDA kernels land with the CUDA
// backend; until then every op on a CUDA tensor must fail with a clear NotImplementedError.
#include <doctest/doctest.h>

#include "autograd/ops.h"
#include "core/allocator.h"

using namespace mn;

TEST_CASE("gpu: device discovery is consistent") {
  CHECK(cuda_device_count() > 0);
  CHECK(cuda_available());
}
