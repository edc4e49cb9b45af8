#pragma once
// Optimizers (SGD, Adam, AdamW with optional amsgrad, RMSprop) with PyTorch's update rules, learning-rate schedulers and gradient
// clipping. Parameters are updated in place with fused kernels; state is per parameter and can be
// saved and restored (state_dict) for resumable training.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mn::nn::optim {

// Optimizer state as named tensors (e.g. "state.3.exp_avg", "param_groups.0.lr" as a 0-d tensor),
// so it can be written to a safetensors file.
using OptimizerState = std::map<std::string, Tensor>;

class Optimizer {
 public:
  explicit Optimizer(std::vector<Tensor> params);
  virtual ~Optimizer() = default;
  virtual void step() = 0;
  void zero_grad();
  // The learning rate lives in the derived optimizer's options (SGDOptions::lr, AdamOptions::lr): the
  // one value step() reads, whether it was set there, through set_lr, by a scheduler or by
  // load_state_dict.
  virtual double lr() const = 0;
  void set_lr(double lr);
  // Refuses a negative or NaN learning rate; `who` starts the message.
  static void check_lr(double lr, const std::string& who);
  const std::vector<Tensor>& params() const { return params_; }
  int64_t step_count() const { return steps_; }
  virtual OptimizerState state_dict() const;
  // Everything load_state_dict restores, checked without changing anything: "lr" and "step" are
  // non-negative 0-d numbers; every other key is "state.<index>.<name>" with a parameter index and a
  // name this optimizer keeps (Adam: exp_avg, exp_avg_sq, step, with amsgrad max_exp_avg_sq; SGD:
  // momentum_buffer; RMSprop: square_avg, step, momentum_buffer with momentum, grad_avg when centered);
  // per-element state is f32 of its parameter's shape, a step count a non-negative whole 0-d number; a
  // parameter has all of its state or none, except entries marked optional (amsgrad's maximum, which
  // an Adam state saved without amsgrad lacks: it then restarts at the next step's second moment). `source` starts each message (e.g. "checkpoint <path>: optimizer
  // state"; default "<name> optimizer state"), which then names the key and what was expected.
  void check_state_dict(const OptimizerState& state, const std::string& source = "") const;
  // Restores state saved from an optimizer of the same kind over parameters of the same shapes
  // (check_state_dict first; state tensors go to their parameter's device).
  virtual void load_state_dict(const OptimizerState& state);
  virtual std::string name() const = 0;

 protected:
  // One entry of a parameter's state: per_element tensors are f32 with the parameter's shape (what
  // the kernels read and write element by element), the others a 0-d step count kept on the CPU.
  struct StateEntry {
    const char* name;
    bool per_element;
    bool optional = false;  // may be absent from a loaded state (created by the next step)
  };
  virtual std::vector<StateEntry> state_entries() const = 0;
  virtual void store_lr(double lr) = 0;

  // The parameter's gradient, detached and contiguous.
  static Tensor dense_grad(const Tensor& param);
  // The state entry `key`, created as zeros like `like` when absent.
  static Tensor& state_tensor(std::map<std::string, Tensor>& state, const std::string& key, const Tensor& like);
  // The per-parameter step count, advanced by one (created as a 0-d i64 on the CPU); returns the new value.
  static int64_t advance_step(std::map<std::string, Tensor>& state);

  std::vector<Tensor> params_;
  std::vector<std::map<std::string, Tensor>> state_;  // per parameter
  int64_t steps_ = 0;
};

struct SGDOptions {
  double lr = 1e-2;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

class SGD : public Optimizer {
 public:
  SGD(std::vector<Tensor> params, SGDOptions options);
  void step() override;
  std::string name() const override { return "sgd"; }
  double lr() const override { return options.lr; }
  // Public and read at every step (checked there too, so a bad value set here is refused).
  SGDOptions options;

 protected:
  std::vector<StateEntry> state_entries() const override { return {{"momentum_buffer", true}}; }
  void store_lr(double lr) override { options.lr = lr; }
};

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  // PyTorch's amsgrad: the denominator uses the running maximum of the second moment (state
  // "max_exp_avg_sq").
  bool amsgrad = false;
};

class Adam : public Optimizer {
 public:
  Adam(std::vector<Tensor> params, AdamOptions options, bool decoupled_weight_decay = false);
  void step() override;
  std::string name() const override { return decoupled_ ? "adamw" : "adam"; }
  double lr() const override { return options.lr; }
  // Public and read at every step (checked there too, so a bad value set here is refused).
  AdamOptions options;

 protected:
  std::vector<StateEntry> state_entries() const override {
    std::vector<StateEntry> entries{{"exp_avg", true}, {"exp_avg_sq", true}, {"step", false}};
    if (options.amsgrad) entries.push_back({"max_exp_avg_sq", true, /*optional=*/true});
    return entries;
  }
  void store_lr(double lr) override { options.lr = lr; }

 private:
  bool decoupled_;
};

// AdamW: Adam with decoupled weight decay (default 1e-2, as in PyTorch).
class AdamW : public Adam {
 public:
  AdamW(std::vector<Tensor> params, AdamOptions options = with_default_decay());
  static AdamOptions with_default_decay() {
    AdamOptions o;
    o.weight_decay = 1e-2;
    return o;
  }
};

// torch.optim.RMSprop's options and defaults.
struct RMSpropOptions {
  double lr = 1e-2;
  double alpha = 0.99;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double momentum = 0.0;
  bool centered = false;
};

// RMSprop (nn/optim_rmsprop.cpp): state square_avg and step, momentum_buffer when momentum > 0,
// grad_avg when centered.
class RMSprop : public Optimizer {
 public:
  explicit RMSprop(std::vector<Tensor> params, RMSpropOptions options = {});
  void step() override;
  std::string name() const override { return "rmsprop"; }
  double lr() const override { return options.lr; }
  // Public and read at every step (checked there too, so a bad value set here is refused).
  RMSpropOptions options;

 protected:
  std::vector<StateEntry> state_entries() const override;
  void store_lr(double lr) override { options.lr = lr; }
};

// ---- schedulers: call step() once per epoch (plateau: step(metric)) ----
class LRScheduler {
 public:
  explicit LRScheduler(Optimizer& optimizer) : optimizer_(optimizer), base_lr_(optimizer.lr()) {}
  virtual ~LRScheduler() = default;
  virtual void step(double metric = 0.0);
  int64_t epoch() const { return epoch_; }
  void set_epoch(int64_t epoch);  // for resuming
  // What a resumed run needs beyond the optimizer (PyTorch's scheduler.state_dict()): "epoch", and for
  // ReduceLROnPlateau its best metric and counters. Loading a time-based schedule sets the lr of the
  // restored epoch; a plateau scheduler leaves the optimizer's lr alone.
  virtual std::map<std::string, double> state_dict() const;
  virtual void load_state_dict(const std::map<std::string, double>& state);
  double base_lr() const { return base_lr_; }

 protected:
  virtual double lr_at(int64_t epoch) const = 0;
  Optimizer& optimizer_;
  double base_lr_;
  int64_t epoch_ = 0;
};

class StepLR : public LRScheduler {
 public:
  StepLR(Optimizer& opt, int64_t step_size, double gamma = 0.1);
  int64_t step_size;
  double gamma;

 protected:
  double lr_at(int64_t epoch) const override;
};

class ExponentialLR : public LRScheduler {
 public:
  ExponentialLR(Optimizer& opt, double gamma) : LRScheduler(opt), gamma(gamma) {}
  double gamma;

 protected:
  double lr_at(int64_t epoch) const override;
};

class CosineAnnealingLR : public LRScheduler {
 public:
  CosineAnnealingLR(Optimizer& opt, int64_t t_max, double eta_min = 0.0);
  int64_t t_max;
  double eta_min;

 protected:
  double lr_at(int64_t epoch) const override;
};

// Multiplies the lr by `factor` when the metric has not improved (relative threshold) for
// `patience` epochs; PyTorch's defaults.
class ReduceLROnPlateau : public LRScheduler {
 public:
  struct Options {
    bool maximize = false;
    double factor = 0.1;
    int64_t patience = 10;
    double threshold = 1e-4;  // relative
    int64_t cooldown = 0;
    double min_lr = 0.0;
    double eps = 1e-8;
  };
  ReduceLROnPlateau(Optimizer& opt, Options options);
  explicit ReduceLROnPlateau(Optimizer& opt) : ReduceLROnPlateau(opt, Options()) {}
  void step(double metric) override;
  // Adds "best" (omitted while no metric was seen), "bad_epochs" and "cooldown_left".
  std::map<std::string, double> state_dict() const override;
  void load_state_dict(const std::map<std::string, double>& state) override;
  Options options;

 protected:
  double lr_at(int64_t) const override { return optimizer_.lr(); }

 private:
  double best_;
  int64_t bad_epochs_ = 0, cooldown_left_ = 0;
};

// ---- gradient clipping ----
// Scales all gradients so their global p-norm is at most max_norm; returns the norm before clipping.
double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type = 2.0);
void clip_grad_value_(const std::vector<Tensor>& params, double clip_value);

// ---- finiteness ----
// A 0-d f32 tensor on the gradients' device: 0 when every element of every defined gradient of
// `params` is finite, NaN when any is NaN or infinite (x * 0 is NaN exactly then, and a sum of such
// terms cannot overflow). Undefined when no gradient is defined. It stays on the device, so a whole
// model is checked with one host read, which can share a transfer with other values of the step.
Tensor nonfinite_grad_probe(const std::vector<Tensor>& params);

}  // namespace mn::nn::optim
