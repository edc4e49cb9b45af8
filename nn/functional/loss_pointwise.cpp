// Elementwise losses composed from differentiable ops (so they differentiate to any order):
// binary cross entropy on logits, L1, smooth L1 and the Kullback-Leibler divergence, each with
// PyTorch 1.13's formula and its gradient at the kinks (sign(0) = 0 for |x - y|).
#include "autograd/autocast.h"
#include "autograd/functions/common.h"
#include "nn/functional.h"
#include "nn/functional/loss_common.h"

namespace mn::nn::functional {

namespace {

// f32 input and target of one shape on one device.
void check_pair(const char* op, const Tensor& input, const Tensor& target) {
  detail::check_defined(op, input, "input");
  detail::check_defined(op, target, "target");
  detail::check_float(op, input, "input");
  detail::check_float(op, target, "target");
  detail::check_same_device(op, input, target);
  MN_CHECK(input.sizes() == target.sizes(), ValueError, op, ": expected target of the input's shape ",
           input.sizes(), ", got ", target.sizes());
}

// An optional f32 factor that must broadcast to the input's shape without growing it.
void check_factor(const char* op, const Tensor& input, const Tensor& factor, const char* name) {
  if (!factor.defined()) return;
  detail::check_float(op, factor, name);
  detail::check_same_device(op, input, factor);
  bool fits = factor.dim() <= input.dim();
  for (int i = 1; fits && i <= factor.dim(); ++i) {
    const int64_t f = factor.sizes()[factor.dim() - i], s = input.sizes()[input.dim() - i];
    fits = f == s || f == 1;
  }
  MN_CHECK(fits, ValueError, op, ": expected ", name, " to broadcast to the input's shape ", input.sizes(),
           ", got shape ", factor.sizes());
}

Tensor zero_like_scalar(const Tensor& like) { return zeros({}, TensorOptions(DType::f32).with_device(like.device())); }

}  // namespace

Tensor binary_cross_entropy_with_logits(const Tensor& input_in, const Tensor& target_in, const Tensor& weight_in,
                                        const Tensor& pos_weight_in, Reduction reduction) {
  // an f32 op under autocast (autograd/autocast.h)
  const Tensor input = amp::cast_f32(input_in), target = amp::cast_f32(target_in), weight = amp::cast_f32(weight_in), pos_weight = amp::cast_f32(pos_weight_in);
  const char* op = "binary_cross_entropy_with_logits";
  check_pair(op, input, target);
  check_factor(op, input, weight, "weight");
  check_factor(op, input, pos_weight, "pos_weight");
  // softplus(-x) = log(1 + exp(-x)) = -log sigmoid(x), computed without overflow for any x; its
  // gradient -sigmoid(-x) is exact at 0 too (a |x|-based form would give 0 there).
  Tensor log_term = softplus(neg(input));
  if (pos_weight.defined()) log_term = mul(add(mul(sub(pos_weight, 1.0), target), 1.0), log_term);
  Tensor loss = add(mul(rsub(target, 1.0), input), log_term);
  if (weight.defined()) loss = mul(loss, weight);
  return loss_internal::reduce_loss(op, loss, reduction);
}

Tensor l1_loss(const Tensor& input_in, const Tensor& target_in, Reduction reduction) {
  // an f32 op under autocast (autograd/autocast.h)
  const Tensor input = amp::cast_f32(input_in), target = amp::cast_f32(target_in);
  check_pair("l1_loss", input, target);
  return loss_internal::reduce_loss("l1_loss", abs(sub(input, target)), reduction);
}

Tensor smooth_l1_loss(const Tensor& input_in, const Tensor& target_in, Reduction reduction, double beta) {
  // an f32 op under autocast (autograd/autocast.h)
  const Tensor input = amp::cast_f32(input_in), target = amp::cast_f32(target_in);
  const char* op = "smooth_l1_loss";
  check_pair(op, input, target);
  MN_CHECK(beta >= 0.0, ValueError, op, ": beta must be non-negative, got ", beta);
  if (beta == 0.0) return loss_internal::reduce_loss(op, abs(sub(input, target)), reduction);
  Tensor d = sub(input, target);
  Tensor magnitude = abs(d);
  // The quadratic piece's gradient d / beta meets sign(d) at |d| = beta; NaN fails `<` and takes the
  // linear piece, which keeps it.
  Tensor loss = where(lt(magnitude, beta), mul(square(d), 0.5 / beta), sub(magnitude, 0.5 * beta));
  return loss_internal::reduce_loss(op, loss, reduction);
}

Tensor kl_div(const Tensor& input_in, const Tensor& target_in, Reduction reduction, bool log_target) {
  // an f32 op under autocast (autograd/autocast.h)
  const Tensor input = amp::cast_f32(input_in), target = amp::cast_f32(target_in);
  const char* op = "kl_div";
  check_pair(op, input, target);
  Tensor loss;
  if (log_target) {
    loss = mul(exp(target), sub(target, input));
  } else {
    // xlogy(t, t) - t x: t log t is 0 at t == 0. The log reads 1 there, so neither the value nor the
    // gradient meets 0 * -inf (a NaN target still gives NaN: NaN == 0 is false).
    const Tensor is_zero = eq(target, 0.0);
    const Tensor safe = where(is_zero, full({}, 1.0, TensorOptions(DType::f32).with_device(target.device())), target);
    const Tensor entropy = where(is_zero, zero_like_scalar(target), mul(target, log(safe)));
    loss = sub(entropy, mul(target, input));
  }
  if (reduction != Reduction::BatchMean) return loss_internal::reduce_loss(op, loss, reduction);
  // PyTorch: the sum divided by input.size(0); a 0-d input is left as its sum.
  Tensor total = sum(loss);
  return input.dim() == 0 ? total : div(total, static_cast<double>(input.sizes()[0]));
}

}  // namespace mn::nn::functional
