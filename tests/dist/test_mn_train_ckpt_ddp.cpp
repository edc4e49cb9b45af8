// mn-train --checkpoint-every under mn-run --nproc-per-node 2 --backend gloo (label dist): a job whose
// rank dies after a mid-epoch checkpoint - rank 1 by the hidden --crash-after-step hook at an exact step,
// or any rank by SIGKILL from outside once a checkpoint appeared - resumes (every rank from rank 0's
// checkpoint, each rank's DistributedSampler shard continuing after the batches trained) and ends with the
// uninterrupted job's checkpoint, weights and metrics.csv (seconds aside), byte for byte. The checkpoint
// records both ranks' metric sums, so the resumed epoch's all-reduced means are the same bits.
// Under mn-run --max-restarts 1 the launcher restarts the job itself and --auto-resume picks the checkpoint up.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "nn/data/fashion_mnist.h"
#include "nn/safetensors.h"
#include "tests/checkpoint_run_support.h"
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

const std::string kTrain = MN_TRAIN_EXE;
const std::string kRun = MN_RUN_EXE;
// 640 images, 2 ranks x 32: 10 steps per epoch.
const char* const kCommon =
    "--backend gloo --target mlp --mlp-hidden 32 --strategy layerwise --latent-dim 16 --batch-size 32 --seed 3 --epochs 2 --json";

bool have_data() {
  const fs::path root = data::default_fashion_mnist_root();
  return fs::exists(root / "train-images-idx3-ubyte.gz") || fs::exists(root / "train-images-idx3-ubyte");
}

std::string ddp(const std::string& args) { return str(kRun, " --nproc-per-node 2 ", kTrain, " ", kCommon, " ", args); }

void require_ok(const CommandResult& r) {
  INFO("output:\n" << r.all());
  REQUIRE(r.status == 0);
}


// The pids of `parent`'s children (the launcher's ranks).
std::vector<pid_t> children(pid_t parent) {
  std::ifstream in(str("/proc/", parent, "/task/", parent, "/children"));
  std::vector<pid_t> out;
  for (pid_t pid; in >> pid;) out.push_back(pid);
  return out;
}

// Starts `command` (mn-run and its 2 ranks), kills rank `which` with SIGKILL as soon as `checkpoint`
// exists, and returns the launcher's exit code.
int run_killing_a_rank(const std::string& command, const std::string& checkpoint, size_t which) {
  const pid_t launcher = mn::testing::spawn_command(command);
  REQUIRE(launcher > 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!fs::exists(checkpoint) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const std::vector<pid_t> ranks = children(launcher);
  REQUIRE(ranks.size() == 2);
  ::kill(ranks.at(which), SIGKILL);
  int status = 0;
  REQUIRE(::waitpid(launcher, &status, 0) == launcher);
  REQUIRE(WIFEXITED(status));
  return WEXITSTATUS(status);
}

}  // namespace

TEST_CASE("mn-train --checkpoint-every under DDP: rank 1 dies after step 14; the restarted job ends as the straight one") {
  if (!have_data()) {
    MESSAGE("skipped: Fashion-MNIST not found in " << data::default_fashion_mnist_root());
    return;
  }
  TempDir dir("mn_train_ckpt_ddp");
  require_ok(mn::testing::run_command(ddp(str("--limit 640 --out ", dir / "straight"))));

  // The command line of every attempt, as mn-run --max-restarts repeats it.
  const std::string line =
      ddp(str("--limit 640 --auto-resume --checkpoint-every 3 --crash-after-step 14 --crash-rank 1 --out ", dir / "job"));
  const CommandResult crashed = mn::testing::run_command(line);
  INFO(crashed.all());
  CHECK(crashed.status != 0);
  CHECK(crashed.all().find("rank 1 (pid") != std::string::npos);
  const json state = mn::testing::checkpoint_trainer_state(dir / "job/checkpoint.safetensors");
  CHECK(state.at("global_step") == 12);
  CHECK(state.at("progress").at("batches") == 2);
  REQUIRE(state.at("progress").at("sums").size() == 2);  // both ranks' sums
  CHECK(state.at("progress").at("sums")[1].at("samples") == 64);

  // The same command line again, now under --max-restarts 1: its first attempt resumes at step 12 and
  // crashes again at step 14 (mn-run sets TORCHELASTIC_RESTART_COUNT=0 for it); the restarted attempt
  // resumes from step 12 once more and finishes.
  const std::string restarting = str(kRun, " --max-restarts 1", line.substr(kRun.size()));
  const CommandResult finished = mn::testing::run_command(restarting);
  require_ok(finished);
  CHECK(finished.all().find("mn-run: restart 1/1 after rank 1") != std::string::npos);
  check_same_run(dir / "job", dir / "straight");
}

TEST_CASE("mn-train --checkpoint-every under DDP: a rank killed with SIGKILL once a checkpoint appeared; --resume finishes") {
  if (!have_data()) {
    MESSAGE("skipped: Fashion-MNIST not found in " << data::default_fashion_mnist_root());
    return;
  }
  TempDir dir("mn_train_ckpt_ddp_kill");
  // 50 steps per epoch: the kill lands long before the first epoch ends.
  require_ok(mn::testing::run_command(ddp(str("--limit 3200 --out ", dir / "straight"))));

  const std::string checkpoint = dir / "killed/checkpoint.safetensors";
  // The launcher reports the dead rank and stops the other.
  CHECK(run_killing_a_rank(ddp(str("--limit 3200 --checkpoint-every 3 --out ", dir / "killed")), checkpoint, 1) != 0);
  REQUIRE(fs::exists(checkpoint));
  const json state = mn::testing::checkpoint_trainer_state(checkpoint);
  MESSAGE("killed after the checkpoint of step " << state.at("global_step"));
  CHECK(state.contains("progress"));

  require_ok(mn::testing::run_command(ddp(str("--resume --out ", dir / "killed"))));
  check_same_run(dir / "killed", dir / "straight");
}

TEST_CASE("mn-run --max-restarts 1: a rank killed with SIGKILL mid-epoch; the job restarts itself and ends as the straight one") {
  if (!have_data()) {
    MESSAGE("skipped: Fashion-MNIST not found in " << data::default_fashion_mnist_root());
    return;
  }
  TempDir dir("mn_train_ckpt_ddp_restart");
  require_ok(mn::testing::run_command(ddp(str("--limit 3200 --out ", dir / "straight"))));

  // Issue 20's elastic case: the launcher restarts both ranks with the same command line, and
  // --auto-resume continues from the last mid-epoch checkpoint.
  const std::string checkpoint = dir / "job/checkpoint.safetensors";
  const std::string command = str(kRun, " --max-restarts 1 --nproc-per-node 2 ", kTrain, " ", kCommon,
                                  " --limit 3200 --auto-resume --checkpoint-every 3 --out ", dir / "job");
  CHECK(run_killing_a_rank(command, checkpoint, 0) == 0);  // restarted once, then finished
  check_same_run(dir / "job", dir / "straight");
}
