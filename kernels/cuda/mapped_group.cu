// CUDA twins of the mapped-group kernels (kernels/cpu/mapped_group.cpp; formula in kernels.h). The
// forward is a tiled GEMM whose A tile is made on the fly from the signs and z (no sign-product
// buffer) and whose epilogue adds alpha |z|^2 and multiplies by the scale before the one write into
// the output; the tail rows are one warp each. The backward makes each 32-row tile's U Q product
// (U = scale * grad, read once), weights it by the signs and reduces it over the tile's rows into one
// partial per tile and column; a last kernel adds the partials in tile order. Every reduction has a
// fixed shape (no atomics), so results do not depend on scheduling; they agree with the CPU's up to
// float rounding (different summation order).
#include "kernels/cuda/compute_utils.cuh"
#include "kernels/kernels.h"

namespace mn::kernels {
namespace {

constexpr int kTile = 32;       // output tile kTile x kTile, K step kTile
constexpr int kRowsPerThread = 4;  // a block is kTile x (kTile / kRowsPerThread) threads
constexpr int kTailRows = 256;  // tail rows per partial in the backward

// c = alpha * sum(z^2) (double accumulation, fixed tree), one block.
__global__ void modulation_kernel(const float* __restrict__ z, int64_t n, double alpha, float* __restrict__ c) {
  __shared__ double sh[cuda::kThreads];
  double v = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) v += static_cast<double>(z[i]) * z[i];
  v = cuda::block_reduce(v, cuda::AddOp{}, sh);
  if (threadIdx.x == 0) *c = static_cast<float>(alpha * v);
}

using Tile = float[kTile][kTile + 1];

// acc[p] += sum over k < K of a[ty + p * blockDim.y][k] * (w's column tx at k), one kTile slab of k at
// a time: load(r, k0) fills row r of both shared tiles for the slab starting at k0 (zeros outside).
// kWByColumn: w holds the right operand as w[column][k]; otherwise as w[k][column].
template <bool kWByColumn, class Load>
__device__ void tiled_products(int64_t K, const Tile& a, const Tile& w, float (&acc)[kRowsPerThread], Load load) {
  for (int64_t k0 = 0; k0 < K; k0 += kTile) {
    for (int r = threadIdx.y; r < kTile; r += blockDim.y) load(r, k0);
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < kTile; ++kk) {
      const float wv = kWByColumn ? w[threadIdx.x][kk] : w[kk][threadIdx.x];
#pragma unroll
      for (int p = 0; p < kRowsPerThread; ++p) acc[p] += a[threadIdx.y + p * blockDim.y][kk] * wv;
    }
    __syncthreads();
  }
}

// y[b L + i] = (sum_k s[b, k] z[k] Q[i, k] + c) * scale[b L + i] for the reps x L repeated rows.
__global__ void block_forward_kernel(const float* __restrict__ q, const float* __restrict__ signs,
                                     const float* __restrict__ z, const float* __restrict__ scale,
                                     const float* __restrict__ c, int64_t reps, int64_t L, float* __restrict__ y) {
  __shared__ float a[kTile][kTile + 1];  // a[r][k] = s[b0 + r, k0 + k] z[k0 + k]
  __shared__ float w[kTile][kTile + 1];  // w[i][k] = Q[i0 + i, k0 + k]
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t i0 = static_cast<int64_t>(blockIdx.y) * kTile, b0 = static_cast<int64_t>(blockIdx.x) * kTile;
  float acc[kRowsPerThread] = {0, 0, 0, 0};
  tiled_products<true>(L, a, w, acc, [&](int r, int64_t k0) {
    const int64_t b = b0 + r, i = i0 + r, k = k0 + tx;
    a[r][tx] = b < reps && k < L ? signs[b * L + k] * z[k] : 0.0f;
    w[r][tx] = i < L && k < L ? q[i * L + k] : 0.0f;
  });
  const int64_t i = i0 + tx;
  if (i >= L) return;
  const float add = *c;
  for (int p = 0; p < kRowsPerThread; ++p) {
    const int64_t b = b0 + ty + p * blockDim.y;
    if (b >= reps) continue;
    const int64_t at = b * L + i;
    y[at] = scale ? (acc[p] + add) * scale[at] : acc[p] + add;
  }
}

// Warp reduction in a fixed order (lane 0 gets the sum).
__device__ float warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  return v;
}

// The tail rows: y[first + r] = (T[r] . z + c) * scale[first + r], one warp per row.
__global__ void tail_forward_kernel(const float* __restrict__ tail, const float* __restrict__ z,
                                    const float* __restrict__ scale, const float* __restrict__ c, int64_t rows,
                                    int64_t L, int64_t first, float* __restrict__ y) {
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= rows) return;
  float v = 0;
  for (int64_t k = lane; k < L; k += 32) v += tail[r * L + k] * z[k];
  v = warp_sum(v);
  if (lane == 0) {
    const int64_t at = first + r;
    y[at] = scale ? (v + *c) * scale[at] : v + *c;
  }
}

// partial[tile, j] = sum over the tile's 32 sign rows b of s[b, j] (sum_i u[b, i] Q[i, j]),
// u = scale * grad.
__global__ void block_backward_kernel(const float* __restrict__ q, const float* __restrict__ signs,
                                      const float* __restrict__ grad, const float* __restrict__ scale, int64_t reps,
                                      int64_t L, float* __restrict__ partial) {
  __shared__ float u[kTile][kTile + 1];  // u[r][k] = scale * grad at row b0 + r, column k0 + k
  __shared__ float w[kTile][kTile + 1];  // w[k][j] = Q[k0 + k, j0 + j]
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t j0 = static_cast<int64_t>(blockIdx.y) * kTile, b0 = static_cast<int64_t>(blockIdx.x) * kTile;
  float acc[kRowsPerThread] = {0, 0, 0, 0};
  tiled_products<false>(L, u, w, acc, [&](int r, int64_t k0) {
    const int64_t b = b0 + r, k = k0 + tx, kr = k0 + r, j = j0 + tx;
    const int64_t at = b * L + k;
    u[r][tx] = b < reps && k < L ? (scale ? grad[at] * scale[at] : grad[at]) : 0.0f;
    w[r][tx] = kr < L && j < L ? q[kr * L + j] : 0.0f;
  });
  const int64_t j = j0 + tx;
  float mine = 0;
  for (int p = 0; p < kRowsPerThread; ++p) {
    const int64_t b = b0 + ty + p * blockDim.y;
    if (b < reps && j < L) mine += signs[b * L + j] * acc[p];
  }
  u[ty][tx] = mine;  // reuse: the loop above ended with a barrier
  __syncthreads();
  if (ty == 0 && j < L) {
    float v = 0;
    for (int t = 0; t < static_cast<int>(blockDim.y); ++t) v += u[t][tx];
    partial[static_cast<int64_t>(blockIdx.x) * L + j] = v;
  }
}

// tail_partial[chunk, j] = sum over the chunk's kTailRows tail rows r of T[r, j] u[first + r].
__global__ void tail_backward_kernel(const float* __restrict__ tail, const float* __restrict__ grad,
                                     const float* __restrict__ scale, int64_t rows, int64_t L, int64_t first,
                                     float* __restrict__ partial) {
  const int64_t j = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (j >= L) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTailRows, r1 = min(rows, r0 + kTailRows);
  float v = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t at = first + r;
    v += tail[r * L + j] * (scale ? grad[at] * scale[at] : grad[at]);
  }
  partial[static_cast<int64_t>(blockIdx.x) * L + j] = v;
}

// sums[block] = sum of u over the block's grid-stride share of the n values (double).
__global__ void scaled_sum_kernel(const float* __restrict__ grad, const float* __restrict__ scale, int64_t n,
                                  double* __restrict__ sums) {
  __shared__ double sh[cuda::kThreads];
  double v = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    v += scale ? grad[i] * scale[i] : grad[i];
  v = cuda::block_reduce(v, cuda::AddOp{}, sh);
  if (threadIdx.x == 0) sums[blockIdx.x] = v;
}

// grad_z[j] = the partials in order + 2 alpha z[j] sum(u).
__global__ void combine_kernel(const float* __restrict__ partial, int64_t parts, const double* __restrict__ sums,
                               int64_t sum_blocks, const float* __restrict__ z, double alpha, int64_t L,
                               float* __restrict__ grad_z) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= L) return;
  double v = 0, total = 0;
  for (int64_t p = 0; p < parts; ++p) v += partial[p * L + j];
  for (int64_t s = 0; s < sum_blocks; ++s) total += sums[s];
  grad_z[j] = static_cast<float>(v + 2.0 * alpha * total * z[j]);
}

struct Operands {
  int64_t L = 0, reps = 0, tail_rows = 0, rows = 0;
};

Operands check_operands(const char* op, const Tensor& block, const Tensor& signs, const Tensor& tail,
                        const Tensor& scale, const Tensor& z, const Tensor& out, int64_t out_n) {
  MN_CHECK(out.device().is_cuda(), DeviceError, op, ": expected the output on a CUDA device, got ", out.device());
  MN_CHECK(tail.defined() && tail.dim() == 2 && z.defined() && z.dim() == 1 && block.defined() == signs.defined(),
           ValueError, op, ": expected a 2-D tail, a 1-D latent, and block and signs together");
  Operands s;
  s.L = z.size(0);
  s.reps = signs.defined() ? signs.size(0) : 0;
  s.tail_rows = tail.size(0);
  s.rows = s.reps * s.L + s.tail_rows;
  auto check = [&](const Tensor& t, const char* name, std::initializer_list<int64_t> sizes) {
    cuda::check_on_device(op, t, out.device().index, name);
    bool ok = t.dtype() == DType::f32 && t.is_contiguous() && t.dim() == static_cast<int64_t>(sizes.size());
    int d = 0;
    for (int64_t n : sizes) ok = ok && t.size(d++) == n;
    MN_CHECK(ok, ValueError, op, ": ", name, " must be a contiguous f32 tensor of the group's shape, got ", t.dtype(),
             t.sizes());
  };
  check(z, "z", {s.L});
  check(tail, "tail", {s.tail_rows, s.L});
  if (block.defined()) {
    check(block, "block", {s.L, s.L});
    check(signs, "signs", {s.reps, s.L});
  }
  if (scale.defined()) check(scale, "scale", {s.rows});
  MN_CHECK(out.dtype() == DType::f32 && out.is_contiguous() && out.numel() == out_n, ValueError, op,
           ": expected a contiguous f32 result of ", out_n, " values, got ", out.dtype(), out.sizes());
  return s;
}

const float* ptr_or_null(const Tensor& t) { return t.defined() ? static_cast<const float*>(t.raw_data()) : nullptr; }

void mapped_group_forward_cuda(const Tensor& block, const Tensor& signs, const Tensor& tail, const Tensor& scale,
                               double alpha, const Tensor& z, Tensor& out) {
  const int64_t rows = (signs.defined() ? signs.size(0) * z.size(0) : 0) + (tail.defined() ? tail.size(0) : 0);
  const Operands s = check_operands("mapped_group_forward", block, signs, tail, scale, z, out, rows);
  cudaStream_t stream = cuda::stream_of(out);
  const Tensor c = cuda::scratch_bytes(8, out.device());
  float* cp = cuda::scratch_ptr<float>(c);
  const float* zp = ptr_or_null(z);
  float* y = static_cast<float*>(out.raw_data());
  modulation_kernel<<<1, cuda::kThreads, 0, stream>>>(zp, s.L, alpha, cp);
  MN_CUDA_CHECK_LAUNCH();
  if (s.reps > 0) {
    // Row tiles in x (up to 2^31 - 1 blocks), column tiles in y (L / 32, far below 65,535).
    const dim3 grid(static_cast<unsigned>((s.reps + kTile - 1) / kTile), static_cast<unsigned>((s.L + kTile - 1) / kTile));
    block_forward_kernel<<<grid, dim3(kTile, kTile / kRowsPerThread), 0, stream>>>(
        ptr_or_null(block), ptr_or_null(signs), zp, ptr_or_null(scale), cp, s.reps, s.L, y);
    MN_CUDA_CHECK_LAUNCH();
  }
  if (s.tail_rows > 0) {
    const int64_t rows_per_block = cuda::kThreads / 32;
    tail_forward_kernel<<<static_cast<unsigned>((s.tail_rows + rows_per_block - 1) / rows_per_block), cuda::kThreads,
                          0, stream>>>(ptr_or_null(tail), zp, ptr_or_null(scale), cp, s.tail_rows, s.L,
                                       s.reps * s.L, y);
    MN_CUDA_CHECK_LAUNCH();
  }
}

void mapped_group_backward_cuda(const Tensor& block, const Tensor& signs, const Tensor& tail, const Tensor& scale,
                                double alpha, const Tensor& z, const Tensor& grad, Tensor& grad_z) {
  const Operands s = check_operands("mapped_group_backward", block, signs, tail, scale, z, grad_z, z.size(0));
  MN_CHECK(grad.dtype() == DType::f32 && grad.is_contiguous() && grad.numel() == s.rows, ValueError,
           "mapped_group_backward: expected a contiguous f32 gradient of ", s.rows, " values, got ", grad.dtype(),
           grad.sizes());
  cuda::check_on_device("mapped_group_backward", grad, grad_z.device().index, "grad");
  cudaStream_t stream = cuda::stream_of(grad_z);
  const int64_t block_tiles = (s.reps + kTile - 1) / kTile, tail_chunks = (s.tail_rows + kTailRows - 1) / kTailRows;
  const int64_t parts = block_tiles + tail_chunks;
  const int64_t sum_blocks = std::min<int64_t>(1024, std::max<int64_t>(1, (s.rows + 4 * cuda::kThreads - 1) /
                                                                               (4 * cuda::kThreads)));
  const Tensor partial = cuda::scratch_bytes(std::max<int64_t>(1, parts * s.L) * 4, grad_z.device());
  const Tensor sums = cuda::scratch_bytes(sum_blocks * 8, grad_z.device());
  float* pp = cuda::scratch_ptr<float>(partial);
  const float* g = ptr_or_null(grad);
  const float* sc = ptr_or_null(scale);
  const unsigned col_tiles = static_cast<unsigned>((s.L + kTile - 1) / kTile);
  if (block_tiles > 0) {
    block_backward_kernel<<<dim3(static_cast<unsigned>(block_tiles), col_tiles), dim3(kTile, kTile / kRowsPerThread),
                            0, stream>>>(ptr_or_null(block), ptr_or_null(signs), g, sc, s.reps, s.L, pp);
    MN_CUDA_CHECK_LAUNCH();
  }
  if (tail_chunks > 0) {
    tail_backward_kernel<<<dim3(static_cast<unsigned>(tail_chunks), cuda::blocks_for(s.L)), cuda::kThreads, 0,
                           stream>>>(ptr_or_null(tail), g, sc, s.tail_rows, s.L, s.reps * s.L,
                                     pp + block_tiles * s.L);
    MN_CUDA_CHECK_LAUNCH();
  }
  scaled_sum_kernel<<<static_cast<unsigned>(sum_blocks), cuda::kThreads, 0, stream>>>(
      g, sc, s.rows, cuda::scratch_ptr<double>(sums));
  MN_CUDA_CHECK_LAUNCH();
  combine_kernel<<<cuda::blocks_for(s.L), cuda::kThreads, 0, stream>>>(
      pp, parts, cuda::scratch_ptr<double>(sums), sum_blocks, ptr_or_null(z), alpha, s.L,
      static_cast<float*>(grad_z.raw_data()));
  MN_CUDA_CHECK_LAUNCH();
}

}  // namespace

void register_cuda_mapped_group() {
  mapped_group_forward.set(DeviceType::CUDA, mapped_group_forward_cuda);
  mapped_group_backward.set(DeviceType::CUDA, mapped_group_backward_cuda);
}

}  // namespace mn::kernels
