// CUDA device discovery and the registration hook of the CUDA backend. Without a driver or device,
// cudaGetDeviceCount returns an error: that means zero devices, not a failure.
#include <cuda_runtime.h>

#include "kernels/kernels.h"

namespace mn {

int cuda_device_count() {
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky error so later checks do not report it
      return 0;
    }
    return n;
  }();
  return count;
}

}  // namespace mn

namespace mn::kernels {

void register_cuda_runtime_kernels();  // kernels/cuda/runtime.cu: copy, fill, random_fill, gemm, optimizer steps
void register_cuda_compute_kernels();  // kernels/cuda/register_compute.cu: elementwise, reductions, index,
                                       // softmax/losses, conv, pooling, batch norm

void register_cuda_kernels() {
  register_cuda_runtime_kernels();
  register_cuda_compute_kernels();
}

}  // namespace mn::kernels
