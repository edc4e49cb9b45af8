#include "mapping/trainer.h"

#include <cxxabi.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <limits>
#include <sstream>
#include <typeinfo>

#include "autograd/node.h"
#include "autograd/ops.h"
#include "nn/progress.h"

namespace mn::mapping {

namespace optim = nn::optim;
using data::Batch;
using data::DataLoader;

namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

std::string format_metrics(const Metrics& metrics) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(4);
  bool first = true;
  for (const auto& [k, v] : metrics) {
    os << (first ? "" : ", ") << k << "=" << v;
    first = false;
  }
  return os.str();
}

int64_t batch_samples(const Batch& batch) {
  return batch.inputs.defined() && batch.inputs.dim() > 0 ? batch.inputs.size(0) : 1;
}

// Sample-weighted means of a pass's loss metrics.
struct EpochAverages {
  double task = 0.0, total = 0.0, accuracy = 0.0;
  int64_t samples = 0, accuracy_samples = 0;

  void add(const LossOutput& out, int64_t n) {
    const double total_value = out.metrics.count("total") ? out.metrics.at("total") : out.total.detach().item();
    const auto task_it = out.metrics.find("task");
    task += (task_it != out.metrics.end() ? task_it->second : total_value) * static_cast<double>(n);
    total += total_value * static_cast<double>(n);
    samples += n;
    if (const auto acc = out.metrics.find("accuracy"); acc != out.metrics.end()) {
      accuracy += acc->second * static_cast<double>(n);
      accuracy_samples += n;
    }
  }
  Metrics finish(const char* task_key, const char* total_key, const char* accuracy_key) const {
    Metrics m;
    m[task_key] = task / static_cast<double>(samples);
    m[total_key] = total / static_cast<double>(samples);
    if (accuracy_samples > 0) m[accuracy_key] = accuracy / static_cast<double>(accuracy_samples);
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

size_t argmin_first(const std::vector<double>& v) {
  size_t best = 0;
  for (size_t i = 1; i < v.size(); ++i)
    if (v[i] < v[best]) best = i;
  return best;
}

std::optional<double> suggest_steep(const std::vector<double>& lrs, const std::vector<double>& s) {
  const size_t n = lrs.size();
  if (n == 0) return std::nullopt;
  if (n < 5) return lrs[0];
  const size_t minimum = argmin_first(s);
  // A minimum in the first steps says little: search the sweep except its (diverging) tail instead.
  size_t end = minimum < 3 ? std::max<size_t>(3, n - 5) : minimum;
  end = std::min(end, n - 1);
  std::vector<double> slopes;
  for (size_t i = 0; i < end; ++i) {
    const double dx = std::log10(lrs[i + 1]) - std::log10(lrs[i]);
    slopes.push_back(dx != 0.0 ? (s[i + 1] - s[i]) / dx : 0.0);
  }
  if (slopes.empty()) return lrs[0];
  std::vector<double> smoothed = slopes;
  if (slopes.size() >= 3) {  // centred 3-window mean, shortened at the ends
    for (size_t i = 0; i < slopes.size(); ++i) {
      const size_t lo = i == 0 ? 0 : i - 1, hi = std::min(slopes.size(), i + 2);
      double acc = 0.0;
      for (size_t j = lo; j < hi; ++j) acc += slopes[j];
      smoothed[i] = acc / static_cast<double>(hi - lo);
    }
  }
  return lrs[argmin_first(smoothed)];
}

std::optional<double> suggest_valley(const std::vector<double>& lrs, const std::vector<double>& s) {
  const size_t n = lrs.size();
  if (n == 0) return std::nullopt;
  if (n < 5) return lrs[0];
  // Longest strictly decreasing subsequence ending at each index (O(n^2) DP).
  std::vector<int64_t> length(n, 1);
  for (size_t i = 1; i < n; ++i)
    for (size_t j = 0; j < i; ++j)
      if (s[i] < s[j] && length[i] < length[j] + 1) length[i] = length[j] + 1;
  size_t end = 0;
  for (size_t i = 1; i < n; ++i)
    if (length[i] > length[end]) end = i;
  const int64_t run = length[end];
  const int64_t index = std::clamp<int64_t>(static_cast<int64_t>(end) - run + 2 * run / 3, 0,
                                            static_cast<int64_t>(n) - 1);
  return lrs[static_cast<size_t>(index)];
}

std::optional<double> suggest_minimum(const std::vector<double>& lrs, const std::vector<double>& s) {
  if (lrs.empty()) return std::nullopt;
  return lrs[argmin_first(s)] / 10.0;
}

}  // namespace

// ---- History ----

const std::vector<double>& History::at(const std::string& key) const {
  auto it = values_.find(key);
  if (it == values_.end()) {
    std::ostringstream os;
    for (const auto& k : keys()) os << (os.tellp() > 0 ? ", " : "") << k;
    throw KeyError(str("History has no key '", key, "'; available: ", keys().empty() ? "(none)" : os.str()));
  }
  return it->second;
}

std::vector<std::string> History::keys() const {
  std::vector<std::string> out;
  for (const auto& [k, v] : values_) out.push_back(k);
  return out;
}

size_t History::epochs() const {
  auto it = values_.find(history_keys::kTrainTotalLoss);
  return it == values_.end() ? 0 : it->second.size();
}

// ---- callbacks ----

std::string Callback::name() const {
  const char* mangled = typeid(*this).name();
  int status = 0;
  char* demangled = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string full = status == 0 && demangled ? demangled : mangled;
  std::free(demangled);
  const size_t colon = full.rfind("::");
  return colon == std::string::npos ? full : full.substr(colon + 2);
}

EarlyStopping::EarlyStopping(std::string monitor, int64_t patience, double min_delta, std::string mode)
    : monitor_(std::move(monitor)), patience_(patience), min_delta_(min_delta) {
  MN_CHECK(mode == "min" || mode == "max", ValueError, "EarlyStopping: mode must be 'min' or 'max', got '", mode, "'");
  MN_CHECK(patience >= 0, ValueError, "EarlyStopping: patience must be non-negative, got ", patience);
  MN_CHECK(min_delta >= 0.0, ValueError, "EarlyStopping: min_delta must be non-negative, got ", min_delta);
  maximize_ = mode == "max";
  best_ = maximize_ ? -std::numeric_limits<double>::infinity() : std::numeric_limits<double>::infinity();
}

void EarlyStopping::on_epoch_end(MappingTrainer& trainer, int64_t, const Metrics& metrics) {
  auto it = metrics.find(monitor_);
  if (it == metrics.end()) return;
  const double current = it->second;
  const bool improved = maximize_ ? current > best_ + min_delta_ : current < best_ - min_delta_;
  if (improved) {
    best_ = current;
    wait_ = 0;
    return;
  }
  if (++wait_ >= patience_) trainer.set_should_stop(true);
}

std::map<std::string, double> EarlyStopping::state_dict() const {
  std::map<std::string, double> state{{"wait", static_cast<double>(wait_)}};
  if (std::isfinite(best_)) state["best"] = best_;
  return state;
}

void EarlyStopping::load_state_dict(const std::map<std::string, double>& state) {
  auto wait = state.find("wait");
  MN_CHECK(wait != state.end(), KeyError, "EarlyStopping state has no 'wait'");
  MN_CHECK(wait->second >= 0 && wait->second == std::floor(wait->second), ValueError,
           "EarlyStopping state 'wait' must be a non-negative whole number, got ", wait->second);
  auto best = state.find("best");
  MN_CHECK(best == state.end() || std::isfinite(best->second), ValueError,
           "EarlyStopping state 'best' must be finite, got ", best->second);
  wait_ = static_cast<int64_t>(wait->second);
  best_ = best != state.end() ? best->second
                              : (maximize_ ? -std::numeric_limits<double>::infinity()
                                           : std::numeric_limits<double>::infinity());
}

MetricLogger::MetricLogger(int64_t every_n_batches) : MetricLogger(every_n_batches, std::clog) {}

MetricLogger::MetricLogger(int64_t every_n_batches, std::ostream& out) : every_n_batches_(every_n_batches), out_(&out) {
  MN_CHECK(every_n_batches >= 1, ValueError, "MetricLogger: every_n_batches must be at least 1, got ",
           every_n_batches);
}

void MetricLogger::on_epoch_start(MappingTrainer& trainer, int64_t epoch) {
  *out_ << "Epoch " << epoch + 1 << "/" << trainer.config().max_epochs << " started\n";
}

void MetricLogger::on_batch_end(MappingTrainer&, int64_t batch, const LossOutput& output) {
  if ((batch + 1) % every_n_batches_ != 0) return;
  *out_ << "  batch " << batch + 1 << ": " << format_metrics(output.metrics) << "\n";
}

void MetricLogger::on_validation_end(MappingTrainer&, const Metrics& metrics) {
  *out_ << "  validation: " << format_metrics(metrics) << "\n";
}

void MetricLogger::on_epoch_end(MappingTrainer& trainer, int64_t epoch, const Metrics& metrics) {
  *out_ << "Epoch " << epoch + 1 << "/" << trainer.config().max_epochs << ": " << format_metrics(metrics) << "\n";
  out_->flush();
}

ProgressCallback::ProgressCallback(int64_t plain_every) : plain_every_(plain_every) {}
ProgressCallback::~ProgressCallback() = default;

void ProgressCallback::on_epoch_start(MappingTrainer& trainer, int64_t epoch) {
  progress_ = std::make_unique<Progress>(str("epoch ", epoch + 1, "/", trainer.config().max_epochs),
                                         trainer.train_loader().size(), plain_every_);
}

void ProgressCallback::on_batch_end(MappingTrainer&, int64_t batch, const LossOutput& output) {
  if (!progress_) return;
  std::ostringstream os;
  // The trainer has read the step's metrics already (one transfer); item() would synchronise again.
  const auto total = output.metrics.find("total");
  const double loss = total != output.metrics.end() ? total->second
                      : output.total.defined()     ? output.total.detach().item()
                                                   : 0.0;
  os << std::fixed << std::setprecision(4) << "loss " << loss;
  progress_->update(batch + 1, os.str());
}

void ProgressCallback::on_epoch_end(MappingTrainer&, int64_t, const Metrics& metrics) {
  if (!progress_) return;
  progress_->finish(format_metrics(metrics));
  progress_.reset();
}

// ---- LR finder result ----

double LRFinderResult::suggestion(const std::string& method) const {
  MN_CHECK(lrs.size() == smoothed_losses.size(), ValueError, "LRFinderResult: ", lrs.size(), " learning rates but ",
           smoothed_losses.size(), " smoothed losses");
  std::optional<double> found;
  if (method == "steep") found = suggest_steep(lrs, smoothed_losses);
  else if (method == "valley") found = suggest_valley(lrs, smoothed_losses);
  else if (method == "minimum") found = suggest_minimum(lrs, smoothed_losses);
  else throw ValueError(str("Unknown suggestion method: '", method, "'. Choose from: 'steep', 'valley', 'minimum'"));
  MN_CHECK(found.has_value(), ValueError, "No suggested learning rate found using method '", method,
           "' (the sweep recorded no steps)");
  return *found;
}

// ---- trainer ----

MappingTrainer::MappingTrainer(MappingModel& model, DataLoader& train_loader, DataLoader* val_loader,
                               std::shared_ptr<Loss> loss, TrainerConfig config,
                               std::vector<std::shared_ptr<Callback>> callbacks)
    : model_(model),
      train_loader_(train_loader),
      val_loader_(val_loader),
      config_(std::move(config)),
      generator_(config_.seed.value_or(default_generator().seed()), stream_key("mn.mapping.trainer")) {
  const TrainerConfig& c = config_;
  MN_CHECK(c.max_epochs >= 0, ValueError, "TrainerConfig: max_epochs must be non-negative, got ", c.max_epochs);
  MN_CHECK(std::isfinite(c.learning_rate) && c.learning_rate >= 0.0, ValueError,
           "TrainerConfig: learning_rate must be a finite non-negative number, got ", c.learning_rate);
  MN_CHECK(c.weight_decay >= 0.0, ValueError, "TrainerConfig: weight_decay must be non-negative, got ",
           c.weight_decay);
  MN_CHECK(c.momentum >= 0.0, ValueError, "TrainerConfig: momentum must be non-negative, got ", c.momentum);
  MN_CHECK(c.accumulation_steps >= 1, ValueError, "TrainerConfig: accumulation_steps must be at least 1, got ",
           c.accumulation_steps);
  MN_CHECK(!c.gradient_clip_norm || *c.gradient_clip_norm > 0.0, ValueError,
           "TrainerConfig: gradient_clip_norm must be positive, got ", c.gradient_clip_norm.value_or(0.0));
  MN_CHECK(!c.gradient_clip_value || *c.gradient_clip_value >= 0.0, ValueError,
           "TrainerConfig: gradient_clip_value must be non-negative, got ", c.gradient_clip_value.value_or(0.0));
  MN_CHECK(c.on_nonfinite == "error" || c.on_nonfinite == "warn", ValueError,
           "TrainerConfig: on_nonfinite must be \"error\" or \"warn\", got \"", c.on_nonfinite, "\"");

  if (!loss) {
    loss_ = MappingLoss::task_only(std::make_shared<RegressionLoss>());
  } else if (auto mapping = std::dynamic_pointer_cast<MappingLoss>(loss)) {
    loss_ = std::move(mapping);
  } else {
    // A bare task loss means the task alone; regularisers are opt-in through a MappingLoss.
    loss_ = MappingLoss::task_only(std::move(loss));
  }
  loss_->to(model_.device());
  for (auto& cb : callbacks) add_callback(std::move(cb));
  build_optimizer();
  build_scheduler();
  if (config_.seed) manual_seed(*config_.seed);  // last, as in the reference: the model exists already
}

MappingTrainer::~MappingTrainer() = default;

void MappingTrainer::add_callback(std::shared_ptr<Callback> callback) {
  MN_CHECK(callback != nullptr, ValueError, "MappingTrainer: callbacks must not be null");
  callbacks_.push_back(std::move(callback));
}

std::vector<Tensor> MappingTrainer::trainable_parameters() const {
  std::vector<Tensor> params = model_.parameters();
  for (const Tensor& rho : loss_->coefficient_parameters()) params.push_back(rho);
  return params;
}

void MappingTrainer::build_optimizer() {
  const std::string name = lower(config_.optimizer);
  std::vector<Tensor> params = trainable_parameters();
  if (name == "adam" || name == "adamw") {
    optim::AdamOptions o;
    o.lr = config_.learning_rate;
    o.weight_decay = config_.weight_decay;
    if (name == "adam") optimizer_ = std::make_unique<optim::Adam>(std::move(params), o);
    else optimizer_ = std::make_unique<optim::AdamW>(std::move(params), o);
  } else if (name == "sgd") {
    optim::SGDOptions o;
    o.lr = config_.learning_rate;
    o.momentum = config_.momentum;
    o.weight_decay = config_.weight_decay;
    optimizer_ = std::make_unique<optim::SGD>(std::move(params), o);
  } else {
    throw ValueError(str("Unknown optimizer '", config_.optimizer, "'; available: adam, adamw, sgd"));
  }
}

void MappingTrainer::build_scheduler() {
  const std::string name = lower(config_.scheduler);
  const SchedulerOptions& o = config_.scheduler_options;
  const int64_t epochs = std::max<int64_t>(1, config_.max_epochs);
  if (name.empty()) {
    scheduler_.reset();
  } else if (name == "cosine") {
    scheduler_ = std::make_unique<optim::CosineAnnealingLR>(*optimizer_, o.cosine_t_max > 0 ? o.cosine_t_max : epochs,
                                                            o.cosine_eta_min);
  } else if (name == "step") {
    const int64_t step_size = o.step_size > 0 ? o.step_size : std::max<int64_t>(1, config_.max_epochs / 3);
    scheduler_ = std::make_unique<optim::StepLR>(*optimizer_, step_size, o.step_gamma);
  } else if (name == "exponential") {
    scheduler_ = std::make_unique<optim::ExponentialLR>(*optimizer_, o.exponential_gamma);
  } else if (name == "plateau") {
    scheduler_ = std::make_unique<optim::ReduceLROnPlateau>(*optimizer_, o.plateau);
  } else {
    throw ValueError(
        str("Unknown scheduler '", config_.scheduler, "'; available: cosine, exponential, plateau, step"));
  }
}

double MappingTrainer::learning_rate() const { return optimizer_->lr(); }

void MappingTrainer::set_learning_rate(double lr) {
  MN_CHECK(std::isfinite(lr) && lr >= 0.0, ValueError, "MappingTrainer: learning rate must be a finite non-negative "
           "number, got ", lr);
  config_.learning_rate = lr;
  optimizer_->set_lr(lr);
  if (scheduler_) {
    // Schedulers remember their base lr: rebuild so the schedule runs from the new one.
    const int64_t scheduler_epoch = scheduler_->epoch();
    build_scheduler();
    if (scheduler_epoch > 0) scheduler_->set_epoch(scheduler_epoch);
  }
}

void MappingTrainer::set_epoch(int64_t epoch) {
  MN_CHECK(epoch >= 0, ValueError, "MappingTrainer: epoch must be non-negative, got ", epoch);
  epoch_ = epoch;
  current_epoch_ = epoch;
}

void MappingTrainer::set_max_epochs(int64_t max_epochs) {
  MN_CHECK(max_epochs >= 0, ValueError, "MappingTrainer: max_epochs must be non-negative, got ", max_epochs);
  config_.max_epochs = max_epochs;
}

TrainerState MappingTrainer::state() const {
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
  return s;
}

void MappingTrainer::load_state(const TrainerState& s) {
  MN_CHECK(s.epoch >= 0 && s.scheduler_epoch >= 0, ValueError, "TrainerState: epoch (", s.epoch,
           ") and scheduler_epoch (", s.scheduler_epoch, ") must be non-negative");
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
}

void MappingTrainer::log(const std::string& line) const {
  if (config_.log) *config_.log << line << '\n';
}

void MappingTrainer::check_interrupt() {
  if (interrupt_requested_.exchange(false)) throw TrainingInterrupted("training interrupted by request");
}

template <class Hook>
void MappingTrainer::fire(const char* hook, Hook&& call) {
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

// ---- one step ----

ForwardResult MappingTrainer::run_forward(const Batch& batch, const LatentOverrides& latents) {
  const Device device = model_.device();
  Batch on_device = batch;
  if (on_device.inputs.defined() && on_device.inputs.device() != device) on_device.inputs = batch.inputs.to(device);
  if (batch_forward_)
    return model_.run_with([&](nn::Module& target) { return batch_forward_(target, on_device); }, latents);
  return model_.run(on_device.inputs, latents);
}

TrainingContext MappingTrainer::build_context(const Batch& batch, const ForwardResult& result) {
  Tensor targets = batch.targets;
  if (targets.defined() && targets.device() != model_.device()) targets = targets.to(model_.device());
  TrainingContext c = make_training_context(result, targets);
  c.generator = &generator_;
  if (const auto& stability = loss_->stability()) {
    std::vector<Tensor> perturbed;
    for (int64_t s = 0; s < stability->num_samples(); ++s) {
      LatentOverrides nudged;
      for (const auto& [name, z] : result.latent_vectors) {
        Tensor noise = randn(z.sizes(), TensorOptions(z.dtype()).with_device(z.device()), &generator_);
        nudged[name] = add(z, mul(noise, stability->epsilon()));  // gradients flow through z as well
      }
      // The same batch through the same forward function: only the latents differ.
      perturbed.push_back(run_forward(batch, nudged).predictions);
    }
    c.perturbed_predictions = perturbed.size() == 1 ? perturbed.front() : stack(perturbed, 0);
  }
  // Read for the clean latents (the reference reads them after the perturbed forward).
  if (loss_->alignment()) c.mapper_column_means = model_.modulated_column_means();
  return c;
}

// Device metrics stay pending (one host read per step, by the caller, after the backward).
LossOutput MappingTrainer::forward_loss(const Batch& batch) {
  DeferredMetrics defer;
  const ForwardResult result = run_forward(batch, {});
  return loss_->compute(build_context(batch, result));
}

LossOutput MappingTrainer::backward_step(const Batch& batch, int64_t accumulation_steps) {
  LossOutput out = forward_loss(batch);
  MN_CHECK(out.total.defined() && out.total.numel() == 1, RuntimeError,
           "MappingTrainer: the loss must return a scalar total");
  const Tensor objective =
      accumulation_steps > 1 ? div(out.total, static_cast<double>(accumulation_steps)) : out.total;
  MN_CHECK(objective.requires_grad(), RuntimeError,
           "MappingTrainer: the loss total does not depend on any trainable tensor (latents or loss "
           "coefficients); nothing to train");
  objective.backward();
  return out;
}

namespace {
std::vector<int64_t> layout_key(int64_t accumulation_steps, const Tensor& inputs, const Tensor& targets) {
  std::vector<int64_t> key{accumulation_steps};
  for (const Tensor* t : {&inputs, &targets}) {
    key.push_back(t->defined() ? t->dim() : -1);
    if (t->defined()) key.insert(key.end(), t->sizes().begin(), t->sizes().end());
  }
  return key;
}
}  // namespace

LossOutput MappingTrainer::compiled_backward_step(const Batch& batch, int64_t accumulation_steps) {
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
    Guard model_guard = model_.compile_guard();
    Guard guard = [model_guard, this](std::vector<uint64_t>& key) {
      model_guard(key);
      for (const Tensor& rho : loss_->coefficient_parameters()) guard_memory(key, rho);
    };
    compiled = std::make_unique<CompiledFunction>(body, guard, CompileOptions{.fullgraph = config_.compile_fullgraph});
  }
  const Device device = model_.device();
  Tensor inputs = batch.inputs, targets = batch.targets;
  if (inputs.defined() && inputs.device() != device) inputs = inputs.to(device);
  if (targets.defined() && targets.device() != device) targets = targets.to(device);
  const std::vector<Tensor> outputs = (*compiled)({inputs, targets});
  const auto found = step_layouts_.find(layout_key(accumulation_steps, inputs, targets));
  MN_CHECK(found != step_layouts_.end(), RuntimeError, "MappingTrainer: no layout for a compiled step of batch ",
           inputs.sizes());
  const StepLayout& layout = found->second;
  MN_CHECK(outputs.size() == 1 + layout.components.size() + layout.pending_metrics.size(), RuntimeError,
           "MappingTrainer: a compiled step returned ", outputs.size(), " tensors, its layout names ",
           1 + layout.components.size() + layout.pending_metrics.size());
  LossOutput out;
  out.total = outputs[0];
  size_t i = 1;
  for (const std::string& name : layout.components) out.components[name] = outputs[i++];
  out.metrics = layout.metrics;
  for (const auto& [name, divisor] : layout.pending_metrics) out.pending_metrics[name] = {outputs[i++], divisor};
  return out;
}

namespace {
// The pending metric that carries the gradient check through the step's one metrics read.
constexpr const char* kGradProbe = "__mn_nonfinite_grad_probe";

// Where on_nonfinite "warn" writes: the configured log, else stderr (a warning is never silent).
std::ostream& warning_stream(const TrainerConfig& config) { return config.log != nullptr ? *config.log : std::cerr; }
}  // namespace

LossOutput MappingTrainer::train_step(const Batch& batch, int64_t accumulation_steps, const StepPosition* step) {
  LossOutput out =
      config_.compile ? compiled_backward_step(batch, accumulation_steps) : backward_step(batch, accumulation_steps);
  if (step != nullptr)
    if (Tensor probe = optim::nonfinite_grad_probe(trainable_parameters()); probe.defined())
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

void MappingTrainer::report_nonfinite(const LossOutput& out, bool loss_finite, const StepPosition& step) {
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
    auto check = [&](const std::string& name, const Tensor& p) {
      const Tensor g = p.grad();
      if (g.defined() && !std::isfinite(sum(mul(g.detach(), 0.0)).item())) what.push_back("gradient of " + name);
    };
    for (const auto& [name, z] : model_.named_latents()) check(str("latent '", name, "'"), z);
    const std::vector<Tensor> rhos = loss_->coefficient_parameters();
    for (size_t i = 0; i < rhos.size(); ++i) check(str("loss coefficient ", i), rhos[i]);
  }
  std::string joined;
  for (const std::string& w : what) joined += (joined.empty() ? "" : "; ") + w;
  const std::string where = str("epoch ", current_epoch_ + 1, "/", config_.max_epochs, ", batch ", step.batch + 1,
                                " (global step ", step.global_step, ", counted from 0)");
  if (config_.on_nonfinite == "error")
    throw RuntimeError(str("MappingTrainer: non-finite values at ", where, ": ", joined,
                           ". The step was not applied. Lower the learning rate, clip gradients "
                           "(gradient_clip_norm) or check the data; on_nonfinite = \"warn\" trains on."));
  if (nonfinite_steps_++ == 0) {
    warning_stream(config_) << "warning: MappingTrainer: non-finite values at " << where << ": " << joined
               << " (training on; later such steps of this epoch are counted at its end)" << std::endl;
  }
}

std::string MappingTrainer::compile_report() const {
  std::string report;
  for (const auto& [k, compiled] : compiled_steps_) {
    if (compiled_steps_.size() > 1) report += str("accumulation ", k, ": ");
    report += compiled->explain();
  }
  return report;
}

void MappingTrainer::optimizer_step() {
  // Clip the latents only: the loss coefficients are not part of the mapping.
  const std::vector<Tensor> latents = model_.parameters();
  if (config_.gradient_clip_norm) optim::clip_grad_norm_(latents, *config_.gradient_clip_norm);
  if (config_.gradient_clip_value) optim::clip_grad_value_(latents, *config_.gradient_clip_value);
  optimizer_->step();
  optimizer_->zero_grad();
  pending_batches_ = 0;
}

void MappingTrainer::finish_accumulation_window() {
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

// ---- passes ----

Metrics MappingTrainer::fit_epoch(DataLoader& loader) {
  ActiveLoader active(active_loader_, loader);
  model_.train();
  optimizer_->zero_grad();
  pending_batches_ = 0;
  nonfinite_steps_ = 0;
  EpochAverages averages;
  int64_t index = 0;
  const int64_t first_step = current_epoch_ * loader.size();
  for (const Batch& batch : loader) {
    check_interrupt();
    fire("on_batch_start", [&](Callback& cb) { cb.on_batch_start(*this, index); });
    const StepPosition position{index, first_step + index};
    const LossOutput out = train_step(batch, config_.accumulation_steps, &position);
    fire("on_batch_end", [&](Callback& cb) { cb.on_batch_end(*this, index, out); });
    averages.add(out, batch_samples(batch));
    ++index;
    if (should_stop_) break;
  }
  MN_CHECK(index > 0, ValueError, "MappingTrainer: the training loader yielded no batches (",
           loader.num_samples(), " samples, batch_size ", loader.options().batch_size, ")");
  finish_accumulation_window();
  if (nonfinite_steps_ > 1) {
    warning_stream(config_) << "warning: MappingTrainer: " << nonfinite_steps_ << " of " << index << " steps of epoch "
               << current_epoch_ + 1 << " were not finite" << std::endl;
  }
  last_pass_samples_ = averages.samples;
  return averages.finish(history_keys::kTrainTaskLoss, history_keys::kTrainTotalLoss, history_keys::kTrainAccuracy);
}

Metrics MappingTrainer::validate(DataLoader& loader) {
  ActiveLoader active(active_loader_, loader);
  const bool was_training = model_.target().is_training();
  model_.eval();
  EpochAverages averages;
  try {
    autograd::NoGradGuard no_grad;
    for (const Batch& batch : loader) {
      check_interrupt();
      LossOutput out = forward_loss(batch);
      out.read_metrics();
      averages.add(out, batch_samples(batch));
    }
  } catch (...) {
    model_.train(was_training);
    throw;
  }
  model_.train(was_training);
  MN_CHECK(averages.samples > 0, ValueError, "MappingTrainer: the validation loader yielded no batches");
  last_pass_samples_ = averages.samples;
  return averages.finish(history_keys::kValTaskLoss, history_keys::kValTotalLoss, history_keys::kValAccuracy);
}

// The metric a scheduler step uses: ReduceLROnPlateau watches val_total_loss (train_total_loss without
// validation); time-based schedules ignore it.
double MappingTrainer::scheduler_metric(const Metrics& metrics) const {
  if (dynamic_cast<optim::ReduceLROnPlateau*>(scheduler_.get()) == nullptr) return 0.0;
  auto it = metrics.find(history_keys::kValTotalLoss);
  if (it == metrics.end()) it = metrics.find(history_keys::kTrainTotalLoss);
  MN_CHECK(it != metrics.end(), RuntimeError, "ReduceLROnPlateau needs '", history_keys::kValTotalLoss, "' or '",
           history_keys::kTrainTotalLoss, "' in the epoch's metrics");
  return it->second;
}

void MappingTrainer::step_scheduler() {
  if (!scheduler_step_pending_) return;
  scheduler_step_pending_ = false;
  if (scheduler_) scheduler_->step(pending_scheduler_metric_);
}

std::vector<std::string> MappingTrainer::callback_keys() const {
  std::vector<std::string> keys;
  std::map<std::string, int> seen;
  for (const auto& callback : callbacks_) {
    const std::string name = callback->name();
    const int n = ++seen[name];
    keys.push_back(n == 1 ? name : str(name, "#", n));
  }
  return keys;
}

History MappingTrainer::fit(bool auto_lr_find) {
  if (auto_lr_find) {
    const LRFinderOptions& o = config_.lr_finder;
    const LRFinderResult sweep = lr_find(o.min_lr, o.max_lr, o.num_iterations, o.divergence_threshold, o.beta);
    const double suggested = sweep.suggestion(o.method);
    log(str("LR finder: setting the learning rate to ", suggested, " (", o.method, ")"));
    set_learning_rate(suggested);
  }
  should_stop_ = false;  // a stop that ended an earlier fit (or came with a checkpoint) is history
  interrupt_requested_.store(false);
  log(str("fit: epochs ", epoch_ + 1, "..", config_.max_epochs, ", loss = ", loss_->describe(), ", optimizer ",
          optimizer_->name(), " lr ", learning_rate(), config_.accumulation_steps > 1
              ? str(", accumulation ", config_.accumulation_steps) : std::string()));

  try {
    fire("on_fit_start", [&](Callback& cb) { cb.on_fit_start(*this); });
    for (int64_t epoch = epoch_; epoch < config_.max_epochs; ++epoch) {
      current_epoch_ = epoch;
      if (should_stop_) break;
      check_interrupt();
      fire("on_epoch_start", [&](Callback& cb) { cb.on_epoch_start(*this, epoch); });
      const double epoch_lr = learning_rate();
      train_loader_.set_epoch(static_cast<uint64_t>(epoch));
      auto reduced = [this](Metrics local) {
        return metrics_reducer_ ? metrics_reducer_(local, last_pass_samples_) : local;
      };
      Metrics metrics = reduced(fit_epoch(train_loader_));
      if (val_loader_ != nullptr) {
        fire("on_validation_start", [&](Callback& cb) { cb.on_validation_start(*this); });
        const Metrics val = reduced(validate(*val_loader_));
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

// ---- learning-rate range test ----

LRFinderResult MappingTrainer::lr_find(double min_lr, double max_lr, int64_t num_iterations,
                                       double divergence_threshold, double beta) {
  MN_CHECK(min_lr > 0.0 && std::isfinite(min_lr) && max_lr >= min_lr && std::isfinite(max_lr), ValueError,
           "lr_find: need 0 < min_lr <= max_lr, got min_lr ", min_lr, " and max_lr ", max_lr);
  MN_CHECK(num_iterations >= 1, ValueError, "lr_find: num_iterations must be at least 1, got ", num_iterations);
  MN_CHECK(divergence_threshold > 0.0, ValueError, "lr_find: divergence_threshold must be positive, got ",
           divergence_threshold);
  MN_CHECK(beta >= 0.0 && beta < 1.0, ValueError, "lr_find: beta must be in [0, 1), got ", beta);

  // ---- snapshot ----
  const std::vector<Tensor> params = optimizer_->params();
  std::vector<Tensor> saved_values, saved_grads;
  for (const Tensor& p : params) {
    saved_values.push_back(p.detach().clone());
    saved_grads.push_back(p.grad().defined() ? p.grad().detach().clone() : Tensor());
  }
  const optim::OptimizerState saved_optimizer = optimizer_->state_dict();
  const double saved_lr = optimizer_->lr();
  nn::StateDict saved_buffers;
  for (const auto& [name, t] : model_.buffers()) saved_buffers[name] = t.detach().clone();
  const uint64_t trainer_seed = generator_.seed(), trainer_offset = generator_.offset();
  const uint64_t global_seed = default_generator().seed(), global_offset = default_generator().offset();
  const int64_t saved_epoch = epoch_, saved_current_epoch = current_epoch_;
  const bool saved_should_stop = should_stop_, saved_callbacks_enabled = callbacks_enabled_;
  const bool saved_training = model_.target().is_training();
  const int64_t saved_pending = pending_batches_;

  auto restore = [&] {
    {
      autograd::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) {
        Tensor p = params[i];
        p.copy_(saved_values[i]);
        p.set_grad(saved_grads[i]);
      }
    }
    optimizer_->load_state_dict(saved_optimizer);
    optimizer_->set_lr(saved_lr);  // the state dict keeps it only as f32
    model_.set_buffers(saved_buffers);
    generator_.manual_seed(trainer_seed);
    generator_.set_offset(trainer_offset);
    default_generator().manual_seed(global_seed);
    default_generator().set_offset(global_offset);
    epoch_ = saved_epoch;
    current_epoch_ = saved_current_epoch;
    should_stop_ = saved_should_stop;
    callbacks_enabled_ = saved_callbacks_enabled;
    pending_batches_ = saved_pending;
    model_.train(saved_training);
  };

  // ---- sweep: no callbacks, no accumulation ----
  LRFinderResult result;
  bool diverged = false;
  callbacks_enabled_ = false;
  try {
    model_.train();
    optimizer_->zero_grad();
    pending_batches_ = 0;
    auto it = train_loader_.begin();
    double best = std::numeric_limits<double>::infinity(), smoothed = 0.0;
    for (int64_t k = 0; k < num_iterations; ++k) {
      if (it == train_loader_.end()) it = train_loader_.begin();  // restart an exhausted loader
      MN_CHECK(it != train_loader_.end(), ValueError, "lr_find: the training loader yielded no batches");
      const Batch batch = *it;
      ++it;
      const double exponent = static_cast<double>(k) / static_cast<double>(std::max<int64_t>(1, num_iterations - 1));
      const double lr = min_lr * std::pow(max_lr / min_lr, exponent);
      optimizer_->set_lr(lr);
      const LossOutput out = train_step(batch, 1);
      double loss = out.total.detach().item();
      // Data parallel: every rank must take the same stop decision (a rank that stops early leaves the
      // others waiting in their next gradient all-reduce), so the sweep follows the mean over the ranks.
      if (metrics_reducer_)
        loss = metrics_reducer_({{"lr_find_loss", loss}}, batch.targets.size(0)).at("lr_find_loss");
      smoothed = k == 0 ? loss : beta * smoothed + (1.0 - beta) * loss;
      best = std::min(best, smoothed);
      result.lrs.push_back(lr);
      result.losses.push_back(loss);
      result.smoothed_losses.push_back(smoothed);
      // A non-finite loss has diverged whatever the threshold says (NaN compares false).
      if (!std::isfinite(smoothed) || (k > 0 && smoothed > divergence_threshold * best)) {
        diverged = true;
        break;
      }
    }
  } catch (...) {
    restore();
    throw;
  }
  restore();

  try {
    result.suggested_lr = result.suggestion("steep");
  } catch (const ValueError&) {
    result.suggested_lr.reset();
  }
  log(str("LR finder: ", result.lrs.size(), " steps from ", min_lr, " to ", result.lrs.back(),
          diverged ? " (stopped: loss diverged)" : "", result.suggested_lr ? str(", suggestion ",
          *result.suggested_lr) : std::string()));
  return result;
}

}  // namespace mn::mapping
