// CPU kernels that walk whole lines along one dim: cumsum (a running sum per line, in double for f32
// as PyTorch's CPU kernel) and topk (a partial sort of each line's positions). Each line is one task.
#include <algorithm>
#include <numeric>
#include <vector>

#include "kernels/cpu/dim_layout.h"

namespace mn::kernels {
namespace {

using cpu::parallel_team;

template <class T, class Acc>
void cumsum_lines(const T* in, const DimSplit& s, bool reverse, T* out) {
  const int team = parallel_team(s.outer * s.n * s.inner);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
  for (int64_t line = 0; line < s.outer * s.inner; ++line) {
    const int64_t o = line / s.inner, i = line % s.inner;
    const int64_t base = o * s.n * s.inner + i;
    Acc acc = 0;
    for (int64_t t = 0; t < s.n; ++t) {
      const int64_t at = base + (reverse ? s.n - 1 - t : t) * s.inner;
      acc += static_cast<Acc>(in[at]);
      out[at] = static_cast<T>(acc);
    }
  }
}

void cumsum_cpu(const Tensor& in, int dim, bool reverse, Tensor& out) {
  MN_CHECK(dim >= 0 && dim < std::max(in.dim(), 1), IndexError, "cumsum: dim ", dim, " is out of range for shape ",
           in.sizes());
  cpu::require_contiguous_output(out, "cumsum", "out");
  MN_CHECK(out.sizes() == in.sizes() && out.dtype() == in.dtype(), ValueError, "cumsum: out ", out.dtype(),
           out.sizes(), " does not match input ", in.dtype(), in.sizes());
  if (in.numel() == 0) return;
  const Tensor src = cpu::dense(in);
  const DimSplit s = split_at(src.sizes(), in.dim() == 0 ? 0 : dim);
  if (in.dtype() == DType::f32) return cumsum_lines<float, double>(src.data<float>(), s, reverse, out.data<float>());
  cumsum_lines<int64_t, int64_t>(src.data<int64_t>(), s, reverse, out.data<int64_t>());
}

// a ranks before b when it is larger (largest) or smaller, NaN counting as above every number.
template <class T>
bool ranks_before(T a, T b, bool largest) {
  const bool a_nan = a != a, b_nan = b != b;
  if (a_nan || b_nan) return largest ? (a_nan && !b_nan) : (!a_nan && b_nan);
  return largest ? a > b : a < b;
}

template <class T>
void topk_lines(const T* in, const DimSplit& s, int64_t k, bool largest, T* values, int64_t* indices) {
  const int team = parallel_team(s.outer * s.n * s.inner);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
  for (int64_t line = 0; line < s.outer * s.inner; ++line) {
    const int64_t o = line / s.inner, i = line % s.inner;
    const T* src = in + o * s.n * s.inner + i;
    std::vector<int64_t> order(static_cast<size_t>(s.n));
    std::iota(order.begin(), order.end(), int64_t{0});
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
      const T va = src[a * s.inner], vb = src[b * s.inner];
      if (ranks_before(va, vb, largest)) return true;
      if (ranks_before(vb, va, largest)) return false;
      return a < b;
    });
    const int64_t base = o * k * s.inner + i;
    for (int64_t j = 0; j < k; ++j) {
      values[base + j * s.inner] = src[order[j] * s.inner];
      indices[base + j * s.inner] = order[j];
    }
  }
}

void topk_cpu(const Tensor& in, int dim, int64_t k, bool largest, Tensor& values, Tensor& indices) {
  MN_CHECK(dim >= 0 && dim < std::max(in.dim(), 1), IndexError, "topk: dim ", dim, " is out of range for shape ",
           in.sizes());
  const int64_t n = in.dim() == 0 ? 1 : in.size(dim);
  MN_CHECK(k >= 0 && k <= n, IndexError, "topk: k = ", k, " is out of range for dimension ", dim, " of size ", n);
  cpu::require_contiguous_output(values, "topk", "values");
  cpu::require_contiguous_output(indices, "topk", "indices");
  MN_CHECK(values.dtype() == in.dtype() && indices.dtype() == DType::i64, TypeError, "topk: expected values of ",
           in.dtype(), " and i64 indices, got ", values.dtype(), " and ", indices.dtype());
  if (values.numel() == 0) return;
  const Tensor src = cpu::dense(in);
  const DimSplit s = split_at(src.sizes(), in.dim() == 0 ? 0 : dim);
  MN_CHECK(values.numel() == s.outer * k * s.inner && indices.numel() == values.numel(), ValueError,
           "topk: outputs of shape ", values.sizes(), " cannot hold ", k, " entries of input ", in.sizes(),
           " along dimension ", dim);
  if (in.dtype() == DType::f32)
    return topk_lines(src.data<float>(), s, k, largest, values.data<float>(), indices.data<int64_t>());
  topk_lines(src.data<int64_t>(), s, k, largest, values.data<int64_t>(), indices.data<int64_t>());
}

}  // namespace

void register_cpu_scan() {
  cumsum.set(DeviceType::CPU, cumsum_cpu);
  topk.set(DeviceType::CPU, topk_cpu);
}

}  // namespace mn::kernels
