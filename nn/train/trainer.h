#pragma once
// Trainer: the training loop of any nn::Module with a loss - epochs, validation, callbacks, gradient
// accumulation and clipping, LR schedulers, a learning-rate range test, compiled steps, data-parallel
// metrics and resumable state.
//
//   train::Trainer trainer(*net, train_loader, &val_loader, train::classification(),
//                          {.max_epochs = 10, .learning_rate = 1e-3, .scheduler = "cosine"},
//                          {std::make_shared<train::CsvLogger>("out/metrics.csv")});
//   train::History history = trainer.fit();
//
// mapping::MappingTrainer is this loop with the mapping-specific step (latents, regularisers,
// perturbed forwards) plugged in through the protected hooks below.
//
// Loop:
//   fit: [lr sweep] on_fit_start; for epoch = epoch() .. max_epochs-1: stop here if should_stop;
//        on_epoch_start; train epoch; [on_validation_start, evaluate, on_validation_end];
//        record history; on_epoch_end(epoch, metrics); scheduler step; on_fit_end (always).
//   train epoch: train mode, zero_grad; per batch on_batch_start, step, on_batch_end; ends early
//        when should_stop is set. Step: forward; loss; backward of total / k; a NaN/inf loss or
//        gradient stops the fit (on_nonfinite); every k batches clip and step the optimizer.
//        With config.amp "f16": backward of (total / k) * scale; every k batches unscale, clip, and
//        step unless a gradient overflowed (then skipped and counted), then update the scale.
//   * A partial accumulation window at the end of an epoch is stepped, with its gradients rescaled to a
//     mean over the batches it holds (or dropped with discard_partial_accumulation).
//   * With a DataParallel attached (set_data_parallel), the micro-batches of an accumulation window
//     except the last run without gradient communication (no_sync), and every pass's metrics are
//     averaged over the ranks before callbacks and history see them.
//   * History has explicit keys: train_task_loss, train_total_loss, [train_accuracy],
//     [val_task_loss, val_total_loss, val_accuracy], lr - one value per completed epoch. Epoch means
//     are weighted by batch size.
//   * fit() continues from the stored epoch up to max_epochs, and starts with should_stop cleared.
//   * A state captured between two optimizer steps of an epoch (ModelCheckpoint's every_n_steps) holds the
//     position: after load_state, fit() continues that epoch at the next batch (on_epoch_start fires for
//     it again, on_batch_start/end with the batch indices that follow) with the epoch's metric sums so far,
//     so the run's steps, history and final state are those of the uninterrupted fit, bit for bit.
//   * Randomness the trainer draws (a subclass's noise, probes) comes from its own generator, seeded
//     from config.seed; together with the global generator (dropout) its position is part of the
//     resumable state, so the same seed gives the same losses, also across a save and resume.
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "autograd/autocast.h"
#include "core/random.h"
#include "nn/compile.h"
#include "nn/data/dataloader.h"
#include "nn/grad_scaler.h"
#include "nn/module.h"
#include "nn/optim.h"
#include "nn/train/callback.h"
#include "nn/train/checkpoint.h"
#include "nn/train/config.h"
#include "nn/train/data_parallel.h"
#include "nn/train/history.h"
#include "nn/train/loss.h"
#include "nn/train/lr_finder.h"
#include "nn/train/state.h"

namespace mn::train {

class Trainer {
 public:
  // Runs the model on one batch. Default: model.forward(batch.inputs).
  using BatchForward = std::function<Tensor(nn::Module& model, const data::Batch& batch)>;
  // Combines one pass's metrics with the other ranks' (`samples`: this rank's share of the pass).
  using MetricsReducer = std::function<Metrics(const Metrics& metrics, int64_t samples)>;

  // Trains the parameters of `model` that require grad. The model and loaders must outlive the trainer.
  Trainer(nn::Module& model, data::DataLoader& train_loader, data::DataLoader* val_loader, Objective objective,
          TrainerConfig config = {}, std::vector<std::shared_ptr<Callback>> callbacks = {});
  virtual ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Trains from epoch() up to config.max_epochs; returns the whole history (restored epochs included).
  History fit(bool auto_lr_find = false);
  // One pass of training steps over `loader` (no set_epoch, validation, history, epoch hooks or
  // scheduler step; a partial accumulation window is finished). Returns the epoch's train metrics.
  Metrics fit_epoch(data::DataLoader& loader);
  // Mean val_* metrics over `loader` without gradients, in eval mode (training mode restored after).
  Metrics evaluate(data::DataLoader& loader);

  // Sweeps lr_k = min (max/min)^(k / max(1, n-1)) over n training steps, with an EMA of the loss
  // (s_0 = l_0, s_k = beta s_{k-1} + (1-beta) l_k) and a stop once s_k > threshold * min(s) (or the
  // loss is not finite). Afterwards everything is as before: trainable tensors (bitwise), optimizer
  // state and lr, scheduler epoch, model buffers, random generators, epoch, should_stop and the
  // gradient scaler's state.
  LRFinderResult lr_find(const LRFinderOptions& options);
  LRFinderResult lr_find(double min_lr = 1e-7, double max_lr = 10.0, int64_t num_iterations = 100,
                         double divergence_threshold = 4.0, double beta = 0.95);

  // Ask a running fit to stop at the next batch boundary as if interrupted (safe to call from a
  // signal handler).
  void interrupt() { interrupt_requested_.store(true); }

  // ---- state ----
  int64_t epoch() const { return epoch_; }                  // completed epochs
  void set_epoch(int64_t epoch);  // also forgets a restored mid-epoch position
  int64_t current_epoch() const { return current_epoch_; }  // the epoch running (or last run)
  bool should_stop() const { return should_stop_; }
  void set_should_stop(bool stop) { should_stop_ = stop; }
  double learning_rate() const;
  // Sets the base learning rate: the optimizer's lr, and the scheduler restarts from it.
  void set_learning_rate(double lr);
  void set_max_epochs(int64_t max_epochs);
  const History& history() const { return history_; }
  // Captured between two optimizer steps of fit's training pass (at_step_boundary()), the state holds
  // the position in the epoch (TrainerState::progress): the next fit() after load_state continues that
  // epoch at the next batch, with the epoch's metric sums so far, and ends as the uninterrupted fit would.
  // Captured elsewhere inside an epoch it holds only the completed epochs (as between epochs); so it does
  // under data parallel unless sync_epoch_progress() ran at this batch.
  TrainerState state() const;
  // Restores a state (a mid-epoch one: fit() continues its epoch; set_epoch forgets that position).
  void load_state(const TrainerState& state);
  // Optimizer steps of the fit's training passes so far, restored ones included.
  int64_t global_step() const { return global_step_; }
  // Inside fit's training pass, after at least one batch, with no gradient accumulated since the last
  // optimizer step: where state() records a resumable position in the epoch.
  bool at_step_boundary() const;
  // Data parallel: gathers every rank's metric sums of the epoch so far, so that state() at this batch
  // records them all (a collective: every rank calls it at the same batch). Otherwise nothing.
  void sync_epoch_progress();
  // The process that writes files for the job: true without data parallel, else rank 0 only.
  bool is_main_process() const;

  // ---- parts ----
  nn::Module& module() { return module_; }
  const nn::Module& module() const { return module_; }
  const TrainerConfig& config() const { return config_; }
  nn::optim::Optimizer& optimizer() { return *optimizer_; }
  const nn::optim::Optimizer& optimizer() const { return *optimizer_; }
  nn::optim::LRScheduler* scheduler() { return scheduler_.get(); }
  data::DataLoader& train_loader() { return train_loader_; }
  data::DataLoader* val_loader() { return val_loader_; }
  // The loader of the pass that is running (train or validation), else the train loader.
  const data::DataLoader& active_loader() const { return active_loader_ ? *active_loader_ : train_loader_; }
  Generator& generator() { return generator_; }
  const std::vector<std::shared_ptr<Callback>>& callbacks() const { return callbacks_; }
  void add_callback(std::shared_ptr<Callback> callback);
  void set_batch_forward(BatchForward forward) { batch_forward_ = std::move(forward); }
  // Data-parallel training (dist::DistributedDataParallel implements DataParallel): no_sync for the
  // non-final micro-batches of an accumulation window, and metrics averaged over the ranks. Null
  // detaches. The object must outlive the trainer's use of it.
  void set_data_parallel(DataParallel* data_parallel);
  // Metrics reduction alone (fit calls it after every pass, lr_find on each step's loss, key
  // "lr_find_loss"); set_data_parallel installs the data-parallel one.
  void set_metrics_reducer(MetricsReducer reducer) { metrics_reducer_ = std::move(reducer); }
  // The optimizer's tensors (default: the module's parameters that require grad).
  virtual std::vector<Tensor> trainable_parameters() const;
  // config.compile: what the compiled steps did (CompiledFunction::explain per accumulation factor).
  std::string compile_report() const;
  // config.amp "f16": the gradient scaler (its state is part of state()); null otherwise.
  amp::GradScaler* grad_scaler() { return scaler_.get(); }
  const amp::GradScaler* grad_scaler() const { return scaler_.get(); }
  // Writes a checkpoint that resumes this fit exactly (default: save_module_checkpoint, the module's
  // state dict and the trainer state; mapping::MappingTrainer: a seed-only mapping checkpoint).
  virtual void save_checkpoint(const std::string& path, const CheckpointMetadata& metadata = {}) const;
  // Restores what save_checkpoint wrote (checked completely before anything changes).
  virtual void load_checkpoint(const std::string& path);
  // The loss as logged at fit start.
  virtual std::string describe_loss() const { return objective_.name; }
  // Names the trainer in errors and warnings ("Trainer", "MappingTrainer").
  virtual std::string trainer_name() const { return "Trainer"; }

 protected:
  // For subclasses: builds nothing until initialize() (virtual hooks are not dispatched during
  // construction); the subclass constructor ends with initialize(). `generator_stream` keys the
  // trainer's own random stream (part of resumable state: keep it fixed for a subclass).
  struct Deferred {};
  Trainer(Deferred, nn::Module& model, data::DataLoader& train_loader, data::DataLoader* val_loader,
          Objective objective, TrainerConfig config, std::vector<std::shared_ptr<Callback>> callbacks,
          const char* generator_stream);
  // Builds the optimizer and scheduler over trainable_parameters(), then seeds the global generator
  // from config.seed (last: the model exists already).
  void initialize();

  // ---- hooks ----
  // Forward and loss of one batch (metrics may stay pending: called inside DeferredMetrics). Default:
  // forward_batch, then the objective against the batch's targets.
  virtual LossOutput compute_loss(const data::Batch& batch);
  // The tensors gradient clipping applies to (default: trainable_parameters()).
  virtual std::vector<Tensor> clipped_parameters() const { return trainable_parameters(); }
  // Named trainable tensors for messages about non-finite gradients (default: "parameter '<name>'").
  virtual std::vector<std::pair<std::string, Tensor>> described_parameters() const;
  // What makes a compiled step's recording reusable (default: nn::module_guard plus the trainable
  // tensors' memory).
  virtual Guard compile_guard() const;
  // Buffers lr_find restores afterwards (default: the module's named buffers).
  virtual nn::StateDict snapshot_buffers() const;
  virtual void restore_buffers(const nn::StateDict& saved);
  // The device batches are moved to (default: the first trainable tensor's, else the CPU).
  virtual Device device() const;

  // Runs the model on one batch (batch_forward or model.forward; inputs moved to device()).
  Tensor forward_batch(const data::Batch& batch);
  Tensor batch_targets(const data::Batch& batch) const;  // moved to device()
  const BatchForward& batch_forward() const { return batch_forward_; }
  void log(const std::string& line) const;
  void log_warning(const std::string& line) const;  // config.log, else stderr

 private:
  struct StepPosition {
    int64_t batch, global_step;
  };
  // forward + loss + backward of total / accumulation; steps when the window is full. With `step`
  // (where the fit is, for messages) the loss and gradients are checked as config.on_nonfinite says.
  LossOutput train_step(const data::Batch& batch, int64_t accumulation_steps, const StepPosition* step = nullptr);
  void report_nonfinite(const LossOutput& out, bool loss_finite, const StepPosition& step);
  LossOutput backward_step(const data::Batch& batch, int64_t accumulation_steps);  // without the step
  LossOutput compiled_backward_step(const data::Batch& batch, int64_t accumulation_steps);
  void optimizer_step();
  // fit_epoch's loop, continuing `resume` when given; with `expose` (fit's own pass, whose epoch the
  // trainer knows) its position and sums are state()'s while it runs.
  Metrics train_pass(data::DataLoader& loader, const EpochProgress* resume, bool expose);
  PassSums resumed_sums(const EpochProgress& progress) const;  // this rank's share of a saved position
  int64_t steps_per_epoch() const;  // optimizer steps of a whole epoch of the train loader
  void finish_accumulation_window();
  void rebuild_scheduler();
  double scheduler_metric(const Metrics& metrics) const;
  void step_scheduler();  // the pending step, if any
  // Data parallel: every rank must start fit() at the same position (epoch, global step, batch within
  // the epoch); RuntimeError naming each rank's position otherwise. A collective.
  void check_ranks_start_together();
  // TrainerConfig::amp: an autocast scope in `scope` for a forward and loss ("" leaves it empty).
  void enter_autocast(std::optional<autocast>& scope) const;
  std::vector<std::string> callback_keys() const;
  Metrics reduce(Metrics local) const;
  void check_interrupt();
  template <class Hook>
  void fire(const char* hook, Hook&& call);

  nn::Module& module_;
  data::DataLoader& train_loader_;
  data::DataLoader* val_loader_;
  Objective objective_;
  TrainerConfig config_;
  std::vector<std::shared_ptr<Callback>> callbacks_;
  std::unique_ptr<nn::optim::Optimizer> optimizer_;
  std::unique_ptr<nn::optim::LRScheduler> scheduler_;
  Generator generator_;
  BatchForward batch_forward_;
  DataParallel* data_parallel_ = nullptr;
  MetricsReducer metrics_reducer_;
  // config_.compile: one compiled backward_step per accumulation factor (a constant of the graph), and
  // what the compiled function returns, per accumulation factor and batch shape.
  std::map<int64_t, std::unique_ptr<CompiledFunction>> compiled_steps_;
  struct StepLayout {
    std::vector<std::string> components;
    std::vector<std::pair<std::string, double>> pending_metrics;  // name, divisor
    std::map<std::string, double> metrics;                        // host values (constants of the step)
  };
  std::map<std::vector<int64_t>, StepLayout> step_layouts_;
  int64_t last_pass_samples_ = 0;  // samples averaged by the last fit_epoch / evaluate
  History history_;
  int64_t epoch_ = 0;
  int64_t current_epoch_ = 0;
  bool should_stop_ = false;
  bool callbacks_enabled_ = true;
  // Between recording an epoch and its scheduler step (on_epoch_end), with the metric that step uses.
  bool scheduler_step_pending_ = false;
  double pending_scheduler_metric_ = 0.0;
  int64_t pending_batches_ = 0;  // backwards accumulated since the last optimizer step
  int64_t window_last_batch_ = -1;  // fit_epoch: index of the current window's last batch (for no_sync)
  int64_t nonfinite_steps_ = 0;  // this epoch's non-finite steps (on_nonfinite "warn")
  const data::DataLoader* active_loader_ = nullptr;
  std::atomic<bool> interrupt_requested_{false};
  // Mid-epoch positions (state(), load_state, ModelCheckpoint's every_n_steps).
  int64_t global_step_ = 0;                     // optimizer steps, see global_step()
  const PassSums* pass_sums_ = nullptr;         // fit's training pass running: its sums so far
  int64_t pass_batches_ = 0;                    // ... and the batches it has trained
  std::vector<PassSums> gathered_sums_;         // sync_epoch_progress at the current batch (rank order)
  std::optional<EpochProgress> resume_progress_;  // loaded, for the next fit() to continue
  // Mixed precision (config.amp "f16"): the loss scaler, and the optimizer steps of this epoch it skipped.
  std::unique_ptr<amp::GradScaler> scaler_;
  int64_t skipped_steps_ = 0;
};

}  // namespace mn::train
