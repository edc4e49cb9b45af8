// Losses: cross entropy (fused log-softmax + NLL with class weights, label smoothing and
// ignore_index), negative log-likelihood on log-probabilities, and mean squared error.
#include "autograd/autocast.h"
#include "autograd/functions/common.h"
#include "nn/functional.h"
#include "nn/functional/loss_common.h"

namespace mn::nn::functional {

using autograd::GradContext;
using autograd::SavedTensor;
using autograd::TensorList;

void loss_internal::refuse_batch_mean(const char* op, Reduction reduction) {
  MN_CHECK(reduction != Reduction::BatchMean, ValueError, op,
           ": reduction BatchMean ('batchmean') is kl_div's alone; use None, Mean or Sum");
}

Tensor loss_internal::reduce_loss(const char* op, const Tensor& per_item, Reduction reduction) {
  refuse_batch_mean(op, reduction);
  switch (reduction) {
    case Reduction::None: return per_item;
    case Reduction::Sum: return sum(per_item);
    case Reduction::Mean: return mean(per_item);
    case Reduction::BatchMean: break;  // refused above
  }
  throw ValueError(str(op, ": unknown reduction"));
}

namespace {

// f32 [N, C] mask with a 1 at (n, target[n]); rows whose target is outside [0, C) stay all zero.
Tensor one_hot(const Tensor& target, int64_t classes) {
  const int64_t rows = target.numel();
  Tensor positions =
      arange(classes, TensorOptions(DType::i64).with_device(target.device())).reshape({1, classes});
  return eq(positions, target.reshape({rows, 1}));
}

// Checks "target is i64 [N] for [N, C] input, or i64 [] / [1] for [C] input"; returns it as [N].
Tensor checked_target(const char* op, const Tensor& input, const char* input_name, const Tensor& target) {
  detail::check_defined(op, target, "target");
  detail::check_same_device(op, input, target);
  const bool single = input.dim() == 1;
  const int64_t rows = single ? 1 : input.sizes()[0];
  const bool ok = target.dtype() == DType::i64 && (single ? target.numel() == 1 && target.dim() <= 1
                                                          : target.dim() == 1 && target.sizes()[0] == rows);
  MN_CHECK(ok, ValueError, op, ": expected target of shape ", single ? Shape{} : Shape{rows},
           " (i64 class indices) for ", input_name, " of shape ", input.sizes(), ", got ", target.dtype(),
           target.sizes());
  if (!single) return target;
  return target.dim() == 0 ? target.unsqueeze(0) : target;
}

void check_class_input(const char* op, const Tensor& input, const char* what) {
  detail::check_defined(op, input, what);
  detail::check_float(op, input, what);
  MN_CHECK(input.dim() == 1 || input.dim() == 2, ValueError, op, ": expected ", what,
           " of shape [N, C] or [C], got ", input.sizes());
}

// Checks the class weights (undefined is fine): f32 [C] on the input's device, not requiring grad.
void check_class_weight(const char* op, const Tensor& input, const Tensor& weight) {
  if (!weight.defined()) return;
  const int64_t classes = input.sizes()[input.dim() - 1];
  MN_CHECK(weight.dtype() == DType::f32 && weight.dim() == 1 && weight.sizes()[0] == classes, ValueError, op,
           ": expected weight of shape [", classes, "] (f32, one per class of input ", input.sizes(), "), got ",
           weight.dtype(), weight.sizes());
  detail::check_same_device(op, input, weight);
  MN_CHECK(!weight.requires_grad() || !autograd::grad_mode_enabled(), ValueError, op,
           ": weight requires grad, but no gradient flows to the class weights (as in PyTorch); pass "
           "weight.detach()");
}

// f32 [N, C] 0/1: (n, t[n]) for the rows that count (t[n] != ignore_index).
Tensor counted_one_hot(const Tensor& target, int64_t classes, int64_t ignore_index) {
  const int64_t rows = target.numel();
  return mul(one_hot(target, classes), ne(target, static_cast<double>(ignore_index)).reshape({rows, 1}));
}

// sum over counted rows of weight[t[n]]: the denominator of a weighted Mean, on the device (no host
// read). `where`, not a product, so a non-finite weight of a class no row has cannot leak in.
Tensor counted_weight(const Tensor& picked, const Tensor& weight) {
  const int64_t classes = weight.numel();
  return sum(where(picked, weight.reshape({1, classes}), zeros({}, TensorOptions(DType::f32).with_device(weight.device()))));
}

// The gradient of the per-row loss written with differentiable ops (used under create_graph), with
// w_t = weight[t[n]] and W = sum(weight) (all 1 without weight):
// g[n] * valid[n] * (softmax(x)[n, c] ((1 - s) w_t + (s / C) W) - (1 - s) w_t [c == t[n]] - (s / C) w[c]).
Tensor cross_entropy_grad(const Tensor& g, const Tensor& logits, const Tensor& target, const Tensor& weight,
                          double smoothing, int64_t ignore_index) {
  const int64_t rows = logits.sizes()[0], classes = logits.sizes()[1];
  const double spread = smoothing / static_cast<double>(classes);
  Tensor valid = ne(target, static_cast<double>(ignore_index)).reshape({rows, 1});
  Tensor scale = mul(g.reshape({rows, 1}), valid);
  if (!weight.defined()) {
    Tensor direction = sub(sub(softmax(logits, 1), mul(one_hot(target, classes), 1.0 - smoothing)), spread);
    return mul(direction, scale);
  }
  Tensor hot = one_hot(target, classes);
  Tensor w = weight.reshape({1, classes});
  Tensor target_weight = mul(sum(mul(hot, w), {1}, /*keepdim=*/true), 1.0 - smoothing);  // [N, 1]
  Tensor coefficient = add(target_weight, mul(sum(weight), spread));
  Tensor direction = sub(sub(mul(softmax(logits, 1), coefficient), mul(hot, target_weight)), mul(w, spread));
  return mul(direction, scale);
}

}  // namespace

Tensor cross_entropy(const Tensor& logits_in, const Tensor& target, double label_smoothing, Reduction reduction,
                     int64_t ignore_index, const Tensor& weight_in) {
  // an f32 op under autocast (autograd/autocast.h)
  const Tensor logits = amp::cast_f32(logits_in), weight = amp::cast_f32(weight_in);
  check_class_input("cross_entropy", logits, "logits");
  MN_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, ValueError,
           "cross_entropy: label_smoothing must lie in [0, 1], got ", label_smoothing);
  const Tensor rows_target = checked_target("cross_entropy", logits, "logits", target);
  check_class_weight("cross_entropy", logits, weight);
  loss_internal::refuse_batch_mean("cross_entropy", reduction);
  const bool single = logits.dim() == 1;
  const Tensor x = single ? logits.reshape({1, logits.sizes()[0]}) : logits;
  const Tensor w = weight.defined() ? weight.detach() : Tensor();
  const int64_t rows = x.sizes()[0];
  Tensor loss = empty({rows}, TensorOptions(DType::f32).with_device(x.device()));
  Tensor lse = empty({rows}, TensorOptions(DType::f32).with_device(x.device()));
  kernels::cross_entropy_forward(x.device(), x, rows_target, w, label_smoothing, ignore_index, loss, lse);
  if (autograd::needs_grad({&x}))
    autograd::record("CrossEntropyBackward", {&x}, {&loss},
                     [sx = SavedTensor::input(x), st = SavedTensor::input(rows_target), w, lse, label_smoothing,
                      ignore_index](const GradContext& c) -> TensorList {
                       Tensor logits = sx.unpack("CrossEntropyBackward");
                       Tensor t = st.unpack("CrossEntropyBackward");
                       if (autograd::grad_mode_enabled())
                         return {cross_entropy_grad(c.grad(), logits, t, w, label_smoothing, ignore_index)};
                       Tensor grad =
                           empty(logits.sizes(), TensorOptions(DType::f32).with_device(logits.device()));
                       kernels::cross_entropy_backward(logits.device(), c.grad(), logits, t, w, lse,
                                                       label_smoothing, ignore_index, grad);
                       return {grad};
                     });
  switch (reduction) {
    case Reduction::None: return single ? loss.reshape({}) : loss;
    case Reduction::Sum: return sum(loss);
    case Reduction::Mean: {
      // Averaged over the targets that count (weighted: divided by their classes' total weight); all
      // ignored gives 0/0 = NaN, as in PyTorch. Decided on the device (no host read: no
      // synchronisation, and a captured step stays capturable); without weight, when every target
      // counts the result is mean(loss), bit for bit.
      if (w.defined())
        return div(sum(loss), counted_weight(counted_one_hot(rows_target, x.sizes()[1], ignore_index), w));
      const Tensor counted = sum(ne(rows_target, static_cast<double>(ignore_index)));
      return where(eq(counted, static_cast<double>(rows)), mean(loss), div(sum(loss), counted));
    }
    case Reduction::BatchMean: break;
  }
  throw ValueError("cross_entropy: unknown reduction");
}

Tensor nll_loss(const Tensor& log_probs_in, const Tensor& target, Reduction reduction, int64_t ignore_index,
                const Tensor& weight_in) {
  // an f32 op under autocast (autograd/autocast.h)
  const Tensor log_probs = amp::cast_f32(log_probs_in), weight = amp::cast_f32(weight_in);
  check_class_input("nll_loss", log_probs, "log_probs");
  const Tensor rows_target = checked_target("nll_loss", log_probs, "log_probs", target);
  check_class_weight("nll_loss", log_probs, weight);
  loss_internal::refuse_batch_mean("nll_loss", reduction);
  const bool single = log_probs.dim() == 1;
  const Tensor x = single ? log_probs.reshape({1, log_probs.sizes()[0]}) : log_probs;
  const int64_t rows = x.sizes()[0], classes = x.sizes()[1];
  const std::vector<int64_t> values = rows_target.to_vector<int64_t>();
  // Flat positions n * C + t[n] of the picked log-probabilities (an ignored row picks its column 0 and
  // is then replaced by 0 with `where`, so a -inf there cannot turn into NaN).
  std::vector<int64_t> picks(values.size());
  std::vector<float> counts(values.size());
  int64_t counted = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    const bool ignored = values[i] == ignore_index;
    MN_CHECK(ignored || (values[i] >= 0 && values[i] < classes), IndexError, "nll_loss: target ", values[i],
             " at position ", i, " is out of range for ", classes, " classes (log_probs of shape ",
             log_probs.sizes(), ")");
    picks[i] = static_cast<int64_t>(i) * classes + (ignored ? 0 : values[i]);
    counts[i] = ignored ? 0.0f : 1.0f;
    counted += ignored ? 0 : 1;
  }
  const Shape row_shape{rows};
  const Tensor index = from_vector(picks, row_shape).to(x.device());
  const Tensor valid = from_vector(counts, row_shape).to(x.device());
  Tensor picked = neg(index_select(x.reshape({rows * classes}), 0, index));
  Tensor row_weight;
  if (weight.defined()) {
    std::vector<int64_t> safe_targets(values.size());
    for (size_t i = 0; i < values.size(); ++i) safe_targets[i] = picks[i] - static_cast<int64_t>(i) * classes;
    row_weight = mul(index_select(weight.detach(), 0, from_vector(safe_targets, row_shape).to(x.device())), valid);
    picked = mul(picked, row_weight);
  }
  Tensor per_row = where(valid, picked, zeros({}, TensorOptions(DType::f32).with_device(x.device())));
  switch (reduction) {
    case Reduction::None: return single ? per_row.reshape({}) : per_row;
    case Reduction::Sum: return sum(per_row);
    case Reduction::Mean:
      if (row_weight.defined()) return div(sum(per_row), sum(row_weight));
      // Every target counts: mean (as before ignore_index existed); otherwise over the counted ones,
      // 0/0 = NaN when none does, as in PyTorch.
      return counted == rows ? mean(per_row) : div(sum(per_row), static_cast<double>(counted));
    case Reduction::BatchMean: break;
  }
  throw ValueError("nll_loss: unknown reduction");
}

Tensor mse_loss(const Tensor& input_in, const Tensor& target_in, Reduction reduction) {
  // an f32 op under autocast (autograd/autocast.h)
  const Tensor input = amp::cast_f32(input_in), target = amp::cast_f32(target_in);
  detail::check_defined("mse_loss", input, "input");
  detail::check_defined("mse_loss", target, "target");
  detail::check_float("mse_loss", input, "input");
  detail::check_float("mse_loss", target, "target");
  MN_CHECK(input.sizes() == target.sizes(), ValueError, "mse_loss: expected target of the input's shape ",
           input.sizes(), ", got ", target.sizes());
  return loss_internal::reduce_loss("mse_loss", square(sub(input, target)), reduction);
}

}  // namespace mn::nn::functional
