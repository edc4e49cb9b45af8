#pragma once
// Checkpoints of a Trainer over a plain module: one safetensors file that resumes the fit exactly.
//
// Tensors: the module's state dict under its own names (f32/i64 as they are), and optimizer/<key>
// (nn::optim::Optimizer::state_dict). Metadata (JSON values): format "mn.train.checkpoint",
// schema_version 1 (2 when the trainer state holds a mid-epoch position), trainer_state (see trainer_state_to_json), metadata {user strings}, config
// (optional JSON). Written atomically (a failed save leaves the old file intact).
//
// mapping::MappingTrainer writes mapping checkpoints instead (seed-only, mapping/checkpoint.h), through
// the same Trainer::save_checkpoint / load_checkpoint calls.
//
// Files of mn-train's direct runs from before this format ("mn-train.direct": epoch, optimizer_lr,
// history {train_loss, train_accuracy, test_accuracy}) are read too: their history becomes
// train_task_loss / train_total_loss, train_accuracy and val_accuracy (the keys they lack are NaN for
// those epochs), and the random generators keep their current positions (they were not recorded).
#include <map>
#include <optional>
#include <string>

#include "nn/module.h"
#include "nn/train/state.h"

namespace mn::train {

class Trainer;

// What a checkpoint records besides the model and the trainer's state.
struct CheckpointMetadata {
  std::map<std::string, std::string> metadata;  // free-form strings, round-tripped
  std::string config;                           // optional JSON text (e.g. the run's options)
};

struct ModuleCheckpoint {
  std::string format;  // "mn.train.checkpoint", or "mn-train.direct" for the older files
  nn::StateDict state;                 // the module's tensors
  std::optional<TrainerState> trainer_state;  // with the optimizer tensors
  CheckpointMetadata metadata;
};

// The module's state and `trainer`'s state (its module must be a plain one: see Trainer::save_checkpoint).
void save_module_checkpoint(const std::string& path, const Trainer& trainer, const CheckpointMetadata& metadata = {});
// Reads and validates the file's structure (IOError naming the file and the key for anything malformed).
ModuleCheckpoint read_module_checkpoint(const std::string& path);
// Checks the state against the module (strict names and shapes) and the optimizer state against the
// optimizer before anything changes, then loads both and the trainer state.
void load_module_checkpoint(const std::string& path, Trainer& trainer);

}  // namespace mn::train
