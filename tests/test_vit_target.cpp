// The attention target (mapping/vit.h): parameter count, layer-wise groups, names and shapes of the
// torch twin (tests/parity/torch_targets.py), a small ViT of the same structure with the twin's
// weights computing the twin's output and input gradient, and every mapping strategy on it.
#include <cmath>

#include "autograd/engine.h"
#include "mapping/generator.h"
#include "mapping/mapping_model.h"
#include "mapping/targets.h"
#include "mapping/vit.h"
#include "nn/functional.h"
#include "nn/optim.h"
#include "tests/target_twins.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::mapping;
using mn::testing::fixture;
using mn::testing::listing;
using mn::testing::max_rel_diff;
using mn::testing::random_tensor;

TEST_CASE("vit target: 803,338 parameters in 29 layer-wise groups, named and shaped as the torch twin") {
  manual_seed(0);
  auto net = make_target("vit");
  CHECK(net->parameter_count() == 803338);
  CHECK(listing(net->named_parameters()) == fixture("parity_vit_target").metadata.at("vit_parameters"));
  const auto groups = layerwise_groups(ParameterSpec::from_module(*net));
  // class token, conv_proj, pos_embedding, 4 blocks x (ln_1, in_proj, out_proj, ln_2, mlp.0, mlp.3),
  // encoder.ln, heads.head
  REQUIRE(groups.size() == 29);
  CHECK(groups[0].first == "<root>");
  CHECK(groups[0].second == std::vector<std::string>{"class_token"});
  CHECK(groups[1].first == "conv_proj");
  CHECK(groups[2].first == "encoder");
  CHECK(groups[2].second == std::vector<std::string>{"encoder.pos_embedding"});
  CHECK(groups[4].first == "encoder.layers.encoder_layer_0.self_attention");
  CHECK(groups[4].second == std::vector<std::string>{"encoder.layers.encoder_layer_0.self_attention.in_proj_weight",
                                                     "encoder.layers.encoder_layer_0.self_attention.in_proj_bias"});
  CHECK(groups[5].first == "encoder.layers.encoder_layer_0.self_attention.out_proj");
  CHECK(groups[28].first == "heads.head");
}

TEST_CASE("vit target: with the twin's weights, outputs and input gradients are the twin's") {
  const safetensors::File twin = fixture("parity_vit_target");
  auto net = std::make_shared<VisionTransformer>(ViTOptions{.width = 32, .depth = 2, .heads = 4, .mlp_dim = 64});
  nn::StateDict weights;
  for (const auto& [name, t] : twin.state_dict())
    if (name.rfind("small.", 0) == 0) weights[name.substr(6)] = t;
  net->load_state_dict(weights, /*strict=*/true);
  const Tensor x = twin.at("input").clone().requires_grad_(true);
  const Tensor y = net->forward(x);
  CHECK(max_rel_diff(y, twin.at("small_output")) <= 1e-5);
  sum(mul(y, twin.at("output_weight"))).backward();
  CHECK(max_rel_diff(x.grad(), twin.at("small_grad_input")) <= 1e-5);
}

TEST_CASE("vit target: wrong input shapes and options are refused with what was expected") {
  auto net = std::make_shared<VisionTransformer>(ViTOptions{.width = 8, .depth = 1, .heads = 2, .mlp_dim = 16});
  CHECK_THROWS_WITH_AS(net->forward(zeros({2, 1, 32, 32})), doctest::Contains("expected input [N, 1, 28, 28]"),
                       ValueError);
  CHECK_THROWS_WITH_AS(VisionTransformer(ViTOptions{.patch_size = 5}), doctest::Contains("multiple of patch_size"),
                       ValueError);
  CHECK_THROWS_AS(VisionTransformer(ViTOptions{.width = 10, .heads = 4}), ValueError);  // 10 % 4 heads
}

TEST_CASE("vit target: every strategy maps the vit; latents get finite, non-zero gradients") {
  const Tensor x = random_tensor({2, 1, 28, 28}, 5);
  const Tensor labels = from_vector(std::vector<int64_t>{3, 7}, Shape{2});
  for (const char* strategy : {"slvt", "layerwise", "lazy_layerwise", "grouped"}) {
    INFO("strategy " << strategy);
    manual_seed(1);
    auto target = make_target("vit");
    MappingOptions mo{.latent_dim = 8, .strategy = strategy, .seed = 3};
    if (std::string(strategy) == "grouped") {
      std::vector<std::string> attention, rest;
      for (const auto& [name, t] : target->named_parameters())
        (name.find("self_attention") != std::string::npos ? attention : rest).push_back(name);
      mo.groups = {{"attention", attention}, {"rest", rest}};
    }
    MappingModel model(target, mo);
    nn::optim::Adam opt(model.parameters(), {.lr = 1e-2});
    const Tensor out = model.run(x).predictions;
    CHECK(out.sizes() == Shape{2, 10});
    nn::functional::cross_entropy(out, labels).backward();
    for (const auto& [name, z] : model.named_latents()) {
      INFO("latent " << name);
      REQUIRE(z.grad().defined());
      double norm = 0;
      for (float v : z.grad().to_vector<float>()) norm += double(v) * v;
      CHECK(std::isfinite(norm));
      CHECK(norm > 0);
    }
    opt.step();
  }
}

TEST_CASE("vit target: streamed module by module, bit for bit the plain mapped model") {
  // Streaming reaches the attention through MultiheadAttention's call and the encoder's own forward.
  CHECK(mn::testing::mapped_step_values("vit", true) == mn::testing::mapped_step_values("vit", false));
}
