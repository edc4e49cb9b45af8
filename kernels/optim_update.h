#pragma once
// The fused optimizer updates, written once for both backends (kernels/cpu/optim.cpp and
// kernels/cuda/optim.cu): the operand checks each kernel runs before it touches memory, the scalar
// coefficients computed on the host in double, and the per-element float math in PyTorch's order.
//
// Why double on the host: PyTorch computes 1 - beta2, lr / (1 - beta1^t) and sqrt(1 - beta2^t) as
// Python floats and rounds each result to float once. Rounding beta2 first and subtracting in float
// (1 - 0.9999f = 1.00017e-4) scales every second moment by 1 + 1.7e-4, a drift PyTorch does not have.
#include <cmath>

#include "core/host_device.h"
#include "kernels/kernels.h"

namespace mn::kernels {

// An optimizer kernel reads and writes numel(param) floats of every operand: each one must be a
// contiguous f32 tensor of the parameter's shape on the parameter's device. Callers are not trusted
// (a state tensor restored from a file is the operand an attacker controls).
inline void check_optimizer_operand(const char* op, const Tensor& param, const Tensor& t, const char* name) {
  MN_CHECK(t.defined(), ValueError, op, ": '", name, "' is an undefined tensor");
  MN_CHECK(t.device() == param.device(), DeviceError, op, ": expected '", name, "' on ", param.device(),
           " (the parameter's device), got a tensor on ", t.device());
  MN_CHECK(t.dtype() == DType::f32, TypeError, op, ": expected '", name, "' to be f32, got ", t.dtype());
  MN_CHECK(t.sizes() == param.sizes() && t.is_contiguous(), ValueError, op, ": expected '", name,
           "' to be a contiguous tensor of the parameter's shape ", param.sizes(), ", got shape ", t.sizes(),
           t.is_contiguous() ? "" : " (not contiguous)");
}

inline void check_adam_operands(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                                const Tensor& exp_avg_sq, const char* op = "adam_step") {
  check_optimizer_operand(op, param, param, "param");
  check_optimizer_operand(op, param, grad, "grad");
  check_optimizer_operand(op, param, exp_avg, "exp_avg");
  check_optimizer_operand(op, param, exp_avg_sq, "exp_avg_sq");
}

inline void check_adam_amsgrad_operands(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                                        const Tensor& exp_avg_sq, const Tensor& max_exp_avg_sq) {
  check_adam_operands(param, grad, exp_avg, exp_avg_sq, "adam_amsgrad_step");
  check_optimizer_operand("adam_amsgrad_step", param, max_exp_avg_sq, "max_exp_avg_sq");
}

// square_avg always; momentum_buffer exactly when momentum > 0, grad_avg exactly when centered.
inline void check_rmsprop_operands(const Tensor& param, const Tensor& grad, const Tensor& square_avg,
                                   const Tensor& momentum_buffer, const Tensor& grad_avg, const RmspropParams& p) {
  const char* op = "rmsprop_step";
  check_optimizer_operand(op, param, param, "param");
  check_optimizer_operand(op, param, grad, "grad");
  check_optimizer_operand(op, param, square_avg, "square_avg");
  MN_CHECK(momentum_buffer.defined() == (p.momentum > 0), ValueError, op, ": 'momentum_buffer' must be given ",
           "exactly when momentum > 0 (momentum ", p.momentum, ")");
  if (momentum_buffer.defined()) check_optimizer_operand(op, param, momentum_buffer, "momentum_buffer");
  MN_CHECK(grad_avg.defined() == p.centered, ValueError, op, ": 'grad_avg' must be given exactly when centered",
           " (centered ", p.centered ? "true" : "false", ")");
  if (grad_avg.defined()) check_optimizer_operand(op, param, grad_avg, "grad_avg");
}

// The momentum buffer may be undefined (momentum 0).
inline void check_sgd_operands(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer) {
  check_optimizer_operand("sgd_step", param, param, "param");
  check_optimizer_operand("sgd_step", param, grad, "grad");
  if (momentum_buffer.defined()) check_optimizer_operand("sgd_step", param, momentum_buffer, "momentum_buffer");
}

struct AdamCoefficients {
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float step_size;              // lr / (1 - beta1^t)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
  float eps, weight_decay;
  float decay;  // AdamW: 1 - lr * weight_decay
  bool decoupled;
};

inline AdamCoefficients adam_coefficients(const AdamParams& p) {
  const double t = static_cast<double>(p.step);
  AdamCoefficients k;
  k.beta1 = static_cast<float>(p.beta1);
  k.one_minus_beta1 = static_cast<float>(1.0 - p.beta1);
  k.beta2 = static_cast<float>(p.beta2);
  k.one_minus_beta2 = static_cast<float>(1.0 - p.beta2);
  k.step_size = static_cast<float>(p.lr / (1.0 - std::pow(p.beta1, t)));
  k.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(p.beta2, t)));
  k.eps = static_cast<float>(p.eps);
  k.weight_decay = static_cast<float>(p.weight_decay);
  k.decay = static_cast<float>(1.0 - p.lr * p.weight_decay);
  k.decoupled = p.decoupled;
  return k;
}

// Weight decay and the moments of torch.optim.Adam/AdamW (single-tensor path): m = b1*m + (1-b1)*g;
// v = b2*v + (1-b2)*g*g.
MN_HOST_DEVICE inline void adam_moments(float& w, float g, float& m, float& v, const AdamCoefficients& k) {
  if (k.weight_decay != 0.0f) {
    if (k.decoupled)
      w *= k.decay;
    else
      g += k.weight_decay * w;
  }
  m = k.beta1 * m + k.one_minus_beta1 * g;
  v = k.beta2 * v + k.one_minus_beta2 * g * g;
}

// The moments, then w -= step_size * m / (sqrt(v) / sqrt(bc2) + eps). Dividing by sqrt(bc2), not
// multiplying by its reciprocal, keeps PyTorch's rounding.
MN_HOST_DEVICE inline void adam_update(float& w, float g, float& m, float& v, const AdamCoefficients& k) {
  adam_moments(w, g, m, v, k);
  w -= k.step_size * m / (sqrtf(v) / k.bias_correction2_sqrt + k.eps);
}

// amsgrad (PyTorch 1.13): the running maximum vmax = maximum(vmax, v) replaces v in the denominator;
// torch.maximum propagates a NaN from either side.
MN_HOST_DEVICE inline void adam_amsgrad_update(float& w, float g, float& m, float& v, float& vmax,
                                               const AdamCoefficients& k) {
  adam_moments(w, g, m, v, k);
  vmax = (v != v || vmax != vmax) ? v + vmax : (v > vmax ? v : vmax);
  w -= k.step_size * m / (sqrtf(vmax) / k.bias_correction2_sqrt + k.eps);
}

struct SgdCoefficients {
  float lr, momentum, one_minus_dampening, weight_decay;
  bool nesterov, first_step;
};

inline SgdCoefficients sgd_coefficients(const SgdParams& p) {
  return SgdCoefficients{static_cast<float>(p.lr), static_cast<float>(p.momentum),
                         static_cast<float>(1.0 - p.dampening), static_cast<float>(p.weight_decay), p.nesterov,
                         p.first_step};
}

// torch.optim.SGD: b is the momentum buffer, nullptr without momentum. Weight decay is skipped when
// zero, as in PyTorch (0 * inf would turn an infinite weight into NaN).
MN_HOST_DEVICE inline void sgd_update(float& w, float g, float* b, const SgdCoefficients& k) {
  if (k.weight_decay != 0.0f) g += k.weight_decay * w;
  if (b != nullptr) {
    *b = k.first_step ? g : k.momentum * *b + k.one_minus_dampening * g;
    g = k.nesterov ? g + k.momentum * *b : *b;
  }
  w -= k.lr * g;
}

struct RmspropCoefficients {
  float lr, alpha, one_minus_alpha, eps, weight_decay, momentum;
};

inline RmspropCoefficients rmsprop_coefficients(const RmspropParams& p) {
  return RmspropCoefficients{static_cast<float>(p.lr),  static_cast<float>(p.alpha),
                             static_cast<float>(1.0 - p.alpha), static_cast<float>(p.eps),
                             static_cast<float>(p.weight_decay), static_cast<float>(p.momentum)};
}

// torch.optim.RMSprop (single-tensor path): sq = alpha*sq + (1-alpha)*g*g; centered: ga = alpha*ga +
// (1-alpha)*g and the denominator sqrt(sq - ga*ga) + eps, else sqrt(sq) + eps; with momentum
// b = momentum*b + g/denom and w -= lr*b, else w -= lr*g/denom. b (momentum) and ga (centered) are
// nullptr when unused.
MN_HOST_DEVICE inline void rmsprop_update(float& w, float g, float& sq, float* b, float* ga,
                                          const RmspropCoefficients& k) {
  if (k.weight_decay != 0.0f) g += k.weight_decay * w;
  sq = k.alpha * sq + k.one_minus_alpha * g * g;
  float denom;
  if (ga != nullptr) {
    *ga = k.alpha * *ga + k.one_minus_alpha * g;
    denom = sqrtf(sq - *ga * *ga) + k.eps;
  } else {
    denom = sqrtf(sq) + k.eps;
  }
  if (b != nullptr) {
    *b = k.momentum * *b + g / denom;
    w -= k.lr * *b;
  } else {
    w -= k.lr * g / denom;
  }
}

}  // namespace mn::kernels
