// Matrix product throughput through the mm op (gemm kernel: the packed AVX-512 GEMM, or Eigen's, split
// over OpenMP threads by output blocks). mn_bench_report sets 1024^3 and 2048^3 against the FMA peak
// (target >= 80 %). Run with OMP_NUM_THREADS set, e.g.
//   OMP_NUM_THREADS=2 mn_bench_matmul --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
// BM_GemmTargetShape runs the products the targets make (the mapper's chunks, the convolutions'
// per-sample products, a linear layer) on one thread, as they run inside the parallel regions, with
// each kernel in turn (kernel:0 packed, kernel:1 Eigen's) so the two are compared in one run.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <iterator>

#include "autograd/ops.h"
#include "core/random.h"
#include "kernels/cpu/packed_gemm.h"

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

// One product of a target, C[m, n] = A[m, k] B[k, n], with A or B read through a transposed view as
// the target's kernel reads it.
struct TargetShape {
  const char* name;
  int64_t m, n, k;
  bool a_transposed, b_transposed;
};
const TargetShape kTargetShapes[] = {
    {"cnn2 mapper chunk z*W (97x672 . Q^T)", 97, 672, 672, false, true},
    {"cnn2 mapper chunk backward (U Q)", 97, 672, 672, false, false},
    {"cnn1.conv2 forward (W . cols)", 64, 196, 288, false, false},
    {"cnn1.conv2 input grad (W^T . g)", 288, 196, 64, true, false},
    {"cnn1.conv2 weight grad (g . cols^T)", 64, 288, 196, false, true},
    {"resnet20.s1 forward (W . cols)", 16, 784, 144, false, false},
    {"resnet20.s3 forward (W . cols)", 64, 49, 576, false, false},
    {"mlp fc1 forward, batch 64 (x . W^T)", 64, 256, 784, false, true},
};

void BM_GemmTargetShape(benchmark::State& state) {
  const TargetShape& s = kTargetShapes[state.range(0)];
  const bool eigen = state.range(1) != 0;
  if (eigen && !kernels::cpu::packed_gemm_built()) {
    state.SkipWithError("this build has Eigen's kernel only; kernel:0 runs it");
    return;
  }
  const Tensor a = s.a_transposed ? random_matrix({s.k, s.m}, 7).t() : random_matrix({s.m, s.k}, 7);
  const Tensor b = s.b_transposed ? random_matrix({s.n, s.k}, 8).t() : random_matrix({s.k, s.n}, 8);
  const bool saved = kernels::cpu::packed_gemm_enabled();
  const int threads = omp_get_max_threads();
  kernels::cpu::set_packed_gemm(!eigen);
  omp_set_num_threads(1);
  for (auto _ : state) benchmark::DoNotOptimize(mm(a, b).data<float>());
  omp_set_num_threads(threads);
  kernels::cpu::set_packed_gemm(saved);
  state.SetLabel(s.name);
  state.counters["packed"] = !eigen && kernels::cpu::packed_gemm_built() ? 1 : 0;
  set_flops(state, 2.0 * s.m * s.n * s.k);
}
BENCHMARK(BM_GemmTargetShape)
    ->ArgNames({"shape", "kernel"})
    ->ArgsProduct({benchmark::CreateDenseRange(0, std::size(kTargetShapes) - 1, 1), {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// Many small products: the batch is spread over the threads.
void BM_BmmSmall(benchmark::State& state) {
  const int64_t batch = 256, n = state.range(0);
  const Tensor a = random_matrix({batch, n, n}, 5), b = random_matrix({batch, n, n}, 6);
  for (auto _ : state) benchmark::DoNotOptimize(bmm(a, b).data<float>());
  set_flops(state, 2.0 * batch * n * n * n);
}
BENCHMARK(BM_BmmSmall)->ArgName("n")->Arg(32)->Arg(64)->Unit(benchmark::kMicrosecond)->UseRealTime();

}  // namespace
