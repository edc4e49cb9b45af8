// The main job (`./mn demo`): the paper's CNN2 (108,618 parameters) trained on Fashion-MNIST as a
// mapping network. The target is frozen; each of its four layers gets its parameters from a latent of
// 672 values through a fixed, seeded mapper (2,688 trainable values, the paper's LWT row). Only the
// latents train (Adam, cosine schedule). The program shows the public API end to end: target,
// MappingModel, MappingTrainer, a metrics callback, a seed-only checkpoint and the export of the
// generated parameters as a PyTorch-loadable state dict.
//
//   mn_demo [--epochs 3] [--latent-dim 672] [--batch-size 256] [--lr 0.01] [--seed 0] [--out out/demo]
//
// For longer runs, other targets and strategies, resuming and JSON output use mn-train.
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/parallel.h"
#include "core/random.h"
#include "mapping/checkpoint.h"
#include "mapping/targets.h"
#include "mapping/trainer.h"
#include "nn/data/dataloader.h"
#include "nn/data/fashion_mnist.h"

using namespace mn;
namespace fs = std::filesystem;

namespace {

data::Dataset take(const data::Dataset& ds, int64_t n) {
  if (n <= 0 || n >= ds.size()) return ds;
  return {ds.images.narrow(0, 0, n).contiguous(), ds.labels.narrow(0, 0, n).contiguous()};
}

// Appends one CSV row per epoch and prints a line when no progress bar is shown.
class EpochLog : public mapping::Callback {
 public:
  EpochLog(const fs::path& csv, bool print) : out_(csv), print_(print) {
    out_ << "epoch,seconds,train_loss,train_accuracy,test_loss,test_accuracy,lr\n";
  }
  std::string name() const override { return "EpochLog"; }
  void on_epoch_start(mapping::MappingTrainer&, int64_t) override { start_ = std::chrono::steady_clock::now(); }
  void on_epoch_end(mapping::MappingTrainer& trainer, int64_t epoch, const mapping::Metrics& m) override {
    namespace k = mapping::history_keys;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    auto get = [&](const char* key) { return m.count(key) ? m.at(key) : std::nan(""); };
    out_ << epoch + 1 << ',' << seconds << ',' << get(k::kTrainTaskLoss) << ',' << get(k::kTrainAccuracy) << ','
         << get(k::kValTaskLoss) << ',' << get(k::kValAccuracy) << ',' << get(k::kLearningRate) << '\n';
    out_.flush();
    if (print_)
      std::printf("epoch %lld/%lld: train loss %.4f acc %.2f%%, test acc %.2f%% (%.1f s)\n",
                  static_cast<long long>(epoch + 1), static_cast<long long>(trainer.config().max_epochs),
                  get(k::kTrainTaskLoss), 100 * get(k::kTrainAccuracy), 100 * get(k::kValAccuracy), seconds);
    seconds_ += seconds;
  }
  double seconds() const { return seconds_; }

 private:
  std::ofstream out_;
  bool print_;
  double seconds_ = 0;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train CNN2 on Fashion-MNIST as a mapping network (layerwise latents)"};
  int64_t epochs = 3, latent_dim = 672, batch_size = 256, limit = 0;
  int threads = 0;
  double lr = 1e-2;
  uint64_t seed = 0;
  std::string out_dir = "out/demo", data_dir = data::default_fashion_mnist_root();
  app.add_option("--epochs", epochs, "training epochs")->check(CLI::PositiveNumber);
  app.add_option("--latent-dim", latent_dim, "latent length per layer")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch_size, "batch size")->check(CLI::PositiveNumber);
  app.add_option("--lr", lr, "Adam learning rate of the latents (cosine decay to 0)")->check(CLI::PositiveNumber);
  app.add_option("--seed", seed, "seed of the target init, mappers, latents and shuffling");
  app.add_option("--limit", limit, "use only the first N training and test images (0 = all)");
  app.add_option("--data", data_dir, "Fashion-MNIST directory");
  app.add_option("--out", out_dir, "directory for metrics.csv, checkpoint.safetensors and generated.safetensors");
  app.add_option("--threads", threads, "threads of the CPU kernels (default: OMP_NUM_THREADS, else all CPUs)")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  try {
    if (threads > 0) set_num_threads(threads);
    manual_seed(seed);
    data::Dataset train = take(data::load_fashion_mnist("train", data_dir), limit);
    data::Dataset test = take(data::load_fashion_mnist("test", data_dir), limit);
    train.images = data::normalize(train.images);  // the training split's mean and std
    test.images = data::normalize(test.images);

    // The frozen target and the mapping network around it.
    auto target = mapping::make_target("cnn2");
    mapping::MappingOptions options;
    options.strategy = "layerwise";
    options.latent_dim = latent_dim;
    options.seed = seed;
    mapping::MappingModel model(target, options);
    std::printf("CNN2 layerwise: %lld target parameters generated from %lld trainable latent values "
                "(%zu groups x %lld), compression %.1fx\n",
                static_cast<long long>(model.target_parameter_count()),
                static_cast<long long>(model.trainable_parameter_count()), model.generator().groups().size(),
                static_cast<long long>(latent_dim), model.compression_ratio());
    std::printf("%lld training / %lld test images, batch %lld, Adam lr %g with cosine decay, %lld epochs, "
                "%d CPU threads\n",
                static_cast<long long>(train.size()), static_cast<long long>(test.size()),
                static_cast<long long>(batch_size), lr, static_cast<long long>(epochs), get_num_threads());

    data::DataLoader train_loader(train, {batch_size, true, seed, false});
    data::DataLoader test_loader(test, {1000, false, 0, false});
    mapping::TrainerConfig config;
    config.max_epochs = epochs;
    config.learning_rate = lr;
    config.scheduler = "cosine";
    config.seed = seed;
    fs::create_directories(out_dir);
    const bool tty = isatty(STDOUT_FILENO) != 0;
    auto log = std::make_shared<EpochLog>(fs::path(out_dir) / "metrics.csv", !tty);
    std::vector<std::shared_ptr<mapping::Callback>> callbacks{log};
    if (tty) callbacks.push_back(std::make_shared<mapping::ProgressCallback>());
    mapping::MappingTrainer trainer(model, train_loader, &test_loader,
                                    std::make_shared<mapping::ClassificationLoss>(), config, callbacks);
    const mapping::History history = trainer.fit();

    // Kilobytes: latents, seed and options; the mappers are rebuilt from the seed on load.
    const fs::path checkpoint = fs::path(out_dir) / "checkpoint.safetensors";
    mapping::save_checkpoint(checkpoint.string(), model, trainer);
    const fs::path generated = fs::path(out_dir) / "generated.safetensors";
    mapping::export_generated_parameters(generated.string(), model);

    namespace k = mapping::history_keys;
    const double test_acc = history.at(k::kValAccuracy).back(), train_acc = history.at(k::kTrainAccuracy).back();
    std::printf("test accuracy %.2f%% (train %.2f%%) after %lld epochs, %.1f s of training\n", 100 * test_acc,
                100 * train_acc, static_cast<long long>(epochs), log->seconds());
    std::printf("trainable %lld of %lld parameters: compression %.1fx; checkpoint %s (%lld bytes), generated "
                "CNN2 state dict %s\n",
                static_cast<long long>(model.trainable_parameter_count()),
                static_cast<long long>(model.target_parameter_count()), model.compression_ratio(),
                checkpoint.c_str(), static_cast<long long>(fs::file_size(checkpoint)), generated.c_str());
  } catch (const Error& e) {
    std::fprintf(stderr, "mn_demo: %s\n", e.what());
    return 1;
  }
  return 0;
}
