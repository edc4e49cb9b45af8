// Distributed benchmarks (a program, not a test):
//
//   mn-run --nproc-per-node 2 mn_dist_bench allreduce
//       Gloo all-reduce (sum, f32) on loopback for 1 KiB .. 64 MiB; bus bandwidth as in nccl-tests:
//       busbw = 2 (n - 1) / n * bytes / time (best of three rounds; the slowest rank's time).
//   mn-run --nproc-per-node 2 mn_dist_bench ddp [--batch 32] [--steps 20]
//   mn_dist_bench ddp [--batch 64] [--steps 20]            (no launcher: one process, no DDP)
//       Training step time of CNN2 through a layer-wise mapping network (4 groups x 672 latents) on random
//       Fashion-MNIST-shaped data; per-sample time = step time / global batch.
// Rank 0 prints the results.
#include <algorithm>
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

void bench_allreduce() {
  dist::EnvConfig env = dist::from_env();
  dist::setup_ddp(env.rank, env.world_size, "gloo", "env://", std::chrono::milliseconds(120'000));
  auto pg = dist::default_process_group();
  const int world = pg->size();
  if (pg->rank() == 0) {
    std::printf("Gloo allreduce (sum, f32), %d ranks on 127.0.0.1\n", world);
    std::printf("%12s %8s %12s %12s %12s\n", "bytes", "iters", "time [us]", "algbw [GB/s]", "busbw [GB/s]");
  }
  for (size_t bytes = 1024; bytes <= (size_t{64} << 20); bytes *= 4) {
    const int64_t n = static_cast<int64_t>(bytes / sizeof(float));
    Tensor t = ones({n});
    // The same count on every rank (collectives must match): ~128 MiB of traffic per round, 5..500 calls.
    const int iterations = static_cast<int>(std::clamp<size_t>((size_t{128} << 20) / bytes, 5, 500));
    for (int w = 0; w < 3; ++w) pg->allreduce(t)->wait();
    // Best of three rounds: a shared machine's other work only ever adds time.
    double per_call = 1e30;
    for (int round = 0; round < 3; ++round) {
      pg->barrier()->wait();
      const auto start = Clock::now();
      for (int i = 0; i < iterations; ++i) pg->allreduce(t)->wait();
      per_call = std::min(per_call, seconds_since(start) / iterations);
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
      std::printf("%12zu %8d %12.1f %12.3f %12.3f\n", bytes, iterations, worst * 1e6, algbw, busbw);
  }
  dist::cleanup_ddp();
}

void bench_ddp(int argc, char** argv) {
  const bool distributed = std::getenv("WORLD_SIZE") != nullptr;
  int rank = 0, world = 1;
  if (distributed) {
    dist::EnvConfig env = dist::from_env();
    rank = env.rank;
    world = env.world_size;
    dist::setup_ddp(rank, world, "gloo", "env://", std::chrono::milliseconds(120'000));
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
    Tensor logits = ddp ? ddp->forward(inputs).predictions : model.forward(inputs).predictions;
    nn::functional::cross_entropy(logits, targets).backward();
    opt.step();
  };
  for (int i = 0; i < warmup; ++i) step();
  double per_step = 1e30;  // best of three rounds, as above
  for (int round = 0; round < 3; ++round) {
    if (distributed) dist::default_process_group()->barrier()->wait();
    const auto start = Clock::now();
    for (int i = 0; i < steps; ++i) step();
    per_step = std::min(per_step, seconds_since(start) / steps);
  }
  if (rank == 0) {
    const int64_t global_batch = batch * world;
    std::printf("CNN2 layerwise 4x672: %s, batch %lld per rank (%lld global), %d steps\n",
                distributed ? (std::to_string(world) + " ranks, DDP over Gloo").c_str() : "1 process, no DDP",
                static_cast<long long>(batch), static_cast<long long>(global_batch), steps);
    std::printf("  trainable floats %lld, bytes all-reduced per step %zu\n",
                static_cast<long long>(model.trainable_parameter_count()), ddp ? ddp->bytes_per_step() : size_t{0});
    std::printf("  step %.2f ms, per sample %.1f us\n", per_step * 1e3, per_step / global_batch * 1e6);
    if (ddp)
      std::printf("  wrap_ddp %.1f ms (hashing %.1f MB of mapper buffers)\n", wrap_seconds * 1e3,
                  static_cast<double>(model.generator().fixed_bytes()) / 1e6);
  }
  ddp.reset();
  if (distributed) dist::cleanup_ddp();
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "allreduce") {
      bench_allreduce();
    } else if (mode == "ddp") {
      bench_ddp(argc, argv);
    } else {
      std::fprintf(stderr, "usage: mn_dist_bench allreduce | ddp [--batch B] [--steps S]\n");
      return 2;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
