// CPU adaptive average and max pooling (NCHW): output (i, j) of an OH x OW grid covers rows
// floor(i*H/OH) .. ceil((i+1)*H/OH) - 1 and the columns alike, PyTorch's windows (neighbouring windows
// overlap when the sizes do not divide). Planes are spread over OpenMP threads; each output and each
// input pixel of the backward pass is summed by one thread in (oy, ox) order.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/dim_layout.h"
#include "kernels/adaptive_pool_shape.h"

namespace mn::kernels {
namespace {

template <class F>
void for_each_plane(int64_t planes, int64_t work, F&& f) {
  const int team = cpu::parallel_team(planes * work);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1 && planes > 1)
  for (int64_t i = 0; i < planes; ++i) f(i);
}

void adaptive_avg_pool2d_forward_cpu(const Tensor& x, Tensor& out) {
  const AdaptivePlanes s = adaptive_planes(x.sizes(), out.sizes(), "adaptive_avg_pool2d");
  cpu::require_contiguous_output(out, "adaptive_avg_pool2d", "out");
  const Tensor xd = cpu::dense(x);
  const float* xp = xd.data<float>();
  float* op = out.data<float>();
  for_each_plane(s.planes, s.height * s.width, [&](int64_t plane) {
    const float* src = xp + plane * s.height * s.width;
    float* dst = op + plane * s.out_h * s.out_w;
    for (int64_t oy = 0; oy < s.out_h; ++oy) {
      const int64_t h0 = window_start(oy, s.height, s.out_h), h1 = window_end(oy, s.height, s.out_h);
      for (int64_t ox = 0; ox < s.out_w; ++ox) {
        const int64_t w0 = window_start(ox, s.width, s.out_w), w1 = window_end(ox, s.width, s.out_w);
        float total = 0.0f;
        for (int64_t y = h0; y < h1; ++y)
          for (int64_t xx = w0; xx < w1; ++xx) total += src[y * s.width + xx];
        dst[oy * s.out_w + ox] = total / static_cast<float>((h1 - h0) * (w1 - w0));
      }
    }
  });
}

void adaptive_avg_pool2d_backward_cpu(const Tensor& grad_out, Tensor& grad_x) {
  const AdaptivePlanes s = adaptive_planes(grad_x.sizes(), grad_out.sizes(), "adaptive_avg_pool2d backward");
  cpu::require_contiguous_output(grad_x, "adaptive_avg_pool2d backward", "grad_x");
  const Tensor go = cpu::dense(grad_out);
  const float* gp = go.data<float>();
  float* gx = grad_x.data<float>();
  for_each_plane(s.planes, s.height * s.width, [&](int64_t plane) {
    float* dst = gx + plane * s.height * s.width;
    std::fill(dst, dst + s.height * s.width, 0.0f);
    const float* g = gp + plane * s.out_h * s.out_w;
    for (int64_t oy = 0; oy < s.out_h; ++oy) {
      const int64_t h0 = window_start(oy, s.height, s.out_h), h1 = window_end(oy, s.height, s.out_h);
      for (int64_t ox = 0; ox < s.out_w; ++ox) {
        const int64_t w0 = window_start(ox, s.width, s.out_w), w1 = window_end(ox, s.width, s.out_w);
        const float share = g[oy * s.out_w + ox] / static_cast<float>((h1 - h0) * (w1 - w0));
        for (int64_t y = h0; y < h1; ++y)
          for (int64_t xx = w0; xx < w1; ++xx) dst[y * s.width + xx] += share;
      }
    }
  });
}

void adaptive_max_pool2d_forward_cpu(const Tensor& x, Tensor& out, Tensor& indices) {
  const AdaptivePlanes s = adaptive_planes(x.sizes(), out.sizes(), "adaptive_max_pool2d");
  cpu::require_contiguous_output(out, "adaptive_max_pool2d", "out");
  cpu::require_contiguous_output(indices, "adaptive_max_pool2d", "indices");
  const Tensor xd = cpu::dense(x);
  const float* xp = xd.data<float>();
  float* op = out.data<float>();
  int64_t* ip = indices.data<int64_t>();
  for_each_plane(s.planes, s.height * s.width, [&](int64_t plane) {
    const float* src = xp + plane * s.height * s.width;
    const int64_t at = plane * s.out_h * s.out_w;
    for (int64_t oy = 0; oy < s.out_h; ++oy) {
      const int64_t h0 = window_start(oy, s.height, s.out_h), h1 = window_end(oy, s.height, s.out_h);
      for (int64_t ox = 0; ox < s.out_w; ++ox) {
        const int64_t w0 = window_start(ox, s.width, s.out_w), w1 = window_end(ox, s.width, s.out_w);
        // The first maximum of the window; a NaN wins and ends the scan (as PyTorch).
        int64_t best_at = h0 * s.width + w0;
        float best = -std::numeric_limits<float>::infinity();
        for (int64_t y = h0; y < h1; ++y)
          for (int64_t xx = w0; xx < w1; ++xx) {
            const float v = src[y * s.width + xx];
            if (v > best || std::isnan(v)) {
              best = v;
              best_at = y * s.width + xx;
              if (std::isnan(v)) y = h1, xx = w1;
            }
          }
        op[at + oy * s.out_w + ox] = src[best_at];
        ip[at + oy * s.out_w + ox] = best_at;
      }
    }
  });
}

}  // namespace

void register_cpu_adaptive_pool() {
  adaptive_avg_pool2d_forward.set(DeviceType::CPU, &adaptive_avg_pool2d_forward_cpu);
  adaptive_avg_pool2d_backward.set(DeviceType::CPU, &adaptive_avg_pool2d_backward_cpu);
  adaptive_max_pool2d_forward.set(DeviceType::CPU, &adaptive_max_pool2d_forward_cpu);
}

}  // namespace mn::kernels
