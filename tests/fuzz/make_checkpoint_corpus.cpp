// Writes the checkpoint fuzzer's seed corpus: real checkpoints of the setups fuzz_checkpoint.cpp
// offers, each after one epoch of training so that they hold optimizer moments, scheduler state and
// history. Usage: make_checkpoint_corpus DIR (run_fuzz.sh checkpoint-corpus writes
// tests/fuzz/corpus_checkpoint). The files are deterministic: rerunning rewrites the same bytes
// unless the checkpoint format or the training arithmetic changed.
#include <cstdio>
#include <exception>
#include <map>
#include <string>
#include <vector>

#include "tests/fuzz/checkpoint_setup.h"

namespace {

struct Seed {
  const char* file;
  mn::fuzz::CheckpointSetup setup;
  bool with_trainer = true;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  using Setup = mn::fuzz::CheckpointSetup;
  const std::vector<Seed> seeds = {
      {"layerwise_adam.safetensors", Setup{}},
      {"lazy_layerwise_adamw_cosine.safetensors",
       Setup{.strategy = "lazy_layerwise", .optimizer = "adamw", .scheduler = "cosine"}},
      {"slvt_sgd_plateau.safetensors",
       Setup{.strategy = "slvt", .latent_dim = 8, .optimizer = "sgd", .scheduler = "plateau"}},
      {"layerwise_unscaled_trainable_loss.safetensors", Setup{.parameter_scaling = false, .loss = "trainable"}},
      {"layerwise_no_trainer_state.safetensors", Setup{}, false},
  };
  try {
    for (const Seed& seed : seeds) {
      auto run = mn::fuzz::make_checkpoint_run(seed.setup);
      run->trainer->set_max_epochs(1);
      run->trainer->fit();
      const std::map<std::string, std::string> metadata = {{"fuzz_optimizer", seed.setup.optimizer},
                                                           {"fuzz_scheduler", seed.setup.scheduler},
                                                           {"fuzz_loss", seed.setup.loss}};
      const std::string path = dir + "/" + seed.file;
      if (seed.with_trainer) {
        mn::mapping::save_checkpoint(path, *run->model, mn::mapping::checkpoint_extras(*run->trainer, metadata));
      } else {
        mn::mapping::CheckpointExtras extras;
        extras.metadata = metadata;
        mn::mapping::save_checkpoint(path, *run->model, extras);
      }
      std::printf("wrote %s\n", path.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_checkpoint_corpus: %s\n", e.what());
    return 1;
  }
  return 0;
}
