#pragma once
// MappingTrainer: the training loop of a MappingModel - epochs, validation, callbacks, gradient
// accumulation, clipping, LR schedulers, a learning-rate range test and resumable state.
//
//   auto loss = std::make_shared<MappingLoss>(std::make_shared<ClassificationLoss>());
//   MappingTrainer trainer(model, train_loader, &val_loader, loss, {.max_epochs = 20, .learning_rate = 3e-3},
//                          {std::make_shared<EarlyStopping>("val_total_loss", 3)});
//   History history = trainer.fit();
//
// Loop (reference semantics, §5 of the library notes):
//   fit: [lr sweep] on_fit_start; for epoch = epoch() .. max_epochs-1: stop here if should_stop;
//        on_epoch_start; train epoch; [on_validation_start, validate, on_validation_end];
//        record history; on_epoch_end(epoch, metrics); scheduler step; on_fit_end (always).
//   train epoch: train mode, zero_grad; per batch on_batch_start, step, on_batch_end; ends early
//        when should_stop is set. Step: forward; context; loss; backward of total / k; a NaN/inf
//        loss or gradient stops the fit (on_nonfinite); every k batches clip (latents only) and step
//        the optimizer.
//
// Where the port does better than the reference library:
//   * A task loss handed over as is trains the task only; regularisers are opt-in through an
//     explicit MappingLoss (whose defaults are the reference's). The active terms are logged at fit
//     start. No loss at all means RegressionLoss, task only.
//   * The optimizer sees only trainable tensors: the latents and, if trainable, the loss's rho's.
//   * The perturbed (stability) forward runs on exactly the same inputs as the clean one, through
//     the same forward function; the alignment summaries use the clean latents.
//   * A partial accumulation window at the end of an epoch is stepped, with its gradients rescaled
//     to a mean over the batches it holds (or dropped with discard_partial_accumulation).
//   * History has explicit keys: train_task_loss, train_total_loss, [train_accuracy],
//     [val_task_loss, val_total_loss, val_accuracy], lr - one value per completed epoch. Epoch means
//     are weighted by batch size. Validation runs without gradients, so its total has no smoothness
//     term (reported absent, see losses.h).
//   * fit() continues from the stored epoch up to max_epochs, and starts with should_stop cleared:
//     a stop that ended an earlier fit (or was restored from a checkpoint) does not abort this one.
//   * Randomness (stability noise, Hutchinson probes) comes from the trainer's own generator, seeded
//     from config.seed; together with the global generator (dropout) its position is part of the
//     resumable state, so the same seed gives the same losses, also across a save and resume.
#include <atomic>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/random.h"
#include "mapping/losses.h"
#include "mapping/mapping_model.h"
#include "nn/data/dataloader.h"
#include "nn/optim.h"

namespace mn {
class Progress;
}

namespace mn::mapping {

class MappingTrainer;

// ---- configuration ----

struct SchedulerOptions {
  int64_t cosine_t_max = 0;  // 0: max_epochs
  double cosine_eta_min = 0.0;
  int64_t step_size = 0;  // 0: max(1, max_epochs / 3)
  double step_gamma = 0.1;
  double exponential_gamma = 0.95;
  nn::optim::ReduceLROnPlateau::Options plateau;  // PyTorch's defaults
};

struct LRFinderOptions {
  double min_lr = 1e-7;
  double max_lr = 10.0;
  int64_t num_iterations = 100;
  double divergence_threshold = 4.0;
  double beta = 0.95;
  std::string method = "steep";  // the suggestion fit(auto_lr_find = true) applies
};

struct TrainerConfig {
  int64_t max_epochs = 100;
  std::string optimizer = "adam";  // adam, adamw, sgd
  double learning_rate = 1e-3;
  double weight_decay = 0.0;
  double momentum = 0.0;  // sgd
  std::string scheduler;  // "" (none), cosine, step, exponential, plateau
  SchedulerOptions scheduler_options;
  std::optional<double> gradient_clip_norm;
  std::optional<double> gradient_clip_value;
  int64_t accumulation_steps = 1;
  std::optional<uint64_t> seed;
  bool discard_partial_accumulation = false;
  LRFinderOptions lr_finder;
  std::ostream* log = nullptr;  // info lines (active loss terms, LR sweep, interrupts); null: silent
  // Training steps (forward, loss, backward) through mn::compile (nn/compile.h): captured once per
  // batch shape, replayed after; the optimizer step stays eager. What cannot be captured (a custom
  // loss reading values on the host) runs eagerly, or throws with fullgraph.
  bool compile = false;
  bool compile_fullgraph = false;
  // A training step whose loss or latent/coefficient gradients hold a NaN or an infinity: "error" stops
  // the fit with a RuntimeError naming the epoch, batch and global step and what was not finite,
  // before the optimizer applies the step; "warn" writes that to `log` (stderr when null) once per
  // epoch, with a count at the epoch's end, and trains on. Checked with the step's metrics read (no
  // extra synchronisation).
  std::string on_nonfinite = "error";
};

// ---- history and resumable state ----

namespace history_keys {
inline constexpr const char* kTrainTaskLoss = "train_task_loss";
inline constexpr const char* kTrainTotalLoss = "train_total_loss";
inline constexpr const char* kTrainAccuracy = "train_accuracy";
inline constexpr const char* kValTaskLoss = "val_task_loss";
inline constexpr const char* kValTotalLoss = "val_total_loss";
inline constexpr const char* kValAccuracy = "val_accuracy";
inline constexpr const char* kLearningRate = "lr";
}  // namespace history_keys

// Per-epoch metric values under explicit names (see history_keys).
class History {
 public:
  void append(const std::string& key, double value) { values_[key].push_back(value); }
  bool contains(const std::string& key) const { return values_.count(key) > 0; }
  const std::vector<double>& at(const std::string& key) const;  // KeyError listing the keys
  const std::vector<double>& operator[](const std::string& key) const { return at(key); }
  std::vector<std::string> keys() const;
  size_t epochs() const;  // entries of train_total_loss
  const std::map<std::string, std::vector<double>>& values() const { return values_; }
  std::map<std::string, std::vector<double>>& values() { return values_; }
  bool operator==(const History& other) const { return values_ == other.values_; }

 private:
  std::map<std::string, std::vector<double>> values_;
};

struct RngState {
  uint64_t trainer_seed = 0, trainer_offset = 0;  // the trainer's generator (noise, probes)
  uint64_t global_seed = 0, global_offset = 0;    // mn::default_generator() (dropout)
};

// What a checkpoint needs to resume a fit exactly (besides the model's latents).
struct TrainerState {
  int64_t epoch = 0;  // completed epochs: the next fit() starts here
  bool should_stop = false;
  nn::optim::OptimizerState optimizer;
  // The optimizer's lr in full precision (the optimizer state holds it as an f32 tensor).
  std::optional<double> learning_rate;
  int64_t scheduler_epoch = 0;  // counting a step still pending at capture (see below)
  // LRScheduler::state_dict() (epoch, and a plateau scheduler's best metric and counters) as captured;
  // when empty (checkpoints from before it was recorded) the scheduler resumes from scheduler_epoch.
  std::map<std::string, double> scheduler_state;
  // Captured from on_epoch_end the finished epoch's scheduler step is still to come: the metric it will
  // use. load_state() restores scheduler_state and the lr, then takes that step, as the run would have.
  std::optional<double> scheduler_step_metric;
  // Callback::state_dict() of each stateful callback, keyed by name() ("#2", "#3" appended to repeats in
  // registration order). Restored into the trainer's callbacks with the same key; others start fresh.
  std::map<std::string, std::map<std::string, double>> callback_states;
  History history;
  RngState rng;
};

// ---- callbacks ----

using Metrics = std::map<std::string, double>;

// Hooks are no-ops by default. An exception thrown from a hook ends the fit as a RuntimeError
// "Callback 'Name' failed during <hook>: <message>" - except TrainingInterrupted, which stops the fit
// quietly (partial history returned).
class Callback {
 public:
  virtual ~Callback() = default;
  // Used in error messages; defaults to the unqualified class name.
  virtual std::string name() const;
  virtual void on_fit_start(MappingTrainer&) {}
  virtual void on_fit_end(MappingTrainer&) {}
  virtual void on_epoch_start(MappingTrainer&, int64_t /*epoch*/) {}
  virtual void on_epoch_end(MappingTrainer&, int64_t /*epoch*/, const Metrics&) {}
  virtual void on_batch_start(MappingTrainer&, int64_t /*batch*/) {}
  virtual void on_batch_end(MappingTrainer&, int64_t /*batch*/, const LossOutput&) {}
  virtual void on_validation_start(MappingTrainer&) {}
  virtual void on_validation_end(MappingTrainer&, const Metrics&) {}
  // State a resumed fit needs (e.g. EarlyStopping's best value and wait count); stored in checkpoints
  // through TrainerState::callback_states. Stateless callbacks keep the empty default.
  virtual std::map<std::string, double> state_dict() const { return {}; }
  virtual void load_state_dict(const std::map<std::string, double>&) {}
  // True for callbacks that save checkpoints from their hooks: at every hook they run after all other
  // callbacks, so a checkpoint written from on_epoch_end holds every callback's update of that epoch.
  virtual bool saves_checkpoints() const { return false; }
};

// The C++ counterpart of Ctrl-C in the reference: thrown by a callback (or raised by
// MappingTrainer::interrupt() at the next batch boundary), it ends fit() early; the epochs completed
// so far stay in the returned history and on_fit_end still runs.
class TrainingInterrupted : public Error {
 public:
  TrainingInterrupted() : Error("training interrupted") {}
  using Error::Error;
};

// Sets should_stop when `monitor` has not improved for `patience` epochs: improvement means
// cur < best - min_delta ("min") or cur > best + min_delta ("max"). Epochs whose metrics lack the key
// are ignored. The stop takes effect at the top of the next epoch, so the triggering epoch is fully
// recorded.
class EarlyStopping : public Callback {
 public:
  explicit EarlyStopping(std::string monitor = history_keys::kValTotalLoss, int64_t patience = 10,
                         double min_delta = 0.0, std::string mode = "min");
  std::string name() const override { return "EarlyStopping"; }
  void on_epoch_end(MappingTrainer& trainer, int64_t epoch, const Metrics& metrics) override;
  double best() const { return best_; }
  int64_t wait() const { return wait_; }
  // "wait", and "best" once a value was seen.
  std::map<std::string, double> state_dict() const override;
  void load_state_dict(const std::map<std::string, double>& state) override;

 private:
  std::string monitor_;
  int64_t patience_;
  double min_delta_;
  bool maximize_;
  double best_;
  int64_t wait_ = 0;
};

// Writes "Epoch e/E started", "  batch b: k=v, ..." every N batches, "  validation: ..." and
// "Epoch e/E: k=v, ..." lines (1-based numbers, 4 decimals).
class MetricLogger : public Callback {
 public:
  explicit MetricLogger(int64_t every_n_batches = 10);
  MetricLogger(int64_t every_n_batches, std::ostream& out);
  std::string name() const override { return "MetricLogger"; }
  void on_epoch_start(MappingTrainer& trainer, int64_t epoch) override;
  void on_batch_end(MappingTrainer& trainer, int64_t batch, const LossOutput& output) override;
  void on_validation_end(MappingTrainer& trainer, const Metrics& metrics) override;
  void on_epoch_end(MappingTrainer& trainer, int64_t epoch, const Metrics& metrics) override;

 private:
  int64_t every_n_batches_;
  std::ostream* out_;
};

// A progress line per epoch (mn::Progress: redrawn on a terminal, plain lines otherwise).
class ProgressCallback : public Callback {
 public:
  explicit ProgressCallback(int64_t plain_every = 0);
  ~ProgressCallback() override;
  std::string name() const override { return "ProgressCallback"; }
  void on_epoch_start(MappingTrainer& trainer, int64_t epoch) override;
  void on_batch_end(MappingTrainer& trainer, int64_t batch, const LossOutput& output) override;
  void on_epoch_end(MappingTrainer& trainer, int64_t epoch, const Metrics& metrics) override;

 private:
  int64_t plain_every_;
  std::unique_ptr<Progress> progress_;
};

// ---- learning-rate range test ----

struct LRFinderResult {
  std::vector<double> lrs;
  std::vector<double> losses;
  std::vector<double> smoothed_losses;
  std::optional<double> suggested_lr;  // the "steep" suggestion, when one exists
  // "steep": steepest descent of the smoothed loss against log10(lr) before its minimum;
  // "valley": 2/3 into the longest strictly decreasing run; "minimum": lr at the minimum / 10.
  double suggestion(const std::string& method = "steep") const;
};

// ---- trainer ----

class MappingTrainer {
 public:
  // Runs the target on one batch inside the model's functional call (clean and perturbed forwards
  // alike). Default: module.forward(batch.inputs).
  using BatchForward = std::function<Tensor(nn::Module& target, const data::Batch& batch)>;

  // `loss`: a MappingLoss is used as is; any other loss trains the task only; null = RegressionLoss.
  // The model and loaders must outlive the trainer.
  MappingTrainer(MappingModel& model, data::DataLoader& train_loader, data::DataLoader* val_loader = nullptr,
                 std::shared_ptr<Loss> loss = nullptr, TrainerConfig config = {},
                 std::vector<std::shared_ptr<Callback>> callbacks = {});
  ~MappingTrainer();
  MappingTrainer(const MappingTrainer&) = delete;
  MappingTrainer& operator=(const MappingTrainer&) = delete;

  // Trains from epoch() up to config.max_epochs; returns the whole history (restored epochs included).
  History fit(bool auto_lr_find = false);
  // One pass of training steps over `loader` (no set_epoch, validation, history, epoch hooks or
  // scheduler step; a partial accumulation window is finished). Returns the epoch's train metrics.
  Metrics fit_epoch(data::DataLoader& loader);
  // Mean val_* metrics over `loader` without gradients, in eval mode.
  Metrics validate(data::DataLoader& loader);

  // Sweeps lr_k = min (max/min)^(k / max(1, n-1)) over n training steps, with an EMA of the loss
  // (s_0 = l_0, s_k = beta s_{k-1} + (1-beta) l_k) and a stop once s_k > threshold * min(s) (or the
  // loss is not finite). Afterwards everything is as before: latents and rho's (bitwise), optimizer
  // state and lr, scheduler epoch, model buffers, random generators, epoch and should_stop.
  LRFinderResult lr_find(double min_lr = 1e-7, double max_lr = 10.0, int64_t num_iterations = 100,
                         double divergence_threshold = 4.0, double beta = 0.95);

  // Ask a running fit to stop at the next batch boundary as if interrupted (safe to call from a
  // signal handler).
  void interrupt() { interrupt_requested_.store(true); }

  // ---- state ----
  int64_t epoch() const { return epoch_; }                  // completed epochs
  void set_epoch(int64_t epoch);
  int64_t current_epoch() const { return current_epoch_; }  // the epoch running (or last run)
  bool should_stop() const { return should_stop_; }
  void set_should_stop(bool stop) { should_stop_ = stop; }
  double learning_rate() const;
  // Sets the base learning rate: the optimizer's lr, and the scheduler restarts from it.
  void set_learning_rate(double lr);
  void set_max_epochs(int64_t max_epochs);
  const History& history() const { return history_; }
  TrainerState state() const;
  void load_state(const TrainerState& state);

  // ---- parts ----
  MappingModel& model() { return model_; }
  const TrainerConfig& config() const { return config_; }
  const MappingLoss& loss() const { return *loss_; }
  std::shared_ptr<MappingLoss> loss_ptr() const { return loss_; }
  nn::optim::Optimizer& optimizer() { return *optimizer_; }
  nn::optim::LRScheduler* scheduler() { return scheduler_.get(); }
  data::DataLoader& train_loader() { return train_loader_; }
  data::DataLoader* val_loader() { return val_loader_; }
  // The loader of the pass that is running (train or validation), else the train loader.
  const data::DataLoader& active_loader() const { return active_loader_ ? *active_loader_ : train_loader_; }
  Generator& generator() { return generator_; }
  const std::vector<std::shared_ptr<Callback>>& callbacks() const { return callbacks_; }
  void add_callback(std::shared_ptr<Callback> callback);
  void set_batch_forward(BatchForward forward) { batch_forward_ = std::move(forward); }
  // Data-parallel training: combines one pass's metrics (an epoch's train_* metrics, or the val_* ones)
  // with those of the other ranks. `samples` is the number of samples this rank's pass averaged over.
  // fit() calls it on every rank after each pass, before callbacks, history and scheduler see the
  // metrics, so all ranks record the same values; lr_find calls it on each step's loss (key
  // "lr_find_loss", the batch's samples), so all ranks sweep alike and stop at the same step.
  // Unset (the default): metrics stay local. dist::average_metrics is the one for DDP.
  using MetricsReducer = std::function<Metrics(const Metrics& metrics, int64_t samples)>;
  void set_metrics_reducer(MetricsReducer reducer) { metrics_reducer_ = std::move(reducer); }
  // The optimizer's tensors: latents, then the loss's rho's.
  std::vector<Tensor> trainable_parameters() const;
  // config.compile: what the compiled steps did (CompiledFunction::explain per accumulation factor).
  std::string compile_report() const;

 private:
  void build_optimizer();
  void build_scheduler();
  ForwardResult run_forward(const data::Batch& batch, const LatentOverrides& latents);
  TrainingContext build_context(const data::Batch& batch, const ForwardResult& result);
  LossOutput forward_loss(const data::Batch& batch);
  // forward + loss + backward of total / accumulation; steps when the window is full. With `step`
  // (where the fit is, for messages) the loss and gradients are checked as config.on_nonfinite says.
  struct StepPosition {
    int64_t batch, global_step;
  };
  LossOutput train_step(const data::Batch& batch, int64_t accumulation_steps,
                        const StepPosition* step = nullptr);
  // Reports a step whose loss or gradients were not finite (throws under on_nonfinite "error").
  void report_nonfinite(const LossOutput& out, bool loss_finite, const StepPosition& step);
  LossOutput backward_step(const data::Batch& batch, int64_t accumulation_steps);  // without the step
  LossOutput compiled_backward_step(const data::Batch& batch, int64_t accumulation_steps);
  void optimizer_step();
  void finish_accumulation_window();
  double scheduler_metric(const Metrics& metrics) const;
  void step_scheduler();  // the pending step, if any
  std::vector<std::string> callback_keys() const;  // TrainerState::callback_states keys, callback order
  void log(const std::string& line) const;
  void check_interrupt();
  template <class Hook>
  void fire(const char* hook, Hook&& call);

  MappingModel& model_;
  data::DataLoader& train_loader_;
  data::DataLoader* val_loader_;
  std::shared_ptr<MappingLoss> loss_;
  TrainerConfig config_;
  std::vector<std::shared_ptr<Callback>> callbacks_;
  std::unique_ptr<nn::optim::Optimizer> optimizer_;
  std::unique_ptr<nn::optim::LRScheduler> scheduler_;
  Generator generator_;
  BatchForward batch_forward_;
  // config_.compile: one compiled backward_step per accumulation factor (a constant of the graph), and
  // what the compiled function returns, per accumulation factor and batch shape (set whenever it runs
  // the step itself; divisors such as the batch size are constants of each graph).
  std::map<int64_t, std::unique_ptr<CompiledFunction>> compiled_steps_;
  struct StepLayout {
    std::vector<std::string> components;
    std::vector<std::pair<std::string, double>> pending_metrics;  // name, divisor
    std::map<std::string, double> metrics;                        // host values (constants of the step)
  };
  std::map<std::vector<int64_t>, StepLayout> step_layouts_;
  MetricsReducer metrics_reducer_;
  int64_t last_pass_samples_ = 0;  // samples averaged by the last fit_epoch / validate
  History history_;
  int64_t epoch_ = 0;
  int64_t current_epoch_ = 0;
  bool should_stop_ = false;
  bool callbacks_enabled_ = true;
  // Between recording an epoch and its scheduler step (on_epoch_end), with the metric that step uses.
  bool scheduler_step_pending_ = false;
  double pending_scheduler_metric_ = 0.0;
  int64_t pending_batches_ = 0;  // backwards accumulated since the last optimizer step
  int64_t nonfinite_steps_ = 0;  // this epoch's non-finite steps (on_nonfinite "warn")
  const data::DataLoader* active_loader_ = nullptr;
  std::atomic<bool> interrupt_requested_{false};
};

}  // namespace mn::mapping
