// ModuleList and ModuleDict, and a module whose forward is written in C++ over them (residual
// connections around attention and linear layers): names, state dicts, functional_call,
// nn::save / nn::load and mapping::MappingModel with the layerwise generator.
#include <filesystem>

#include "mapping/mapping_model.h"
#include "nn/functional_call.h"
#include "nn/layers.h"
#include "nn/serialize.h"
#include "tests/temp_dir.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::testing;

namespace {

// x [N, T, 4] -> h = x + attn(x); h = h + relu(layer(h)) for each layer; out(norm(mean_T(h))) [N, 3].
class ResidualNet : public nn::Module {
 public:
  ResidualNet() : nn::Module("ResidualNet") {
    layers = register_module("layers", std::make_shared<nn::ModuleList>());
    layers->push_back(std::make_shared<nn::Linear>(4, 4)).append(std::make_shared<nn::Linear>(4, 4));
    parts = register_module("parts", std::make_shared<nn::ModuleDict>(std::vector<nn::ModuleDict::Item>{
                                          {"attn", std::make_shared<nn::MultiheadAttention>(4, 2, 0.0, true, true)},
                                          {"norm", std::make_shared<nn::BatchNorm1d>(4)},
                                          {"out", std::make_shared<nn::Linear>(4, 3)}}));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = add(x, (*parts)["attn"]->forward(x));
    for (const auto& layer : *layers) h = add(h, relu(layer->forward(h)));
    return (*parts)["out"]->forward((*parts)["norm"]->forward(mean(h, 1)));
  }
  std::shared_ptr<nn::ModuleList> layers;
  std::shared_ptr<nn::ModuleDict> parts;
};

std::vector<std::string> names_of(const nn::NamedTensors& tensors) {
  std::vector<std::string> out;
  for (const auto& [name, t] : tensors) out.push_back(name);
  return out;
}

}  // namespace

TEST_CASE("containers: ModuleList indexes, iterates, names its children and has no forward") {
  auto a = std::make_shared<nn::Linear>(2, 3);
  auto b = std::make_shared<nn::ReLU>();
  auto c = std::make_shared<nn::Linear>(3, 1);
  nn::ModuleList list({a, b});
  list.extend({c});
  REQUIRE(list.size() == 3);
  CHECK(list[0] == a);
  CHECK(list[-1] == c);
  CHECK(list[-3] == a);
  CHECK(list.at<nn::Linear>(2)->in_features == 3);
  std::vector<nn::ModulePtr> seen(list.begin(), list.end());
  CHECK(seen == std::vector<nn::ModulePtr>{a, b, c});
  std::vector<std::string> child_names;
  for (const auto& [name, m] : list.named_children()) child_names.push_back(name);
  CHECK(child_names == std::vector<std::string>{"0", "1", "2"});
  CHECK(names_of(list.named_parameters()) == std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"});

  CHECK_THROWS_WITH_AS(list[3], doctest::Contains("index 3 is out of range for 3 modules"), IndexError);
  CHECK_THROWS_WITH_AS(list[-4], doctest::Contains("index -4"), IndexError);
  CHECK_THROWS_WITH_AS(list.at<nn::Linear>(1), doctest::Contains("index 1 is a ReLU"), TypeError);
  CHECK_THROWS_WITH_AS(list.push_back(nullptr), doctest::Contains("null"), ValueError);
  CHECK(list.size() == 3);  // the refused module left no trace
  CHECK_THROWS_WITH_AS(list.forward(zeros({1, 2})), doctest::Contains("ModuleList has no forward"),
                       NotImplementedError);
  CHECK(nn::ModuleList().empty());
}

TEST_CASE("containers: ModuleDict keeps insertion order, validates keys and names a missing one") {
  auto z = std::make_shared<nn::Linear>(2, 2);
  auto a = std::make_shared<nn::Tanh>();
  nn::ModuleDict dict({{"zeta", z}, {"alpha", a}});
  CHECK(dict.keys() == std::vector<std::string>{"zeta", "alpha"});
  CHECK(dict["alpha"] == a);
  CHECK(dict.contains("zeta"));
  CHECK_FALSE(dict.contains("beta"));
  CHECK(dict.at<nn::Linear>("zeta") == z);
  std::vector<std::string> order;
  for (const auto& [key, m] : dict) order.push_back(key);
  CHECK(order == dict.keys());
  CHECK(names_of(dict.named_parameters()) == std::vector<std::string>{"zeta.weight", "zeta.bias"});

  CHECK_THROWS_WITH_AS(dict["beta"], doctest::Contains("no module under key 'beta' (keys: 'zeta', 'alpha')"),
                       KeyError);
  CHECK_THROWS_WITH_AS(dict.at<nn::Linear>("alpha"), doctest::Contains("key 'alpha' is a Tanh"), TypeError);
  CHECK_THROWS_WITH_AS(dict.insert("zeta", a), doctest::Contains("key 'zeta' is already present"), ValueError);
  CHECK_THROWS_WITH_AS(dict.insert("a.b", a), doctest::Contains("must not contain '.'"), ValueError);
  CHECK_THROWS_WITH_AS(dict.insert("", a), doctest::Contains("non-empty"), ValueError);
  CHECK_THROWS_WITH_AS(dict.insert("gamma", nullptr), doctest::Contains("null"), ValueError);
  CHECK(dict.size() == 2);  // nothing refused was added
  CHECK_THROWS_WITH_AS(dict.forward(zeros({1, 2})), doctest::Contains("ModuleDict has no forward"),
                       NotImplementedError);
}

TEST_CASE("containers: a residual module over ModuleList/ModuleDict: names, state dicts, functional_call, save") {
  manual_seed(21);
  auto net = std::make_shared<ResidualNet>();
  const std::vector<std::string> expected{
      "layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias",
      "parts.attn.in_proj_weight", "parts.attn.in_proj_bias", "parts.attn.out_proj.weight",
      "parts.attn.out_proj.bias", "parts.norm.weight", "parts.norm.bias", "parts.out.weight", "parts.out.bias"};
  CHECK(names_of(net->named_parameters()) == expected);
  CHECK(names_of(net->named_buffers()) == std::vector<std::string>{"parts.norm.running_mean", "parts.norm.running_var",
                                                                   "parts.norm.num_batches_tracked"});
  const Tensor x = random_tensor({3, 5, 4}, 22);
  net->forward(x);  // one training step moves the running statistics away from their init
  net->eval();
  const Tensor y = net->forward(x);
  CHECK(y.sizes() == Shape{3, 3});

  // state_dict -> load_state_dict into a differently seeded twin reproduces the output.
  manual_seed(99);
  auto twin = std::make_shared<ResidualNet>();
  twin->eval();
  CHECK(max(abs(sub(twin->forward(x), y))).item() > 1e-3);
  twin->load_state_dict(net->state_dict());
  check_close(twin->forward(x), y.to_vector<float>(), 0.0);

  // nn::save / nn::load through a file.
  TempDir dir("mn_containers");
  nn::save(*net, dir / "net.safetensors");
  manual_seed(100);
  auto loaded = std::make_shared<ResidualNet>();
  loaded->eval();
  const auto result = nn::load(*loaded, dir / "net.safetensors");
  CHECK(result.missing.empty());
  CHECK(result.unexpected.empty());
  check_close(loaded->forward(x), y.to_vector<float>(), 0.0);

  // functional_call: the supplied tensors are the ones read (all of them) and receive the gradients;
  // the module's own tensors are untouched.
  std::map<std::string, Tensor> params;
  for (const auto& [name, t] : net->named_parameters()) params[name] = t.detach().clone().requires_grad_(true);
  params["parts.out.bias"] = full({3}, 5.0).requires_grad_(true);
  Tensor out;
  {
    nn::FunctionalCallGuard guard(*net, params);
    out = net->forward(x);
    CHECK(guard.unread_parameters().empty());
  }
  check_close(out, add(y, rsub(net->parts->at<nn::Linear>("out")->param("bias"), 5.0)).to_vector<float>(), 1e-5);
  sum(out).backward();
  for (const auto& [name, t] : params) {
    INFO(name);
    REQUIRE(t.grad().defined());
    CHECK(max(abs(t.grad())).item() > 0.0);
  }
  for (const auto& [name, t] : net->named_parameters()) CHECK_FALSE(t.grad().defined());
}

TEST_CASE("containers: MappingModel with the layerwise generator groups a residual module by owning module") {
  manual_seed(23);
  auto net = std::make_shared<ResidualNet>();
  mapping::MappingOptions options;
  options.latent_dim = 6;
  options.seed = 5;
  options.strategy = "layerwise";
  mapping::MappingModel model(net, options);
  CHECK(names_of(model.named_latents()) == std::vector<std::string>{"layers.0", "layers.1", "parts.attn",
                                                                   "parts.attn.out_proj", "parts.norm", "parts.out"});
  const Tensor x = random_tensor({3, 5, 4}, 24);
  const auto result = model.run(x);
  // The predictions are the target run on the generated parameters, every one of which was generated.
  CHECK(result.generated_parameters.names() == names_of(net->named_parameters()));
  const Tensor direct = nn::functional_call(*net, result.generated_parameters.to_map(), x);
  check_close(result.predictions, direct.to_vector<float>(), 1e-6);
  sum(mul(result.predictions, random_tensor({3, 3}, 25))).backward();
  for (const auto& [group, latent] : model.named_latents()) {
    INFO(group);
    REQUIRE(latent.grad().defined());
    CHECK(max(abs(latent.grad())).item() > 0.0);
  }
}
