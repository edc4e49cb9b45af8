// One rank of the multi-process tests (run under mn-run; see tests/dist/tests.cmake):
//
//   dist_worker collectives   allreduce (sum, avg; f32, i64), broadcast, allgather and barrier for sizes
//                             0, 1, 1023 and 10^7; Gloo's event loop runs under SCHED_BATCH
//   dist_worker equivalence   N ranks on disjoint shards == one process on the whole batch after k Adam steps
//                             (also with two forwards - clean and perturbed - before each backward, and
//                             with --compile: the steps captured once and replayed, all-reduce included)
//   dist_worker no_sync       two micro-batches, the first under no_sync == one step on their concatenation
//   dist_worker module_equivalence  the same for a plain nn::Module (an MLP with buffers): N ranks == one
//                             process, rank 0's parameters and buffers broadcast at wrapping
//   dist_worker gradient_sync  accumulation over micro-batches through train::DataParallel: sync off for all
//                             but the last == sync on for each, with fewer all-reduces (counted)
//   dist_worker buffer_mismatch  rank 1 uses another mapper seed: wrap_ddp must fail on every rank
//   dist_worker kill          rank --kill-rank raises SIGKILL after --after-step steps; the others must stop
//                             with a clear error within the collective timeout
//   dist_worker stall         rank --stall-rank sleeps --stall-seconds before its all-reduce: the others' wait
//                             must fail after the collective --timeout, naming it, and later collectives at once
//   dist_worker env           reads the environment only (bad-variable tests)
//   dist_worker backend_mismatch --backends B0,B1,...  rank r calls setup_ddp with backend Br: when they
//                             differ, every rank must fail with the same message naming them
//   dist_worker restart       under mn-run --max-restarts: joins the group, then rank --fail-rank exits 1 while
//                             TORCHELASTIC_RESTART_COUNT < --fail-attempts (default 1); in the attempt that
//                             passes, an all-reduce over the ranks and the launcher's variables are checked
//   dist_worker affinity      under mn-run --bind-cores: every rank runs on its own, equally large set of CPUs
//                             and OMP_NUM_THREADS is that set's size
//
// --backend mpi (any mode; default gloo): the same checks over the MPI process group, under
// mpirun -np N instead of mn-run (rank and size from dist::launch_env).
//
// Exit codes: 0 passed, 1 a check failed or an error, 3 training stopped by a communication error (kill).
#include <sched.h>
#include <signal.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "autograd/engine.h"
#include "autograd/ops.h"
#include "core/cpu_load.h"
#include "core/random.h"
#include "dist/ddp.h"
#include "dist/env.h"
#include "dist/sampler.h"
#include "mapping/mapping_model.h"
#include "nn/functional.h"
#include "nn/layers.h"
#include "nn/optim.h"

using namespace mn;
using namespace std::chrono_literals;
using mn::dist::Milliseconds;

namespace {

int g_rank = 0;
int g_failures = 0;
std::string g_backend = "gloo";  // --backend

#define WORKER_CHECK(cond, ...)                                                                          \
  do {                                                                                                   \
    if (!(cond)) {                                                                                       \
      ++g_failures;                                                                                      \
      std::fprintf(stderr, "rank %d: CHECK FAILED %s:%d: %s -- %s\n", g_rank, __FILE__, __LINE__, #cond, \
                   mn::str(__VA_ARGS__).c_str());                                                        \
    }                                                                                                    \
  } while (0)

std::string arg_value(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 2; i + 1 < argc; ++i)
    if (name == argv[i]) return argv[i + 1];
  return fallback;
}

bool has_flag(int argc, char** argv, const std::string& name) {
  for (int i = 2; i < argc; ++i)
    if (name == argv[i]) return true;
  return false;
}

void setup_from_env(Milliseconds timeout) {
  dist::EnvConfig env = dist::launch_env(g_backend);
  g_rank = env.rank;
  dist::setup_ddp(env.rank, env.world_size, g_backend, "env://", timeout);
}

// ---- collectives ----

// i % 7 for i < n.
Tensor remainder_free_pattern(int64_t n) {
  Tensor t = empty({n});
  float* p = t.data<float>();
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(i % 7);
  return t;
}

// Threads of this process running under SCHED_BATCH (Gloo's event loop, see gloo_process_group.cpp).
int batch_threads() {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task"))
    if (sched_getscheduler(std::stoi(entry.path().filename().string())) == SCHED_BATCH) ++count;
  return count;
}

void run_collectives() {
  setup_from_env(60s);
  auto pg = dist::default_process_group();
  const int rank = pg->rank(), world = pg->size();
  const char* io_thread = std::getenv("MN_GLOO_IO_THREAD");
  const bool gloo_batch_loop = g_backend == "gloo" && (io_thread == nullptr || std::string(io_thread) != "normal");
  const int expected_batch = gloo_batch_loop ? 1 : 0;
  WORKER_CHECK(batch_threads() == expected_batch, "expected ", expected_batch,
               " SCHED_BATCH thread (Gloo's event loop), found ", batch_threads());
  const double triangle = world * (world + 1) / 2.0;  // sum of (rank + 1)
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1023}, int64_t{10'000'000}}) {
    // Values i % 7 times (rank + 1): sums and averages are exact in f32.
    Tensor pattern = remainder_free_pattern(n);
    Tensor sum_t = mul(pattern, static_cast<double>(rank + 1)).contiguous();
    Tensor avg_t = mul(pattern, 3.0 * (rank + 1)).contiguous();
    auto sum_work = pg->allreduce(sum_t, dist::ReduceOp::Sum);
    auto avg_work = pg->allreduce(avg_t, dist::ReduceOp::Avg);  // two in flight at once
    sum_work->wait();
    avg_work->wait();
    WORKER_CHECK(sum_work->is_completed() && avg_work->is_completed(), "works report completion");
    const float* s = sum_t.data<float>();
    const float* a = avg_t.data<float>();
    int64_t bad_sum = 0, bad_avg = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double base = static_cast<double>(i % 7);
      if (s[i] != static_cast<float>(base * triangle)) ++bad_sum;
      if (std::abs(a[i] - static_cast<float>(base * 3.0 * triangle / world)) > 1e-6 * (1 + base * triangle))
        ++bad_avg;
    }
    WORKER_CHECK(bad_sum == 0, bad_sum, " wrong sums for n=", n);
    WORKER_CHECK(bad_avg == 0, bad_avg, " wrong averages for n=", n);

    const int root = world - 1;
    Tensor b = full({n}, rank == root ? 7.5 : -1.0);
    pg->broadcast(b, root)->wait();
    int64_t bad_broadcast = 0;
    for (float v : b.to_vector<float>()) bad_broadcast += v != 7.5f;
    WORKER_CHECK(bad_broadcast == 0, bad_broadcast, " wrong broadcast values for n=", n);

    if (n <= 1023) {
      Tensor in = full({n}, static_cast<double>(rank));
      Tensor out = full({n * world}, -1.0);
      pg->allgather(in, out)->wait();
      auto got = out.to_vector<float>();
      int64_t bad_gather = 0;
      for (int r = 0; r < world; ++r)
        for (int64_t i = 0; i < n; ++i) bad_gather += got[static_cast<size_t>(r * n + i)] != static_cast<float>(r);
      WORKER_CHECK(bad_gather == 0, bad_gather, " wrong allgather values for n=", n);
    }
    std::printf("rank %d: collectives on %lld elements ok\n", rank, static_cast<long long>(n));
  }
  // Inexact sums (random values per rank) must still come out bitwise the same on every rank, on both
  // sides of the Gloo backend's switch from gather-and-sum (small) to the ring (large).
  for (int64_t n : {int64_t{2688}, int64_t{70'000}}) {
    Generator gen(1000 + static_cast<uint64_t>(rank));
    Tensor values = randn({n}, {}, &gen);
    pg->allreduce(values, dist::ReduceOp::Sum)->wait();
    Tensor everyone = zeros({n * world});
    pg->allgather(values, everyone)->wait();
    const std::vector<float> all = everyone.to_vector<float>();
    int64_t differing = 0;
    for (int r = 1; r < world; ++r)
      for (int64_t i = 0; i < n; ++i)
        differing += std::memcmp(&all[static_cast<size_t>(r * n + i)], &all[static_cast<size_t>(i)], sizeof(float)) != 0;
    WORKER_CHECK(differing == 0, differing, " all-reduced values differ between ranks for n=", n);
  }
  Tensor ints = from_vector(std::vector<int64_t>{rank, int64_t{1} << 40});
  pg->allreduce(ints)->wait();
  WORKER_CHECK(
      ints.to_vector<int64_t>() == (std::vector<int64_t>{world * (world - 1) / 2, world * (int64_t{1} << 40)}),
      "i64 allreduce");
  Tensor gathered = zeros({world}, TensorOptions(DType::i64));
  pg->allgather(from_vector(std::vector<int64_t>{int64_t{100} + rank}), gathered)->wait();
  for (int r = 0; r < world; ++r) WORKER_CHECK(gathered.to_vector<int64_t>()[r] == 100 + r, "i64 allgather");

  // Barrier: nobody passes before the slowest rank arrives.
  const auto before = std::chrono::steady_clock::now();
  if (rank == 0) std::this_thread::sleep_for(300ms);
  pg->barrier()->wait();
  const auto waited = std::chrono::steady_clock::now() - before;
  WORKER_CHECK(waited >= 250ms, "rank ", rank, " left the barrier before rank 0 arrived");
  dist::cleanup_ddp();
}

// ---- the training problem shared by equivalence, no_sync and kill ----

std::shared_ptr<nn::Module> make_target() {
  manual_seed(1234);  // every rank (and the reference) builds the same target, hence the same scales
  auto net = std::make_shared<nn::Sequential>();
  net->push_back(std::make_shared<nn::Linear>(8, 16));
  net->push_back(std::make_shared<nn::ReLU>());
  net->push_back(std::make_shared<nn::Linear>(16, 4));
  return net;
}

mapping::MappingModel make_model(uint64_t seed = 99) {
  mapping::MappingOptions options;
  options.latent_dim = 6;
  options.seed = seed;
  options.strategy = "layerwise";
  return mapping::MappingModel(make_target(), options);
}

struct Data {
  Tensor inputs;   // [n, 8]
  Tensor targets;  // [n] classes 0..3
};

Data make_data(int64_t n, uint64_t seed) {
  Generator gen(seed);
  Data d;
  d.inputs = randn({n, 8}, {}, &gen);
  std::vector<int64_t> labels;
  for (int64_t i = 0; i < n; ++i) labels.push_back((i * 3 + static_cast<int64_t>(seed)) % 4);
  d.targets = from_vector(labels, Shape{n});
  return d;
}

Data take(const Data& d, const Tensor& index) {
  return {d.inputs.index_select(0, index), d.targets.index_select(0, index)};
}

// Same perturbation on every rank and in the reference (a fixed stream per step).
mapping::LatentOverrides perturbed(const mapping::MappingModel& model, int step) {
  mapping::LatentOverrides out;
  Generator gen(5000 + static_cast<uint64_t>(step));
  for (const auto& [name, z] : model.named_latents()) out[name] = add(z, mul(randn(z.sizes(), {}, &gen), 0.05));
  return out;
}

// Cross-entropy plus, with two forwards, a stability-like term between clean and perturbed predictions.
// Means over the batch, so the mean of equal-sized shard losses is the full-batch loss.
template <class Forward>
Tensor loss_of(Forward&& forward, const mapping::MappingModel& model, const Data& batch, bool two_forwards,
               int step) {
  Tensor clean = forward(batch.inputs, mapping::LatentOverrides{});
  Tensor loss = nn::functional::cross_entropy(clean, batch.targets);
  if (two_forwards) {
    Tensor noisy = forward(batch.inputs, perturbed(model, step));
    loss = add(loss, mul(nn::functional::mse_loss(noisy, clean), 0.5));
  }
  return loss;
}

std::vector<float> flat_latents(const mapping::MappingModel& model) {
  std::vector<float> out;
  for (const Tensor& z : model.parameters())
    for (float v : z.to_vector<float>()) out.push_back(v);
  return out;
}

std::vector<float> flat_grads(const mapping::MappingModel& model) {
  std::vector<float> out;
  for (const Tensor& z : model.parameters())
    for (float v : z.grad().to_vector<float>()) out.push_back(v);
  return out;
}

// Max |a - b| relative to max |b| (latents are O(1/sqrt(L)); elementwise relative error is meaningless
// where a value crosses zero).
double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return diff / std::max(scale, 1e-30);
}

void check_ranks_identical(dist::ProcessGroup& pg, const std::vector<float>& mine, const char* what) {
  Tensor local = from_vector(mine);
  Tensor all = zeros({static_cast<int64_t>(mine.size()) * pg.size()});
  pg.allgather(local, all)->wait();
  auto values = all.to_vector<float>();
  for (int r = 1; r < pg.size(); ++r)
    for (size_t i = 0; i < mine.size(); ++i)
      if (values[r * mine.size() + i] != values[i]) {
        WORKER_CHECK(false, what, ": rank ", r, " differs from rank 0 at element ", i);
        return;
      }
}

// ---- equivalence ----

void run_equivalence(int argc, char** argv) {
  const int steps = std::stoi(arg_value(argc, argv, "--steps", "3"));
  const bool two_forwards = has_flag(argc, argv, "--two-forwards");
  // --compile: the DDP steps go through mn::compile (fullgraph), the all-reduce replayed inside.
  const bool compiled = has_flag(argc, argv, "--compile");
  WORKER_CHECK(!(compiled && two_forwards), "--compile takes the single-forward step only");
  const int64_t batch_size = 12;  // divisible by 2 and 3: equal shards
  setup_from_env(60s);
  auto pg = dist::default_process_group();
  const int rank = pg->rank(), world = pg->size();
  const Data data = make_data(batch_size, 17);

  // The reference: one process, whole batch.
  mapping::MappingModel reference = make_model();
  nn::optim::Adam reference_opt(reference.parameters(), nn::optim::AdamOptions{.lr = 1e-2});
  std::vector<std::vector<float>>
      reference_grads;  // per step: Adam hides a wrong gradient scale, so compare these too
  for (int step = 0; step < steps; ++step) {
    reference_opt.zero_grad();
    auto forward = [&](const Tensor& x, const mapping::LatentOverrides& o) {
      return reference.run(x, o).predictions;
    };
    loss_of(forward, reference, data, two_forwards, step).backward();
    reference_grads.push_back(flat_grads(reference));
    reference_opt.step();
  }

  // DDP: disjoint shards of the same batch.
  mapping::MappingModel model = make_model();
  if (rank != 0) {  // the wrapper must replace these with rank 0's latents
    autograd::NoGradGuard no_grad;
    for (Tensor& z : model.parameters()) z.detach().copy_(add(z.detach(), 0.25 * rank));
  }
  auto ddp = dist::wrap_ddp(model);
  WORKER_CHECK(ddp.bytes_per_step() == static_cast<size_t>(model.trainable_parameter_count()) * 4,
               "bytes_per_step");
  dist::DistributedSampler sampler(batch_size, world, rank, /*shuffle=*/true, /*seed=*/3);
  sampler.set_epoch(0);
  const Data shard = take(data, sampler.index_tensor());
  WORKER_CHECK(shard.inputs.size(0) == batch_size / world, "shard size");
  nn::optim::Adam opt(ddp.parameters(), nn::optim::AdamOptions{.lr = 1e-2});
  // The model runs directly: the reducer's hooks sit on its latents.
  auto forward = [&](const Tensor& x, const mapping::LatentOverrides& o) { return model.run(x, o).predictions; };
  CompiledFunction compiled_step(
      [&](const std::vector<Tensor>& in) {
        loss_of(forward, model, Data{in[0], in[1]}, false, 0).backward();
        return std::vector<Tensor>{};
      },
      model.compile_guard(), {.fullgraph = true});
  double max_grad_rel = 0;
  for (int step = 0; step < steps; ++step) {
    opt.zero_grad();
    if (compiled)
      compiled_step({shard.inputs, shard.targets});
    else
      loss_of(forward, model, shard, two_forwards, step).backward();
    const double grad_rel = relative_difference(flat_grads(model), reference_grads[static_cast<size_t>(step)]);
    WORKER_CHECK(grad_rel <= 1e-5, "step ", step, ": averaged gradients differ from the full-batch ones by ",
                 grad_rel);
    max_grad_rel = std::max(max_grad_rel, grad_rel);
    opt.step();
  }
  const auto mine = flat_latents(model);
  const double rel = relative_difference(mine, flat_latents(reference));
  std::printf("rank %d of %d: %d Adam steps%s, max relative difference to one process: latents %.3g, grads %.3g\n",
              rank, world, steps, two_forwards ? " (two forwards per step)" : "", rel, max_grad_rel);
  WORKER_CHECK(rel <= 1e-6, "latents differ from the single-process run by ", rel);
  check_ranks_identical(*pg, mine, "latents after training");
  if (compiled)
    WORKER_CHECK(compiled_step.stats().captures == 1 && compiled_step.stats().replays == steps - 1,
                 "expected 1 capture and ", steps - 1, " replays:\n", compiled_step.explain());
  dist::cleanup_ddp();
}

// ---- no_sync ----

void run_no_sync() {
  setup_from_env(60s);
  auto pg = dist::default_process_group();
  const int rank = pg->rank(), world = pg->size();
  const int64_t micro = 12;
  const Data a = make_data(micro, 21), b = make_data(micro, 22);

  // Reference: one step on the concatenation (mean over 2 * micro samples).
  mapping::MappingModel reference = make_model();
  nn::optim::Adam reference_opt(reference.parameters(), nn::optim::AdamOptions{.lr = 1e-2});
  Data both{cat({a.inputs, b.inputs}, 0), cat({a.targets, b.targets}, 0)};
  std::vector<std::vector<float>> reference_grads;
  for (int step = 0; step < 2; ++step) {
    reference_opt.zero_grad();
    nn::functional::cross_entropy(reference.run(both.inputs).predictions, both.targets).backward();
    reference_grads.push_back(flat_grads(reference));
    reference_opt.step();
  }

  mapping::MappingModel model = make_model();
  auto ddp = dist::wrap_ddp(model);
  dist::DistributedSampler sampler(micro, world, rank, false);
  const Tensor index = sampler.index_tensor();
  const Data a_shard = take(a, index), b_shard = take(b, index);
  nn::optim::Adam opt(ddp.parameters(), nn::optim::AdamOptions{.lr = 1e-2});
  for (int step = 0; step < 2; ++step) {
    opt.zero_grad();
    {
      auto guard = ddp.no_sync();
      mul(nn::functional::cross_entropy(ddp.forward(a_shard.inputs), a_shard.targets), 0.5).backward();
    }
    if (step == 0) {
      // No communication happened: the local grads still differ between ranks (different shards).
      const std::vector<float> local = flat_grads(model);
      Tensor all = zeros({static_cast<int64_t>(local.size()) * world});
      pg->allgather(from_vector(local), all)->wait();
      auto values = all.to_vector<float>();
      bool differs = false;
      for (size_t i = 0; i < local.size(); ++i) differs |= values[i] != values[local.size() + i];
      WORKER_CHECK(differs, "grads after the no_sync backward are identical across ranks: something was reduced");
    }
    mul(nn::functional::cross_entropy(ddp.forward(b_shard.inputs), b_shard.targets), 0.5).backward();
    const double grad_rel = relative_difference(flat_grads(model), reference_grads[static_cast<size_t>(step)]);
    WORKER_CHECK(grad_rel <= 1e-5, "step ", step,
                 ": accumulated gradients differ from the concatenated batch's by ", grad_rel);
    opt.step();
  }
  const auto mine = flat_latents(model);
  const double rel = relative_difference(mine, flat_latents(reference));
  std::printf("rank %d of %d: no_sync accumulation over 2 micro-batches, max relative latent difference: %.3g\n",
              rank, world, rel);
  WORKER_CHECK(rel <= 1e-6, "no_sync accumulation differs from the concatenated batch by ", rel);
  check_ranks_identical(*pg, mine, "latents after no_sync training");
  dist::cleanup_ddp();
}

// ---- a plain module: module_equivalence, gradient_sync ----

// Linear, BatchNorm1d (eval mode: its running statistics are buffers the output depends on), ReLU, Linear.
std::shared_ptr<nn::Sequential> make_mlp() {
  manual_seed(4321);
  auto net = std::make_shared<nn::Sequential>();
  net->push_back(std::make_shared<nn::Linear>(8, 16));
  net->push_back(std::make_shared<nn::BatchNorm1d>(16));
  net->push_back(std::make_shared<nn::ReLU>());
  net->push_back(std::make_shared<nn::Linear>(16, 4));
  net->eval();
  return net;
}

std::vector<float> flat_values(const std::vector<Tensor>& tensors, bool grads) {
  std::vector<float> out;
  for (const Tensor& t : tensors)
    for (float v : (grads ? t.grad() : t).to(DType::f32).to_vector<float>()) out.push_back(v);
  return out;
}

// N ranks on disjoint shards of a plain nn::Module == one process on the whole batch, after k Adam steps.
// Ranks other than 0 start from shifted parameters and buffers: the wrapper broadcasts rank 0's.
void run_module_equivalence(int argc, char** argv) {
  const int steps = std::stoi(arg_value(argc, argv, "--steps", "3"));
  const int64_t batch_size = 12;
  setup_from_env(60s);
  auto pg = dist::default_process_group();
  const int rank = pg->rank(), world = pg->size();
  const Data data = make_data(batch_size, 31);

  auto reference = make_mlp();
  nn::optim::Adam reference_opt(reference->parameters(), nn::optim::AdamOptions{.lr = 1e-2});
  std::vector<std::vector<float>> reference_grads;
  for (int step = 0; step < steps; ++step) {
    reference_opt.zero_grad();
    nn::functional::cross_entropy(reference->forward(data.inputs), data.targets).backward();
    reference_grads.push_back(flat_values(reference->parameters(), true));
    reference_opt.step();
  }

  auto net = make_mlp();
  if (rank != 0) {
    autograd::NoGradGuard no_grad;
    for (auto& [name, t] : net->named_parameters()) t.detach().copy_(add(t.detach(), 0.25 * rank));
    for (auto& [name, t] : net->named_buffers())
      if (t.dtype() == DType::f32) t.detach().copy_(add(t.detach(), 0.5 * rank));
  }
  auto ddp = dist::wrap_ddp(*net);
  WORKER_CHECK(ddp.bytes_per_step() == static_cast<size_t>(net->parameter_count()) * 4, "bytes_per_step ",
               ddp.bytes_per_step());
  check_ranks_identical(*pg, flat_values(net->parameters(), false), "parameters after wrapping");
  std::vector<Tensor> buffers;
  for (auto& [name, t] : net->named_buffers()) buffers.push_back(t);
  check_ranks_identical(*pg, flat_values(buffers, false), "buffers after wrapping");

  dist::DistributedSampler sampler(batch_size, world, rank, /*shuffle=*/true, /*seed=*/5);
  const Data shard = take(data, sampler.index_tensor());
  nn::optim::Adam opt(ddp.parameters(), nn::optim::AdamOptions{.lr = 1e-2});
  double max_grad_rel = 0;
  for (int step = 0; step < steps; ++step) {
    opt.zero_grad();
    nn::functional::cross_entropy(ddp(shard.inputs), shard.targets).backward();
    const double grad_rel =
        relative_difference(flat_values(net->parameters(), true), reference_grads[static_cast<size_t>(step)]);
    WORKER_CHECK(grad_rel <= 1e-5, "step ", step, ": averaged gradients differ from the full-batch ones by ", grad_rel);
    max_grad_rel = std::max(max_grad_rel, grad_rel);
    opt.step();
  }
  const auto mine = flat_values(net->parameters(), false);
  const double rel = relative_difference(mine, flat_values(reference->parameters(), false));
  std::printf("rank %d of %d: plain module, %d Adam steps, max relative difference to one process: parameters %.3g, "
              "grads %.3g\n", rank, world, steps, rel, max_grad_rel);
  WORKER_CHECK(rel <= 1e-6, "parameters differ from the single-process run by ", rel);
  check_ranks_identical(*pg, mine, "parameters after training");
  dist::cleanup_ddp();
}

// Gradient accumulation over 3 micro-batches per step through train::DataParallel: sync off for the
// first two == sync on for every one (the same parameters), with one all-reduce per bucket per step
// instead of per micro-batch. Also the interface's rank, world_size and average_metrics.
void run_gradient_sync() {
  setup_from_env(60s);
  auto pg = dist::default_process_group();
  const int rank = pg->rank(), world = pg->size();
  const int steps = 2, micro_batches = 3;
  const int64_t micro = 6;
  std::vector<Data> shards;
  dist::DistributedSampler sampler(micro, world, rank, false);
  for (int m = 0; m < micro_batches; ++m) shards.push_back(take(make_data(micro, 40 + m), sampler.index_tensor()));

  struct Outcome {
    std::vector<float> parameters;
    std::vector<std::vector<float>> grads;  // per step
    int64_t allreduces = 0;
    size_t buckets = 0;
  };
  auto accumulate = [&](bool sync_every_micro_batch) {
    auto net = make_mlp();
    dist::DdpOptions options;
    options.first_bucket_bytes = 64;  // several buckets
    options.bucket_bytes = 256;
    dist::DistributedDataParallel ddp(*net, dist::default_process_group(), options);
    train::DataParallel& dp = ddp;
    WORKER_CHECK(dp.rank() == rank && dp.world_size() == world, "rank ", dp.rank(), " of ", dp.world_size());
    nn::optim::Adam opt(ddp.parameters(), nn::optim::AdamOptions{.lr = 1e-2});
    Outcome out;
    out.buckets = ddp.bucket_parameter_names().size();
    const int64_t before = ddp.allreduce_count();
    for (int step = 0; step < steps; ++step) {
      opt.zero_grad();
      for (int m = 0; m < micro_batches; ++m) {
        dp.set_gradient_sync(sync_every_micro_batch || m == micro_batches - 1);
        const Data& b = shards[static_cast<size_t>(m)];
        mul(nn::functional::cross_entropy(ddp(b.inputs), b.targets), 1.0 / micro_batches).backward();
      }
      out.grads.push_back(flat_values(net->parameters(), true));
      opt.step();
    }
    WORKER_CHECK(dp.gradient_sync(), "the last micro-batch left gradient sync on");
    out.allreduces = ddp.allreduce_count() - before;
    out.parameters = flat_values(net->parameters(), false);
    return out;
  };
  const Outcome every = accumulate(true);
  const Outcome last_only = accumulate(false);
  WORKER_CHECK(every.buckets > 1, "expected several buckets, got ", every.buckets);
  WORKER_CHECK(every.allreduces == static_cast<int64_t>(steps * micro_batches * every.buckets), "syncing every "
               "micro-batch launched ", every.allreduces, " all-reduces");
  WORKER_CHECK(last_only.allreduces == static_cast<int64_t>(steps * last_only.buckets), "syncing the last "
               "micro-batch only launched ", last_only.allreduces, " all-reduces");
  for (int step = 0; step < steps; ++step) {
    const double grad_rel = relative_difference(last_only.grads[static_cast<size_t>(step)],
                                                every.grads[static_cast<size_t>(step)]);
    WORKER_CHECK(grad_rel <= 1e-5, "step ", step, ": accumulated gradients differ by ", grad_rel);
  }
  const double rel = relative_difference(last_only.parameters, every.parameters);
  WORKER_CHECK(rel <= 1e-5, "parameters differ by ", rel);
  check_ranks_identical(*pg, last_only.parameters, "parameters after accumulation");
  std::printf("rank %d of %d: %d steps x %d micro-batches, all-reduces %lld (sync every micro-batch) vs %lld (last "
              "only), max relative parameter difference %.3g\n", rank, world, steps, micro_batches,
              static_cast<long long>(every.allreduces), static_cast<long long>(last_only.allreduces), rel);

  // The interface's metrics: rank r reports value r over r + 1 samples.
  auto net = make_mlp();
  dist::DistributedDataParallel ddp(*net, dist::default_process_group());
  train::DataParallel& dp = ddp;
  const train::Metrics all = dp.average_metrics({{"value", static_cast<double>(rank)}}, rank + 1);
  double weighted = 0, samples = 0;
  for (int r = 0; r < world; ++r) {
    weighted += r * (r + 1.0);
    samples += r + 1.0;
  }
  WORKER_CHECK(std::abs(all.at("value") - weighted / samples) <= 1e-6, "average_metrics gave ", all.at("value"),
               ", expected ", weighted / samples);
  dist::cleanup_ddp();
}

// ---- buffer_mismatch ----

// Rank 1 builds its mappers from another seed: wrapping must fail on every rank, naming the group.
void run_buffer_mismatch() {
  setup_from_env(60s);
  mapping::MappingModel model = make_model(g_rank == 1 ? 100 : 99);
  auto ddp = dist::wrap_ddp(model);
  WORKER_CHECK(false, "wrap_ddp accepted mapper buffers that differ between ranks");
}

// ---- kill ----

int run_kill(int argc, char** argv) {
  const int kill_rank = std::stoi(arg_value(argc, argv, "--kill-rank", "1"));
  const int after_step = std::stoi(arg_value(argc, argv, "--after-step", "2"));
  const double timeout_s = std::stod(arg_value(argc, argv, "--timeout", "10"));
  // The survivors must show their own error path, not the launcher's SIGTERM.
  if (has_flag(argc, argv, "--ignore-sigterm")) signal(SIGTERM, SIG_IGN);
  setup_from_env(Milliseconds(static_cast<int64_t>(timeout_s * 1000)));
  auto pg = dist::default_process_group();
  const int rank = pg->rank(), world = pg->size();
  mapping::MappingModel model = make_model();
  auto ddp = dist::wrap_ddp(model);
  dist::DistributedSampler sampler(12, world, rank, false);
  const Data shard = take(make_data(12, 5), sampler.index_tensor());
  nn::optim::Adam opt(ddp.parameters(), nn::optim::AdamOptions{.lr = 1e-2});
  auto last_ok = std::chrono::steady_clock::now();
  for (int step = 1; step <= 100000; ++step) {
    try {
      opt.zero_grad();
      nn::functional::cross_entropy(ddp.forward(shard.inputs), shard.targets).backward();
      opt.step();
    } catch (const Error& e) {
      const double after = std::chrono::duration<double>(std::chrono::steady_clock::now() - last_ok).count();
      std::fprintf(stderr, "rank %d: training stopped at step %d, %.2f s after the last good step: %s\n", rank,
                   step, after, e.what());
      return 3;
    }
    last_ok = std::chrono::steady_clock::now();
    if (step == after_step && rank == kill_rank) {
      std::fprintf(stderr, "rank %d: raising SIGKILL after step %d\n", rank, step);
      std::fflush(stderr);
      raise(SIGKILL);
    }
  }
  std::fprintf(stderr, "rank %d: finished all steps without noticing the dead rank\n", rank);
  return 1;
}

// ---- restart ----

int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? static_cast<int>(dist::parse_int_variable(name, v)) : -1;
}

int run_restart(int argc, char** argv) {
  const int fail_rank = std::stoi(arg_value(argc, argv, "--fail-rank", "1"));
  const int fail_attempts = std::stoi(arg_value(argc, argv, "--fail-attempts", "1"));
  const dist::AgentStore agent = dist::agent_store_from_env();
  WORKER_CHECK(agent.used, "TORCHELASTIC_USE_AGENT_STORE is not True under mn-run");
  setup_from_env(30s);  // a rendezvous in the attempt's own namespace of the launcher's store
  auto pg = dist::default_process_group();
  const int rank = pg->rank(), world = pg->size();
  WORKER_CHECK(rank == env_int("GROUP_RANK") * env_int("LOCAL_WORLD_SIZE") + env_int("LOCAL_RANK"),
               "RANK ", rank, " != GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK");
  WORKER_CHECK(world == env_int("GROUP_WORLD_SIZE") * env_int("LOCAL_WORLD_SIZE"),
               "WORLD_SIZE ", world, " != GROUP_WORLD_SIZE * LOCAL_WORLD_SIZE");
  std::printf("rank %d: attempt %d joined\n", rank, agent.restart_count);
  std::fflush(stdout);
  if (agent.restart_count < fail_attempts && rank == fail_rank) {
    std::fprintf(stderr, "rank %d: failing on purpose in attempt %d\n", rank, agent.restart_count);
    std::fflush(stderr);
    std::_Exit(1);
  }
  if (agent.restart_count < fail_attempts) {
    std::this_thread::sleep_for(60s);  // stopped by the launcher
    return 1;
  }
  Tensor t = full({1}, static_cast<double>(rank + 1));
  pg->allreduce(t, dist::ReduceOp::Sum)->wait();
  WORKER_CHECK(t.to_vector<float>()[0] == world * (world + 1) / 2.0f, "all-reduce after the restart gave ",
               t.to_vector<float>()[0]);
  dist::cleanup_ddp();
  return 0;
}

// ---- stall ----

// Exit 3 when the expected timeout error came (and the next collective failed at once), 1 otherwise.
int run_stall(int argc, char** argv) {
  const int stall_rank = std::stoi(arg_value(argc, argv, "--stall-rank", "1"));
  const double stall_s = std::stod(arg_value(argc, argv, "--stall-seconds", "20"));
  const double timeout_s = std::stod(arg_value(argc, argv, "--timeout", "2"));
  setup_from_env(Milliseconds(static_cast<int64_t>(timeout_s * 1000)));
  auto pg = dist::default_process_group();
  if (pg->rank() == stall_rank) std::this_thread::sleep_for(std::chrono::duration<double>(stall_s));
  Tensor t = ones({16});
  const auto start = std::chrono::steady_clock::now();
  try {
    pg->allreduce(t)->wait();
  } catch (const Error& e) {
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "rank %d: all-reduce failed after %.2f s: %s\n", pg->rank(), waited, e.what());
    try {
      pg->barrier()->wait();
    } catch (const Error& later) {
      std::fprintf(stderr, "rank %d: then: %s\n", pg->rank(), later.what());
      return waited >= 0.9 * timeout_s && waited < timeout_s + 5 ? 3 : 1;
    }
    return 1;
  }
  std::fprintf(stderr, "rank %d: the all-reduce completed although rank %d stalled\n", pg->rank(), stall_rank);
  return 1;
}

// ---- affinity ----

void run_affinity() {
  setup_from_env(60s);
  auto pg = dist::default_process_group();
  const int world = pg->size();
  cpu_set_t set;
  CPU_ZERO(&set);
  WORKER_CHECK(sched_getaffinity(0, sizeof(set), &set) == 0, "cannot read the affinity mask");
  std::vector<int64_t> mine(CPU_SETSIZE / 64, 0);  // the mask as 64-bit words
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &set)) mine[static_cast<size_t>(cpu / 64)] |= int64_t{1} << (cpu % 64);
  const int count = CPU_COUNT(&set);
  // Threads: the CPUs bound, or fewer under a cgroup CPU limit (its whole CPUs shared by the node's ranks).
  const int quota = mn::cpu_load::quota_cpus(mn::cpu_load::cgroup_cpu_limit());
  const int local_world = std::atoi(std::getenv("LOCAL_WORLD_SIZE") ? std::getenv("LOCAL_WORLD_SIZE") : "1");
  const int threads = quota > 0 ? std::max(1, std::min(count, quota / std::max(1, local_world))) : count;
  const char* omp = std::getenv("OMP_NUM_THREADS");
  WORKER_CHECK(omp != nullptr && std::to_string(threads) == omp, "OMP_NUM_THREADS is '", omp ? omp : "(unset)",
               "' but the rank is bound to ", count, " CPU(s) (", threads, " thread(s) within the cgroup CPU limit)");
  const int64_t words = static_cast<int64_t>(mine.size());
  Tensor all = zeros({words * world}, TensorOptions(DType::i64));
  pg->allgather(from_vector(mine, Shape{words}), all)->wait();
  const std::vector<int64_t> masks = all.to_vector<int64_t>();
  for (int r = 0; r < world; ++r) {
    int other_count = 0;
    for (int64_t w = 0; w < words; ++w) {
      const auto word = static_cast<uint64_t>(masks[static_cast<size_t>(r * words + w)]);
      other_count += std::popcount(word);
      if (r != g_rank)
        WORKER_CHECK((word & static_cast<uint64_t>(mine[static_cast<size_t>(w)])) == 0, "ranks ", g_rank, " and ",
                     r, " share a CPU");
    }
    WORKER_CHECK(other_count == count, "rank ", r, " is bound to ", other_count, " CPU(s), this rank to ", count);
  }
  dist::cleanup_ddp();
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  g_backend = arg_value(argc, argv, "--backend", "gloo");
  try {
    if (mode == "collectives") {
      run_collectives();
    } else if (mode == "equivalence") {
      run_equivalence(argc, argv);
    } else if (mode == "no_sync") {
      run_no_sync();
    } else if (mode == "module_equivalence") {
      run_module_equivalence(argc, argv);
    } else if (mode == "gradient_sync") {
      run_gradient_sync();
    } else if (mode == "buffer_mismatch") {
      run_buffer_mismatch();
    } else if (mode == "kill") {
      return run_kill(argc, argv);
    } else if (mode == "stall") {
      return run_stall(argc, argv);
    } else if (mode == "affinity") {
      run_affinity();
    } else if (mode == "backend_mismatch") {
      dist::EnvConfig env = dist::from_env();
      g_rank = env.rank;
      std::vector<std::string> backends;
      std::string list = arg_value(argc, argv, "--backends", "gloo") + ",";
      for (size_t start = 0, comma; (comma = list.find(',', start)) != std::string::npos; start = comma + 1)
        backends.push_back(list.substr(start, comma - start));
      const std::string& mine = backends[static_cast<size_t>(env.rank) % backends.size()];
      dist::setup_ddp(env.rank, env.world_size, mine, "env://", 20000ms);
      dist::cleanup_ddp();
    } else if (mode == "restart") {
      if (run_restart(argc, argv) != 0) return 1;
    } else if (mode == "env") {
      dist::EnvConfig env = dist::from_env();
      std::printf("rank %d of %d at %s:%u\n", env.rank, env.world_size, env.master_addr.c_str(), env.master_port);
    } else {
      std::fprintf(stderr,
                   "usage: dist_worker collectives|equivalence|no_sync|module_equivalence|gradient_sync|"
                   "buffer_mismatch|kill|stall|affinity|env|backend_mismatch|restart [options] [--backend gloo|mpi]\n");
      return 2;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: error: %s\n", g_rank, e.what());
    return 1;
  }
  if (g_failures > 0) {
    std::fprintf(stderr, "rank %d: %d check(s) failed\n", g_rank, g_failures);
    return 1;
  }
  std::printf("rank %d: %s passed\n", g_rank, mode.c_str());
  return 0;
}
