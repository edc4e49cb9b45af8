// Distributed benchmarks (a program, not a test):
//
//   mn-run --nproc-per-node 2 mn_dist_bench allreduce [--max-bytes 67108864]
//       Gloo all-reduce (sum, f32) on loopback for 1 KiB .. 64 MiB (up to 256 KiB gathered: all-gather + local
//       sum; MN_GLOO_GATHER_REDUCE_BYTES=0 forces Gloo's ring for comparison); bus bandwidth as in nccl-tests:
//       busbw = 2 (n - 1) / n * bytes / time (best of three rounds; the slowest rank's time).
//   mn-run --nproc-per-node 2 mn_dist_bench ddp [--batch 32] [--steps 20]
//   mn_dist_bench ddp [--batch 64] [--steps 20]            (no launcher: one process, no DDP)
//       Training step time of CNN2 through a layer-wise mapping network (4 groups x 672 latents) on random
//       Fashion-MNIST-shaped data: the median step (the slowest rank's median under DDP) and the best
//       mean of three rounds; per-sample time = step time / global batch.
//   mn_dist_bench ddp ... --cpu K                           pins the process to the K-th CPU it may use
//   mn_dist_bench compare [--batch 32] [--steps 100] [--repeats 3] [--no-bind]
//       The DDP target in one command: runs `ddp` as one process and under mn-run as 2 ranks,
//       every process with OMP_NUM_THREADS=1 on its own core (single processes --cpu 0 / 1, ranks through
//       mn-run --bind-cores; --no-bind leaves placement to the scheduler), alternating, --repeats times (plus
//       two independent processes at once: the cost of sharing the machine without communication), and prints
//       the median step and per-sample times side by side with the bytes all-reduced per step. Both use the
//       same per-process batch, so "DDP / 1 process" of the step time is the per-sample overhead of DDP
//       (target: <= 1.10 with 2 ranks on 2 cores; bytes per step 10,752 = 2,688 floats). It also reports
//       the ratio over the quiet repeats, those where the side-by-side pair stayed within 5 % of one process.
//   mn_dist_bench compare --nodes 2 [...]
//       The same with the 2 ranks as 2 "nodes" x 1 rank on this machine: two mn-run processes (--nnodes 2,
//       node ranks 0 and 1, node 0 serving the store on a free port), rank r pinned to CPU r (--cpu r).
// --backend mpi (allreduce, ddp): the same over the MPI process group, ranks started by mpirun instead, e.g.
//   mpirun -np 2 --bind-to core mn_dist_bench allreduce --backend mpi
//   mpirun -np 2 --bind-to core -x OMP_NUM_THREADS=1 mn_dist_bench ddp --backend mpi --batch 32 --steps 100
// beside mn-run --nproc-per-node 2 --bind-cores mn_dist_bench allreduce | ddp ... for Gloo.
// Rank 0 prints the results.
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "core/random.h"
#include "dist/ddp.h"
#include "dist/env.h"
#include "dist/socket.h"
#include "mapping/mapping_model.h"
#include "mapping/targets.h"
#include "nn/functional.h"
#include "nn/optim.h"

using namespace mn;
using Clock = std::chrono::steady_clock;

namespace {

std::string arg_value(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 2; i + 1 < argc; ++i)
    if (name == argv[i]) return argv[i + 1];
  return fallback;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

long voluntary_switches() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_nvcsw;
}

void bench_allreduce(int argc, char** argv) {
  const size_t max_bytes = std::stoull(arg_value(argc, argv, "--max-bytes", std::to_string(size_t{64} << 20)));
  const std::string backend = arg_value(argc, argv, "--backend", "gloo");
  dist::EnvConfig env = dist::launch_env(backend);
  dist::setup_ddp(env.rank, env.world_size, backend, "env://", std::chrono::milliseconds(120'000));
  auto pg = dist::default_process_group();
  const int world = pg->size();
  if (pg->rank() == 0) {
    std::printf("%s allreduce (sum, f32), %d ranks on this machine\n", backend.c_str(), world);
    std::printf("%12s %8s %12s %12s %12s %12s\n", "bytes", "iters", "time [us]", "algbw [GB/s]", "busbw [GB/s]",
                "csw/call");
  }
  for (size_t bytes = 1024; bytes <= max_bytes; bytes *= 4) {
    const int64_t n = static_cast<int64_t>(bytes / sizeof(float));
    Tensor t = ones({n});
    // The same count on every rank (collectives must match): ~128 MiB of traffic per round, 5..500 calls.
    const int iterations = static_cast<int>(std::clamp<size_t>((size_t{128} << 20) / bytes, 5, 500));
    for (int w = 0; w < 3; ++w) pg->allreduce(t)->wait();
    // Best of three rounds: a shared machine's other work only ever adds time.
    // csw/call: rank 0's voluntary context switches (all threads) per call, the thread wake-ups a call costs;
    // each waits for a free core on a busy machine.
    double per_call = 1e30, switches = 0;
    for (int round = 0; round < 3; ++round) {
      pg->barrier()->wait();
      const long csw_start = voluntary_switches();
      const auto start = Clock::now();
      for (int i = 0; i < iterations; ++i) pg->allreduce(t)->wait();
      per_call = std::min(per_call, seconds_since(start) / iterations);
      switches += static_cast<double>(voluntary_switches() - csw_start) / iterations / 3;
    }
    // The slowest rank defines the time.
    Tensor slowest = full({1}, per_call);
    Tensor all = zeros({world});
    pg->allgather(slowest, all)->wait();
    double worst = 0;
    for (float v : all.to_vector<float>()) worst = std::max(worst, static_cast<double>(v));
    const double algbw = static_cast<double>(bytes) / worst / 1e9;
    const double busbw = algbw * 2.0 * (world - 1) / world;
    if (pg->rank() == 0)
      std::printf("%12zu %8d %12.1f %12.3f %12.3f %12.1f\n", bytes, iterations, worst * 1e6, algbw, busbw, switches);
  }
  dist::cleanup_ddp();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Restricts this process to the k-th CPU of its affinity mask.
void pin_to_cpu(int k) {
  cpu_set_t set;
  CPU_ZERO(&set);
  MN_CHECK(sched_getaffinity(0, sizeof(set), &set) == 0, RuntimeError, "cannot read the CPU affinity mask");
  for (int cpu = 0, seen = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set) || seen++ != k) continue;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    MN_CHECK(sched_setaffinity(0, sizeof(one), &one) == 0, RuntimeError, "cannot pin to CPU ", cpu);
    return;
  }
  throw ValueError(str("--cpu ", k, ": this process may run on ", CPU_COUNT(&set), " CPU(s) only"));
}

void bench_ddp(int argc, char** argv) {
  if (const std::string cpu = arg_value(argc, argv, "--cpu", ""); !cpu.empty()) pin_to_cpu(std::stoi(cpu));
  const std::string backend = arg_value(argc, argv, "--backend", "gloo");
  const bool distributed = std::getenv("WORLD_SIZE") != nullptr || backend == "mpi";
  int rank = 0, world = 1;
  if (distributed) {
    dist::EnvConfig env = dist::launch_env(backend);
    rank = env.rank;
    world = env.world_size;
    dist::setup_ddp(rank, world, backend, "env://", std::chrono::milliseconds(120'000));
  }
  const int64_t batch = std::stoll(arg_value(argc, argv, "--batch", distributed ? "32" : "64"));
  const int steps = std::stoi(arg_value(argc, argv, "--steps", "20"));
  const int warmup = 3;

  manual_seed(0);
  mapping::MappingOptions options;
  options.latent_dim = 672;
  options.strategy = "layerwise";
  options.seed = 1;
  mapping::MappingModel model(mapping::make_target("cnn2"), options);
  std::optional<dist::DistributedDataParallel> ddp;
  const auto wrap_start = Clock::now();
  if (distributed) ddp.emplace(dist::wrap_ddp(model));  // latent broadcast + mapper-buffer hash check
  const double wrap_seconds = seconds_since(wrap_start);
  nn::optim::Adam opt(model.parameters(), nn::optim::AdamOptions{.lr = 1e-3});

  Generator gen(100 + static_cast<uint64_t>(rank));
  Tensor inputs = randn({batch, 1, 28, 28}, {}, &gen);
  std::vector<int64_t> labels;
  for (int64_t i = 0; i < batch; ++i) labels.push_back(i % 10);
  Tensor targets = from_vector(labels, Shape{batch});

  auto step = [&] {
    opt.zero_grad();
    Tensor logits = ddp ? ddp->forward(inputs) : model.forward(inputs);
    nn::functional::cross_entropy(logits, targets).backward();
    opt.step();
  };
  for (int i = 0; i < warmup; ++i) step();
  double per_step = 1e30;  // best of three rounds, as above
  std::vector<double> step_times;
  for (int round = 0; round < 3; ++round) {
    if (distributed) dist::default_process_group()->barrier()->wait();
    const auto start = Clock::now();
    for (int i = 0; i < steps; ++i) {
      const auto step_start = Clock::now();
      step();
      step_times.push_back(seconds_since(step_start));
    }
    per_step = std::min(per_step, seconds_since(start) / steps);
  }
  // The median step of each rank; the job runs at the pace of the slowest.
  double median_step = median(step_times);
  if (distributed) {
    Tensor mine = full({1}, median_step);
    Tensor all = zeros({world});
    dist::default_process_group()->allgather(mine, all)->wait();
    for (float v : all.to_vector<float>()) median_step = std::max(median_step, static_cast<double>(v));
  }
  if (rank == 0 && std::getenv("MN_DIST_BENCH_MACHINE") != nullptr) {
    // One line for `compare` to parse.
    std::printf("RESULT world=%d batch=%lld median_step_s=%.9g best_mean_step_s=%.9g bytes_per_step=%zu\n", world,
                static_cast<long long>(batch), median_step, per_step, ddp ? ddp->bytes_per_step() : size_t{0});
  } else if (rank == 0) {
    const int64_t global_batch = batch * world;
    std::printf("CNN2 layerwise 4x672: %s, batch %lld per rank (%lld global), %d steps\n",
                distributed ? (std::to_string(world) + " ranks, DDP over " + backend).c_str() : "1 process, no DDP",
                static_cast<long long>(batch), static_cast<long long>(global_batch), steps);
    std::printf("  trainable floats %lld, bytes all-reduced per step %zu\n",
                static_cast<long long>(model.trainable_parameter_count()), ddp ? ddp->bytes_per_step() : size_t{0});
    std::printf("  median step %.2f ms, per sample %.1f us; best mean of 3 rounds %.2f ms\n", median_step * 1e3,
                median_step / global_batch * 1e6, per_step * 1e3);
    if (ddp)
      std::printf("  wrap_ddp %.1f ms (hashing %.1f MB of mapper buffers)\n", wrap_seconds * 1e3,
                  static_cast<double>(model.generator().fixed_bytes()) / 1e6);
  }
  ddp.reset();
  if (distributed) dist::cleanup_ddp();
}

struct Measured {
  double median_step = 0, best_mean = 0;
  size_t bytes = 0;
};

// need_result false: a command whose output carries no RESULT line (node 1 of `compare --nodes 2`) only
// has to succeed.
Measured finish_measurement(FILE* pipe, const std::string& command, bool need_result = true) {
  std::string output;
  std::array<char, 4096> buffer;
  size_t n;
  while ((n = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0) output.append(buffer.data(), n);
  const int status = ::pclose(pipe);
  const size_t at = output.find("RESULT ");
  if (!need_result && status == 0 && at == std::string::npos) return Measured{};
  MN_CHECK(status == 0 && at != std::string::npos, RuntimeError, "measurement failed (status ", status, "): ",
           command, "\n", output);
  Measured m;
  int world = 0;
  long long batch = 0;
  MN_CHECK(std::sscanf(output.c_str() + at, "RESULT world=%d batch=%lld median_step_s=%lf best_mean_step_s=%lf "
                       "bytes_per_step=%zu", &world, &batch, &m.median_step, &m.best_mean, &m.bytes) == 5,
           RuntimeError, "cannot parse: ", output.substr(at));
  return m;
}

// Runs `ddp` measurements (shell command lines) at the same time and parses their RESULT lines.
std::vector<Measured> run_measurements(const std::vector<std::string>& commands, bool need_results = true) {
  std::vector<FILE*> pipes;
  for (const std::string& command : commands) {
    pipes.push_back(::popen(command.c_str(), "r"));
    MN_CHECK(pipes.back() != nullptr, RuntimeError, "cannot run: ", command);
  }
  std::vector<Measured> out;
  for (size_t i = 0; i < commands.size(); ++i)
    out.push_back(finish_measurement(pipes[i], commands[i], need_results || i == 0));
  return out;
}

Measured run_measurement(const std::string& command) { return run_measurements({command}).front(); }

void bench_compare(int argc, char** argv) {
  const int64_t batch = std::stoll(arg_value(argc, argv, "--batch", "32"));
  const int steps = std::stoi(arg_value(argc, argv, "--steps", "100"));
  const int repeats = std::stoi(arg_value(argc, argv, "--repeats", "3"));
  const int nodes = std::stoi(arg_value(argc, argv, "--nodes", "1"));
  MN_CHECK(nodes == 1 || nodes == 2, ValueError, "--nodes must be 1 (2 ranks on one mn-run) or 2 (two mn-runs), got ",
           nodes);
  bool bind = true;
  for (int i = 2; i < argc; ++i)
    if (std::string(argv[i]) == "--no-bind") bind = false;
  MN_CHECK(batch > 0 && steps > 0 && repeats > 0, ValueError, "--batch, --steps and --repeats must be positive");
  char self[4096] = {};
  const ssize_t len = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  MN_CHECK(len > 0, RuntimeError, "cannot find this program's path");
  const std::string args = str(" ddp --batch ", batch, " --steps ", steps);
  const std::string env = "env -u RANK -u WORLD_SIZE OMP_NUM_THREADS=1 MN_DIST_BENCH_MACHINE=1 ";
  const std::string single = env + self + args + (bind ? " --cpu 0" : "");
  const std::string single_other = env + self + args + (bind ? " --cpu 1" : "");
  const std::string two = env + MN_RUN_EXE + std::string(" --nproc-per-node 2 ") + (bind ? "--bind-cores " : "") +
                          self + args;
  // --nodes 2: node r's mn-run starts its one rank, which pins itself to the r-th CPU (--cpu r).
  auto node_command = [&](int node, uint16_t port) {
    return str(env, MN_RUN_EXE, " --nnodes 2 --node-rank ", node, " --master-port ", port, " --nproc-per-node 1 ",
               self, args, bind ? str(" --cpu ", node) : std::string());
  };
  auto run_two_ranks = [&] {
    if (nodes == 1) return run_measurement(two);
    const uint16_t port = dist::net::free_port("127.0.0.1");
    return run_measurements({node_command(0, port), node_command(1, port)}, false).front();
  };
  std::printf("CNN2 layerwise 4x672, batch %lld per process, 1 OpenMP thread per process%s, %d steps x 3 rounds, "
              "%d alternating repeats%s\n", static_cast<long long>(batch), bind ? " on its own core" : " (unbound)",
              steps, repeats, nodes == 2 ? "; DDP as 2 nodes x 1 rank (two mn-run processes)" : "");
  std::vector<double> one_steps, pair_steps, two_steps;
  size_t bytes = 0;
  for (int r = 0; r < repeats; ++r) {
    const Measured a = run_measurement(single);
    // Two independent processes at once: what sharing the machine costs before any communication.
    const std::vector<Measured> pair = run_measurements({single, single_other});
    const Measured b = run_two_ranks();
    one_steps.push_back(a.median_step);
    pair_steps.push_back(std::max(pair[0].median_step, pair[1].median_step));
    two_steps.push_back(b.median_step);
    bytes = b.bytes;
    std::printf("  repeat %d: 1 process %.3f ms, 2 processes side by side %.3f ms (x%.3f), 2 ranks %.3f ms per step "
                "(x%.3f)\n", r + 1, a.median_step * 1e3, pair_steps.back() * 1e3, pair_steps.back() / a.median_step,
                b.median_step * 1e3, b.median_step / a.median_step);
    std::fflush(stdout);
  }
  const double one = median(one_steps), side_by_side = median(pair_steps), two_ranks = median(two_steps);
  const double b = static_cast<double>(batch);
  std::printf("\n%-22s %12s %22s %24s\n", "median over repeats", "step [ms]", "per sample/rank [us]",
              "global per sample [us]");
  std::printf("%-22s %12.3f %22.2f %24.2f\n", "1 process", one * 1e3, one / b * 1e6, one / b * 1e6);
  std::printf("%-22s %12.3f %22.2f %24.2f\n", "2 processes, no DDP", side_by_side * 1e3, side_by_side / b * 1e6,
              side_by_side / (2 * b) * 1e6);
  std::printf("%-22s %12.3f %22.2f %24.2f\n", nodes == 2 ? "2 nodes x 1 rank, DDP" : "2 ranks, DDP (Gloo)",
              two_ranks * 1e3, two_ranks / b * 1e6, two_ranks / (2 * b) * 1e6);
  std::printf("DDP / 1 process per-sample step time: %.3f (target <= 1.10); of which sharing the machine %.3f, "
              "communication and waiting %.3f\n", two_ranks / one, side_by_side / one, two_ranks / side_by_side);
  // A shared host's other tenants slow one core now and then: two processes without any communication
  // then already differ by 20-40 %. Repeats where they stayed within 5 % of one process measure DDP alone.
  std::vector<double> quiet;
  for (size_t r = 0; r < one_steps.size(); ++r)
    if (pair_steps[r] <= 1.05 * one_steps[r]) quiet.push_back(two_steps[r] / one_steps[r]);
  if (quiet.empty())
    std::printf("quiet repeats (side by side within 5 %% of 1 process): none\n");
  else
    std::printf("quiet repeats (side by side within 5 %% of 1 process): %zu of %zu, DDP / 1 process median %.3f "
                "(range %.3f-%.3f)\n", quiet.size(), one_steps.size(), median(quiet),
                *std::min_element(quiet.begin(), quiet.end()), *std::max_element(quiet.begin(), quiet.end()));
  std::printf("bytes all-reduced per step: %zu (%zu floats; target 2688)\n", bytes, bytes / sizeof(float));
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "allreduce") {
      bench_allreduce(argc, argv);
    } else if (mode == "ddp") {
      bench_ddp(argc, argv);
    } else if (mode == "compare") {
      bench_compare(argc, argv);
    } else {
      std::fprintf(stderr,
                   "usage: mn_dist_bench allreduce [--max-bytes N] [--backend gloo|mpi] | ddp [--batch B] [--steps S] "
                   "[--backend gloo|mpi] | compare [--batch B] [--steps S] [--repeats R] [--nodes 1|2] [--no-bind]\n");
      return 2;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
