#pragma once
// MappingTrainer: train::Trainer (nn/train/trainer.h) with the mapping network's step - only the
// latents (and trainable loss coefficients) train, the loss sees the generated parameters and latents,
// and regularisers get the perturbed forwards they need. Epochs, validation, callbacks, accumulation,
// clipping, schedulers, the LR finder, compile, data parallel and resumable state are the generic
// trainer's.
//
//   auto loss = std::make_shared<MappingLoss>(std::make_shared<ClassificationLoss>());
//   MappingTrainer trainer(model, train_loader, &val_loader, loss, {.max_epochs = 20, .learning_rate = 3e-3},
//                          {std::make_shared<EarlyStopping>("val_total_loss", 3)});
//   History history = trainer.fit();
//
// Where the port does better than the reference library:
//   * A task loss handed over as is trains the task only; regularisers are opt-in through an
//     explicit MappingLoss (whose defaults are the reference's). The active terms are logged at fit
//     start. No loss at all means RegressionLoss, task only.
//   * The optimizer sees only trainable tensors: the latents and, if trainable, the loss's rho's.
//     Gradient clipping applies to the latents only.
//   * The perturbed (stability) forward runs on exactly the same inputs as the clean one, through
//     the same forward function; the alignment summaries use the clean latents.
//   * Validation runs without gradients, so its total has no smoothness term (reported absent, see
//     losses.h).
//   * Stability noise and Hutchinson probes come from the trainer's own generator (stream
//     "mn.mapping.trainer"), whose position is part of the resumable state.
//   * save_checkpoint writes a seed-only mapping checkpoint (mapping/checkpoint.h): kilobytes.
#include <memory>
#include <string>
#include <vector>

#include "mapping/losses.h"
#include "mapping/mapping_model.h"
#include "nn/train/trainer.h"

namespace mn::mapping {

// The generic training vocabulary, under the names mapping code has always used.
using train::Callback;
using train::EarlyStopping;
using train::History;
using train::LRFinderOptions;
using train::LRFinderResult;
using train::MetricLogger;
using train::Metrics;
using train::ProgressCallback;
using train::RngState;
using train::SchedulerOptions;
using train::TrainerConfig;
using train::TrainerState;
using train::TrainingInterrupted;
namespace history_keys = train::history_keys;

class MappingTrainer : public train::Trainer {
 public:
  // `loss`: a MappingLoss is used as is; any other loss trains the task only; null = RegressionLoss.
  // The model and loaders must outlive the trainer.
  MappingTrainer(MappingModel& model, data::DataLoader& train_loader, data::DataLoader* val_loader = nullptr,
                 std::shared_ptr<Loss> loss = nullptr, TrainerConfig config = {},
                 std::vector<std::shared_ptr<Callback>> callbacks = {});

  MappingModel& model() { return model_; }
  const MappingModel& model() const { return model_; }
  const MappingLoss& loss() const { return *loss_; }
  std::shared_ptr<MappingLoss> loss_ptr() const { return loss_; }

  // The optimizer's tensors: latents, then the loss's rho's.
  std::vector<Tensor> trainable_parameters() const override;
  std::string describe_loss() const override { return loss_->describe(); }
  std::string trainer_name() const override { return "MappingTrainer"; }
  // A mapping checkpoint (mapping/checkpoint.h) with this trainer's state and loss coefficients.
  void save_checkpoint(const std::string& path, const train::CheckpointMetadata& metadata = {}) const override;
  void load_checkpoint(const std::string& path) override;

 protected:
  LossOutput compute_loss(const data::Batch& batch) override;
  std::vector<Tensor> clipped_parameters() const override { return model_.parameters(); }
  std::vector<std::pair<std::string, Tensor>> described_parameters() const override;
  Guard compile_guard() const override;
  nn::StateDict snapshot_buffers() const override;
  void restore_buffers(const nn::StateDict& saved) override { model_.set_buffers(saved); }
  Device device() const override { return model_.device(); }

 private:
  ForwardResult run_forward(const data::Batch& batch, const LatentOverrides& latents);
  TrainingContext build_context(const data::Batch& batch, const ForwardResult& result);

  MappingModel& model_;
  std::shared_ptr<MappingLoss> loss_;
};

}  // namespace mn::mapping
