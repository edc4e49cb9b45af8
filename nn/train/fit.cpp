// Trainer: the fit loop, its training and validation passes, callbacks and the scheduler step.
#include <algorithm>

#include "autograd/node.h"
#include "nn/train/trainer.h"

namespace mn::train {

namespace optim = nn::optim;
using data::Batch;
using data::DataLoader;

namespace {

int64_t batch_samples(const Batch& batch) {
  return batch.inputs.defined() && batch.inputs.dim() > 0 ? batch.inputs.size(0) : 1;
}

// Sample-weighted means of a pass's loss metrics.
struct EpochAverages {
  PassSums sums;

  void add(const LossOutput& out, int64_t n) {
    const double total_value = out.metrics.count("total") ? out.metrics.at("total") : out.total.detach().item();
    const auto task_it = out.metrics.find("task");
    sums.task += (task_it != out.metrics.end() ? task_it->second : total_value) * static_cast<double>(n);
    sums.total += total_value * static_cast<double>(n);
    sums.samples += n;
    if (const auto acc = out.metrics.find("accuracy"); acc != out.metrics.end()) {
      sums.accuracy += acc->second * static_cast<double>(n);
      sums.accuracy_samples += n;
    }
  }
  Metrics finish(const char* task_key, const char* total_key, const char* accuracy_key) const {
    Metrics m;
    m[task_key] = sums.task / static_cast<double>(sums.samples);
    m[total_key] = sums.total / static_cast<double>(sums.samples);
    if (sums.accuracy_samples > 0) m[accuracy_key] = sums.accuracy / static_cast<double>(sums.accuracy_samples);
    return m;
  }
};

// Sets a pointer for the lifetime of a scope.
class ActiveLoader {
 public:
  ActiveLoader(const DataLoader*& slot, const DataLoader& loader) : slot_(slot), previous_(slot) { slot_ = &loader; }
  ~ActiveLoader() { slot_ = previous_; }

 private:
  const DataLoader*& slot_;
  const DataLoader* previous_;
};

}  // namespace

void Trainer::check_interrupt() {
  if (interrupt_requested_.exchange(false)) throw TrainingInterrupted("training interrupted by request");
}

template <class Hook>
void Trainer::fire(const char* hook, Hook&& call) {
  if (!callbacks_enabled_) return;
  // Checkpoint writers last (Callback::saves_checkpoints), otherwise in registration order.
  for (const bool writers : {false, true})
    for (const auto& callback : callbacks_) {
      if (callback->saves_checkpoints() != writers) continue;
      try {
        call(*callback);
      } catch (const TrainingInterrupted&) {
        throw;
      } catch (const std::exception& e) {
        throw RuntimeError(str("Callback '", callback->name(), "' failed during ", hook, ": ", e.what()));
      }
    }
}

// ---- passes ----

Metrics Trainer::fit_epoch(DataLoader& loader) { return train_pass(loader, nullptr, false); }

Metrics Trainer::train_pass(DataLoader& loader, const EpochProgress* resume, bool expose) {
  ActiveLoader active(active_loader_, loader);
  module_.train();
  optimizer_->zero_grad();
  pending_batches_ = 0;
  nonfinite_steps_ = 0;
  skipped_steps_ = 0;
  EpochAverages averages;
  int64_t index = 0;
  const int64_t batches = loader.size(), k = config_.accumulation_steps;
  const int64_t first_step = current_epoch_ * batches;
  if (resume != nullptr) {
    MN_CHECK(resume->batches < batches, ValueError, trainer_name(), ": the restored state stopped after batch ",
             resume->batches, " of epoch ", current_epoch_ + 1, ", but the training loader has ", batches,
             " batches per epoch (another data set size or batch size?)");
    index = resume->batches;
    nonfinite_steps_ = resume->nonfinite_steps;
    skipped_steps_ = resume->skipped_steps;
    averages.sums = resumed_sums(*resume);
  }
  // The position is state()'s while the pass runs (cleared however it ends).
  struct Exposed {
    Trainer& t;
    bool on;
    ~Exposed() {
      if (on) t.pass_sums_ = nullptr;
      t.gathered_sums_.clear();
    }
  } exposed{*this, expose};
  if (expose) {
    pass_sums_ = &averages.sums;
    pass_batches_ = index;
  }
  while (index < batches) {
    check_interrupt();
    const Batch batch = loader.batch(index);
    const int64_t b = index;
    fire("on_batch_start", [&](Callback& cb) { cb.on_batch_start(*this, b); });
    // The window's last micro-batch: a full window's k-th, or the epoch's last batch.
    window_last_batch_ = std::min(b - b % k + k, batches) - 1;
    const StepPosition position{b, first_step + b};
    const LossOutput out = train_step(batch, k, &position);
    // Counted before on_batch_end, so a state captured there includes this batch.
    averages.add(out, batch_samples(batch));
    ++index;
    if (expose) pass_batches_ = index;
    gathered_sums_.clear();
    fire("on_batch_end", [&](Callback& cb) { cb.on_batch_end(*this, b, out); });
    if (should_stop_) break;
  }
  window_last_batch_ = -1;
  MN_CHECK(index > 0, ValueError, trainer_name(), ": the training loader yielded no batches (", loader.num_samples(),
           " samples, batch_size ", loader.options().batch_size, ")");
  finish_accumulation_window();
  if (nonfinite_steps_ > 1) {
    log_warning(str("warning: ", trainer_name(), ": ", nonfinite_steps_, " of ", index, " steps of epoch ", current_epoch_ + 1,
                    " were not finite"));
  }
  last_pass_samples_ = averages.sums.samples;
  Metrics metrics =
      averages.finish(history_keys::kTrainTaskLoss, history_keys::kTrainTotalLoss, history_keys::kTrainAccuracy);
  if (scaler_) {
    metrics[history_keys::kTrainSkippedSteps] = static_cast<double>(skipped_steps_);
    if (skipped_steps_ > 0)
      log(str(trainer_name(), ": the gradient scaler skipped ", skipped_steps_, " optimizer step",
              skipped_steps_ == 1 ? "" : "s", " of epoch ", current_epoch_ + 1,
              " (gradients not finite); loss scale now ", scaler_->get_scale()));
  }
  return metrics;
}

Metrics Trainer::evaluate(DataLoader& loader) {
  ActiveLoader active(active_loader_, loader);
  const bool was_training = module_.is_training();
  module_.eval();
  EpochAverages averages;
  try {
    autograd::NoGradGuard no_grad;
    for (const Batch& batch : loader) {
      check_interrupt();
      LossOutput out;
      {
        DeferredMetrics defer;
        std::optional<autocast> amp;
        enter_autocast(amp);  // evaluated in the precision it trains in
        out = compute_loss(batch);
      }
      out.read_metrics();
      averages.add(out, batch_samples(batch));
    }
  } catch (...) {
    module_.train(was_training);
    throw;
  }
  module_.train(was_training);
  MN_CHECK(averages.sums.samples > 0, ValueError, trainer_name(), ": the validation loader yielded no batches");
  last_pass_samples_ = averages.sums.samples;
  return averages.finish(history_keys::kValTaskLoss, history_keys::kValTotalLoss, history_keys::kValAccuracy);
}

// The metric a scheduler step uses: ReduceLROnPlateau watches val_total_loss (train_total_loss without
// validation); time-based schedules ignore it.
double Trainer::scheduler_metric(const Metrics& metrics) const {
  if (dynamic_cast<optim::ReduceLROnPlateau*>(scheduler_.get()) == nullptr) return 0.0;
  auto it = metrics.find(history_keys::kValTotalLoss);
  if (it == metrics.end()) it = metrics.find(history_keys::kTrainTotalLoss);
  MN_CHECK(it != metrics.end(), RuntimeError, "ReduceLROnPlateau needs '", history_keys::kValTotalLoss, "' or '",
           history_keys::kTrainTotalLoss, "' in the epoch's metrics");
  return it->second;
}

void Trainer::step_scheduler() {
  if (!scheduler_step_pending_) return;
  scheduler_step_pending_ = false;
  if (scheduler_) scheduler_->step(pending_scheduler_metric_);
}

Metrics Trainer::reduce(Metrics local) const {
  return metrics_reducer_ ? metrics_reducer_(local, last_pass_samples_) : local;
}

// A rank that resumed another checkpoint than the others (or none: a node that does not see the shared
// checkpoint directory starts fresh under mn-train --auto-resume) would train other batches under the
// same all-reduce and nobody would notice; compare the positions first.
void Trainer::check_ranks_start_together() {
  if (data_parallel_ == nullptr || data_parallel_->world_size() <= 1) return;
  const double batches = resume_progress_ ? static_cast<double>(resume_progress_->batches) : 0.0;
  const std::vector<double> mine = {static_cast<double>(epoch_), static_cast<double>(global_step_), batches};
  const std::vector<std::vector<double>> all = data_parallel_->all_gather(mine);
  bool same = true;
  for (const auto& v : all) same = same && v == all.front();
  if (same) return;
  std::string positions;
  for (size_t r = 0; r < all.size(); ++r) {
    const auto& v = all[r];
    positions += str(r == 0 ? "" : "; ", "rank ", r, ": ",
                     v[0] == 0 && v[1] == 0 && v[2] == 0 ? std::string("a fresh start")
                               : str("epoch ", static_cast<int64_t>(v[0]) + 1, ", global step ",
                                     static_cast<int64_t>(v[1]), ", batch ", static_cast<int64_t>(v[2]),
                                     " of its epoch"));
  }
  throw RuntimeError(str(trainer_name(), ": the data-parallel ranks start from different positions (", positions,
                         "); every rank must resume the same checkpoint (on several nodes, the checkpoint "
                         "directory must be one all nodes share)"));
}

History Trainer::fit(bool auto_lr_find) {
  if (auto_lr_find) {
    const LRFinderOptions& o = config_.lr_finder;
    const LRFinderResult sweep = lr_find(o);
    const double suggested = sweep.suggestion(o.method);
    log(str("LR finder: setting the learning rate to ", suggested, " (", o.method, ")"));
    set_learning_rate(suggested);
  }
  should_stop_ = false;  // a stop that ended an earlier fit (or came with a checkpoint) is history
  interrupt_requested_.store(false);
  log(str("fit: epochs ", epoch_ + 1, "..", config_.max_epochs, ", loss = ", describe_loss(), ", optimizer ",
          optimizer_->name(), " lr ", learning_rate(), config_.accumulation_steps > 1
              ? str(", accumulation ", config_.accumulation_steps) : std::string()));

  check_ranks_start_together();
  try {
    fire("on_fit_start", [&](Callback& cb) { cb.on_fit_start(*this); });
    for (int64_t epoch = epoch_; epoch < config_.max_epochs; ++epoch) {
      current_epoch_ = epoch;
      if (should_stop_) break;
      check_interrupt();
      fire("on_epoch_start", [&](Callback& cb) { cb.on_epoch_start(*this, epoch); });
      const double epoch_lr = learning_rate();
      train_loader_.set_epoch(static_cast<uint64_t>(epoch));
      // A restored mid-epoch position continues its epoch (the first one run here), once.
      const std::optional<EpochProgress> resume = std::move(resume_progress_);
      resume_progress_.reset();
      Metrics metrics = reduce(train_pass(train_loader_, resume ? &*resume : nullptr, true));
      if (val_loader_ != nullptr) {
        fire("on_validation_start", [&](Callback& cb) { cb.on_validation_start(*this); });
        const Metrics val = reduce(evaluate(*val_loader_));
        fire("on_validation_end", [&](Callback& cb) { cb.on_validation_end(*this, val); });
        metrics.insert(val.begin(), val.end());
      }
      metrics[history_keys::kLearningRate] = epoch_lr;
      for (const auto& [key, value] : metrics) history_.append(key, value);
      epoch_ = epoch + 1;
      scheduler_step_pending_ = true;
      pending_scheduler_metric_ = scheduler_metric(metrics);
      fire("on_epoch_end", [&](Callback& cb) { cb.on_epoch_end(*this, epoch, metrics); });
      step_scheduler();
    }
  } catch (const TrainingInterrupted& e) {
    log(str("Training interrupted at epoch ", current_epoch_ + 1, ": ", e.what()));
    optimizer_->zero_grad();  // a half-accumulated window belongs to no epoch
    pending_batches_ = 0;
    step_scheduler();  // when pending: the recorded epoch completed
  } catch (...) {
    try {
      fire("on_fit_end", [&](Callback& cb) { cb.on_fit_end(*this); });
    } catch (...) {
      // the original error is the one to report
    }
    throw;
  }
  fire("on_fit_end", [&](Callback& cb) { cb.on_fit_end(*this); });
  return history_;
}

}  // namespace mn::train
