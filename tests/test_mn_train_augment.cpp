// mn-train's --augment, --val-split and --label-smoothing end to end on a few hundred Fashion-MNIST
// images: the run config records them, --resume restores and checks them (1 + 1 epochs = 2 with
// augmentation on), metrics.csv reports the validation split's val_* columns, the test set is measured
// once, and the smoothed loss is the one trained and reported.
// Skipped with a message when the binary or the data set is missing (tests/mn_train_exe.h).
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "nn/safetensors.h"
#include "tests/mn_train_exe.h"
#include "tests/run_command.h"
#include "tests/temp_dir.h"

using namespace mn;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const char* const kRun = "--target mlp --mlp-hidden 32 --strategy layerwise --latent-dim 16 --limit 300 "
                         "--batch-size 64 --seed 5 --threads 1 --json";

mn::testing::CommandResult run(const std::string& exe, const std::string& args) {
  return mn::testing::run_command(exe + " " + args);
}

json summary(const mn::testing::CommandResult& r) {
  INFO("mn-train output:\n" << r.all());
  REQUIRE(r.status == 0);
  json j;
  REQUIRE_NOTHROW(j = json::parse(r.last_line()));
  return j;
}

json config_of(const fs::path& checkpoint) {
  const safetensors::File f = safetensors::load(checkpoint.string());
  REQUIRE(f.metadata.count("config") == 1);
  return json::parse(f.metadata.at("config"));
}

std::string first_line(const fs::path& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::vector<float> latents(const fs::path& checkpoint) {
  const safetensors::File f = safetensors::load(checkpoint.string());
  std::vector<float> all;
  for (const auto& e : f.tensors)
    if (e.name.rfind("latent/", 0) == 0) {
      const std::vector<float> v = e.tensor.to_vector<float>();
      all.insert(all.end(), v.begin(), v.end());
    }
  return all;
}

}  // namespace

TEST_CASE("mn-train: --augment changes the run, is recorded, and --resume continues it exactly") {
  std::string exe;
  if (!mn::testing::mn_train_ready(exe)) return;
  mn::testing::TempDir dir("mn_train_augment");
  const json plain = summary(run(exe, str(kRun, " --epochs 2 --out ", dir / "plain")));
  const json straight = summary(run(exe, str(kRun, " --epochs 2 --augment flip,crop --out ", dir / "straight")));
  CHECK(straight["augment"] == json::array({"crop", "flip"}));  // canonical order, whatever the command line's
  CHECK(config_of(dir / "straight/checkpoint.safetensors")["augment"] == json::array({"crop", "flip"}));
  CHECK(config_of(dir / "plain/checkpoint.safetensors")["augment"] == json::array());
  CHECK(latents(dir / "plain/checkpoint.safetensors") != latents(dir / "straight/checkpoint.safetensors"));
  // 1 epoch, then --resume with no run flags: the augmentation comes from the checkpoint.
  summary(run(exe, str(kRun, " --epochs 1 --augment crop,flip --out ", dir / "split")));
  const json resumed = summary(run(exe, str("--out ", dir / "split", " --resume --epochs 2 --threads 1 --json")));
  CHECK(resumed["epochs"] == 2);
  CHECK(resumed["augment"] == json::array({"crop", "flip"}));
  CHECK(latents(dir / "split/checkpoint.safetensors") == latents(dir / "straight/checkpoint.safetensors"));
  CHECK(resumed["test_accuracy"] == straight["test_accuracy"]);
  // A contradicting flag is refused with both values.
  const auto conflict = run(exe, str("--out ", dir / "split", " --resume --epochs 3 --augment flip"));
  CHECK(conflict.status != 0);
  CHECK(conflict.all().find("--augment: the run has [\"crop\",\"flip\"], the command line [\"flip\"]") !=
        std::string::npos);
  const auto unknown = run(exe, str(kRun, " --epochs 1 --augment rotate --out ", dir / "bad"));
  CHECK(unknown.status != 0);
  CHECK(unknown.all().find("rotate") != std::string::npos);
}

TEST_CASE("mn-train: --val-split validates on held-out training images and measures the test set once") {
  std::string exe;
  if (!mn::testing::mn_train_ready(exe)) return;
  mn::testing::TempDir dir("mn_train_val_split");
  const json j = summary(run(exe, str(kRun, " --epochs 2 --val-split 0.2 --out ", dir / "val")));
  CHECK(j.contains("val_accuracy"));
  CHECK(j.contains("val_loss"));
  CHECK(j.contains("test_loss"));
  CHECK(j["val_accuracy_per_epoch"].size() == 2);
  CHECK(j["val_loss_per_epoch"].size() == 2);
  CHECK(j["val_accuracy"] == j["val_accuracy_per_epoch"][1]);
  CHECK(j["test_accuracy"].get<double>() > 0.0);
  CHECK(first_line(dir / "val/metrics.csv") == "epoch,seconds,train_loss,train_accuracy,val_loss,val_accuracy,lr");
  CHECK(config_of(dir / "val/checkpoint.safetensors")["val_split"] == 0.2);
  // The validation figures are not the test set's: a run without the split validates on the test set,
  // whose last epoch is what it reports as test_accuracy.
  const json old = summary(run(exe, str(kRun, " --epochs 2 --out ", dir / "old")));
  CHECK(first_line(dir / "old/metrics.csv") == "epoch,seconds,train_loss,train_accuracy,test_loss,test_accuracy,lr");
  CHECK_FALSE(old.contains("val_accuracy"));
  CHECK(config_of(dir / "old/checkpoint.safetensors")["val_split"] == 0.0);
  // --resume keeps the split (and refuses another one).
  const json resumed = summary(run(exe, str("--out ", dir / "val", " --resume --epochs 3 --threads 1 --json")));
  CHECK(resumed["val_accuracy_per_epoch"].size() == 3);
  const auto conflict = run(exe, str("--out ", dir / "val", " --resume --epochs 4 --val-split 0.1"));
  CHECK(conflict.status != 0);
  CHECK(conflict.all().find("--val-split: the run has 0.2, the command line 0.1") != std::string::npos);
  for (const char* bad : {"1", "-0.1", "1.5"}) {
    INFO(bad);
    CHECK(run(exe, str(kRun, " --epochs 1 --val-split ", bad, " --out ", dir / "bad")).status != 0);
  }
}

// The first epoch's train_loss from metrics.csv (its third column).
double first_train_loss(const fs::path& metrics) {
  std::ifstream in(metrics);
  std::string header, row, field;
  std::getline(in, header);
  std::getline(in, row);
  std::istringstream fields(row);
  for (int i = 0; i < 3; ++i) std::getline(fields, field, ',');
  return std::stod(field);
}

// With smoothing F the target is F/10 on every class plus 1 - F on its own; at F = 1 the loss is the
// mean of -log p over the ten classes, which is at least ln 10 for any prediction (Jensen), while the
// same run without smoothing ends its first epoch well below ln 10.
TEST_CASE("mn-train: --label-smoothing is the loss trained and reported, and part of the run") {
  std::string exe;
  if (!mn::testing::mn_train_ready(exe)) return;
  mn::testing::TempDir dir("mn_train_label_smoothing");
  const char* const direct = "--target mlp --mlp-hidden 32 --strategy direct --limit 300 --batch-size 64 --lr 0.01 "
                             "--threads 1 --json --epochs 1";
  summary(run(exe, str(direct, " --out ", dir / "plain")));
  summary(run(exe, str(direct, " --label-smoothing 1 --out ", dir / "uniform")));
  const double ln10 = std::log(10.0);
  CHECK(first_train_loss(dir / "plain/metrics.csv") < ln10 - 0.2);
  CHECK(first_train_loss(dir / "uniform/metrics.csv") >= ln10 - 1e-4);
  CHECK(config_of(dir / "plain/checkpoint.safetensors")["label_smoothing"] == 0.0);
  CHECK(config_of(dir / "uniform/checkpoint.safetensors")["label_smoothing"] == 1.0);
  // A mapped run takes it too.
  summary(run(exe, str(kRun, " --epochs 1 --label-smoothing 1 --out ", dir / "mapped")));
  CHECK(first_train_loss(dir / "mapped/metrics.csv") >= ln10 - 1e-4);
  // --resume keeps it and refuses another value; out-of-range values are refused.
  summary(run(exe, str("--out ", dir / "mapped", " --resume --epochs 2 --threads 1 --json")));
  CHECK(config_of(dir / "mapped/checkpoint.safetensors")["label_smoothing"] == 1.0);
  const auto conflict = run(exe, str("--out ", dir / "mapped", " --resume --epochs 3 --label-smoothing 0.1"));
  CHECK(conflict.status != 0);
  CHECK(conflict.all().find("--label-smoothing: the run has 1.0, the command line 0.1") != std::string::npos);
  for (const char* bad : {"-0.1", "1.5", "nan"}) {
    INFO(bad);
    const auto refused = run(exe, str(kRun, " --epochs 1 --label-smoothing ", bad, " --out ", dir / "bad"));
    CHECK(refused.status != 0);
    CHECK(refused.all().find("--label-smoothing") != std::string::npos);
  }
}

TEST_CASE("mn-train: a checkpoint from before --augment, --val-split and --label-smoothing resumes with them off") {
  std::string exe;
  if (!mn::testing::mn_train_ready(exe)) return;
  mn::testing::TempDir dir("mn_train_augment_old");
  const fs::path out = dir / "run";
  summary(run(exe, str(kRun, " --epochs 1 --out ", out)));
  const fs::path checkpoint = out / "checkpoint.safetensors";
  {
    safetensors::File f = safetensors::load(checkpoint.string());
    json config = json::parse(f.metadata.at("config"));
    config.erase("augment");
    config.erase("val_split");
    config.erase("label_smoothing");
    f.metadata["config"] = config.dump();
    safetensors::NamedTensors tensors;
    for (const auto& e : f.tensors) tensors.emplace_back(e.name, e.tensor);
    safetensors::save(checkpoint.string(), tensors, f.metadata);
  }
  const json resumed = summary(run(exe, str("--out ", out, " --resume --epochs 2 --threads 1 --json")));
  CHECK(resumed["epochs"] == 2);
  CHECK_FALSE(resumed.contains("augment"));
  CHECK(config_of(checkpoint)["augment"] == json::array());
  CHECK(config_of(checkpoint)["val_split"] == 0.0);
  CHECK(config_of(checkpoint)["label_smoothing"] == 0.0);
}
