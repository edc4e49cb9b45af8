// The mapping layer on a real device (skipped without one, see main.cpp): MappingModel on cuda:0 for
// layerwise, lazy_layerwise and slvt against the same model on the CPU (generated parameters,
// predictions, latent gradients, a few Adam steps), mapper factors built for the device against the
// CPU ones, MappingModel::to, lazy_layerwise emptying the CUDA cache once per group, the scaling
// guide's peak ordering from the CUDA allocator's exact counters, a short training loop on CUDA, and
// mn::compile on the device (a compiled step against the eager one; lazy generation with and without
// the per-group empty_cache).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "autograd/node.h"
#include "autograd/ops.h"
#include "core/allocator.h"
#include "core/caching_allocator.h"
#include "core/cuda.h"
#include "core/random.h"
#include "mapping/checkpoint.h"
#include "mapping/generator.h"
#include "mapping/mapping_model.h"
#include "mapping/orthogonal.h"
#include "mapping/profiler.h"
#include "mapping/targets.h"
#include "mapping/trainer.h"
#include "nn/compile.h"
#include "nn/data/dataloader.h"
#include "nn/functional.h"
#include "nn/optim.h"
#include "tests/temp_dir.h"

using namespace mn;
using namespace mn::mapping;
namespace F = mn::nn::functional;

namespace {

const Device kGpu = cuda_device(0);
constexpr int64_t MiB = int64_t{1} << 20;

bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.sizes() != b.sizes()) return false;
  const std::vector<float> x = a.to_vector<float>(), y = b.to_vector<float>();
  return x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0);
}

// |got - want| <= atol + rtol * max|want| everywhere (tolerance relative to the tensor's scale: the
// two backends sum in different orders); reports the first offender.
void check_close(const Tensor& got, const Tensor& want, double atol, double rtol, const std::string& what) {
  INFO(what);
  REQUIRE(got.defined());
  REQUIRE(want.defined());
  CHECK(got.device() == kGpu);
  REQUIRE(got.sizes() == want.sizes());
  const std::vector<float> g = got.to_vector<float>(), w = want.to_vector<float>();
  double scale = 0;
  for (float v : w) scale = std::max(scale, std::fabs(double(v)));
  for (size_t i = 0; i < g.size(); ++i) {
    if (!(std::fabs(double(g[i]) - w[i]) <= atol + rtol * scale)) {
      FAIL_CHECK("element " << i << ": got " << g[i] << ", expected " << w[i] << " (max |expected| " << scale << ")");
      return;
    }
  }
}

Tensor batch_images(int64_t n, uint64_t seed) {
  Generator gen(seed);
  return randn({n, 1, 28, 28}, {}, &gen);
}

Tensor batch_labels(int64_t n, uint64_t seed) {
  Generator gen(seed);
  return uniform({n}, 0.0, 10.0, {}, &gen).to(DType::i64);
}

MappingOptions options_for(const std::string& strategy, int64_t latent, Device device) {
  MappingOptions o;
  o.strategy = strategy;
  o.latent_dim = latent;
  o.seed = 3;
  o.device = device;
  return o;
}

// CNN2 (108,618 parameters) through a mapping network; the target's initial values (and so the
// parameter scales) come from the global seed.
MappingModel cnn2_model(const std::string& strategy, int64_t latent, Device device) {
  manual_seed(0);
  return MappingModel(make_target("cnn2"), options_for(strategy, latent, device));
}

}  // namespace

TEST_CASE("cuda mapping: generated parameters, predictions and latent gradients equal the CPU model's") {
  const Tensor x = batch_images(16, 5), y = batch_labels(16, 6);
  const Tensor x_gpu = x.to(kGpu), y_gpu = y.to(kGpu);
  for (const std::string strategy : {"layerwise", "lazy_layerwise", "slvt"}) {
    INFO("strategy " << strategy);
    MappingModel cpu = cnn2_model(strategy, 64, kCPU);
    MappingModel gpu = cnn2_model(strategy, 64, kGpu);
    CHECK(gpu.device() == kGpu);
    CHECK(gpu.strategy() == strategy);
    CHECK(gpu.trainable_parameter_count() == cpu.trainable_parameter_count());

    // Latents: the same draws, on the device, trainable leaves.
    const auto cpu_latents = cpu.named_latents(), gpu_latents = gpu.named_latents();
    REQUIRE(cpu_latents.size() == gpu_latents.size());
    for (size_t i = 0; i < cpu_latents.size(); ++i) {
      CHECK(gpu_latents[i].first == cpu_latents[i].first);
      CHECK(gpu_latents[i].second.device() == kGpu);
      CHECK(gpu_latents[i].second.requires_grad());
      CHECK(same_bits(gpu_latents[i].second, cpu_latents[i].second));
    }
    CHECK(gpu.generator().per_entry_scales() == cpu.generator().per_entry_scales());

    ForwardResult want = cpu.run(x);
    ForwardResult got = gpu.run(x_gpu);
    const auto want_params = want.generated_parameters.to_map();
    const auto got_params = got.generated_parameters.to_map();
    REQUIRE(got_params.size() == want_params.size());
    for (const auto& [name, value] : want_params) {
      REQUIRE(got_params.count(name));
      check_close(got_params.at(name), value, 1e-6, 1e-5, "generated " + name);
    }
    check_close(got.predictions, want.predictions, 1e-5, 1e-4, "predictions");

    Tensor want_loss = F::cross_entropy(want.predictions, y);
    Tensor got_loss = F::cross_entropy(got.predictions, y_gpu);
    CHECK(got_loss.item() == doctest::Approx(want_loss.item()).epsilon(1e-4));
    want_loss.backward();
    got_loss.backward();
    const auto cpu_z = cpu.named_latents(), gpu_z = gpu.named_latents();
    for (size_t i = 0; i < cpu_z.size(); ++i)
      check_close(gpu_z[i].second.grad(), cpu_z[i].second.grad(), 1e-6, 1e-3, "latent gradient " + cpu_z[i].first);
  }
}

TEST_CASE("cuda mapping: mapper factors and scales built for the device equal the CPU ones bit for bit") {
  // One matrix of each form: repeated blocks + tail (rows >= 2 cols), a tall one, a wide one.
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1000, 64}, {96, 64}, {20, 64}}) {
    INFO(rows << " x " << cols);
    const OrthogonalMatrix host = OrthogonalMatrix::build(9, "m", rows, cols, true);
    const OrthogonalMatrix dev = OrthogonalMatrix::build(9, "m", rows, cols, true, kGpu);
    const auto hf = host.factors(), df = dev.factors();
    REQUIRE(hf.size() == df.size());
    for (size_t i = 0; i < hf.size(); ++i) {
      CHECK(df[i].device() == kGpu);
      CHECK(same_bits(df[i], hf[i]));
    }
    Generator gen(4);
    const Tensor z = randn({cols}, {}, &gen);
    check_close(dev.apply(z.to(kGpu)), host.apply(z), 1e-6, 1e-5, "W z");
    check_close(dev.materialize(), host.materialize(), 1e-7, 1e-6, "materialised W");
  }
  // Every group's mapper buffers and scales, through the generator options.
  const ParameterSpec spec = target_spec("cnn2");
  GeneratorOptions host_options, dev_options;
  host_options.seed = dev_options.seed = 17;
  dev_options.device = kGpu;
  LayerwiseGenerator host(spec, 96, host_options), dev(spec, 96, dev_options);
  const std::vector<float> scales(spec.size(), 0.25f);
  host.set_scales(scales);
  dev.set_scales(scales);
  REQUIRE(host.groups().size() == dev.groups().size());
  CHECK(dev.fixed_bytes() == host.fixed_bytes());
  const auto hb = host.buffers(), db = dev.buffers();
  REQUIRE(hb.size() == db.size());
  for (size_t i = 0; i < hb.size(); ++i) {
    CHECK(db[i].device() == kGpu);
    CHECK(same_bits(db[i], hb[i]));
  }
}

TEST_CASE("cuda mapping: MappingModel::to moves a CPU model to the device and back") {
  MappingModel reference = cnn2_model("layerwise", 64, kCPU);
  MappingModel moved = cnn2_model("layerwise", 64, kCPU);
  static_cast<nn::Module&>(moved).to(kGpu);  // virtual: the generator, target and carried buffers move
  CHECK(moved.named_parameters()[0].second.same(moved.named_latents()[0].second));
  CHECK(moved.device() == kGpu);
  CHECK(moved.options().device == kGpu);
  for (const Tensor& z : moved.parameters()) {
    CHECK(z.device() == kGpu);
    CHECK(z.requires_grad());
  }
  for (const Tensor& b : moved.generator().buffers()) CHECK(b.device() == kGpu);
  const Tensor x = batch_images(8, 12);
  const Tensor want = reference.run(x).predictions;
  check_close(moved.run(x.to(kGpu)).predictions, want, 1e-5, 1e-4, "predictions after to(cuda)");
  // An optimizer built after the move trains the device latents.
  nn::optim::Adam adam(moved.parameters(), nn::optim::AdamOptions{.lr = 1e-2});
  Tensor loss = F::cross_entropy(moved.run(x.to(kGpu)).predictions, batch_labels(8, 13).to(kGpu));
  loss.backward();
  adam.step();
  moved.to(kCPU);
  CHECK(moved.device() == kCPU);
  for (const Tensor& z : moved.parameters()) CHECK(z.device() == kCPU);
  CHECK(moved.run(x).predictions.device() == kCPU);
}

namespace {

// Wraps a mapper and watches the CUDA allocator around each group's generation: after computing the
// group it takes and frees an 8 MiB block (a 20 MiB segment of the large pool that generation itself
// never reuses: its temporaries are all below 1 MiB), so the cache holds a free, unsplit segment;
// the next group then sees whether something emptied the cache in between.
struct CacheProbe {
  std::vector<int64_t> reserved_after;  // per group, with the freed ballast segment still cached
  std::vector<int64_t> reserved_entry;  // per group, on entry
};

class ProbeMapper : public Mapper {
 public:
  ProbeMapper(std::shared_ptr<Mapper> inner, std::shared_ptr<CacheProbe> probe)
      : Mapper(inner->latent_dim(), inner->output_dim()), inner_(std::move(inner)), probe_(std::move(probe)) {}
  size_t fixed_bytes() const override { return inner_->fixed_bytes(); }
  size_t dense_bytes() const override { return inner_->dense_bytes(); }
  std::vector<Tensor> buffers() const override { return inner_->buffers(); }
  void to(Device device) override { inner_->to(device); }
  std::string describe() const override { return "probe(" + inner_->describe() + ")"; }

 protected:
  Tensor compute(const Tensor& z) const override {
    probe_->reserved_entry.push_back(memory_stats(kGpu).reserved_bytes.current);
    Tensor theta = inner_->forward(z);
    { Tensor ballast = empty({8 * MiB / 4}, kGpu); }
    probe_->reserved_after.push_back(memory_stats(kGpu).reserved_bytes.current);
    return theta;
  }

 private:
  std::shared_ptr<Mapper> inner_;
  std::shared_ptr<CacheProbe> probe_;
};

}  // namespace

TEST_CASE("cuda mapping: lazy_layerwise with empty_cache_on_cuda empties the cache once per group") {
  if (!caching_enabled(kGpu)) return;  // MN_NO_CACHING (the sanitizer runs): there is no cache to empty
  const ParameterSpec spec = target_spec("cnn2");
  for (const bool empty_each : {true, false}) {
    INFO("empty_cache_on_cuda = " << empty_each);
    auto probe = std::make_shared<CacheProbe>();
    GeneratorOptions o;
    o.device = kGpu;
    o.empty_cache_on_cuda = empty_each;
    const MapperFactory inner = default_mapper_factory();
    o.mapper_factory = [inner, probe](int64_t l, int64_t n, uint64_t seed, const std::string& key) {
      return std::make_shared<ProbeMapper>(inner(l, n, seed, key), probe);
    };
    LazyLayerwiseGenerator gen(spec, 64, o);
    const size_t groups = gen.groups().size();
    REQUIRE(groups == 4);
    empty_cache(kGpu);
    const int64_t syncs_before = memory_stats(kGpu).num_sync_all_streams;
    const int64_t frees_before = memory_stats(kGpu).num_raw_frees;
    ParameterTree tree = gen.generate_parameters();
    const MemoryStats after = memory_stats(kGpu);
    REQUIRE(probe->reserved_entry.size() == groups);
    REQUIRE(probe->reserved_after.size() == groups);
    CHECK(tree.size() == spec.size());
    if (empty_each) {
      // empty_cache runs release_cached_segments, which counts one synchronisation of all streams.
      CHECK(after.num_sync_all_streams - syncs_before == static_cast<int64_t>(groups));
      // Each group's ballast segment was returned to the driver before the next group started...
      for (size_t g = 1; g < groups; ++g)
        CHECK(probe->reserved_entry[g] <= probe->reserved_after[g - 1] - 8 * MiB);
      // ...and the last one before generate_parameters returned.
      CHECK(after.reserved_bytes.current <= probe->reserved_after.back() - 8 * MiB);
      CHECK(after.num_raw_frees - frees_before >= static_cast<int64_t>(groups));
    } else {
      CHECK(after.num_sync_all_streams == syncs_before);
      for (size_t g = 1; g < groups; ++g) CHECK(probe->reserved_entry[g] >= probe->reserved_after[g - 1]);
      CHECK(after.reserved_bytes.current >= probe->reserved_after.back());
    }
  }
  // Layerwise (not lazy) never empties the cache.
  GeneratorOptions o;
  o.device = kGpu;
  LayerwiseGenerator eager(spec, 64, o);
  const int64_t syncs_before = memory_stats(kGpu).num_sync_all_streams;
  (void)eager.generate_parameters();
  CHECK(memory_stats(kGpu).num_sync_all_streams == syncs_before);
}

TEST_CASE("cuda mapping: on the scaling guide's spec (L = 64) lazy_layerwise <= layerwise <= slvt in exact device bytes") {
  manual_seed(0);
  const ParameterSpec spec = target_spec("guide");
  REQUIRE(spec.total_numel() == 76938);
  const auto results = benchmark_strategies(spec, 64, kGpu);
  for (const auto& [name, stats] : results) REQUIRE_MESSAGE(stats.ok(), name << ": " << stats.error);
  const int64_t slvt = results.at("slvt").peak_bytes;
  const int64_t layerwise = results.at("layerwise").peak_bytes;
  const int64_t lazy = results.at("lazy_layerwise").peak_bytes;
  MESSAGE("cuda:0, scaling guide spec, L = 64:\n" << strategy_table(results));
  MESSAGE("exact peak bytes on cuda:0: slvt " << slvt << ", layerwise " << layerwise << ", lazy_layerwise " << lazy);
  // With the fused group kernels (mapping/fused_group.h) every strategy peaks at the N generated
  // floats plus one 512-byte scratch block: no n-sized temporary is left to separate them.
  CHECK(lazy <= layerwise);
  CHECK(layerwise <= slvt);
  for (int64_t peak : {slvt, layerwise, lazy}) {
    CHECK(peak >= 76938 * 4);               // the generated parameters themselves
    CHECK(peak < 64 * 76938 * 4 / 4);       // never an L x N temporary
    CHECK(peak % 512 == 0);                 // the allocator's 512-byte rounding
  }
  // For comparison: the CPU allocator runs the same caching algorithm, but the kernels' temporaries
  // differ between the backends, so the bytes need not be equal.
  const auto host = benchmark_strategies(spec, 64, kCPU, 1, 2);
  MESSAGE("same spec on the cpu: slvt " << host.at("slvt").peak_bytes << ", layerwise "
                                        << host.at("layerwise").peak_bytes << ", lazy_layerwise "
                                        << host.at("lazy_layerwise").peak_bytes);
}

TEST_CASE("cuda mapping: Adam steps on CUDA follow the CPU ones and a short training loop lowers the loss") {
  MappingModel cpu = cnn2_model("layerwise", 64, kCPU);
  MappingModel gpu = cnn2_model("layerwise", 64, kGpu);
  nn::optim::Adam cpu_adam(cpu.parameters(), nn::optim::AdamOptions{.lr = 1e-2});
  nn::optim::Adam gpu_adam(gpu.parameters(), nn::optim::AdamOptions{.lr = 1e-2});
  const Tensor x = batch_images(64, 21), y = batch_labels(64, 22);
  const Tensor x_gpu = x.to(kGpu), y_gpu = y.to(kGpu);
  auto step = [](MappingModel& m, nn::optim::Adam& adam, const Tensor& xs, const Tensor& ys) {
    Tensor loss = F::cross_entropy(m.run(xs).predictions, ys);
    adam.zero_grad();
    loss.backward();
    adam.step();
    return loss.item();
  };
  std::vector<double> cpu_losses, gpu_losses;
  for (int i = 0; i < 5; ++i) {
    cpu_losses.push_back(step(cpu, cpu_adam, x, y));
    gpu_losses.push_back(step(gpu, gpu_adam, x_gpu, y_gpu));
  }
  for (size_t i = 0; i < cpu_losses.size(); ++i) {
    INFO("step " << i);
    CHECK(gpu_losses[i] == doctest::Approx(cpu_losses[i]).epsilon(1e-3));
  }
  const auto cz = cpu.named_latents(), gz = gpu.named_latents();
  for (size_t i = 0; i < cz.size(); ++i) check_close(gz[i].second, cz[i].second, 1e-5, 1e-3, "latent " + cz[i].first);
  // Memorising one fixed batch: 40 more steps must lower the loss well below where it started.
  double last = 0;
  for (int i = 0; i < 40; ++i) last = step(gpu, gpu_adam, x_gpu, y_gpu);
  MESSAGE("cuda training loop: loss " << gpu_losses.front() << " -> " << last);
  CHECK(std::isfinite(last));
  CHECK(last < 0.7 * gpu_losses.front());
}

TEST_CASE("cuda mapping: a compiled training step replays on the device like the eager one") {
  MappingModel eager = cnn2_model("layerwise", 64, kGpu);
  MappingModel compiled = cnn2_model("layerwise", 64, kGpu);
  nn::optim::Adam eager_adam(eager.parameters(), nn::optim::AdamOptions{.lr = 1e-2});
  nn::optim::Adam compiled_adam(compiled.parameters(), nn::optim::AdamOptions{.lr = 1e-2});
  const Tensor x = batch_images(64, 31).to(kGpu), y = batch_labels(64, 32).to(kGpu);
  auto body = [](MappingModel& m) {
    return [&m](const std::vector<Tensor>& in) {
      Tensor loss = F::cross_entropy(m.run(in[0]).predictions, in[1]);
      loss.backward();
      return std::vector<Tensor>{loss.detach()};
    };
  };
  auto eager_step = body(eager);
  CompiledFunction step = compile(body(compiled), compiled.compile_guard(), {.fullgraph = true});
  bool bitwise = true;
  for (int i = 0; i < 4; ++i) {
    eager_adam.zero_grad();
    compiled_adam.zero_grad();
    const Tensor a = eager_step({x, y})[0], b = step({x, y})[0];
    CHECK(b.device() == kGpu);
    check_close(b, a, 0.0, 1e-6, "loss of step " + std::to_string(i));
    bitwise = bitwise && same_bits(a, b);
    eager_adam.step();
    compiled_adam.step();
  }
  CHECK(step.stats().captures == 1);
  CHECK(step.stats().replays == 3);
  const auto ez = eager.named_latents(), cz = compiled.named_latents();
  for (size_t i = 0; i < ez.size(); ++i) {
    check_close(cz[i].second, ez[i].second, 0.0, 1e-6, "latent " + ez[i].first);
    bitwise = bitwise && same_bits(cz[i].second, ez[i].second);
  }
  MESSAGE("cuda compiled step: " << step.num_kernels() << " kernels, pool " << step.reserved_bytes()
                                 << " bytes, results " << (bitwise ? "bit for bit equal" : "within 1e-6"));
}

TEST_CASE("cuda mapping: compiling lazy_layerwise generation: empty_cache_on_cuda breaks the capture, off it replays") {
  // The scaling guide's fullgraph constraint: the per-group empty_cache cannot be part of a graph.
  const ParameterSpec spec = target_spec("cnn2");
  for (const bool empty_each : {true, false}) {
    INFO("empty_cache_on_cuda = " << empty_each);
    GeneratorOptions o;
    o.device = kGpu;
    o.empty_cache_on_cuda = empty_each;
    LazyLayerwiseGenerator gen(spec, 64, o);
    auto generate = [&gen](const std::vector<Tensor>&) {
      autograd::NoGradGuard no_grad;
      const ParameterTree tree = gen.generate_parameters();
      std::vector<Tensor> out;
      for (const auto& [name, t] : tree.items()) out.push_back(t);
      return out;
    };
    CompiledFunction lenient = compile(generate);
    for (int i = 0; i < 3; ++i) {
      const std::vector<Tensor> got = lenient({}), want = generate({});
      REQUIRE(got.size() == want.size());
      for (size_t k = 0; k < got.size(); ++k) check_close(got[k], want[k], 0.0, 1e-6, "parameter " + std::to_string(k));
    }
    if (empty_each) {
      CHECK(lenient.stats().eager == 3);
      CHECK(lenient.explain().find("empty_cache") != std::string::npos);
      CompiledFunction strict = compile(generate, {}, {.fullgraph = true});
      CHECK_THROWS_WITH_AS(strict({}), doctest::Contains("empty_cache"), RuntimeError);
    } else {
      CHECK(lenient.stats().replays == 2);
    }
  }
}

// Written from device tensors (copied to the host), resumed on the device: the same run as one without
// the stop, and the same file loads into a CPU model with the values the device held.
TEST_CASE("cuda mapping: trainer on the device, checkpoint written from device tensors, resumed on the device") {
  Generator gen(41);
  const Tensor inputs = randn({48, 1, 28, 28}, {}, &gen).to(kGpu);
  const Tensor targets = uniform({48}, 0.0, 10.0, {}, &gen).to(DType::i64).to(kGpu);
  auto make = [] {
    manual_seed(0);
    MappingOptions o;
    o.strategy = "layerwise";
    o.latent_dim = 32;
    o.seed = 5;
    o.device = kGpu;
    return std::make_unique<MappingModel>(make_target("cnn2"), o);
  };
  TrainerConfig config;
  config.max_epochs = 2;
  config.learning_rate = 1e-2;
  config.seed = 9;
  auto loss = [] { return std::make_shared<ClassificationLoss>(); };
  testing::TempDir dir("mn_gpu_ckpt");
  const std::string path = dir / "checkpoint.safetensors";

  auto straight = make();
  data::DataLoader straight_loader(inputs, targets, {.batch_size = 16, .shuffle = true, .seed = 3});
  MappingTrainer straight_trainer(*straight, straight_loader, nullptr, loss(), config);
  straight_trainer.fit();

  std::vector<Tensor> written;  // the device latents at save time, on the host
  {
    auto first = make();
    data::DataLoader loader(inputs, targets, {.batch_size = 16, .shuffle = true, .seed = 3});
    TrainerConfig one = config;
    one.max_epochs = 1;
    MappingTrainer trainer(*first, loader, nullptr, loss(), one);
    trainer.fit();
    save_checkpoint(path, *first, trainer);  // device latents and Adam moments, copied to the host
    for (const Tensor& z : first->parameters()) written.push_back(z.detach().to(kCPU));
  }
  auto resumed = make();
  data::DataLoader loader(inputs, targets, {.batch_size = 16, .shuffle = true, .seed = 3});
  MappingTrainer trainer(*resumed, loader, nullptr, loss(), config);
  load_checkpoint(path, *resumed, &trainer);
  for (const Tensor& z : resumed->parameters()) CHECK(z.device() == kGpu);
  trainer.fit();
  CHECK(trainer.epoch() == 2);
  const auto a = straight->named_latents(), b = resumed->named_latents();
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("latent " << a[i].first);
    CHECK(b[i].second.device() == kGpu);
    CHECK(same_bits(b[i].second, a[i].second));  // same kernels, same order: bit for bit
  }
  CHECK(trainer.history() == straight_trainer.history());
  // The same file loads into a CPU model: the values written from the device, exactly.
  MappingOptions host_options = resumed->options();
  host_options.device = kCPU;
  manual_seed(0);
  MappingModel host(make_target("cnn2"), host_options);
  load_checkpoint(path, host);
  const std::vector<Tensor> host_z = host.parameters();
  REQUIRE(host_z.size() == written.size());
  for (size_t i = 0; i < written.size(); ++i) {
    CHECK(host_z[i].device() == kCPU);
    CHECK(same_bits(host_z[i], written[i]));
  }
  CHECK(read_checkpoint(path).trainer_state->optimizer.count("state.0.exp_avg") == 1);
}
