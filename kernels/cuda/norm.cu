// CUDA row normalisation (layer norm and group norm, RowNormLayout in kernels/kernels.h). Twin of
// kernels/cpu/norm.cpp.
//
// Forward and grad_x: one block of kThreads threads per row (blocks stride over the rows); threads
// stride over the row and their float partial sums meet in a fixed double tree (cuda::block_reduce):
// mean first, then the squared deviations from it (two passes, no cancellation), then the output.
// grad_weight / grad_bias: one thread per (channel, chunk of batch entries) sums g * x_hat and g over
// its chunk (neighbouring threads take neighbouring channels, so layer norm reads coalesced rows),
// and a second kernel adds the chunks of each channel in order, in double. No atomics; every split
// depends on the shapes only, so results are reproducible run to run.
#include <cmath>

#include "kernels/cuda/compute_utils.cuh"
#include "kernels/norm_check.h"

namespace mn::kernels {
namespace {

using cuda::kThreads;

// Elements one thread of the affine-gradient kernel sums (about).
constexpr int64_t kChunkElements = 256;

const float* data_or_null(const Tensor& t) { return t.defined() ? static_cast<const float*>(t.raw_data()) : nullptr; }
float* mutable_or_null(const Tensor& t) { return t.defined() ? static_cast<float*>(t.raw_data()) : nullptr; }

void require_contiguous(const Tensor& t, const char* kernel, const char* arg) {
  MN_CHECK(!t.defined() || t.is_contiguous(), ValueError, kernel, ": output '", arg, "' must be contiguous, got shape ",
           t.sizes(), " with strides ", t.strides());
}

void check_devices(const char* kernel, int device, std::initializer_list<std::pair<const Tensor*, const char*>> ts) {
  for (const auto& [t, name] : ts)
    if (t->defined()) cuda::check_on_device(kernel, *t, device, name);
}

// The layout by value for the kernels.
struct Rows {
  int64_t rows, n, groups, inner, per_group;
  // Channel of element j of row r.
  __device__ int64_t channel(int64_t r, int64_t j) const {
    const int64_t first = (r % groups) * per_group;
    return inner == 1 ? first + j : first + j / inner;
  }
};

Rows rows_of(const RowNormLayout& s) { return {s.rows, s.row_len, s.groups, s.inner, s.row_len / s.inner}; }

__global__ void forward_kernel(const float* x, const float* w, const float* b, Rows s, double eps, float* y,
                               float* mean, float* rstd) {
  __shared__ double sh[kThreads];
  for (int64_t r = blockIdx.x; r < s.rows; r += gridDim.x) {
    const float* row = x + r * s.n;
    float* out = y + r * s.n;
    float part = 0.0f;
    for (int64_t j = threadIdx.x; j < s.n; j += blockDim.x) part += row[j];
    const float m = static_cast<float>(cuda::block_reduce<double>(part, cuda::AddOp{}, sh) / static_cast<double>(s.n));
    part = 0.0f;
    for (int64_t j = threadIdx.x; j < s.n; j += blockDim.x) {
      const float d = row[j] - m;
      part += d * d;
    }
    const double var = cuda::block_reduce<double>(part, cuda::AddOp{}, sh) / static_cast<double>(s.n);
    const float k = static_cast<float>(1.0 / sqrt(var + eps));
    if (threadIdx.x == 0) {
      mean[r] = m;
      rstd[r] = k;
    }
    for (int64_t j = threadIdx.x; j < s.n; j += blockDim.x) {
      float v = (row[j] - m) * k;
      if (w != nullptr || b != nullptr) {
        const int64_t c = s.channel(r, j);
        if (w != nullptr) v *= w[c];
        if (b != nullptr) v += b[c];
      }
      out[j] = v;
    }
  }
}

// grad_x = rstd * (dy - mean(dy) - x_hat * mean(dy * x_hat)), dy = g * weight.
__global__ void grad_input_kernel(const float* g, const float* x, const float* w, const float* mean,
                                  const float* rstd, Rows s, float* gx) {
  __shared__ double sh[kThreads];
  for (int64_t r = blockIdx.x; r < s.rows; r += gridDim.x) {
    const float* gr = g + r * s.n;
    const float* xr = x + r * s.n;
    const float m = mean[r], k = rstd[r];
    float part_dy = 0.0f, part_dy_xhat = 0.0f;
    for (int64_t j = threadIdx.x; j < s.n; j += blockDim.x) {
      const float dy = w != nullptr ? gr[j] * w[s.channel(r, j)] : gr[j];
      part_dy += dy;
      part_dy_xhat += dy * (xr[j] - m) * k;
    }
    const float a = static_cast<float>(cuda::block_reduce<double>(part_dy, cuda::AddOp{}, sh) / s.n);
    const float c = static_cast<float>(cuda::block_reduce<double>(part_dy_xhat, cuda::AddOp{}, sh) / s.n);
    float* out = gx + r * s.n;
    for (int64_t j = threadIdx.x; j < s.n; j += blockDim.x) {
      const float dy = w != nullptr ? gr[j] * w[s.channel(r, j)] : gr[j];
      out[j] = k * (dy - a - (xr[j] - m) * k * c);
    }
  }
}

// Thread (chunk q, channel c): sums over batch entries [q * chunk, (q + 1) * chunk) of the values of
// channel c, into partial[q][0][c] (g * x_hat) and partial[q][1][c] (g).
__global__ void affine_partial_kernel(const float* g, const float* x, const float* mean, const float* rstd, Rows s,
                                      int64_t batch, int64_t chunk, int64_t chunks, float* partial) {
  const int64_t channels = s.groups * s.per_group;
  MN_CUDA_KERNEL_LOOP(t, chunks * channels) {
    const int64_t q = t / channels, c = t % channels;
    const int64_t group = c / s.per_group, offset = (c % s.per_group) * s.inner;
    const int64_t end = min(batch, (q + 1) * chunk);
    float sum_w = 0.0f, sum_b = 0.0f;
    for (int64_t e = q * chunk; e < end; ++e) {
      const int64_t r = e * s.groups + group;
      const float m = mean[r], k = rstd[r];
      const float* gr = g + r * s.n + offset;
      const float* xr = x + r * s.n + offset;
      for (int64_t i = 0; i < s.inner; ++i) {
        sum_w += gr[i] * (xr[i] - m) * k;
        sum_b += gr[i];
      }
    }
    partial[(2 * q) * channels + c] = sum_w;
    partial[(2 * q + 1) * channels + c] = sum_b;
  }
}

__global__ void affine_merge_kernel(const float* partial, int64_t channels, int64_t chunks, float* gw, float* gb) {
  MN_CUDA_KERNEL_LOOP(c, channels) {
    double tw = 0, tb = 0;
    for (int64_t q = 0; q < chunks; ++q) {
      tw += partial[(2 * q) * channels + c];
      tb += partial[(2 * q + 1) * channels + c];
    }
    if (gw != nullptr) gw[c] = static_cast<float>(tw);
    if (gb != nullptr) gb[c] = static_cast<float>(tb);
  }
}

void row_norm_forward_cuda(const Tensor& x_in, const Tensor& weight, const Tensor& bias, const RowNormLayout& s,
                           double eps, Tensor& out, Tensor& mean, Tensor& rstd) {
  check_row_norm_layout(s, x_in, weight, "row_norm_forward");
  require_contiguous(out, "row_norm_forward", "out");
  require_contiguous(mean, "row_norm_forward", "mean");
  require_contiguous(rstd, "row_norm_forward", "rstd");
  check_devices("row_norm_forward", out.device().index,
                {{&x_in, "x"}, {&weight, "weight"}, {&bias, "bias"}, {&mean, "mean"}, {&rstd, "rstd"}});
  if (s.rows == 0) return;
  const Tensor x = cuda::dense(x_in), w = cuda::dense(weight), b = cuda::dense(bias);
  forward_kernel<<<cuda::grid_for_blocks(s.rows), kThreads, 0, cuda::stream_of(out)>>>(
      static_cast<const float*>(x.raw_data()), data_or_null(w), data_or_null(b), rows_of(s), eps,
      static_cast<float*>(out.raw_data()), static_cast<float*>(mean.raw_data()), static_cast<float*>(rstd.raw_data()));
  MN_CUDA_CHECK_LAUNCH();
}

void row_norm_backward_cuda(const Tensor& grad_out, const Tensor& x_in, const Tensor& weight, const Tensor& mean_in,
                            const Tensor& rstd_in, const RowNormLayout& s, Tensor& grad_x, Tensor& grad_weight,
                            Tensor& grad_bias) {
  check_row_norm_layout(s, x_in, weight, "row_norm_backward");
  require_contiguous(grad_x, "row_norm_backward", "grad_x");
  require_contiguous(grad_weight, "row_norm_backward", "grad_weight");
  require_contiguous(grad_bias, "row_norm_backward", "grad_bias");
  const int device = x_in.device().index;
  check_devices("row_norm_backward", device,
                {{&grad_out, "grad_out"}, {&x_in, "x"}, {&weight, "weight"}, {&mean_in, "mean"}, {&rstd_in, "rstd"},
                 {&grad_x, "grad_x"}, {&grad_weight, "grad_weight"}, {&grad_bias, "grad_bias"}});
  const Tensor x = cuda::dense(x_in), g = cuda::dense(grad_out), w = cuda::dense(weight);
  const Tensor mean = cuda::dense(mean_in), rstd = cuda::dense(rstd_in);
  const float* xp = static_cast<const float*>(x.raw_data());
  const float* gp = static_cast<const float*>(g.raw_data());
  const float* mp = static_cast<const float*>(mean.raw_data());
  const float* kp = static_cast<const float*>(rstd.raw_data());
  cudaStream_t stream = cuda::stream_of(x);
  const Rows rows = rows_of(s);
  if (grad_x.defined() && s.rows > 0) {
    grad_input_kernel<<<cuda::grid_for_blocks(s.rows), kThreads, 0, stream>>>(gp, xp, data_or_null(w), mp, kp, rows,
                                                                              mutable_or_null(grad_x));
    MN_CUDA_CHECK_LAUNCH();
  }
  if (!grad_weight.defined() && !grad_bias.defined()) return;
  const int64_t channels = s.channels();
  if (channels == 0) return;
  const int64_t batch = s.rows / s.groups;
  const int64_t chunk = std::max<int64_t>(1, kChunkElements / s.inner);
  const int64_t chunks = std::max<int64_t>(1, (batch + chunk - 1) / chunk);
  Tensor partial = cuda::scratch_bytes(2 * chunks * channels * static_cast<int64_t>(sizeof(float)), x.device());
  float* pp = cuda::scratch_ptr<float>(partial);
  affine_partial_kernel<<<cuda::blocks_for(chunks * channels), kThreads, 0, stream>>>(gp, xp, mp, kp, rows, batch,
                                                                                     chunk, chunks, pp);
  MN_CUDA_CHECK_LAUNCH();
  affine_merge_kernel<<<cuda::blocks_for(channels), kThreads, 0, stream>>>(pp, channels, chunks,
                                                                           mutable_or_null(grad_weight),
                                                                           mutable_or_null(grad_bias));
  MN_CUDA_CHECK_LAUNCH();
}

}  // namespace

void register_cuda_norm() {
  row_norm_forward.set(DeviceType::CUDA, &row_norm_forward_cuda);
  row_norm_backward.set(DeviceType::CUDA, &row_norm_backward_cuda);
}

}  // namespace mn::kernels
