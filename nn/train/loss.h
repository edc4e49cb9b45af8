#pragma once
// What one training step's loss returns, and the task losses every trainer offers.
//
// A loss produces a LossOutput: a scalar `total` to minimise, its named `components` (live scalars,
// gradients flow through them) and plain-number `metrics` for logging ("task", "total", "accuracy",
// ...). A metric computed on the device can stay pending until the step ends, so a step reads all of
// them from the device once (DeferredMetrics).
//
// A plain module trains with an Objective: a function of (predictions, targets) with a name, e.g.
//   train::Trainer trainer(*net, loader, &val_loader, train::classification());
// mapping::MappingTrainer uses mapping losses (mapping/losses.h), whose task terms call the same
// functions, so a module trained directly and through a mapping network report the same metrics.
#include <functional>
#include <map>
#include <string>

#include "core/tensor.h"

namespace mn::train {

struct LossOutput {
  Tensor total;  // scalar; undefined only for a term reported absent (see mapping::SmoothnessLoss)
  std::map<std::string, Tensor> components;
  std::map<std::string, double> metrics;

  // A metric computed on the device: metrics[name] = value / divisor. Read at once, or, inside a
  // DeferredMetrics scope, kept in pending_metrics until read_metrics() (one host read for all of
  // them, after the step: no synchronisation per metric, and a compiled step stays capturable).
  struct PendingMetric {
    Tensor value;  // one element, detached
    double divisor = 1.0;
  };
  std::map<std::string, PendingMetric> pending_metrics;
  void set_metric(const std::string& name, const Tensor& value, double divisor = 1.0);
  bool has_metric(const std::string& name) const { return metrics.count(name) || pending_metrics.count(name); }
  // Moves every pending metric into `metrics` with one device-to-host transfer.
  void read_metrics();
};

// While alive (per thread), LossOutput::set_metric keeps device metrics pending instead of reading them.
class DeferredMetrics {
 public:
  DeferredMetrics();
  ~DeferredMetrics();
  DeferredMetrics(const DeferredMetrics&) = delete;
  DeferredMetrics& operator=(const DeferredMetrics&) = delete;
  static bool active();

 private:
  bool previous_;
};

// ---- task losses ----

// total = components["task"] = metric "task" = value.
LossOutput task_output(Tensor value);
// Cross-entropy of logits [N, C] (or [C]) against class indices (integer-valued float labels are
// accepted), with label smoothing; adds the metric "accuracy" (argmax hits / N, counted on the device).
LossOutput classification_loss(const Tensor& logits, const Tensor& targets, double label_smoothing = 0.0);
// Mean squared error; predictions and targets must have the same shape (no silent broadcasting).
LossOutput regression_loss(const Tensor& predictions, const Tensor& targets);

// A task loss for Trainer: a name (for logs) and a function of (predictions, targets).
struct Objective {
  std::string name;
  std::function<LossOutput(const Tensor& predictions, const Tensor& targets)> compute;
};
Objective classification(double label_smoothing = 0.0);  // classification_loss
Objective regression();                                  // regression_loss
// Any scalar loss function: its value is the task term and the total.
Objective task_loss(std::function<Tensor(const Tensor& predictions, const Tensor& targets)> fn,
                    std::string name = "TaskLoss");

}  // namespace mn::train
