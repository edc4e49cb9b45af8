// The registration hook of the CUDA backend (device discovery, cuda_device_count, is in core/device.cpp).
#include "kernels/kernels.h"

namespace mn::kernels {

void register_cuda_runtime_kernels();  // kernels/cuda/runtime.cu: copy, fill, random_fill, gemm, optimizer steps
void register_cuda_compute_kernels();  // kernels/cuda/register_compute.cu: elementwise, reductions, index,
                                       // softmax/losses, conv, pooling, batch norm

void register_cuda_kernels() {
  register_cuda_runtime_kernels();
  register_cuda_compute_kernels();
}

}  // namespace mn::kernels
