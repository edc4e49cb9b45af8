// Trainer: one training step - forward, loss, backward (eager or compiled), the non-finite check,
// gradient accumulation (with no_sync under data parallel), loss scaling (amp "f16"), clipping and the
// optimizer step.
#include <cmath>

#include "autograd/node.h"
#include "nn/train/trainer.h"

namespace mn::train {

namespace optim = nn::optim;
using data::Batch;

namespace {

// The pending metric that carries the gradient check through the step's one metrics read.
constexpr const char* kGradProbe = "__mn_nonfinite_grad_probe";

std::vector<int64_t> layout_key(int64_t accumulation_steps, const Tensor& inputs, const Tensor& targets) {
  std::vector<int64_t> key{accumulation_steps};
  for (const Tensor* t : {&inputs, &targets}) {
    key.push_back(t->defined() ? t->dim() : -1);
    if (t->defined()) key.insert(key.end(), t->sizes().begin(), t->sizes().end());
  }
  return key;
}

// Turns gradient communication off for one backward and back on after it (also on exceptions).
class SyncScope {
 public:
  SyncScope(DataParallel* data_parallel, bool sync) : data_parallel_(sync ? nullptr : data_parallel) {
    if (data_parallel_ != nullptr) {
      previous_ = data_parallel_->gradient_sync();
      data_parallel_->set_gradient_sync(false);
    }
  }
  ~SyncScope() {
    if (data_parallel_ != nullptr) data_parallel_->set_gradient_sync(previous_);
  }
  SyncScope(const SyncScope&) = delete;
  SyncScope& operator=(const SyncScope&) = delete;

 private:
  DataParallel* data_parallel_;
  bool previous_ = true;
};

}  // namespace

LossOutput Trainer::backward_step(const Batch& batch, int64_t accumulation_steps) {
  LossOutput out;
  {
    DeferredMetrics defer;  // device metrics stay pending: one host read per step, after the backward
    std::optional<autocast> amp;
    enter_autocast(amp);  // forward and loss only: the backward below runs outside it
    out = compute_loss(batch);
  }
  MN_CHECK(out.total.defined() && out.total.numel() == 1, RuntimeError, trainer_name(), ": the loss must return a scalar total");
  const Tensor objective =
      accumulation_steps > 1 ? div(out.total, static_cast<double>(accumulation_steps)) : out.total;
  MN_CHECK(objective.requires_grad(), RuntimeError,
           trainer_name(), ": the loss total does not depend on any trainable tensor; nothing to train");
  // f16: every micro-batch's loss is scaled; optimizer_step unscales the sum once.
  (scaler_ ? scaler_->scale(objective) : objective).backward();
  return out;
}

LossOutput Trainer::compiled_backward_step(const Batch& batch, int64_t accumulation_steps) {
  auto& compiled = compiled_steps_[accumulation_steps];
  if (!compiled) {
    // Outputs: the total, the components, the pending metrics (names in step_layouts_).
    auto body = [this, accumulation_steps](const std::vector<Tensor>& in) {
      Batch b;
      b.inputs = in[0];
      b.targets = in[1];
      LossOutput out = backward_step(b, accumulation_steps);
      StepLayout layout;
      std::vector<Tensor> outputs{out.total.detach()};
      for (const auto& [name, t] : out.components) {
        layout.components.push_back(name);
        outputs.push_back(t.defined() ? t.detach() : t);
      }
      for (const auto& [name, m] : out.pending_metrics) {
        layout.pending_metrics.emplace_back(name, m.divisor);
        outputs.push_back(m.value);
      }
      layout.metrics = out.metrics;
      step_layouts_[layout_key(accumulation_steps, in[0], in[1])] = std::move(layout);
      return outputs;
    };
    Guard guard = compile_guard();
    if (scaler_)  // the recorded multiply reads the scale tensor, which update() rewrites in place
      guard = [guard, scale = scaler_->scale_tensor()](std::vector<uint64_t>& key) {
        guard(key);
        guard_memory(key, scale);
      };
    compiled = std::make_unique<CompiledFunction>(body, guard, CompileOptions{.fullgraph = config_.compile_fullgraph});
  }
  const Device dev = device();
  Tensor inputs = batch.inputs, targets = batch.targets;
  if (inputs.defined() && inputs.device() != dev) inputs = inputs.to(dev);
  if (targets.defined() && targets.device() != dev) targets = targets.to(dev);
  const std::vector<Tensor> outputs = (*compiled)({inputs, targets});
  const auto found = step_layouts_.find(layout_key(accumulation_steps, inputs, targets));
  MN_CHECK(found != step_layouts_.end(), RuntimeError, trainer_name(), ": no layout for a compiled step of batch ",
           inputs.sizes());
  const StepLayout& layout = found->second;
  MN_CHECK(outputs.size() == 1 + layout.components.size() + layout.pending_metrics.size(), RuntimeError,
           trainer_name(), ": a compiled step returned ", outputs.size(), " tensors, its layout names ",
           1 + layout.components.size() + layout.pending_metrics.size());
  LossOutput out;
  out.total = outputs[0];
  size_t i = 1;
  for (const std::string& name : layout.components) out.components[name] = outputs[i++];
  out.metrics = layout.metrics;
  for (const auto& [name, divisor] : layout.pending_metrics) out.pending_metrics[name] = {outputs[i++], divisor};
  return out;
}

LossOutput Trainer::train_step(const Batch& batch, int64_t accumulation_steps, const StepPosition* step) {
  LossOutput out;
  {
    // Data parallel: only the backward that completes a window communicates (no_sync before it).
    const bool sync = step == nullptr || window_last_batch_ < 0 || step->batch >= window_last_batch_;
    SyncScope scope(data_parallel_, sync);
    out = config_.compile ? compiled_backward_step(batch, accumulation_steps) : backward_step(batch, accumulation_steps);
  }
  // With a scaler, overflowing gradients are its business (it skips the step); the loss is still checked.
  if (step != nullptr && !scaler_)
    if (Tensor probe = optim::nonfinite_grad_probe(optimizer_->params()); probe.defined())
      out.pending_metrics[kGradProbe] = {probe, 1.0};
  out.read_metrics();
  if (step != nullptr) {
    double grads = 0.0;
    if (const auto it = out.metrics.find(kGradProbe); it != out.metrics.end()) {
      grads = it->second;
      out.metrics.erase(it);
    }
    const auto total = out.metrics.find("total");
    const bool loss_finite = total == out.metrics.end() || std::isfinite(total->second);
    if (!loss_finite || !std::isfinite(grads)) report_nonfinite(out, loss_finite, *step);
  }
  if (++pending_batches_ >= accumulation_steps) optimizer_step();
  return out;
}

void Trainer::report_nonfinite(const LossOutput& out, bool loss_finite, const StepPosition& step) {
  std::vector<std::string> what;
  if (!loss_finite) {
    std::string values;
    for (const auto& [name, value] : out.metrics)
      if (!std::isfinite(value))  // "nan", whatever its sign bit
        values += str(values.empty() ? "" : ", ", name, " = ", std::isnan(value) ? std::string("nan") : str(value));
    what.push_back(str("loss (", values, ")"));
  }
  {
    // Off the hot path: name the tensors whose gradients hold the NaN or infinity (one read each).
    autograd::NoGradGuard no_grad;
    for (const auto& [name, p] : described_parameters()) {
      const Tensor g = p.grad();
      if (g.defined() && !std::isfinite(sum(mul(g.detach(), 0.0)).item())) what.push_back("gradient of " + name);
    }
  }
  std::string joined;
  for (const std::string& w : what) joined += (joined.empty() ? "" : "; ") + w;
  const std::string where = str("epoch ", current_epoch_ + 1, "/", config_.max_epochs, ", batch ", step.batch + 1,
                                " (global step ", step.global_step, ", counted from 0)");
  if (config_.on_nonfinite == "error")
    throw RuntimeError(str(trainer_name(), ": non-finite values at ", where, ": ", joined,
                           ". The step was not applied. Lower the learning rate, clip gradients "
                           "(gradient_clip_norm) or check the data; on_nonfinite = \"warn\" trains on."));
  if (nonfinite_steps_++ == 0)
    log_warning(str("warning: ", trainer_name(), ": non-finite values at ", where, ": ", joined,
                    " (training on; later such steps of this epoch are counted at its end)"));
}

std::string Trainer::compile_report() const {
  std::string report;
  for (const auto& [k, compiled] : compiled_steps_) {
    if (compiled_steps_.size() > 1) report += str("accumulation ", k, ": ");
    report += compiled->explain();
  }
  return report;
}

void Trainer::optimizer_step() {
  // f16: the gradients are divided by the loss scale before clipping, so clipping sees the true ones.
  if (scaler_) scaler_->unscale_(*optimizer_);
  const std::vector<Tensor> clipped = clipped_parameters();
  if (config_.gradient_clip_norm) optim::clip_grad_norm_(clipped, *config_.gradient_clip_norm);
  if (config_.gradient_clip_value) optim::clip_grad_value_(clipped, *config_.gradient_clip_value);
  if (scaler_) {
    if (!scaler_->step(*optimizer_)) ++skipped_steps_;  // a gradient overflowed: nothing applied
    scaler_->update();
  } else {
    optimizer_->step();
  }
  optimizer_->zero_grad();
  pending_batches_ = 0;
  ++global_step_;
}

void Trainer::finish_accumulation_window() {
  if (pending_batches_ == 0) return;
  if (config_.discard_partial_accumulation) {
    optimizer_->zero_grad();
    pending_batches_ = 0;
    return;
  }
  // Each backward was scaled by 1/k; a window of m < k batches becomes a mean over its m batches.
  const double rescale = static_cast<double>(config_.accumulation_steps) / static_cast<double>(pending_batches_);
  if (rescale != 1.0) {
    autograd::NoGradGuard no_grad;
    for (const Tensor& p : optimizer_->params()) {
      Tensor g = p.grad();
      if (g.defined()) p.set_grad(mul(g.detach(), rescale));
    }
  }
  optimizer_step();
}

}  // namespace mn::train
