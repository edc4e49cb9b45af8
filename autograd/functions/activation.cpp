// Activations with scalar parameters or fused gradients: softplus (beta, threshold), silu,
// leaky_relu, elu, hardtanh and logsigmoid, with PyTorch's formulas and NaN rules (the per-element
// formulas are in kernels/scalar_math.h). The first-order backward is one fused kernel reading the
// saved input; when the backward is itself recorded (create_graph) the derivative is written with
// differentiable ops so double backward works.
#include <cmath>

#include "autograd/functions/common.h"
#include "kernels/scalar_math.h"

namespace mn {

using autograd::GradContext;
using autograd::SavedTensor;
using autograd::TensorList;
using kernels::BinaryOp;
using kernels::UnaryOp;

namespace {

Tensor activation_forward(const char* name, UnaryOp op, const Tensor& x, double alpha = 0, double beta = 0) {
  detail::check_defined(name, x, "input");
  detail::check_float(name, x, "input");
  Tensor out = empty(x.sizes(), x.options());
  kernels::unary(x.device(), op, x, out, alpha, beta);
  return out;
}

// grad * f'(x) in one kernel; the ops math::binary_takes_params lists get alpha and beta.
Tensor fused_derivative(BinaryOp op, const Tensor& grad, const Tensor& x, double alpha = 0, double beta = 0) {
  Tensor out = empty(x.sizes(), x.options());
  const Tensor g = detail::expand_view(grad, x.sizes());
  if (kernels::math::binary_takes_params(op))
    kernels::binary_params(x.device(), op, g, x, out, alpha, beta);
  else
    kernels::binary(x.device(), op, g, x, out);
  return out;
}

// Records the backward of y = f(x): the fused kernel `op`, or `recorded(grad, x)` under create_graph.
template <class Recorded>
void record_activation(const char* name, const Tensor& x, Tensor& out, BinaryOp op, double alpha, double beta,
                       Recorded recorded) {
  if (!autograd::needs_grad({&x})) return;
  autograd::record(name, {&x}, {&out},
                   [sx = SavedTensor::input(x), name, op, alpha, beta, recorded](const GradContext& c) -> TensorList {
                     const Tensor x = sx.unpack(name);
                     if (autograd::grad_mode_enabled()) return {recorded(c.grad(), x)};
                     return {fused_derivative(op, c.grad(), x, alpha, beta)};
                   });
}

}  // namespace

Tensor softplus(const Tensor& x) { return softplus(x, 1.0, 20.0); }

Tensor softplus(const Tensor& x, double beta, double threshold) {
  Tensor out = activation_forward("softplus", UnaryOp::Softplus, x, beta, threshold);
  record_activation("SoftplusBackward", x, out, BinaryOp::SoftplusBackward, beta, threshold,
                    [beta, threshold](const Tensor& g, const Tensor& x) {
                      const Tensor z = mul(x, beta);
                      return mul(g, where(gt(z, threshold), ones_like(x), sigmoid(z)));
                    });
  return out;
}

Tensor silu(const Tensor& x) {
  Tensor out = activation_forward("silu", UnaryOp::Silu, x);
  record_activation("SiluBackward", x, out, BinaryOp::SiluBackward, 0, 0, [](const Tensor& g, const Tensor& x) {
    const Tensor s = sigmoid(x);
    return mul(g, mul(s, add(mul(x, rsub(s, 1.0)), 1.0)));  // s * (1 + x * (1 - s))
  });
  return out;
}

Tensor leaky_relu(const Tensor& x, double negative_slope) {
  Tensor out = activation_forward("leaky_relu", UnaryOp::LeakyRelu, x, negative_slope);
  record_activation("LeakyReluBackward", x, out, BinaryOp::LeakyReluBackward, negative_slope, 0,
                    [negative_slope](const Tensor& g, const Tensor& x) {
                      // 1 where x > 0, the slope elsewhere (NaN included)
                      return mul(g, add(mul(gt(x, 0.0), 1.0 - negative_slope), negative_slope));
                    });
  return out;
}

Tensor elu(const Tensor& x, double alpha) {
  Tensor out = activation_forward("elu", UnaryOp::Elu, x, alpha);
  record_activation("EluBackward", x, out, BinaryOp::EluBackward, alpha, 0, [alpha](const Tensor& g, const Tensor& x) {
    return mul(g, where(le(x, 0.0), mul(exp(x), alpha), ones_like(x)));
  });
  return out;
}

Tensor hardtanh(const Tensor& x, double min_val, double max_val) {
  MN_CHECK(!std::isnan(min_val) && !std::isnan(max_val) && min_val <= max_val, ValueError,
           "hardtanh: expected min_val <= max_val, got min_val ", min_val, " and max_val ", max_val);
  Tensor out = activation_forward("hardtanh", UnaryOp::Hardtanh, x, min_val, max_val);
  record_activation("HardtanhBackward", x, out, BinaryOp::HardtanhBackward, min_val, max_val,
                    [min_val, max_val](const Tensor& g, const Tensor& x) {
                      // 0 at and beyond the bounds, 1 inside (and for NaN, which compares false)
                      return mul(g, rsub(maximum(le(x, min_val), ge(x, max_val)), 1.0));
                    });
  return out;
}

Tensor logsigmoid(const Tensor& x) {
  Tensor out = activation_forward("logsigmoid", UnaryOp::LogSigmoid, x);
  record_activation("LogSigmoidBackward", x, out, BinaryOp::LogSigmoidBackward, 0, 0,
                    [](const Tensor& g, const Tensor& x) { return mul(g, sigmoid(neg(x))); });
  return out;
}

}  // namespace mn
