// Parameter generation per strategy: generate_parameters() alone (BM_Generate) and generation plus the
// backward pass into the latents (BM_GenerateBackward, upstream gradients fixed in advance), for every
// strategy (slvt, layerwise, lazy_layerwise) x spec (the scaling guide's Conv2d(3,64,3) +
// Conv2d(64,128,3) + Linear(128,10), CNN1, CNN2, MLP 784-1024-1024-10) x latent (64, 256, 1024).
// Counters: N (generated parameters), peak_bytes (exact: the caching allocator's peak of allocated
// bytes during one call minus the bytes allocated before it, see profile_peak_memory), fixed_bytes
// (the mapper factors the generator holds), items/s = generated parameters per second.
//
// Generators are built as a user gets them: default options, so the projection-size guard
// (sum_g L x n_g > 1e8) applies. slvt configurations it refuses are reported as errors carrying the
// guard's message ("skipped: ..."), not run with allow_large. The library applies the same guard to
// layerwise and lazy_layerwise (the reference library guards slvt only), although their mapper factors
// stay small; those are rebuilt with allow_large = true and marked so: label suffix "(allow_large)"
// and counter allow_large = 1. No parameter scaling. Each generator is built once per configuration
// and cached for the process (building is not timed).
//   mn_bench_generators --benchmark_filter='BM_Generate/.*spec:2'
#include <benchmark/benchmark.h>

#include <map>
#include <memory>
#include <string>
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
const int64_t kLatents[] = {64, 256, 1024};

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

struct Built {
  std::unique_ptr<ParameterGenerator> generator;
  std::string error;         // why it could not be built (the projection-size guard)
  bool allow_large = false;  // built only with allow_large (layerwise strategies, see above)
};

const Built& generator_for(int64_t strategy, int64_t spec, int64_t latent_dim) {
  static std::map<std::tuple<int64_t, int64_t, int64_t>, Built> cache;
  auto [it, inserted] = cache.try_emplace({strategy, spec, latent_dim});
  if (inserted) {
    Built& b = it->second;
    try {
      b.generator = make_generator(kStrategies[strategy], spec_for(spec), latent_dim);
    } catch (const std::exception& e) {
      b.error = std::string("skipped: ") + e.what();
    }
    if (!b.generator && std::string(kStrategies[strategy]) != "slvt") {
      GeneratorOptions options;
      options.allow_large = true;
      b.generator = make_generator(kStrategies[strategy], spec_for(spec), latent_dim, options);
      b.allow_large = true;
      b.error.clear();
    }
  }
  return it->second;
}

std::string config_label(const benchmark::State& state) {
  return std::string(kStrategies[state.range(0)]) + "/" + kSpecs[state.range(1)] + "/L=" +
         std::to_string(state.range(2));
}

// Returns the generator, or reports the configuration skipped (and returns null).
ParameterGenerator* setup(benchmark::State& state) {
  const Built& built = generator_for(state.range(0), state.range(1), state.range(2));
  state.SetLabel(config_label(state) + (built.allow_large ? " (allow_large)" : ""));
  state.counters["allow_large"] = built.allow_large ? 1 : 0;
  if (!built.generator) {
    state.SkipWithError(built.error.c_str());
    return nullptr;
  }
  return built.generator.get();
}

void finish(benchmark::State& state, const ParameterGenerator& gen, int64_t peak) {
  const int64_t n = gen.parameter_spec().total_numel();
  state.counters["N"] = static_cast<double>(n);
  state.counters["peak_bytes"] = static_cast<double>(peak);
  state.counters["fixed_bytes"] = static_cast<double>(gen.fixed_bytes());
  state.SetItemsProcessed(state.iterations() * n);
}

void BM_Generate(benchmark::State& state) {
  ParameterGenerator* gen = setup(state);
  if (gen == nullptr) {
    for (auto _ : state) {
    }
    return;
  }
  // Gradients enabled, as in training: the graph is recorded (and released with the tree).
  const int64_t peak = profile_peak_memory([&] { return gen->generate_parameters(); }).second;
  for (auto _ : state) {
    ParameterTree tree = gen->generate_parameters();
    benchmark::DoNotOptimize(tree);
  }
  finish(state, *gen, peak);
}

void BM_GenerateBackward(benchmark::State& state) {
  ParameterGenerator* gen = setup(state);
  if (gen == nullptr) {
    for (auto _ : state) {
    }
    return;
  }
  std::vector<Tensor> upstream;
  Generator noise(1);
  for (const auto& e : gen->parameter_spec().entries()) upstream.push_back(randn(e.shape, {}, &noise));
  auto step = [&] {
    const ParameterTree tree = gen->generate_parameters();
    std::vector<Tensor> roots;
    for (const auto& [name, t] : tree.items()) roots.push_back(t);
    autograd::backward(roots, upstream);
  };
  for (auto& [name, z] : gen->named_latents()) z.set_grad(Tensor());
  const int64_t peak = profile_peak_memory(step);  // includes the latents' first gradients
  for (auto _ : state) {
    step();
    for (const Tensor& z : gen->latents()) benchmark::DoNotOptimize(z.grad());
  }
  for (auto& [name, z] : gen->named_latents()) z.set_grad(Tensor());
  finish(state, *gen, peak);
}

void register_all() {
  for (auto [name, fn] : {std::pair{"BM_Generate", &BM_Generate}, std::pair{"BM_GenerateBackward", &BM_GenerateBackward}}) {
    auto* b = benchmark::RegisterBenchmark(name, fn);
    b->ArgNames({"strategy", "spec", "L"})->Unit(benchmark::kMillisecond)->UseRealTime();
    for (int64_t spec = 0; spec < 4; ++spec)
      for (int64_t latent : kLatents)
        for (int64_t s = 0; s < 3; ++s) b->Args({s, spec, latent});
  }
}

const int registered = (register_all(), 0);

}  // namespace
