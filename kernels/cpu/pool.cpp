// CPU 2-D max and average pooling (NCHW) and their backward passes. Every (sample, channel) plane
// is independent, so planes are spread over OpenMP threads; each output is computed by one thread
// in a fixed order. The op layer gives the output its size (pool_output_size in nn/functional/pool.cpp);
// the window arithmetic here follows PyTorch, including windows that ceil_mode lets run past the
// right/bottom padding.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/loops.h"
#include "kernels/kernels.h"

namespace mn::kernels {
namespace {

constexpr int64_t kParallelWork = 32768;

struct PoolPlanes {
  int64_t planes, height, width, out_h, out_w;
};

PoolPlanes planes_of(const Shape& in, const Shape& out, const char* op) {
  MN_CHECK(in.size() == 4 && out.size() == 4 && in[0] == out[0] && in[1] == out[1], ValueError, op,
           " kernel: expected [N, C, H, W] input and output with equal N and C, got ", in, " and ", out);
  return {in[0] * in[1], in[2], in[3], out[2], out[3]};
}

Tensor dense(const Tensor& t) {
  if (t.is_contiguous()) return t;
  Tensor out = empty(t.sizes(), TensorOptions(t.dtype()));
  copy(kCPU, t, out);
  return out;
}

// One pooling window clipped to the input, plus PyTorch's average divisor when padding counts.
struct Window {
  int64_t h0, h1, w0, w1;
  int64_t padded_size;  // window area clipped to the padded input
};

inline Window window(const Pool2dParams& p, int64_t oy, int64_t ox, int64_t height, int64_t width) {
  int64_t h0 = oy * p.stride_h - p.pad_h, w0 = ox * p.stride_w - p.pad_w;
  int64_t h1 = std::min(h0 + p.kernel_h, height + p.pad_h), w1 = std::min(w0 + p.kernel_w, width + p.pad_w);
  const int64_t padded = (h1 - h0) * (w1 - w0);
  return {std::max<int64_t>(h0, 0), std::min(h1, height), std::max<int64_t>(w0, 0), std::min(w1, width), padded};
}

template <class F>
void for_each_plane(int64_t planes, int64_t work_per_plane, F&& f) {
  const int team = cpu::parallel_team(planes * work_per_plane, kParallelWork);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1 && planes > 1)
  for (int64_t i = 0; i < planes; ++i) f(i);
}

// Flat position of the window's maximum (the first one on ties); a NaN wins and stays, like PyTorch.
inline int64_t window_argmax(const float* plane, int64_t width, const Window& w) {
  int64_t best_at = w.h0 * width + w.w0;
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t y = w.h0; y < w.h1; ++y)
    for (int64_t x = w.w0; x < w.w1; ++x) {
      const float v = plane[y * width + x];
      if (std::isnan(v)) return y * width + x;
      if (v > best) {
        best = v;
        best_at = y * width + x;
      }
    }
  return best_at;
}

void max_pool2d_forward_cpu(const Tensor& x, const Pool2dParams& p, Tensor& out, Tensor& indices) {
  const PoolPlanes s = planes_of(x.sizes(), out.sizes(), "max_pool2d");
  const Tensor xd = dense(x);
  const float* xp = xd.data<float>();
  float* op = out.data<float>();
  int64_t* ip = indices.data<int64_t>();
  const int64_t in_plane = s.height * s.width, out_plane = s.out_h * s.out_w;
  for_each_plane(s.planes, out_plane * p.kernel_h * p.kernel_w, [&](int64_t plane) {
    const float* src = xp + plane * in_plane;
    float* dst = op + plane * out_plane;
    int64_t* idx = ip + plane * out_plane;
    for (int64_t oy = 0; oy < s.out_h; ++oy)
      for (int64_t ox = 0; ox < s.out_w; ++ox) {
        const Window w = window(p, oy, ox, s.height, s.width);
        const int64_t best_at = window_argmax(src, s.width, w);
        dst[oy * s.out_w + ox] = src[best_at];
        idx[oy * s.out_w + ox] = best_at;
      }
  });
}

void max_pool2d_backward_cpu(const Tensor& grad_out, const Tensor& indices, Tensor& grad_x) {
  MN_CHECK(grad_x.is_contiguous(), ValueError, "max_pool2d backward: grad_x must be contiguous");
  const PoolPlanes s = planes_of(grad_x.sizes(), grad_out.sizes(), "max_pool2d backward");
  const Tensor go = dense(grad_out), id = dense(indices);
  const float* gp = go.data<float>();
  const int64_t* ip = id.data<int64_t>();
  float* gx = grad_x.data<float>();
  const int64_t in_plane = s.height * s.width, out_plane = s.out_h * s.out_w;
  for_each_plane(s.planes, in_plane + out_plane, [&](int64_t plane) {
    float* dst = gx + plane * in_plane;
    std::fill(dst, dst + in_plane, 0.0f);
    const float* g = gp + plane * out_plane;
    const int64_t* idx = ip + plane * out_plane;
    for (int64_t i = 0; i < out_plane; ++i) dst[idx[i]] += g[i];
  });
}

inline float avg_divisor(const Pool2dParams& p, const Window& w) {
  const int64_t n = p.count_include_pad ? w.padded_size : (w.h1 - w.h0) * (w.w1 - w.w0);
  return static_cast<float>(std::max<int64_t>(n, 1));
}

void avg_pool2d_forward_cpu(const Tensor& x, const Pool2dParams& p, Tensor& out) {
  const PoolPlanes s = planes_of(x.sizes(), out.sizes(), "avg_pool2d");
  const Tensor xd = dense(x);
  const float* xp = xd.data<float>();
  float* op = out.data<float>();
  const int64_t in_plane = s.height * s.width, out_plane = s.out_h * s.out_w;
  for_each_plane(s.planes, out_plane * p.kernel_h * p.kernel_w, [&](int64_t plane) {
    const float* src = xp + plane * in_plane;
    float* dst = op + plane * out_plane;
    for (int64_t oy = 0; oy < s.out_h; ++oy)
      for (int64_t ox = 0; ox < s.out_w; ++ox) {
        const Window w = window(p, oy, ox, s.height, s.width);
        float total = 0.0f;
        for (int64_t y = w.h0; y < w.h1; ++y)
          for (int64_t xx = w.w0; xx < w.w1; ++xx) total += src[y * s.width + xx];
        dst[oy * s.out_w + ox] = total / avg_divisor(p, w);
      }
  });
}

void avg_pool2d_backward_cpu(const Tensor& grad_out, const Pool2dParams& p, Tensor& grad_x) {
  MN_CHECK(grad_x.is_contiguous(), ValueError, "avg_pool2d backward: grad_x must be contiguous");
  const PoolPlanes s = planes_of(grad_x.sizes(), grad_out.sizes(), "avg_pool2d backward");
  const Tensor go = dense(grad_out);
  const float* gp = go.data<float>();
  float* gx = grad_x.data<float>();
  const int64_t in_plane = s.height * s.width, out_plane = s.out_h * s.out_w;
  for_each_plane(s.planes, in_plane + out_plane * p.kernel_h * p.kernel_w, [&](int64_t plane) {
    float* dst = gx + plane * in_plane;
    std::fill(dst, dst + in_plane, 0.0f);
    const float* g = gp + plane * out_plane;
    for (int64_t oy = 0; oy < s.out_h; ++oy)
      for (int64_t ox = 0; ox < s.out_w; ++ox) {
        const Window w = window(p, oy, ox, s.height, s.width);
        const float share = g[oy * s.out_w + ox] / avg_divisor(p, w);
        for (int64_t y = w.h0; y < w.h1; ++y)
          for (int64_t xx = w.w0; xx < w.w1; ++xx) dst[y * s.width + xx] += share;
      }
  });
}

}  // namespace

void register_cpu_pool() {
  max_pool2d_forward.set(DeviceType::CPU, &max_pool2d_forward_cpu);
  max_pool2d_backward.set(DeviceType::CPU, &max_pool2d_backward_cpu);
  avg_pool2d_forward.set(DeviceType::CPU, &avg_pool2d_forward_cpu);
  avg_pool2d_backward.set(DeviceType::CPU, &avg_pool2d_backward_cpu);
}

}  // namespace mn::kernels
