// Every distinct convolution of the CNN2, CNN1 and ResNet-20 targets (mapping/targets.h) at the batch
// their training-step benchmarks use (128), forward alone and forward + backward. The first conv of
// each network reads the image, so it needs no input gradient; the others do (as in training).
// bench/compare_torch.py times the same layers in PyTorch and prints ours / torch per layer. Run e.g.
//   OMP_NUM_THREADS=2 mn_bench_conv --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
// The benchmark's label is the layer's name (kConvLayers below; compare_torch.py keeps its own copy
// of the table, keyed by the same names).
#include <benchmark/benchmark.h>

#include "core/random.h"
#include "nn/functional.h"

namespace {

using namespace mn;
namespace F = mn::nn::functional;

struct ConvLayer {
  const char* name;
  Shape x, w;
  int64_t stride, pad;
  bool bias, input_grad;
};
// name: network.layer (resnet20: stem, s<stage>[.down] for the stride-2 entry, .ds the 1x1 shortcut).
const ConvLayer kConvLayers[] = {
    {"cnn2.conv1", {128, 1, 28, 28}, {16, 1, 3, 3}, 1, 0, true, false},
    {"cnn2.conv2", {128, 16, 13, 13}, {32, 16, 3, 3}, 1, 0, true, true},
    {"cnn1.conv1", {128, 1, 28, 28}, {32, 1, 3, 3}, 1, 1, true, false},
    {"cnn1.conv2", {128, 32, 14, 14}, {64, 32, 3, 3}, 1, 1, true, true},
    {"cnn1.conv3", {128, 64, 7, 7}, {128, 64, 3, 3}, 1, 1, true, true},
    {"cnn1.conv4", {128, 128, 7, 7}, {128, 128, 3, 3}, 1, 1, true, true},
    {"resnet20.stem", {128, 1, 28, 28}, {16, 1, 3, 3}, 1, 1, false, false},
    {"resnet20.s1", {128, 16, 28, 28}, {16, 16, 3, 3}, 1, 1, false, true},
    {"resnet20.s2.down", {128, 16, 28, 28}, {32, 16, 3, 3}, 2, 1, false, true},
    {"resnet20.s2.ds", {128, 16, 28, 28}, {32, 16, 1, 1}, 2, 0, false, true},
    {"resnet20.s2", {128, 32, 14, 14}, {32, 32, 3, 3}, 1, 1, false, true},
    {"resnet20.s3.down", {128, 32, 14, 14}, {64, 32, 3, 3}, 2, 1, false, true},
    {"resnet20.s3.ds", {128, 32, 14, 14}, {64, 32, 1, 1}, 2, 0, false, true},
    {"resnet20.s3", {128, 64, 7, 7}, {64, 64, 3, 3}, 1, 1, false, true},
};
constexpr int64_t kConvLayerCount = static_cast<int64_t>(std::size(kConvLayers));

Tensor random_tensor(const Shape& shape, uint64_t seed, bool requires_grad) {
  Generator gen(seed);
  Tensor t = normal(shape, 0.0, 0.1, {}, &gen);
  return requires_grad ? t.requires_grad_(true) : t;
}

// Multiply-adds of the forward pass x 2.
double forward_flops(const ConvLayer& l) {
  const double out_h = (l.x[2] + 2 * l.pad - l.w[2]) / l.stride + 1;
  const double out_w = (l.x[3] + 2 * l.pad - l.w[3]) / l.stride + 1;
  return 2.0 * l.x[0] * l.w[0] * out_h * out_w * l.w[1] * l.w[2] * l.w[3];
}

Tensor run_conv(const ConvLayer& l, const Tensor& x, const Tensor& w, const Tensor& b) {
  return F::conv2d(x, w, b, {l.stride, l.stride}, {l.pad, l.pad});
}

void BM_ConvForward(benchmark::State& state) {
  const ConvLayer& l = kConvLayers[state.range(0)];
  const Tensor x = random_tensor(l.x, 1, false), w = random_tensor(l.w, 2, false);
  const Tensor b = l.bias ? random_tensor({l.w[0]}, 3, false) : Tensor();
  for (auto _ : state) benchmark::DoNotOptimize(run_conv(l, x, w, b).data<float>());
  state.SetLabel(l.name);
  state.counters["GFLOPS"] = benchmark::Counter(forward_flops(l), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_ConvForward)
    ->DenseRange(0, kConvLayerCount - 1)
    ->ArgName("layer")
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_ConvForwardBackward(benchmark::State& state) {
  const ConvLayer& l = kConvLayers[state.range(0)];
  Tensor x = random_tensor(l.x, 1, l.input_grad), w = random_tensor(l.w, 2, true);
  Tensor b = l.bias ? random_tensor({l.w[0]}, 3, true) : Tensor();
  Tensor grad;
  for (auto _ : state) {
    w.set_grad(Tensor());
    if (l.bias) b.set_grad(Tensor());
    if (l.input_grad) x.set_grad(Tensor());
    Tensor y = run_conv(l, x, w, b);
    if (!grad.defined()) grad = ones(y.sizes());
    y.backward(grad);
    benchmark::DoNotOptimize(w.grad().data<float>());
  }
  state.SetLabel(l.name);
  // Backward costs one forward-sized product per gradient (weight, and input when needed).
  const double passes = l.input_grad ? 3.0 : 2.0;
  state.counters["GFLOPS"] =
      benchmark::Counter(passes * forward_flops(l), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_ConvForwardBackward)
    ->DenseRange(0, kConvLayerCount - 1)
    ->ArgName("layer")
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
