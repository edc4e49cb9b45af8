// Fused optimizer updates: one pass over parameter, gradient and state, with PyTorch's exact update
// rules (bias correction and eps placement of Adam, decoupled decay of AdamW, SGD momentum with
// dampening and Nesterov).
#include <cmath>

#include "kernels/kernels.h"

namespace mn::kernels {
namespace {

void adam_cpu(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamParams& p) {
  float* w = param.data<float>();
  const float* g = grad.data<float>();
  float* ma = m.data<float>();
  float* va = v.data<float>();
  const int64_t n = param.numel();
  const double bc1 = 1.0 - std::pow(p.beta1, static_cast<double>(p.step));
  const double bc2 = 1.0 - std::pow(p.beta2, static_cast<double>(p.step));
  const float b1 = static_cast<float>(p.beta1), b2 = static_cast<float>(p.beta2);
  const float step_size = static_cast<float>(p.lr / bc1);
  const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  const float eps = static_cast<float>(p.eps);
  const float wd = static_cast<float>(p.weight_decay);
  const float decay = static_cast<float>(1.0 - p.lr * p.weight_decay);
  const bool decoupled = p.decoupled;
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i];
    float wi = w[i];
    if (wd != 0.0f) {
      if (decoupled)
        wi *= decay;
      else
        gi += wd * wi;
    }
    const float mi = b1 * ma[i] + (1.0f - b1) * gi;
    const float vi = b2 * va[i] + (1.0f - b2) * gi * gi;
    ma[i] = mi;
    va[i] = vi;
    w[i] = wi - step_size * mi / (std::sqrt(vi) * inv_sqrt_bc2 + eps);
  }
}

void sgd_cpu(Tensor& param, const Tensor& grad, Tensor& buf, const SgdParams& p) {
  float* w = param.data<float>();
  const float* g = grad.data<float>();
  float* b = buf.defined() ? buf.data<float>() : nullptr;
  const int64_t n = param.numel();
  const float lr = static_cast<float>(p.lr), mom = static_cast<float>(p.momentum);
  const float damp = static_cast<float>(1.0 - p.dampening), wd = static_cast<float>(p.weight_decay);
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i] + wd * w[i];
    if (b != nullptr) {
      const float bi = p.first_step ? gi : mom * b[i] + damp * gi;
      b[i] = bi;
      gi = p.nesterov ? gi + mom * bi : bi;
    }
    w[i] -= lr * gi;
  }
}

}  // namespace

void register_cpu_optim() {
  adam_step.set(DeviceType::CPU, adam_cpu);
  sgd_step.set(DeviceType::CPU, sgd_cpu);
}

}  // namespace mn::kernels
