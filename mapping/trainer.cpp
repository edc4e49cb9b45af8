#include "mapping/trainer.h"

#include "autograd/ops.h"
#include "mapping/checkpoint.h"

namespace mn::mapping {

using data::Batch;

namespace {
std::shared_ptr<MappingLoss> as_mapping_loss(std::shared_ptr<Loss> loss) {
  if (!loss) return MappingLoss::task_only(std::make_shared<RegressionLoss>());
  if (auto mapping = std::dynamic_pointer_cast<MappingLoss>(loss)) return mapping;
  // A bare task loss means the task alone; regularisers are opt-in through a MappingLoss.
  return MappingLoss::task_only(std::move(loss));
}
}  // namespace

MappingTrainer::MappingTrainer(MappingModel& model, data::DataLoader& train_loader, data::DataLoader* val_loader,
                               std::shared_ptr<Loss> loss, TrainerConfig config,
                               std::vector<std::shared_ptr<Callback>> callbacks)
    : Trainer(Deferred{}, model, train_loader, val_loader, train::Objective{}, std::move(config),
              std::move(callbacks), "mn.mapping.trainer"),
      model_(model),
      loss_(as_mapping_loss(std::move(loss))) {
  loss_->to(model_.device());
  initialize();
}

std::vector<Tensor> MappingTrainer::trainable_parameters() const {
  std::vector<Tensor> params = model_.parameters();
  for (const Tensor& rho : loss_->coefficient_parameters()) params.push_back(rho);
  return params;
}

std::vector<std::pair<std::string, Tensor>> MappingTrainer::described_parameters() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [name, z] : model_.named_latents()) out.emplace_back(str("latent '", name, "'"), z);
  const std::vector<Tensor> rhos = loss_->coefficient_parameters();
  for (size_t i = 0; i < rhos.size(); ++i) out.emplace_back(str("loss coefficient ", i), rhos[i]);
  return out;
}

Guard MappingTrainer::compile_guard() const {
  Guard model_guard = model_.compile_guard();
  std::shared_ptr<MappingLoss> loss = loss_;
  return [model_guard, loss](std::vector<uint64_t>& key) {
    model_guard(key);
    for (const Tensor& rho : loss->coefficient_parameters()) guard_memory(key, rho);
  };
}

nn::StateDict MappingTrainer::snapshot_buffers() const {
  nn::StateDict saved;
  for (const auto& [name, t] : model_.buffers()) saved[name] = t.detach().clone();
  return saved;
}

void MappingTrainer::save_checkpoint(const std::string& path, const train::CheckpointMetadata& metadata) const {
  CheckpointExtras extras = checkpoint_extras(*this, metadata.metadata);
  extras.config = metadata.config;
  mapping::save_checkpoint(path, model_, extras);
}

void MappingTrainer::load_checkpoint(const std::string& path) { mapping::load_checkpoint(path, model_, this); }

// ---- one step ----

ForwardResult MappingTrainer::run_forward(const Batch& batch, const LatentOverrides& latents) {
  const Device dev = model_.device();
  Batch on_device = batch;
  if (on_device.inputs.defined() && on_device.inputs.device() != dev) on_device.inputs = batch.inputs.to(dev);
  if (const BatchForward& forward = batch_forward())
    return model_.run_with([&](nn::Module& target) { return forward(target, on_device); }, latents);
  return model_.run(on_device.inputs, latents);
}

TrainingContext MappingTrainer::build_context(const Batch& batch, const ForwardResult& result) {
  TrainingContext c = make_training_context(result, batch_targets(batch));
  c.generator = &generator();
  if (const auto& stability = loss_->stability()) {
    std::vector<Tensor> perturbed;
    for (int64_t s = 0; s < stability->num_samples(); ++s) {
      LatentOverrides nudged;
      for (const auto& [name, z] : result.latent_vectors) {
        Tensor noise = randn(z.sizes(), z.options(), &generator());
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

LossOutput MappingTrainer::compute_loss(const Batch& batch) {
  const ForwardResult result = run_forward(batch, {});
  return loss_->compute(build_context(batch, result));
}

}  // namespace mn::mapping
