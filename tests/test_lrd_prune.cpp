// The paper's Table 8 add-ons: LRD (LRDGenerator, mapped; nn::Reparametrized, direct) and unstructured
// magnitude pruning (MappingOptions::prune_fraction for every generator; nn::Reparametrized for direct
// training): counts against the paper's arithmetic, ranks, init spread, gradients, mask determinism
// and checkpoint round trips. The mn-train flags are tested at the end (skipped without the binary or
// Fashion-MNIST).
#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "autograd/gradcheck.h"
#include "core/random.h"
#include "mapping/checkpoint.h"
#include "mapping/lrd.h"
#include "mapping/mapping_model.h"
#include "mapping/targets.h"
#include "nn/functional.h"
#include "nn/layers.h"
#include "nn/optim.h"
#include "nn/safetensors.h"
#include "nn/reparametrize.h"
#include "tests/mn_train_exe.h"
#include "tests/run_command.h"
#include "tests/temp_dir.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::mapping;
using json = nlohmann::json;

namespace {

// Singular values of a small matrix (descending), from the Jacobi eigenvalues of A^T A in double.
std::vector<double> singular_values(const Tensor& a) {
  const int64_t m = a.size(0), n = a.size(1);
  const std::vector<float> v = a.detach().contiguous().to_vector<float>();
  std::vector<double> g(static_cast<size_t>(n * n), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t k = 0; k < m; ++k) g[i * n + j] += double(v[k * n + i]) * double(v[k * n + j]);
  for (int sweep = 0; sweep < 60; ++sweep)
    for (int64_t p = 0; p < n; ++p)
      for (int64_t q = p + 1; q < n; ++q) {
        if (std::fabs(g[p * n + q]) < 1e-300) continue;
        const double theta = (g[q * n + q] - g[p * n + p]) / (2 * g[p * n + q]);
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (int64_t k = 0; k < n; ++k) {  // G <- J^T G J
          const double gkp = g[k * n + p], gkq = g[k * n + q];
          g[k * n + p] = c * gkp - s * gkq;
          g[k * n + q] = s * gkp + c * gkq;
        }
        for (int64_t k = 0; k < n; ++k) {
          const double gpk = g[p * n + k], gqk = g[q * n + k];
          g[p * n + k] = c * gpk - s * gqk;
          g[q * n + k] = s * gpk + c * gqk;
        }
      }
  std::vector<double> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(std::sqrt(std::max(0.0, g[i * n + i])));
  std::sort(out.rbegin(), out.rend());
  return out;
}

double population_std(const Tensor& t) { return std_dev(t.detach(), {}, 0.0).item(); }

std::shared_ptr<nn::Sequential> small_net() {
  auto net = std::make_shared<nn::Sequential>();
  net->push_back(std::make_shared<nn::Linear>(6, 5));
  net->push_back(std::make_shared<nn::ReLU>());
  net->push_back(std::make_shared<nn::Linear>(5, 3));
  return net;
}

std::vector<float> values(const Tensor& t) { return t.detach().contiguous().to_vector<float>(); }

// gradcheck of every generated tensor (flattened, concatenated) with respect to the groups' latents.
std::string gradcheck_latents(const std::vector<std::pair<std::string, Tensor>>& latents,
                              const std::function<ParameterTree(const LatentOverrides&)>& generate) {
  std::vector<Tensor> inputs;
  for (const auto& [name, z] : latents) inputs.push_back(z.detach().clone().requires_grad_(true));
  return autograd::gradcheck(
      [&](const std::vector<Tensor>& v) {
        LatentOverrides over;
        for (size_t i = 0; i < latents.size(); ++i) over[latents[i].first] = v[i];
        const ParameterTree tree = generate(over);
        std::vector<Tensor> flat;
        for (const auto& [n, t] : tree.items()) flat.push_back(t.reshape({t.numel()}));
        return cat(flat, 0);
      },
      inputs);
}

}  // namespace

TEST_CASE("lrd: the reference's Linear(4, 4) at rank 2 - one group of 20 outputs, a weight of rank 2") {
  manual_seed(0);
  auto lin = std::make_shared<nn::Linear>(4, 4);
  MappingModel model(lin, MappingOptions{.latent_dim = 3, .strategy = "lrd", .lrd_rank = 2});
  const auto& gen = dynamic_cast<const LRDGenerator&>(model.generator());
  CHECK(model.strategy() == "lrd");
  CHECK(gen.group_names() == std::vector<std::string>{"<root>"});
  CHECK(gen.group_output_dim(0) == 20);  // U 4x2 + V 4x2 + bias 4
  CHECK(gen.factored_names() == std::vector<std::string>{"weight"});
  CHECK(model.trainable_parameter_count() == 3);
  CHECK(model.run(randn({3, 4})).predictions.sizes() == Shape{3, 4});
  const std::vector<double> sv = singular_values(model.generate_parameters().at("weight"));
  CHECK(sv[1] > 1e-3);
  CHECK(sv[2] < 1e-5);
  CHECK(sv[3] < 1e-5);

  const ParameterSpec spec = ParameterSpec::from_module(*lin);
  CHECK_THROWS_WITH_AS(LRDGenerator(spec, 3, 0), "rank must be positive, got 0", ValueError);
  CHECK_THROWS_WITH_AS(make_generator("lrd", spec, 3), "rank must be positive, got 0", ValueError);
  CHECK_THROWS_WITH_AS(MappingModel(lin, MappingOptions{.strategy = "lrd", .lrd_rank = -1}),
                       "rank must be positive, got -1", ValueError);
  CHECK_THROWS_WITH_AS(MappingModel(lin, MappingOptions{.strategy = "layerwise", .lrd_rank = 2}),
                       doctest::Contains("strategy 'layerwise' has no rank"), ValueError);
  // A rank at or above min(m, n) leaves the weight unfactored: the mapper output is the layer's size.
  CHECK(LRDGenerator(spec, 3, 4).group_output_dim(0) == 20);
  CHECK(LRDGenerator(spec, 3, 4).factored_names().empty());
}

TEST_CASE("lrd: CNN2 at rank 32 factors FC1 only and starts at the target's init spread") {
  manual_seed(0);
  auto target = make_target("cnn2");
  MappingModel model(target, MappingOptions{.latent_dim = 64, .strategy = "lrd", .lrd_rank = 32});
  const auto& gen = dynamic_cast<const LRDGenerator&>(model.generator());
  CHECK(gen.factored_names() == std::vector<std::string>{"7.weight"});
  CHECK(gen.group_output_dim(2) == 32 * (128 + 800) + 128);
  CHECK(gen.group_output_dim(0) == 16 * 9 + 16);
  CHECK(model.trainable_parameter_count() == 4 * 64);
  CHECK(model.target_parameter_count() == 108618);
  const ParameterTree tree = model.generate_parameters();
  std::map<std::string, Tensor> own;
  for (auto& [n, t] : target->named_parameters()) own[n] = t;
  // Without the 1/sqrt(r) the factored weight would start sqrt(32) = 5.7x too wide.
  const double init = population_std(own.at("7.weight")), generated = population_std(tree.at("7.weight"));
  INFO("init std " << init << ", generated " << generated);
  CHECK(generated == doctest::Approx(init).epsilon(0.2));
  CHECK(population_std(tree.at("9.weight")) == doctest::Approx(population_std(own.at("9.weight"))).epsilon(0.2));

  // slvt + LRD: one latent for the whole target, the same factored layout in one mapper.
  MappingModel slvt(target, MappingOptions{.latent_dim = 64, .strategy = "slvt", .lrd_rank = 32});
  const auto& one = dynamic_cast<const LRDGenerator&>(slvt.generator());
  CHECK(one.group_names() == std::vector<std::string>{"all"});
  CHECK(one.group_output_dim(0) == 108618 - 102400 + 32 * (128 + 800));
  CHECK(slvt.trainable_parameter_count() == 64);
  CHECK(population_std(slvt.generate_parameters().at("7.weight")) == doctest::Approx(init).epsilon(0.2));
}

TEST_CASE("lrd: gradients of the generated factors' products (gradcheck)") {
  manual_seed(1);
  auto net = small_net();
  LRDGenerator gen(ParameterSpec::from_module(*net), 4, 2);
  gen.initialize_parameter_scaling(*net);
  CHECK(gradcheck_latents(gen.named_latents(), [&](const LatentOverrides& o) { return gen.generate_parameters(o); }) ==
        "");
  // The layer-by-layer path (streaming) produces the same values.
  const ParameterTree all = gen.generate_parameters();
  const ParameterTree first = gen.generate_group_parameters(0);
  CHECK(values(first.at("0.weight")) == values(all.at("0.weight")));
}

TEST_CASE("prune: masks keep the largest entries of each weight tensor; the paper's CNN2 counts") {
  // Ties go to the lower index; 1-D tensors are left alone unless asked.
  const nn::NamedTensors t{{"w", mn::testing::tensor({0.5f, -3.0f, 1.0f, -1.0f, 0.1f, 2.0f}, Shape{2, 3})},
                           {"b", mn::testing::tensor({1.0f, 2.0f})}};
  const auto masks = nn::magnitude_prune_masks(t, 0.5);
  REQUIRE(masks.count("w") == 1);
  CHECK(masks.count("b") == 0);
  CHECK(values(masks.at("w")) == std::vector<float>{0, 1, 1, 0, 0, 1});  // |1.0| = |-1.0|: index 2 wins
  CHECK(nn::magnitude_prune_masks(t, 0.5, true).count("b") == 1);
  CHECK_THROWS_WITH_AS(nn::magnitude_prune_masks(t, 1.0), "prune fraction must be in [0, 1), got 1", ValueError);
  CHECK_THROWS_WITH_AS(nn::check_prune_fraction(-0.1), "prune fraction must be in [0, 1), got -0.1", ValueError);

  // CNN2 at 90 %: the weights keep 14 + 461 + 10,240 + 128 (llround) and the 186 bias entries stay:
  // 11,029. The paper's 10,862 is llround(0.1 x 108,618): it prunes the biases too (per tensor, the
  // same rounding gives exactly 10,862), which we do not.
  manual_seed(0);
  auto cnn2 = make_target("cnn2");
  nn::Reparametrized pruned(cnn2, {.prune_fraction = 0.9});
  CHECK(pruned.trainable_parameter_count() == 11029);
  int64_t with_biases = 0;
  for (const auto& [name, m] : nn::magnitude_prune_masks(cnn2->named_parameters(), 0.9, true))
    with_biases += static_cast<int64_t>(sum(m).item());
  CHECK(with_biases == 10862);
}

TEST_CASE("prune: every generator's parameters come out masked, the same masks for the same seed") {
  for (const std::string strategy : {"slvt", "layerwise", "lazy_layerwise", "grouped", "lrd"}) {
    INFO("strategy " << strategy);
    manual_seed(2);
    auto net = small_net();
    MappingOptions o{.latent_dim = 5, .strategy = strategy, .seed = 7, .prune_fraction = 0.6};
    if (strategy == "grouped") o.groups = {{"w", {"0.weight", "2.weight"}}, {"b", {"0.bias", "2.bias"}}};
    if (strategy == "lrd") o.lrd_rank = 2;
    MappingModel model(net, o);
    const auto& masks = model.prune_masks();
    REQUIRE(masks.size() == 2);  // the two weights; biases are not pruned
    CHECK(sum(masks.at("0.weight")).item() == std::llround(0.4 * 30));
    CHECK(sum(masks.at("2.weight")).item() == std::llround(0.4 * 15));
    CHECK(model.unpruned_parameter_count() == 12 + 5 + 6 + 3);
    // The masks are those of the unmasked initial generation, and the generated tensors are zero where masked.
    const ParameterTree raw = model.generator().generate_parameters();
    const auto expected = nn::magnitude_prune_masks(raw.items(), 0.6);
    const ParameterTree tree = model.generate_parameters();
    for (const auto& [name, m] : masks) {
      CHECK(values(m) == values(expected.at(name)));
      const std::vector<float> got = values(tree.at(name)), mask = values(m), unmasked = values(raw.at(name));
      for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == mask[i] * unmasked[i]);
    }
    CHECK(values(tree.at("0.bias")) == values(raw.at("0.bias")));
    // A second model from the same seed and options rebuilds them bit for bit.
    manual_seed(2);
    MappingModel again(small_net(), o);
    for (const auto& [name, m] : masks) CHECK(values(again.prune_masks().at(name)) == values(m));
    // Gradients through the masks (masked entries contribute nothing to the latents' gradient).
    CHECK(gradcheck_latents(model.named_latents(),
                            [&](const LatentOverrides& over) { return model.generate_parameters(over); }) == "");
  }
  CHECK_THROWS_WITH_AS(MappingModel(small_net(), MappingOptions{.prune_fraction = 1.5}),
                       "prune fraction must be in [0, 1), got 1.5", ValueError);
}

TEST_CASE("prune: a checkpoint round trip rebuilds the masks, which it does not store") {
  mn::testing::TempDir dir("lrd_prune_ckpt");
  const MappingOptions o{.latent_dim = 6, .strategy = "lrd", .seed = 4, .lrd_rank = 2, .prune_fraction = 0.5};
  manual_seed(3);
  MappingModel model(small_net(), o);
  {
    autograd::NoGradGuard no_grad;
    for (auto& [name, z] : model.named_latents()) z.copy_(randn(z.sizes()));  // "trained" latents
  }
  save_checkpoint(dir.file("m.safetensors"), model);
  const safetensors::File file = safetensors::load(dir.file("m.safetensors"));
  for (const auto& e : file.tensors) CHECK(e.name.find("mask") == std::string::npos);
  manual_seed(3);
  MappingModel fresh(small_net(), o);
  load_checkpoint(dir.file("m.safetensors"), fresh);
  for (const auto& [name, m] : model.prune_masks()) CHECK(values(fresh.prune_masks().at(name)) == values(m));
  const ParameterTree a = model.generate_parameters(), b = fresh.generate_parameters();
  for (const auto& [name, t] : a.items()) CHECK(values(t) == values(b.at(name)));
}

TEST_CASE("direct lrd: CNN2 at rank 32 trains 35,914 parameters, U V^T at the layer's init spread") {
  manual_seed(0);
  auto cnn2 = make_target("cnn2");
  const double init = population_std(cnn2->named_parameters()[4].second);  // 7.weight
  nn::Reparametrized lrd(cnn2, {.lrd_rank = 32});
  CHECK(lrd.trainable_parameter_count() == 108618 - 102400 + 32 * (800 + 128));
  CHECK(lrd.trainable_parameter_count() == 35914);
  CHECK(lrd.parameter_count() == 35914);
  CHECK(lrd.factored_names() == std::vector<std::string>{"7.weight"});
  std::map<std::string, Tensor> listed;
  for (auto& [n, t] : lrd.named_parameters()) listed[n] = t;
  CHECK(listed.at("7.weight_U").sizes() == Shape{128, 32});
  CHECK(listed.at("7.weight_V").sizes() == Shape{800, 32});
  CHECK(listed.count("7.weight") == 0);
  CHECK(listed.count("9.weight") == 1);  // [10, 128]: rank 32 >= 10, trained as it is
  const auto effective = lrd.effective_state_dict();
  CHECK(effective.at("7.weight").sizes() == Shape{128, 800});
  CHECK(population_std(effective.at("7.weight")) == doctest::Approx(init).epsilon(0.2));
  CHECK(lrd.forward(randn({2, 1, 28, 28})).sizes() == Shape{2, 10});
  CHECK_THROWS_WITH_AS(nn::Reparametrized(cnn2, {.lrd_rank = -2}), doctest::Contains("rank must be positive"),
                       ValueError);
}

TEST_CASE("direct lrd + prune: gradients, zero gradient where masked, masks fixed across a reload") {
  manual_seed(5);
  auto net = small_net();
  nn::Reparametrized r(net, {.lrd_rank = 2, .prune_fraction = 0.5});
  CHECK(r.factored_names() == std::vector<std::string>{"0.weight", "2.weight"});
  // U [5,2], V [6,2], U [3,2], V [5,2] keep llround(0.5 n); biases kept.
  CHECK(r.trainable_parameter_count() == 5 + 6 + 3 + 5 + 5 + 3);
  const Tensor x = randn({4, 6});
  const nn::NamedTensors listed = r.named_parameters();
  // The forward against the explicit masked product, and the masked entries' gradients.
  Tensor loss = sum(mul(r.forward(x), r.forward(x)));
  loss.backward();
  for (const auto& [name, t] : listed) {
    auto it = r.masks().find(name);
    if (it == r.masks().end()) continue;
    const std::vector<float> g = values(t.grad()), m = values(it->second), v = values(t);
    for (size_t i = 0; i < g.size(); ++i)
      if (m[i] == 0) {
        CHECK(g[i] == 0.0f);
        CHECK(v[i] == 0.0f);  // zeroed at construction
      }
  }
  // gradcheck of the effective weights (U V^T of masked factors) with respect to the factors.
  const Tensor u = listed[0].second, v = listed[1].second;
  const Tensor mu = r.masks().at("0.weight_U"), mv = r.masks().at("0.weight_V");
  CHECK(autograd::gradcheck(
            [&](const std::vector<Tensor>& in) {
              return nn::functional::linear(x, matmul(mul(in[0], mu), transpose(mul(in[1], mv), 0, 1)), Tensor());
            },
            {u.detach().clone().requires_grad_(true), v.detach().clone().requires_grad_(true)}) == "");
  // An optimizer step leaves the masked entries at zero; a reload into a model built from the same
  // seed keeps its own masks (those of the initial values), equal to the first model's.
  nn::optim::Adam opt(r.parameters(), {.lr = 0.1});
  opt.step();
  const nn::StateDict trained = r.state_dict();
  manual_seed(5);
  nn::Reparametrized fresh(small_net(), {.lrd_rank = 2, .prune_fraction = 0.5});
  fresh.load_state_dict(trained);
  for (const auto& [name, m] : r.masks()) {
    CHECK(values(fresh.masks().at(name)) == values(m));
    const std::vector<float> w = values(trained.at(name)), mask = values(m);
    for (size_t i = 0; i < w.size(); ++i)
      if (mask[i] == 0) CHECK(w[i] == 0.0f);
  }
  CHECK(values(fresh.forward(x)) == values(r.forward(x)));
}

// ---------------- mn-train ----------------

namespace {
json run_json(const std::string& exe, const std::string& args) {
  const mn::testing::CommandResult r = mn::testing::run_command(exe + " " + args);
  INFO("mn-train " << args << "\n" << r.all());
  REQUIRE(r.status == 0);
  return json::parse(r.last_line());
}
const char* const kTiny = "--target cnn2 --limit 256 --batch-size 128 --seed 3 --threads 1 --json";
}  // namespace

TEST_CASE("mn-train: --strategy lrd --rank, direct --rank, --prune: counts, resume and errors") {
  std::string exe;
  if (!mn::testing::mn_train_ready(exe)) return;
  mn::testing::TempDir dir("mn_train_lrd");
  const json lrd = run_json(exe, str(kTiny, " --strategy lrd --rank 32 --latent-dim 64 --prune 0.9 --epochs 1 --out ",
                                     dir / "lrd"));
  CHECK(lrd["strategy"] == "lrd");
  CHECK(lrd["trainable_params"] == 4 * 64);
  CHECK(lrd["target_params"] == 108618);
  const json slvt = run_json(exe, str(kTiny, " --strategy slvt --rank 32 --latent-dim 64 --epochs 1 --out ", dir / "slvt"));
  CHECK(slvt["trainable_params"] == 64);
  const json direct = run_json(exe, str(kTiny, " --strategy direct --rank 32 --epochs 1 --out ", dir / "direct"));
  CHECK(direct["trainable_params"] == 35914);
  // The exported weights are the target's own tensors (W = U V^T), not the factors.
  const safetensors::File weights = safetensors::load(dir / "direct/weights.safetensors");
  CHECK(weights.at("7.weight").sizes() == Shape{128, 800});
  CHECK_FALSE(weights.contains("7.weight_U"));

  // Direct + prune, resumed: 1 + 1 epochs equal 2 straight, so the resumed run rebuilt the same masks.
  const std::string pruned = str(kTiny, " --strategy direct --prune 0.9");
  const json straight = run_json(exe, str(pruned, " --epochs 2 --out ", dir / "straight"));
  CHECK(straight["trainable_params"] == 11029);
  run_json(exe, str(pruned, " --epochs 1 --out ", dir / "split"));
  const json resumed = run_json(exe, str("--out ", dir / "split", " --resume --epochs 2 --threads 1 --json"));
  CHECK(resumed["trainable_params"] == 11029);
  CHECK(resumed["test_accuracy"] == straight["test_accuracy"]);
  const safetensors::File a = safetensors::load(dir / "straight/weights.safetensors");
  const safetensors::File b = safetensors::load(dir / "split/weights.safetensors");
  for (const auto& e : a.tensors) CHECK(values(e.tensor) == values(b.at(e.name)));
  int64_t zeros_in_fc1 = 0;
  for (float w : values(a.at("7.weight"))) zeros_in_fc1 += w == 0.0f;
  CHECK(zeros_in_fc1 == 102400 - 10240);

  const auto fails_with = [&](const std::string& args, const std::string& message) {
    const mn::testing::CommandResult r = mn::testing::run_command(exe + " " + args);
    INFO(args << "\n" << r.all());
    CHECK(r.status != 0);
    CHECK(r.all().find(message) != std::string::npos);
  };
  fails_with(str(kTiny, " --strategy direct --prune 1 --out ", dir / "x"), "prune fraction must be in [0, 1), got 1");
  fails_with(str(kTiny, " --strategy lrd --out ", dir / "x"), "give --rank R");
  fails_with(str(kTiny, " --strategy layerwise --rank 4 --out ", dir / "x"), "--rank 4 factors the weights");
  fails_with(str(kTiny, " --strategy direct --rank -1 --out ", dir / "x"), "rank must be positive, got -1");
  fails_with(str("--out ", dir / "split", " --resume --prune 0.5"), "--prune: the run has 0.9, the command line 0.5");
}

TEST_CASE("lrd/prune: a checkpoint records rank and prune fraction and refuses a model built otherwise") {
  mn::testing::TempDir dir("lrd_prune_addons");
  const MappingOptions o{.latent_dim = 4, .strategy = "lrd", .lrd_rank = 2, .prune_fraction = 0.5};
  MappingModel model(small_net(), o);
  save_checkpoint(dir.file("m.safetensors"), model);
  // Ranks 5 and 6 both leave the weights (min sizes 5 and 3) unfactored, so the mappers agree and the
  // recorded rank is what tells them apart; at factoring ranks the mapper sizes differ too.
  MappingOptions rank5 = o, rank6 = o;
  rank5.lrd_rank = 5;
  rank6.lrd_rank = 6;
  MappingModel five(small_net(), rank5), six(small_net(), rank6);
  save_checkpoint(dir.file("r.safetensors"), five);
  CHECK_THROWS_WITH_AS(load_checkpoint(dir.file("r.safetensors"), six),
                       doctest::Contains("was saved with lrd_rank 5 but the model uses 6"), ValueError);
  MappingOptions rank3 = o;
  rank3.lrd_rank = 3;
  MappingModel wrong_rank(small_net(), rank3);
  CHECK_THROWS_WITH_AS(load_checkpoint(dir.file("m.safetensors"), wrong_rank), doctest::Contains("mapper mismatch"),
                       ValueError);
  MappingOptions unpruned = o;
  unpruned.prune_fraction = 0;
  MappingModel wrong_prune(small_net(), unpruned);
  CHECK_THROWS_WITH_AS(load_checkpoint(dir.file("m.safetensors"), wrong_prune),
                       doctest::Contains("was saved with prune_fraction 0.5 but the model uses 0"), ValueError);
  // A plain layerwise checkpoint has no add_ons section and loads into a plain model only.
  MappingModel plain(small_net(), MappingOptions{.latent_dim = 4});
  save_checkpoint(dir.file("p.safetensors"), plain);
  CHECK(safetensors::load(dir.file("p.safetensors")).metadata.count("add_ons") == 0);
  MappingModel pruned(small_net(), MappingOptions{.latent_dim = 4, .prune_fraction = 0.25});
  CHECK_THROWS_WITH_AS(load_checkpoint(dir.file("p.safetensors"), pruned),
                       doctest::Contains("prune_fraction 0 but the model uses 0.25"), ValueError);
}
