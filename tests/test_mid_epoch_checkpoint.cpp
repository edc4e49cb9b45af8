// Mid-epoch checkpoints (ModelCheckpoint every_n_steps, TrainerState::progress): a fit stopped after a
// mid-epoch save and resumed from it ends with the checkpoint file and the metrics of the uninterrupted
// fit, byte for byte - for a plain module with dropout (the global generator), accumulation, a scheduler
// and early stopping, and for a MappingTrainer with stability noise (the trainer's generator). Also the
// state's JSON round trip, the schema versions and the data-parallel sums.
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "mapping/checkpoint.h"
#include "mapping/losses.h"
#include "mapping/trainer.h"
#include "nn/layers.h"
#include "nn/safetensors.h"
#include "nn/train/loggers.h"
#include "tests/checkpoint_run_support.h"
#include "tests/temp_dir.h"
#include "tests/test_support.h"

using namespace mn;
using mn::testing::read_bytes;
using mn::testing::without_seconds;
using mn::testing::TempDir;

namespace {

// 60 labelled samples of 6 features in 3 classes: 8 batches of 8 per epoch (the last one of 4).
data::DataLoader classification_loader() {
  Generator gen(11);
  Tensor x = randn({60, 6}, {}, &gen);
  std::vector<int64_t> labels;
  for (int64_t i = 0; i < 60; ++i) labels.push_back((i * 7) % 3);
  return data::DataLoader(x, from_vector(labels, Shape{60}), {.batch_size = 8, .shuffle = true, .seed = 5});
}
data::DataLoader validation_loader() {
  Generator gen(12);
  Tensor x = randn({20, 6}, {}, &gen);
  std::vector<int64_t> labels;
  for (int64_t i = 0; i < 20; ++i) labels.push_back(i % 3);
  return data::DataLoader(x, from_vector(labels, Shape{20}), {.batch_size = 10});
}

std::shared_ptr<nn::Sequential> mlp_with_dropout() {
  manual_seed(3);
  return std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
      std::make_shared<nn::Linear>(6, 16), std::make_shared<nn::ReLU>(), std::make_shared<nn::Dropout>(0.3),
      std::make_shared<nn::Linear>(16, 3)});
}

// Stands for a crash: throws once the global step reaches `step` (after the step's checkpoint writers,
// being one of them itself, registered after ModelCheckpoint); the fit reports it as a RuntimeError
// naming CrashAt.
struct Crash : std::runtime_error {
  Crash() : std::runtime_error("crash") {}
};
class CrashAt : public train::Callback {
 public:
  explicit CrashAt(int64_t step) : step_(step) {}
  bool saves_checkpoints() const override { return true; }
  void on_batch_end(train::Trainer& t, int64_t, const train::LossOutput&) override {
    if (t.global_step() >= step_) throw Crash();
  }

 private:
  int64_t step_;
};

train::TrainerConfig plain_config() {
  train::TrainerConfig c;
  c.max_epochs = 3;
  c.learning_rate = 0.05;
  c.optimizer = "adam";
  c.scheduler = "step";
  c.accumulation_steps = 2;  // 8 batches: 4 steps per epoch
  c.seed = 9;
  return c;
}

// One plain-module fit into `dir`, crashing after `crash_step` (0: never) and resuming when `resume`.
// Throws when it crashes.
void plain_fit(const std::filesystem::path& dir, int64_t crash_step, bool resume, int64_t every_n_steps = 3) {
  auto net = mlp_with_dropout();
  data::DataLoader train_loader = classification_loader();
  data::DataLoader val = validation_loader();
  std::vector<std::shared_ptr<train::Callback>> callbacks{
      std::make_shared<train::CsvLogger>(dir / "metrics.csv"),
      std::make_shared<train::EarlyStopping>(train::history_keys::kValTotalLoss, 5),
      std::make_shared<train::ModelCheckpoint>(dir / "ckpt.safetensors", 1,
                                               train::CheckpointMetadata{{{"k", "v"}}, ""}, every_n_steps)};
  if (crash_step > 0) callbacks.push_back(std::make_shared<CrashAt>(crash_step));
  train::Trainer trainer(*net, train_loader, &val, train::classification(), plain_config(), callbacks);
  if (resume) trainer.load_checkpoint(dir / "ckpt.safetensors");
  trainer.fit();
}

int64_t schema_version(const std::string& path) {
  return std::stoll(safetensors::load(path).metadata.at("schema_version"));
}

}  // namespace

TEST_CASE("mid-epoch checkpoint: a plain module's fit resumed after a crash ends byte for byte as the straight fit") {
  TempDir dir("mn_mid_epoch_plain");
  std::filesystem::create_directories(dir / "straight");
  std::filesystem::create_directories(dir / "crashed");
  plain_fit(dir / "straight", 0, false);
  const std::string final_bytes = read_bytes(dir / "straight/ckpt.safetensors");
  REQUIRE(!final_bytes.empty());
  CHECK(schema_version(dir / "straight/ckpt.safetensors") == 1);  // the last save is an epoch end

  // Steps 1-4 are epoch 1, 5-8 epoch 2: the save at step 6 sits after batch 4 of epoch 2; crash at 7.
  CHECK_THROWS_WITH_AS(plain_fit(dir / "crashed", 7, false), doctest::Contains("CrashAt"), RuntimeError);
  const std::string mid = dir / "crashed/ckpt.safetensors";
  CHECK(schema_version(mid) == 2);
  const train::ModuleCheckpoint saved = train::read_module_checkpoint(mid);
  REQUIRE(saved.trainer_state->progress.has_value());
  CHECK(saved.trainer_state->epoch == 1);
  CHECK(saved.trainer_state->global_step == 6);
  CHECK(saved.trainer_state->progress->batches == 4);
  REQUIRE(saved.trainer_state->progress->sums.size() == 1);
  CHECK(saved.trainer_state->progress->sums[0].samples == 32);

  SUBCASE("resumed with the same every_n_steps") { plain_fit(dir / "crashed", 0, true); }
  SUBCASE("every_n_steps does not define the run: resumed with another, or none") {
    plain_fit(dir / "crashed", 0, true, 0);
  }
  CHECK(read_bytes(dir / "crashed/ckpt.safetensors") == final_bytes);
  CHECK(without_seconds(dir / "crashed/metrics.csv") == without_seconds(dir / "straight/metrics.csv"));
}

TEST_CASE("mid-epoch checkpoint: a resumed fit can crash and resume again, and the state round-trips unchanged") {
  TempDir dir("mn_mid_epoch_twice");
  std::filesystem::create_directories(dir / "straight");
  std::filesystem::create_directories(dir / "twice");
  plain_fit(dir / "straight", 0, false);
  CHECK_THROWS_WITH_AS(plain_fit(dir / "twice", 4, false), doctest::Contains("CrashAt"), RuntimeError);  // saved at 3 (epoch 1, batch 6)
  CHECK_THROWS_WITH_AS(plain_fit(dir / "twice", 11, true), doctest::Contains("CrashAt"), RuntimeError);  // saved at 9 (epoch 3, batch 2)
  const train::ModuleCheckpoint saved = train::read_module_checkpoint(dir / "twice/ckpt.safetensors");
  CHECK(saved.trainer_state->global_step == 9);
  CHECK(saved.trainer_state->progress->batches == 2);

  // Loaded and saved again before any step: the position stays in the state.
  {
    auto net = mlp_with_dropout();
    data::DataLoader train_loader = classification_loader();
    train::Trainer trainer(*net, train_loader, nullptr, train::classification(), plain_config());
    trainer.load_checkpoint(dir / "twice/ckpt.safetensors");
    CHECK(trainer.global_step() == 9);
    CHECK(trainer.state().progress == saved.trainer_state->progress);
    trainer.set_epoch(2);  // forgets the position
    CHECK_FALSE(trainer.state().progress.has_value());
  }
  plain_fit(dir / "twice", 0, true);
  CHECK(read_bytes(dir / "twice/ckpt.safetensors") == read_bytes(dir / "straight/ckpt.safetensors"));
  CHECK(without_seconds(dir / "twice/metrics.csv") == without_seconds(dir / "straight/metrics.csv"));
}

TEST_CASE("mid-epoch checkpoint: a MappingTrainer with stability noise resumes exactly (mapping checkpoint)") {
  TempDir dir("mn_mid_epoch_mapping");
  const auto fit = [&](const std::string& name, int64_t crash_step, bool resume) {
    const std::filesystem::path run = dir / name;
    std::filesystem::create_directories(run);
    manual_seed(21);
    mapping::MappingOptions options;
    options.latent_dim = 8;
    options.seed = 4;
    mapping::MappingModel model(std::make_shared<nn::Linear>(6, 3), options);
    data::DataLoader train_loader = classification_loader();
    auto loss = std::make_shared<mapping::MappingLoss>(std::make_shared<mapping::ClassificationLoss>());
    train::TrainerConfig c;
    c.max_epochs = 2;
    c.learning_rate = 0.02;
    c.seed = 4;
    std::vector<std::shared_ptr<train::Callback>> callbacks{
        std::make_shared<train::CsvLogger>((run / "metrics.csv").string()),
        std::make_shared<train::ModelCheckpoint>((run / "ckpt.safetensors").string(), 1,
                                                 train::CheckpointMetadata{}, 5)};
    if (crash_step > 0) callbacks.push_back(std::make_shared<CrashAt>(crash_step));
    mapping::MappingTrainer trainer(model, train_loader, nullptr, loss, c, callbacks);
    if (resume) trainer.load_checkpoint((run / "ckpt.safetensors").string());
    trainer.fit();
  };
  fit("straight", 0, false);
  CHECK_THROWS_WITH_AS(fit("crashed", 12, false), doctest::Contains("CrashAt"), RuntimeError);  // 8 steps per epoch; saved at 10 (epoch 2, batch 2)
  const mapping::CheckpointInfo info = mapping::read_checkpoint(dir / "crashed/ckpt.safetensors");
  CHECK(info.schema_version == mapping::kMidEpochCheckpointSchemaVersion);
  REQUIRE(info.trainer_state->progress.has_value());
  CHECK(info.trainer_state->progress->batches == 2);
  fit("crashed", 0, true);
  CHECK(read_bytes(dir / "crashed/ckpt.safetensors") == read_bytes(dir / "straight/ckpt.safetensors"));
  CHECK(without_seconds(dir / "crashed/metrics.csv") == without_seconds(dir / "straight/metrics.csv"));
}

TEST_CASE("mid-epoch checkpoint: no position inside an accumulation window, nor outside fit") {
  auto net = mlp_with_dropout();
  data::DataLoader train_loader = classification_loader();
  train::TrainerConfig c = plain_config();
  c.max_epochs = 1;
  struct Probe : train::Callback {
    std::vector<std::pair<bool, bool>> seen;  // (at_step_boundary, state has progress) per batch end
    void on_batch_end(train::Trainer& t, int64_t, const train::LossOutput&) override {
      seen.emplace_back(t.at_step_boundary(), t.state().progress.has_value());
    }
  };
  auto probe = std::make_shared<Probe>();
  train::Trainer trainer(*net, train_loader, nullptr, train::classification(), c, {probe});
  trainer.fit();
  REQUIRE(probe->seen.size() == 8);
  for (size_t i = 0; i < 8; ++i) {
    INFO("batch " << i);
    const bool boundary = i % 2 == 1;  // accumulation 2: a step after every second batch
    CHECK(probe->seen[i] == std::make_pair(boundary, boundary));
  }
  CHECK(trainer.global_step() == 4);
  CHECK_FALSE(trainer.state().progress.has_value());  // between epochs
  CHECK(trainer.state().global_step == 4);
  // fit_epoch outside fit records no position (the caller owns the epoch number).
  probe->seen.clear();
  trainer.fit_epoch(train_loader);
  CHECK(probe->seen[1] == std::make_pair(false, false));
}

TEST_CASE("TrainerState progress: JSON round trip keeps sums exactly, non-finite ones too; bad values are refused") {
  train::TrainerState s;
  s.epoch = 2;
  s.global_step = 17;
  s.progress = train::EpochProgress{
      .batches = 3,
      .nonfinite_steps = 1,
      .sums = {{0.1 + 0.2, 1e-310, 2.0 / 3.0, 24, 24},
               {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                std::numeric_limits<double>::quiet_NaN(), 24, 0}}};
  const train::TrainerState back = train::trainer_state_from_json(train::trainer_state_to_json(s));
  CHECK(back.global_step == 17);
  REQUIRE(back.progress.has_value());
  CHECK(back.progress->batches == 3);
  CHECK(back.progress->nonfinite_steps == 1);
  REQUIRE(back.progress->sums.size() == 2);
  CHECK(back.progress->sums[0] == s.progress->sums[0]);
  CHECK(back.progress->sums[1].task == std::numeric_limits<double>::infinity());
  CHECK(back.progress->sums[1].total == -std::numeric_limits<double>::infinity());
  CHECK(std::isnan(back.progress->sums[1].accuracy));
  // Files without the fields (epoch-end checkpoints of earlier builds) have neither.
  train::TrainerState old;
  old.epoch = 1;
  const train::TrainerState old_back = train::trainer_state_from_json(train::trainer_state_to_json(old));
  CHECK_FALSE(old_back.global_step.has_value());
  CHECK_FALSE(old_back.progress.has_value());

  std::string text = train::trainer_state_to_json(s);
  const auto replaced = [&](const std::string& from, const std::string& to) {
    std::string t = text;
    t.replace(t.find(from), from.size(), to);
    return t;
  };
  CHECK_THROWS_AS(train::trainer_state_from_json(replaced("\"batches\":3", "\"batches\":0")), ValueError);
  CHECK_THROWS_AS(train::trainer_state_from_json(replaced("\"inf\"", "\"lots\"")), ValueError);
  CHECK_THROWS_AS(train::trainer_state_from_json(replaced("\"accuracy_samples\":0", "\"accuracy_samples\":25")),
                  ValueError);
}

namespace {

// Two "ranks" in one process: all_gather returns this rank's values and a second rank's (doubled).
class TwoRanks : public train::DataParallel {
 public:
  explicit TwoRanks(int rank) : rank_(rank) {}
  void set_gradient_sync(bool) override {}
  bool gradient_sync() const override { return true; }
  train::Metrics average_metrics(const train::Metrics& metrics, int64_t) override { return metrics; }
  int rank() const override { return rank_; }
  int world_size() const override { return 2; }
  std::vector<std::vector<double>> all_gather(const std::vector<double>& values) override {
    std::vector<double> other = values;
    for (double& v : other) v *= 2;
    return rank_ == 0 ? std::vector<std::vector<double>>{values, other} : std::vector<std::vector<double>>{other, values};
  }

 private:
  int rank_;
};

}  // namespace

TEST_CASE("mid-epoch checkpoint under data parallel: every rank's sums are recorded; another rank count sums them") {
  TempDir dir("mn_mid_epoch_dp");
  auto net = mlp_with_dropout();
  data::DataLoader train_loader = classification_loader();
  train::TrainerConfig c = plain_config();
  c.max_epochs = 1;
  TwoRanks dp(0);
  const std::string path = dir / "ckpt.safetensors";
  std::vector<std::shared_ptr<train::Callback>> callbacks{
      std::make_shared<train::ModelCheckpoint>(path, 1, train::CheckpointMetadata{}, 1),
      std::make_shared<CrashAt>(1)};
  {
    // Without sync_epoch_progress a state captured under data parallel holds no position.
    struct Probe : train::Callback {
      bool progress = true;
      void on_batch_end(train::Trainer& t, int64_t b, const train::LossOutput&) override {
        if (b == 1) progress = t.state().progress.has_value();
      }
    };
    auto probe = std::make_shared<Probe>();
    callbacks.insert(callbacks.begin(), probe);
    train::Trainer trainer(*net, train_loader, nullptr, train::classification(), c, callbacks);
    trainer.set_data_parallel(&dp);
    CHECK(trainer.is_main_process());
    CHECK_THROWS_WITH_AS(trainer.fit(), doctest::Contains("CrashAt"), RuntimeError);
    CHECK_FALSE(probe->progress);
  }
  const train::ModuleCheckpoint saved = train::read_module_checkpoint(path);
  REQUIRE(saved.trainer_state->progress.has_value());
  const std::vector<train::PassSums>& sums = saved.trainer_state->progress->sums;
  REQUIRE(sums.size() == 2);
  CHECK(sums[0].samples == 16);
  CHECK(sums[1].samples == 32);
  CHECK(sums[1].task == 2 * sums[0].task);

  // Resumed by one process: its pass starts from both ranks' total (48 samples before batch 3).
  struct FirstBatch : train::Callback {
    int64_t first = -1;
    void on_batch_start(train::Trainer&, int64_t b) override {
      if (first < 0) first = b;
    }
  };
  auto first = std::make_shared<FirstBatch>();
  int64_t samples = 0;
  auto net2 = mlp_with_dropout();
  train::Trainer single(*net2, train_loader, nullptr, train::classification(), c, {first});
  single.load_checkpoint(path);
  single.set_metrics_reducer([&](const train::Metrics& m, int64_t n) {
    samples = n;
    return m;
  });
  single.fit();
  CHECK(first->first == 2);
  CHECK(samples == 48 + 60 - 16);  // the two ranks' 48, then batches 3..8 (44 samples)

  // A rank other than 0 only sees a DataParallel of rank 1: it writes nothing.
  TwoRanks second(1);
  auto net3 = mlp_with_dropout();
  train::Trainer other(*net3, train_loader, nullptr, train::classification(), c);
  other.set_data_parallel(&second);
  CHECK_FALSE(other.is_main_process());
}
