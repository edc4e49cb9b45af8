#pragma once
// Mapping-network checkpoints: one safetensors file holding what cannot be recomputed, and nothing
// that can. The mapper matrices are a pure function of (seed, group, shape), so they are rebuilt by
// the model on load instead of being stored; a checkpoint is kilobytes where the reference library's
// pickle held (L + 2) * N floats.
//
// Tensors (f32 unless the source tensor is i64):
//   latent/<group>       each group's trainable latent, in group order
//   scales               [K] per-tensor init scales, one per spec entry (when scaling is on)
//   buffer/<name>        the model's carried buffers (e.g. BatchNorm running statistics)
//   optimizer/<key>      optimizer state (nn::optim::Optimizer::state_dict) when a trainer state is given
//   loss/<name>          trainable loss coefficients (MappingLoss rho's), when there are any
// Metadata (every value is a JSON document, as safetensors metadata must be strings):
//   format "mapping_networks.checkpoint", schema_version 1 (2 with a mid-epoch trainer state), package_version, strategy, seed,
//   latent_dims {group: L}, groups [[group, [parameter names]]...], parameter_scaling,
//   mapper {alpha, default, groups: {group: description}}, spec [[name, [shape]]...] in spec order,
//   add_ons {lrd_rank, prune_fraction} (only when either is set: LRD and pruning change what the
//   latents generate, so they must match on load; the pruning masks are rebuilt, never stored),
//   trainer_state {epoch, should_stop, scheduler_epoch, [scheduler_state, scheduler_step_metric],
//   [callbacks {key: state}], optimizer_lr, history, rng, [global_step], [progress], [grad_scaler]}
//   (optional; grad_scaler: an amp "f16" trainer's amp::GradScaler::state_dict),
//   metadata {user strings}, config (optional JSON), finetuning {pretrained, hash, block_size, alpha,
//   group_alpha} (strategy "finetuning": the pretrained file's path and FNV-1a 64 content hash, never its
//   tensors; loading into a model whose pretrained file has another hash is a ValueError naming both).
// No target parameter and no mapper factor is stored. The file is written to a temporary name and
// renamed over `path` (parent directories are created), so a failed save leaves the old file intact.
//
// load_checkpoint validates in this order and touches the model only when everything fits:
//   missing file -> IOError "checkpoint not found: <path>";
//   not safetensors / corrupt / unreadable metadata -> IOError "not a valid mapping_networks checkpoint";
//   no schema_version -> KeyError naming 'schema_version'; a newer one -> ValueError "... newer ...";
//   spec: different parameter count -> ValueError "... The target architecture differs."; name and
//   shape mismatches are all collected, the first differing parameter first, e.g.
//   "shape mismatch for '0.weight': checkpoint [8, 4], model [2, 4]";
//   strategy, latent groups and dims, seed, mapper and scaling must match the model (ValueError);
//   then the latents are copied into the model's latent tensors in place (no grad: optimizers that
//   hold them stay valid), the scales and buffers restored, and the trainer state applied when a
//   trainer is given.
// layerwise and lazy_layerwise checkpoints are interchangeable: same groups, latents and values.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mapping/mapping_model.h"
#include "mapping/trainer.h"

namespace mn::mapping {

inline constexpr int64_t kCheckpointSchemaVersion = 1;
// The version of a checkpoint whose trainer state holds a mid-epoch position (TrainerState::progress), so
// that builds which cannot continue an epoch refuse it; the newest this build reads.
inline constexpr int64_t kMidEpochCheckpointSchemaVersion = 2;
// Keep in step with project(VERSION) in CMakeLists.txt.
inline constexpr const char* kPackageVersion = "0.1.0";

struct CheckpointExtras {
  // Optimizer tensors, epoch, should_stop, scheduler epoch, history and RNG positions.
  std::optional<TrainerState> trainer_state;
  // The optimizer's exact learning rate: its state dict stores the lr as an f32 tensor, and resuming
  // bit for bit needs the double (checkpoint_extras fills it).
  std::optional<double> optimizer_lr;
  // Trainable loss coefficients (MappingLoss rho's), stored as loss/<name>; restored in place when
  // load_checkpoint is given a trainer.
  std::vector<std::pair<std::string, Tensor>> loss_parameters;
  std::map<std::string, std::string> metadata;  // free-form user key/values, round-tripped
  std::string config;                           // optional JSON text (e.g. the run's options)
};

// trainer.state() plus the given metadata.
CheckpointExtras checkpoint_extras(const MappingTrainer& trainer,
                                   std::map<std::string, std::string> metadata = {});

struct CheckpointInfo {
  int64_t schema_version = 0;
  std::string package_version;
  std::string strategy;
  uint64_t seed = 0;
  std::vector<std::pair<std::string, int64_t>> latent_dims;  // group order
  bool parameter_scaling = false;
  std::vector<std::pair<std::string, Shape>> spec;  // the saved target's names and shapes, spec order
  std::map<std::string, std::string> metadata;
  std::string config;              // "" when none was saved
  std::string trainer_state_json;  // "" when none was saved
  // Parsed trainer state with the optimizer tensors (optimizer/<key> -> key) when one was saved.
  std::optional<TrainerState> trainer_state;
  // Strategy "finetuning": the metadata 'finetuning' (JSON: pretrained path, hash, block_size, alpha,
  // group_alpha); "" otherwise.
  std::string finetuning;
};

void save_checkpoint(const std::string& path, const MappingModel& model, const CheckpointExtras& extras = {});
inline void save_checkpoint(const std::string& path, const MappingModel& model, const MappingTrainer& trainer) {
  save_checkpoint(path, model, checkpoint_extras(trainer));
}

// Validates and restores into `model` (see the file comment); with a trainer, also its state.
CheckpointInfo load_checkpoint(const std::string& path, MappingModel& model, MappingTrainer* trainer = nullptr);

// Reads and validates the file's own structure (existence, format, schema version, sections) without
// a model: what was saved, e.g. to rebuild a matching model before load_checkpoint.
CheckpointInfo read_checkpoint(const std::string& path);

// The generated target parameters and the model's carried buffers (MappingModel::buffers(), e.g.
// BatchNorm running statistics), under the target's own names (no prefix): the target's whole state
// dict, as a plain safetensors file that PyTorch's safetensors.torch.load_file or
// nn::safetensors::load reads; metadata records the strategy, seed and package version. Atomic like
// save_checkpoint.
void export_generated_parameters(const std::string& path, const MappingModel& model);

}  // namespace mn::mapping
