// train::Trainer over a plain module: the loop against a hand-written one, accumulation with no_sync
// under data parallel, file loggers, periodic checkpoints and exact resume (also from mn-train's older
// direct checkpoints), Ctrl-C, the LR finder's restore and compiled steps.
#include <csignal>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "nn/functional.h"
#include "nn/layers.h"
#include "nn/safetensors.h"
#include "nn/train/interrupt.h"
#include "nn/train/loggers.h"
#include "nn/train/trainer.h"
#include "tests/temp_dir.h"
#include "tests/test_support.h"

using namespace mn;
using mn::testing::contains;
using mn::testing::error_message;
using mn::testing::TempDir;
namespace keys = mn::train::history_keys;

namespace {

std::shared_ptr<nn::Sequential> mlp(uint64_t seed = 3) {
  manual_seed(seed);
  return std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
      std::make_shared<nn::Linear>(6, 8), std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(8, 3)});
}

// 14 samples of 6 features in 3 classes: batches of 2 give 7 batches per epoch.
struct Data {
  Tensor x, y;
  Data() {
    Generator gen(11);
    x = randn({14, 6}, {}, &gen);
    std::vector<int64_t> labels;
    for (int64_t i = 0; i < 14; ++i) labels.push_back(i % 3);
    y = from_vector(labels, {14});
  }
  data::DataLoader loader(int64_t batch = 2, bool shuffle = true) const {
    return data::DataLoader(x, y, {.batch_size = batch, .shuffle = shuffle, .seed = 5});
  }
};

std::vector<std::vector<float>> values(const nn::Module& m) {
  std::vector<std::vector<float>> out;
  for (const Tensor& p : m.parameters()) out.push_back(p.to_vector<float>());
  return out;
}

// Counts what a trainer asks of data parallel; one "rank", so averages are the local values.
class FakeDataParallel : public train::DataParallel {
 public:
  void set_gradient_sync(bool enabled) override {
    (enabled ? enables : disables)++;
    sync = enabled;
  }
  bool gradient_sync() const override { return sync; }
  train::Metrics average_metrics(const train::Metrics& metrics, int64_t samples) override {
    ++reductions;
    samples_seen += samples;
    return metrics;
  }
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  bool sync = true;
  int enables = 0, disables = 0, reductions = 0;
  int64_t samples_seen = 0;
};

// After each batch, how many times the trainer has turned gradient communication off so far.
struct SyncRecorder : train::Callback {
  explicit SyncRecorder(FakeDataParallel& dp) : dp(dp) {}
  void on_batch_end(train::Trainer&, int64_t, const train::LossOutput&) override { disables.push_back(dp.disables); }
  FakeDataParallel& dp;
  std::vector<int> disables;
};

}  // namespace

TEST_CASE("Trainer trains a plain module exactly as the hand-written loop does") {
  const Data d;
  auto reference = mlp();
  {
    nn::optim::Adam adam(reference->parameters(), {.lr = 1e-2});
    data::DataLoader loader = d.loader();
    for (uint64_t epoch = 0; epoch < 3; ++epoch) {
      loader.set_epoch(epoch);
      for (const data::Batch& b : loader) {
        adam.zero_grad();
        nn::functional::cross_entropy(reference->forward(b.inputs), b.targets).backward();
        adam.step();
      }
    }
  }
  auto net = mlp();
  data::DataLoader loader = d.loader();
  data::DataLoader val = d.loader(7, false);
  train::Trainer trainer(*net, loader, &val, train::classification(), {.max_epochs = 3, .learning_rate = 1e-2});
  const train::History history = trainer.fit();
  CHECK(values(*net) == values(*reference));
  CHECK(history.epochs() == 3);
  for (const char* key : {keys::kTrainTaskLoss, keys::kTrainTotalLoss, keys::kTrainAccuracy, keys::kValTaskLoss,
                          keys::kValTotalLoss, keys::kValAccuracy, keys::kLearningRate})
    CHECK(history.at(key).size() == 3);
  CHECK(history.at(keys::kTrainTaskLoss) == history.at(keys::kTrainTotalLoss));
  CHECK(history.at(keys::kTrainTaskLoss).back() < history.at(keys::kTrainTaskLoss).front());

  // Frozen parameters are not trained; a model with none trainable is refused.
  auto frozen = mlp();
  frozen->requires_grad_(false);
  CHECK(contains(error_message([&] {
                   train::Trainer t(*frozen, loader, nullptr, train::classification());
                 }),
                 "no trainable parameters"));
  CHECK(contains(error_message([&] {
                   train::Trainer t(*net, loader, nullptr, train::Objective{});
                 }),
                 "needs an objective"));
}

TEST_CASE("Trainer: accumulation under data parallel communicates only at the end of each window") {
  const Data d;
  // 7 batches, windows of 3: batches 0, 1 | 3, 4 run without sync; 2, 5 and the partial window's 6 sync.
  FakeDataParallel dp;
  auto recorder = std::make_shared<SyncRecorder>(dp);
  auto net = mlp();
  data::DataLoader loader = d.loader();
  data::DataLoader val = d.loader(7, false);
  train::Trainer trainer(*net, loader, &val, train::classification(), {.max_epochs = 1, .accumulation_steps = 3},
                         {recorder});
  trainer.set_data_parallel(&dp);
  trainer.fit();
  CHECK(dp.disables == 4);
  CHECK(dp.enables == 4);
  CHECK(dp.sync);
  CHECK(recorder->disables == std::vector<int>{1, 2, 2, 3, 4, 4, 4});
  CHECK(dp.reductions == 2);           // the training pass and the validation pass
  CHECK(dp.samples_seen == 14 + 14);  // each pass reports its samples

  // Without data parallel the same accumulation gives the same parameters.
  auto plain = mlp();
  data::DataLoader loader2 = d.loader();
  data::DataLoader val2 = d.loader(7, false);
  train::Trainer other(*plain, loader2, &val2, train::classification(), {.max_epochs = 1, .accumulation_steps = 3});
  other.fit();
  CHECK(values(*plain) == values(*net));
}

namespace {
// Two ranks whose other rank reports `other` as its starting position (epoch, global step, batch).
class SplitStart : public FakeDataParallel {
 public:
  explicit SplitStart(std::vector<double> other) : other_(std::move(other)) {}
  int world_size() const override { return 2; }
  std::vector<std::vector<double>> all_gather(const std::vector<double>& values) override {
    return {values, other_};
  }

 private:
  std::vector<double> other_;
};
}  // namespace

TEST_CASE("Trainer: data-parallel ranks that would start at different positions are refused") {
  const Data d;
  auto net = mlp();
  data::DataLoader loader = d.loader();
  train::Trainer trainer(*net, loader, nullptr, train::classification(), {.max_epochs = 1});
  // The other rank resumed a mid-epoch checkpoint; this one starts fresh (as a node without the shared
  // checkpoint directory would under --auto-resume).
  SplitStart resumed({1, 12, 5});
  trainer.set_data_parallel(&resumed);
  const std::string message = error_message([&] { trainer.fit(); });
  CHECK(contains(message, "ranks start from different positions"));
  CHECK(contains(message, "rank 0: a fresh start"));
  CHECK(contains(message, "rank 1: epoch 2, global step 12, batch 5 of its epoch"));
  CHECK(trainer.global_step() == 0);  // refused before any step
  // Ranks that agree train.
  SplitStart agreeing({0, 0, 0});
  trainer.set_data_parallel(&agreeing);
  trainer.fit();
  CHECK(trainer.global_step() > 0);
}

TEST_CASE("Trainer: checkpoints every N epochs, CSV and JSON logs, and an exact resume") {
  const Data d;
  TempDir dir("mn_train");
  const std::string ckpt = (dir.path() / "checkpoint.safetensors").string();
  const std::string csv = (dir.path() / "metrics.csv").string();
  const std::string jsonl = (dir.path() / "metrics.jsonl").string();
  const train::TrainerConfig config{.max_epochs = 4, .learning_rate = 1e-2, .scheduler = "cosine"};

  auto straight = mlp();
  {
    data::DataLoader loader = d.loader();
    data::DataLoader val = d.loader(7, false);
    train::Trainer trainer(*straight, loader, &val, train::classification(), config);
    trainer.fit();
  }

  // First run: killed (interrupted) after epoch 3; checkpoints every 2 epochs, and at the stop.
  struct StopAfter : train::Callback {
    void on_epoch_end(train::Trainer& t, int64_t e, const train::Metrics&) override {
      if (e == 2) t.set_should_stop(true);
    }
  };
  {
    auto net = mlp();
    data::DataLoader loader = d.loader();
    data::DataLoader val = d.loader(7, false);
    auto checkpoint = std::make_shared<train::ModelCheckpoint>(
        ckpt, 2, train::CheckpointMetadata{.metadata = {{"who", "test"}}, .config = R"({"run": 1})"});
    train::Trainer trainer(*net, loader, &val, train::classification(), config,
                           {checkpoint, std::make_shared<train::CsvLogger>(csv),
                            std::make_shared<train::JsonLogger>(jsonl), std::make_shared<StopAfter>()});
    trainer.fit();
    REQUIRE(trainer.epoch() == 3);
  }
  const train::ModuleCheckpoint saved = train::read_module_checkpoint(ckpt);
  CHECK(saved.format == "mn.train.checkpoint");
  REQUIRE(saved.trainer_state.has_value());
  CHECK(saved.trainer_state->epoch == 3);  // saved at the stop, between two periodic saves
  CHECK(saved.metadata.metadata.at("who") == "test");
  CHECK(nlohmann::json::parse(saved.metadata.config) == nlohmann::json{{"run", 1}});
  CHECK(saved.state.count("0.weight") == 1);

  // Second run: a fresh model and trainer continue from the checkpoint to epoch 4.
  auto resumed = mlp(99);  // other initial values: all of them come from the checkpoint
  data::DataLoader loader = d.loader();
  data::DataLoader val = d.loader(7, false);
  train::Trainer trainer(*resumed, loader, &val, train::classification(), config,
                         {std::make_shared<train::CsvLogger>(csv), std::make_shared<train::JsonLogger>(jsonl)});
  trainer.load_checkpoint(ckpt);
  CHECK(trainer.epoch() == 3);
  const train::History history = trainer.fit();
  CHECK(values(*resumed) == values(*straight));
  CHECK(history.epochs() == 4);

  std::ifstream csv_in(csv);
  std::string line;
  std::vector<std::string> lines;
  while (std::getline(csv_in, line)) lines.push_back(line);
  REQUIRE(lines.size() == 5);
  CHECK(lines[0] == "epoch,seconds,train_loss,train_accuracy,test_loss,test_accuracy,lr");
  for (int e = 1; e <= 4; ++e) CHECK(lines[static_cast<size_t>(e)].rfind(std::to_string(e) + ",", 0) == 0);
  std::ifstream json_in(jsonl);
  int records = 0;
  while (std::getline(json_in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    CHECK(j.at("epoch") == ++records);
    CHECK(j.at(keys::kValAccuracy).is_number());
  }
  CHECK(records == 4);

  // A checkpoint that does not fit the module names every difference and changes nothing.
  manual_seed(1);
  auto wider = std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
      std::make_shared<nn::Linear>(6, 9), std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(9, 3)});
  const auto before = values(*wider);
  train::Trainer mismatched(*wider, loader, nullptr, train::classification(), config);
  const std::string message = error_message([&] { mismatched.load_checkpoint(ckpt); });
  CHECK(contains(message, "'0.weight' has shape [8, 6], the module's [9, 6]"));
  CHECK(contains(message, "'2.weight'"));
  CHECK(values(*wider) == before);
  CHECK(mismatched.epoch() == 0);
}

TEST_CASE("Trainer reads mn-train's direct checkpoints from before the generic trainer") {
  const Data d;
  TempDir dir("mn_train_legacy");
  const std::string path = (dir.path() / "checkpoint.safetensors").string();
  auto source = mlp();
  data::DataLoader loader = d.loader();
  train::Trainer writer(*source, loader, nullptr, train::classification(), {.max_epochs = 1, .learning_rate = 1e-2});
  writer.fit();
  // The old layout: state dict, optimizer/<key>, and epoch / optimizer_lr / history / config metadata.
  safetensors::NamedTensors tensors;
  for (const auto& [name, t] : source->state_dict()) tensors.emplace_back(name, t.detach());
  for (const auto& [key, t] : writer.optimizer().state_dict()) tensors.emplace_back("optimizer/" + key, t);
  safetensors::save(path, tensors,
                    {{"format", "\"mn-train.direct\""},
                     {"epoch", "1"},
                     {"optimizer_lr", "0.01"},
                     {"history", R"({"train_loss": [1.5], "train_accuracy": [0.25], "test_accuracy": [0.5]})"},
                     {"config", R"({"target": "mlp"})"}});

  auto net = mlp(42);
  train::Trainer trainer(*net, loader, nullptr, train::classification(), {.max_epochs = 2, .learning_rate = 1e-3});
  const uint64_t offset = default_generator().offset();
  trainer.load_checkpoint(path);
  CHECK(values(*net) == values(*source));
  CHECK(trainer.epoch() == 1);
  CHECK(trainer.learning_rate() == 0.01);
  CHECK(default_generator().offset() == offset);  // not recorded in those files: left alone
  const train::History& h = trainer.history();
  CHECK(h.at(keys::kTrainTaskLoss) == std::vector<double>{1.5});
  CHECK(h.at(keys::kTrainTotalLoss) == std::vector<double>{1.5});
  CHECK(h.at(keys::kValAccuracy) == std::vector<double>{0.5});
  CHECK(std::isnan(h.at(keys::kValTaskLoss).at(0)));
  CHECK(train::read_module_checkpoint(path).metadata.config == R"({"target":"mlp"})");

  // Malformed metadata names the file and what is wrong.
  safetensors::save(path, tensors, {{"format", "\"mn-train.direct\""}, {"epoch", "1.5"}, {"optimizer_lr", "0.01"},
                                    {"history", "{}"}});
  CHECK(contains(error_message([&] { trainer.load_checkpoint(path); }), "malformed metadata"));
  safetensors::save(path, tensors, {{"format", "\"something else\""}});
  CHECK(contains(error_message([&] { trainer.load_checkpoint(path); }), "is not a trainer checkpoint"));
}

TEST_CASE("StopOnSigint stops the fit at the next batch and restores the previous handler") {
  const Data d;
  struct sigaction before {};
  REQUIRE(sigaction(SIGINT, nullptr, &before) == 0);
  const bool handled = before.sa_handler != SIG_IGN;  // the test runner's default
  REQUIRE(handled);
  struct RaiseAt : train::Callback {
    void on_batch_end(train::Trainer& t, int64_t batch, const train::LossOutput&) override {
      if (t.current_epoch() == 1 && batch == 2) std::raise(SIGINT);
    }
  };
  auto sigint = std::make_shared<train::StopOnSigint>();
  auto net = mlp();
  data::DataLoader loader = d.loader();
  train::Trainer trainer(*net, loader, nullptr, train::classification(), {.max_epochs = 3},
                         {sigint, std::make_shared<RaiseAt>()});
  const train::History history = trainer.fit();
  CHECK(sigint->interrupted());
  CHECK(trainer.epoch() == 1);  // the interrupted epoch is dropped
  CHECK(history.epochs() == 1);
  struct sigaction after {};
  REQUIRE(sigaction(SIGINT, nullptr, &after) == 0);
  const bool restored = after.sa_handler == before.sa_handler;
  CHECK(restored);
}

TEST_CASE("Trainer: the LR finder leaves a plain module as it was, and compiled steps match eager ones") {
  const Data d;
  auto net = mlp();
  data::DataLoader loader = d.loader();
  train::Trainer trainer(*net, loader, nullptr, train::classification(), {.max_epochs = 2});
  const auto before = values(*net);
  const train::LRFinderResult sweep = trainer.lr_find(1e-5, 1.0, 6);
  CHECK(sweep.lrs.size() == 6);
  CHECK(values(*net) == before);
  CHECK(trainer.learning_rate() == 1e-3);

  auto eager = mlp(), compiled = mlp();
  data::DataLoader l1 = d.loader(), l2 = d.loader();
  train::Trainer a(*eager, l1, nullptr, train::classification(), {.max_epochs = 2});
  train::Trainer b(*compiled, l2, nullptr, train::classification(), {.max_epochs = 2, .compile = true});
  a.fit();
  b.fit();
  CHECK(values(*eager) == values(*compiled));
  CHECK(contains(b.compile_report(), "captured"));
}
