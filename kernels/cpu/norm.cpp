// CPU row normalisation (layer norm and group norm, see RowNormLayout in kernels/kernels.h): the
// forward writes the output and each row's mean and rstd; the backward gives grad_x, grad_weight and
// grad_bias. Rows are spread over OpenMP threads; each row's sums run in a fixed order
// (cpu::ordered_sum), and the weight/bias gradients are summed per chunk of rows (chunks chosen
// from the shapes) and the chunks merged in order, in double: results do not depend on the thread
// count.
#include <omp.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "kernels/cpu/dim_layout.h"
#include "kernels/cpu/loops.h"
#include "kernels/kernels.h"
#include "kernels/norm_check.h"

namespace mn::kernels {
namespace {

using cpu::ordered_sum;

// Rows per chunk of the backward: about this many elements each.
constexpr int64_t kChunkElements = 32768;

Tensor dense_or_undefined(const Tensor& t) { return t.defined() ? cpu::dense(t) : t; }
const float* data_or_null(const Tensor& t) { return t.defined() ? t.data<float>() : nullptr; }

// Calls f(begin, len, channel, per_element) for the runs of row r that share an affine layout:
// the whole row when inner == 1 (element begin + i has channel `channel + i`, per_element true), else
// one run of `inner` values per channel (channel fixed, per_element false). Without affine parameters
// (affine false) the whole row is one run.
template <class F>
void for_each_affine_run(const RowNormLayout& s, bool affine, int64_t r, F&& f) {
  const int64_t per_group = s.row_len / s.inner;
  const int64_t first_channel = (r % s.groups) * per_group;
  if (!affine || s.inner == 1) return f(int64_t{0}, s.row_len, first_channel, std::true_type{});
  for (int64_t c = 0; c < per_group; ++c) f(c * s.inner, s.inner, first_channel + c, std::false_type{});
}

// Entry i of a run of f: the affine value of its channel, or `fallback` without parameters.
template <class PerElement>
inline float affine_at(const float* p, float fallback, int64_t channel, int64_t i, PerElement) {
  if (p == nullptr) return fallback;
  if constexpr (PerElement::value) return p[channel + i];
  return p[channel];
}

void row_norm_forward_cpu(const Tensor& x_in, const Tensor& weight, const Tensor& bias, const RowNormLayout& s,
                          double eps, Tensor& out, Tensor& mean, Tensor& rstd) {
  check_row_norm_layout(s, x_in, weight, "row_norm_forward");
  cpu::require_contiguous_output(out, "row_norm_forward", "out");
  cpu::require_contiguous_output(mean, "row_norm_forward", "mean");
  cpu::require_contiguous_output(rstd, "row_norm_forward", "rstd");
  const Tensor x = cpu::dense(x_in), w = dense_or_undefined(weight), b = dense_or_undefined(bias);
  const float* xp = x.data<float>();
  const float* wp = data_or_null(w);
  const float* bp = data_or_null(b);
  float* yp = out.data<float>();
  float* mp = mean.data<float>();
  float* rp = rstd.data<float>();
  const int64_t n = s.row_len;

  const int team = cpu::parallel_team(s.rows * n);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1 && s.rows > 1)
  for (int64_t r = 0; r < s.rows; ++r) {
    const float* row = xp + r * n;
    float* y = yp + r * n;
    // Two passes: the mean, then the mean squared deviation from it (no cancellation).
    const double m = ordered_sum(n, [row](int64_t i) { return row[i]; }) / static_cast<double>(n);
    const float mf = static_cast<float>(m);
    const double var = ordered_sum(n, [row, mf](int64_t i) {
                         const float d = row[i] - mf;
                         return d * d;
                       }) / static_cast<double>(n);
    const float k = static_cast<float>(1.0 / std::sqrt(var + eps));
    mp[r] = mf;
    rp[r] = k;
    const bool affine = wp != nullptr || bp != nullptr;
    for_each_affine_run(s, affine, r, [&](int64_t begin, int64_t len, int64_t channel, auto per) {
      for (int64_t i = 0; i < len; ++i) {
        const int64_t j = begin + i;
        y[j] = (row[j] - mf) * k * affine_at(wp, 1.0f, channel, i, per) + affine_at(bp, 0.0f, channel, i, per);
      }
    });
  }
}

void row_norm_backward_cpu(const Tensor& grad_out, const Tensor& x_in, const Tensor& weight, const Tensor& mean,
                           const Tensor& rstd, const RowNormLayout& s, Tensor& grad_x, Tensor& grad_weight,
                           Tensor& grad_bias) {
  check_row_norm_layout(s, x_in, weight, "row_norm_backward");
  if (grad_x.defined()) cpu::require_contiguous_output(grad_x, "row_norm_backward", "grad_x");
  if (grad_weight.defined()) cpu::require_contiguous_output(grad_weight, "row_norm_backward", "grad_weight");
  if (grad_bias.defined()) cpu::require_contiguous_output(grad_bias, "row_norm_backward", "grad_bias");
  const Tensor x = cpu::dense(x_in), g = cpu::dense(grad_out), w = dense_or_undefined(weight);
  const Tensor m = cpu::dense(mean), k = cpu::dense(rstd);
  const float* xp = x.data<float>();
  const float* gp = g.data<float>();
  const float* wp = data_or_null(w);
  const float* mp = m.data<float>();
  const float* kp = k.data<float>();
  float* gxp = grad_x.defined() ? grad_x.data<float>() : nullptr;
  const bool affine_grads = grad_weight.defined() || grad_bias.defined();
  const int64_t n = s.row_len, channels = s.channels(), per_group = n / s.inner;

  // Chunks of whole batch entries (groups rows each), so every chunk covers every channel alike.
  const int64_t batch = s.rows / s.groups;
  const int64_t chunk = std::max<int64_t>(1, kChunkElements / std::max<int64_t>(1, s.groups * n));
  const int64_t chunks = (batch + chunk - 1) / chunk;
  // Per chunk: [sum g * x_hat | sum g] for every channel.
  std::vector<float> partial(affine_grads ? static_cast<size_t>(chunks * 2 * channels) : 0, 0.0f);

  const int team = cpu::parallel_team(s.rows * n);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1 && chunks > 1)
  for (int64_t ch = 0; ch < chunks; ++ch) {
    float* pw = affine_grads ? partial.data() + ch * 2 * channels : nullptr;
    float* pb = affine_grads ? pw + channels : nullptr;
    const int64_t r_end = std::min(batch, (ch + 1) * chunk) * s.groups;
    for (int64_t r = ch * chunk * s.groups; r < r_end; ++r) {
      const float* xr = xp + r * n;
      const float* gr = gp + r * n;
      const float mr = mp[r], kr = kp[r];
      if (affine_grads) {
        const int64_t first_channel = (r % s.groups) * per_group;
        if (s.inner == 1) {
          for (int64_t j = 0; j < n; ++j) {
            pw[first_channel + j] += gr[j] * (xr[j] - mr) * kr;
            pb[first_channel + j] += gr[j];
          }
        } else {
          for (int64_t c = 0; c < per_group; ++c) {
            const float* gc = gr + c * s.inner;
            const float* xc = xr + c * s.inner;
            pw[first_channel + c] += static_cast<float>(
                ordered_sum(s.inner, [gc, xc, mr, kr](int64_t i) { return gc[i] * (xc[i] - mr) * kr; }));
            pb[first_channel + c] += static_cast<float>(ordered_sum(s.inner, [gc](int64_t i) { return gc[i]; }));
          }
        }
      }
      if (gxp == nullptr) continue;
      // grad_x = rstd * (dy - mean(dy) - x_hat * mean(dy * x_hat)), dy = g * weight.
      double sum_dy = 0, sum_dy_xhat = 0;
      for_each_affine_run(s, wp != nullptr, r, [&](int64_t begin, int64_t len, int64_t channel, auto per) {
        const float* gb = gr + begin;
        const float* xb = xr + begin;
        sum_dy += ordered_sum(len, [=](int64_t i) { return gb[i] * affine_at(wp, 1.0f, channel, i, per); });
        sum_dy_xhat += ordered_sum(len, [=](int64_t i) {
          return gb[i] * affine_at(wp, 1.0f, channel, i, per) * (xb[i] - mr) * kr;
        });
      });
      const float a = static_cast<float>(sum_dy / static_cast<double>(n));
      const float c2 = static_cast<float>(sum_dy_xhat / static_cast<double>(n));
      float* gx = gxp + r * n;
      for_each_affine_run(s, wp != nullptr, r, [&](int64_t begin, int64_t len, int64_t channel, auto per) {
        for (int64_t i = 0; i < len; ++i) {
          const int64_t j = begin + i;
          gx[j] = kr * (gr[j] * affine_at(wp, 1.0f, channel, i, per) - a - (xr[j] - mr) * kr * c2);
        }
      });
    }
  }

  if (!affine_grads) return;
  float* gw = grad_weight.defined() ? grad_weight.data<float>() : nullptr;
  float* gb = grad_bias.defined() ? grad_bias.data<float>() : nullptr;
  for (int64_t c = 0; c < channels; ++c) {
    double tw = 0, tb = 0;
    for (int64_t ch = 0; ch < chunks; ++ch) {
      tw += partial[static_cast<size_t>(ch * 2 * channels + c)];
      tb += partial[static_cast<size_t>(ch * 2 * channels + channels + c)];
    }
    if (gw != nullptr) gw[c] = static_cast<float>(tw);
    if (gb != nullptr) gb[c] = static_cast<float>(tb);
  }
}

}  // namespace

void register_cpu_norm() {
  row_norm_forward.set(DeviceType::CPU, row_norm_forward_cpu);
  row_norm_backward.set(DeviceType::CPU, row_norm_backward_cpu);
}

}  // namespace mn::kernels
