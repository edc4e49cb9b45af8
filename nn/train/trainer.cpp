// Trainer: construction, the default hooks and resumable state (the loop is in fit.cpp, a step in step.cpp).
#include "nn/train/trainer.h"

#include <cmath>
#include <iostream>

#include "autograd/node.h"

namespace mn::train {

namespace optim = nn::optim;
using data::Batch;
using data::DataLoader;

// ---- construction ----

Trainer::Trainer(nn::Module& model, DataLoader& train_loader, DataLoader* val_loader, Objective objective,
                 TrainerConfig config, std::vector<std::shared_ptr<Callback>> callbacks)
    : Trainer(Deferred{}, model, train_loader, val_loader, std::move(objective), std::move(config),
              std::move(callbacks), "mn.train.trainer") {
  MN_CHECK(static_cast<bool>(objective_.compute), ValueError,
           "Trainer: needs an objective (e.g. train::classification()), got an empty one");
  initialize();
}

Trainer::Trainer(Deferred, nn::Module& model, DataLoader& train_loader, DataLoader* val_loader, Objective objective,
                 TrainerConfig config, std::vector<std::shared_ptr<Callback>> callbacks, const char* generator_stream)
    : module_(model),
      train_loader_(train_loader),
      val_loader_(val_loader),
      objective_(std::move(objective)),
      config_(std::move(config)),
      generator_(config_.seed.value_or(default_generator().seed()), stream_key(generator_stream)) {
  check_config(config_, "TrainerConfig");
  for (auto& cb : callbacks) add_callback(std::move(cb));
}

Trainer::~Trainer() = default;

void Trainer::initialize() {
  std::vector<Tensor> params = trainable_parameters();
  MN_CHECK(!params.empty(), ValueError,
           trainer_name(), ": the model has no trainable parameters (none requires grad); nothing to train");
  optimizer_ = make_optimizer(config_, std::move(params));
  scheduler_ = make_scheduler(config_, *optimizer_);
  if (config_.amp == "f16") {
    scaler_ = std::make_unique<amp::GradScaler>();
    scaler_->materialize(device());  // now: a compiled step then reads the one scale tensor update() rewrites
  }
  if (config_.seed) manual_seed(*config_.seed);  // last, as in the reference: the model exists already
}

void Trainer::add_callback(std::shared_ptr<Callback> callback) {
  MN_CHECK(callback != nullptr, ValueError, trainer_name(), ": callbacks must not be null");
  callbacks_.push_back(std::move(callback));
}

void Trainer::set_data_parallel(DataParallel* data_parallel) {
  data_parallel_ = data_parallel;
  if (data_parallel == nullptr) {
    metrics_reducer_ = nullptr;
    return;
  }
  metrics_reducer_ = [data_parallel](const Metrics& metrics, int64_t samples) {
    return data_parallel->average_metrics(metrics, samples);
  };
}

std::vector<Tensor> Trainer::trainable_parameters() const {
  std::vector<Tensor> params;
  for (const Tensor& p : module_.parameters())
    if (p.requires_grad()) params.push_back(p);
  return params;
}

std::vector<std::pair<std::string, Tensor>> Trainer::described_parameters() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [name, p] : module_.named_parameters())
    if (p.requires_grad()) out.emplace_back(str("parameter '", name, "'"), p);
  return out;
}

Guard Trainer::compile_guard() const {
  Guard module_guard = nn::module_guard(module_);
  std::vector<Tensor> params = trainable_parameters();
  return [module_guard, params](std::vector<uint64_t>& key) {
    module_guard(key);
    for (const Tensor& p : params) guard_memory(key, p);
  };
}

nn::StateDict Trainer::snapshot_buffers() const {
  nn::StateDict saved;
  for (const auto& [name, t] : module_.named_buffers()) saved[name] = t.detach().clone();
  return saved;
}

void Trainer::restore_buffers(const nn::StateDict& saved) {
  autograd::NoGradGuard no_grad;
  for (const auto& [name, t] : module_.named_buffers()) {
    auto it = saved.find(name);
    if (it != saved.end()) Tensor(t).copy_(it->second);
  }
}

Device Trainer::device() const {
  // The optimizer holds trainable_parameters() (built once): asked for every batch, no list rebuilt.
  return optimizer_ && !optimizer_->params().empty() ? optimizer_->params().front().device() : kCPU;
}

Tensor Trainer::forward_batch(const Batch& batch) {
  const Device dev = device();
  Batch on_device = batch;
  if (on_device.inputs.defined() && on_device.inputs.device() != dev) on_device.inputs = batch.inputs.to(dev);
  if (batch_forward_) return batch_forward_(module_, on_device);
  return module_.forward(on_device.inputs);
}

Tensor Trainer::batch_targets(const Batch& batch) const {
  const Device dev = device();
  return batch.targets.defined() && batch.targets.device() != dev ? batch.targets.to(dev) : batch.targets;
}

void Trainer::enter_autocast(std::optional<autocast>& scope) const {
  if (!config_.amp.empty()) scope.emplace(device(), config_.amp == "f16" ? DType::f16 : DType::bf16);
}

LossOutput Trainer::compute_loss(const Batch& batch) {
  const Tensor predictions = forward_batch(batch);
  LossOutput out = objective_.compute(predictions, batch_targets(batch));
  if (!out.has_metric("total") && out.total.defined()) out.set_metric("total", out.total.detach());
  return out;
}

// ---- state ----

double Trainer::learning_rate() const { return optimizer_->lr(); }

void Trainer::set_learning_rate(double lr) {
  MN_CHECK(std::isfinite(lr) && lr >= 0.0, ValueError, trainer_name(), ": learning rate must be a finite non-negative "
           "number, got ", lr);
  config_.learning_rate = lr;
  optimizer_->set_lr(lr);
  rebuild_scheduler();
}

void Trainer::rebuild_scheduler() {
  if (!scheduler_) return;
  // Schedulers remember their base lr: rebuild so the schedule runs from the current one.
  const int64_t scheduler_epoch = scheduler_->epoch();
  scheduler_ = make_scheduler(config_, *optimizer_);
  if (scheduler_epoch > 0) scheduler_->set_epoch(scheduler_epoch);
}

void Trainer::set_epoch(int64_t epoch) {
  MN_CHECK(epoch >= 0, ValueError, trainer_name(), ": epoch must be non-negative, got ", epoch);
  epoch_ = epoch;
  current_epoch_ = epoch;
  resume_progress_.reset();  // a restored position belongs to the restored epoch
}

void Trainer::set_max_epochs(int64_t max_epochs) {
  MN_CHECK(max_epochs >= 0, ValueError, trainer_name(), ": max_epochs must be non-negative, got ", max_epochs);
  config_.max_epochs = max_epochs;
}

TrainerState Trainer::state() const {
  TrainerState s;
  s.epoch = epoch_;
  s.should_stop = should_stop_;
  s.optimizer = optimizer_->state_dict();
  s.learning_rate = optimizer_->lr();
  // Captured from on_epoch_end, the finished epoch's scheduler step is still to come: count it.
  s.scheduler_epoch = scheduler_ ? scheduler_->epoch() + (scheduler_step_pending_ ? 1 : 0) : 0;
  if (scheduler_) {
    s.scheduler_state = scheduler_->state_dict();
    if (scheduler_step_pending_) s.scheduler_step_metric = pending_scheduler_metric_;
  }
  const std::vector<std::string> keys = callback_keys();
  for (size_t i = 0; i < callbacks_.size(); ++i)
    if (auto state = callbacks_[i]->state_dict(); !state.empty()) s.callback_states[keys[i]] = std::move(state);
  s.history = history_;
  s.rng.trainer_seed = generator_.seed();
  s.rng.trainer_offset = generator_.offset();
  s.rng.global_seed = default_generator().seed();
  s.rng.global_offset = default_generator().offset();
  s.global_step = global_step_;
  if (at_step_boundary()) {
    EpochProgress progress{
        .batches = pass_batches_, .nonfinite_steps = nonfinite_steps_, .sums = {}, .skipped_steps = skipped_steps_};
    if (data_parallel_ == nullptr) progress.sums = {*pass_sums_};
    else progress.sums = gathered_sums_;  // empty unless sync_epoch_progress ran at this batch
    if (!progress.sums.empty()) s.progress = std::move(progress);
  } else if (pass_sums_ == nullptr && resume_progress_) {
    s.progress = resume_progress_;  // restored and not yet continued
  }
  if (scaler_) s.grad_scaler = scaler_->state_dict();
  return s;
}

bool Trainer::at_step_boundary() const { return pass_sums_ != nullptr && pass_batches_ > 0 && pending_batches_ == 0; }

bool Trainer::is_main_process() const { return data_parallel_ == nullptr || data_parallel_->rank() == 0; }

void Trainer::sync_epoch_progress() {
  if (pass_sums_ == nullptr || data_parallel_ == nullptr) return;
  const PassSums& mine = *pass_sums_;
  const std::vector<std::vector<double>> all = data_parallel_->all_gather(
      {mine.task, mine.total, mine.accuracy, static_cast<double>(mine.samples),
       static_cast<double>(mine.accuracy_samples)});
  std::vector<PassSums> gathered;
  for (const std::vector<double>& v : all) {
    MN_CHECK(v.size() == 5, RuntimeError, trainer_name(), ": sync_epoch_progress gathered ", v.size(),
             " values from a rank, expected 5");
    gathered.push_back({v[0], v[1], v[2], static_cast<int64_t>(v[3]), static_cast<int64_t>(v[4])});
  }
  gathered_sums_ = std::move(gathered);
}

PassSums Trainer::resumed_sums(const EpochProgress& progress) const {
  const int world = data_parallel_ != nullptr ? data_parallel_->world_size() : 1;
  const int rank = data_parallel_ != nullptr ? data_parallel_->rank() : 0;
  if (static_cast<int>(progress.sums.size()) == world) return progress.sums[static_cast<size_t>(rank)];
  // Another number of ranks: their total goes to rank 0, so the epoch's all-reduced means still count
  // every sample once.
  PassSums total;
  if (rank != 0) return total;
  for (const PassSums& s : progress.sums) {
    total.task += s.task;
    total.total += s.total;
    total.accuracy += s.accuracy;
    total.samples += s.samples;
    total.accuracy_samples += s.accuracy_samples;
  }
  return total;
}

int64_t Trainer::steps_per_epoch() const {
  const int64_t batches = train_loader_.size(), k = config_.accumulation_steps;
  return batches / k + (batches % k != 0 && !config_.discard_partial_accumulation ? 1 : 0);
}

void Trainer::load_state(const TrainerState& s) {
  MN_CHECK(s.epoch >= 0 && s.scheduler_epoch >= 0, ValueError, "TrainerState: epoch (", s.epoch,
           ") and scheduler_epoch (", s.scheduler_epoch, ") must be non-negative");
  if (scaler_ && !s.grad_scaler.empty()) amp::GradScaler::check_state_dict(s.grad_scaler, "TrainerState: grad_scaler");
  if (!s.optimizer.empty()) optimizer_->load_state_dict(s.optimizer);
  if (s.learning_rate) optimizer_->set_lr(*s.learning_rate);
  // After the optimizer: a time-based schedule then sets the lr of the restored epoch, a plateau
  // scheduler keeps the restored one (and changes it only through the pending step, as the run would).
  if (scheduler_ && s.scheduler_state.empty()) {
    scheduler_->set_epoch(s.scheduler_epoch);
  } else if (scheduler_) {
    scheduler_->load_state_dict(s.scheduler_state);
    if (s.scheduler_step_metric) scheduler_->step(*s.scheduler_step_metric);
  }
  const std::vector<std::string> keys = callback_keys();
  for (size_t i = 0; i < callbacks_.size(); ++i) {
    auto it = s.callback_states.find(keys[i]);
    if (it != s.callback_states.end()) callbacks_[i]->load_state_dict(it->second);
  }
  epoch_ = s.epoch;
  current_epoch_ = s.epoch;
  should_stop_ = s.should_stop;  // kept for inspection; the next fit() starts with it cleared
  history_ = s.history;
  generator_.manual_seed(s.rng.trainer_seed);
  generator_.set_offset(s.rng.trainer_offset);
  default_generator().manual_seed(s.rng.global_seed);
  default_generator().set_offset(s.rng.global_offset);
  pending_batches_ = 0;
  scheduler_step_pending_ = false;
  resume_progress_ = s.progress;
  // A state without the scaler's (an f32 run's, or from before it was recorded): the scaler's defaults.
  if (scaler_) scaler_->load_state_dict(s.grad_scaler.empty() ? amp::GradScaler().state_dict() : s.grad_scaler);
  // Files from before the step count was recorded: the restored epochs' steps (a restored position sits
  // on a window boundary).
  global_step_ = s.global_step ? *s.global_step
                               : s.epoch * steps_per_epoch() +
                                     (s.progress ? s.progress->batches / config_.accumulation_steps : 0);
}

std::vector<std::string> Trainer::callback_keys() const {
  std::vector<std::string> keys;
  std::map<std::string, int> seen;
  for (const auto& callback : callbacks_) {
    const std::string name = callback->name();
    const int n = ++seen[name];
    keys.push_back(n == 1 ? name : str(name, "#", n));
  }
  return keys;
}

void Trainer::log(const std::string& line) const {
  if (config_.log) *config_.log << line << '\n';
}

void Trainer::save_checkpoint(const std::string& path, const CheckpointMetadata& metadata) const {
  save_module_checkpoint(path, *this, metadata);
}

void Trainer::load_checkpoint(const std::string& path) { load_module_checkpoint(path, *this); }

void Trainer::log_warning(const std::string& line) const {
  // A warning is never silent: the configured log, else stderr.
  (config_.log != nullptr ? *config_.log : std::cerr) << line << std::endl;
}

}  // namespace mn::train
