// CUDA twins of the srht kernels (kernels/cpu/srht.cpp, math in kernels/srht_math.h): one thread block
// per Hadamard block, working in a global scratch row of 2P floats, with a barrier between the FWHT
// stages. Every float step is the CPU's (same butterfly order, explicit __fmul_rn / __fadd_rn so nvcc
// fuses nothing), and the transpose adds the blocks in block order, so results are bitwise the CPU's.
#include "kernels/cuda/compute_utils.cuh"
#include "kernels/kernels.h"
#include "kernels/srht_math.h"

namespace mn::kernels {
namespace {

constexpr int kSrhtThreads = 256;

__device__ void fwht_block(float* x, int64_t n) {
  for (int64_t h = 1; h < n; h <<= 1) {
    for (int64_t q = threadIdx.x; q < n / 2; q += blockDim.x) {
      const int64_t j = (q / h) * 2 * h + q % h;
      const float a = x[j], b = x[j + h];
      x[j] = __fadd_rn(a, b);
      x[j + h] = __fsub_rn(a, b);
    }
    __syncthreads();
  }
}

__device__ float v_of(const SrhtPlan& p, int64_t b, const SrhtPerm& perm, const float* x, int64_t i) {
  return srht_sign(p, SrhtDraw::OutputSigns, b, i) * x[perm(i)];
}

__global__ void srht_forward_kernel(SrhtPlan p, const float* __restrict__ z, float* __restrict__ y,
                                    float* __restrict__ scratch) {
  const int64_t b = blockIdx.x, P = p.pow2, r = p.tail;
  float* x = scratch + b * 2 * P;
  float* t = x + P;
  for (int64_t i = threadIdx.x; i < P; i += blockDim.x)
    x[i] = i < p.cols ? srht_sign(p, SrhtDraw::InputSigns, b, i) * z[i] : 0.0f;
  __syncthreads();
  fwht_block(x, P);
  const SrhtPerm perm = srht_perm(p, b);
  float* out = y + b * P;
  if (b + 1 < p.blocks || r == 0) {
    for (int64_t i = threadIdx.x; i < P; i += blockDim.x) out[i] = __fmul_rn(p.scale, v_of(p, b, perm, x, i));
    return;
  }
  for (int64_t i = threadIdx.x; i < r; i += blockDim.x) out[i] = __fmul_rn(p.tail_head, v_of(p, b, perm, x, i));
  for (int64_t j = threadIdx.x; j < P; j += blockDim.x) {
    const float moved = r + j < P ? v_of(p, b, perm, x, r + j) : __fmul_rn(p.split, v_of(p, b, perm, x, r + j - P));
    t[j] = srht_sign(p, SrhtDraw::TailSigns, b, j) * moved;
  }
  __syncthreads();
  fwht_block(t, P);
  for (int64_t j = threadIdx.x; j < P; j += blockDim.x) out[r + j] = __fmul_rn(p.tail_mix, t[j]);
}

__global__ void srht_transpose_kernel(SrhtPlan p, const float* __restrict__ u, float* __restrict__ partial,
                                      float* __restrict__ scratch) {
  const int64_t b = blockIdx.x, P = p.pow2, r = p.tail, L = p.cols;
  float* x = scratch + b * 2 * P;
  float* t = x + P;
  const float* in = u + b * P;
  const SrhtPerm perm = srht_perm(p, b);
  if (b + 1 < p.blocks || r == 0) {
    for (int64_t i = threadIdx.x; i < P; i += blockDim.x)
      x[perm(i)] = srht_sign(p, SrhtDraw::OutputSigns, b, i) * __fmul_rn(p.scale, in[i]);
  } else {
    for (int64_t j = threadIdx.x; j < P; j += blockDim.x) t[j] = __fmul_rn(p.tail_mix, in[r + j]);
    __syncthreads();
    fwht_block(t, P);
    for (int64_t i = threadIdx.x; i < P; i += blockDim.x) {
      float v;
      if (i < r) {
        const float moved = srht_sign(p, SrhtDraw::TailSigns, b, P - r + i) * t[P - r + i];
        v = __fadd_rn(__fmul_rn(p.tail_head, in[i]), __fmul_rn(p.split, moved));
      } else {
        v = srht_sign(p, SrhtDraw::TailSigns, b, i - r) * t[i - r];
      }
      x[perm(i)] = srht_sign(p, SrhtDraw::OutputSigns, b, i) * v;
    }
  }
  __syncthreads();
  fwht_block(x, P);
  for (int64_t j = threadIdx.x; j < L; j += blockDim.x)
    partial[b * L + j] = srht_sign(p, SrhtDraw::InputSigns, b, j) * x[j];
}

// g_j = sum over blocks of partial[b, j], in block order from 0 (the CPU's order).
__global__ void srht_sum_blocks_kernel(const float* __restrict__ partial, int64_t blocks, int64_t L,
                                       float* __restrict__ g) {
  MN_CUDA_KERNEL_LOOP(j, L) {
    float acc = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) acc = __fadd_rn(acc, partial[b * L + j]);
    g[j] = acc;
  }
}

void check_operands(const char* op, const SrhtPlan& p, const Tensor& in, int64_t in_n, const Tensor& out,
                    int64_t out_n) {
  MN_CHECK(p.pow2 > 0 && (p.pow2 & (p.pow2 - 1)) == 0 && p.cols <= p.pow2 && p.blocks >= 1 && p.tail >= 0 &&
               p.tail < p.pow2 && p.blocks * p.pow2 + p.tail == p.rows && p.blocks <= 0x7fffffff,
           ValueError, op, ": inconsistent plan (rows ", p.rows, ", cols ", p.cols, ", P ", p.pow2, ", blocks ",
           p.blocks, ", tail ", p.tail, ")");
  MN_CHECK(out.device().is_cuda(), DeviceError, op, ": expected the output on a CUDA device, got ", out.device());
  cuda::check_on_device(op, in, out.device().index, "input");
  MN_CHECK(in.dtype() == DType::f32 && in.dim() == 1 && in.size(0) == in_n && in.is_contiguous(), ValueError, op,
           ": expected a contiguous f32 input of shape [", in_n, "], got ", in.dtype(), in.sizes());
  MN_CHECK(out.dtype() == DType::f32 && out.dim() == 1 && out.size(0) == out_n && out.is_contiguous(), ValueError,
           op, ": expected a contiguous f32 output of shape [", out_n, "], got ", out.dtype(), out.sizes());
}

void srht_apply_cuda(const SrhtPlan& p, const Tensor& z, Tensor& y) {
  check_operands("srht_apply", p, z, p.cols, y, p.rows);
  const Tensor scratch = cuda::scratch_bytes(p.blocks * 2 * p.pow2 * 4, y.device());
  srht_forward_kernel<<<static_cast<unsigned>(p.blocks), kSrhtThreads, 0, cuda::stream_of(y)>>>(
      p, static_cast<const float*>(z.raw_data()), static_cast<float*>(y.raw_data()),
      cuda::scratch_ptr<float>(scratch));
  MN_CUDA_CHECK_LAUNCH();
}

void srht_apply_transpose_cuda(const SrhtPlan& p, const Tensor& u, Tensor& g) {
  check_operands("srht_apply_transpose", p, u, p.rows, g, p.cols);
  const Tensor scratch = cuda::scratch_bytes(p.blocks * 2 * p.pow2 * 4, g.device());
  const Tensor partial = cuda::scratch_bytes(p.blocks * p.cols * 4, g.device());
  cudaStream_t stream = cuda::stream_of(g);
  srht_transpose_kernel<<<static_cast<unsigned>(p.blocks), kSrhtThreads, 0, stream>>>(
      p, static_cast<const float*>(u.raw_data()), cuda::scratch_ptr<float>(partial), cuda::scratch_ptr<float>(scratch));
  MN_CUDA_CHECK_LAUNCH();
  srht_sum_blocks_kernel<<<cuda::blocks_for(p.cols), cuda::kThreads, 0, stream>>>(
      cuda::scratch_ptr<float>(partial), p.blocks, p.cols, static_cast<float*>(g.raw_data()));
  MN_CUDA_CHECK_LAUNCH();
}

}  // namespace

void register_cuda_srht() {
  srht_apply.set(DeviceType::CUDA, srht_apply_cuda);
  srht_apply_transpose.set(DeviceType::CUDA, srht_apply_transpose_cuda);
}

}  // namespace mn::kernels
