// CUDA twins of the gradient scaler's kernels (kernels/cpu/amp.cpp; math and checks in
// kernels/amp_math.h). The unscale reads inv_scale and writes found_inf in device memory, so a step
// needs no host read until the scaler decides whether to apply it; results equal the CPU's bit for bit
// (one multiply per element, and the update in double as on the host).
#include "kernels/amp_math.h"
#include "kernels/cuda/common.cuh"
#include "kernels/kernels.h"

namespace mn::kernels {
namespace {

// Every thread that meets a non-finite element stores 1: the stores race only with each other, all
// with the same value.
__global__ void non_finite_check_and_unscale_kernel(float* __restrict__ g, float* __restrict__ found_inf,
                                                    const float* __restrict__ inv_scale, int64_t n) {
  const float inv = *inv_scale;
  bool found = false;
  MN_CUDA_KERNEL_LOOP(i, n) { found |= unscale_element(g[i], inv); }
  if (found) *found_inf = 1.0f;
}

__global__ void amp_update_scale_kernel(float* scale, int64_t* growth_tracker, const float* found_inf,
                                        double growth_factor, double backoff_factor, int64_t growth_interval) {
  update_scale(*scale, *growth_tracker, *found_inf, growth_factor, backoff_factor, growth_interval);
}

void non_finite_check_and_unscale_cuda(Tensor& grad, Tensor& found_inf, const Tensor& inv_scale) {
  check_unscale_operands(grad, found_inf, inv_scale);
  const int64_t n = grad.numel();
  if (n == 0) return;
  non_finite_check_and_unscale_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream_of(grad)>>>(
      grad.data<float>(), found_inf.data<float>(), inv_scale.data<float>(), n);
  MN_CUDA_CHECK_LAUNCH();
}

void amp_update_scale_cuda(Tensor& scale, Tensor& growth_tracker, const Tensor& found_inf, double growth_factor,
                           double backoff_factor, int64_t growth_interval) {
  check_update_scale_operands(scale, growth_tracker, found_inf);
  amp_update_scale_kernel<<<1, 1, 0, cuda::stream_of(scale)>>>(scale.data<float>(), growth_tracker.data<int64_t>(),
                                                             found_inf.data<float>(), growth_factor, backoff_factor,
                                                             growth_interval);
  MN_CUDA_CHECK_LAUNCH();
}

}  // namespace

void register_cuda_amp() {
  non_finite_check_and_unscale.set(DeviceType::CUDA, non_finite_check_and_unscale_cuda);
  amp_update_scale.set(DeviceType::CUDA, amp_update_scale_cuda);
}

}  // namespace mn::kernels
