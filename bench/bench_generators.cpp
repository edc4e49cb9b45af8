// Parameter generation per strategy: generate_parameters() alone (BM_Generate) and generation plus the
// backward pass into the latents (BM_GenerateBackward, upstream gradients fixed in advance), for every
// strategy (slvt, layerwise, lazy_layerwise) x spec (the scaling guide's Conv2d(3,64,3) +
// Conv2d(64,128,3) + Linear(128,10), CNN1, CNN2, MLP 784-1024-1024-10) x latent (64, 256, 1024).
// Each configuration is registered under a name that says what it is:
//   BM_Generate/strategy:layerwise/spec:cnn2/L:256/real_time
// Counters: N (generated parameters), peak_bytes (exact: the caching allocator's peak of allocated
// bytes during one call minus the bytes allocated before it, see profile_peak_memory), fixed_bytes
// (the mapper factors the generator holds), items/s = generated parameters per second, and
// peak_bytes_unfused (the same peak with the fused group kernels off, mapping/fused_group.h: the
// composition of the mapper's ops they replace).
//
// Generators are built as a user gets them: default options, so slvt's projection-size guard
// (L x N > max_projection_elements) applies and is not bypassed with allow_large. Each generator is
// built on its benchmark's first run and kept for the process (building is not timed). The
// configurations the guard refuses are known when registering (building them fails at once, before
// any allocation): they are registered as intended skips, one iteration of nothing (hence
// ".../iterations:1/repeats:1" in their names) with the counter not_run = 1 and the label
// "skipped: <the library's message>" (Google Benchmark 1.7 has no SkipWithMessage, and SkipWithError
// would print it as ERROR OCCURRED). A build that fails unexpectedly is reported with SkipWithError.
// No parameter scaling.
//   mn_bench_generators --benchmark_filter='BM_Generate/.*spec:cnn2'
#include <benchmark/benchmark.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "autograd/engine.h"
#include "core/random.h"
#include "mapping/fused_group.h"
#include "mapping/generator.h"
#include "mapping/profiler.h"
#include "mapping/targets.h"

namespace {

using namespace mn;
using namespace mn::mapping;

const char* const kStrategies[] = {"slvt", "layerwise", "lazy_layerwise"};
const char* const kSpecs[] = {"guide", "cnn1", "cnn2", "mlp1024"};
const int64_t kLatents[] = {64, 256, 1024};

ParameterSpec make_spec(const std::string& name) {
  manual_seed(0);
  return name == "mlp1024" ? target_spec("mlp", {{1024, 1024}}) : target_spec(name);
}

// One registered configuration: its generator once built, or why the library refused to build it.
struct Config {
  std::string strategy;
  const ParameterSpec* spec = nullptr;
  int64_t latent_dim = 0;
  std::unique_ptr<ParameterGenerator> generator;
  std::string skipped;  // "skipped: <message>": refused by the guard, an intended skip
  std::string error;    // the build failed unexpectedly
};

// The configuration's generator, built on first use; null (with the run marked) when there is none.
ParameterGenerator* generator_for(benchmark::State& state, Config& c) {
  if (!c.generator && c.skipped.empty() && c.error.empty()) {
    try {
      c.generator = make_generator(c.strategy, *c.spec, c.latent_dim);
    } catch (const std::exception& e) {
      c.error = e.what();
    }
  }
  if (!c.skipped.empty()) {  // intended: see the header
    state.SetLabel(c.skipped);
    state.counters["not_run"] = 1;
  } else if (!c.error.empty()) {
    state.SkipWithError(c.error.c_str());
  }
  if (!c.generator)
    for (auto _ : state) {
    }
  return c.generator.get();
}

void finish(benchmark::State& state, const ParameterGenerator& gen, int64_t peak) {
  const int64_t n = gen.parameter_spec().total_numel();
  state.counters["N"] = static_cast<double>(n);
  state.counters["peak_bytes"] = static_cast<double>(peak);
  state.counters["fixed_bytes"] = static_cast<double>(gen.fixed_bytes());
  state.SetItemsProcessed(state.iterations() * n);
}

void generate(benchmark::State& state, Config& c) {
  ParameterGenerator* built = generator_for(state, c);
  if (!built) return;
  ParameterGenerator& gen = *built;
  // Gradients enabled, as in training: the graph is recorded (and released with the tree).
  const int64_t peak = profile_peak_memory([&] { return gen.generate_parameters(); }).second;
  set_fused_generation(false);
  state.counters["peak_bytes_unfused"] =
      static_cast<double>(profile_peak_memory([&] { return gen.generate_parameters(); }).second);
  set_fused_generation(true);
  for (auto _ : state) {
    ParameterTree tree = gen.generate_parameters();
    benchmark::DoNotOptimize(tree);
  }
  finish(state, gen, peak);
}

void generate_backward(benchmark::State& state, Config& c) {
  ParameterGenerator* built = generator_for(state, c);
  if (!built) return;
  ParameterGenerator& gen = *built;
  std::vector<Tensor> upstream;
  Generator noise(1);
  for (const auto& e : gen.parameter_spec().entries()) upstream.push_back(randn(e.shape, {}, &noise));
  auto step = [&] {
    const ParameterTree tree = gen.generate_parameters();
    std::vector<Tensor> roots;
    for (const auto& [name, t] : tree.items()) roots.push_back(t);
    autograd::backward(roots, upstream);
  };
  for (auto& [name, z] : gen.named_latents()) z.set_grad(Tensor());
  const int64_t peak = profile_peak_memory(step);  // includes the latents' first gradients
  for (auto& [name, z] : gen.named_latents()) z.set_grad(Tensor());
  set_fused_generation(false);
  state.counters["peak_bytes_unfused"] = static_cast<double>(profile_peak_memory(step));
  set_fused_generation(true);
  for (auto _ : state) {
    step();
    for (const Tensor& z : gen.latents()) benchmark::DoNotOptimize(z.grad());
  }
  for (auto& [name, z] : gen.named_latents()) z.set_grad(Tensor());
  finish(state, gen, peak);
}

// Registers both benchmarks for every configuration, named BM_<fn>/strategy:<s>/spec:<spec>/L:<latent>.
// slvt's guard is applied here to find the intended skips: building a refused configuration throws
// before allocating anything, and its message becomes the label.
void register_all(std::map<std::string, ParameterSpec>& specs, std::vector<std::unique_ptr<Config>>& configs) {
  const int64_t max_projection = GeneratorOptions{}.max_projection_elements;
  for (const char* spec : kSpecs) specs.emplace(spec, make_spec(spec));
  for (const char* spec : kSpecs)
    for (int64_t latent : kLatents)
      for (const char* strategy : kStrategies) {
        auto c = std::make_unique<Config>();
        c->strategy = strategy;
        c->spec = &specs.at(spec);
        c->latent_dim = latent;
        if (c->strategy == "slvt" && latent * c->spec->total_numel() > max_projection) {
          try {
            c->generator = make_generator(strategy, *c->spec, latent);  // not expected to succeed
          } catch (const std::exception& e) {
            c->skipped = std::string("skipped: ") + e.what();
          }
        }
        Config& ref = *c;
        configs.push_back(std::move(c));
        const std::string suffix = std::string("/strategy:") + strategy + "/spec:" + spec + "/L:" + std::to_string(latent);
        for (auto [name, fn] : {std::pair{"BM_Generate", &generate}, std::pair{"BM_GenerateBackward", &generate_backward}}) {
          auto* b = benchmark::RegisterBenchmark((name + suffix).c_str(),
                                                 [fn = fn, &ref](benchmark::State& state) { fn(state, ref); });
          b->Unit(benchmark::kMillisecond)->UseRealTime();
          if (!ref.skipped.empty()) b->Iterations(1)->Repetitions(1);  // nothing to time or repeat
        }
      }
}

}  // namespace

// BM_GroupPass/<target>/fused:<0|1>: layer-wise generation plus the backward into the latents, with
// parameter scaling as MappingModel sets it, for the targets of the mapped-step bound (MLP L = 64, CNN2
// L = 672), with the fused group kernels (mapping/fused_group.h) on and off: what the mapper adds to
// a training step, the one against the composition it replaces.
void group_pass(benchmark::State& state, const char* target, int64_t latent, bool fused) {
  manual_seed(0);
  const auto net = make_target(target);
  const ParameterSpec spec = ParameterSpec::from_module(*net);
  auto gen = make_generator("layerwise", spec, latent);
  gen->initialize_parameter_scaling(*net);
  std::vector<Tensor> upstream;
  Generator noise(1);
  for (const auto& e : spec.entries()) upstream.push_back(randn(e.shape, {}, &noise));
  set_fused_generation(fused);
  auto step = [&] {
    const ParameterTree tree = gen->generate_parameters();
    std::vector<Tensor> roots;
    for (const auto& [name, t] : tree.items()) roots.push_back(t);
    autograd::backward(roots, upstream);
  };
  step();
  for (auto _ : state) step();
  set_fused_generation(true);
  state.counters["N"] = static_cast<double>(spec.total_numel());
}

// Our own main (instead of benchmark_main): the specs are made and the guard applied after Google
// Benchmark has read its flags, not during static initialisation, where the library's statics may
// not exist yet.
int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  std::map<std::string, ParameterSpec> specs;
  std::vector<std::unique_ptr<Config>> configs;
  register_all(specs, configs);
  for (auto [target, latent] : {std::pair{"mlp", int64_t{64}}, std::pair{"cnn2", int64_t{672}}})
    for (bool fused : {false, true})
      benchmark::RegisterBenchmark(
          (std::string("BM_GroupPass/") + target + "/fused:" + (fused ? "1" : "0")).c_str(),
          [target = target, latent = latent, fused](benchmark::State& state) { group_pass(state, target, latent, fused); })
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
