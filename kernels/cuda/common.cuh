#pragma once
// Shared pieces of the CUDA kernels: error checking, the current stream, strided indexing of tensors
// (up to kMaxDims dimensions, passed by value to kernels) and launch geometry. Every kernel runs on
// the current stream of the tensor's device (kernels/cuda/runtime.cu).
#include <cuda_runtime.h>

#include <cstdint>

#include "core/error.h"
#include "core/tensor.h"
#include "kernels/cuda/divider.h"

namespace mn::cuda {

// Throws DeviceError naming the failed call and CUDA's message (and clears a non-sticky error).
void check(cudaError_t status, const char* what, const char* file, int line);

// The stream kernels on `device` are launched on: the calling thread's current stream of the device
// (core/cuda.h; default: the device's legacy default stream, StreamId 0, which is what PyTorch uses
// and what dist/nccl_process_group.cpp orders its NCCL stream against). Also makes `device` the
// current device. Throws DeviceError for an index that is not a device.
cudaStream_t current_stream(int device);
inline cudaStream_t stream_of(const Tensor& t) { return current_stream(t.device().index); }

// Makes `device` the current CUDA device for a scope and restores the previous one afterwards (the
// restore never throws).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// Throws DeviceError unless `t` lives on CUDA device `device`: "<op>: expected '<arg>' on cuda:0, got
// cpu". Kernels call it for every tensor argument so that mixed devices never reach a launch.
void check_on_device(const char* op, const Tensor& t, int device, const char* arg);

// Launch geometry for an element-wise pass over n elements (grid-stride loops in the kernels).
constexpr int kThreads = 256;
inline unsigned blocks_for(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  if (b < 1) b = 1;
  if (b > 65535LL * 8) b = 65535LL * 8;
  return static_cast<unsigned>(b);
}

// The grid-stride loop of those kernels: `index` runs over [0, count) in steps of the launch's thread
// count, so any grid covers any count. Use as a for header: MN_CUDA_KERNEL_LOOP(i, n) { ... }
#define MN_CUDA_KERNEL_LOOP(index, count)                                                       \
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,            \
               index##_step_ = static_cast<int64_t>(gridDim.x) * blockDim.x;                   \
       index < (count); index += index##_step_)

// Sizes and strides (in elements) of a tensor, by value, so that a kernel can turn a linear
// row-major index over the shape into an element offset of a strided (possibly expanded) view.
// offset() divides by the sizes through `dims`, which prepare() sets: collapse() and the helpers built
// on it (kernels/cuda/compute_utils.cuh) call it, as must any code that fills sizes by hand.
struct Strided {
  int ndim = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};
  Divider dims[kMaxDims] = {};

  // Dividers for dividends below the element count (every linear index a kernel passes is).
  void prepare() {
    int64_t numel = 1;
    for (int d = 0; d < ndim; ++d) numel *= sizes[d];
    for (int d = 0; d < ndim; ++d) dims[d] = Divider(sizes[d], numel);
  }

  __host__ __device__ int64_t offset(int64_t linear) const {
    int64_t off = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      int64_t q, r;
      dims[d].divmod(linear, &q, &r);
      off += r * strides[d];
      linear = q;
    }
    return off;
  }
};

}  // namespace mn::cuda

#define MN_CUDA_CHECK(expr) ::mn::cuda::check((expr), #expr, __FILE__, __LINE__)
// After a kernel launch: reports a bad configuration at the launch site.
#define MN_CUDA_CHECK_LAUNCH() ::mn::cuda::check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)
