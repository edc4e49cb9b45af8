// Reductions, softmax and cross entropy at sizes a training step meets: a full sum over 1M elements,
// row and column sums of a [1024, 1024] matrix (column = bias gradient layout), softmax and fused cross
// entropy (forward + backward) on [256, 1000] logits. Bytes processed let the numbers be read as
// memory bandwidth. Wall time (UseRealTime): the kernels are OpenMP-parallel, and the calling
// thread's CPU time would undercount them.
#include <benchmark/benchmark.h>

#include "autograd/node.h"
#include "autograd/ops.h"
#include "core/random.h"
#include "nn/functional.h"

using namespace mn;

namespace {

Tensor random_matrix(const Shape& shape) {
  Generator gen(1);
  return normal(shape, 0.0, 1.0, {}, &gen);
}

void set_bytes(benchmark::State& state, const Tensor& t) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(t.nbytes()));
}

}  // namespace

static void BM_SumAll_1M(benchmark::State& state) {
  Tensor x = random_matrix({1 << 20});
  for (auto _ : state) benchmark::DoNotOptimize(sum(x).raw_data());
  set_bytes(state, x);
}
BENCHMARK(BM_SumAll_1M)->UseRealTime();

static void BM_SumRows_1024x1024(benchmark::State& state) {
  Tensor x = random_matrix({1024, 1024});
  for (auto _ : state) benchmark::DoNotOptimize(sum(x, {1}).raw_data());
  set_bytes(state, x);
}
BENCHMARK(BM_SumRows_1024x1024)->UseRealTime();

static void BM_SumColumns_1024x1024(benchmark::State& state) {
  Tensor x = random_matrix({1024, 1024});
  for (auto _ : state) benchmark::DoNotOptimize(sum(x, {0}).raw_data());
  set_bytes(state, x);
}
BENCHMARK(BM_SumColumns_1024x1024)->UseRealTime();

static void BM_MaxAll_1M(benchmark::State& state) {
  Tensor x = random_matrix({1 << 20});
  for (auto _ : state) benchmark::DoNotOptimize(max(x).raw_data());
  set_bytes(state, x);
}
BENCHMARK(BM_MaxAll_1M)->UseRealTime();

static void BM_VarRows_1024x1024(benchmark::State& state) {
  Tensor x = random_matrix({1024, 1024});
  for (auto _ : state) benchmark::DoNotOptimize(var(x, {1}).raw_data());
  set_bytes(state, x);
}
BENCHMARK(BM_VarRows_1024x1024)->UseRealTime();

static void BM_Softmax_256x1000(benchmark::State& state) {
  Tensor x = random_matrix({256, 1000});
  for (auto _ : state) benchmark::DoNotOptimize(softmax(x, 1).raw_data());
  set_bytes(state, x);
}
BENCHMARK(BM_Softmax_256x1000)->UseRealTime();

static void BM_CrossEntropy_ForwardBackward_256x1000(benchmark::State& state) {
  Tensor x = random_matrix({256, 1000}).requires_grad_(true);
  std::vector<int64_t> labels(256);
  for (int i = 0; i < 256; ++i) labels[i] = (i * 37) % 1000;
  Tensor target = from_vector(labels);
  for (auto _ : state) {
    nn::functional::cross_entropy(x, target, 0.1).backward();
    x.set_grad(Tensor());
  }
  set_bytes(state, x);
}
BENCHMARK(BM_CrossEntropy_ForwardBackward_256x1000)->UseRealTime();
