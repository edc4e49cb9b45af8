// mn-train under mn-run (label dist): data-parallel training over Gloo on 127.0.0.1 against one process,
// the trainer's metrics-reducer hook it relies on, and the --backend errors.
//
// Equivalence: the DistributedSampler gives rank r positions r, r + 2, r + 4, ... of the permutation one
// process with the same seed uses, so batch k of 2 ranks x B is exactly batch k of one process with 2B
// (512 samples: every batch full). The DDP gradient is the mean of the two per-rank means = the mean over
// 2B, so the runs agree up to float rounding of the sums (checked to 1e-5 relative on the latents after
// 8 Adam steps; the accuracies to one test image). Resume under DDP is bitwise (a sum of two values is
// commutative, so the ranks' reductions are deterministic).
//
// The binaries come from compile definitions (MN_TRAIN_EXE, MN_RUN_EXE); the cases that need
// Fashion-MNIST are skipped with a message when it is missing.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/random.h"
#include "dist/process_group.h"
#include "mapping/trainer.h"
#include "nn/data/fashion_mnist.h"
#include "nn/layers.h"
#include "nn/safetensors.h"
#include "tests/run_command.h"
#include "tests/temp_dir.h"

using namespace mn;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using mn::testing::TempDir;

bool have_data() {
  const fs::path root = data::default_fashion_mnist_root();
  return fs::exists(root / "train-images-idx3-ubyte.gz") || fs::exists(root / "train-images-idx3-ubyte");
}

using mn::testing::CommandResult;
using mn::testing::nonempty_lines;

CommandResult run(const std::string& command) { return mn::testing::run_command(command); }

const std::string kTrain = MN_TRAIN_EXE;
const std::string kRun = MN_RUN_EXE;

std::string ddp(int nproc, const std::string& args) {
  return str(kRun, " --nproc-per-node ", nproc, " ", kTrain, " --backend gloo ", args);
}

// The JSON summary of a --json run: the last stdout line, and the only one that is a JSON object (the
// others are rank 0's epoch lines, one per epoch).
json only_json_line(const CommandResult& r, int64_t epochs_run) {
  INFO("output:\n" << r.all());
  REQUIRE(r.status == 0);
  const auto lines = nonempty_lines(r.out);
  size_t objects = 0;
  for (const auto& line : lines) objects += json::accept(line) && json::parse(line).is_object();
  CHECK(objects == 1);
  CHECK(lines.size() == static_cast<size_t>(epochs_run) + 1);  // no line from rank 1
  REQUIRE(!lines.empty());
  json j;
  REQUIRE_NOTHROW(j = json::parse(lines.back()));
  return j;
}

size_t csv_rows(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return nonempty_lines(ss.str()).size();
}

std::map<std::string, std::vector<float>> tensors_with_prefix(const std::string& path, const std::string& prefix) {
  std::map<std::string, std::vector<float>> out;
  for (const auto& e : safetensors::load(path).tensors)
    if (e.name.rfind(prefix, 0) == 0 && e.tensor.dtype() == DType::f32) out[e.name] = e.tensor.to_vector<float>();
  return out;
}

// The largest element difference between two files' tensors of the same names: absolute, or relative to
// each tensor's largest magnitude.
double largest_difference(const std::map<std::string, std::vector<float>>& a,
                          const std::map<std::string, std::vector<float>>& b, bool relative) {
  REQUIRE(b.size() == a.size());
  double worst = 0;
  for (const auto& [name, va] : a) {
    REQUIRE(b.count(name) == 1);
    const std::vector<float>& vb = b.at(name);
    REQUIRE(va.size() == vb.size());
    double diff = 0, norm = 0;
    for (size_t i = 0; i < va.size(); ++i) {
      diff = std::max(diff, std::abs(static_cast<double>(va[i]) - vb[i]));
      norm = std::max(norm, std::abs(static_cast<double>(va[i])));
    }
    worst = std::max(worst, relative ? diff / norm : diff);
  }
  return worst;
}

const char* const kCommon = "--target cnn2 --strategy layerwise --latent-dim 16 --limit 512 --seed 3 --json";

}  // namespace

TEST_CASE("MappingTrainer: the metrics reducer sees each pass's sample count and its result is recorded") {
  manual_seed(7);
  mapping::MappingOptions options;
  options.latent_dim = 4;
  mapping::MappingModel model(std::make_shared<nn::Linear>(3, 2), options);
  Generator gen(5);
  data::DataLoader train(randn({10, 3}, {}, &gen), randn({10, 2}, {}, &gen), {.batch_size = 4});
  data::DataLoader val(randn({6, 3}, {}, &gen), randn({6, 2}, {}, &gen), {.batch_size = 4});

  struct Seen : mapping::Callback {
    std::vector<mapping::Metrics> epochs;
    void on_epoch_end(train::Trainer&, int64_t, const mapping::Metrics& m) override { epochs.push_back(m); }
  };
  auto seen = std::make_shared<Seen>();
  mapping::TrainerConfig config;
  config.max_epochs = 2;
  mapping::MappingTrainer trainer(model, train, &val, nullptr, config, {seen});
  std::vector<int64_t> samples;
  trainer.set_metrics_reducer([&](const mapping::Metrics& m, int64_t n) {
    samples.push_back(n);
    mapping::Metrics out;
    for (const auto& [key, value] : m) out[key] = 1000.0 + static_cast<double>(n);  // recognisable
    return out;
  });
  const mapping::History history = trainer.fit();
  CHECK(samples == std::vector<int64_t>{10, 6, 10, 6});  // train, validation per epoch
  REQUIRE(seen->epochs.size() == 2);
  CHECK(seen->epochs[1].at(mapping::history_keys::kTrainTaskLoss) == 1010.0);
  CHECK(seen->epochs[1].at(mapping::history_keys::kValTotalLoss) == 1006.0);
  CHECK(history.at(mapping::history_keys::kTrainTotalLoss) == std::vector<double>{1010.0, 1010.0});
  CHECK(history.at(mapping::history_keys::kValTaskLoss) == std::vector<double>{1006.0, 1006.0});
  CHECK(history.at(mapping::history_keys::kLearningRate).size() == 2);  // added after the reducer
}

TEST_CASE("mn-train --backend gloo: 2 ranks x batch 64 match one process with batch 128") {
  if (!have_data()) {
    MESSAGE("skipped: Fashion-MNIST not found in " << data::default_fashion_mnist_root());
    return;
  }
  TempDir dir("mn_train_ddp_test");
  const json single =
      only_json_line(run(str(kTrain, " ", kCommon, " --epochs 2 --batch-size 128 --out ", dir / "single")), 2);
  const CommandResult two = run(ddp(2, str(kCommon, " --epochs 2 --batch-size 64 --out ", dir / "ddp")));
  const json j = only_json_line(two, 2);
  CHECK(j["world_size"] == 2);
  CHECK(j["backend"] == "gloo");
  CHECK(j["global_batch_size"] == 128);
  CHECK(j["bytes_per_step"] == 4 * 16 * 4);  // the latents only: 4 groups x 16 floats
  CHECK(j["trainable_params"] == single["trainable_params"]);
  CHECK(j["epochs"] == 2);
  CHECK(std::abs(j["test_accuracy"].get<double>() - single["test_accuracy"].get<double>()) <= 1.0 / 512 + 1e-12);
  CHECK(std::abs(j["train_accuracy"].get<double>() - single["train_accuracy"].get<double>()) <= 1.0 / 512 + 1e-12);
  CHECK(csv_rows(dir / "ddp/metrics.csv") == 3);  // header + 2 epochs, written once

  const auto a = tensors_with_prefix(dir / "single/checkpoint.safetensors", "latent/");
  const auto b = tensors_with_prefix(dir / "ddp/checkpoint.safetensors", "latent/");
  REQUIRE(a.size() == 4);
  const double worst = largest_difference(a, b, /*relative=*/true);
  MESSAGE("largest relative latent difference, 2 ranks vs 1 process: " << worst);
  // Equal up to float summation order (per-rank batches of 64 against one of 128), which Adam amplifies
  // on near-zero gradient components: seen 1.1e-7 and 1.8e-5 for two mapper constructions of the same
  // run, and 1.3e-4 with the fused group kernels (issue 22: the latents' gradient summed in another
  // order; under 1e-4 with MN_FUSED_GROUPS=0). A sharding or averaging bug moves the latents by 1e-2
  // and more.
  CHECK(worst < 1e-3);

  SUBCASE("--resume under DDP: 1 + 1 epochs give the latents of 2 straight epochs") {
    only_json_line(run(ddp(2, str(kCommon, " --epochs 1 --batch-size 64 --out ", dir / "split"))), 1);
    const json resumed =
        only_json_line(run(ddp(2, str(kCommon, " --epochs 2 --batch-size 64 --resume --out ", dir / "split"))), 1);
    CHECK(resumed["epochs"] == 2);
    CHECK(resumed["test_accuracy"] == j["test_accuracy"]);
    CHECK(tensors_with_prefix(dir / "split/checkpoint.safetensors", "latent/") == b);
    CHECK(tensors_with_prefix(dir / "split/checkpoint.safetensors", "optimizer/") ==
          tensors_with_prefix(dir / "ddp/checkpoint.safetensors", "optimizer/"));
    CHECK(csv_rows(dir / "split/metrics.csv") == 3);
  }
  SUBCASE("a single-process checkpoint resumes under DDP with the same global batch") {
    only_json_line(run(str(kTrain, " ", kCommon, " --epochs 1 --batch-size 128 --out ", dir / "mixed")), 1);
    const json resumed =
        only_json_line(run(ddp(2, str(kCommon, " --epochs 2 --batch-size 64 --resume --out ", dir / "mixed"))), 1);
    CHECK(resumed["epochs"] == 2);
    const CommandResult other = run(ddp(2, str(kCommon, " --epochs 3 --batch-size 128 --resume --out ", dir / "mixed")));
    CHECK(other.status != 0);
    CHECK(other.all().find("--batch-size: the run has 128, the command line 256") != std::string::npos);
  }
}

TEST_CASE("mn-train --backend gloo --strategy direct: 2 ranks x batch 64 match one process with batch 128") {
  if (!have_data()) {
    MESSAGE("skipped: Fashion-MNIST not found in " << data::default_fashion_mnist_root());
    return;
  }
  TempDir dir("mn_train_ddp_direct");
  const std::string common = "--target mlp --mlp-hidden 16 --strategy direct --limit 512 --seed 3 --json --epochs 2";
  const json single = only_json_line(run(str(kTrain, " ", common, " --batch-size 128 --out ", dir / "single")), 2);
  const json two = only_json_line(run(ddp(2, str(common, " --batch-size 64 --out ", dir / "ddp"))), 2);
  CHECK(two["world_size"] == 2);
  CHECK(two["bytes_per_step"] == 4 * single["trainable_params"].get<int64_t>());  // every weight travels
  CHECK(std::abs(two["test_accuracy"].get<double>() - single["test_accuracy"].get<double>()) <= 1.0 / 512 + 1e-12);
  // The exported weights agree up to float summation order.
  const auto a = tensors_with_prefix(dir / "single/weights.safetensors", "");
  const auto b = tensors_with_prefix(dir / "ddp/weights.safetensors", "");
  REQUIRE(a.size() == 4);
  const double worst = largest_difference(a, b, /*relative=*/false);
  MESSAGE("largest weight difference, 2 ranks vs 1 process: " << worst);
  CHECK(worst < 1e-4);
}

TEST_CASE("mn-train --backend: clear errors") {
  TempDir dir("mn_train_ddp_test");
  const std::string small = str("--limit 64 --epochs 1 --out ", dir / "x");
  {
    const CommandResult r = run(str(kTrain, " --backend ucc ", small));
    INFO(r.all());
    CHECK(r.status != 0);
    CHECK(r.all().find("--backend 'ucc' is not supported; use gloo (CPU), nccl (CUDA) or mpi (CPU, under mpirun)") !=
          std::string::npos);
  }
  {
    const CommandResult r = run(str(kRun, " --nproc-per-node 2 ", kTrain, " --backend bogus ", small));
    INFO(r.all());
    CHECK(r.status != 0);
    CHECK(r.all().find("mn-train: rank 0: --backend 'bogus' is not supported") != std::string::npos);
    CHECK(r.all().find("mn-train: rank 1: --backend 'bogus' is not supported") != std::string::npos);
    CHECK(r.all().find("mn-run: failed") != std::string::npos);
  }
  {  // without the launcher's variables
    const CommandResult r = run(str("env -u RANK -u WORLD_SIZE ", kTrain, " --backend gloo ", small));
    INFO(r.all());
    CHECK(r.status != 0);
    CHECK(r.all().find("runs one process per rank under a launcher (mn-run") != std::string::npos);
    CHECK(r.all().find(" is not set") != std::string::npos);
  }
  if (!dist::is_backend_available("nccl")) {
    for (const char* device : {"cpu", "cuda"}) {
      const CommandResult r = run(str(kRun, " --nproc-per-node 2 ", kTrain, " --backend nccl --device ", device, " ", small));
      INFO(r.all());
      CHECK(r.status != 0);
      CHECK(r.all().find("--backend nccl needs a CUDA build with NCCL, and this build has no CUDA") !=
            std::string::npos);
    }
  } else if (!cuda_available()) {
    const CommandResult r = run(str(kRun, " --nproc-per-node 2 ", kTrain, " --backend nccl --device cuda ", small));
    INFO(r.all());
    CHECK(r.status != 0);
    CHECK(r.all().find("CUDA is not available here") != std::string::npos);
  }
  {
    const CommandResult r = run(str(kRun, " --nproc-per-node 2 ", kTrain, " --backend gloo --device cuda ", small));
    INFO(r.all());
    CHECK(r.status != 0);
    CHECK(r.all().find("--backend gloo trains on the CPU") != std::string::npos);
  }
}

// ---- --backend mpi (builds with MPI; MN_MPIRUN_NP is "mpirun [flags] -n", from tests/dist/tests.cmake) ----

TEST_CASE("mn-train --backend mpi: errors") {
  TempDir dir("mn_train_mpi_errors");
  const std::string small = str("--limit 64 --epochs 1 --out ", dir / "x");
  const CommandResult r = run(str("env RANK=1 WORLD_SIZE=2 ", kTrain, " --backend mpi ", small));
  INFO(r.all());
  CHECK(r.status != 0);
  if (dist::is_backend_available("mpi"))  // one process without mpirun is rank 0 of 1
    CHECK(r.all().find("but MPI started this process as rank 0 of 1") != std::string::npos);
  else
    CHECK(r.all().find("backend 'mpi' is not available in this build (built without MPI") != std::string::npos);
}

#ifdef MN_MPIRUN_NP
// With 2 ranks every all-reduced value is the sum of the same two addends under either backend (a + b ==
// b + a in floating point), so the runs agree bit for bit; against one process up to summation order.
TEST_CASE("mn-train --backend mpi under mpirun: 2 ranks match mn-run over Gloo and one process") {
  if (!have_data()) {
    MESSAGE("skipped: Fashion-MNIST not found in " << data::default_fashion_mnist_root());
    return;
  }
  TempDir dir("mn_train_mpi_test");
  const std::string args = str(kCommon, " --epochs 2 --batch-size 64 --out ");
  only_json_line(run(str(kTrain, " ", kCommon, " --epochs 2 --batch-size 128 --out ", dir / "single")), 2);
  const json gloo = only_json_line(run(ddp(2, args + (dir / "gloo"))), 2);
  // No launcher variables of mn-run's: rank and size come from Open MPI.
  const json j = only_json_line(run(str("env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT ", MN_MPIRUN_NP,
                                        " 2 ", kTrain, " --backend mpi ", args, dir / "mpi")), 2);
  CHECK(j["world_size"] == 2);
  CHECK(j["backend"] == "mpi");
  CHECK(j["global_batch_size"] == 128);
  CHECK(j["bytes_per_step"] == gloo["bytes_per_step"]);
  CHECK(j["test_accuracy"] == gloo["test_accuracy"]);
  CHECK(j["train_accuracy"] == gloo["train_accuracy"]);
  const auto mpi = tensors_with_prefix(dir / "mpi/checkpoint.safetensors", "latent/");
  REQUIRE(mpi.size() == 4);
  CHECK(mpi == tensors_with_prefix(dir / "gloo/checkpoint.safetensors", "latent/"));
  CHECK(largest_difference(tensors_with_prefix(dir / "single/checkpoint.safetensors", "latent/"), mpi, true) < 1e-3);
  CHECK(csv_rows(dir / "mpi/metrics.csv") == 3);
}
#endif
