// The residual targets (mapping/resnet.h): parameter counts and layer-wise groups, names, shapes and
// outputs against the plain-torch twins of tests/parity/make_targets.py, and every mapping strategy
// on resnet20. resnet18 is only built here (names, shapes, counts), never run: its forward is heavy on
// the CPU (tests/test_targets.cpp runs it once at batch 2).
#include <cmath>
#include <nlohmann/json.hpp>
#include <sstream>

#include "autograd/engine.h"
#include "mapping/checkpoint.h"
#include "mapping/generator.h"
#include "mapping/mapping_model.h"
#include "mapping/resnet.h"
#include "mapping/targets.h"
#include "nn/functional.h"
#include "nn/optim.h"
#include "nn/safetensors.h"
#include "tests/mn_train_exe.h"
#include "tests/run_command.h"
#include "tests/target_twins.h"
#include "tests/temp_dir.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::mapping;
using mn::testing::fixture;
using mn::testing::listing;
using mn::testing::max_rel_diff;
using mn::testing::random_tensor;

namespace {

std::vector<std::pair<std::string, std::vector<std::string>>> weights_and_others(const nn::Module& target) {
  std::vector<std::string> weights, others;
  for (const auto& [name, t] : target.named_parameters())
    (name.size() >= 6 && name.compare(name.size() - 6, 6, "weight") == 0 ? weights : others).push_back(name);
  return {{"weights", weights}, {"others", others}};
}

}  // namespace

TEST_CASE("resnet targets: parameter counts and layer-wise groups follow the owning modules") {
  manual_seed(0);
  const ParameterSpec r20 = target_spec("resnet20");
  CHECK(r20.total_numel() == 272186);
  const auto groups20 = layerwise_groups(r20);
  // stem conv + bn, 9 blocks x (2 convs + 2 bns), 2 downsample convs + bns, fc
  REQUIRE(groups20.size() == 43);
  CHECK(groups20[0].first == "conv1");
  CHECK(groups20[1].first == "bn1");
  CHECK(groups20[2].first == "layer1.0.conv1");
  CHECK(groups20[5].first == "layer1.0.bn2");
  CHECK(groups20[18].first == "layer2.0.downsample.0");
  CHECK(groups20[19].first == "layer2.0.downsample.1");
  CHECK(groups20[42].first == "fc");
  CHECK(groups20[42].second == std::vector<std::string>{"fc.weight", "fc.bias"});
  CHECK(groups20[1].second == std::vector<std::string>{"bn1.weight", "bn1.bias"});

  const ParameterSpec r18 = target_spec("resnet18");
  CHECK(r18.total_numel() == 11172810);
  const auto groups18 = layerwise_groups(r18);
  CHECK(groups18.size() == 41);
  CHECK(groups18[14].first == "layer2.0.downsample.0");
  CHECK(r18.entry("layer4.1.conv2.weight").shape == Shape{512, 512, 3, 3});
  CHECK(r18.entry("conv1.weight").shape == Shape{64, 1, 3, 3});

  // No biases on the convolutions; BatchNorm carries torch's three buffers.
  auto net = resnet20();
  CHECK_FALSE(r20.contains("conv1.bias"));
  CHECK(net->named_buffers().size() == 3 * 21);
  CHECK(net->layers[1]->operator[](0)->type_name() == "BasicBlock");
  CHECK(net->layers[0]->operator[](0)->named_children().size() == 4);  // identity shortcut
  CHECK_THROWS_AS(ResNet(1, {16, 32}, {3}, 10), ValueError);
  CHECK_THROWS_AS(ResNet(1, {16}, {0}, 10), ValueError);
  CHECK_THROWS_AS(BasicBlock(16, 16, 0), ValueError);
  CHECK_THROWS_AS(net->forward(zeros({2, 3, 28, 28})), ValueError);
}

TEST_CASE("resnet targets: names and shapes are those of the torch twins, in torch's order") {
  const safetensors::File twin = fixture("parity_resnet_targets");
  manual_seed(0);
  auto r20 = make_target("resnet20");
  CHECK(listing(r20->named_parameters()) == twin.metadata.at("resnet20_parameters"));
  CHECK(listing(r20->named_buffers()) == twin.metadata.at("resnet20_buffers"));
  auto r18 = make_target("resnet18");
  CHECK(listing(r18->named_parameters()) == twin.metadata.at("resnet18_parameters"));
  CHECK(listing(r18->named_buffers()) == twin.metadata.at("resnet18_buffers"));
}

TEST_CASE("resnet targets: resnet20 with exported weights computes what its torch twin computes") {
  // resnet20_weights: mn-train's export of a briefly trained resnet20 (make_targets.py says how),
  // which the twin loaded with strict=True; the outputs are the twin's.
  const safetensors::File weights = fixture("resnet20_weights");
  const safetensors::File twin = fixture("parity_resnet_targets");
  auto net = make_target("resnet20");
  net->load_state_dict(weights.state_dict(), /*strict=*/true);
  const Tensor x = twin.at("input");
  autograd::NoGradGuard no_grad;
  net->eval();
  CHECK(max_rel_diff(net->forward(x), twin.at("resnet20_eval")) <= 1e-5);
  // Train mode normalises with the batch statistics and updates the running ones.
  net->train();
  CHECK(max_rel_diff(net->forward(x), twin.at("resnet20_train")) <= 1e-5);
  auto block = std::dynamic_pointer_cast<BasicBlock>(
      std::dynamic_pointer_cast<ResNet>(net)->layers[2]->operator[](2));
  REQUIRE(block);
  CHECK(max_rel_diff(block->bn2->buffer("running_mean"), twin.at("resnet20_running_mean_after")) <= 1e-5);
}

TEST_CASE("resnet targets: a BasicBlock's gradient through both paths matches finite differences") {
  manual_seed(3);
  for (int64_t stride : {1, 2}) {
    INFO("stride " << stride);
    BasicBlock block(2, stride == 1 ? 2 : 3, stride);
    CHECK((block.downsample != nullptr) == (stride == 2));
    const Tensor x = random_tensor({2, 2, 5, 5}, 11).requires_grad_(true);
    // Train mode: BatchNorm on the batch statistics, so the input reaches the output through them too.
    CHECK(autograd::gradcheck([&](const std::vector<Tensor>& in) { return block.forward(in[0]); }, {x}) == "");
  }
}

TEST_CASE("resnet targets: every strategy maps resnet20; the export reproduces the mapped model") {
  const Tensor x = random_tensor({2, 1, 28, 28}, 5);
  const Tensor labels = from_vector(std::vector<int64_t>{3, 7}, Shape{2});
  Tensor layerwise_out;
  for (const char* strategy : {"slvt", "layerwise", "lazy_layerwise", "grouped"}) {
    INFO("strategy " << strategy);
    manual_seed(1);
    auto target = make_target("resnet20");
    MappingOptions mo{.latent_dim = 8, .strategy = strategy, .seed = 3, .write_back_buffers = true};
    if (std::string(strategy) == "grouped") mo.groups = weights_and_others(*target);
    MappingModel model(target, mo);
    const size_t expected_groups = std::string(strategy) == "slvt" ? 1 : std::string(strategy) == "grouped" ? 2 : 43;
    CHECK(model.generator().groups().size() == expected_groups);
    CHECK(model.trainable_parameter_count() == int64_t(8 * expected_groups));

    nn::optim::Adam opt(model.parameters(), {.lr = 1e-2});
    const Tensor out = model.run(x).predictions;
    CHECK(out.sizes() == Shape{2, 10});
    if (std::string(strategy) == "layerwise") layerwise_out = out.detach();
    if (std::string(strategy) == "lazy_layerwise")  // the same values, bit for bit
      CHECK(out.to_vector<float>() == layerwise_out.to_vector<float>());
    nn::functional::cross_entropy(out, labels).backward();
    for (const auto& [name, z] : model.named_latents()) {
      INFO("latent " << name);
      REQUIRE(z.grad().defined());
      const std::vector<float> g = z.grad().to_vector<float>();
      float norm = 0;
      for (float v : g) norm += v * v;
      CHECK(std::isfinite(norm));
      CHECK(norm > 0);
    }
    opt.step();

    // The export holds the generated weights and the written-back running statistics: the plain
    // target loads it strictly and agrees with the mapped model in eval mode.
    testing::TempDir dir("mn_resnet_test");
    export_generated_parameters(dir.file("w.safetensors"), model);
    auto plain = make_target("resnet20");
    plain->load_state_dict(safetensors::load(dir.file("w.safetensors")).state_dict(), /*strict=*/true);
    const safetensors::File exported = safetensors::load(dir.file("w.safetensors"));
    CHECK(exported.at("bn1.num_batches_tracked").to_vector<int64_t>() == std::vector<int64_t>{1});
    autograd::NoGradGuard no_grad;
    model.eval();
    plain->eval();
    CHECK(max_rel_diff(plain->forward(x), model.run(x).predictions) <= 1e-5);
  }
}

TEST_CASE("resnet targets: mn-train trains resnet20 through layerwise and exports loadable weights") {
  std::string exe;
  if (!testing::mn_train_ready(exe)) return;
  testing::TempDir dir("mn_resnet_test");
  const testing::CommandResult r = testing::run_command(
      str(exe, " --target resnet20 --strategy layerwise --latent-dim 8 --epochs 1 --limit 32 --batch-size 16",
          " --threads 2 --seed 3 --json --out ", dir.path()));
  INFO("mn-train output:\n" << r.all());
  REQUIRE(r.status == 0);
  const nlohmann::json summary = nlohmann::json::parse(r.last_line());
  CHECK(summary["target_params"] == 272186);
  CHECK(summary["trainable_params"] == 43 * 8);
  auto plain = make_target("resnet20");
  const safetensors::File exported = safetensors::load((dir.path() / "weights.safetensors").string());
  plain->load_state_dict(exported.state_dict(), /*strict=*/true);
  // Two training steps updated the running statistics the export carries.
  CHECK(exported.at("fc.weight").sizes() == Shape{10, 64});
  CHECK(exported.at("bn1.num_batches_tracked").to_vector<int64_t>() == std::vector<int64_t>{2});
}

TEST_CASE("resnet targets: resnet20 streamed module by module, bit for bit the plain mapped model") {
  // Predictions, latent gradients and the written-back BatchNorm statistics.
  CHECK(mn::testing::mapped_step_values("resnet20", true) == mn::testing::mapped_step_values("resnet20", false));
}
