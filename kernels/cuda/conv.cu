// CUDA 2-D convolution (NCHW) by im2col / col2im kernels and the op table's GEMM (cuBLAS on CUDA),
// with stride, padding, dilation and groups. Twin of kernels/cpu/conv.cpp.
//   forward:          out[n, g]    = W_g [Og, K] @ col(x[n, g]) [K, P]        (K = Cg*KH*KW, P = OH*OW)
//                     one batched GEMM per group over a chunk of samples (W_g broadcast, batch stride 0)
//   backward input:   grad_x[n, g] = col2im(W_g^T @ grad_out[n, g])            (batched GEMM, then a
//                     gather-style col2im: each input pixel sums its taps in a fixed order, no atomics)
//   backward weight:  grad_W_g     = grad_out_g [Og, nb*P] @ col_g^T [nb*P, K]  (one GEMM per group and
//                     chunk; the columns of a chunk are laid out [G, K, nb, P] so the batch folds
//                     into the GEMM's inner dimension; chunks accumulate with beta = 1 in order)
//   grad_bias[o]    = sum over n and pixels of grad_out[n, o]: the reduce kernels (split, in double).
// Chunks of samples bound the column buffer; their size depends on the shapes only, so results are
// reproducible from run to run.
#include <algorithm>

#include "kernels/cuda/compute_utils.cuh"

namespace mn::kernels {
namespace {

using cuda::kThreads;

// Floats of column buffer per chunk of samples (128 MiB).
constexpr int64_t kColumnBudget = int64_t{1} << 25;

struct Geometry {
  int64_t batch, channels, height, width;  // x
  int64_t out_channels, kernel_h, kernel_w;
  int64_t out_h, out_w;
  int64_t groups, group_in, group_out;
  int64_t sx_n, sx_c, sx_h, sx_w;  // x strides (elements)
  int64_t stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;

  __host__ __device__ int64_t k() const { return group_in * kernel_h * kernel_w; }
  __host__ __device__ int64_t plane() const { return out_h * out_w; }
};

Geometry geometry(const Shape& x_shape, const Shape& x_strides, const Shape& weight_shape, const Shape& out_shape,
                  const Conv2dParams& p) {
  MN_CHECK(x_shape.size() == 4 && weight_shape.size() == 4 && out_shape.size() == 4, ValueError,
           "conv2d kernel: expected 4-D x, weight and output, got ", x_shape, ", ", weight_shape, ", ", out_shape);
  Geometry g;
  g.batch = x_shape[0], g.channels = x_shape[1], g.height = x_shape[2], g.width = x_shape[3];
  g.out_channels = weight_shape[0], g.kernel_h = weight_shape[2], g.kernel_w = weight_shape[3];
  g.out_h = out_shape[2], g.out_w = out_shape[3];
  g.groups = p.groups;
  g.group_in = g.channels / p.groups;
  g.group_out = g.out_channels / p.groups;
  g.sx_n = x_strides[0], g.sx_c = x_strides[1], g.sx_h = x_strides[2], g.sx_w = x_strides[3];
  g.stride_h = p.stride_h, g.stride_w = p.stride_w, g.pad_h = p.pad_h, g.pad_w = p.pad_w;
  g.dilation_h = p.dilation_h, g.dilation_w = p.dilation_w;
  MN_CHECK(g.group_in == weight_shape[1] && g.group_in * p.groups == g.channels &&
               g.group_out * p.groups == g.out_channels && out_shape[0] == g.batch && out_shape[1] == g.out_channels,
           ValueError, "conv2d kernel: inconsistent shapes x ", x_shape, ", weight ", weight_shape, ", output ",
           out_shape, " for groups ", p.groups);
  return g;
}

int64_t chunk_samples(const Geometry& g) {
  const int64_t per_sample = std::max<int64_t>(1, g.groups * g.k() * g.plane());
  return std::clamp<int64_t>(kColumnBudget / per_sample, 1, std::max<int64_t>(g.batch, 1));
}

Tensor view(const Tensor& t, const Shape& sizes, const Shape& strides, int64_t extra_offset) {
  return make_view(t.storage(), sizes, strides, t.storage_offset() + extra_offset, t.dtype());
}

Tensor device_empty(const Shape& shape, Device device) {
  return empty(shape, TensorOptions(DType::f32).with_device(device));
}

void require_contiguous(const Tensor& t, const char* what) {
  MN_CHECK(t.is_contiguous(), ValueError, "conv2d kernel: ", what, " must be contiguous, got shape ", t.sizes(),
           " with strides ", t.strides());
}

// The divisions of im2col's index l = ((nl * G + grp) * K + kr) * P + p, with kr = (c * KH + ki) * KW + kj
// and p = oy * OW + ox, for `total` values of l.
struct ColumnIndex {
  cuda::Divider plane, k, groups, kernel_w, kernel_h, out_w;
};

ColumnIndex column_index(const Geometry& g, int64_t total) {
  const int64_t K = g.k(), P = g.plane();
  return {cuda::Divider(P, total),      cuda::Divider(K, total),      cuda::Divider(g.groups, total),
          cuda::Divider(g.kernel_w, K), cuda::Divider(g.kernel_h, K), cuda::Divider(g.out_w, P)};
}

// col[(nl, g, kr, p)] at nl*s_n + g*s_g + kr*s_k + p, for samples n0 .. n0+nb.
__global__ void im2col_kernel(Geometry g, ColumnIndex index, const float* x, int64_t n0, int64_t nb, float* col,
                              int64_t s_n, int64_t s_g, int64_t s_k) {
  const int64_t total = nb * g.groups * g.k() * g.plane();
  MN_CUDA_KERNEL_LOOP(l, total) {
    int64_t t, p, kr, grp, nl, r, kj, c, ki, oy, ox;
    index.plane.divmod(l, &t, &p);
    index.k.divmod(t, &t, &kr);
    index.groups.divmod(t, &nl, &grp);
    index.kernel_w.divmod(kr, &r, &kj);
    index.kernel_h.divmod(r, &c, &ki);
    index.out_w.divmod(p, &oy, &ox);
    const int64_t iy = oy * g.stride_h - g.pad_h + ki * g.dilation_h;
    const int64_t ix = ox * g.stride_w - g.pad_w + kj * g.dilation_w;
    float v = 0.0f;
    if (iy >= 0 && iy < g.height && ix >= 0 && ix < g.width)
      v = x[(n0 + nl) * g.sx_n + (grp * g.group_in + c) * g.sx_c + iy * g.sx_h + ix * g.sx_w];
    col[nl * s_n + grp * s_g + kr * s_k + p] = v;
  }
}

void launch_im2col(const Geometry& g, const Tensor& x, int64_t n0, int64_t nb, Tensor& col, int64_t s_n,
                   int64_t s_g, int64_t s_k) {
  const int64_t total = nb * g.groups * g.k() * g.plane();
  if (total == 0) return;
  im2col_kernel<<<cuda::blocks_for(total), kThreads, 0, cuda::stream_of(col)>>>(
      g, column_index(g, total), static_cast<const float*>(x.raw_data()), n0, nb, static_cast<float*>(col.raw_data()),
      s_n, s_g, s_k);
  MN_CUDA_CHECK_LAUNCH();
}

// out[n0 + nl, grp*Og + o, p] = tmp[nl, o, p] (groups > 1: the GEMM result of one group).
__global__ void place_group_kernel(const float* tmp, int64_t total, cuda::Divider group_out, cuda::Divider plane,
                                   int64_t out_channels, int64_t channel0, int64_t n0, float* out) {
  MN_CUDA_KERNEL_LOOP(l, total) {
    int64_t t, p, nl, o;
    plane.divmod(l, &t, &p);
    group_out.divmod(t, &nl, &o);
    out[((n0 + nl) * out_channels + channel0 + o) * plane.divisor() + p] = tmp[l];
  }
}

__global__ void add_bias_kernel(float* out, const float* bias, int64_t total, cuda::Divider channels,
                                cuda::Divider plane) {
  MN_CUDA_KERNEL_LOOP(l, total)
    out[l] += bias[channels.mod(plane.div(l))];
}

void conv2d_forward_cuda(const Tensor& x, const Tensor& weight, const Tensor& bias, const Conv2dParams& p,
                         Tensor& out) {
  const Geometry g = geometry(x.sizes(), x.strides(), weight.sizes(), out.sizes(), p);
  require_contiguous(out, "out");
  if (out.numel() == 0) return;
  const Device device = x.device();
  const Tensor w = cuda::dense(weight);
  const int64_t K = g.k(), P = g.plane(), G = g.groups, Og = g.group_out, O = g.out_channels;
  const int64_t chunk = chunk_samples(g);
  Tensor col = device_empty({chunk * G * K * P}, device);
  Tensor tmp = G > 1 ? device_empty({chunk * Og * P}, device) : Tensor();
  for (int64_t n0 = 0; n0 < g.batch; n0 += chunk) {
    const int64_t nb = std::min(chunk, g.batch - n0);
    launch_im2col(g, x, n0, nb, col, G * K * P, K * P, P);
    for (int64_t grp = 0; grp < G; ++grp) {
      const Tensor a = view(w, {nb, Og, K}, {0, K, 1}, grp * Og * K);
      const Tensor b = view(col, {nb, K, P}, {G * K * P, P, 1}, grp * K * P);
      if (G == 1) {
        Tensor dst = view(out, {nb, O, P}, {O * P, P, 1}, n0 * O * P);
        gemm(device, a, b, dst, 1.0, 0.0);
      } else {
        Tensor dst = view(tmp, {nb, Og, P}, {Og * P, P, 1}, 0);
        gemm(device, a, b, dst, 1.0, 0.0);
        const int64_t total = nb * Og * P;
        place_group_kernel<<<cuda::blocks_for(total), kThreads, 0, cuda::stream_of(out)>>>(
            static_cast<const float*>(tmp.raw_data()), total, cuda::Divider(Og, total), cuda::Divider(P, total), O,
            grp * Og, n0, static_cast<float*>(out.raw_data()));
        MN_CUDA_CHECK_LAUNCH();
      }
    }
  }
  if (bias.defined()) {
    const Tensor b = cuda::dense(bias);
    const int64_t total = out.numel();
    add_bias_kernel<<<cuda::blocks_for(total), kThreads, 0, cuda::stream_of(out)>>>(
        static_cast<float*>(out.raw_data()), static_cast<const float*>(b.raw_data()), total, cuda::Divider(O, total),
        cuda::Divider(P, total));
    MN_CUDA_CHECK_LAUNCH();
  }
}

// grad_x[n0 + nl, grp*Cg + c, iy, ix] = sum over taps (ki, kj) of col[nl, c*KH*KW + ki*KW + kj, oy*OW + ox]
// (col: contiguous [nb, K, P] of group grp). Taps in (ki, kj) order, as the CPU accumulates them.
// The divisions of col2im's index l = ((nl * Cg + c) * H + iy) * W + ix (`total` values) and of the
// tap offsets ty < H + pad_h, tx < W + pad_w by the strides.
struct ImageIndex {
  cuda::Divider width, height, group_in, stride_h, stride_w;
};

ImageIndex image_index(const Geometry& g, int64_t total) {
  return {cuda::Divider(g.width, total), cuda::Divider(g.height, total), cuda::Divider(g.group_in, total),
          cuda::Divider(g.stride_h, g.height + g.pad_h), cuda::Divider(g.stride_w, g.width + g.pad_w)};
}

__global__ void col2im_kernel(Geometry g, ImageIndex index, const float* col, int64_t n0, int64_t nb, int64_t grp,
                              float* grad_x) {
  const int64_t K = g.k(), P = g.plane();
  const int64_t image = g.height * g.width;
  const int64_t total = nb * g.group_in * image;
  MN_CUDA_KERNEL_LOOP(l, total) {
    int64_t t, ix, iy, nl, c;
    index.width.divmod(l, &t, &ix);
    index.height.divmod(t, &t, &iy);
    index.group_in.divmod(t, &nl, &c);
    const float* src = col + nl * K * P + c * g.kernel_h * g.kernel_w * P;
    float sum = 0.0f;
    for (int64_t ki = 0; ki < g.kernel_h; ++ki) {
      const int64_t ty = iy + g.pad_h - ki * g.dilation_h;
      if (ty < 0) continue;
      int64_t oy, ry;
      index.stride_h.divmod(ty, &oy, &ry);
      if (ry != 0 || oy >= g.out_h) continue;
      for (int64_t kj = 0; kj < g.kernel_w; ++kj) {
        const int64_t tx = ix + g.pad_w - kj * g.dilation_w;
        if (tx < 0) continue;
        int64_t ox, rx;
        index.stride_w.divmod(tx, &ox, &rx);
        if (rx != 0 || ox >= g.out_w) continue;
        sum += src[(ki * g.kernel_w + kj) * P + oy * g.out_w + ox];
      }
    }
    grad_x[((n0 + nl) * g.channels + grp * g.group_in + c) * image + iy * g.width + ix] = sum;
  }
}

void conv2d_backward_input_cuda(const Tensor& grad_out, const Tensor& weight, const Conv2dParams& p, Tensor& grad_x) {
  MN_CHECK(grad_x.is_contiguous(), ValueError, "conv2d backward: grad_x must be contiguous");
  const Geometry g = geometry(grad_x.sizes(), grad_x.strides(), weight.sizes(), grad_out.sizes(), p);
  if (grad_x.numel() == 0) return;
  const Device device = grad_x.device();
  cudaStream_t stream = cuda::stream_of(grad_x);
  const int64_t K = g.k(), P = g.plane(), G = g.groups, Og = g.group_out, O = g.out_channels;
  if (P == 0 || O == 0) {  // nothing reaches x
    MN_CUDA_CHECK(cudaMemsetAsync(grad_x.raw_data(), 0, grad_x.nbytes(), stream));
    return;
  }
  const Tensor w = cuda::dense(weight), go = cuda::dense(grad_out);
  const int64_t chunk = std::clamp<int64_t>(kColumnBudget / std::max<int64_t>(1, K * P), 1, g.batch);
  Tensor col = device_empty({chunk * K * P}, device);
  for (int64_t n0 = 0; n0 < g.batch; n0 += chunk) {
    const int64_t nb = std::min(chunk, g.batch - n0);
    for (int64_t grp = 0; grp < G; ++grp) {
      const Tensor a = view(w, {nb, K, Og}, {0, 1, K}, grp * Og * K);  // W_g^T
      const Tensor b = view(go, {nb, Og, P}, {O * P, P, 1}, n0 * O * P + grp * Og * P);
      Tensor dst = view(col, {nb, K, P}, {K * P, P, 1}, 0);
      gemm(device, a, b, dst, 1.0, 0.0);
      const int64_t total = nb * g.group_in * g.height * g.width;
      if (total == 0) continue;
      col2im_kernel<<<cuda::blocks_for(total), kThreads, 0, stream>>>(
          g, image_index(g, total), static_cast<const float*>(col.raw_data()), n0, nb, grp,
          static_cast<float*>(grad_x.raw_data()));
      MN_CUDA_CHECK_LAUNCH();
    }
  }
}

// go_t[o, nl, p] = go[n0 + nl, o, p]
__global__ void transpose_batch_kernel(const float* go, int64_t n0, int64_t total, cuda::Divider nb,
                                       cuda::Divider plane, int64_t channels, float* go_t) {
  MN_CUDA_KERNEL_LOOP(l, total) {
    int64_t t, p, o, nl;
    plane.divmod(l, &t, &p);
    nb.divmod(t, &o, &nl);
    go_t[l] = go[((n0 + nl) * channels + o) * plane.divisor() + p];
  }
}

void conv2d_backward_weight_cuda(const Tensor& grad_out, const Tensor& x, const Conv2dParams& p, Tensor& grad_weight,
                                 Tensor& grad_bias) {
  const Tensor go = cuda::dense(grad_out);
  cudaStream_t stream = cuda::stream_of(go);
  if (grad_bias.defined()) {
    MN_CHECK(go.dim() == 4, ValueError, "conv2d backward: expected a 4-D grad_out, got ", go.sizes());
    const int64_t batch = go.size(0), channels = go.size(1), plane = go.size(2) * go.size(3);
    MN_CHECK(grad_bias.is_contiguous() && grad_bias.numel() == channels, ValueError,
             "conv2d backward: grad_bias must be a contiguous [", channels, "], got ", grad_bias.sizes());
    // grad_bias[o] = sum over n, p of go[n, o, p]: the reduction kernels split each channel's long sum
    // over many blocks (a block per channel would leave most of the device idle) and merge in order.
    const Tensor go3 = view(go, {batch, channels, plane}, {channels * plane, plane, 1}, 0);
    reduce(go.device(), ReduceOp::Sum, go3, 0b101, grad_bias, 0.0);
  }
  if (!grad_weight.defined()) return;
  MN_CHECK(grad_weight.is_contiguous(), ValueError, "conv2d backward: grad_weight must be contiguous");
  const Geometry g = geometry(x.sizes(), x.strides(), grad_weight.sizes(), grad_out.sizes(), p);
  if (grad_weight.numel() == 0) return;
  const int64_t K = g.k(), P = g.plane(), G = g.groups, Og = g.group_out, O = g.out_channels;
  if (g.batch == 0 || P == 0) {
    MN_CUDA_CHECK(cudaMemsetAsync(grad_weight.raw_data(), 0, grad_weight.nbytes(), stream));
    return;
  }
  const Device device = x.device();
  const int64_t chunk = chunk_samples(g);
  Tensor col = device_empty({G * K * chunk * P}, device);
  Tensor go_t = device_empty({O * chunk * P}, device);
  bool first = true;
  for (int64_t n0 = 0; n0 < g.batch; n0 += chunk) {
    const int64_t nb = std::min(chunk, g.batch - n0);
    const int64_t cols = nb * P;  // the GEMM's inner dimension
    launch_im2col(g, x, n0, nb, col, P, K * cols, cols);
    const int64_t total = O * cols;
    transpose_batch_kernel<<<cuda::blocks_for(total), kThreads, 0, stream>>>(
        static_cast<const float*>(go.raw_data()), n0, total, cuda::Divider(nb, total), cuda::Divider(P, total), O,
        static_cast<float*>(go_t.raw_data()));
    MN_CUDA_CHECK_LAUNCH();
    for (int64_t grp = 0; grp < G; ++grp) {
      const Tensor a = view(go_t, {Og, cols}, {cols, 1}, grp * Og * cols);
      const Tensor b = view(col, {cols, K}, {1, cols}, grp * K * cols);  // col_g^T
      Tensor dst = view(grad_weight, {Og, K}, {K, 1}, grp * Og * K);
      gemm(device, a, b, dst, 1.0, first ? 0.0 : 1.0);
    }
    first = false;
  }
}

}  // namespace

void register_cuda_conv() {
  conv2d_forward.set(DeviceType::CUDA, &conv2d_forward_cuda);
  conv2d_backward_input.set(DeviceType::CUDA, &conv2d_backward_input_cuda);
  conv2d_backward_weight.set(DeviceType::CUDA, &conv2d_backward_weight_cuda);
}

}  // namespace mn::kernels
