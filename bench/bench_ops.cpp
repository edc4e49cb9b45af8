// Eager per-op overhead: a 1x16 add without and with autograd recording (end to end: allocation of
// the output, dispatch, node creation and destruction), plus a tiny forward+backward chain; and
// layer_norm forward + backward at the ViT shape; max_pool2d at CNN2's pools.
#include <benchmark/benchmark.h>

#include "autograd/node.h"
#include "autograd/ops.h"
#include "core/random.h"
#include "nn/functional.h"

using namespace mn;

static void BM_AddTiny_NoGrad(benchmark::State& state) {
  Tensor a = ones({1, 16}), b = ones({1, 16});
  for (auto _ : state) {
    Tensor c = add(a, b);
    benchmark::DoNotOptimize(c.raw_data());
  }
}
BENCHMARK(BM_AddTiny_NoGrad);

static void BM_AddTiny_Autograd(benchmark::State& state) {
  Tensor a = ones({1, 16}).requires_grad_(true), b = ones({1, 16});
  for (auto _ : state) {
    Tensor c = add(a, b);  // records an AddBackward node; freed when c goes out of scope
    benchmark::DoNotOptimize(c.raw_data());
  }
}
BENCHMARK(BM_AddTiny_Autograd);

static void BM_MulScalarTiny_Autograd(benchmark::State& state) {
  Tensor a = ones({1, 16}).requires_grad_(true);
  for (auto _ : state) {
    Tensor c = mul(a, 2.0);
    benchmark::DoNotOptimize(c.raw_data());
  }
}
BENCHMARK(BM_MulScalarTiny_Autograd);

// 10 tiny ops forward + backward: per-op cost of a whole training-style step.
static void BM_TinyChain_ForwardBackward(benchmark::State& state) {
  Tensor x = ones({1, 16}).requires_grad_(true);
  for (auto _ : state) {
    Tensor y = x;
    for (int i = 0; i < 10; ++i) y = add(y, x);
    sum(y).backward();
    x.set_grad(Tensor());
  }
  state.counters["ops_per_iter"] = 22;
}
BENCHMARK(BM_TinyChain_ForwardBackward);

// layer_norm forward + backward at the ViT target's shape: 256 images x 50 tokens, width 128, with
// the affine weight and bias (the fused row_norm kernels: one forward, one backward giving grad_x,
// grad_weight and grad_bias). Bytes: x, y, grad_y and grad_x, 4 bytes each.
static void BM_LayerNorm_ViT_ForwardBackward(benchmark::State& state) {
  Generator gen(7);
  Tensor x = randn({256 * 50, 128}, {}, &gen).requires_grad_(true);
  Tensor w = ones({128}).requires_grad_(true), b = zeros({128}).requires_grad_(true);
  Tensor g = randn({256 * 50, 128}, {}, &gen);
  for (auto _ : state) {
    Tensor y = nn::functional::layer_norm(x, {128}, w, b);
    y.backward(g);
    benchmark::DoNotOptimize(x.grad().raw_data());
    x.set_grad(Tensor());
    w.set_grad(Tensor());
    b.set_grad(Tensor());
  }
  state.SetBytesProcessed(state.iterations() * 4 * x.numel() * 4);
}
BENCHMARK(BM_LayerNorm_ViT_ForwardBackward)->Unit(benchmark::kMicrosecond);

// max_pool2d 2x2 / stride 2 at CNN2's two pools, batch 256 (arg: 0 = after conv1 [256, 32, 28, 28],
// 1 = after conv2 [256, 64, 14, 14]); forward alone, then forward + backward. Bytes: the input read,
// the output and its i64 indices written (forward); backward adds grad_out and the indices read and
// grad_x written.
static Tensor pool_input(int64_t which) {
  Generator gen(11);
  return which == 0 ? randn({256, 32, 28, 28}, {}, &gen) : randn({256, 64, 14, 14}, {}, &gen);
}
static void BM_MaxPool2d_CNN2_Forward(benchmark::State& state) {
  const Tensor x = pool_input(state.range(0));
  autograd::NoGradGuard no_grad;
  for (auto _ : state) {
    Tensor y = nn::functional::max_pool2d(x, {2, 2});
    benchmark::DoNotOptimize(y.raw_data());
  }
  state.SetBytesProcessed(state.iterations() * (x.numel() * 4 + x.numel() / 4 * 12));
}
BENCHMARK(BM_MaxPool2d_CNN2_Forward)->ArgName("pool")->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

static void BM_MaxPool2d_CNN2_ForwardBackward(benchmark::State& state) {
  Tensor x = pool_input(state.range(0)).requires_grad_(true);
  Generator gen(12);
  const Tensor g = randn({x.size(0), x.size(1), x.size(2) / 2, x.size(3) / 2}, {}, &gen);
  for (auto _ : state) {
    nn::functional::max_pool2d(x, {2, 2}).backward(g);
    benchmark::DoNotOptimize(x.grad().raw_data());
    x.set_grad(Tensor());
  }
  state.SetBytesProcessed(state.iterations() * (2 * x.numel() * 4 + x.numel() / 4 * 28));
}
BENCHMARK(BM_MaxPool2d_CNN2_ForwardBackward)->ArgName("pool")->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);
