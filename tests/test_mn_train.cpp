// End to end: the mn-train example on 512 Fashion-MNIST images - the --json summary, the files it
// writes, and --resume (1 + 1 epochs give the same latents as 2 straight). The binary is looked up
// next to this test executable (<build>/examples/mn-train) or in $MN_TRAIN_EXE; the cases are skipped
// with a message when it or the data set is missing.
#include <algorithm>
#include <doctest/doctest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/device.h"
#include "core/error.h"
#include "kernels/factories.h"
#include "nn/data/fashion_mnist.h"
#include "nn/safetensors.h"
#include "tests/mn_train_exe.h"
#include "tests/run_command.h"
#include "tests/temp_dir.h"

using namespace mn;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using mn::testing::read_bytes;
using mn::testing::TempDir;

// Skips (with a message) unless both the binary and the data are there.
bool ready(std::string& exe) { return mn::testing::mn_train_ready(exe); }

using mn::testing::CommandResult;

CommandResult run(const std::string& exe, const std::string& args) {
  return mn::testing::run_command(exe + " " + args);
}

json summary(const CommandResult& r) {
  INFO("mn-train output:\n" << r.all());
  REQUIRE(r.status == 0);
  json j;
  REQUIRE_NOTHROW(j = json::parse(r.last_line()));
  for (const char* key : {"test_accuracy", "train_accuracy", "trainable_params", "target_params",
                          "compression_ratio", "epochs", "seconds", "steps_per_second"}) {
    INFO("key " << key);
    CHECK(j.contains(key));
  }
  return j;
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

size_t csv_rows(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  size_t rows = 0;
  while (std::getline(in, line))
    if (!line.empty()) ++rows;
  return rows;
}

// Tensors whose names start with prefix must be present in both files and bitwise equal.
void check_same_tensors(const std::string& a, const std::string& b, const std::string& prefix) {
  const safetensors::File fa = safetensors::load(a), fb = safetensors::load(b);
  size_t compared = 0;
  for (const auto& e : fa.tensors) {
    if (e.name.rfind(prefix, 0) != 0) continue;
    INFO("tensor " << e.name);
    REQUIRE(fb.contains(e.name));
    CHECK(e.tensor.sizes() == fb.at(e.name).sizes());
    if (e.tensor.dtype() == DType::f32)
      CHECK(e.tensor.to_vector<float>() == fb.at(e.name).to_vector<float>());
    else
      CHECK(e.tensor.to_vector<int64_t>() == fb.at(e.name).to_vector<int64_t>());
    ++compared;
  }
  CHECK(compared > 0);
}

const char* const kSmall = "--limit 512 --batch-size 128 --seed 3";

}  // namespace

TEST_CASE("mn-train: direct and layerwise runs print a JSON summary and write metrics and a checkpoint") {
  std::string exe;
  if (!ready(exe)) return;
  TempDir dir("mn_train_test");
  SUBCASE("direct") {
    const json j = summary(
        run(exe, str("--target cnn2 --strategy direct --epochs 1 --threads 1 --json ", kSmall, " --out ",
                     dir / "direct")));
    CHECK(j["cpu_threads"] == 1);
    CHECK(j["target_params"] == 108618);
    CHECK(j["trainable_params"] == 108618);
    CHECK(j["compression_ratio"].get<double>() == doctest::Approx(1.0));
    CHECK(j["epochs"] == 1);
    CHECK(j["test_accuracy"].get<double>() > 0.1);  // better than chance after 4 steps
    CHECK(j["steps_per_second"].get<double>() > 0);
    CHECK(csv_rows(dir / "direct/metrics.csv") == 2);
    CHECK(fs::exists(dir / "direct/checkpoint.safetensors"));
  }
  SUBCASE("layerwise") {
    const json j = summary(run(exe, str("--target cnn2 --strategy layerwise --latent-dim 32 --epochs 1 --json ",
                                        kSmall, " --out ", dir / "lwt")));
    CHECK(j["target_params"] == 108618);
    CHECK(j["trainable_params"] == 4 * 32);
    CHECK(j["cpu_threads"].get<int>() >= 1);
    CHECK(j["compression_ratio"].get<double>() == doctest::Approx(108618.0 / 128.0));
    CHECK(j["epochs"] == 1);
    CHECK(j["test_accuracy"].get<double>() >= 0.0);
    CHECK(csv_rows(dir / "lwt/metrics.csv") == 2);
    const safetensors::File ckpt = safetensors::load(dir / "lwt/checkpoint.safetensors");
    CHECK(ckpt.contains("latent/0"));
    CHECK(ckpt.contains("latent/7"));
    CHECK_FALSE(ckpt.contains("0.weight"));
  }
}

TEST_CASE("mn-train: 1 epoch + --resume 1 epoch gives the latents of 2 straight epochs") {
  std::string exe;
  if (!ready(exe)) return;
  TempDir dir("mn_train_test");
  SUBCASE("layerwise") {
    const std::string common = str("--target cnn2 --strategy layerwise --latent-dim 16 --json ", kSmall);
    const json straight = summary(run(exe, str(common, " --epochs 2 --out ", dir / "straight")));
    // The first process stops after epoch 1 (as if killed right after its checkpoint was written).
    summary(run(exe, str(common, " --epochs 1 --out ", dir / "split")));
    const auto inode = [&] {
      struct stat info {};
      return ::stat((dir / "split/metrics.csv").c_str(), &info) == 0 ? static_cast<uint64_t>(info.st_ino) : 0;
    };
    const uint64_t metrics_inode = inode();
    const json resumed = summary(run(exe, str(common, " --epochs 2 --resume --out ", dir / "split")));
    CHECK(resumed["epochs"] == 2);
    // The resumed run rewrote metrics.csv into a new file renamed over the old one: a kill during the
    // rewrite cannot leave it truncated (it used to be truncated and rewritten in place).
    CHECK(inode() != metrics_inode);
    check_same_tensors(dir / "straight/checkpoint.safetensors", dir / "split/checkpoint.safetensors",
                       "latent/");
    check_same_tensors(dir / "straight/checkpoint.safetensors", dir / "split/checkpoint.safetensors",
                       "optimizer/");
    CHECK(resumed["test_accuracy"] == straight["test_accuracy"]);
    CHECK(resumed["train_accuracy"] == straight["train_accuracy"]);
    CHECK(csv_rows(dir / "split/metrics.csv") == 3);

    // A resume with different run options is refused.
    const CommandResult bad = run(exe, str("--target cnn2 --strategy layerwise --latent-dim 8 --epochs 3 --resume ",
                                 kSmall, " --out ", dir / "split"));
    CHECK(bad.status != 0);
    CHECK(bad.all().find("--latent-dim: the run has 16, the command line 8") != std::string::npos);
  }
  SUBCASE("direct") {
    const std::string common = str("--target lenet --strategy direct --json ", kSmall);
    summary(run(exe, str(common, " --epochs 2 --out ", dir / "straight")));
    summary(run(exe, str(common, " --epochs 1 --out ", dir / "split")));
    summary(run(exe, str(common, " --epochs 2 --resume --out ", dir / "split")));
    check_same_tensors(dir / "straight/checkpoint.safetensors", dir / "split/checkpoint.safetensors", "");
  }
}

TEST_CASE("mn-train: --compile replays the steps and writes the checkpoint of the eager run, byte for byte") {
  std::string exe;
  if (!ready(exe)) return;
  TempDir dir("mn_train_test");
  for (const char* strategy : {"layerwise --latent-dim 16", "direct"}) {
    INFO("strategy " << strategy);
    // 512 images in batches of 200: two full batches and a partial one (a second signature).
    const std::string common = str("--target cnn2 --epochs 2 --limit 512 --batch-size 200 --seed 3 --strategy ", strategy);
    const std::string name = std::string(strategy).substr(0, 6);
    const json eager = summary(run(exe, str(common, " --json --out ", dir / (name + "_eager"))));
    const json compiled = summary(run(exe, str(common, " --json --compile --out ", dir / (name + "_compiled"))));
    CHECK(compiled["test_accuracy"] == eager["test_accuracy"]);
    REQUIRE(compiled.contains("compiled"));
    const std::string report = compiled["compiled"].get<std::string>();
    INFO(report);
    CHECK(report.find("6 calls, 2 captures, 4 replays, 0 eager") != std::string::npos);
    const std::string bytes_a = read_bytes(dir / (name + "_eager/checkpoint.safetensors"));
    CHECK(!bytes_a.empty());
    CHECK(bytes_a == read_bytes(dir / (name + "_compiled/checkpoint.safetensors")));
  }
}

TEST_CASE("mn-train: --stream-layers trains the same run (the same checkpoint bytes)") {
  std::string exe;
  if (!ready(exe)) return;
  TempDir dir("mn_train_test");
  const std::string common = "--target cnn2 --epochs 1 --limit 512 --batch-size 200 --seed 3 --strategy layerwise "
                             "--latent-dim 16 --json --out ";
  const json plain = summary(run(exe, str(common, dir / "plain")));
  const json streamed = summary(run(exe, str(common, dir / "streamed", " --stream-layers")));
  CHECK(streamed["test_accuracy"] == plain["test_accuracy"]);
  const std::string bytes_a = read_bytes(dir / "plain/checkpoint.safetensors");
  CHECK(!bytes_a.empty());
  CHECK(bytes_a == read_bytes(dir / "streamed/checkpoint.safetensors"));
}

TEST_CASE("mn-train: Ctrl-C keeps the completed epochs, prints the summary, exits 130, and --resume goes on") {
  std::string exe;
  if (!ready(exe)) return;
  TempDir dir("mn_train_sigint");
  for (const char* strategy : {"layerwise", "direct"}) {
    INFO("strategy " << strategy);
    const fs::path out = dir / strategy;
    const std::string args = str("--target cnn2 --strategy ", strategy,
                                 std::string(strategy) == "direct" ? "" : " --latent-dim 32", " --threads 1 --json ",
                                 kSmall, " --out ", out.string());
    // Job control (set -m), so that the background run does not start with SIGINT ignored; the signal
    // goes once two epochs are in metrics.csv (header + 2 rows), long before the 10,000th.
    const std::string script = str(
        "set -m; ", exe, " ", args, " --epochs 10000 >", (out / "stdout").string(), " 2>", (out / "stderr").string(),
        " & pid=$!; for i in $(seq 1200); do [ \"$(cat ", (out / "metrics.csv").string(),
        " 2>/dev/null | wc -l)\" -ge 3 ] && break; sleep 0.05; done; kill -INT $pid; wait $pid; echo status=$?");
    fs::create_directories(out);
    const CommandResult r = mn::testing::run_command("bash -c '" + script + "'");
    const std::string stdout_text = read_bytes((out / "stdout").string());
    const std::string stderr_text = read_bytes((out / "stderr").string());
    INFO("script output: " << r.all() << "\nmn-train stdout:\n" << stdout_text << "\nstderr:\n" << stderr_text);
    CHECK(r.out.find("status=130") != std::string::npos);
    // The graceful path, not death by the signal (which also gives 130): the summary and the message.
    CHECK(stderr_text.find("interrupted (SIGINT)") != std::string::npos);
    const std::vector<std::string> lines = mn::testing::nonempty_lines(stdout_text);
    REQUIRE(!lines.empty());
    json j;
    REQUIRE_NOTHROW(j = json::parse(lines.back()));
    CHECK(j["interrupted"] == true);
    const int64_t epochs = j["epochs"].get<int64_t>();
    CHECK(epochs >= 2);
    CHECK(epochs < 10000);
    CHECK(csv_rows(out / "metrics.csv") == static_cast<size_t>(epochs) + 1);

    // The checkpoint holds those epochs: one more with --resume completes normally.
    const json resumed = summary(run(exe, str(args, " --epochs ", epochs + 1, " --resume")));
    CHECK(resumed["epochs"] == epochs + 1);
    CHECK(resumed["interrupted"] == false);
    CHECK(csv_rows(out / "metrics.csv") == static_cast<size_t>(epochs) + 2);
  }
}

TEST_CASE("mn-train: unavailable CUDA and a missing checkpoint are clear errors") {
  std::string exe;
  if (!ready(exe)) return;
  TempDir dir("mn_train_test");
  if (!cuda_available()) {
    const CommandResult r = run(exe, str("--device cuda --epochs 1 ", kSmall, " --out ", dir / "cuda"));
    CHECK(r.status != 0);
    CHECK(r.all().find("CUDA is not available") != std::string::npos);
  }
  const CommandResult r = run(exe, str("--epochs 1 --resume ", kSmall, " --out ", dir / "empty"));
  CHECK(r.status != 0);
  CHECK(r.all().find("checkpoint not found") != std::string::npos);
}

TEST_CASE("mn-train: flag values it cannot use are errors that name the flag and the value") {
  std::string exe;
  if (!ready(exe)) return;
  TempDir dir("mn_train_test");
  struct Case {
    const char* flags;
    const char* message;
  };
  // Before: --lr nan trained at the default lr, --seed -1 at seed 2^64 - 1, and --batch-size 0 was
  // "not in range" of a 309-digit bound.
  for (const Case& c : {Case{"--lr nan", "--lr: expected a finite number above 0, got 'nan'"},
                        Case{"--lr -0.5", "--lr: expected a finite number above 0, got '-0.5'"},
                        Case{"--seed -1", "--seed: expected a whole number from 0 to 18446744073709551615, got '-1'"},
                        Case{"--epochs -1", "--epochs: expected a whole number of at least 0, got '-1'"},
                        Case{"--batch-size 0", "--batch-size: expected a whole number of at least 1, got '0'"},
                        Case{"--batch-size 1.5", "--batch-size: expected a whole number of at least 1, got '1.5'"},
                        Case{"--limit -3", "--limit: expected a whole number of at least 0, got '-3'"}}) {
    INFO("flags " << c.flags);
    const CommandResult r = run(exe, str(c.flags, " --out ", dir / "never"));
    CHECK(r.status != 0);
    CHECK(r.all().find(c.message) != std::string::npos);
    INFO(r.all());
    CHECK_FALSE(fs::exists(dir / "never"));
  }
  // An --out that cannot hold files is found before any training (it is a regular file here).
  std::ofstream(dir / "a_file") << "x";
  const CommandResult r = run(exe, str("--epochs 1 ", kSmall, " --out ", dir / "a_file"));
  CHECK(r.status != 0);
  CHECK(r.all().find(str("--out ", dir / "a_file", ": cannot create the directory")) != std::string::npos);
  CHECK(r.all().find("epoch 1/1") == std::string::npos);
}

TEST_CASE("mn-train: --resume refuses a checkpoint with no trainer state or damaged metadata") {
  std::string exe;
  if (!ready(exe)) return;
  TempDir dir("mn_train_test");
  // A mapped run's checkpoint with its trainer state removed (as save_checkpoint writes it without a
  // trainer): before, --resume restarted at epoch 0 and rewrote metrics.csv.
  const fs::path mapped = dir / "mapped";
  REQUIRE(run(exe, str("--strategy layerwise --epochs 1 --json ", kSmall, " --out ", mapped)).status == 0);
  const fs::path ckpt = mapped / "checkpoint.safetensors";
  {
    safetensors::File f = safetensors::load(ckpt.string());
    safetensors::NamedTensors kept;
    for (const auto& e : f.tensors)
      if (e.name.rfind("optimizer/", 0) != 0) kept.emplace_back(e.name, e.tensor);
    f.metadata.erase("trainer_state");
    safetensors::save(ckpt.string(), kept, f.metadata);
  }
  const std::string metrics_before = read_text(mapped / "metrics.csv");
  CommandResult r = run(exe, str("--strategy layerwise --epochs 2 --resume ", kSmall, " --out ", mapped));
  CHECK(r.status != 0);
  CHECK(r.all().find("no trainer state") != std::string::npos);
  CHECK(read_text(mapped / "metrics.csv") == metrics_before);

  // A direct run's checkpoint whose metadata lost a key, or holds text that is not JSON: the file and the
  // key are named (before: "map::at" or a raw JSON parser message).
  const fs::path direct = dir / "direct";
  REQUIRE(run(exe, str("--strategy direct --epochs 1 --json ", kSmall, " --out ", direct)).status == 0);
  const fs::path dckpt = direct / "checkpoint.safetensors";
  const safetensors::File original = safetensors::load(dckpt.string());
  safetensors::NamedTensors tensors;
  for (const auto& e : original.tensors) tensors.emplace_back(e.name, e.tensor);
  for (const char* key : {"format", "schema_version", "trainer_state", "config"}) {
    for (bool remove : {true, false}) {
      INFO("key " << key << (remove ? " removed" : " not JSON"));
      safetensors::StringMap meta = original.metadata;
      if (remove)
        meta.erase(key);
      else
        meta[key] = "{not json";
      safetensors::save(dckpt.string(), tensors, meta);
      r = run(exe, str("--strategy direct --epochs 2 --resume ", kSmall, " --out ", direct));
      CHECK(r.status != 0);
      INFO(r.all());
      CHECK(r.all().find(dckpt.string()) != std::string::npos);
      CHECK(r.all().find(str("'", key, "'")) != std::string::npos);
    }
  }
}

TEST_CASE("mn-train: --epochs 0 evaluates without training (it printed 'test accuracy nan%')") {
  std::string exe;
  if (!ready(exe)) return;
  TempDir dir("mn_train_test");
  for (const char* strategy : {"layerwise --latent-dim 16", "direct"}) {
    INFO("strategy " << strategy);
    const CommandResult plain = run(exe, str("--strategy ", strategy, " --epochs 0 ", kSmall, " --out ", dir / "plain"));
    INFO(plain.all());
    CHECK(plain.status == 0);
    CHECK(plain.all().find("nan") == std::string::npos);
    CHECK(plain.all().find("without training (0 epochs)") != std::string::npos);
    const json j = summary(run(exe, str("--strategy ", strategy, " --epochs 0 --json ", kSmall, " --out ", dir / "json")));
    CHECK(j["epochs"] == 0);
    REQUIRE(j["test_accuracy"].is_number());
    CHECK(j["test_accuracy"].get<double>() > 0.0);
    CHECK(j["test_accuracy"].get<double>() < 0.5);  // untrained: about one class in ten
  }
}

TEST_CASE("mn-train: a diverging run stops naming the step; --on-nonfinite warn trains on") {
  std::string exe;
  if (!ready(exe)) return;
  TempDir dir("mn_train_test");
  for (const char* strategy : {"direct", "layerwise"}) {
    CAPTURE(strategy);
    // lr 1e12 makes the loss NaN at the second step
    const std::string args =
        str("--target mlp --strategy ", strategy, " --lr 1e12 --epochs 1 --threads 1 ", kSmall, " --out ");
    const CommandResult stop = run(exe, args + (dir / (std::string(strategy) + "_stop")));
    INFO(stop.all());
    CHECK(stop.status != 0);
    CHECK(stop.all().find("non-finite") != std::string::npos);
    CHECK(stop.all().find("epoch 1/1, batch 2 (global step 1") != std::string::npos);
    const CommandResult warn =
        run(exe, args + (dir / (std::string(strategy) + "_warn")) + " --on-nonfinite warn");
    INFO(warn.all());
    CHECK(warn.status == 0);
    CHECK(warn.all().find("warning: ") != std::string::npos);
  }
  CHECK(run(exe, "--on-nonfinite ignore").status != 0);
}

TEST_CASE("mn-train: --resume refuses optimizer state that does not fit its parameters, naming file and key") {
  // A 0-d exp_avg used to be restored, and Adam then wrote a whole parameter's moments into 4 bytes.
  std::string exe;
  if (!ready(exe)) return;
  TempDir dir("mn_train_test");
  for (const char* strategy : {"direct", "layerwise --latent-dim 16"}) {
    CAPTURE(strategy);
    const std::string common = str("--target cnn2 --strategy ", strategy, " --json ", kSmall);
    const fs::path out = dir / (std::string(strategy) == "direct" ? "direct" : "layerwise");
    summary(run(exe, str(common, " --epochs 1 --out ", out)));
    const std::string checkpoint = (out / "checkpoint.safetensors").string();
    safetensors::File file = safetensors::load(checkpoint);
    safetensors::NamedTensors tensors;
    for (const auto& e : file.tensors)
      tensors.emplace_back(e.name, e.name == "optimizer/state.0.exp_avg" ? scalar_tensor(0.0) : e.tensor);
    safetensors::save(checkpoint, tensors, file.metadata);
    const std::string before = read_bytes(checkpoint);
    const CommandResult r = run(exe, str(common, " --epochs 2 --resume --out ", out));
    INFO(r.all());
    CHECK(r.status != 0);
    CHECK(r.all().find(checkpoint) != std::string::npos);
    CHECK(r.all().find("'state.0.exp_avg' has shape []") != std::string::npos);
    CHECK(read_bytes(checkpoint) == before);
  }
}

TEST_CASE("mn-train: a latent dim whose sizes overflow int64 is a clear error, not a wrapped guard or bad_alloc") {
  std::string exe;
  if (!ready(exe)) return;
  TempDir dir("mn_train_test");
  // 84914745327985664 x N wrapped negative and passed the slvt projection guard; 2^62 ended in a bare
  // std::bad_alloc.
  for (const char* dim : {"84914745327985664", "4611686018427387904"}) {
    const CommandResult r = run(exe, str("--strategy slvt --latent-dim ", dim, " --epochs 1 ", kSmall, " --out ",
                                         dir / "huge"));
    INFO("latent dim " << dim << ", output:\n" << r.all());
    CHECK(r.status != 0);
    CHECK(r.all().find("latent_dim " + std::string(dim)) != std::string::npos);
    CHECK(r.all().find("int64") != std::string::npos);
    CHECK(r.all().find("bad_alloc") == std::string::npos);
  }
}

TEST_CASE("mn-train: --resume takes the run's options from its checkpoint; flags must agree with them") {
  std::string exe;
  if (!ready(exe)) return;
  TempDir dir("mn_train_resume_config");
  // Options that all differ from the defaults, so a resume that fell back to a default would diverge.
  const std::string run_options =
      "--target mlp --mlp-hidden 16 --strategy grouped --latent-dim 8 --batch-size 64 --limit 256 --seed 3 "
      "--optimizer adamw --lr 0.02 --mapping-loss";
  const json straight = summary(run(exe, str(run_options, " --epochs 2 --threads 1 --json --out ", dir / "straight")));
  REQUIRE(summary(run(exe, str(run_options, " --epochs 1 --threads 1 --json --out ", dir / "split")))["epochs"] == 1);
  // Only --out, --resume and the new total: everything else comes from the checkpoint.
  const json resumed = summary(run(exe, str("--out ", dir / "split", " --resume --epochs 2 --threads 1 --json")));
  CHECK(resumed["epochs"] == 2);
  CHECK(resumed["test_accuracy"] == straight["test_accuracy"]);
  CHECK(resumed["target"] == "mlp");
  CHECK(resumed["strategy"] == "grouped");
  check_same_tensors((fs::path(dir / "straight") / "checkpoint.safetensors").string(),
                     (fs::path(dir / "split") / "checkpoint.safetensors").string(), "latent/");

  // Without --epochs the run goes to the epochs it was started with: here it has them all, so it
  // only evaluates.
  const json again = summary(run(exe, str("--out ", dir / "straight", " --resume --threads 1 --json")));
  CHECK(again["epochs"] == 2);
  CHECK(again["test_accuracy"] == straight["test_accuracy"]);

  // A flag that contradicts the run names the flag and both values; one that agrees is fine.
  const CommandResult conflict =
      run(exe, str("--out ", dir / "straight", " --resume --batch-size 32 --optimizer adam --target mlp"));
  CHECK(conflict.status != 0);
  INFO(conflict.all());
  CHECK(conflict.all().find("--batch-size: the run has 64, the command line 32") != std::string::npos);
  CHECK(conflict.all().find("--optimizer: the run has \"adamw\", the command line \"adam\"") != std::string::npos);
  CHECK(conflict.all().find("--target") == std::string::npos);
}

TEST_CASE("mn-train: the target's weights are exported alone, for mapped and direct runs") {
  std::string exe;
  if (!ready(exe)) return;
  TempDir dir("mn_train_export");
  for (const char* strategy : {"layerwise --latent-dim 8", "direct"}) {
    INFO("strategy " << strategy);
    const fs::path out = dir / (std::string(strategy) == "direct" ? "direct" : "mapped");
    const json j = summary(
        run(exe, str("--target mlp --mlp-hidden 16 --strategy ", strategy, " --epochs 1 --json ", kSmall, " --out ", out)));
    REQUIRE(j.contains("weights"));
    CHECK(j["weights"] == (out / "weights.safetensors").string());
    const safetensors::File weights = safetensors::load((out / "weights.safetensors").string());
    std::vector<std::string> names;
    for (const auto& e : weights.tensors) names.push_back(e.name);
    std::sort(names.begin(), names.end());
    // The mlp target's state dict, under its own names: nothing from the optimizer or the mapping.
    CHECK(names == std::vector<std::string>{"1.bias", "1.weight", "3.bias", "3.weight"});
    if (std::string(strategy) == "direct")
      check_same_tensors((out / "weights.safetensors").string(), (out / "checkpoint.safetensors").string(), "");
  }
  // --export FILE puts them elsewhere.
  const fs::path file = fs::path(dir / "elsewhere") / "w.safetensors";
  summary(run(exe, str("--target mlp --mlp-hidden 16 --strategy direct --epochs 1 --json ", kSmall, " --out ", dir / "x",
                       " --export ", file)));
  CHECK(fs::exists(file));
}
