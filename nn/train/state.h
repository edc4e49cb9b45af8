#pragma once
// What a checkpoint needs to resume a fit exactly, besides the model's own tensors.
#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "nn/optim.h"
#include "nn/train/history.h"

namespace mn::train {

struct RngState {
  uint64_t trainer_seed = 0, trainer_offset = 0;  // the trainer's generator (noise, probes)
  uint64_t global_seed = 0, global_offset = 0;    // mn::default_generator() (dropout)
};

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

// The state without its optimizer tensors as JSON text (they are stored as tensors beside it):
// epoch, should_stop, scheduler_epoch, [optimizer_lr], [scheduler_state, scheduler_step_metric],
// [callbacks], history, rng. NaN and infinities are written as null and read back as NaN.
std::string trainer_state_to_json(const TrainerState& state);
// The inverse; a malformed document is a ValueError naming what is wrong (the optimizer map stays empty).
TrainerState trainer_state_from_json(const std::string& text);

}  // namespace mn::train
