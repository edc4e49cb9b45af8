#pragma once
// A trainer's configuration: optimizer, schedule, clipping, accumulation, the LR finder, compile and
// what to do with non-finite steps. make_optimizer / make_scheduler build what it names.
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "nn/optim.h"

namespace mn::train {

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
  std::string optimizer = "adam";  // adam, adamw, sgd, rmsprop
  double learning_rate = 1e-3;
  double weight_decay = 0.0;
  double momentum = 0.0;  // sgd, rmsprop
  bool amsgrad = false;   // adam, adamw (AdamOptions::amsgrad)
  bool centered = false;  // rmsprop (RMSpropOptions::centered); its alpha and eps keep PyTorch's defaults
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
  // A training step whose loss or trainable gradients hold a NaN or an infinity: "error" stops the fit
  // with a RuntimeError naming the epoch, batch and global step and what was not finite, before the
  // optimizer applies the step; "warn" writes that to `log` (stderr when null) once per epoch, with a
  // count at the epoch's end, and trains on. Checked with the step's metrics read (no extra
  // synchronisation).
  std::string on_nonfinite = "error";
  // Mixed precision (issue 23): "" trains in f32; "bf16" and "f16" run the forward and loss under
  // autocast in that dtype. "f16" adds a gradient scaler (amp::GradScaler, nn/grad_scaler.h): each
  // micro-batch's loss is scaled before backward, the gradients are unscaled once before clipping, and a
  // step whose gradients overflowed is skipped (counted in the history as train_skipped_steps, not a
  // non-finite error; a non-finite loss still is one) while the scale backs off. Its state is part of the
  // trainer state. "bf16" needs no scaler (bf16 has f32's range), as in PyTorch.
  std::string amp;
};

// Throws ValueError naming the field for a value out of range.
void check_config(const TrainerConfig& config, const std::string& who);

// The optimizer `config` names over `params` ("adam", "adamw", "sgd", "rmsprop"; case-insensitive).
// amsgrad with another optimizer than adam/adamw, or centered with another than rmsprop, is a ValueError.
std::unique_ptr<nn::optim::Optimizer> make_optimizer(const TrainerConfig& config, std::vector<Tensor> params);
// The scheduler `config` names for `optimizer`, or null for none.
std::unique_ptr<nn::optim::LRScheduler> make_scheduler(const TrainerConfig& config, nn::optim::Optimizer& optimizer);

}  // namespace mn::train
