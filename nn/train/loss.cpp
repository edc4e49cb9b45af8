#include "nn/train/loss.h"

#include "autograd/node.h"
#include "autograd/ops.h"
#include "nn/functional.h"

namespace mn::train {

namespace {
thread_local bool t_defer_metrics = false;
}  // namespace

DeferredMetrics::DeferredMetrics() : previous_(t_defer_metrics) { t_defer_metrics = true; }
DeferredMetrics::~DeferredMetrics() { t_defer_metrics = previous_; }
bool DeferredMetrics::active() { return t_defer_metrics; }

void LossOutput::set_metric(const std::string& name, const Tensor& value, double divisor) {
  MN_CHECK(value.defined() && value.numel() == 1, ValueError, "metric '", name,
           "' needs a one-element tensor, got ", value.defined() ? value.sizes().str() : std::string("none"));
  metrics.erase(name);
  pending_metrics[name] = PendingMetric{value.detach(), divisor};
  if (!DeferredMetrics::active()) read_metrics();
}

void LossOutput::read_metrics() {
  if (pending_metrics.empty()) return;
  std::vector<Tensor> values;
  for (const auto& [name, m] : pending_metrics) values.push_back(m.value.reshape(Shape{}).to(DType::f32));
  const std::vector<float> host = stack(values, 0).to_vector<float>();  // one transfer
  size_t i = 0;
  for (const auto& [name, m] : pending_metrics) metrics[name] = static_cast<double>(host[i++]) / m.divisor;
  pending_metrics.clear();
}

LossOutput task_output(Tensor value) {
  LossOutput out;
  out.set_metric("task", value);
  out.components["task"] = value;
  out.total = std::move(value);
  return out;
}

LossOutput classification_loss(const Tensor& logits, const Tensor& targets, double label_smoothing) {
  MN_CHECK(logits.defined() && targets.defined(), ValueError,
           "classification loss: needs predictions and targets, got an undefined tensor");
  MN_CHECK(logits.dim() == 1 || logits.dim() == 2, ValueError,
           "classification loss expects logits of shape [N, C] (or [C]), got ", logits.sizes());
  MN_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, ValueError,
           "classification loss: label_smoothing must be in [0, 1], got ", label_smoothing);
  // Integer-valued float labels are accepted; class indices are what cross-entropy reads.
  const Tensor labels = targets.dtype() == DType::i64 ? targets : targets.detach().to(DType::i64);
  LossOutput out = task_output(nn::functional::cross_entropy(logits, labels, label_smoothing));
  autograd::NoGradGuard no_grad;
  const Tensor predicted = argmax(logits.detach(), -1);
  MN_CHECK(predicted.numel() == labels.numel(), ValueError, "classification loss: ", predicted.numel(),
           " predictions but ", labels.numel(), " targets");
  // Counted on the device (exact in f32 below 2^24 rows), divided on the host in double.
  if (predicted.numel() == 0)
    out.metrics["accuracy"] = 0.0;
  else
    out.set_metric("accuracy", sum(eq(predicted, labels.reshape(predicted.sizes()))),
                   static_cast<double>(predicted.numel()));
  return out;
}

LossOutput regression_loss(const Tensor& predictions, const Tensor& targets) {
  MN_CHECK(predictions.defined() && targets.defined(), ValueError,
           "regression loss: needs predictions and targets, got an undefined tensor");
  // Silent broadcasting ([N, 1] against [N]) is a classic source of wrong losses: refuse it.
  MN_CHECK(predictions.sizes() == targets.sizes(), ValueError, "regression loss: predictions have shape ",
           predictions.sizes(), " but targets have shape ", targets.sizes(), "; they must match");
  return task_output(nn::functional::mse_loss(predictions, targets));
}

Objective classification(double label_smoothing) {
  MN_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, ValueError,
           "classification: label_smoothing must be in [0, 1], got ", label_smoothing);
  return {"ClassificationLoss", [label_smoothing](const Tensor& logits, const Tensor& targets) {
            return classification_loss(logits, targets, label_smoothing);
          }};
}

Objective regression() { return {"RegressionLoss", regression_loss}; }

Objective task_loss(std::function<Tensor(const Tensor&, const Tensor&)> fn, std::string name) {
  MN_CHECK(static_cast<bool>(fn), ValueError, name, ": needs a loss function, got an empty one");
  return {name, [fn = std::move(fn), name](const Tensor& predictions, const Tensor& targets) {
            Tensor value = fn(predictions, targets);
            MN_CHECK(value.defined() && value.numel() == 1, ValueError, name,
                     ": the loss function must return a one-element tensor, got ",
                     value.defined() ? value.sizes().str() : std::string("an undefined tensor"));
            return task_output(value.dim() == 0 ? value : value.reshape(Shape{}));
          }};
}

}  // namespace mn::train
