#include "nn/train/config.h"

#include <algorithm>
#include <cctype>
#include <cmath>

namespace mn::train {

namespace optim = nn::optim;

namespace {
std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}
}  // namespace

void check_config(const TrainerConfig& c, const std::string& who) {
  MN_CHECK(c.max_epochs >= 0, ValueError, who, ": max_epochs must be non-negative, got ", c.max_epochs);
  MN_CHECK(std::isfinite(c.learning_rate) && c.learning_rate >= 0.0, ValueError, who,
           ": learning_rate must be a finite non-negative number, got ", c.learning_rate);
  MN_CHECK(c.weight_decay >= 0.0, ValueError, who, ": weight_decay must be non-negative, got ", c.weight_decay);
  MN_CHECK(c.momentum >= 0.0, ValueError, who, ": momentum must be non-negative, got ", c.momentum);
  MN_CHECK(c.accumulation_steps >= 1, ValueError, who, ": accumulation_steps must be at least 1, got ",
           c.accumulation_steps);
  MN_CHECK(!c.gradient_clip_norm || *c.gradient_clip_norm > 0.0, ValueError, who,
           ": gradient_clip_norm must be positive, got ", c.gradient_clip_norm.value_or(0.0));
  MN_CHECK(!c.gradient_clip_value || *c.gradient_clip_value >= 0.0, ValueError, who,
           ": gradient_clip_value must be non-negative, got ", c.gradient_clip_value.value_or(0.0));
  MN_CHECK(c.on_nonfinite == "error" || c.on_nonfinite == "warn", ValueError, who,
           ": on_nonfinite must be \"error\" or \"warn\", got \"", c.on_nonfinite, "\"");
  MN_CHECK(c.amp.empty() || c.amp == "bf16" || c.amp == "f16", ValueError, who,
           ": amp must be \"\" (f32), \"bf16\" or \"f16\", got \"", c.amp, "\"");
}

std::unique_ptr<optim::Optimizer> make_optimizer(const TrainerConfig& config, std::vector<Tensor> params) {
  const std::string name = lower(config.optimizer);
  const bool adam = name == "adam" || name == "adamw";
  MN_CHECK(!config.amsgrad || adam, ValueError, "amsgrad applies to the adam and adamw optimizers, not '",
           config.optimizer, "'");
  MN_CHECK(!config.centered || name == "rmsprop", ValueError, "centered applies to the rmsprop optimizer, not '",
           config.optimizer, "'");
  if (adam) {
    optim::AdamOptions o;
    o.lr = config.learning_rate;
    o.weight_decay = config.weight_decay;
    o.amsgrad = config.amsgrad;
    if (name == "adam") return std::make_unique<optim::Adam>(std::move(params), o);
    return std::make_unique<optim::AdamW>(std::move(params), o);
  }
  if (name == "sgd") {
    optim::SGDOptions o;
    o.lr = config.learning_rate;
    o.momentum = config.momentum;
    o.weight_decay = config.weight_decay;
    return std::make_unique<optim::SGD>(std::move(params), o);
  }
  if (name == "rmsprop") {
    optim::RMSpropOptions o;
    o.lr = config.learning_rate;
    o.momentum = config.momentum;
    o.weight_decay = config.weight_decay;
    o.centered = config.centered;
    return std::make_unique<optim::RMSprop>(std::move(params), o);
  }
  throw ValueError(str("Unknown optimizer '", config.optimizer, "'; available: adam, adamw, rmsprop, sgd"));
}

std::unique_ptr<optim::LRScheduler> make_scheduler(const TrainerConfig& config, optim::Optimizer& optimizer) {
  const std::string name = lower(config.scheduler);
  const SchedulerOptions& o = config.scheduler_options;
  const int64_t epochs = std::max<int64_t>(1, config.max_epochs);
  if (name.empty()) return nullptr;
  if (name == "cosine")
    return std::make_unique<optim::CosineAnnealingLR>(optimizer, o.cosine_t_max > 0 ? o.cosine_t_max : epochs,
                                                      o.cosine_eta_min);
  if (name == "step") {
    const int64_t step_size = o.step_size > 0 ? o.step_size : std::max<int64_t>(1, config.max_epochs / 3);
    return std::make_unique<optim::StepLR>(optimizer, step_size, o.step_gamma);
  }
  if (name == "exponential") return std::make_unique<optim::ExponentialLR>(optimizer, o.exponential_gamma);
  if (name == "plateau") return std::make_unique<optim::ReduceLROnPlateau>(optimizer, o.plateau);
  throw ValueError(str("Unknown scheduler '", config.scheduler, "'; available: cosine, exponential, plateau, step"));
}

}  // namespace mn::train
