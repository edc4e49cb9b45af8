// mn-train --checkpoint-every and --auto-resume end to end (a small MLP, layerwise, on 640 Fashion-MNIST
// images, batch 64: 10 steps per epoch, 2 epochs): a run stopped after a mid-epoch checkpoint - by the hidden
// --crash-after-step hook at an exact step, or by SIGKILL from outside as soon as a checkpoint appears -
// and resumed ends with the uninterrupted run's checkpoint and weights, byte for byte, and its metrics.csv
// (the seconds column aside). The binary and the data are looked up as in test_mn_train.cpp; the cases are
// skipped with a message when either is missing.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "nn/safetensors.h"
#include "tests/checkpoint_run_support.h"
#include "tests/mn_train_exe.h"
#include "tests/run_command.h"
#include "tests/temp_dir.h"

using namespace mn;
namespace fs = std::filesystem;
using json = nlohmann::json;
using mn::testing::CommandResult;
using mn::testing::read_bytes;
using mn::testing::check_same_run;
using mn::testing::without_seconds;
using mn::testing::TempDir;

namespace {

const char* const kRun = "--target mlp --mlp-hidden 32 --strategy layerwise --latent-dim 16 --batch-size 64 --seed 3 --epochs 2";

CommandResult run(const std::string& exe, const std::string& args) {
  return mn::testing::run_command(exe + " " + args);
}

void require_ok(const CommandResult& r) {
  INFO("mn-train output:\n" << r.all());
  REQUIRE(r.status == 0);
}

size_t rows(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  size_t n = 0;
  while (std::getline(in, line)) n += !line.empty();
  return n;
}


}  // namespace

TEST_CASE("mn-train --checkpoint-every: stopped after step 14 and resumed, the run ends as the uninterrupted one") {
  std::string exe;
  if (!mn::testing::mn_train_ready(exe)) return;
  TempDir dir("mn_train_ckpt");
  const std::string common = str(kRun, " --limit 640");
  require_ok(run(exe, str(common, " --json --out ", dir / "straight")));
  CHECK(mn::testing::checkpoint_trainer_state(dir / "straight/checkpoint.safetensors").at("global_step") == 20);

  // Saves at steps 3, 6, 9 (epoch 1), the epoch end (10), then 12 (epoch 2 after batch 2); dies at 14.
  const CommandResult crashed =
      run(exe, str(common, " --json --checkpoint-every 3 --crash-after-step 14 --out ", dir / "crashed"));
  CHECK(crashed.status != 0);
  const std::string checkpoint = dir / "crashed/checkpoint.safetensors";
  CHECK(safetensors::load(checkpoint).metadata.at("schema_version") == "2");
  const json state = mn::testing::checkpoint_trainer_state(checkpoint);
  CHECK(state.at("epoch") == 1);
  CHECK(state.at("global_step") == 12);
  CHECK(state.at("progress").at("batches") == 2);
  CHECK(state.at("progress").at("sums").size() == 1);
  CHECK(state.at("progress").at("sums")[0].at("samples") == 128);
  CHECK(rows(dir / "crashed/metrics.csv") == 2);  // header + epoch 1

  // The flag does not define the run: the resume takes another value.
  const CommandResult resumed = run(exe, str("--out ", dir / "crashed", " --resume --checkpoint-every 4"));
  require_ok(resumed);
  CHECK(resumed.out.find("in epoch 2 after batch 2 (step 12)") != std::string::npos);
  check_same_run(dir / "crashed", dir / "straight");
  CHECK(rows(dir / "crashed/metrics.csv") == 3);

  {  // --auto-resume: one command line for the first start and the restart
    const std::string line = str(common, " --json --auto-resume --checkpoint-every 3 --crash-after-step 14 --out ",
                                 dir / "auto");
    CHECK(run(exe, line).status != 0);  // started afresh (no checkpoint), crashed at step 14
    CHECK(mn::testing::checkpoint_trainer_state(dir / "auto/checkpoint.safetensors").at("global_step") == 12);
    // A restart by mn-run --max-restarts: the same command line, TORCHELASTIC_RESTART_COUNT=1, which also
    // disarms the crash hook.
    const CommandResult restarted = mn::testing::run_command(str("TORCHELASTIC_RESTART_COUNT=1 ", exe, " ", line));
    require_ok(restarted);
    check_same_run(dir / "auto", dir / "straight");
    // The run is complete: the same line again only evaluates, and the checkpoint stays.
    const CommandResult again = mn::testing::run_command(str("TORCHELASTIC_RESTART_COUNT=2 ", exe, " ", line));
    require_ok(again);
    CHECK(json::parse(again.last_line()).at("epochs") == 2);
    CHECK(read_bytes(dir / "auto/checkpoint.safetensors") == read_bytes(dir / "straight/checkpoint.safetensors"));
  }
  {  // --auto-resume refuses another run's checkpoint, and does not go with --resume
    const CommandResult other = run(exe, str(common, " --lr 0.5 --auto-resume --out ", dir / "crashed"));
    INFO(other.all());
    CHECK(other.status != 0);
    CHECK(other.err.find("--lr: the run has 0.01, the command line 0.5") != std::string::npos);
    const CommandResult both = run(exe, str(common, " --auto-resume --resume --out ", dir / "crashed"));
    CHECK(both.status != 0);
    CHECK(both.all().find("give it or --resume, not both") != std::string::npos);
  }
}

TEST_CASE("mn-train --checkpoint-every: killed with SIGKILL once a mid-epoch checkpoint appeared, --resume finishes the run") {
  std::string exe;
  if (!mn::testing::mn_train_ready(exe)) return;
  TempDir dir("mn_train_ckpt_kill");
  // 50 steps per epoch: the kill lands long before the first epoch ends.
  const std::string common = str(kRun, " --limit 3200 --json");
  require_ok(run(exe, str(common, " --out ", dir / "straight")));

  const std::string checkpoint = dir / "killed/checkpoint.safetensors";
  const pid_t pid = mn::testing::spawn_command(str(exe, " ", common, " --checkpoint-every 3 --out ", dir / "killed"));
  REQUIRE(pid > 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!fs::exists(checkpoint) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ::kill(pid, SIGKILL);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(fs::exists(checkpoint));
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGKILL);
  const json state = mn::testing::checkpoint_trainer_state(checkpoint);
  MESSAGE("killed after the checkpoint of step " << state.at("global_step"));
  CHECK(state.contains("progress"));  // a mid-epoch one (the first epoch has 50 steps)

  require_ok(run(exe, str("--json --resume --out ", dir / "killed")));
  check_same_run(dir / "killed", dir / "straight");
}
