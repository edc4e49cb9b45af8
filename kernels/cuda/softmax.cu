// CUDA softmax / log-softmax along one dim with their backward, and the fused cross-entropy forward
// and backward. Twins of kernels/cpu/softmax.cpp.
//
// Inputs are made dense and seen as [outer, n, inner] around the dim. When inner == 1 each row is
// contiguous and one block of kThreads threads handles it (threads stride over the row, block
// reductions in a fixed tree); otherwise, and for short rows, one thread handles one (outer, inner)
// column and loops over the dim, so neighbouring threads read neighbouring memory. Max subtraction keeps exp in range.
// Cross-entropy targets are validated on the device first (IndexError naming the value and C).
#include <cmath>

#include "kernels/cuda/compute_utils.cuh"
#include "kernels/dim_split.h"

namespace mn::kernels {
namespace {

using cuda::kThreads;

// Rows up to this long are handled by one thread each (the column kernels with inner == 1).
constexpr int64_t kShortRow = 32;

void require_contiguous(const Tensor& t, const char* kernel, const char* arg) {
  MN_CHECK(t.is_contiguous(), ValueError, kernel, ": output '", arg, "' must be contiguous, got shape ", t.sizes(),
           " with strides ", t.strides());
}

__device__ inline float max_f(float a, float b) { return a > b ? a : b; }

// ---------------- softmax forward ----------------

__global__ void softmax_rows_kernel(const float* x, float* y, int64_t rows, int64_t n, bool log) {
  __shared__ float sh[kThreads];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* in = x + r * n;
    float* out = y + r * n;
    float m = -INFINITY;
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) m = max_f(m, in[k]);
    m = cuda::block_reduce(m, cuda::MaxOp{}, sh);
    float total = 0.0f;
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) total += expf(in[k] - m);
    total = cuda::block_reduce(total, cuda::AddOp{}, sh);
    if (log) {
      const float shift = m + logf(total);
      for (int64_t k = threadIdx.x; k < n; k += blockDim.x) out[k] = in[k] - shift;
    } else {
      const float scale = 1.0f / total;
      for (int64_t k = threadIdx.x; k < n; k += blockDim.x) out[k] = expf(in[k] - m) * scale;
    }
  }
}

__global__ void softmax_columns_kernel(const float* x, float* y, int64_t outer, int64_t n, int64_t inner, bool log) {
  const int64_t columns = outer * inner;
  MN_CUDA_KERNEL_LOOP(c, columns) {
    const int64_t o = c / inner, i = c % inner;
    const float* in = x + o * n * inner + i;
    float* out = y + o * n * inner + i;
    float m = in[0];
    for (int64_t k = 1; k < n; ++k) m = max_f(m, in[k * inner]);
    float total = 0.0f;
    for (int64_t k = 0; k < n; ++k) total += expf(in[k * inner] - m);
    if (log) {
      const float shift = m + logf(total);
      for (int64_t k = 0; k < n; ++k) out[k * inner] = in[k * inner] - shift;
    } else {
      const float scale = 1.0f / total;
      for (int64_t k = 0; k < n; ++k) out[k * inner] = expf(in[k * inner] - m) * scale;
    }
  }
}

void softmax_cuda(const Tensor& in, int dim, bool log, Tensor& out) {
  MN_CHECK(in.dtype() == DType::f32 && out.dtype() == DType::f32, TypeError, "softmax: expected f32, got ",
           in.dtype(), in.sizes());
  MN_CHECK(out.sizes() == in.sizes(), ValueError, "softmax: output shape ", out.sizes(), " differs from input ",
           in.sizes());
  require_contiguous(out, "softmax", "out");
  if (in.numel() == 0) return;
  const Tensor x = cuda::dense(in);
  const DimSplit s = split_at(x.sizes(), dim);
  cudaStream_t stream = cuda::stream_of(out);
  const float* xp = static_cast<const float*>(x.raw_data());
  float* yp = static_cast<float*>(out.raw_data());
  if (s.inner == 1 && s.n > kShortRow) {
    softmax_rows_kernel<<<cuda::grid_for_blocks(s.outer), kThreads, 0, stream>>>(xp, yp, s.outer, s.n, log);
  } else {
    softmax_columns_kernel<<<cuda::blocks_for(s.outer * s.inner), kThreads, 0, stream>>>(xp, yp, s.outer, s.n,
                                                                                         s.inner, log);
  }
  MN_CUDA_CHECK_LAUNCH();
}

// ---------------- softmax backward ----------------
// softmax:     grad_in = y * (g - sum(g * y))
// log_softmax: grad_in = g - exp(y) * sum(g)

__global__ void softmax_backward_rows_kernel(const float* g, const float* y, float* gi, int64_t rows, int64_t n,
                                             bool log) {
  __shared__ float sh[kThreads];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* gr = g + r * n;
    const float* yr = y + r * n;
    float* out = gi + r * n;
    float total = 0.0f;
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) total += log ? gr[k] : gr[k] * yr[k];
    total = cuda::block_reduce(total, cuda::AddOp{}, sh);
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x)
      out[k] = log ? gr[k] - expf(yr[k]) * total : yr[k] * (gr[k] - total);
  }
}

__global__ void softmax_backward_columns_kernel(const float* g, const float* y, float* gi, int64_t outer, int64_t n,
                                                int64_t inner, bool log) {
  const int64_t columns = outer * inner;
  MN_CUDA_KERNEL_LOOP(c, columns) {
    const int64_t base = (c / inner) * n * inner + c % inner;
    float total = 0.0f;
    for (int64_t k = 0; k < n; ++k) {
      const int64_t at = base + k * inner;
      total += log ? g[at] : g[at] * y[at];
    }
    for (int64_t k = 0; k < n; ++k) {
      const int64_t at = base + k * inner;
      gi[at] = log ? g[at] - expf(y[at]) * total : y[at] * (g[at] - total);
    }
  }
}

void softmax_backward_cuda(const Tensor& grad_out, const Tensor& out, int dim, bool log, Tensor& grad_in) {
  MN_CHECK(grad_out.sizes() == out.sizes() && grad_in.sizes() == out.sizes(), ValueError,
           "softmax_backward: shapes differ: grad_out ", grad_out.sizes(), ", out ", out.sizes(), ", grad_in ",
           grad_in.sizes());
  require_contiguous(grad_in, "softmax_backward", "grad_in");
  MN_CHECK(grad_out.dtype() == DType::f32 && out.dtype() == DType::f32 && grad_in.dtype() == DType::f32, TypeError,
           "softmax_backward: expected f32 tensors, got ", grad_out.dtype(), ", ", out.dtype(), ", ", grad_in.dtype());
  if (out.numel() == 0) return;
  const Tensor g = cuda::dense(grad_out), y = cuda::dense(out);
  const DimSplit s = split_at(y.sizes(), dim);
  cudaStream_t stream = cuda::stream_of(grad_in);
  const float* gp = static_cast<const float*>(g.raw_data());
  const float* yp = static_cast<const float*>(y.raw_data());
  float* gi = static_cast<float*>(grad_in.raw_data());
  if (s.inner == 1 && s.n > kShortRow) {
    softmax_backward_rows_kernel<<<cuda::grid_for_blocks(s.outer), kThreads, 0, stream>>>(gp, yp, gi, s.outer, s.n,
                                                                                          log);
  } else {
    softmax_backward_columns_kernel<<<cuda::blocks_for(s.outer * s.inner), kThreads, 0, stream>>>(
        gp, yp, gi, s.outer, s.n, s.inner, log);
  }
  MN_CUDA_CHECK_LAUNCH();
}

// ---------------- cross entropy ----------------

// Shapes, dtypes and devices (class weights, when defined, f32 [C]); with check_targets also the target
// values, which costs a stream synchronisation. The backward skips that scan although its kernel reads
// weight[target] when class weights are given: the forward already refused bad values of the very
// target, and autograd refuses one changed in place since (by its version), so the index is in range.
void check_cross_entropy_args(const char* op, const Tensor& logits, const Tensor& target, const Tensor& weight,
                              int64_t ignore_index, bool check_targets) {
  MN_CHECK(logits.dtype() == DType::f32 && logits.dim() == 2, ValueError, op, ": expected f32 logits [N, C], got ",
           logits.dtype(), logits.sizes());
  const int64_t rows = logits.sizes()[0], classes = logits.sizes()[1];
  MN_CHECK(classes > 0, ValueError, op, ": logits of shape ", logits.sizes(), " have no classes");
  MN_CHECK(target.dtype() == DType::i64 && target.dim() == 1 && target.sizes()[0] == rows, ValueError, op,
           ": expected target of shape [", rows, "] (i64 class indices) for logits of shape ", logits.sizes(),
           ", got ", target.dtype(), target.sizes());
  MN_CHECK(target.device().is_cuda(), ValueError, op, ": target must be on a CUDA device, got ",
           target.device().str());
  if (weight.defined()) {
    MN_CHECK(weight.dtype() == DType::f32 && weight.dim() == 1 && weight.sizes()[0] == classes, ValueError, op,
             ": expected f32 class weights of shape [", classes, "], got ", weight.dtype(), weight.sizes());
    MN_CHECK(weight.device() == logits.device(), ValueError, op, ": class weights must be on ",
             logits.device().str(), " (the logits' device), got ", weight.device().str());
  }
  if (!check_targets) return;
  int64_t value = 0;
  const int64_t pos = cuda::first_invalid_index(target, classes, true, ignore_index, &value);
  MN_CHECK(pos < 0, IndexError, op, ": target ", value, " at position ", pos, " is out of range for ", classes,
           " classes (logits of shape ", logits.sizes(), ")");
}

// weight == nullptr: every class weighs 1 (the smoothing term is then s * mean_c(-log p_c)).
__global__ void cross_entropy_kernel(const float* x, const int64_t* target, int64_t target_stride,
                                     const float* weight, int64_t rows, int64_t classes, double smoothing,
                                     int64_t ignore_index, float* loss, float* lse) {
  __shared__ float sh[kThreads];
  const double keep = 1.0 - smoothing;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* row = x + r * classes;
    float m = -INFINITY;
    for (int64_t k = threadIdx.x; k < classes; k += blockDim.x) m = max_f(m, row[k]);
    m = cuda::block_reduce(m, cuda::MaxOp{}, sh);
    // The smoothing sums are taken relative to the row's max: sum_c w_c (lse - x_c) is then
    // W log(total) - sum_c w_c (x_c - m), with no cancellation between two large terms when the
    // logits are large (W lse - sum_c w_c x_c loses the float digits the CPU's double keeps).
    float total = 0.0f, row_sum = 0.0f, weight_sum = 0.0f;
    for (int64_t k = threadIdx.x; k < classes; k += blockDim.x) {
      total += expf(row[k] - m);
      if (weight == nullptr) {
        row_sum += row[k] - m;
      } else {
        row_sum += weight[k] * (row[k] - m);
        weight_sum += weight[k];
      }
    }
    total = cuda::block_reduce(total, cuda::AddOp{}, sh);
    if (smoothing != 0.0) row_sum = cuda::block_reduce(row_sum, cuda::AddOp{}, sh);
    if (smoothing != 0.0 && weight != nullptr) weight_sum = cuda::block_reduce(weight_sum, cuda::AddOp{}, sh);
    if (threadIdx.x == 0) {
      const double log_total = log(static_cast<double>(total));  // lse - m
      const double log_sum_exp = static_cast<double>(m) + log_total;
      lse[r] = static_cast<float>(log_sum_exp);
      const int64_t t = target[r * target_stride];
      if (t == ignore_index) {
        loss[r] = 0.0f;
      } else if (weight == nullptr) {
        double value = keep * (log_sum_exp - row[t]);
        if (smoothing != 0.0)
          value += smoothing * (log_total - static_cast<double>(row_sum) / static_cast<double>(classes));
        loss[r] = static_cast<float>(value);
      } else {
        // sum_c w_c (lse - x_c) = W (lse - m) - sum_c w_c (x_c - m)
        double value = keep * weight[t] * (log_sum_exp - row[t]);
        if (smoothing != 0.0)
          value += smoothing / static_cast<double>(classes) *
                   (static_cast<double>(weight_sum) * log_total - static_cast<double>(row_sum));
        loss[r] = static_cast<float>(value);
      }
    }
  }
}

void cross_entropy_cuda(const Tensor& logits, const Tensor& target, const Tensor& weight, double smoothing,
                        int64_t ignore_index, Tensor& loss, Tensor& lse) {
  check_cross_entropy_args("cross_entropy", logits, target, weight, ignore_index, true);
  const int64_t rows = logits.sizes()[0], classes = logits.sizes()[1];
  MN_CHECK(loss.numel() == rows && lse.numel() == rows, ValueError, "cross_entropy: loss ", loss.sizes(), " and lse ",
           lse.sizes(), " must hold one value per row of logits ", logits.sizes());
  require_contiguous(loss, "cross_entropy", "loss");
  require_contiguous(lse, "cross_entropy", "lse");
  if (rows == 0) return;
  const Tensor x = cuda::dense(logits);
  const Tensor w = weight.defined() ? cuda::dense(weight) : Tensor();
  cross_entropy_kernel<<<cuda::grid_for_blocks(rows), kThreads, 0, cuda::stream_of(loss)>>>(
      static_cast<const float*>(x.raw_data()), static_cast<const int64_t*>(target.raw_data()), target.stride(0),
      w.defined() ? static_cast<const float*>(w.raw_data()) : nullptr, rows, classes, smoothing, ignore_index,
      static_cast<float*>(loss.raw_data()), static_cast<float*>(lse.raw_data()));
  MN_CUDA_CHECK_LAUNCH();
}

// out[0] = sum of the n class weights (one block), for the backward's smoothing coefficient.
__global__ void weight_total_kernel(const float* weight, int64_t n, float* out) {
  __shared__ float sh[kThreads];
  float total = 0.0f;
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) total += weight[k];
  total = cuda::block_reduce(total, cuda::AddOp{}, sh);
  if (threadIdx.x == 0) out[0] = total;
}

// weight == nullptr: all classes weigh 1 (weight_total is then unused).
__global__ void cross_entropy_backward_kernel(const float* grad_loss, const float* x, const int64_t* target,
                                              int64_t target_stride, const float* lse, const float* weight,
                                              const float* weight_total, int64_t rows, int64_t classes, float keep,
                                              float spread, int64_t ignore_index, float* out) {
  const int64_t total = rows * classes;
  MN_CUDA_KERNEL_LOOP(l, total) {
    const int64_t r = l / classes, c = l % classes;
    const int64_t t = target[r * target_stride];
    if (t == ignore_index) {
      out[l] = 0.0f;
      continue;
    }
    const float scale = grad_loss[r];
    float v;
    if (weight == nullptr) {
      v = scale * (expf(x[l] - lse[r]) - spread);
      if (c == t) v -= scale * keep;
    } else {
      const float target_weight = keep * weight[t];
      v = scale * (expf(x[l] - lse[r]) * (target_weight + spread * weight_total[0]) - spread * weight[c]);
      if (c == t) v -= scale * target_weight;
    }
    out[l] = v;
  }
}

void cross_entropy_backward_cuda(const Tensor& grad_loss, const Tensor& logits, const Tensor& target,
                                 const Tensor& weight, const Tensor& lse, double smoothing, int64_t ignore_index,
                                 Tensor& grad_logits) {
  check_cross_entropy_args("cross_entropy_backward", logits, target, weight, ignore_index, false);
  const int64_t rows = logits.sizes()[0], classes = logits.sizes()[1];
  MN_CHECK(grad_loss.numel() == rows && lse.numel() == rows && grad_logits.sizes() == logits.sizes(), ValueError,
           "cross_entropy_backward: grad_loss ", grad_loss.sizes(), ", lse ", lse.sizes(), " and grad_logits ",
           grad_logits.sizes(), " do not fit logits ", logits.sizes());
  require_contiguous(grad_logits, "cross_entropy_backward", "grad_logits");
  const int64_t total = rows * classes;
  if (total == 0) return;
  const Tensor x = cuda::dense(logits), g = cuda::dense(grad_loss), l = cuda::dense(lse);
  const Tensor w = weight.defined() ? cuda::dense(weight) : Tensor();
  // The weights' sum stays on the device (no host read): one single-block reduction on the same stream.
  Tensor w_total;
  if (w.defined()) {
    w_total = empty({1}, TensorOptions(DType::f32).with_device(grad_logits.device()));
    weight_total_kernel<<<1, kThreads, 0, cuda::stream_of(grad_logits)>>>(
        static_cast<const float*>(w.raw_data()), classes, static_cast<float*>(w_total.raw_data()));
    MN_CUDA_CHECK_LAUNCH();
  }
  const float keep = static_cast<float>(1.0 - smoothing);
  const float spread = static_cast<float>(smoothing / static_cast<double>(std::max<int64_t>(classes, 1)));
  cross_entropy_backward_kernel<<<cuda::blocks_for(total), kThreads, 0, cuda::stream_of(grad_logits)>>>(
      static_cast<const float*>(g.raw_data()), static_cast<const float*>(x.raw_data()),
      static_cast<const int64_t*>(target.raw_data()), target.stride(0), static_cast<const float*>(l.raw_data()),
      w.defined() ? static_cast<const float*>(w.raw_data()) : nullptr,
      w_total.defined() ? static_cast<const float*>(w_total.raw_data()) : nullptr, rows, classes, keep, spread,
      ignore_index, static_cast<float*>(grad_logits.raw_data()));
  MN_CUDA_CHECK_LAUNCH();
}

}  // namespace

void register_cuda_softmax() {
  softmax.set(DeviceType::CUDA, softmax_cuda);
  softmax_backward.set(DeviceType::CUDA, softmax_backward_cuda);
  cross_entropy_forward.set(DeviceType::CUDA, cross_entropy_cuda);
  cross_entropy_backward.set(DeviceType::CUDA, cross_entropy_backward_cuda);
}

}  // namespace mn::kernels
