// CUDA twins of the fused optimizer updates (kernels/cpu/optim.cpp): the same operand checks,
// host-side coefficients and per-element float math (kernels/optim_update.h), one thread per element.
// Results agree with the CPU to float rounding (nvcc may fuse a multiply-add the CPU build keeps
// separate), not bitwise.
#include "kernels/cuda/common.cuh"
#include "kernels/kernels.h"
#include "kernels/optim_update.h"

namespace mn::kernels {
namespace {

__global__ void adam_kernel(float* __restrict__ w, const float* __restrict__ g, float* __restrict__ m,
                            float* __restrict__ v, AdamCoefficients k, int64_t n) {
  MN_CUDA_KERNEL_LOOP(i, n) { adam_update(w[i], g[i], m[i], v[i], k); }
}

// b == nullptr: no momentum buffer (momentum 0).
__global__ void sgd_kernel(float* __restrict__ w, const float* __restrict__ g, float* __restrict__ b,
                           SgdCoefficients k, int64_t n) {
  MN_CUDA_KERNEL_LOOP(i, n) { sgd_update(w[i], g[i], b != nullptr ? b + i : nullptr, k); }
}

void adam_cuda(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamParams& p) {
  check_adam_operands(param, grad, exp_avg, exp_avg_sq);
  const int64_t n = param.numel();
  if (n == 0) return;
  adam_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream_of(param)>>>(
      param.data<float>(), grad.data<float>(), exp_avg.data<float>(), exp_avg_sq.data<float>(),
      adam_coefficients(p), n);
  MN_CUDA_CHECK_LAUNCH();
}

void sgd_cuda(Tensor& param, const Tensor& grad, Tensor& buf, const SgdParams& p) {
  check_sgd_operands(param, grad, buf);
  const int64_t n = param.numel();
  if (n == 0) return;
  sgd_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream_of(param)>>>(
      param.data<float>(), grad.data<float>(), buf.defined() ? buf.data<float>() : nullptr, sgd_coefficients(p), n);
  MN_CUDA_CHECK_LAUNCH();
}

}  // namespace

void register_cuda_optim() {
  adam_step.set(DeviceType::CUDA, adam_cuda);
  sgd_step.set(DeviceType::CUDA, sgd_cuda);
}

}  // namespace mn::kernels
