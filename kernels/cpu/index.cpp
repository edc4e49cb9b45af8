// CPU gather/scatter along one dim: index_select copies slices out, index_add accumulates slices back
// in (the backward of index_select and of embedding lookups). Indices are checked before any work
// starts, so a bad one throws cleanly instead of touching memory. index_add walks the indices in order
// for each piece of the other dims, so repeated indices accumulate deterministically.
#include <algorithm>
#include <cstring>

#include "kernels/cpu/dim_layout.h"

namespace mn::kernels {
namespace {

using cpu::parallel_team;

constexpr int64_t kInnerTile = 1024;  // elements of the trailing dims one index_add task owns

// Dense copy of the index values, each checked against the dim size.
Tensor checked_index(const char* op, const Tensor& index, int64_t dim_size, int dim, const Shape& shape) {
  MN_CHECK(index.dtype() == DType::i64 && index.dim() <= 1, TypeError, op, ": expected a 1-D i64 index, got ",
           index.dtype(), index.sizes());
  Tensor idx = cpu::dense(index);
  const int64_t* p = idx.data<int64_t>();
  for (int64_t j = 0; j < idx.numel(); ++j)
    MN_CHECK(p[j] >= 0 && p[j] < dim_size, IndexError, op, ": index ", p[j], " (at position ", j,
             ") is out of range for dimension ", dim, " of size ", dim_size, " (shape ", shape, ")");
  return idx;
}

int64_t dim_size(const Tensor& t, int dim) { return t.dim() == 0 ? 1 : t.sizes()[dim]; }

// Shapes of `a` and `b` agree everywhere except dim, where b has `count`.
void check_slices(const char* op, const Tensor& a, const Tensor& b, int dim, int64_t count,
                  const char* a_name, const char* b_name) {
  bool ok = a.dim() == b.dim() && dim_size(b, dim) == count;
  for (int d = 0; ok && d < a.dim(); ++d) ok = d == dim || a.sizes()[d] == b.sizes()[d];
  MN_CHECK(ok, ValueError, op, ": '", b_name, "' of shape ", b.sizes(), " does not match '", a_name,
           "' of shape ", a.sizes(), " with ", count, " indices along dimension ", dim);
  MN_CHECK(a.dtype() == b.dtype(), TypeError, op, ": '", a_name, "' is ", a.dtype(), " but '", b_name,
           "' is ", b.dtype());
}

template <class T>
void gather(const T* src, const int64_t* idx, int64_t count, const cpu::DimSplit& s, T* out) {
  const int64_t tasks = s.outer * count;
  const int team = parallel_team(tasks * s.inner);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t o = task / count, j = task % count;
    const T* from = src + (o * s.n + idx[j]) * s.inner;
    T* to = out + task * s.inner;
    if (s.inner == 1)
      *to = *from;
    else
      std::memcpy(to, from, static_cast<size_t>(s.inner) * sizeof(T));
  }
}

void index_select_cpu(const Tensor& in, int dim, const Tensor& index, Tensor& out) {
  MN_CHECK(dim >= 0 && dim < std::max(in.dim(), 1), IndexError, "index_select: dim ", dim,
           " is out of range for shape ", in.sizes());
  const Tensor idx = checked_index("index_select", index, dim_size(in, dim), dim, in.sizes());
  cpu::require_contiguous_output(out, "index_select", "out");
  if (in.dim() > 0) check_slices("index_select", in, out, dim, idx.numel(), "input", "out");
  const Tensor src = cpu::dense(in);
  const cpu::DimSplit s = cpu::split_at(src.sizes(), dim);
  MN_CHECK(out.numel() == s.outer * idx.numel() * s.inner, ValueError, "index_select: output of shape ",
           out.sizes(), " cannot hold ", idx.numel(), " slices of input ", in.sizes(), " along dimension ",
           dim);
  if (out.numel() == 0) return;
  if (in.dtype() == DType::f32)
    return gather(src.data<float>(), idx.data<int64_t>(), idx.numel(), s, out.data<float>());
  gather(src.data<int64_t>(), idx.data<int64_t>(), idx.numel(), s, out.data<int64_t>());
}

template <class T>
void scatter_add(T* out, const int64_t* idx, int64_t count, const cpu::DimSplit& s, const T* src) {
  const int64_t tiles = (s.inner + kInnerTile - 1) / kInnerTile;
  const int team = parallel_team(s.outer * count * s.inner);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
  for (int64_t task = 0; task < s.outer * tiles; ++task) {
    const int64_t o = task / tiles, i0 = (task % tiles) * kInnerTile;
    const int64_t width = std::min(kInnerTile, s.inner - i0);
    for (int64_t j = 0; j < count; ++j) {
      T* to = out + (o * s.n + idx[j]) * s.inner + i0;
      const T* from = src + (o * count + j) * s.inner + i0;
      for (int64_t i = 0; i < width; ++i) to[i] += from[i];
    }
  }
}

void index_add_cpu(Tensor& out, int dim, const Tensor& index, const Tensor& src) {
  MN_CHECK(dim >= 0 && dim < std::max(out.dim(), 1), IndexError, "index_add: dim ", dim,
           " is out of range for shape ", out.sizes());
  const Tensor idx = checked_index("index_add", index, dim_size(out, dim), dim, out.sizes());
  if (out.dim() > 0) check_slices("index_add", out, src, dim, idx.numel(), "out", "src");
  if (src.numel() == 0) return;
  const Tensor values = cpu::dense(src);
  Tensor target = cpu::dense(out);  // accumulate into a dense copy when out is strided, then write back
  const cpu::DimSplit s = cpu::split_at(target.sizes(), dim);
  MN_CHECK(values.numel() == s.outer * idx.numel() * s.inner, ValueError, "index_add: src of shape ",
           src.sizes(), " does not hold ", idx.numel(), " slices of out ", out.sizes(), " along dimension ",
           dim);
  if (out.dtype() == DType::f32)
    scatter_add(target.data<float>(), idx.data<int64_t>(), idx.numel(), s, values.data<float>());
  else
    scatter_add(target.data<int64_t>(), idx.data<int64_t>(), idx.numel(), s, values.data<int64_t>());
  if (!target.same(out)) copy(out.device(), target, out);
}

}  // namespace

void register_cpu_index() {
  index_select.set(DeviceType::CPU, index_select_cpu);
  index_add.set(DeviceType::CPU, index_add_cpu);
}

}  // namespace mn::kernels
