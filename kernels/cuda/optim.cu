// CUDA twins of the fused optimizer updates (kernels/cpu/optim.cpp): the same per-element float math
// with the same host-side constants (bias corrections in double, then rounded to float), one thread
// per element. Results agree with the CPU to float rounding (nvcc may fuse a multiply-add the CPU
// build keeps separate), not bitwise.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/kernels.h"

namespace mn::kernels {
namespace {

struct AdamConstants {
  float b1, b2, step_size, inv_sqrt_bc2, eps, wd, decay;
  bool decoupled;
};

__global__ void adam_kernel(float* __restrict__ w, const float* __restrict__ g, float* __restrict__ m,
                            float* __restrict__ v, AdamConstants k, int64_t n) {
  MN_CUDA_KERNEL_LOOP(i, n) {
    float gi = g[i];
    float wi = w[i];
    if (k.wd != 0.0f) {
      if (k.decoupled)
        wi *= k.decay;
      else
        gi += k.wd * wi;
    }
    const float mi = k.b1 * m[i] + (1.0f - k.b1) * gi;
    const float vi = k.b2 * v[i] + (1.0f - k.b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    w[i] = wi - k.step_size * mi / (sqrtf(vi) * k.inv_sqrt_bc2 + k.eps);
  }
}

struct SgdConstants {
  float lr, mom, damp, wd;
  bool nesterov, first_step;
};

// b == nullptr: no momentum buffer (momentum 0).
__global__ void sgd_kernel(float* __restrict__ w, const float* __restrict__ g, float* __restrict__ b, SgdConstants k,
                           int64_t n) {
  MN_CUDA_KERNEL_LOOP(i, n) {
    float gi = g[i] + k.wd * w[i];
    if (b != nullptr) {
      const float bi = k.first_step ? gi : k.mom * b[i] + k.damp * gi;
      b[i] = bi;
      gi = k.nesterov ? gi + k.mom * bi : bi;
    }
    w[i] -= k.lr * gi;
  }
}

void check_state(const char* op, const Tensor& param, const Tensor& t, const char* name) {
  cuda::check_on_device(op, t, param.device().index, name);
  MN_CHECK(t.dtype() == DType::f32 && t.is_contiguous() && t.sizes() == param.sizes(), ValueError, op,
           ": expected '", name, "' to be a contiguous f32 tensor of shape ", param.sizes(), ", got ", t.dtype(),
           t.sizes(), t.is_contiguous() ? "" : " (not contiguous)");
}

void adam_cuda(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamParams& p) {
  check_state("adam_step", param, param, "param");
  check_state("adam_step", param, grad, "grad");
  check_state("adam_step", param, exp_avg, "exp_avg");
  check_state("adam_step", param, exp_avg_sq, "exp_avg_sq");
  const int64_t n = param.numel();
  if (n == 0) return;
  const double bc1 = 1.0 - std::pow(p.beta1, static_cast<double>(p.step));
  const double bc2 = 1.0 - std::pow(p.beta2, static_cast<double>(p.step));
  AdamConstants k;
  k.b1 = static_cast<float>(p.beta1);
  k.b2 = static_cast<float>(p.beta2);
  k.step_size = static_cast<float>(p.lr / bc1);
  k.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  k.eps = static_cast<float>(p.eps);
  k.wd = static_cast<float>(p.weight_decay);
  k.decay = static_cast<float>(1.0 - p.lr * p.weight_decay);
  k.decoupled = p.decoupled;
  adam_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream_of(param)>>>(
      param.data<float>(), grad.data<float>(), exp_avg.data<float>(), exp_avg_sq.data<float>(), k, n);
  MN_CUDA_CHECK_LAUNCH();
}

void sgd_cuda(Tensor& param, const Tensor& grad, Tensor& buf, const SgdParams& p) {
  check_state("sgd_step", param, param, "param");
  check_state("sgd_step", param, grad, "grad");
  if (buf.defined()) check_state("sgd_step", param, buf, "momentum_buffer");
  const int64_t n = param.numel();
  if (n == 0) return;
  SgdConstants k;
  k.lr = static_cast<float>(p.lr);
  k.mom = static_cast<float>(p.momentum);
  k.damp = static_cast<float>(1.0 - p.dampening);
  k.wd = static_cast<float>(p.weight_decay);
  k.nesterov = p.nesterov;
  k.first_step = p.first_step;
  sgd_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, cuda::stream_of(param)>>>(
      param.data<float>(), grad.data<float>(), buf.defined() ? buf.data<float>() : nullptr, k, n);
  MN_CUDA_CHECK_LAUNCH();
}

}  // namespace

void register_cuda_optim() {
  adam_step.set(DeviceType::CUDA, adam_cuda);
  sgd_step.set(DeviceType::CUDA, sgd_cuda);
}

}  // namespace mn::kernels
