// Fused optimizer updates on the CPU: one pass over parameter, gradient and state with the update
// rules of kernels/optim_update.h (PyTorch's bias correction and eps placement for Adam, decoupled
// decay for AdamW, amsgrad's running maximum, SGD momentum with dampening and Nesterov, RMSprop).
#include "kernels/cpu/loops.h"
#include "kernels/kernels.h"
#include "kernels/optim_update.h"

namespace mn::kernels {
namespace {

constexpr int64_t kParallelElements = 65536;  // smaller updates run on the calling thread

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
  const int team = cpu::parallel_team(n, kParallelElements);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1) firstprivate(k)
  for (int64_t i = 0; i < n; ++i) adam_update(w[i], g[i], ma[i], va[i], k);
}

void sgd_cpu(Tensor& param, const Tensor& grad, Tensor& buf, const SgdParams& p) {
  check_sgd_operands(param, grad, buf);
  float* w = param.data<float>();
  const float* g = grad.data<float>();
  float* b = buf.defined() ? buf.data<float>() : nullptr;
  const int64_t n = param.numel();
  const SgdCoefficients k = sgd_coefficients(p);
  const int team = cpu::parallel_team(n, kParallelElements);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1) firstprivate(k)
  for (int64_t i = 0; i < n; ++i) sgd_update(w[i], g[i], b != nullptr ? b + i : nullptr, k);
}

void adam_amsgrad_cpu(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, Tensor& vmax, const AdamParams& p) {
  check_adam_amsgrad_operands(param, grad, m, v, vmax);
  float* w = param.data<float>();
  const float* g = grad.data<float>();
  float* ma = m.data<float>();
  float* va = v.data<float>();
  float* xa = vmax.data<float>();
  const int64_t n = param.numel();
  const AdamCoefficients k = adam_coefficients(p);
  const int team = cpu::parallel_team(n, kParallelElements);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1) firstprivate(k)
  for (int64_t i = 0; i < n; ++i) adam_amsgrad_update(w[i], g[i], ma[i], va[i], xa[i], k);
}

void rmsprop_cpu(Tensor& param, const Tensor& grad, Tensor& square_avg, Tensor& buf, Tensor& grad_avg,
                 const RmspropParams& p) {
  check_rmsprop_operands(param, grad, square_avg, buf, grad_avg, p);
  float* w = param.data<float>();
  const float* g = grad.data<float>();
  float* sq = square_avg.data<float>();
  float* b = buf.defined() ? buf.data<float>() : nullptr;
  float* ga = grad_avg.defined() ? grad_avg.data<float>() : nullptr;
  const int64_t n = param.numel();
  const RmspropCoefficients k = rmsprop_coefficients(p);
  const int team = cpu::parallel_team(n, kParallelElements);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1) firstprivate(k)
  for (int64_t i = 0; i < n; ++i)
    rmsprop_update(w[i], g[i], sq[i], b != nullptr ? b + i : nullptr, ga != nullptr ? ga + i : nullptr, k);
}

}  // namespace

void register_cpu_optim() {
  adam_step.set(DeviceType::CPU, adam_cpu);
  sgd_step.set(DeviceType::CPU, sgd_cpu);
  adam_amsgrad_step.set(DeviceType::CPU, adam_amsgrad_cpu);
  rmsprop_step.set(DeviceType::CPU, rmsprop_cpu);
}

}  // namespace mn::kernels
