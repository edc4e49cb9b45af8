// Convolution layers shaped like the CNN2 target network on Fashion-MNIST (batch 128):
//   conv1: x[128, 1, 28, 28] * w[16, 1, 3, 3]      conv2: x[128, 16, 13, 13] * w[32, 16, 3, 3]
// forward alone, and forward + backward (weight and bias gradients; conv2 also the input gradient,
// since its input comes from an earlier layer). Run with e.g.
//   OMP_NUM_THREADS=2 mn_bench_conv --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include "core/random.h"
#include "nn/functional.h"

namespace {

using namespace mn;
namespace F = mn::nn::functional;

struct ConvLayer {
  Shape x, w;
  bool input_grad;
};
const ConvLayer kLayers[] = {{{128, 1, 28, 28}, {16, 1, 3, 3}, false}, {{128, 16, 13, 13}, {32, 16, 3, 3}, true}};

Tensor random_tensor(const Shape& shape, uint64_t seed, bool requires_grad) {
  Generator gen(seed);
  Tensor t = normal(shape, 0.0, 0.1, {}, &gen);
  return requires_grad ? t.requires_grad_(true) : t;
}

// Multiply-adds of the forward pass x 2.
double forward_flops(const ConvLayer& l) {
  const double out_h = l.x[2] - l.w[2] + 1, out_w = l.x[3] - l.w[3] + 1;
  return 2.0 * l.x[0] * l.w[0] * out_h * out_w * l.w[1] * l.w[2] * l.w[3];
}

void BM_ConvForward(benchmark::State& state) {
  const ConvLayer& l = kLayers[state.range(0)];
  const Tensor x = random_tensor(l.x, 1, false), w = random_tensor(l.w, 2, false), b = random_tensor({l.w[0]}, 3, false);
  for (auto _ : state) benchmark::DoNotOptimize(F::conv2d(x, w, b).data<float>());
  state.counters["GFLOPS"] = benchmark::Counter(forward_flops(l), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_ConvForward)->Arg(0)->Arg(1)->ArgName("layer")->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_ConvForwardBackward(benchmark::State& state) {
  const ConvLayer& l = kLayers[state.range(0)];
  Tensor x = random_tensor(l.x, 1, l.input_grad), w = random_tensor(l.w, 2, true), b = random_tensor({l.w[0]}, 3, true);
  Tensor grad;
  for (auto _ : state) {
    w.set_grad(Tensor());
    b.set_grad(Tensor());
    if (l.input_grad) x.set_grad(Tensor());
    Tensor y = F::conv2d(x, w, b);
    if (!grad.defined()) grad = ones(y.sizes());
    y.backward(grad);
    benchmark::DoNotOptimize(w.grad().data<float>());
  }
  // Backward costs one forward-sized product per gradient (weight, and input when needed).
  const double passes = l.input_grad ? 3.0 : 2.0;
  state.counters["GFLOPS"] =
      benchmark::Counter(passes * forward_flops(l), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_ConvForwardBackward)->Arg(0)->Arg(1)->ArgName("layer")->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
