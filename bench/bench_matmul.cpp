// Matrix product throughput through the mm op (gemm kernel: Eigen GEMM, split over OpenMP threads by
// output blocks). Target: 1024^3 f32 on 2 threads >= 220 GFLOP/s. Run with OMP_NUM_THREADS set, e.g.
//   OMP_NUM_THREADS=2 mn_bench_matmul --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include "autograd/ops.h"
#include "core/random.h"

namespace {

using namespace mn;

Tensor random_matrix(const Shape& shape, uint64_t seed) {
  Generator gen(seed);
  return randn(shape, {}, &gen);
}

// Reported as flop/s (printed with an SI prefix, e.g. "231G/s" = 231 GFLOP/s).
void set_flops(benchmark::State& state, double flops_per_iteration) {
  state.counters["GFLOPS"] = benchmark::Counter(flops_per_iteration, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_MatmulSquare(benchmark::State& state) {
  const int64_t n = state.range(0);
  const Tensor a = random_matrix({n, n}, 1), b = random_matrix({n, n}, 2);
  for (auto _ : state) benchmark::DoNotOptimize(mm(a, b).data<float>());
  set_flops(state, 2.0 * n * n * n);
}
BENCHMARK(BM_MatmulSquare)->ArgName("n")->Arg(256)->Arg(512)->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();

// x @ W^T with W read through a transposed view, as linear() does.
void BM_MatmulTransposedRhs(benchmark::State& state) {
  const int64_t n = state.range(0);
  const Tensor a = random_matrix({n, n}, 3), w = random_matrix({n, n}, 4);
  for (auto _ : state) benchmark::DoNotOptimize(mm(a, w.t()).data<float>());
  set_flops(state, 2.0 * n * n * n);
}
BENCHMARK(BM_MatmulTransposedRhs)->ArgName("n")->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime();

// Many small products: the batch is spread over the threads.
void BM_BmmSmall(benchmark::State& state) {
  const int64_t batch = 256, n = state.range(0);
  const Tensor a = random_matrix({batch, n, n}, 5), b = random_matrix({batch, n, n}, 6);
  for (auto _ : state) benchmark::DoNotOptimize(bmm(a, b).data<float>());
  set_flops(state, 2.0 * batch * n * n * n);
}
BENCHMARK(BM_BmmSmall)->ArgName("n")->Arg(32)->Arg(64)->Unit(benchmark::kMicrosecond)->UseRealTime();

}  // namespace
