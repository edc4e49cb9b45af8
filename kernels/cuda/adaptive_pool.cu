// CUDA adaptive average and max pooling (NCHW). Twins of kernels/cpu/adaptive_pool.cpp with the same
// windows (rows floor(i*H/OH) .. ceil((i+1)*H/OH) - 1, columns alike) and scan order.
//   * forward: one thread per output element (reads x through its strides).
//   * avg backward: one thread per input pixel sums the windows that cover it in (oy, ox) order, the
//     order in which the CPU adds them: the same bits, no atomics.
// Max pooling's backward is max_pool2d_backward (kernels/cuda/pool.cu) on the recorded indices.
#include <cmath>

#include "kernels/cuda/compute_utils.cuh"
#include "kernels/adaptive_pool_shape.h"

namespace mn::kernels {
namespace {

using cuda::kThreads;

// x read through its strides: plane = n*C + c.
struct Input {
  const float* x;
  int64_t channels, sn, sc, sh, sw;
  __device__ const float* plane_at(int64_t plane) const {
    return x + (plane / channels) * sn + (plane % channels) * sc;
  }
};

Input input_of(const Tensor& x) {
  return {static_cast<const float*>(x.raw_data()), x.size(1), x.stride(0), x.stride(1), x.stride(2), x.stride(3)};
}

__global__ void adaptive_avg_forward_kernel(Input in, AdaptivePlanes s, float* out) {
  const int64_t total = s.planes * s.out_h * s.out_w;
  MN_CUDA_KERNEL_LOOP(l, total) {
    const int64_t ox = l % s.out_w, t = l / s.out_w;
    const int64_t oy = t % s.out_h, plane = t / s.out_h;
    const float* xp = in.plane_at(plane);
    const int64_t h0 = window_start(oy, s.height, s.out_h), h1 = window_end(oy, s.height, s.out_h);
    const int64_t w0 = window_start(ox, s.width, s.out_w), w1 = window_end(ox, s.width, s.out_w);
    float total_v = 0.0f;
    for (int64_t y = h0; y < h1; ++y)
      for (int64_t xx = w0; xx < w1; ++xx) total_v += xp[y * in.sh + xx * in.sw];
    out[l] = total_v / static_cast<float>((h1 - h0) * (w1 - w0));
  }
}

void adaptive_avg_pool2d_forward_cuda(const Tensor& x, Tensor& out) {
  const AdaptivePlanes s = adaptive_planes(x.sizes(), out.sizes(), "adaptive_avg_pool2d");
  MN_CHECK(out.is_contiguous(), ValueError, "adaptive_avg_pool2d kernel: out must be contiguous");
  const int64_t total = out.numel();
  adaptive_avg_forward_kernel<<<cuda::blocks_for(total), kThreads, 0, cuda::stream_of(out)>>>(
      input_of(x), s, static_cast<float*>(out.raw_data()));
  MN_CUDA_CHECK_LAUNCH();
}

// Outputs along one axis whose window covers input coordinate y: from floor(y*out/in) (the first
// window that can reach y) to the last one starting at or before y.
__device__ inline void covering(int64_t y, int64_t in, int64_t out, int64_t* first, int64_t* last) {
  *first = y * out / in;
  int64_t o = ((y + 1) * out + in - 1) / in;  // past every window that starts at or before y
  *last = (o < out ? o : out) - 1;
}

__global__ void adaptive_avg_backward_kernel(const float* g, AdaptivePlanes s, float* gx) {
  const int64_t total = s.planes * s.height * s.width;
  MN_CUDA_KERNEL_LOOP(l, total) {
    const int64_t x = l % s.width, t = l / s.width;
    const int64_t y = t % s.height, plane = t / s.height;
    int64_t oy0, oy1, ox0, ox1;
    covering(y, s.height, s.out_h, &oy0, &oy1);
    covering(x, s.width, s.out_w, &ox0, &ox1);
    const float* gp = g + plane * s.out_h * s.out_w;
    float sum = 0.0f;
    for (int64_t oy = oy0; oy <= oy1; ++oy) {
      const int64_t h0 = window_start(oy, s.height, s.out_h), h1 = window_end(oy, s.height, s.out_h);
      if (y < h0 || y >= h1) continue;
      for (int64_t ox = ox0; ox <= ox1; ++ox) {
        const int64_t w0 = window_start(ox, s.width, s.out_w), w1 = window_end(ox, s.width, s.out_w);
        if (x < w0 || x >= w1) continue;
        sum += gp[oy * s.out_w + ox] / static_cast<float>((h1 - h0) * (w1 - w0));
      }
    }
    gx[l] = sum;
  }
}

void adaptive_avg_pool2d_backward_cuda(const Tensor& grad_out, Tensor& grad_x) {
  MN_CHECK(grad_x.is_contiguous(), ValueError, "adaptive_avg_pool2d backward: grad_x must be contiguous");
  const AdaptivePlanes s = adaptive_planes(grad_x.sizes(), grad_out.sizes(), "adaptive_avg_pool2d backward");
  const Tensor go = cuda::dense(grad_out);
  adaptive_avg_backward_kernel<<<cuda::blocks_for(grad_x.numel()), kThreads, 0, cuda::stream_of(grad_x)>>>(
      static_cast<const float*>(go.raw_data()), s, static_cast<float*>(grad_x.raw_data()));
  MN_CUDA_CHECK_LAUNCH();
}

__global__ void adaptive_max_forward_kernel(Input in, AdaptivePlanes s, float* out, int64_t* indices) {
  const int64_t total = s.planes * s.out_h * s.out_w;
  MN_CUDA_KERNEL_LOOP(l, total) {
    const int64_t ox = l % s.out_w, t = l / s.out_w;
    const int64_t oy = t % s.out_h, plane = t / s.out_h;
    const float* xp = in.plane_at(plane);
    const int64_t h0 = window_start(oy, s.height, s.out_h), h1 = window_end(oy, s.height, s.out_h);
    const int64_t w0 = window_start(ox, s.width, s.out_w), w1 = window_end(ox, s.width, s.out_w);
    int64_t best_y = h0, best_x = w0;
    float best = -INFINITY;
    bool found_nan = false;
    for (int64_t y = h0; y < h1 && !found_nan; ++y)
      for (int64_t xx = w0; xx < w1; ++xx) {
        const float v = xp[y * in.sh + xx * in.sw];
        if (v > best || v != v) {
          best = v;
          best_y = y, best_x = xx;
          if (v != v) {
            found_nan = true;
            break;
          }
        }
      }
    out[l] = xp[best_y * in.sh + best_x * in.sw];
    indices[l] = best_y * s.width + best_x;
  }
}

void adaptive_max_pool2d_forward_cuda(const Tensor& x, Tensor& out, Tensor& indices) {
  const AdaptivePlanes s = adaptive_planes(x.sizes(), out.sizes(), "adaptive_max_pool2d");
  MN_CHECK(out.is_contiguous() && indices.is_contiguous() && indices.dtype() == DType::i64, ValueError,
           "adaptive_max_pool2d kernel: out and indices (i64) must be contiguous");
  adaptive_max_forward_kernel<<<cuda::blocks_for(out.numel()), kThreads, 0, cuda::stream_of(out)>>>(
      input_of(x), s, static_cast<float*>(out.raw_data()), static_cast<int64_t*>(indices.raw_data()));
  MN_CUDA_CHECK_LAUNCH();
}

}  // namespace

void register_cuda_adaptive_pool() {
  adaptive_avg_pool2d_forward.set(DeviceType::CUDA, &adaptive_avg_pool2d_forward_cuda);
  adaptive_avg_pool2d_backward.set(DeviceType::CUDA, &adaptive_avg_pool2d_backward_cuda);
  adaptive_max_pool2d_forward.set(DeviceType::CUDA, &adaptive_max_pool2d_forward_cuda);
}

}  // namespace mn::kernels
