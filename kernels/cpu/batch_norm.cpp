// CPU batch norm over x [N, C, *] (any trailing dims, seen as [N, C, S]): forward in training mode
// (batch statistics) and eval mode (running statistics), and the backward of both. Channels are
// spread over OpenMP threads; each channel's sums run in a fixed order (16 float lanes per
// contiguous run, combined in double), so results do not depend on the thread count.
#include <omp.h>

#include <cmath>

#include "kernels/cpu/loops.h"
#include "kernels/kernels.h"

namespace mn::kernels {
namespace {

using cpu::ordered_sum;

constexpr int64_t kParallelWork = 32768;

struct ChannelLayout {
  int64_t batch, channels, inner;  // [N, C, S]
  int64_t count() const { return batch * inner; }
  int64_t offset(int64_t n, int64_t c) const { return (n * channels + c) * inner; }
};

ChannelLayout layout_of(const Tensor& x) {
  MN_CHECK(x.dim() >= 2, ValueError, "batch_norm kernel: expected x [N, C, *], got ", x.sizes());
  return {x.size(0), x.size(1), x.numel() / std::max<int64_t>(1, x.size(0) * x.size(1))};
}

Tensor dense(const Tensor& t) {
  if (!t.defined() || t.is_contiguous()) return t;
  Tensor out = empty(t.sizes(), TensorOptions(t.dtype()));
  copy(kCPU, t, out);
  return out;
}

const float* data_or_null(const Tensor& t) { return t.defined() ? t.data<float>() : nullptr; }

template <class F>
void for_each_channel(const ChannelLayout& s, F&& f) {
  const int team = cpu::parallel_team(s.channels * s.count(), kParallelWork);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1 && s.channels > 1)
  for (int64_t c = 0; c < s.channels; ++c) f(c);
}

void batch_norm_forward_cpu(const Tensor& x_in, const Tensor& weight, const Tensor& bias, Tensor& running_mean,
                            Tensor& running_var, bool training, double momentum, double eps, Tensor& out,
                            Tensor& save_mean, Tensor& save_invstd) {
  const ChannelLayout s = layout_of(x_in);
  MN_CHECK(out.is_contiguous() && save_mean.is_contiguous() && save_invstd.is_contiguous(), ValueError,
           "batch_norm kernel: outputs must be contiguous");
  MN_CHECK(!training || s.count() > 1, ValueError,
           "batch_norm: expected more than 1 value per channel when training, got input of shape ", x_in.sizes());
  const Tensor x = dense(x_in), w = dense(weight), b = dense(bias);
  const float* xp = x.data<float>();
  const float* wp = data_or_null(w);
  const float* bp = data_or_null(b);
  float* rm = running_mean.defined() ? running_mean.data<float>() : nullptr;
  float* rv = running_var.defined() ? running_var.data<float>() : nullptr;
  MN_CHECK(training || (rm != nullptr && rv != nullptr), ValueError,
           "batch_norm: running_mean and running_var must be defined in evaluation mode");
  float* op = out.data<float>();
  float* mean_out = save_mean.data<float>();
  float* invstd_out = save_invstd.data<float>();
  const double count = static_cast<double>(s.count());

  for_each_channel(s, [&](int64_t c) {
    double mean, invstd;
    if (training) {
      double total = 0;
      for (int64_t n = 0; n < s.batch; ++n) {
        const float* row = xp + s.offset(n, c);
        total += ordered_sum(s.inner, [row](int64_t i) { return row[i]; });
      }
      mean = total / count;
      const float mean_f = static_cast<float>(mean);
      double squares = 0;
      for (int64_t n = 0; n < s.batch; ++n) {
        const float* row = xp + s.offset(n, c);
        squares += ordered_sum(s.inner, [row, mean_f](int64_t i) {
          const float d = row[i] - mean_f;
          return d * d;
        });
      }
      const double var = squares / count;
      invstd = 1.0 / std::sqrt(var + eps);
      if (rm != nullptr) rm[c] = static_cast<float>((1.0 - momentum) * rm[c] + momentum * mean);
      if (rv != nullptr) rv[c] = static_cast<float>((1.0 - momentum) * rv[c] + momentum * var * count / (count - 1));
    } else {
      mean = rm[c];
      invstd = 1.0 / std::sqrt(static_cast<double>(rv[c]) + eps);
    }
    mean_out[c] = static_cast<float>(mean);
    invstd_out[c] = static_cast<float>(invstd);
    // out = x * scale + shift
    const double scale = invstd * (wp != nullptr ? wp[c] : 1.0);
    const float scale_f = static_cast<float>(scale);
    const float shift_f = static_cast<float>((bp != nullptr ? bp[c] : 0.0) - mean * scale);
    for (int64_t n = 0; n < s.batch; ++n) {
      const float* src = xp + s.offset(n, c);
      float* dst = op + s.offset(n, c);
      for (int64_t i = 0; i < s.inner; ++i) dst[i] = src[i] * scale_f + shift_f;
    }
  });
}

void batch_norm_backward_cpu(const Tensor& grad_out, const Tensor& x_in, const Tensor& weight,
                             const Tensor& save_mean, const Tensor& save_invstd, bool training, Tensor& grad_x,
                             Tensor& grad_weight, Tensor& grad_bias) {
  const ChannelLayout s = layout_of(x_in);
  const Tensor x = dense(x_in), g = dense(grad_out), w = dense(weight);
  const Tensor mean_t = dense(save_mean), invstd_t = dense(save_invstd);
  const float* xp = x.data<float>();
  const float* gp = g.data<float>();
  const float* wp = data_or_null(w);
  const float* means = mean_t.data<float>();
  const float* invstds = invstd_t.data<float>();
  float* gx = grad_x.defined() ? grad_x.data<float>() : nullptr;
  float* gw = grad_weight.defined() ? grad_weight.data<float>() : nullptr;
  float* gb = grad_bias.defined() ? grad_bias.data<float>() : nullptr;
  MN_CHECK((!gx || grad_x.is_contiguous()) && (!gw || grad_weight.is_contiguous()) &&
               (!gb || grad_bias.is_contiguous()),
           ValueError, "batch_norm backward: gradient outputs must be contiguous");
  const double count = static_cast<double>(s.count());

  for_each_channel(s, [&](int64_t c) {
    const float mean = means[c];
    const double invstd = invstds[c];
    double sum_g = 0, sum_g_centered = 0;
    for (int64_t n = 0; n < s.batch; ++n) {
      const float* gr = gp + s.offset(n, c);
      const float* xr = xp + s.offset(n, c);
      sum_g += ordered_sum(s.inner, [gr](int64_t i) { return gr[i]; });
      sum_g_centered += ordered_sum(s.inner, [gr, xr, mean](int64_t i) { return gr[i] * (xr[i] - mean); });
    }
    if (gb != nullptr) gb[c] = static_cast<float>(sum_g);
    if (gw != nullptr) gw[c] = static_cast<float>(sum_g_centered * invstd);
    if (gx == nullptr) return;
    const double scale = invstd * (wp != nullptr ? wp[c] : 1.0);
    // Training: dx = scale * (g - mean(g) - (x - mean) * invstd^2 * mean(g * (x - mean))); the batch
    // statistics depend on x. Eval: dx = scale * g.
    const float k_scale = static_cast<float>(scale);
    const float k_mean_g = training ? static_cast<float>(sum_g / count) : 0.0f;
    const float k_centered = training ? static_cast<float>(invstd * invstd * sum_g_centered / count) : 0.0f;
    for (int64_t n = 0; n < s.batch; ++n) {
      const float* gr = gp + s.offset(n, c);
      const float* xr = xp + s.offset(n, c);
      float* dst = gx + s.offset(n, c);
      for (int64_t i = 0; i < s.inner; ++i) dst[i] = k_scale * (gr[i] - k_mean_g - (xr[i] - mean) * k_centered);
    }
  });
}

}  // namespace

void register_cpu_batch_norm() {
  batch_norm_forward.set(DeviceType::CPU, &batch_norm_forward_cpu);
  batch_norm_backward.set(DeviceType::CPU, &batch_norm_backward_cpu);
}

}  // namespace mn::kernels
