// Full training steps (forward + backward + optimizer), the figures bench/compare_torch.py sets
// beside PyTorch: CNN2 trained directly (batch 128, Adam), CNN2 through a layerwise mapping network
// (4 groups x 672, batch 256) and MLP 784-256-256-10 layerwise L = 64 (batch 64, no regularisers).
#include <benchmark/benchmark.h>

#include "mapping/mapping_model.h"
#include "mapping/targets.h"
#include "nn/functional.h"
#include "nn/optim.h"

using namespace mn;
namespace F = mn::nn::functional;

namespace {
Tensor labels(int64_t n) {
  Generator gen(7);
  return uniform({n}, 0.0, 10.0, DType::f32, &gen).to(DType::i64);
}
}  // namespace

static void BM_CNN2_DirectStep(benchmark::State& state) {
  manual_seed(0);
  auto net = mapping::make_target("cnn2");
  nn::optim::Adam adam(net->parameters(), nn::optim::AdamOptions{1e-3});
  const int64_t batch = state.range(0);
  Tensor x = randn({batch, 1, 28, 28}), y = labels(batch);
  for (auto _ : state) {
    Tensor loss = F::cross_entropy(net->forward(x), y);
    adam.zero_grad();
    loss.backward();
    adam.step();
  }
  state.SetItemsProcessed(state.iterations() * batch);
}
BENCHMARK(BM_CNN2_DirectStep)->Arg(128)->Unit(benchmark::kMillisecond)->UseRealTime();

static void mapped_step(benchmark::State& state, const std::string& target, int64_t latent, const Shape& input) {
  manual_seed(0);
  mapping::MappingOptions o;
  o.latent_dim = latent;
  o.strategy = "layerwise";
  mapping::MappingModel model(mapping::make_target(target), o);
  nn::optim::Adam adam(model.parameters(), nn::optim::AdamOptions{1e-2});
  Tensor x = randn(input), y = labels(input[0]);
  for (auto _ : state) {
    Tensor loss = F::cross_entropy(model.forward(x).predictions, y);
    adam.zero_grad();
    loss.backward();
    adam.step();
  }
  state.SetItemsProcessed(state.iterations() * input[0]);
  state.counters["trainable"] = static_cast<double>(model.trainable_parameter_count());
  state.counters["fixed_MB"] = static_cast<double>(model.generator().fixed_bytes()) / 1e6;
}

static void BM_CNN2_LayerwiseStep(benchmark::State& state) { mapped_step(state, "cnn2", 672, {256, 1, 28, 28}); }
BENCHMARK(BM_CNN2_LayerwiseStep)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_MLP_LayerwiseStep(benchmark::State& state) { mapped_step(state, "mlp", 64, {64, 784}); }
BENCHMARK(BM_MLP_LayerwiseStep)->Unit(benchmark::kMillisecond)->UseRealTime();
