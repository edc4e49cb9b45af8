// CUDA batch norm over x [N, C, *] (trailing dims seen as [N, C, S]): forward in training mode (batch
// statistics, running-stat update) and eval mode (running statistics), and the backward of both.
// Twin of kernels/cpu/batch_norm.cpp.
//
// Per-channel sums go through the op table's reductions (kernels/cuda/reduce.cu) on [N, C, S] views
// with dim mask 0b101: they cut a long channel (N*S values) into pieces over many blocks and merge the
// pieces in order, in double, so a few channels still fill the device (one block per channel would
// leave most of it idle). Training forward: mean (reduce Mean) and biased variance (var, two passes
// in double); backward: sum(g) (reduce Sum) and sum(g * (x - mean)) (an elementwise product into a
// scratch buffer, then reduce Sum). A one-thread-per-channel kernel turns those sums into the saved
// statistics, the running-stat update and the coefficients of an elementwise pass. No atomics, and
// every split depends on the shapes only: reproducible run to run.
#include <cmath>

#include "kernels/cuda/compute_utils.cuh"

namespace mn::kernels {
namespace {

using cuda::kThreads;

struct Layout {
  int64_t batch, channels, inner;  // [N, C, S]
  int64_t count() const { return batch * inner; }
};

Layout layout_of(const Tensor& x) {
  MN_CHECK(x.dim() >= 2, ValueError, "batch_norm kernel: expected x [N, C, *], got ", x.sizes());
  return {x.size(0), x.size(1), x.numel() / std::max<int64_t>(1, x.size(0) * x.size(1))};
}

const float* data_or_null(const Tensor& t) { return t.defined() ? static_cast<const float*>(t.raw_data()) : nullptr; }
float* mutable_or_null(const Tensor& t) { return t.defined() ? static_cast<float*>(t.raw_data()) : nullptr; }

// The contiguous tensor t seen as [N, C, S].
Tensor channel_view(const Tensor& t, const Layout& s) {
  return make_view(t.storage(), {s.batch, s.channels, s.inner}, {s.channels * s.inner, s.inner, 1},
                   t.storage_offset(), DType::f32);
}

// Elements [k * C, (k + 1) * C) of the contiguous f32 buffer t, as a [C] tensor (a reduction's output).
Tensor channel_slot(const Tensor& t, int64_t channels, int64_t k) {
  return make_view(t.storage(), {channels}, {1}, t.storage_offset() + k * channels, DType::f32);
}

constexpr uint32_t kAllButChannels = 0b101;  // reduce N and S of [N, C, S]

// Per channel, from the mean and the biased variance (the batch's in training, the running ones in
// eval): save_mean / save_invstd, the running-stat update (training, when rm / rv are given; the
// running variance takes the unbiased n / (n - 1) variance) and out = x * scale[c] + shift[c].
__global__ void coefficients_kernel(int64_t channels, double count, const float* mean, const float* var,
                                    const float* w, const float* b, float* rm, float* rv, double momentum,
                                    double eps, float* save_mean, float* save_invstd, float* scale, float* shift) {
  MN_CUDA_KERNEL_LOOP(c, channels) {
    const double m = mean[c], v = var[c];
    const double invstd = 1.0 / sqrt(v + eps);
    if (rm != nullptr) rm[c] = static_cast<float>((1.0 - momentum) * rm[c] + momentum * m);
    if (rv != nullptr) rv[c] = static_cast<float>((1.0 - momentum) * rv[c] + momentum * v * count / (count - 1));
    save_mean[c] = static_cast<float>(m);
    save_invstd[c] = static_cast<float>(invstd);
    const double k = invstd * (w != nullptr ? w[c] : 1.0);
    scale[c] = static_cast<float>(k);
    shift[c] = static_cast<float>((b != nullptr ? b[c] : 0.0) - m * k);
  }
}

// The channel of element l of a contiguous [N, C, inner] tensor of `total` elements.
struct ChannelOf {
  cuda::Divider inner, channels;
  __device__ int64_t operator()(int64_t l) const { return channels.mod(inner.div(l)); }
};

ChannelOf channel_of(const Layout& s, int64_t total) {
  return {cuda::Divider(s.inner, total), cuda::Divider(s.channels, total)};
}

__global__ void normalize_kernel(const float* x, int64_t total, ChannelOf channel, const float* scale,
                                 const float* shift, float* out) {
  MN_CUDA_KERNEL_LOOP(l, total) {
    const int64_t c = channel(l);
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
  const Device device = x.device();
  cudaStream_t stream = cuda::stream_of(out);
  // [scale | shift | batch mean | batch variance]
  Tensor coeff = empty({4 * s.channels}, TensorOptions(DType::f32).with_device(device));
  float* scale = static_cast<float*>(coeff.raw_data());
  float* shift = scale + s.channels;
  const float* mean_p = rm;
  const float* var_p = rv;
  float* rm_update = nullptr;
  float* rv_update = nullptr;
  if (training) {
    const Tensor x3 = channel_view(x, s);
    Tensor batch_mean = channel_slot(coeff, s.channels, 2), batch_var = channel_slot(coeff, s.channels, 3);
    reduce(device, ReduceOp::Mean, x3, kAllButChannels, batch_mean, 0.0);
    var(device, x3, kAllButChannels, 0.0, batch_var);  // biased
    mean_p = static_cast<const float*>(batch_mean.raw_data());
    var_p = static_cast<const float*>(batch_var.raw_data());
    rm_update = rm;
    rv_update = rv;
  }
  coefficients_kernel<<<cuda::blocks_for(s.channels), kThreads, 0, stream>>>(
      s.channels, static_cast<double>(s.count()), mean_p, var_p, data_or_null(w), data_or_null(b), rm_update, rv_update,
      momentum, eps, static_cast<float*>(save_mean.raw_data()), static_cast<float*>(save_invstd.raw_data()), scale,
      shift);
  MN_CUDA_CHECK_LAUNCH();
  const int64_t total = x.numel();
  if (total == 0) return;
  normalize_kernel<<<cuda::blocks_for(total), kThreads, 0, stream>>>(static_cast<const float*>(x.raw_data()), total,
                                                                    channel_of(s, total), scale, shift,
                                                                    static_cast<float*>(out.raw_data()));
  MN_CUDA_CHECK_LAUNCH();
}

// centered[l] = g[l] * (x[l] - mean[c]), in float as the CPU twin forms it.
__global__ void centered_product_kernel(const float* g, const float* x, int64_t total, ChannelOf channel,
                                        const float* means, float* centered) {
  MN_CUDA_KERNEL_LOOP(l, total) {
    const int64_t c = channel(l);
    centered[l] = g[l] * (x[l] - means[c]);
  }
}

// Per channel, from sum(g) and sum(g * (x - mean)) (null when not needed): grad_bias, grad_weight =
// invstd * sum(g * (x - mean)), and the grad_x coefficients (k_scale, k_mean_g, k_centered).
__global__ void backward_coefficients_kernel(int64_t channels, double count, const float* sum_g,
                                             const float* sum_gc, const float* w, const float* invstds,
                                             bool training, float* gw, float* gb, float* k_scale, float* k_mean_g,
                                             float* k_centered) {
  MN_CUDA_KERNEL_LOOP(c, channels) {
    const double invstd = invstds[c];
    const double sg = sum_g != nullptr ? sum_g[c] : 0.0;
    const double sgc = sum_gc != nullptr ? sum_gc[c] : 0.0;
    if (gb != nullptr) gb[c] = static_cast<float>(sg);
    if (gw != nullptr) gw[c] = static_cast<float>(sgc * invstd);
    k_scale[c] = static_cast<float>(invstd * (w != nullptr ? w[c] : 1.0));
    k_mean_g[c] = training ? static_cast<float>(sg / count) : 0.0f;
    k_centered[c] = training ? static_cast<float>(invstd * invstd * sgc / count) : 0.0f;
  }
}

__global__ void backward_input_kernel(const float* g, const float* x, int64_t total, ChannelOf channel,
                                      const float* means, const float* k_scale, const float* k_mean_g,
                                      const float* k_centered, float* gx) {
  MN_CUDA_KERNEL_LOOP(l, total) {
    const int64_t c = channel(l);
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
  const Device device = x.device();
  cudaStream_t stream = cuda::stream_of(x);
  const int64_t total = x.numel();
  // [k_scale | k_mean_g | k_centered | sum(g) | sum(g * (x - mean))]
  Tensor coeff = empty({5 * s.channels}, TensorOptions(DType::f32).with_device(device));
  float* k_scale = static_cast<float*>(coeff.raw_data());
  float* k_mean_g = k_scale + s.channels;
  float* k_centered = k_mean_g + s.channels;
  const float* xp = static_cast<const float*>(x.raw_data());
  const float* gp = static_cast<const float*>(g.raw_data());
  const float* means = static_cast<const float*>(mean_t.raw_data());
  // The grad_x formula of training needs both sums; grad_bias needs sum(g), grad_weight the other.
  const bool input_sums = training && gx != nullptr;
  const float* sum_g = nullptr;
  const float* sum_gc = nullptr;
  if (gb != nullptr || input_sums) {
    Tensor out = channel_slot(coeff, s.channels, 3);
    reduce(device, ReduceOp::Sum, channel_view(g, s), kAllButChannels, out, 0.0);
    sum_g = static_cast<const float*>(out.raw_data());
  }
  if (gw != nullptr || input_sums) {
    // g * (x - mean) goes into grad_x's memory when there is one (it is overwritten below, after the
    // sums), else into a scratch buffer.
    const bool reuse_gx = gx != nullptr && grad_x.storage() != g.storage() && grad_x.storage() != x.storage();
    const Tensor centered = reuse_gx ? grad_x : empty(x.sizes(), TensorOptions(DType::f32).with_device(device));
    if (total > 0) {
      centered_product_kernel<<<cuda::blocks_for(total), kThreads, 0, stream>>>(
          gp, xp, total, channel_of(s, total), means, static_cast<float*>(centered.raw_data()));
      MN_CUDA_CHECK_LAUNCH();
    }
    Tensor out = channel_slot(coeff, s.channels, 4);
    reduce(device, ReduceOp::Sum, channel_view(centered, s), kAllButChannels, out, 0.0);
    sum_gc = static_cast<const float*>(out.raw_data());
  }
  backward_coefficients_kernel<<<cuda::blocks_for(s.channels), kThreads, 0, stream>>>(
      s.channels, static_cast<double>(s.count()), sum_g, sum_gc, data_or_null(w),
      static_cast<const float*>(invstd_t.raw_data()), training, gw, gb, k_scale, k_mean_g, k_centered);
  MN_CUDA_CHECK_LAUNCH();
  if (gx == nullptr || total == 0) return;
  backward_input_kernel<<<cuda::blocks_for(total), kThreads, 0, stream>>>(gp, xp, total, channel_of(s, total), means,
                                                                         k_scale, k_mean_g, k_centered, gx);
  MN_CUDA_CHECK_LAUNCH();
}

}  // namespace

void register_cuda_batch_norm() {
  batch_norm_forward.set(DeviceType::CUDA, &batch_norm_forward_cuda);
  batch_norm_backward.set(DeviceType::CUDA, &batch_norm_backward_cuda);
}

}  // namespace mn::kernels
