#pragma once
// What a checkpoint needs to resume a fit exactly, besides the model's own tensors.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "nn/optim.h"
#include "nn/train/history.h"

namespace mn::train {

struct RngState {
  uint64_t trainer_seed = 0, trainer_offset = 0;  // the trainer's generator (noise, probes)
  uint64_t global_seed = 0, global_offset = 0;    // mn::default_generator() (dropout)
};

// The running sums of one rank's training pass, from which the epoch's means are formed (sample-weighted:
// task and total are sums of loss x batch size, accuracy of accuracy x batch size).
struct PassSums {
  double task = 0.0, total = 0.0, accuracy = 0.0;
  int64_t samples = 0, accuracy_samples = 0;
  bool operator==(const PassSums&) const = default;
};

// Where a fit stood inside an epoch when its state was captured between two optimizer steps (a mid-epoch
// checkpoint): the next fit() continues epoch TrainerState::epoch at batch `batches` with these sums,
// instead of starting the epoch over.
struct EpochProgress {
  int64_t batches = 0;          // batches of the epoch trained (and stepped) so far, >= 1
  int64_t nonfinite_steps = 0;  // the epoch's non-finite steps so far (on_nonfinite "warn")
  // The pass's sums per data-parallel rank, in rank order (one entry without data parallel). A resume
  // with the same number of ranks gives each rank its own; with another, rank 0 takes their total and the
  // others start from zero (the epoch's means are then the same up to rounding).
  std::vector<PassSums> sums;
  // The epoch's optimizer steps the gradient scaler skipped so far (TrainerConfig::amp "f16"); 0 in
  // files written before it was recorded.
  int64_t skipped_steps = 0;
  bool operator==(const EpochProgress&) const = default;
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
  // Optimizer steps of the run's training passes so far (restored epochs included); absent in files
  // written before it was recorded (the trainer then counts the restored epochs' steps itself).
  std::optional<int64_t> global_step;
  // Set when captured mid-epoch (see EpochProgress); absent: captured between epochs.
  std::optional<EpochProgress> progress;
  // amp::GradScaler::state_dict() of an "f16" trainer's scaler; empty without one, and in files written
  // before it was recorded (a scaler then starts from its defaults).
  std::map<std::string, double> grad_scaler;
};

// The state without its optimizer tensors as JSON text (they are stored as tensors beside it):
// epoch, should_stop, scheduler_epoch, [optimizer_lr], [scheduler_state, scheduler_step_metric],
// [callbacks], history, rng, [global_step], [progress {batches, nonfinite_steps, sums [{task, total,
// accuracy, samples, accuracy_samples} per rank], [skipped_steps]}], [grad_scaler {scale, growth_factor,
// backoff_factor, growth_interval, _growth_tracker}]. NaN and infinities are written as null and read back
// as NaN, except in progress's sums, which keep them exactly ("nan", "inf", "-inf").
std::string trainer_state_to_json(const TrainerState& state);
// The inverse; a malformed document is a ValueError naming what is wrong (the optimizer map stays empty).
TrainerState trainer_state_from_json(const std::string& text);

}  // namespace mn::train
