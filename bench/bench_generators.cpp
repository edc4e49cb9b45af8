// Parameter generation per strategy: generate_parameters() alone (BM_Generate) and generation plus the
// backward pass into the latents (BM_GenerateBackward, upstream gradients fixed in advance), for
// slvt / layerwise / lazy_layerwise on the scaling guide's spec, CNN1, CNN2 and MLP 784-1024-1024-10,
// at L = 64 / 256 / 1024. Counters: N (generated parameters), peak_bytes (exact allocator bytes one
// call adds, see profile_peak_memory), items/s = generated parameters per second.
//
// The default run is short (guide at L = 64, CNN2 at L = 256); MN_BENCH_FULL=1 registers the whole
// strategy x spec x latent matrix. Generators are built with allow_large (their structured mapper
// factors stay small), without parameter scaling, once per configuration and cached.
//   mn_bench_generators --benchmark_filter='BM_Generate/.*'
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <tuple>

#include "autograd/engine.h"
#include "core/random.h"
#include "mapping/generator.h"
#include "mapping/profiler.h"
#include "mapping/targets.h"

namespace {

using namespace mn;
using namespace mn::mapping;

const char* const kStrategies[] = {"slvt", "layerwise", "lazy_layerwise"};
const char* const kSpecs[] = {"guide", "cnn1", "cnn2", "mlp1024"};

const ParameterSpec& spec_for(int64_t index) {
  static std::map<int64_t, ParameterSpec> cache;
  auto it = cache.find(index);
  if (it == cache.end()) {
    manual_seed(0);
    const std::string name = kSpecs[index];
    ParameterSpec spec = name == "mlp1024" ? target_spec("mlp", {{1024, 1024}}) : target_spec(name);
    it = cache.emplace(index, std::move(spec)).first;
  }
  return it->second;
}

ParameterGenerator& generator_for(int64_t strategy, int64_t spec, int64_t latent_dim) {
  static std::map<std::tuple<int64_t, int64_t, int64_t>, std::unique_ptr<ParameterGenerator>> cache;
  auto& slot = cache[{strategy, spec, latent_dim}];
  if (!slot) {
    GeneratorOptions options;
    options.allow_large = true;
    slot = make_generator(kStrategies[strategy], spec_for(spec), latent_dim, options);
  }
  return *slot;
}

void label(benchmark::State& state, const ParameterGenerator& gen) {
  state.SetLabel(std::string(kStrategies[state.range(0)]) + "/" + kSpecs[state.range(1)] +
                 "/L=" + std::to_string(state.range(2)));
  const int64_t n = gen.parameter_spec().total_numel();
  state.counters["N"] = static_cast<double>(n);
  state.SetItemsProcessed(state.iterations() * n);
}

void BM_Generate(benchmark::State& state) {
  ParameterGenerator& gen = generator_for(state.range(0), state.range(1), state.range(2));
  // Gradients enabled, as in training: the graph is recorded (and released with the tree).
  state.counters["peak_bytes"] =
      static_cast<double>(profile_peak_memory([&] { return gen.generate_parameters(); }).second);
  for (auto _ : state) {
    ParameterTree tree = gen.generate_parameters();
    benchmark::DoNotOptimize(tree);
  }
  label(state, gen);
}

void BM_GenerateBackward(benchmark::State& state) {
  ParameterGenerator& gen = generator_for(state.range(0), state.range(1), state.range(2));
  std::vector<Tensor> upstream;
  Generator noise(1);
  for (const auto& e : gen.parameter_spec().entries()) upstream.push_back(randn(e.shape, {}, &noise));
  auto step = [&] {
    const ParameterTree tree = gen.generate_parameters();
    std::vector<Tensor> roots;
    for (const auto& [name, t] : tree.items()) roots.push_back(t);
    autograd::backward(roots, upstream);
  };
  state.counters["peak_bytes"] = static_cast<double>(profile_peak_memory(step));
  for (auto _ : state) {
    step();
    for (const Tensor& z : gen.latents()) benchmark::DoNotOptimize(z.grad());
  }
  for (auto& [name, z] : gen.named_latents()) z.set_grad(Tensor());
  label(state, gen);
}

void register_all() {
  const bool full = std::getenv("MN_BENCH_FULL") != nullptr && std::string(std::getenv("MN_BENCH_FULL")) != "0";
  for (auto* fn : {&BM_Generate, &BM_GenerateBackward}) {
    auto* b = benchmark::RegisterBenchmark(fn == &BM_Generate ? "BM_Generate" : "BM_GenerateBackward", fn);
    b->ArgNames({"strategy", "spec", "L"})->Unit(benchmark::kMillisecond);
    for (int64_t s = 0; s < 3; ++s) {
      if (full) {
        for (int64_t spec = 0; spec < 4; ++spec)
          for (int64_t latent : {64, 256, 1024}) b->Args({s, spec, latent});
      } else {
        b->Args({s, 0, 64});   // guide, L = 64
        b->Args({s, 2, 256});  // cnn2, L = 256
      }
    }
  }
}

const int registered = (register_all(), 0);

}  // namespace
