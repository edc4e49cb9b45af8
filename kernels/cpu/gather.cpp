// CPU gather and scatter_add along one dim with an index of the input's rank (PyTorch's torch.gather /
// Tensor.scatter_add_). Both walk the index's positions: every combination of the other dims is one
// task, which runs along dim in order. Tasks never share an output element (their other coordinates
// differ), so they run in parallel and scatter_add accumulates repeated targets in a fixed order.
// Index values are all checked before any work starts.
#include <algorithm>

#include "kernels/cpu/dim_layout.h"
#include "kernels/gather_shape.h"

namespace mn::kernels {
namespace {

using cpu::parallel_team;

// The index's positions without dim, and for each tensor the element offset of a position.
struct Walk {
  int ndim = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[3][kMaxDims] = {};
  int64_t dim_stride[3] = {};
  int64_t count = 1, positions = 1;

  void offsets(int64_t p, int64_t* off) const {
    off[0] = off[1] = off[2] = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      const int64_t c = p % sizes[d];
      p /= sizes[d];
      for (int t = 0; t < 3; ++t) off[t] += c * strides[t][d];
    }
  }
};

// tensors[0] is the index; the others are read or written at the index's positions.
Walk walk_of(const Tensor& index, int dim, const Tensor& a, const Tensor& b) {
  Walk w;
  const Tensor* ts[3] = {&index, &a, &b};
  for (int d = 0; d < index.dim(); ++d) {
    if (d == dim) {
      w.count = index.size(d);
      for (int t = 0; t < 3; ++t) w.dim_stride[t] = ts[t]->stride(d);
      continue;
    }
    w.sizes[w.ndim] = index.size(d);
    for (int t = 0; t < 3; ++t) w.strides[t][w.ndim] = ts[t]->stride(d);
    w.positions *= index.size(d);
    ++w.ndim;
  }
  return w;
}

// Every index value in [0, size) (walks the index through its strides).
void check_values(const char* op, const Tensor& index, int dim, int64_t size, const Shape& shape) {
  const Tensor idx = cpu::dense(index);
  const int64_t* p = idx.data<int64_t>();
  for (int64_t j = 0; j < idx.numel(); ++j)
    MN_CHECK(p[j] >= 0 && p[j] < size, IndexError, op, ": index ", p[j], " is out of range for dimension ", dim,
             " of size ", size, " (shape ", shape, ")");
}

template <class T>
void gather_loop(const T* in, const int64_t* idx, const Walk& w, T* out) {
  // out is contiguous in index's shape: stride 1 along the last dim, so use its own walk (tensor 2).
  const int team = parallel_team(w.positions * w.count);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
  for (int64_t p = 0; p < w.positions; ++p) {
    int64_t off[3];
    w.offsets(p, off);
    for (int64_t j = 0; j < w.count; ++j)
      out[off[2] + j * w.dim_stride[2]] = in[off[1] + idx[off[0] + j * w.dim_stride[0]] * w.dim_stride[1]];
  }
}

void gather_cpu(const Tensor& in, int dim, const Tensor& index, Tensor& out) {
  check_gather_shapes(in, dim, index, out);
  check_values("gather", index, dim, in.size(dim), in.sizes());
  if (out.numel() == 0) return;
  const Walk w = walk_of(index, dim, in, out);
  const int64_t* idx = index.data<int64_t>();
  if (in.dtype() == DType::f32) return gather_loop(in.data<float>(), idx, w, out.data<float>());
  gather_loop(in.data<int64_t>(), idx, w, out.data<int64_t>());
}

template <class T>
void scatter_loop(T* out, const int64_t* idx, const Walk& w, const T* src) {
  const int team = parallel_team(w.positions * w.count);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
  for (int64_t p = 0; p < w.positions; ++p) {
    int64_t off[3];
    w.offsets(p, off);
    for (int64_t j = 0; j < w.count; ++j)
      out[off[1] + idx[off[0] + j * w.dim_stride[0]] * w.dim_stride[1]] += src[off[2] + j * w.dim_stride[2]];
  }
}

void scatter_add_cpu(Tensor& out, int dim, const Tensor& index, const Tensor& src) {
  check_scatter_shapes(out, dim, index, src);
  check_values("scatter_add", index, dim, out.size(dim), out.sizes());
  if (index.numel() == 0) return;
  Tensor target = cpu::dense(out);  // accumulate into a dense copy when out is strided, then write back
  const Walk w = walk_of(index, dim, target, src);
  const int64_t* idx = index.data<int64_t>();
  if (out.dtype() == DType::f32)
    scatter_loop(target.data<float>(), idx, w, src.data<float>());
  else
    scatter_loop(target.data<int64_t>(), idx, w, src.data<int64_t>());
  if (!target.same(out)) copy(out.device(), target, out);
}

}  // namespace

void register_cpu_gather() {
  gather.set(DeviceType::CPU, gather_cpu);
  scatter_add.set(DeviceType::CPU, scatter_add_cpu);
}

}  // namespace mn::kernels
