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

__global__ void adam_amsgrad_kernel(float* __restrict__ w, const float* __restrict__ g, float* __restrict__ m,
                                    float* __restrict__ v, float* __restrict__ vmax, AdamCoefficients k, int64_t n) {
  MN_CUDA_KERNEL_LOOP(i, n) { adam_amsgrad_update(w[i], g[i], m[i], v[i], vmax[i], k); }
}

// b == nullptr: no momentum buffer; ga == nullptr: not centered.
__global__ void rmsprop_kernel(float* __restrict__ w, const float* __restrict__ g, float* __restrict__ sq,
                               float* __restrict__ b, float* __restrict__ ga, RmspropCoefficients k, int64_t n) {
  MN_CUDA_KERNEL_LOOP(i, n) {
    rmsprop_update(w[i], g[i], sq[i], b != nullptr ? b + i : nullptr, ga != nullptr ? ga + i : nullptr, k);
  }
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

void adam_amsgrad_cuda(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                       Tensor& max_exp_avg_sq, const AdamParams& p) {
  check_adam_amsgrad_operands(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq);
  const int64_t n = param.numel();
  if (n == 0) return;
  adam_amsgrad_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream_of(param)>>>(
      param.data<float>(), grad.data<float>(), exp_avg.data<float>(), exp_avg_sq.data<float>(),
      max_exp_avg_sq.data<float>(), adam_coefficients(p), n);
  MN_CUDA_CHECK_LAUNCH();
}

void rmsprop_cuda(Tensor& param, const Tensor& grad, Tensor& square_avg, Tensor& buf, Tensor& grad_avg,
                  const RmspropParams& p) {
  check_rmsprop_operands(param, grad, square_avg, buf, grad_avg, p);
  const int64_t n = param.numel();
  if (n == 0) return;
  rmsprop_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream_of(param)>>>(
      param.data<float>(), grad.data<float>(), square_avg.data<float>(), buf.defined() ? buf.data<float>() : nullptr,
      grad_avg.defined() ? grad_avg.data<float>() : nullptr, rmsprop_coefficients(p), n);
  MN_CUDA_CHECK_LAUNCH();
}

}  // namespace

void register_cuda_optim() {
  adam_step.set(DeviceType::CUDA, adam_cuda);
  sgd_step.set(DeviceType::CUDA, sgd_cuda);
  adam_amsgrad_step.set(DeviceType::CUDA, adam_amsgrad_cuda);
  rmsprop_step.set(DeviceType::CUDA, rmsprop_cuda);
}

}  // namespace mn::kernels
