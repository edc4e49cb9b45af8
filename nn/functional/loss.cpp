// Losses: cross entropy (fused log-softmax + NLL with label smoothing and ignore_index), negative
// log-likelihood on log-probabilities, and mean squared error.
#include "autograd/functions/common.h"
#include "nn/functional.h"

namespace mn::nn::functional {

using autograd::GradContext;
using autograd::SavedTensor;
using autograd::TensorList;

namespace {

Tensor reduce_loss(const Tensor& per_item, Reduction reduction) {
  switch (reduction) {
    case Reduction::None: return per_item;
    case Reduction::Sum: return sum(per_item);
    case Reduction::Mean: return mean(per_item);
  }
  throw ValueError("unknown loss reduction");
}

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

// The gradient of the per-row loss written with differentiable ops (used under create_graph):
// g[n] * valid[n] * (softmax(x)[n, c] - (1 - s) [c == t[n]] - s / C).
Tensor cross_entropy_grad(const Tensor& g, const Tensor& logits, const Tensor& target, double smoothing,
                          int64_t ignore_index) {
  const int64_t rows = logits.sizes()[0], classes = logits.sizes()[1];
  Tensor valid = ne(target, static_cast<double>(ignore_index)).reshape({rows, 1});
  Tensor direction = sub(sub(softmax(logits, 1), mul(one_hot(target, classes), 1.0 - smoothing)),
                         smoothing / static_cast<double>(classes));
  return mul(direction, mul(g.reshape({rows, 1}), valid));
}

}  // namespace

Tensor cross_entropy(const Tensor& logits, const Tensor& target, double label_smoothing, Reduction reduction,
                     int64_t ignore_index) {
  check_class_input("cross_entropy", logits, "logits");
  MN_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, ValueError,
           "cross_entropy: label_smoothing must lie in [0, 1], got ", label_smoothing);
  const Tensor rows_target = checked_target("cross_entropy", logits, "logits", target);
  const bool single = logits.dim() == 1;
  const Tensor x = single ? logits.reshape({1, logits.sizes()[0]}) : logits;
  const int64_t rows = x.sizes()[0];
  Tensor loss = empty({rows}, TensorOptions(DType::f32).with_device(x.device()));
  Tensor lse = empty({rows}, TensorOptions(DType::f32).with_device(x.device()));
  kernels::cross_entropy_forward(x.device(), x, rows_target, label_smoothing, ignore_index, loss, lse);
  if (autograd::needs_grad({&x}))
    autograd::record("CrossEntropyBackward", {&x}, {&loss},
                     [sx = SavedTensor::input(x), st = SavedTensor::input(rows_target), lse, label_smoothing,
                      ignore_index](const GradContext& c) -> TensorList {
                       Tensor logits = sx.unpack("CrossEntropyBackward");
                       Tensor t = st.unpack("CrossEntropyBackward");
                       if (autograd::grad_mode_enabled())
                         return {cross_entropy_grad(c.grad(), logits, t, label_smoothing, ignore_index)};
                       Tensor grad =
                           empty(logits.sizes(), TensorOptions(DType::f32).with_device(logits.device()));
                       kernels::cross_entropy_backward(logits.device(), c.grad(), logits, t, lse,
                                                       label_smoothing, ignore_index, grad);
                       return {grad};
                     });
  switch (reduction) {
    case Reduction::None: return single ? loss.reshape({}) : loss;
    case Reduction::Sum: return sum(loss);
    case Reduction::Mean: {
      // Averaged over the targets that count; all ignored gives 0/0 = NaN, as in PyTorch. Decided on
      // the device (no host read: no synchronisation, and a captured step stays capturable); when every
      // target counts the result is mean(loss), bit for bit.
      const Tensor counted = sum(ne(rows_target, static_cast<double>(ignore_index)));
      return where(eq(counted, static_cast<double>(rows)), mean(loss), div(sum(loss), counted));
    }
  }
  throw ValueError("cross_entropy: unknown reduction");
}

Tensor nll_loss(const Tensor& log_probs, const Tensor& target, Reduction reduction) {
  check_class_input("nll_loss", log_probs, "log_probs");
  const Tensor rows_target = checked_target("nll_loss", log_probs, "log_probs", target);
  const bool single = log_probs.dim() == 1;
  const Tensor x = single ? log_probs.reshape({1, log_probs.sizes()[0]}) : log_probs;
  const int64_t classes = x.sizes()[1];
  const std::vector<int64_t> values = rows_target.to_vector<int64_t>();
  for (size_t i = 0; i < values.size(); ++i)
    MN_CHECK(values[i] >= 0 && values[i] < classes, IndexError, "nll_loss: target ", values[i],
             " at position ", i, " is out of range for ", classes, " classes (log_probs of shape ",
             log_probs.sizes(), ")");
  // Picking log_probs[n, target[n]] as a masked row sum keeps the op differentiable to any order.
  Tensor per_row = neg(sum(mul(x, one_hot(rows_target, classes)), {1}));
  if (reduction == Reduction::None && single) return per_row.reshape({});
  return reduce_loss(per_row, reduction);
}

Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction) {
  detail::check_defined("mse_loss", input, "input");
  detail::check_defined("mse_loss", target, "target");
  detail::check_float("mse_loss", input, "input");
  detail::check_float("mse_loss", target, "target");
  MN_CHECK(input.sizes() == target.sizes(), ValueError, "mse_loss: expected target of the input's shape ",
           input.sizes(), ", got ", target.sizes());
  return reduce_loss(square(sub(input, target)), reduction);
}

}  // namespace mn::nn::functional
