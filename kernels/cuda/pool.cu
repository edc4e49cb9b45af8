// CUDA 2-D max and average pooling (NCHW) and their backward passes. Twins of kernels/cpu/pool.cpp,
// with the same window arithmetic (PyTorch's, including ceil_mode windows that run past the padding)
// and the same scan order inside a window.
//   * forward: one thread per output element.
//   * avg backward: one thread per input pixel gathers the windows that cover it, in the CPU's
//     (oy, ox) order: deterministic, no atomics.
//   * max backward: the kernel gets only the indices (no window parameters). With many planes one
//     warp per plane scatters that plane's outputs in order (the CPU's sums, bit for bit); with few
//     planes one thread per output element scatters with atomicAdd, so when windows overlap the f32
//     sum order (and so the last bits) may vary from run to run.
#include <cmath>

#include "kernels/cuda/compute_utils.cuh"

namespace mn::kernels {
namespace {

using cuda::kThreads;

// Planes from which max-pool backward uses one warp per plane (below: one atomic add per output).
constexpr int64_t kWarpPerPlaneFrom = 512;

struct Planes {
  int64_t planes, height, width, out_h, out_w;
};

Planes planes_of(const Shape& in, const Shape& out, const char* op) {
  MN_CHECK(in.size() == 4 && out.size() == 4 && in[0] == out[0] && in[1] == out[1], ValueError, op,
           " kernel: expected [N, C, H, W] input and output with equal N and C, got ", in, " and ", out);
  return {in[0] * in[1], in[2], in[3], out[2], out[3]};
}

struct PoolArgs {
  int64_t kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w;
  bool count_include_pad;
};

PoolArgs args_of(const Pool2dParams& p) {
  return {p.kernel_h, p.kernel_w, p.stride_h, p.stride_w, p.pad_h, p.pad_w, p.count_include_pad};
}

struct Window {
  int64_t h0, h1, w0, w1;
  int64_t padded_size;
};

__device__ inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

__device__ inline Window window(const PoolArgs& p, int64_t oy, int64_t ox, int64_t height, int64_t width) {
  const int64_t h0 = oy * p.stride_h - p.pad_h, w0 = ox * p.stride_w - p.pad_w;
  const int64_t h1 = min64(h0 + p.kernel_h, height + p.pad_h), w1 = min64(w0 + p.kernel_w, width + p.pad_w);
  const int64_t padded = (h1 - h0) * (w1 - w0);
  return {max64(h0, 0), min64(h1, height), max64(w0, 0), min64(w1, width), padded};
}

__device__ inline float avg_divisor(const PoolArgs& p, const Window& w) {
  const int64_t n = p.count_include_pad ? w.padded_size : (w.h1 - w.h0) * (w.w1 - w.w0);
  return static_cast<float>(n > 1 ? n : 1);
}

// x read through its strides: plane = n*C + c.
struct Input {
  const float* x;
  cuda::Divider channels;
  int64_t sn, sc, sh, sw;
  __device__ const float* plane_at(int64_t plane) const {
    int64_t n, c;
    channels.divmod(plane, &n, &c);
    return x + n * sn + c * sc;
  }
  __device__ float at(const float* plane, int64_t y, int64_t xx) const { return plane[y * sh + xx * sw]; }
};

Input input_of(const Tensor& x) {
  return {static_cast<const float*>(x.raw_data()), cuda::Divider(x.size(1), x.size(0) * x.size(1)), x.stride(0),
          x.stride(1), x.stride(2), x.stride(3)};
}

// The divisions of an index l = (plane * rows + row) * cols + col over `planes` planes.
struct Grid {
  cuda::Divider cols, rows;
  __device__ void split(int64_t l, int64_t* plane, int64_t* row, int64_t* col) const {
    int64_t t;
    cols.divmod(l, &t, col);
    rows.divmod(t, plane, row);
  }
};

Grid grid_of(int64_t planes, int64_t rows, int64_t cols) {
  const int64_t total = planes * rows * cols;
  return {cuda::Divider(cols, total), cuda::Divider(rows, total)};
}

__global__ void max_pool_forward_kernel(Input in, PoolArgs p, Planes s, Grid grid, float* out, int64_t* indices) {
  const int64_t total = s.planes * s.out_h * s.out_w;
  MN_CUDA_KERNEL_LOOP(l, total) {
    int64_t plane, oy, ox;
    grid.split(l, &plane, &oy, &ox);
    const float* xp = in.plane_at(plane);
    const Window w = window(p, oy, ox, s.height, s.width);
    int64_t best_y = w.h0, best_x = w.w0;
    float best = -INFINITY;
    bool found_nan = false;
    for (int64_t y = w.h0; y < w.h1 && !found_nan; ++y)
      for (int64_t xx = w.w0; xx < w.w1; ++xx) {
        const float v = in.at(xp, y, xx);
        if (v != v) {
          best_y = y, best_x = xx;
          found_nan = true;
          break;
        }
        if (v > best) {
          best = v;
          best_y = y, best_x = xx;
        }
      }
    out[l] = in.at(xp, best_y, best_x);
    indices[l] = best_y * s.width + best_x;
  }
}

void max_pool2d_forward_cuda(const Tensor& x, const Pool2dParams& p, Tensor& out, Tensor& indices) {
  const Planes s = planes_of(x.sizes(), out.sizes(), "max_pool2d");
  MN_CHECK(out.is_contiguous() && indices.is_contiguous() && indices.dtype() == DType::i64, ValueError,
           "max_pool2d kernel: out and indices (i64) must be contiguous");
  const int64_t total = out.numel();
  if (total == 0) return;
  max_pool_forward_kernel<<<cuda::blocks_for(total), kThreads, 0, cuda::stream_of(out)>>>(
      input_of(x), args_of(p), s, grid_of(s.planes, s.out_h, s.out_w), static_cast<float*>(out.raw_data()),
      static_cast<int64_t*>(indices.raw_data()));
  MN_CUDA_CHECK_LAUNCH();
}

// One warp per plane: the warp walks the plane's outputs 32 at a time, in order. Lanes of one step that
// hit the same input pixel are merged by the lowest of them, which adds their values to the pixel in
// lane order, so every pixel receives its contributions in increasing output order, as in the CPU
// loop (bitwise the same result, no atomics). Loops are warp-uniform (blockDim is a multiple of 32).
__global__ void max_pool_backward_warp_kernel(const float* g, const int64_t* idx, int64_t planes, int64_t in_plane,
                                              int64_t out_plane, float* gx) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps_per_block = blockDim.x / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * warps_per_block;
  for (int64_t plane = static_cast<int64_t>(blockIdx.x) * warps_per_block + threadIdx.x / 32; plane < planes;
       plane += warps) {
    float* dst = gx + plane * in_plane;
    const float* gp = g + plane * out_plane;
    const int64_t* ip = idx + plane * out_plane;
    for (int64_t base = 0; base < out_plane; base += 32) {
      const int64_t i = base + lane;
      const bool active = i < out_plane;
      const long long target = active ? static_cast<long long>(ip[i]) : -1LL - lane;  // idle lanes: unique keys
      const float v = active ? gp[i] : 0.0f;
      const unsigned peers = __match_any_sync(0xffffffffu, target);
      const bool leader = active && __ffs(static_cast<int>(peers)) - 1 == lane;
      float acc = leader ? dst[target] : 0.0f;
      for (int src = 0; src < 32; ++src) {
        const float pv = __shfl_sync(0xffffffffu, v, src);
        if (leader && ((peers >> src) & 1u)) acc += pv;
      }
      if (leader) dst[target] = acc;
      __syncwarp();  // the next step may read a pixel another lane has just written
    }
  }
}

__global__ void max_pool_backward_atomic_kernel(const float* g, const int64_t* idx, int64_t total, int64_t in_plane,
                                                cuda::Divider out_plane, float* gx) {
  MN_CUDA_KERNEL_LOOP(l, total)
    atomicAdd(gx + out_plane.div(l) * in_plane + idx[l], g[l]);
}

void max_pool2d_backward_cuda(const Tensor& grad_out, const Tensor& indices, Tensor& grad_x) {
  MN_CHECK(grad_x.is_contiguous(), ValueError, "max_pool2d backward: grad_x must be contiguous");
  const Planes s = planes_of(grad_x.sizes(), grad_out.sizes(), "max_pool2d backward");
  cudaStream_t stream = cuda::stream_of(grad_x);
  if (grad_x.numel() == 0) return;
  MN_CUDA_CHECK(cudaMemsetAsync(grad_x.raw_data(), 0, grad_x.nbytes(), stream));
  const int64_t out_plane = s.out_h * s.out_w, in_plane = s.height * s.width;
  if (out_plane == 0) return;
  const Tensor go = cuda::dense(grad_out), id = cuda::dense(indices);
  const float* gp = static_cast<const float*>(go.raw_data());
  const int64_t* ip = static_cast<const int64_t*>(id.raw_data());
  float* gx = static_cast<float*>(grad_x.raw_data());
  if (s.planes >= kWarpPerPlaneFrom) {
    const int64_t warps_per_block = kThreads / 32;
    max_pool_backward_warp_kernel<<<cuda::grid_for_blocks((s.planes + warps_per_block - 1) / warps_per_block), kThreads,
                                    0, stream>>>(gp, ip, s.planes, in_plane, out_plane, gx);
  } else {
    const int64_t total = s.planes * out_plane;
    max_pool_backward_atomic_kernel<<<cuda::blocks_for(total), kThreads, 0, stream>>>(
        gp, ip, total, in_plane, cuda::Divider(out_plane, total), gx);
  }
  MN_CUDA_CHECK_LAUNCH();
}

__global__ void avg_pool_forward_kernel(Input in, PoolArgs p, Planes s, Grid grid, float* out) {
  const int64_t total = s.planes * s.out_h * s.out_w;
  MN_CUDA_KERNEL_LOOP(l, total) {
    int64_t plane, oy, ox;
    grid.split(l, &plane, &oy, &ox);
    const float* xp = in.plane_at(plane);
    const Window w = window(p, oy, ox, s.height, s.width);
    float sum = 0.0f;
    for (int64_t y = w.h0; y < w.h1; ++y)
      for (int64_t xx = w.w0; xx < w.w1; ++xx) sum += in.at(xp, y, xx);
    out[l] = sum / avg_divisor(p, w);
  }
}

void avg_pool2d_forward_cuda(const Tensor& x, const Pool2dParams& p, Tensor& out) {
  const Planes s = planes_of(x.sizes(), out.sizes(), "avg_pool2d");
  MN_CHECK(out.is_contiguous(), ValueError, "avg_pool2d kernel: out must be contiguous");
  const int64_t total = out.numel();
  if (total == 0) return;
  avg_pool_forward_kernel<<<cuda::blocks_for(total), kThreads, 0, cuda::stream_of(out)>>>(
      input_of(x), args_of(p), s, grid_of(s.planes, s.out_h, s.out_w), static_cast<float*>(out.raw_data()));
  MN_CUDA_CHECK_LAUNCH();
}

// Output rows (or columns) whose window covers input coordinate y: o * stride - pad <= y < o * stride
// - pad + kernel, within [0, count). `stride` divides values below count_in + pad + stride.
__device__ inline void covering(int64_t y, cuda::Divider stride, int64_t pad, int64_t kernel, int64_t count,
                                int64_t* first, int64_t* last) {
  const int64_t hi = y + pad;                // o * stride <= hi
  const int64_t lo = y + pad - kernel + 1;   // o * stride >= lo
  *first = lo <= 0 ? 0 : stride.div(lo + stride.divisor() - 1);
  *last = min64(stride.div(hi), count - 1);  // hi >= 0 for y >= 0
}

__global__ void avg_pool_backward_kernel(const float* g, PoolArgs p, Planes s, Grid grid, cuda::Divider stride_h,
                                         cuda::Divider stride_w, float* gx) {
  const int64_t in_plane = s.height * s.width, out_plane = s.out_h * s.out_w;
  const int64_t total = s.planes * in_plane;
  MN_CUDA_KERNEL_LOOP(l, total) {
    int64_t plane, y, x;
    grid.split(l, &plane, &y, &x);
    int64_t oy0, oy1, ox0, ox1;
    covering(y, stride_h, p.pad_h, p.kernel_h, s.out_h, &oy0, &oy1);
    covering(x, stride_w, p.pad_w, p.kernel_w, s.out_w, &ox0, &ox1);
    const float* gp = g + plane * out_plane;
    float sum = 0.0f;
    for (int64_t oy = oy0; oy <= oy1; ++oy)
      for (int64_t ox = ox0; ox <= ox1; ++ox) {
        const Window w = window(p, oy, ox, s.height, s.width);
        if (y < w.h0 || y >= w.h1 || x < w.w0 || x >= w.w1) continue;
        sum += gp[oy * s.out_w + ox] / avg_divisor(p, w);
      }
    gx[l] = sum;
  }
}

void avg_pool2d_backward_cuda(const Tensor& grad_out, const Pool2dParams& p, Tensor& grad_x) {
  MN_CHECK(grad_x.is_contiguous(), ValueError, "avg_pool2d backward: grad_x must be contiguous");
  const Planes s = planes_of(grad_x.sizes(), grad_out.sizes(), "avg_pool2d backward");
  const int64_t total = grad_x.numel();
  if (total == 0) return;
  const Tensor go = cuda::dense(grad_out);
  avg_pool_backward_kernel<<<cuda::blocks_for(total), kThreads, 0, cuda::stream_of(grad_x)>>>(
      static_cast<const float*>(go.raw_data()), args_of(p), s, grid_of(s.planes, s.height, s.width),
      cuda::Divider(p.stride_h, s.height + p.pad_h + p.stride_h), cuda::Divider(p.stride_w, s.width + p.pad_w + p.stride_w),
      static_cast<float*>(grad_x.raw_data()));
  MN_CUDA_CHECK_LAUNCH();
}

}  // namespace

void register_cuda_pool() {
  max_pool2d_forward.set(DeviceType::CUDA, &max_pool2d_forward_cuda);
  max_pool2d_backward.set(DeviceType::CUDA, &max_pool2d_backward_cuda);
  avg_pool2d_forward.set(DeviceType::CUDA, &avg_pool2d_forward_cuda);
  avg_pool2d_backward.set(DeviceType::CUDA, &avg_pool2d_backward_cuda);
}

}  // namespace mn::kernels
