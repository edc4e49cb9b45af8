// The main job (`./mn demo`): the paper's CNN2 (108,618 parameters) trained on Fashion-MNIST as a
// mapping network. The target is frozen; each of its four layers gets its parameters from a latent of
// 672 values through a fixed, seeded mapper (2,688 trainable values, the paper's LWT row). Only the
// latents train (Adam, cosine schedule). The program shows the public API end to end: target,
// MappingModel, MappingTrainer, a metrics callback, a seed-only checkpoint and the export of the
// generated parameters as a PyTorch-loadable state dict.
//
//   mn-demo [--epochs 3] [--latent-dim 672] [--batch-size 256] [--lr 0.01] [--seed 0] [--out out/demo]
//   mn-demo --epochs 5 --write-config demo.toml   # save the options; mn-demo --config demo.toml runs them
//
// For longer runs, other targets and strategies, resuming and JSON output use mn-train.
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>

#include "cli_checks.h"
#include "core/parallel.h"
#include "core/random.h"
#include "mapping/checkpoint.h"
#include "mapping/targets.h"
#include "mapping/trainer.h"
#include "nn/data/dataloader.h"
#include "nn/data/fashion_mnist.h"
#include "nn/train/loggers.h"

using namespace mn;
using namespace mn::examples;
namespace fs = std::filesystem;

int main(int argc, char** argv) {
  CLI::App app{"Train CNN2 on Fashion-MNIST as a mapping network (layerwise latents)"};
  int64_t epochs = 3, latent_dim = 672, batch_size = 256, limit = 0;
  int threads = 0;
  double lr = 1e-2;
  uint64_t seed = 0;
  std::string out_dir = "out/demo", data_dir = data::default_fashion_mnist_root(), write_config;
  add_version_flag(app, "mn-demo");
  add_config_options(app, write_config);
  app.add_option("--epochs", epochs, "training epochs")->check(whole_number_at_least(1))->capture_default_str();
  app.add_option("--latent-dim", latent_dim, "latent length per layer")
      ->check(whole_number_at_least(1))
      ->capture_default_str();
  app.add_option("--batch-size", batch_size, "batch size")->check(whole_number_at_least(1))->capture_default_str();
  app.add_option("--lr", lr, "Adam learning rate of the latents (cosine decay to 0)")
      ->check(positive_finite_number())
      ->capture_default_str();
  app.add_option("--seed", seed, "seed of the target init, mappers, latents and shuffling")
      ->check(unsigned_whole_number())
      ->capture_default_str();
  app.add_option("--limit", limit, "use only the first N training and test images (0 = all)")
      ->check(whole_number_at_least(0))
      ->capture_default_str();
  app.add_option("--data", data_dir, "Fashion-MNIST directory")->capture_default_str();
  app.add_option("--out", out_dir, "directory for metrics.csv, checkpoint.safetensors and generated.safetensors")
      ->capture_default_str();
  app.add_option("--threads", threads,
                 "threads of the CPU kernels (default: OMP_NUM_THREADS, else the CPUs other processes leave free, "
                 "within the cgroup CPU limit)")
      ->check(whole_number_at_least(1));
  CLI11_PARSE(app, argc, argv);

  try {
    if (write_config_if_asked(app, write_config, "mn-demo")) return 0;
    if (threads > 0) set_num_threads(threads);
    manual_seed(seed);
    data::Dataset train = data::load_fashion_mnist("train", data_dir).head(limit);
    data::Dataset test = data::load_fashion_mnist("test", data_dir).head(limit);
    train.images = data::normalize(train.images);  // the training split's mean and std
    test.images = data::normalize(test.images);

    // The frozen target and the mapping network around it.
    auto target = mapping::make_target("cnn2");
    mapping::MappingModel model(target, {.latent_dim = latent_dim, .strategy = "layerwise", .seed = seed});
    std::printf("CNN2 layerwise: %lld target parameters generated from %lld trainable latent values "
                "(%zu groups x %lld), compression %.1fx\n",
                static_cast<long long>(model.target_parameter_count()),
                static_cast<long long>(model.trainable_parameter_count()), model.generator().groups().size(),
                static_cast<long long>(latent_dim), model.compression_ratio());
    std::printf("%lld training / %lld test images, batch %lld, Adam lr %g with cosine decay, %s, %d CPU threads\n",
                static_cast<long long>(train.size()), static_cast<long long>(test.size()),
                static_cast<long long>(batch_size), lr, count_of(epochs, "epoch").c_str(), get_num_threads());

    data::DataLoader train_loader(train, {.batch_size = batch_size, .shuffle = true, .seed = seed});
    data::DataLoader test_loader(test, {.batch_size = 1000});
    fs::create_directories(out_dir);
    const bool tty = isatty(STDOUT_FILENO) != 0;
    // metrics.csv per epoch; a progress bar on a terminal, else a line per epoch.
    std::vector<std::shared_ptr<train::Callback>> callbacks{
        std::make_shared<train::CsvLogger>((fs::path(out_dir) / "metrics.csv").string())};
    callbacks.push_back(std::make_shared<train::ProgressCallback>());  // a bar, or plain lines in logs
    if (!tty) callbacks.push_back(std::make_shared<train::EpochSummary>());
    mapping::MappingTrainer trainer(model, train_loader, &test_loader, std::make_shared<mapping::ClassificationLoss>(),
                                    {.max_epochs = epochs, .learning_rate = lr, .scheduler = "cosine", .seed = seed},
                                    callbacks);
    const auto start = std::chrono::steady_clock::now();
    const train::History history = trainer.fit();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    // Kilobytes: latents, seed and options; the mappers are rebuilt from the seed on load.
    const fs::path checkpoint = fs::path(out_dir) / "checkpoint.safetensors";
    mapping::save_checkpoint(checkpoint.string(), model, trainer);
    const fs::path generated = fs::path(out_dir) / "generated.safetensors";
    mapping::export_generated_parameters(generated.string(), model);

    namespace k = train::history_keys;
    const double test_acc = history.at(k::kValAccuracy).back(), train_acc = history.at(k::kTrainAccuracy).back();
    std::printf("test %.2f%%, train %.2f%% accuracy after %s, %.1f s of training\n", 100 * test_acc,
                100 * train_acc, count_of(epochs, "epoch").c_str(), seconds);
    std::printf("trainable %lld of %lld parameters: compression %.1fx; checkpoint %s (%lld bytes), generated "
                "CNN2 state dict %s\n",
                static_cast<long long>(model.trainable_parameter_count()),
                static_cast<long long>(model.target_parameter_count()), model.compression_ratio(),
                checkpoint.c_str(), static_cast<long long>(fs::file_size(checkpoint)), generated.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mn-demo: %s\n", e.what());
    return 1;
  }
  return 0;
}
