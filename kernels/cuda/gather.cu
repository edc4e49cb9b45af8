// CUDA gather and scatter_add along one dim with an index of the input's rank. Twins of
// kernels/cpu/gather.cpp: gather runs one thread per output element; scatter_add one thread per
// position of the other dims, which walks dim in order, so repeated targets accumulate in the CPU's
// order (bitwise the same, no atomics). Index values are validated on the device first
// (cuda::first_invalid_index: one stream synchronisation), so a bad one throws IndexError cleanly.
#include "kernels/cuda/compute_utils.cuh"
#include "kernels/gather_shape.h"

namespace mn::kernels {
namespace {

using cuda::kThreads;

// The index's positions without dim, and for each of three tensors (index, a, b) the element offset
// of a position and the stride along dim.
struct Walk {
  int ndim = 0;
  cuda::Divider sizes[kMaxDims] = {};
  int64_t strides[3][kMaxDims] = {};
  int64_t dim_stride[3] = {};
  int64_t count = 1, positions = 1;

  __device__ void offsets(int64_t p, int64_t* off) const {
    off[0] = off[1] = off[2] = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      int64_t q, c;
      sizes[d].divmod(p, &q, &c);
      p = q;
      for (int t = 0; t < 3; ++t) off[t] += c * strides[t][d];
    }
  }
};

Walk walk_of(const Tensor& index, int dim, const Tensor& a, const Tensor& b) {
  Walk w;
  const Tensor* ts[3] = {&index, &a, &b};
  for (int d = 0; d < index.dim(); ++d)
    if (d != dim) w.positions *= index.size(d);
  for (int d = 0; d < index.dim(); ++d) {
    if (d == dim) {
      w.count = index.size(d);
      for (int t = 0; t < 3; ++t) w.dim_stride[t] = ts[t]->stride(d);
      continue;
    }
    w.sizes[w.ndim] = cuda::Divider(index.size(d), w.positions * w.count + 1);
    for (int t = 0; t < 3; ++t) w.strides[t][w.ndim] = ts[t]->stride(d);
    ++w.ndim;
  }
  return w;
}

void check_devices(const char* op, const Tensor& target, const char* target_name, const Tensor& index,
                   const Tensor& other, const char* other_name) {
  MN_CHECK(target.device().is_cuda(), DeviceError, op, ": expected '", target_name, "' on a CUDA device, got ",
           target.device());
  cuda::check_on_device(op, index, target.device().index, "index");
  cuda::check_on_device(op, other, target.device().index, other_name);
}

void check_values(const char* op, const Tensor& index, int dim, int64_t size, const Shape& shape) {
  const Tensor dense = cuda::dense(index);
  const Tensor flat = make_view(dense.storage(), {dense.numel()}, {1}, dense.storage_offset(), DType::i64);
  int64_t value = 0;
  const int64_t pos = cuda::first_invalid_index(flat, size, false, 0, &value);
  MN_CHECK(pos < 0, IndexError, op, ": index ", value, " is out of range for dimension ", dim, " of size ", size,
           " (shape ", shape, ")");
}

template <class T>
__global__ void gather_kernel(const T* in, const int64_t* idx, Walk w, T* out) {
  const int64_t total = w.positions * w.count;
  MN_CUDA_KERNEL_LOOP(l, total) {
    const int64_t p = l / w.count, j = l - p * w.count;
    int64_t off[3];
    w.offsets(p, off);
    out[off[2] + j * w.dim_stride[2]] = in[off[1] + idx[off[0] + j * w.dim_stride[0]] * w.dim_stride[1]];
  }
}

void gather_cuda(const Tensor& in, int dim, const Tensor& index, Tensor& out) {
  check_devices("gather", in, "input", index, out, "out");
  check_gather_shapes(in, dim, index, out);
  check_values("gather", index, dim, in.size(dim), in.sizes());
  const int64_t total = out.numel();
  if (total == 0) return;
  const Walk w = walk_of(index, dim, in, out);
  const int64_t* idx = static_cast<const int64_t*>(index.raw_data());
  cudaStream_t stream = cuda::stream_of(out);
  if (in.dtype() == DType::f32)
    gather_kernel<float><<<cuda::blocks_for(total), kThreads, 0, stream>>>(
        static_cast<const float*>(in.raw_data()), idx, w, static_cast<float*>(out.raw_data()));
  else
    gather_kernel<int64_t><<<cuda::blocks_for(total), kThreads, 0, stream>>>(
        static_cast<const int64_t*>(in.raw_data()), idx, w, static_cast<int64_t*>(out.raw_data()));
  MN_CUDA_CHECK_LAUNCH();
}

template <class T>
__global__ void scatter_kernel(T* out, const int64_t* idx, Walk w, const T* src) {
  MN_CUDA_KERNEL_LOOP(p, w.positions) {
    int64_t off[3];
    w.offsets(p, off);
    for (int64_t j = 0; j < w.count; ++j)
      out[off[1] + idx[off[0] + j * w.dim_stride[0]] * w.dim_stride[1]] += src[off[2] + j * w.dim_stride[2]];
  }
}

void scatter_add_cuda(Tensor& out, int dim, const Tensor& index, const Tensor& src) {
  check_devices("scatter_add", out, "out", index, src, "src");
  check_scatter_shapes(out, dim, index, src);
  check_values("scatter_add", index, dim, out.size(dim), out.sizes());
  if (index.numel() == 0) return;
  Tensor target = cuda::dense(out);  // accumulate into a dense copy when out is strided, then write back
  const Walk w = walk_of(index, dim, target, src);
  const int64_t* idx = static_cast<const int64_t*>(index.raw_data());
  cudaStream_t stream = cuda::stream_of(out);
  if (out.dtype() == DType::f32)
    scatter_kernel<float><<<cuda::blocks_for(w.positions), kThreads, 0, stream>>>(
        static_cast<float*>(target.raw_data()), idx, w, static_cast<const float*>(src.raw_data()));
  else
    scatter_kernel<int64_t><<<cuda::blocks_for(w.positions), kThreads, 0, stream>>>(
        static_cast<int64_t*>(target.raw_data()), idx, w, static_cast<const int64_t*>(src.raw_data()));
  MN_CUDA_CHECK_LAUNCH();
  if (!target.same(out)) copy(out.device(), target, out);
}

}  // namespace

void register_cuda_gather() {
  gather.set(DeviceType::CUDA, gather_cuda);
  scatter_add.set(DeviceType::CUDA, scatter_add_cuda);
}

}  // namespace mn::kernels
