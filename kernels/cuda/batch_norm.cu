// CUDA batch norm over x [N, C, *] (trailing dims seen as [N, C, S]): forward in training mode (batch
// statistics, running-stat update) and eval mode (running statistics), and the backward of both.
// Twin of kernels/cpu/batch_norm.cpp. Per-channel sums run in one block per channel (threads stride
// over the channel's N*S values, double accumulation, a fixed shared-memory tree), and write per-channel
// coefficients; a second, elementwise kernel applies them. No atomics: reproducible run to run.
#include <cmath>

#include "kernels/cuda/compute_utils.cuh"

namespace mn::kernels {
namespace {

using cuda::kThreads;

struct Layout {
  int64_t batch, channels, inner;  // [N, C, S]
  __host__ __device__ int64_t count() const { return batch * inner; }
  // element l of channel c's values (l = n * S + i)
  __host__ __device__ int64_t at(int64_t c, int64_t l) const { return ((l / inner) * channels + c) * inner + l % inner; }
};

Layout layout_of(const Tensor& x) {
  MN_CHECK(x.dim() >= 2, ValueError, "batch_norm kernel: expected x [N, C, *], got ", x.sizes());
  return {x.size(0), x.size(1), x.numel() / std::max<int64_t>(1, x.size(0) * x.size(1))};
}

const float* data_or_null(const Tensor& t) { return t.defined() ? static_cast<const float*>(t.raw_data()) : nullptr; }
float* mutable_or_null(const Tensor& t) { return t.defined() ? static_cast<float*>(t.raw_data()) : nullptr; }

// Training statistics of each channel; writes save_mean / save_invstd, updates the running stats and
// stores out = x * scale[c] + shift[c] coefficients.
__global__ void batch_stats_kernel(const float* x, Layout s, const float* w, const float* b, float* rm, float* rv,
                                   double momentum, double eps, float* save_mean, float* save_invstd, float* scale,
                                   float* shift) {
  __shared__ double sh[kThreads];
  const int64_t count = s.count();
  const double n = static_cast<double>(count);
  for (int64_t c = blockIdx.x; c < s.channels; c += gridDim.x) {
    double total = 0.0;
    for (int64_t l = threadIdx.x; l < count; l += blockDim.x) total += static_cast<double>(x[s.at(c, l)]);
    total = cuda::block_reduce(total, cuda::AddOp{}, sh);
    const double mean = total / n;
    const float mean_f = static_cast<float>(mean);
    double squares = 0.0;
    for (int64_t l = threadIdx.x; l < count; l += blockDim.x) {
      const float d = x[s.at(c, l)] - mean_f;
      squares += static_cast<double>(d * d);
    }
    squares = cuda::block_reduce(squares, cuda::AddOp{}, sh);
    if (threadIdx.x == 0) {
      const double var = squares / n;
      const double invstd = 1.0 / sqrt(var + eps);
      if (rm != nullptr) rm[c] = static_cast<float>((1.0 - momentum) * rm[c] + momentum * mean);
      if (rv != nullptr) rv[c] = static_cast<float>((1.0 - momentum) * rv[c] + momentum * var * n / (n - 1));
      save_mean[c] = mean_f;
      save_invstd[c] = static_cast<float>(invstd);
      const double k = invstd * (w != nullptr ? w[c] : 1.0);
      scale[c] = static_cast<float>(k);
      shift[c] = static_cast<float>((b != nullptr ? b[c] : 0.0) - mean * k);
    }
  }
}

// Eval: running statistics.
__global__ void running_stats_kernel(int64_t channels, const float* w, const float* b, const float* rm,
                                     const float* rv, double eps, float* save_mean, float* save_invstd, float* scale,
                                     float* shift) {
  MN_CUDA_KERNEL_LOOP(c, channels) {
    const double mean = rm[c];
    const double invstd = 1.0 / sqrt(static_cast<double>(rv[c]) + eps);
    save_mean[c] = static_cast<float>(mean);
    save_invstd[c] = static_cast<float>(invstd);
    const double k = invstd * (w != nullptr ? w[c] : 1.0);
    scale[c] = static_cast<float>(k);
    shift[c] = static_cast<float>((b != nullptr ? b[c] : 0.0) - mean * k);
  }
}

__global__ void normalize_kernel(const float* x, int64_t total, int64_t channels, int64_t inner, const float* scale,
                                 const float* shift, float* out) {
  MN_CUDA_KERNEL_LOOP(l, total) {
    const int64_t c = (l / inner) % channels;
    out[l] = x[l] * scale[c] + shift[c];
  }
}

void batch_norm_forward_cuda(const Tensor& x_in, const Tensor& weight, const Tensor& bias, Tensor& running_mean,
                             Tensor& running_var, bool training, double momentum, double eps, Tensor& out,
                             Tensor& save_mean, Tensor& save_invstd) {
  const Layout s = layout_of(x_in);
  MN_CHECK(out.is_contiguous() && save_mean.is_contiguous() && save_invstd.is_contiguous(), ValueError,
           "batch_norm kernel: outputs must be contiguous");
  MN_CHECK(!training || s.count() > 1, ValueError,
           "batch_norm: expected more than 1 value per channel when training, got input of shape ", x_in.sizes());
  float* rm = mutable_or_null(running_mean);
  float* rv = mutable_or_null(running_var);
  MN_CHECK(training || (rm != nullptr && rv != nullptr), ValueError,
           "batch_norm: running_mean and running_var must be defined in evaluation mode");
  MN_CHECK((rm == nullptr || running_mean.is_contiguous()) && (rv == nullptr || running_var.is_contiguous()),
           ValueError, "batch_norm kernel: running statistics must be contiguous");
  if (s.channels == 0) return;
  const Tensor x = cuda::dense(x_in), w = cuda::dense(weight), b = cuda::dense(bias);
  cudaStream_t stream = cuda::stream_of(out);
  Tensor coeff = empty({2 * s.channels}, TensorOptions(DType::f32).with_device(x.device()));
  float* scale = static_cast<float*>(coeff.raw_data());
  float* shift = scale + s.channels;
  float* mean_out = static_cast<float*>(save_mean.raw_data());
  float* invstd_out = static_cast<float*>(save_invstd.raw_data());
  if (training) {
    batch_stats_kernel<<<cuda::grid_for_blocks(s.channels), kThreads, 0, stream>>>(
        static_cast<const float*>(x.raw_data()), s, data_or_null(w), data_or_null(b), rm, rv, momentum, eps, mean_out,
        invstd_out, scale, shift);
  } else {
    running_stats_kernel<<<cuda::blocks_for(s.channels), kThreads, 0, stream>>>(
        s.channels, data_or_null(w), data_or_null(b), rm, rv, eps, mean_out, invstd_out, scale, shift);
  }
  MN_CUDA_CHECK_LAUNCH();
  const int64_t total = x.numel();
  if (total == 0) return;
  normalize_kernel<<<cuda::blocks_for(total), kThreads, 0, stream>>>(static_cast<const float*>(x.raw_data()), total,
                                                                    s.channels, s.inner, scale, shift,
                                                                    static_cast<float*>(out.raw_data()));
  MN_CUDA_CHECK_LAUNCH();
}

// Per channel: grad_bias = sum(g), grad_weight = invstd * sum(g * (x - mean)), and the grad_x
// coefficients (k_scale, k_mean_g, k_centered).
__global__ void backward_sums_kernel(const float* g, const float* x, Layout s, const float* w, const float* means,
                                     const float* invstds, bool training, float* gw, float* gb, float* k_scale,
                                     float* k_mean_g, float* k_centered) {
  __shared__ double sh[kThreads];
  const int64_t count = s.count();
  const double n = static_cast<double>(count);
  for (int64_t c = blockIdx.x; c < s.channels; c += gridDim.x) {
    const float mean = means[c];
    double sum_g = 0.0, sum_gc = 0.0;
    for (int64_t l = threadIdx.x; l < count; l += blockDim.x) {
      const int64_t at = s.at(c, l);
      sum_g += static_cast<double>(g[at]);
      sum_gc += static_cast<double>(g[at] * (x[at] - mean));
    }
    sum_g = cuda::block_reduce(sum_g, cuda::AddOp{}, sh);
    sum_gc = cuda::block_reduce(sum_gc, cuda::AddOp{}, sh);
    if (threadIdx.x == 0) {
      const double invstd = invstds[c];
      if (gb != nullptr) gb[c] = static_cast<float>(sum_g);
      if (gw != nullptr) gw[c] = static_cast<float>(sum_gc * invstd);
      k_scale[c] = static_cast<float>(invstd * (w != nullptr ? w[c] : 1.0));
      k_mean_g[c] = training ? static_cast<float>(sum_g / n) : 0.0f;
      k_centered[c] = training ? static_cast<float>(invstd * invstd * sum_gc / n) : 0.0f;
    }
  }
}

__global__ void backward_input_kernel(const float* g, const float* x, int64_t total, int64_t channels, int64_t inner,
                                      const float* means, const float* k_scale, const float* k_mean_g,
                                      const float* k_centered, float* gx) {
  MN_CUDA_KERNEL_LOOP(l, total) {
    const int64_t c = (l / inner) % channels;
    gx[l] = k_scale[c] * (g[l] - k_mean_g[c] - (x[l] - means[c]) * k_centered[c]);
  }
}

void batch_norm_backward_cuda(const Tensor& grad_out, const Tensor& x_in, const Tensor& weight,
                              const Tensor& save_mean, const Tensor& save_invstd, bool training, Tensor& grad_x,
                              Tensor& grad_weight, Tensor& grad_bias) {
  const Layout s = layout_of(x_in);
  float* gx = mutable_or_null(grad_x);
  float* gw = mutable_or_null(grad_weight);
  float* gb = mutable_or_null(grad_bias);
  MN_CHECK((!gx || grad_x.is_contiguous()) && (!gw || grad_weight.is_contiguous()) &&
               (!gb || grad_bias.is_contiguous()),
           ValueError, "batch_norm backward: gradient outputs must be contiguous");
  if (s.channels == 0) return;
  const Tensor x = cuda::dense(x_in), g = cuda::dense(grad_out), w = cuda::dense(weight);
  const Tensor mean_t = cuda::dense(save_mean), invstd_t = cuda::dense(save_invstd);
  cudaStream_t stream = cuda::stream_of(x);
  Tensor coeff = empty({3 * s.channels}, TensorOptions(DType::f32).with_device(x.device()));
  float* k_scale = static_cast<float*>(coeff.raw_data());
  float* k_mean_g = k_scale + s.channels;
  float* k_centered = k_mean_g + s.channels;
  const float* xp = static_cast<const float*>(x.raw_data());
  const float* gp = static_cast<const float*>(g.raw_data());
  const float* means = static_cast<const float*>(mean_t.raw_data());
  backward_sums_kernel<<<cuda::grid_for_blocks(s.channels), kThreads, 0, stream>>>(
      gp, xp, s, data_or_null(w), means, static_cast<const float*>(invstd_t.raw_data()), training, gw, gb, k_scale,
      k_mean_g, k_centered);
  MN_CUDA_CHECK_LAUNCH();
  const int64_t total = x.numel();
  if (gx == nullptr || total == 0) return;
  backward_input_kernel<<<cuda::blocks_for(total), kThreads, 0, stream>>>(gp, xp, total, s.channels, s.inner, means,
                                                                         k_scale, k_mean_g, k_centered, gx);
  MN_CUDA_CHECK_LAUNCH();
}

}  // namespace

void register_cuda_batch_norm() {
  batch_norm_forward.set(DeviceType::CUDA, &batch_norm_forward_cuda);
  batch_norm_backward.set(DeviceType::CUDA, &batch_norm_backward_cuda);
}

}  // namespace mn::kernels
