#include "nn/optim.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <optional>

#include "autograd/node.h"
#include "autograd/ops.h"
#include "core/capture.h"
#include "kernels/kernels.h"
#include "nn/optim_step.h"

namespace mn::nn::optim {

Optimizer::Optimizer(std::vector<Tensor> params) : params_(std::move(params)) {
  for (size_t i = 0; i < params_.size(); ++i) {
    MN_CHECK(params_[i].defined() && params_[i].requires_grad() && params_[i].is_leaf(), ValueError,
             "optimizer: parameter ", i, " must be a leaf tensor that requires grad");
    MN_CHECK(params_[i].dtype() == DType::f32, TypeError, "optimizer: parameter ", i, " must be f32, got ",
             params_[i].dtype());
  }
  state_.resize(params_.size());
}

void Optimizer::check_lr(double lr, const std::string& who) {
  MN_CHECK(lr >= 0.0, ValueError, who, ": learning rate must be non-negative, got ", lr);
}

void Optimizer::zero_grad() {
  for (Tensor& p : params_) p.set_grad(Tensor());
}

void Optimizer::set_lr(double lr) {
  check_lr(lr, name());
  store_lr(lr);
}

OptimizerState Optimizer::state_dict() const {
  OptimizerState out;
  out["lr"] = scalar_tensor(lr());
  out["step"] = scalar_tensor(static_cast<double>(steps_), DType::i64);
  for (size_t i = 0; i < state_.size(); ++i)
    for (const auto& [k, v] : state_[i]) out["state." + std::to_string(i) + "." + k] = v.detach().clone();
  return out;
}

namespace {

constexpr const char* kStatePrefix = "state.";

// "state.<index>.<name>": the index in decimal as std::to_string writes it (no sign, no leading
// zeros, no overflow), the name non-empty. nullopt for anything else.
struct StateKey {
  size_t index;
  std::string name;
};
std::optional<StateKey> parse_state_key(const std::string& key) {
  const size_t begin = std::string(kStatePrefix).size();
  if (key.rfind(kStatePrefix, 0) != 0) return std::nullopt;
  const size_t dot = key.find('.', begin);
  if (dot == std::string::npos || dot == begin || dot + 1 == key.size()) return std::nullopt;
  size_t index = 0;
  const char* first = key.data() + begin;
  const char* last = key.data() + dot;
  const auto [end, error] = std::from_chars(first, last, index);
  if (error != std::errc() || end != last || (*first == '0' && last - first > 1)) return std::nullopt;
  return StateKey{index, key.substr(dot + 1)};
}

// A 0-d count ("step"): a whole number in [0, 2^53), where a double still counts exactly.
void check_count(const std::string& source, const std::string& key, const Tensor& value) {
  MN_CHECK(value.dim() == 0, ValueError, source, ": '", key, "' must be a 0-d count, got shape ", value.sizes());
  const double v = value.item();
  MN_CHECK(v >= 0 && v == std::floor(v) && v < 9007199254740992.0, ValueError, source, ": '", key,
           "' must be a non-negative whole number, got ", v);
}

}  // namespace

void Optimizer::check_state_dict(const OptimizerState& state, const std::string& source_in) const {
  const std::string source = source_in.empty() ? name() + " optimizer state" : source_in;
  for (const auto& [key, value] : state)
    MN_CHECK(value.defined(), ValueError, source, ": '", key, "' is an undefined tensor");
  for (const char* key : {"lr", "step"})
    MN_CHECK(state.count(key), KeyError, source, ": missing '", key, "' (not an optimizer state dict?)");
  const Tensor& lr = state.at("lr");
  MN_CHECK(lr.dim() == 0, ValueError, source, ": 'lr' must be a 0-d number, got shape ", lr.sizes());
  check_lr(lr.item(), source + ": 'lr'");
  check_count(source, "step", state.at("step"));

  const std::vector<StateEntry> entries = state_entries();
  std::vector<std::string> known;
  for (const StateEntry& e : entries) known.push_back(e.name);
  std::vector<std::vector<std::string>> present(params_.size());
  for (const auto& [key, value] : state) {
    if (key == "lr" || key == "step") continue;
    const std::optional<StateKey> parsed = parse_state_key(key);
    MN_CHECK(parsed.has_value(), ValueError, source, ": unexpected key '", key,
             "' (expected 'lr', 'step' or 'state.<parameter index>.<name>')");
    const size_t index = parsed->index;
    const std::string& entry_name = parsed->name;
    MN_CHECK(index < params_.size(), ValueError, source, ": '", key, "' refers to parameter ", index, " but the ",
             name(), " optimizer has ", params_.size(), " parameters");
    const auto entry =
        std::find_if(entries.begin(), entries.end(), [&](const StateEntry& e) { return entry_name == e.name; });
    MN_CHECK(entry != entries.end(), ValueError, source, ": unexpected key '", key, "': the ", name(),
             " optimizer keeps ", bracket_list(known), " per parameter");
    const Tensor& param = params_[index];
    if (entry->per_element) {
      MN_CHECK(value.dtype() == DType::f32, TypeError, source, ": '", key, "' must be f32 like parameter ", index,
               ", got ", value.dtype());
      MN_CHECK(value.sizes() == param.sizes(), ValueError, source, ": '", key, "' has shape ", value.sizes(),
               " but parameter ", index, " has shape ", param.sizes());
    } else {
      check_count(source, key, value);
    }
    present[index].push_back(entry_name);
  }
  // A parameter's state is created all at once by step(): part of it missing means the rest would
  // silently restart from zero.
  for (size_t i = 0; i < params_.size(); ++i) {
    if (present[i].empty()) continue;  // never stepped (no gradient yet), as in PyTorch
    for (const StateEntry& e : entries) {
      if (e.optional) continue;
      const bool has = std::find(present[i].begin(), present[i].end(), e.name) != present[i].end();
      MN_CHECK(has, ValueError, source, ": parameter ", i, " has ", bracket_list(present[i]), " but lacks 'state.",
               i, ".", e.name, "'");
    }
  }
}

void Optimizer::load_state_dict(const OptimizerState& state) {
  check_state_dict(state);
  const std::vector<StateEntry> entries = state_entries();
  std::vector<std::map<std::string, Tensor>> restored(params_.size());
  for (const auto& [key, value] : state) {
    const std::optional<StateKey> parsed = parse_state_key(key);
    if (!parsed) continue;  // "lr", "step"
    const bool per_element = std::find_if(entries.begin(), entries.end(), [&](const StateEntry& e) {
                               return parsed->name == e.name;
                             })->per_element;
    // Adam's per-parameter step counter is read on the host at every step (count.item() in
    // Adam::step): keep it on the CPU as an i64, as step() creates it, so a resumed CUDA run does not
    // synchronise once per parameter per step. Per-element state goes beside its parameter.
    const Tensor moved = per_element ? value.to(params_[parsed->index].device()) : value.to(kCPU).to(DType::i64);
    restored[parsed->index][parsed->name] = moved.contiguous().clone();
  }
  steps_ = static_cast<int64_t>(state.at("step").item());
  store_lr(state.at("lr").item());
  state_ = std::move(restored);
}

Tensor Optimizer::dense_grad(const Tensor& p) {
  Tensor g = p.grad();
  if (g.requires_grad()) g = g.detach();
  return g.contiguous();
}

Tensor& Optimizer::state_tensor(std::map<std::string, Tensor>& s, const std::string& key, const Tensor& like) {
  auto it = s.find(key);
  if (it == s.end()) it = s.emplace(key, zeros(like.sizes(), like.options())).first;
  return it->second;
}

int64_t Optimizer::advance_step(std::map<std::string, Tensor>& s) {
  // Per-parameter step count as in PyTorch (a parameter without a gradient does not advance).
  Tensor& count = s.try_emplace("step", zeros({}, DType::i64)).first->second;
  const int64_t t = static_cast<int64_t>(count.item()) + 1;
  count.fill_(static_cast<double>(t));
  return t;
}

namespace {
// Options are public and may change between steps: checked at construction and at every step.
void check_options(const SGDOptions& o) {
  Optimizer::check_lr(o.lr, "SGD (options.lr)");
  MN_CHECK(o.momentum >= 0 && o.weight_decay >= 0, ValueError, "SGD: momentum and weight_decay must be >= 0, got ",
           o.momentum, ", ", o.weight_decay);
  MN_CHECK(!o.nesterov || (o.momentum > 0 && o.dampening == 0), ValueError,
           "SGD: nesterov requires momentum > 0 and dampening 0");
}
}  // namespace

SGD::SGD(std::vector<Tensor> params, SGDOptions o) : Optimizer(std::move(params)), options(o) { check_options(o); }

void SGD::step() {
  capture::unsupported("SGD::step() passes host-side step counts and learning rates to its kernels");
  check_options(options);
  detail::update_each_parameter("SGD", steps_, params_, [&](size_t i, Tensor& p) {
    Tensor g = dense_grad(p);
    Tensor buf;
    bool first = false;
    if (options.momentum != 0) {
      first = !state_[i].count("momentum_buffer");
      buf = state_tensor(state_[i], "momentum_buffer", p);
    }
    kernels::sgd_step(p.device(), p, g, buf,
                      kernels::SgdParams{options.lr, options.momentum, options.dampening, options.weight_decay,
                                         options.nesterov, first});
  });
}

namespace {
void check_options(const AdamOptions& o) {
  Optimizer::check_lr(o.lr, "Adam (options.lr)");
  MN_CHECK(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1, ValueError,
           "Adam: betas must be in [0, 1), got (", o.beta1, ", ", o.beta2, ")");
  MN_CHECK(o.eps >= 0 && o.weight_decay >= 0, ValueError, "Adam: eps and weight_decay must be >= 0, got ", o.eps,
           ", ", o.weight_decay);
}
}  // namespace

Adam::Adam(std::vector<Tensor> params, AdamOptions o, bool decoupled)
    : Optimizer(std::move(params)), options(o), decoupled_(decoupled) {
  check_options(o);
}

void Adam::step() {
  capture::unsupported("Adam::step() passes host-side step counts and learning rates to its kernels");
  check_options(options);
  detail::update_each_parameter(name(), steps_, params_, [&](size_t i, Tensor& p) {
    Tensor g = dense_grad(p);
    Tensor& m = state_tensor(state_[i], "exp_avg", p);
    Tensor& v = state_tensor(state_[i], "exp_avg_sq", p);
    const int64_t t = advance_step(state_[i]);
    const kernels::AdamParams k{options.lr, options.beta1, options.beta2, options.eps, options.weight_decay, t,
                                decoupled_};
    if (options.amsgrad)
      kernels::adam_amsgrad_step(p.device(), p, g, m, v, state_tensor(state_[i], "max_exp_avg_sq", p), k);
    else
      kernels::adam_step(p.device(), p, g, m, v, k);
  });
}

AdamW::AdamW(std::vector<Tensor> params, AdamOptions o) : Adam(std::move(params), o, /*decoupled=*/true) {}

// ---- schedulers ----

void LRScheduler::step(double) {
  ++epoch_;
  optimizer_.set_lr(lr_at(epoch_));
}

void LRScheduler::set_epoch(int64_t epoch) {
  epoch_ = epoch;
  optimizer_.set_lr(lr_at(epoch_));
}

namespace {

double state_value(const std::map<std::string, double>& state, const char* key, const char* who) {
  auto it = state.find(key);
  MN_CHECK(it != state.end(), KeyError, who, " state has no '", key, "'");
  return it->second;
}

int64_t state_count(const std::map<std::string, double>& state, const char* key, const char* who) {
  const double v = state_value(state, key, who);
  MN_CHECK(v >= 0 && v == std::floor(v) && v < 9.0e15, ValueError, who, " state '", key,
           "' must be a non-negative whole number, got ", v);
  return static_cast<int64_t>(v);
}

}  // namespace

std::map<std::string, double> LRScheduler::state_dict() const { return {{"epoch", static_cast<double>(epoch_)}}; }

void LRScheduler::load_state_dict(const std::map<std::string, double>& state) {
  set_epoch(state_count(state, "epoch", "LR scheduler"));
}

StepLR::StepLR(Optimizer& opt, int64_t step_size, double gamma) : LRScheduler(opt), step_size(step_size), gamma(gamma) {
  MN_CHECK(step_size > 0, ValueError, "StepLR: step_size must be positive, got ", step_size);
}
double StepLR::lr_at(int64_t e) const { return base_lr_ * std::pow(gamma, static_cast<double>(e / step_size)); }

double ExponentialLR::lr_at(int64_t e) const { return base_lr_ * std::pow(gamma, static_cast<double>(e)); }

CosineAnnealingLR::CosineAnnealingLR(Optimizer& opt, int64_t t_max, double eta_min)
    : LRScheduler(opt), t_max(t_max), eta_min(eta_min) {
  MN_CHECK(t_max > 0, ValueError, "CosineAnnealingLR: T_max must be positive, got ", t_max);
}
double CosineAnnealingLR::lr_at(int64_t e) const {
  // Closed form of PyTorch's schedule; past T_max it continues along the cosine, as PyTorch does.
  return eta_min + (base_lr_ - eta_min) * (1.0 + std::cos(M_PI * static_cast<double>(e) / t_max)) / 2.0;
}

ReduceLROnPlateau::ReduceLROnPlateau(Optimizer& opt, Options o)
    : LRScheduler(opt),
      options(o),
      best_(o.maximize ? -std::numeric_limits<double>::infinity() : std::numeric_limits<double>::infinity()) {
  MN_CHECK(o.factor < 1.0 && o.factor > 0.0, ValueError, "ReduceLROnPlateau: factor must be in (0, 1), got ", o.factor);
}

void ReduceLROnPlateau::step(double metric) {
  ++epoch_;
  const bool better = options.maximize ? metric > best_ * (best_ >= 0 ? 1.0 + options.threshold : 1.0 - options.threshold)
                                       : metric < best_ * (best_ >= 0 ? 1.0 - options.threshold : 1.0 + options.threshold);
  if (better || std::isinf(best_)) {
    best_ = metric;
    bad_epochs_ = 0;
  } else {
    ++bad_epochs_;
  }
  if (cooldown_left_ > 0) {
    --cooldown_left_;
    bad_epochs_ = 0;
  }
  if (bad_epochs_ > options.patience) {
    const double old_lr = optimizer_.lr();
    const double new_lr = std::max(old_lr * options.factor, options.min_lr);
    if (old_lr - new_lr > options.eps) optimizer_.set_lr(new_lr);
    cooldown_left_ = options.cooldown;
    bad_epochs_ = 0;
  }
}

std::map<std::string, double> ReduceLROnPlateau::state_dict() const {
  std::map<std::string, double> state = LRScheduler::state_dict();
  if (std::isfinite(best_)) state["best"] = best_;
  state["bad_epochs"] = static_cast<double>(bad_epochs_);
  state["cooldown_left"] = static_cast<double>(cooldown_left_);
  return state;
}

void ReduceLROnPlateau::load_state_dict(const std::map<std::string, double>& state) {
  const char* who = "ReduceLROnPlateau";
  const int64_t bad = state_count(state, "bad_epochs", who);
  const int64_t cooldown = state_count(state, "cooldown_left", who);
  auto best = state.find("best");
  MN_CHECK(best == state.end() || std::isfinite(best->second), ValueError, who, " state 'best' must be finite, got ",
           best->second);
  LRScheduler::load_state_dict(state);
  best_ = best != state.end() ? best->second
                              : (options.maximize ? -std::numeric_limits<double>::infinity()
                                                  : std::numeric_limits<double>::infinity());
  bad_epochs_ = bad;
  cooldown_left_ = cooldown;
}

// ---- clipping ----

double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type) {
  autograd::NoGradGuard no_grad;
  double total = 0.0;
  const bool inf_norm = std::isinf(norm_type);
  // One host read per device (not one per parameter): the per-parameter norms are stacked first.
  std::vector<std::pair<Device, std::vector<Tensor>>> norms;
  for (const Tensor& p : params) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    auto it = std::find_if(norms.begin(), norms.end(), [&](const auto& e) { return e.first == g.device(); });
    if (it == norms.end()) it = norms.insert(norms.end(), {g.device(), {}});
    it->second.push_back(norm(g.detach(), norm_type).reshape(Shape{}));
  }
  for (const auto& [device, list] : norms)
    for (float n : stack(list, 0).to_vector<float>())
      total = inf_norm ? std::max(total, static_cast<double>(n)) : total + std::pow(static_cast<double>(n), norm_type);
  if (!inf_norm) total = std::pow(total, 1.0 / norm_type);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0)
    for (const Tensor& p : params) {
      Tensor g = p.grad();
      if (g.defined()) p.set_grad(mul(g.detach(), coef));
    }
  return total;
}

void clip_grad_value_(const std::vector<Tensor>& params, double clip_value) {
  MN_CHECK(clip_value >= 0, ValueError, "clip_grad_value_: clip value must be non-negative, got ", clip_value);
  autograd::NoGradGuard no_grad;
  for (const Tensor& p : params) {
    Tensor g = p.grad();
    if (g.defined()) p.set_grad(clamp(g.detach(), -clip_value, clip_value));
  }
}

Tensor nonfinite_grad_probe(const std::vector<Tensor>& params) {
  autograd::NoGradGuard no_grad;
  Tensor probe;
  for (const Tensor& p : params) {
    const Tensor g = p.grad();
    if (!g.defined()) continue;
    Tensor term = sum(mul(g.detach(), 0.0));
    if (probe.defined() && term.device() != probe.device()) term = term.to(probe.device());
    probe = probe.defined() ? add(probe, term) : term;
  }
  return probe;
}

}  // namespace mn::nn::optim
