// Fused optimizer updates on the CPU: one pass over parameter, gradient and state with the update
// rules of kernels/optim_update.h (PyTorch's bias correction and eps placement for Adam, decoupled
// decay for AdamW, SGD momentum with dampening and Nesterov).
#include "kernels/kernels.h"
#include "kernels/optim_update.h"

namespace mn::kernels {
namespace {

void adam_cpu(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamParams& p) {
  check_adam_operands(param, grad, m, v);
  float* w = param.data<float>();
  const float* g = grad.data<float>();
  float* ma = m.data<float>();
  float* va = v.data<float>();
  const int64_t n = param.numel();
  const AdamCoefficients k = adam_coefficients(p);
  // firstprivate: each thread's own copy of the coefficients, so that the stores to w, m and v (floats
  // like them) cannot alias them and the loop vectorises (with -fno-math-errno for sqrt; CMakeLists).
#pragma omp parallel for schedule(static) if (n > 65536) firstprivate(k)
  for (int64_t i = 0; i < n; ++i) adam_update(w[i], g[i], ma[i], va[i], k);
}

void sgd_cpu(Tensor& param, const Tensor& grad, Tensor& buf, const SgdParams& p) {
  check_sgd_operands(param, grad, buf);
  float* w = param.data<float>();
  const float* g = grad.data<float>();
  float* b = buf.defined() ? buf.data<float>() : nullptr;
  const int64_t n = param.numel();
  const SgdCoefficients k = sgd_coefficients(p);
#pragma omp parallel for schedule(static) if (n > 65536) firstprivate(k)
  for (int64_t i = 0; i < n; ++i) sgd_update(w[i], g[i], b != nullptr ? b + i : nullptr, k);
}

}  // namespace

void register_cpu_optim() {
  adam_step.set(DeviceType::CPU, adam_cpu);
  sgd_step.set(DeviceType::CPU, sgd_cpu);
}

}  // namespace mn::kernels
