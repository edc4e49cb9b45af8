// The thread contract (README, "Threads"): independent models train on several threads at once with
// the results of one thread, bit for bit, while sharing the op table, the allocator, the default
// generator and leaves that are only read. Built with -fsanitize=thread (./mn build --sanitize=thread)
// this is also the race check: run it with MN_NO_CACHING=1 and OMP_NUM_THREADS=1 (libgomp is not
// built with TSan, so its barriers are invisible to it and every kernel's parallel region would be
// reported as a race; one OpenMP thread keeps the kernels on the calling thread).
#include <omp.h>

#include <atomic>
#include <barrier>
#include <memory>
#include <thread>
#include <vector>

#include "kernels/dispatch.h"
#include "mapping/mapping_model.h"
#include "nn/functional.h"
#include "nn/layers.h"
#include "nn/optim.h"
#include "tests/test_support.h"

using namespace mn;
namespace F = mn::nn::functional;

namespace {

constexpr int kWorkers = 4;

// One worker's models and data, built on the main thread (layers draw their initial values from the
// default generator, whose order would otherwise depend on the schedule).
struct Job {
  std::shared_ptr<nn::Sequential> mlp;         // trained directly
  std::unique_ptr<mapping::MappingModel> cnn;  // trained through its latents
  Tensor x_flat, x_image, labels;
};

Job make_job(int index) {
  manual_seed(1000 + index);
  Job job;
  job.mlp = std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
      std::make_shared<nn::Linear>(12, 16), std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(16, 4)});
  auto cnn = std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
      std::make_shared<nn::Conv2d>(1, 3, 3), std::make_shared<nn::ReLU>(), std::make_shared<nn::MaxPool2d>(2),
      std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(3 * 3 * 3, 4)});
  mapping::MappingOptions options;
  options.latent_dim = 8;
  options.seed = 7 + index;
  job.cnn = std::make_unique<mapping::MappingModel>(cnn, options);
  Generator gen(50 + index);
  job.x_flat = randn({6, 12}, {}, &gen);
  job.x_image = randn({6, 1, 8, 8}, {}, &gen);
  job.labels = from_vector(std::vector<int64_t>{0, 1, 2, 3, 1, 2}, {6});
  return job;
}

// Two optimizer steps of each model, plus a term through `shared`, a leaf every worker reads with the
// same input (so its accumulated gradient is the same sum in any order). Returns every loss, gradient
// and updated parameter.
std::vector<std::vector<float>> run_job(Job& job, const Tensor& shared, const Tensor& shared_input) {
  std::vector<std::vector<float>> out;
  nn::optim::Adam mlp_opt(job.mlp->parameters(), {.lr = 1e-2});
  nn::optim::Adam cnn_opt(job.cnn->parameters(), {.lr = 1e-2});
  for (int step = 0; step < 2; ++step) {
    mlp_opt.zero_grad();
    cnn_opt.zero_grad();
    Tensor mlp_loss = F::cross_entropy(job.mlp->forward(job.x_flat), job.labels);
    Tensor cnn_loss = F::cross_entropy(job.cnn->run(job.x_image).predictions, job.labels);
    Tensor loss = mlp_loss + cnn_loss;
    if (step == 0) loss = loss + sum(shared * shared_input);
    loss.backward();
    out.push_back(mlp_loss.to_vector<float>());
    out.push_back(cnn_loss.to_vector<float>());
    for (const Tensor& p : job.mlp->parameters()) out.push_back(p.grad().to_vector<float>());
    for (const Tensor& z : job.cnn->parameters()) out.push_back(z.grad().to_vector<float>());
    mlp_opt.step();
    cnn_opt.step();
  }
  for (const Tensor& p : job.mlp->parameters()) out.push_back(p.to_vector<float>());
  for (const Tensor& z : job.cnn->parameters()) out.push_back(z.to_vector<float>());
  return out;
}

}  // namespace

TEST_CASE("threads: independent models train on 4 threads with the single-threaded results bit for bit") {
  const Tensor shared_input = testing::random_tensor({5}, 3);

  // Reference: the jobs one after another on this thread.
  Tensor shared = testing::random_param({5}, 4);
  std::vector<std::vector<std::vector<float>>> expected;
  for (int i = 0; i < kWorkers; ++i) {
    Job job = make_job(i);
    expected.push_back(run_job(job, shared, shared_input));
  }
  const std::vector<float> expected_shared_grad = shared.grad().to_vector<float>();

  // The same jobs, freshly built, all at once. Grad mode is per thread: turning it off here must not
  // reach the workers. Each worker uses this thread's OpenMP team size (a new thread starts from the
  // environment's), so reductions split their work the same way.
  Tensor shared2 = testing::random_param({5}, 4);
  std::vector<Job> jobs;
  for (int i = 0; i < kWorkers; ++i) jobs.push_back(make_job(i));
  std::vector<std::vector<std::vector<float>>> got(kWorkers);
  std::vector<std::string> errors(kWorkers);
  const int omp_threads = omp_get_max_threads();
  {
    autograd::NoGradGuard no_grad;
    std::vector<std::thread> workers;
    for (int i = 0; i < kWorkers; ++i)
      workers.emplace_back([&, i] {
        omp_set_num_threads(omp_threads);
        try {
          got[i] = run_job(jobs[i], shared2, shared_input);
        } catch (const std::exception& e) {
          errors[i] = e.what();
        }
      });
    for (auto& w : workers) w.join();
  }
  for (int i = 0; i < kWorkers; ++i) {
    INFO("worker " << i);
    CHECK(errors[i] == "");
    CHECK(got[i] == expected[i]);
  }
  CHECK(shared2.grad().to_vector<float>() == expected_shared_grad);
}

namespace {
void twice(int* out, int x) { *out = 2 * x; }
}  // namespace

TEST_CASE("threads: an op slot filled on one thread is read on another without a race") {
  // What happens when two threads make the first kernel calls of a process: one fills the table
  // inside call_once while the other's fast path already reads the slots. (A data race on a plain
  // pointer before the slots were atomics; ThreadSanitizer reports it.)
  kernels::Op<void(int*, int)> op("twice");
  std::atomic<bool> started{false};
  int result = 0;
  std::thread reader([&] {
    started = true;
    while (!op.has(DeviceType::CPU)) std::this_thread::yield();
    op(kCPU, &result, 21);
  });
  while (!started) std::this_thread::yield();
  op.set(DeviceType::CPU, &twice);
  reader.join();
  CHECK(result == 42);
}

TEST_CASE("threads: a shared leaf gets one metadata block, one accumulator and every gradient") {
  // Four threads reach the same tensor at the same moment (a barrier releases them together): the
  // lazily created autograd metadata and AccumulateGrad sink must come out single, and the four
  // accumulations must all land. Each round uses fresh tensors, so each round races creation again.
  constexpr int kRounds = 50;
  for (int round = 0; round < kRounds; ++round) {
    Tensor plain = zeros({3});  // no autograd metadata yet
    Tensor leaf = zeros({3});
    leaf.requires_grad_(true);  // metadata, but no accumulator yet
    std::vector<Tensor> grads;
    for (int i = 0; i < kWorkers; ++i) grads.push_back(ones({3}));
    std::vector<autograd::AutogradMeta*> metas(kWorkers);
    std::vector<std::shared_ptr<autograd::Node>> sinks(kWorkers);
    std::barrier sync(kWorkers);
    std::vector<std::thread> workers;
    for (int i = 0; i < kWorkers; ++i)
      workers.emplace_back([&, i] {
        autograd::NoGradGuard no_grad;  // as the engine runs a sink without create_graph
        sync.arrive_and_wait();
        metas[i] = &autograd::ensure_meta(plain);
        sinks[i] = autograd::grad_accumulator(leaf);
        sync.arrive_and_wait();
        sinks[i]->apply({std::move(grads[i])});
      });
    for (auto& w : workers) w.join();
    INFO("round " << round);
    for (int i = 1; i < kWorkers; ++i) {
      CHECK(metas[i] == metas[0]);
      CHECK(sinks[i] == sinks[0]);
    }
    CHECK(leaf.grad().to_vector<float>() == std::vector<float>(3, static_cast<float>(kWorkers)));
  }
}
