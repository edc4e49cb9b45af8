// mn-run across "nodes" (label dist): two mn-run processes on 127.0.0.1 with node ranks 0 and 1, as on two
// machines. Equivalence of 2 nodes x 1 and x 2 ranks with one process (dist_worker equivalence), a node
// that never arrives, a rank dying on node 1, a restart agreed by both nodes, the Slurm recipe
// (examples/slurm/mn-run.sbatch) under stand-in srun/scontrol (tests/dist/slurm/), and mn-train
// --auto-resume restarted on two nodes with and without a shared checkpoint directory.
//
// The binaries and the source tree come from compile definitions (MN_RUN_EXE, MN_DIST_WORKER_EXE,
// MN_SOURCE_DIR, and MN_TRAIN_EXE when mn-train is built). Each case picks a free port, so the cases may
// run in parallel.
#include <doctest/doctest.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "core/error.h"
#include "dist/socket.h"
#include "tests/checkpoint_run_support.h"
#include "tests/mn_train_exe.h"
#include "tests/temp_dir.h"

using namespace mn;
using Clock = std::chrono::steady_clock;

namespace {

const std::string kRun = MN_RUN_EXE;
const std::string kWorker = MN_DIST_WORKER_EXE;
const std::string kSource = MN_SOURCE_DIR;

struct Outcome {
  int status = -1;     // exit code; -1 when the command did not exit normally
  std::string output;  // stdout and stderr
  double seconds = 0;  // from the start of all commands to this one's end
};

// Runs the commands at the same time (each through the shell, its output into a file) and waits for all.
std::vector<Outcome> run_together(const std::vector<std::string>& commands) {
  mn::testing::TempDir dir("mn_multinode");
  const auto start = Clock::now();
  std::vector<FILE*> pipes;
  for (size_t i = 0; i < commands.size(); ++i) {
    pipes.push_back(::popen(str("exec ", commands[i], " >", dir / str("out", i), " 2>&1").c_str(), "r"));
    REQUIRE(pipes.back() != nullptr);
  }
  std::vector<Outcome> out(commands.size());
  for (size_t i = 0; i < commands.size(); ++i) {
    const int raw = ::pclose(pipes[i]);
    out[i].status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
    out[i].seconds = std::chrono::duration<double>(Clock::now() - start).count();
    out[i].output = mn::testing::read_bytes(dir / str("out", i));
  }
  return out;
}

std::string free_port() { return std::to_string(dist::net::free_port("127.0.0.1")); }

// The mn-run command line of one node of `nnodes` on 127.0.0.1:port.
std::string node(int nnodes, int rank, const std::string& port, const std::string& options,
                 const std::string& program) {
  return str(kRun, " --nnodes ", nnodes, " --node-rank ", rank, " --master-addr 127.0.0.1 --master-port ", port, " ",
             options, " ", program);
}

std::vector<Outcome> two_nodes(const std::string& options, const std::string& program) {
  const std::string port = free_port();
  return run_together({node(2, 0, port, options, program), node(2, 1, port, options, program)});
}

bool has(const Outcome& o, const std::string& text) { return o.output.find(text) != std::string::npos; }

void check_equivalence(int nproc) {
  const auto nodes = two_nodes(str("--nproc-per-node ", nproc), kWorker + " equivalence --steps 3");
  const int world = 2 * nproc;
  for (size_t n = 0; n < nodes.size(); ++n) {
    INFO("node " << n << ":\n" << nodes[n].output);
    CHECK(nodes[n].status == 0);
    for (int local = 0; local < nproc; ++local) {
      const int rank = static_cast<int>(n) * nproc + local;
      CHECK(has(nodes[n], str("rank ", rank, " of ", world, ": 3 Adam steps")));
      CHECK(has(nodes[n], str("rank ", rank, ": equivalence passed")));
    }
  }
}

}  // namespace

TEST_CASE("two nodes x 1 rank train as one process with the global batch") { check_equivalence(1); }

TEST_CASE("two nodes x 2 ranks train as one process with the global batch") { check_equivalence(2); }

TEST_CASE("a node that never arrives: node 0 names it after the rendezvous timeout") {
  const auto alone = run_together({node(2, 0, free_port(), "--rdzv-timeout 2", kWorker + " equivalence")});
  INFO(alone[0].output);
  CHECK(alone[0].status != 0);
  CHECK(has(alone[0], "mn-run: failed: rendezvous timed out after 2 s: node(s) 1 of 2 did not join"));
  CHECK(alone[0].seconds < 10);
  CHECK_FALSE(has(alone[0], "equivalence passed"));  // no rank started
}

TEST_CASE("a rank killed on node 1 stops node 0's ranks within seconds, naming node, rank and status") {
  // Node 0's ranks sleep: only their launcher can stop them, after it read node 1's failure in the store.
  const auto nodes = two_nodes("--nproc-per-node 2",
                               "sh -c 'if test $RANK = 3; then sleep 1; kill -9 $$; else exec sleep 60; fi'");
  for (const Outcome& o : nodes) {
    INFO(o.output);
    CHECK(o.status == 137);
    CHECK(o.seconds < 10);
    CHECK(has(o, "mn-run: failed: rank 3 on node 1 was killed by signal 9 (Killed) first"));
  }
  CHECK(has(nodes[0], "mn-run: rank 3 on node 1 was killed by signal 9 (Killed); stopping node 0's 2 running rank(s)"));
  CHECK(has(nodes[0], "rank 0 on node 0 (pid"));
  CHECK(has(nodes[1], "mn-run:   rank 2 on node 1 (pid"));
}

TEST_CASE("a launcher killed on node 1: node 0 stops its ranks once node 1's heartbeat stops") {
  const std::string port = free_port();
  const auto nodes = run_together(
      {node(2, 0, port, "", "sleep 60"),
       str("sh -c '", node(2, 1, port, "", "sleep 60"),
           " & launcher=$!; sleep 2; kill -9 $launcher; wait $launcher'")});
  INFO("node 0:\n" << nodes[0].output << "node 1:\n" << nodes[1].output);
  CHECK(nodes[0].status == 1);
  CHECK(nodes[0].seconds < 20);  // 2 s, then 10 s without a heartbeat, then the ranks' SIGTERM
  CHECK(has(nodes[0], "mn-run: failed: the mn-run of node(s) 1 stopped answering (no heartbeat for 10 s)"));
  CHECK(has(nodes[0], "rank 0 on node 0 (pid"));
}

TEST_CASE("a rank killed in the middle of DDP training on node 1 is named on both nodes") {
  // Node 0's ranks see the broken all-reduce themselves and exit with an error; the killed rank on
  // node 1 is still the job's failure.
  const auto nodes = two_nodes("--nproc-per-node 2", kWorker + " kill --kill-rank 3 --after-step 2 --timeout 20");
  for (const Outcome& o : nodes) {
    INFO(o.output);
    CHECK(o.status == 137);
    CHECK(o.seconds < 30);
    CHECK(has(o, "mn-run: failed: rank 3 on node 1 was killed by signal 9 (Killed) first"));
  }
}

TEST_CASE("--max-restarts: both nodes restart all ranks after a rank failed on node 1") {
  const auto nodes = two_nodes("--max-restarts 1", kWorker + " restart --fail-rank 1");
  for (const Outcome& o : nodes) {
    INFO(o.output);
    CHECK(o.status == 0);
    CHECK(has(o, "mn-run: restart 1/1 after rank 1 on node 1 exited with code 1"));
    CHECK(has(o, "attempt 1 joined"));
    CHECK(has(o, "restart passed"));
  }
}

TEST_CASE("the Slurm recipe starts one mn-run per node (stand-in srun and scontrol)") {
  // The shims run SLURM_NNODES copies of srun's command on this machine with SLURM_NODEID set; scontrol
  // expands the comma-separated node list.
  const std::string env = str("PATH=", kSource, "/tests/dist/slurm:$PATH SLURM_JOB_ID=4242 SLURM_NNODES=2 ",
                              "SLURM_JOB_NODELIST=127.0.0.1,127.0.0.1 NPROC_PER_NODE=2 MASTER_PORT=", free_port(),
                              " MN_RUN=", kRun);
  const auto job = run_together(
      {str("env ", env, " bash ", kSource, "/examples/slurm/mn-run.sbatch ", kWorker, " equivalence --steps 2")});
  INFO(job[0].output);
  CHECK(job[0].status == 0);
  CHECK(has(job[0], "mn-run.sbatch: 2 node(s) x 2 rank(s), node 0 at 127.0.0.1:"));
  for (int rank = 0; rank < 4; ++rank) CHECK(has(job[0], str("rank ", rank, " of 4: 2 Adam steps")));
}

#ifdef MN_TRAIN_EXE
namespace {

// mn-train on 2 nodes x 2 ranks: 640 images, 4 ranks x 32 a step, 5 steps per epoch.
const std::string kTrainCommon = str(MN_TRAIN_EXE, " --backend gloo --target mlp --mlp-hidden 32 --strategy layerwise ",
                                     "--latent-dim 16 --batch-size 32 --seed 3 --epochs 2 --limit 640 --json");
// Issue 20's elastic job: one command line that starts the run and, repeated by mn-run --max-restarts,
// continues it. Rank 3 (on node 1) crashes after step 3 in the first attempt only; rank 0 has written the
// checkpoint of step 2 (epoch 1, batch 2) to its node's --out by then.
const std::string kElastic = str(kTrainCommon, " --auto-resume --checkpoint-every 2 --crash-after-step 3 --crash-rank 3");

// Both nodes of the job `train` (mn-train and its arguments but --out) under --max-restarts 1, node n
// writing to outs[n].
std::vector<Outcome> two_training_nodes(const std::string& train, const std::vector<std::string>& outs,
                                        const std::string& launcher = "--nproc-per-node 2 --max-restarts 1") {
  const std::string port = free_port();
  return run_together({node(2, 0, port, launcher, str(train, " --out ", outs[0])),
                       node(2, 1, port, launcher, str(train, " --out ", outs[1]))});
}

}  // namespace

TEST_CASE("mn-train --auto-resume on two nodes without a shared --out: the restart fails, naming each rank's position") {
  if (!mn::testing::have_fashion_mnist()) {
    MESSAGE("skipped: Fashion-MNIST not found in " << data::default_fashion_mnist_root());
    return;
  }
  // Each node its own directory, as on machines that share no file system: only node 0's holds the
  // checkpoint (rank 0 writes it), so after the restart node 0's ranks resume and node 1's start fresh.
  // Trained under one all-reduce, they would silently mix two runs; every rank must refuse instead.
  mn::testing::TempDir dir("mn_multinode_train");
  const auto nodes = two_training_nodes(kElastic, {dir / "node0", dir / "node1"});
  const std::string positions =
      "the data-parallel ranks start from different positions (rank 0: epoch 1, global step 2, batch 2 of its "
      "epoch; rank 1: epoch 1, global step 2, batch 2 of its epoch; rank 2: a fresh start; rank 3: a fresh start); "
      "every rank must resume the same checkpoint (on several nodes, the checkpoint directory must be one all nodes "
      "share)";
  for (size_t n = 0; n < nodes.size(); ++n) {
    INFO("node " << n << ":\n" << nodes[n].output);
    CHECK(nodes[n].status == 1);
    CHECK(nodes[n].seconds < 30);
    CHECK(has(nodes[n], "mn-run: restart 1/1 after rank 3 on node 1 was killed by signal 9 (Killed)"));
    for (int local = 0; local < 2; ++local)
      CHECK(has(nodes[n], str("mn-train: rank ", 2 * n + local, ": MappingTrainer: ", positions)));
    CHECK(has(nodes[n], "(after 1 restart(s), --max-restarts 1)"));
    CHECK_FALSE(has(nodes[n], "epoch 1/2:"));  // no epoch was trained in the restart
  }
  CHECK_FALSE(std::filesystem::exists(dir / "node1/checkpoint.safetensors"));
  // Nothing trained after the refusal: the checkpoint is still the one the restart found.
  CHECK(mn::testing::checkpoint_trainer_state(dir / "node0/checkpoint.safetensors").at("global_step") == 2);
}

TEST_CASE("mn-train --auto-resume on two nodes sharing --out: the restarted job ends as the straight one") {
  if (!mn::testing::have_fashion_mnist()) {
    MESSAGE("skipped: Fashion-MNIST not found in " << data::default_fashion_mnist_root());
    return;
  }
  mn::testing::TempDir dir("mn_multinode_train_shared");
  const auto straight = two_training_nodes(kTrainCommon, {dir / "straight", dir / "straight"}, "--nproc-per-node 2");
  for (const Outcome& o : straight) {
    INFO(o.output);
    REQUIRE(o.status == 0);
  }
  // Both nodes see the checkpoint after the restart: all four ranks resume at step 2 (the position check
  // passes) and finish the run.
  const auto nodes = two_training_nodes(kElastic, {dir / "job", dir / "job"});
  for (const Outcome& o : nodes) {
    INFO(o.output);
    CHECK(o.status == 0);
    CHECK(has(o, "mn-run: restart 1/1 after rank 3 on node 1 was killed by signal 9 (Killed)"));
  }
  mn::testing::check_same_run(dir / "job", dir / "straight");
}
#endif
