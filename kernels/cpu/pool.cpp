// CPU 2-D max and average pooling (NCHW) and their backward passes. Every (sample, channel) plane
// is independent, so planes are spread over OpenMP threads; each output is computed by one thread
// in a fixed order. The op layer gives the output its size (pool_output_size in nn/functional/pool.cpp);
// the window arithmetic here follows PyTorch, including windows that ceil_mode lets run past the
// right/bottom padding.
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

#if defined(__AVX512F__) && defined(__AVX512VL__)
constexpr bool kVectorPool2x2 = true;
// Outputs [0, n) of one output row of a 2 x 2, stride 2, unpadded pool whose windows lie inside the
// plane: rows r0 and r1 = r0 + width, `row_at` the flat position of r0[0]. The same scan order, and so
// the same values and indices, as window_argmax, eight windows per step without a branch per comparison
// (on pooled activations those mispredict about half the time). Masked loads and stores only where a
// row ends: with them throughout (even with all lanes on) the kernel ran 2-5x slower on this project's
// AMD EPYC host.
void max_pool_2x2_row(const float* r0, int64_t row_at, int64_t width, int64_t n, float* dst, int64_t* idx,
                      const float* input_end) {
  const float* r1 = r0 + width;
  const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  const __m256i odd = _mm256_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15);
  const __m512i lane_at = _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14);
  // 16 consecutive floats as two halves; past `valid` (< 16) zeros, never stored.
  auto load16 = [](const float* src, int64_t valid, __m256& lo, __m256& hi) {
    if (valid >= 16) {
      lo = _mm256_loadu_ps(src);
      hi = _mm256_loadu_ps(src + 8);
    } else {
      lo = _mm256_maskz_loadu_ps(static_cast<__mmask8>((1u << std::min<int64_t>(valid, 8)) - 1), src);
      hi = _mm256_maskz_loadu_ps(static_cast<__mmask8>((1u << std::max<int64_t>(valid - 8, 0)) - 1), src + 8);
    }
  };
  // v replaces best where larger, or where it is the first NaN (a NaN best stays).
  auto take = [](__m256 v, __m512i v_at, __m256& best, __m512i& best_at) {
    const __mmask8 m = _mm256_cmp_ps_mask(v, best, _CMP_GT_OQ) |
                       (_mm256_cmp_ps_mask(v, v, _CMP_UNORD_Q) & _mm256_cmp_ps_mask(best, best, _CMP_ORD_Q));
    best = _mm256_mask_mov_ps(best, m, v);
    best_at = _mm512_mask_mov_epi64(best_at, m, v_at);
  };
  for (int64_t ox = 0; ox < n; ox += 8) {
    const int64_t lanes = std::min<int64_t>(8, n - ox);
    // Whole vectors wherever they stay inside the input: lanes past `lanes` then read the next row or
    // plane and are never stored.
    const int64_t valid = input_end - (r1 + 2 * ox) >= 16 ? 16 : 2 * lanes;
    __m256 t0, t1, b0, b1;
    load16(r0 + 2 * ox, valid, t0, t1);
    load16(r1 + 2 * ox, valid, b0, b1);
    const __m512i at = _mm512_add_epi64(_mm512_set1_epi64(row_at + 2 * ox), lane_at);
    const __m512i below = _mm512_add_epi64(at, _mm512_set1_epi64(width));
    const __m512i one = _mm512_set1_epi64(1);
    __m256 best = _mm256_permutex2var_ps(t0, even, t1);
    __m512i best_at = at;
    take(_mm256_permutex2var_ps(t0, odd, t1), _mm512_add_epi64(at, one), best, best_at);
    take(_mm256_permutex2var_ps(b0, even, b1), below, best, best_at);
    take(_mm256_permutex2var_ps(b0, odd, b1), _mm512_add_epi64(below, one), best, best_at);
    if (lanes == 8) {
      _mm256_storeu_ps(dst + ox, best);
      _mm512_storeu_si512(idx + ox, best_at);
    } else {
      const __mmask8 out_mask = static_cast<__mmask8>((1u << lanes) - 1);
      _mm256_mask_storeu_ps(dst + ox, out_mask, best);
      _mm512_mask_storeu_epi64(idx + ox, out_mask, best_at);
    }
  }
}
#else
constexpr bool kVectorPool2x2 = false;
void max_pool_2x2_row(const float*, int64_t, int64_t, int64_t, float*, int64_t*, const float*) {}
#endif

void max_pool2d_forward_cpu(const Tensor& x, const Pool2dParams& p, Tensor& out, Tensor& indices) {
  const PoolPlanes s = planes_of(x.sizes(), out.sizes(), "max_pool2d");
  const Tensor xd = dense(x);
  const float* xp = xd.data<float>();
  float* op = out.data<float>();
  int64_t* ip = indices.data<int64_t>();
  const int64_t in_plane = s.height * s.width, out_plane = s.out_h * s.out_w;
  // 2 x 2 windows at stride 2 without padding (the usual CNN pool), in AVX-512 builds: rows and columns of
  // windows that lie inside the plane take max_pool_2x2_row; a last one that ceil_mode lets hang past the
  // edge, the general path.
  const bool pool_2x2 = kVectorPool2x2 && p.kernel_h == 2 && p.kernel_w == 2 && p.stride_h == 2 &&
                        p.stride_w == 2 && p.pad_h == 0 && p.pad_w == 0;
  const int64_t full_h = pool_2x2 ? std::min(s.out_h, s.height / 2) : 0;
  const int64_t full_w = pool_2x2 ? std::min(s.out_w, s.width / 2) : 0;
  for_each_plane(s.planes, out_plane * p.kernel_h * p.kernel_w, [&](int64_t plane) {
    const float* src = xp + plane * in_plane;
    float* dst = op + plane * out_plane;
    int64_t* idx = ip + plane * out_plane;
    for (int64_t oy = 0; oy < s.out_h; ++oy) {
      const int64_t first = oy < full_h ? full_w : 0;
      if (first > 0)
        max_pool_2x2_row(src + 2 * oy * s.width, 2 * oy * s.width, s.width, first, dst + oy * s.out_w,
                         idx + oy * s.out_w, xp + s.planes * in_plane);
      for (int64_t ox = first; ox < s.out_w; ++ox) {
        const Window w = window(p, oy, ox, s.height, s.width);
        const int64_t best_at = window_argmax(src, s.width, w);
        dst[oy * s.out_w + ox] = src[best_at];
        idx[oy * s.out_w + ox] = best_at;
      }
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
