#pragma once
// The model, data and trainer that the checkpoint fuzzer (fuzz_checkpoint.cpp) loads its inputs into,
// shared with the program that writes its seed corpus (make_checkpoint_corpus.cpp), so that the
// seeds pass every compatibility check and reach the optimizer step. Everything is small (an MLP
// target 784-4-10, latents of 4) so that one input costs milliseconds.
//
// The trainer's optimizer, scheduler and loss cannot be read from a checkpoint, so the corpus records
// them in its user metadata ("fuzz_optimizer", "fuzz_scheduler", "fuzz_loss"); the fuzzer builds the
// trainer they name, and mutations of them reach the other optimizers' state checks.
#include <cstdint>
#include <memory>
#include <string>

#include "core/random.h"
#include "mapping/checkpoint.h"
#include "mapping/losses.h"
#include "mapping/targets.h"
#include "nn/data/dataloader.h"

namespace mn::fuzz {

struct CheckpointSetup {
  std::string strategy = "layerwise";  // layerwise, lazy_layerwise or slvt
  int64_t latent_dim = 4;
  uint64_t seed = 3;
  bool parameter_scaling = true;
  std::string optimizer = "adam";  // adam, adamw, sgd (with momentum, so it has state)
  std::string scheduler;           // "", cosine or plateau
  std::string loss = "task";       // task, or trainable (an alignment term with a trainable rho)
};

// What one input is loaded into. Members are destroyed in reverse order: the trainer before the
// model and loader it refers to.
struct CheckpointRun {
  std::unique_ptr<data::DataLoader> loader;
  std::unique_ptr<mapping::MappingModel> model;
  std::unique_ptr<mapping::MappingTrainer> trainer;
};

inline std::unique_ptr<CheckpointRun> make_checkpoint_run(const CheckpointSetup& setup) {
  auto run = std::make_unique<CheckpointRun>();
  // The target's initial weights and the data come from fixed seeds: every input meets the same model.
  manual_seed(0);
  mapping::TargetOptions target_options;
  target_options.mlp_hidden = {4};
  mapping::MappingOptions options;
  options.strategy = setup.strategy;
  options.latent_dim = setup.latent_dim;
  options.seed = setup.seed;
  options.parameter_scaling = setup.parameter_scaling;
  run->model = std::make_unique<mapping::MappingModel>(mapping::make_target("mlp", target_options), options);

  Generator data_gen(5);
  Tensor images = randn({2, 1, 28, 28}, {}, &data_gen);
  Tensor labels = from_vector(std::vector<int64_t>{3, 7}, {2});
  data::DataLoaderOptions loader_options;
  loader_options.batch_size = 2;
  run->loader = std::make_unique<data::DataLoader>(images, labels, loader_options);

  mapping::TrainerConfig config;
  config.max_epochs = 2;
  config.optimizer = setup.optimizer;
  config.learning_rate = 0.01;
  config.momentum = setup.optimizer == "sgd" ? 0.9 : 0.0;
  config.scheduler = setup.scheduler;
  config.seed = 1;
  std::shared_ptr<mapping::MappingLoss> loss;
  if (setup.loss == "trainable") {
    mapping::MappingLossOptions loss_options;
    loss_options.stability = mapping::no_term;
    loss_options.smoothness = mapping::no_term;
    loss_options.trainable_coefficients = true;
    loss = std::make_shared<mapping::MappingLoss>(std::make_shared<mapping::ClassificationLoss>(), loss_options);
  } else {
    loss = mapping::MappingLoss::task_only(std::make_shared<mapping::ClassificationLoss>());
  }
  run->trainer = std::make_unique<mapping::MappingTrainer>(*run->model, *run->loader, nullptr, loss, config);
  return run;
}

// The setup a checkpoint asks for, where it is one the fuzzer offers (else the default's value).
inline CheckpointSetup setup_for(const mapping::CheckpointInfo& info) {
  CheckpointSetup setup;
  if (info.strategy == "layerwise" || info.strategy == "lazy_layerwise" || info.strategy == "slvt")
    setup.strategy = info.strategy;
  if (!info.latent_dims.empty() && info.latent_dims.front().second >= 1 && info.latent_dims.front().second <= 8)
    setup.latent_dim = info.latent_dims.front().second;
  setup.seed = info.seed;
  setup.parameter_scaling = info.parameter_scaling;
  auto meta = [&](const char* key, std::initializer_list<const char*> allowed, std::string& out) {
    const auto it = info.metadata.find(key);
    if (it == info.metadata.end()) return;
    for (const char* a : allowed)
      if (it->second == a) out = a;
  };
  meta("fuzz_optimizer", {"adam", "adamw", "sgd"}, setup.optimizer);
  meta("fuzz_scheduler", {"", "cosine", "plateau"}, setup.scheduler);
  meta("fuzz_loss", {"task", "trainable"}, setup.loss);
  return setup;
}

}  // namespace mn::fuzz
