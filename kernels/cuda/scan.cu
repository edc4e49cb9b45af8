// CUDA cumsum and topk along one dim. Twins of kernels/cpu/scan.cpp.
//   * cumsum: one thread per line runs the sum in the CPU's order and precision (double for f32), so
//     both backends give the same bits.
//   * topk: one thread per input element counts the entries of its line that rank before it (larger,
//     or smaller, NaN above every number, ties by lower position: the CPU's order); an element of
//     rank r < k writes output r. O(n^2) comparisons per line of n, without sorting or shared memory:
//     meant for the lines of classification outputs and attention scores (up to a few thousand).
#include "kernels/cuda/compute_utils.cuh"
#include "kernels/dim_split.h"

namespace mn::kernels {
namespace {

using cuda::kThreads;

template <class T, class Acc>
__global__ void cumsum_kernel(const T* in, int64_t n, int64_t inner, int64_t lines, bool reverse, T* out) {
  MN_CUDA_KERNEL_LOOP(line, lines) {
    const int64_t o = line / inner, i = line - o * inner;
    const int64_t base = o * n * inner + i;
    Acc acc = 0;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t at = base + (reverse ? n - 1 - t : t) * inner;
      acc += static_cast<Acc>(in[at]);
      out[at] = static_cast<T>(acc);
    }
  }
}

void cumsum_cuda(const Tensor& in, int dim, bool reverse, Tensor& out) {
  MN_CHECK(in.device().is_cuda(), DeviceError, "cumsum: expected 'input' on a CUDA device, got ", in.device());
  cuda::check_on_device("cumsum", out, in.device().index, "out");
  MN_CHECK(dim >= 0 && dim < std::max(in.dim(), 1), IndexError, "cumsum: dim ", dim, " is out of range for shape ",
           in.sizes());
  MN_CHECK(out.is_contiguous() && out.sizes() == in.sizes() && out.dtype() == in.dtype(), ValueError,
           "cumsum: out ", out.dtype(), out.sizes(), " must be contiguous and match input ", in.dtype(), in.sizes());
  if (in.numel() == 0) return;
  const Tensor src = cuda::dense(in);
  const DimSplit s = split_at(src.sizes(), in.dim() == 0 ? 0 : dim);
  const int64_t lines = s.outer * s.inner;
  cudaStream_t stream = cuda::stream_of(out);
  if (in.dtype() == DType::f32)
    cumsum_kernel<float, double><<<cuda::blocks_for(lines), kThreads, 0, stream>>>(
        static_cast<const float*>(src.raw_data()), s.n, s.inner, lines, reverse, static_cast<float*>(out.raw_data()));
  else
    cumsum_kernel<int64_t, int64_t><<<cuda::blocks_for(lines), kThreads, 0, stream>>>(
        static_cast<const int64_t*>(src.raw_data()), s.n, s.inner, lines, reverse,
        static_cast<int64_t*>(out.raw_data()));
  MN_CUDA_CHECK_LAUNCH();
}

template <class T>
__device__ inline bool ranks_before(T a, T b, bool largest) {
  const bool a_nan = a != a, b_nan = b != b;
  if (a_nan || b_nan) return largest ? (a_nan && !b_nan) : (!a_nan && b_nan);
  return largest ? a > b : a < b;
}

constexpr int64_t kMaxTopkLine = 65536;

template <class T>
__global__ void topk_kernel(const T* in, int64_t n, int64_t inner, int64_t total, int64_t k, bool largest, T* values,
                            int64_t* indices) {
  MN_CUDA_KERNEL_LOOP(l, total) {
    // l = (o * n + j) * inner + i
    const int64_t i = l % inner, t = l / inner;
    const int64_t o = t / n, j = t - o * n;
    const T* line = in + o * n * inner + i;
    const T v = line[j * inner];
    int64_t rank = 0;
    for (int64_t m = 0; m < n && rank < k; ++m) {
      const T u = line[m * inner];
      if (ranks_before(u, v, largest) || (m < j && !ranks_before(v, u, largest))) ++rank;
    }
    if (rank < k) {
      values[(o * k + rank) * inner + i] = v;
      indices[(o * k + rank) * inner + i] = j;
    }
  }
}

void topk_cuda(const Tensor& in, int dim, int64_t k, bool largest, Tensor& values, Tensor& indices) {
  MN_CHECK(in.device().is_cuda(), DeviceError, "topk: expected 'input' on a CUDA device, got ", in.device());
  cuda::check_on_device("topk", values, in.device().index, "values");
  cuda::check_on_device("topk", indices, in.device().index, "indices");
  MN_CHECK(dim >= 0 && dim < std::max(in.dim(), 1), IndexError, "topk: dim ", dim, " is out of range for shape ",
           in.sizes());
  const int64_t n = in.dim() == 0 ? 1 : in.size(dim);
  MN_CHECK(k >= 0 && k <= n, IndexError, "topk: k = ", k, " is out of range for dimension ", dim, " of size ", n);
  // Each entry ranks itself against its line (up to n comparisons per thread; a sorted line reaches
  // that bound), so lines are capped where that stays cheap, instead of stalling on a huge one.
  MN_CHECK(n <= kMaxTopkLine, NotImplementedError, "topk on CUDA takes lines of at most ", kMaxTopkLine,
           " entries, got ", n, " along dimension ", dim, " of shape ", in.sizes(),
           " (run it on the CPU, or split the line)");
  MN_CHECK(values.is_contiguous() && indices.is_contiguous(), ValueError, "topk: outputs must be contiguous");
  MN_CHECK(values.dtype() == in.dtype() && indices.dtype() == DType::i64, TypeError, "topk: expected values of ",
           in.dtype(), " and i64 indices, got ", values.dtype(), " and ", indices.dtype());
  if (values.numel() == 0) return;
  const Tensor src = cuda::dense(in);
  const DimSplit s = split_at(src.sizes(), in.dim() == 0 ? 0 : dim);
  MN_CHECK(values.numel() == s.outer * k * s.inner && indices.numel() == values.numel(), ValueError,
           "topk: outputs of shape ", values.sizes(), " cannot hold ", k, " entries of input ", in.sizes(),
           " along dimension ", dim);
  const int64_t total = src.numel();
  cudaStream_t stream = cuda::stream_of(values);
  int64_t* ip = static_cast<int64_t*>(indices.raw_data());
  if (in.dtype() == DType::f32)
    topk_kernel<float><<<cuda::blocks_for(total), kThreads, 0, stream>>>(
        static_cast<const float*>(src.raw_data()), s.n, s.inner, total, k, largest,
        static_cast<float*>(values.raw_data()), ip);
  else
    topk_kernel<int64_t><<<cuda::blocks_for(total), kThreads, 0, stream>>>(
        static_cast<const int64_t*>(src.raw_data()), s.n, s.inner, total, k, largest,
        static_cast<int64_t*>(values.raw_data()), ip);
  MN_CUDA_CHECK_LAUNCH();
}

}  // namespace

void register_cuda_scan() {
  cumsum.set(DeviceType::CUDA, cumsum_cuda);
  topk.set(DeviceType::CUDA, topk_cuda);
}

}  // namespace mn::kernels
