#pragma once
// Helpers shared by the CUDA compute kernels (elementwise, reductions, indexing, softmax, conv,
// pooling, batch norm): dense copies of strided inputs, scratch buffers from the caching allocator,
// collapsing of strided layouts, a deterministic block reduction and device-side index validation.
//
// Determinism: every reduction here uses a fixed block size (kThreads, a power of two) and a fixed
// shared-memory tree, and every work split is chosen from the shapes alone, so a result never
// depends on scheduling. No float atomics are used except where a kernel says so.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/kernels.h"

namespace mn::cuda {

// t itself when contiguous (or undefined), else a contiguous copy on the same device.
inline Tensor dense(const Tensor& t) {
  if (!t.defined() || t.is_contiguous()) return t;
  Tensor out = empty(t.sizes(), TensorOptions(t.dtype()).with_device(t.device()));
  kernels::copy(t.device(), t, out);
  return out;
}

// Uninitialised device scratch of at least `bytes` bytes (8-byte elements, so any accumulator fits).
inline Tensor scratch_bytes(int64_t bytes, Device device) {
  const int64_t n = bytes <= 0 ? 1 : (bytes + 7) / 8;
  return empty({n}, TensorOptions(DType::i64).with_device(device));
}

template <class T>
inline T* scratch_ptr(const Tensor& t) {
  return reinterpret_cast<T*>(t.raw_data());
}

// Drops size-1 dims and merges neighbours that are contiguous with each other; the result is prepared.
inline Strided collapse(const Strided& in) {
  Strided s;
  for (int d = 0; d < in.ndim; ++d) {
    if (in.sizes[d] == 1) continue;
    if (s.ndim > 0 && s.strides[s.ndim - 1] == in.strides[d] * in.sizes[d]) {
      s.sizes[s.ndim - 1] *= in.sizes[d];
      s.strides[s.ndim - 1] = in.strides[d];
      continue;
    }
    s.sizes[s.ndim] = in.sizes[d];
    s.strides[s.ndim] = in.strides[d];
    ++s.ndim;
  }
  s.prepare();
  return s;
}

// The dims of t except `skip` (-1 = none), with t's strides, collapsed.
inline Strided strided_without(const Tensor& t, int skip) {
  Strided s;
  for (int d = 0; d < t.dim(); ++d) {
    if (d == skip) continue;
    s.sizes[s.ndim] = t.size(d);
    s.strides[s.ndim] = t.stride(d);
    ++s.ndim;
  }
  return collapse(s);
}

// All of t's dims, collapsed: the index map of a strided copy or fill.
inline Strided collapsed(const Tensor& t) { return strided_without(t, -1); }

inline unsigned grid_for_blocks(int64_t units) {
  if (units < 1) return 1;
  if (units > 65535LL * 8) return 65535u * 8;
  return static_cast<unsigned>(units);
}

// Reduces one value per thread of a block of kThreads threads with merge(a, b), in a fixed tree.
// Every thread of the block must call it; the result is returned to every thread. `sh` is a
// __shared__ array of kThreads elements.
template <class T, class Merge>
__device__ inline T block_reduce(T value, Merge merge, T* sh) {
  const int tid = threadIdx.x;
  sh[tid] = value;
  __syncthreads();
  for (int width = kThreads / 2; width > 0; width >>= 1) {
    if (tid < width) sh[tid] = merge(sh[tid], sh[tid + width]);
    __syncthreads();
  }
  const T result = sh[0];
  __syncthreads();  // sh may be reused right after
  return result;
}

struct AddOp {
  template <class T>
  __device__ T operator()(T a, T b) const { return a + b; }
};
struct MaxOp {
  __device__ float operator()(float a, float b) const { return (a != a || a > b) ? a : b; }  // NaN wins
};

// Position of the first element of the 1-D i64 tensor `index` (on the device) that is neither in
// [0, limit) nor equal to `allowed` (when has_allowed), or -1 when all are valid. Runs a check
// kernel and reads back one value (a stream synchronisation). When an entry is bad, its value is
// read back into *value. Defined in kernels/cuda/index.cu.
int64_t first_invalid_index(const Tensor& index, int64_t limit, bool has_allowed, int64_t allowed, int64_t* value);

}  // namespace mn::cuda
