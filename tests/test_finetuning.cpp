// Fine-tuning a pretrained target through latents (mapping/finetuning.h): the reference's semantics,
// gradients, blocks across weight and bias, pretrained files (checks, buffers, export round trip),
// kilobyte checkpoints that refuse another pretrained file, and mn-train's transfer flags.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "autograd/gradcheck.h"
#include "autograd/node.h"
#include "autograd/ops.h"
#include "mapping/checkpoint.h"
#include "mapping/finetuning.h"
#include "mapping/targets.h"
#include "nn/layers.h"
#include "nn/safetensors.h"
#include "nn/serialize.h"
#include "tests/mn_train_exe.h"
#include "tests/run_command.h"
#include "tests/temp_dir.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::mapping;
namespace fs = std::filesystem;
using mn::testing::contains;
using mn::testing::error_message;
using mn::testing::TempDir;

namespace {

// A module's parameters and buffers written as a plain safetensors state dict, as nn::save does.
std::string saved(const nn::Module& m, const TempDir& dir, const std::string& name) {
  const std::string path = dir.file(name);
  nn::save(m, path);
  return path;
}

std::vector<float> values(const Tensor& t) { return t.detach().contiguous().to_vector<float>(); }

// The generated parameters as one flat vector in spec order.
Tensor flat(const ParameterGenerator& gen, const LatentOverrides& latents = {}) {
  return gen.parameter_spec().flatten(gen.generate_parameters(latents));
}

}  // namespace

TEST_CASE("finetuning: the reference's Linear(4,2), L_b = 2, alpha = 0.1 case") {
  TempDir dir("mn_ft_ref");
  manual_seed(5);
  auto lin = std::make_shared<nn::Linear>(4, 2);
  const std::string path = saved(*lin, dir, "pre.safetensors");
  const PretrainedWeights pre = load_pretrained(path);
  FineTuningGenerator gen(ParameterSpec::from_module(*lin), 3, pre, {.block_size = 2, .alpha = 0.1});
  CHECK(gen.strategy() == "finetuning");
  CHECK(gen.group_names() == std::vector<std::string>{"<root>"});
  CHECK(gen.groups()[0].mapper->output_dim() == 5);  // ceil(10 / 2)
  CHECK(gen.trainable_parameter_count() == 3);

  const std::vector<float> theta = values(flat(gen));
  const std::vector<float> before = values(ParameterSpec::from_module(*lin).flatten(pre.tensors));
  const std::vector<float> o = values(gen.groups()[0].mapper->forward(gen.groups()[0].latent));
  REQUIRE(theta.size() == 10);
  bool differs = false;
  for (size_t i = 0; i < 10; ++i) {
    const double d = (theta[i] - before[i]) / 0.1;
    differs = differs || theta[i] != before[i];
    CHECK(d == doctest::Approx((theta[i & ~size_t{1}] - before[i & ~size_t{1}]) / 0.1));  // constant per block
    CHECK(d == doctest::Approx(o[i / 2]).epsilon(1e-4));                                  // = o[block]
  }
  CHECK(differs);

  MappingOptions mo{.latent_dim = 3, .strategy = "finetuning"};
  mo.pretrained = path;
  mo.finetune_block_size = 2;
  mo.finetune_alpha = 0.1;
  MappingModel model(lin, mo);
  CHECK(model.run(mn::testing::random_tensor({3, 4}, 1)).predictions.sizes() == Shape{3, 2});
  CHECK(model.named_latents().size() == 1);
  CHECK_FALSE(model.generator().scaling_initialized());  // parameter_scaling has nothing to scale here

  for (int64_t bad : {0, -3}) {
    const std::string msg = error_message(
        [&] { FineTuningGenerator(ParameterSpec::from_module(*lin), 3, pre, {.block_size = bad}); });
    CHECK(contains(msg, "block size must be positive, got " + std::to_string(bad)));
  }
  CHECK_THROWS_AS(make_generator("finetuning", ParameterSpec::from_module(*lin), 3), ValueError);
  CHECK(contains(error_message([&] { make_generator("finetuning", ParameterSpec::from_module(*lin), 3); }),
                 "MappingOptions::pretrained"));
  MappingOptions no_file{.latent_dim = 3, .strategy = "finetuning"};
  CHECK_THROWS_AS(MappingModel(lin, no_file), ValueError);
  CHECK_THROWS_AS(gen.set_scales({1.0f, 1.0f}), ValueError);
}

TEST_CASE("finetuning: a block straddles weight and bias; per-group alpha; gradcheck in the latents") {
  TempDir dir("mn_ft_straddle");
  manual_seed(6);
  auto net = std::make_shared<nn::Sequential>();
  net->push_back(std::make_shared<nn::Linear>(4, 1));  // group "0": 4 weights + 1 bias
  net->push_back(std::make_shared<nn::Linear>(1, 2));  // group "1": 2 weights + 2 biases
  const PretrainedWeights pre = load_pretrained(saved(*net, dir, "pre.safetensors"));
  FineTuningGenerator gen(ParameterSpec::from_module(*net), 2, pre,
                          {.block_size = 3, .alpha = 0.5, .group_alpha = {{"1", 2.0}}});
  CHECK(gen.group_alpha("0") == 0.5);
  CHECK(gen.group_alpha("1") == 2.0);
  // Group "0": blocks [w0 w1 w2] [w3 b0]: the bias moves with the last weight.
  const ParameterTree tree = gen.generate_parameters();
  const std::vector<float> w = values(tree.at("0.weight")), b = values(tree.at("0.bias"));
  const std::vector<float> w0 = values(pre.tensors.at("0.weight")), b0 = values(pre.tensors.at("0.bias"));
  CHECK(b[0] - b0[0] == doctest::Approx(w[3] - w0[3]));
  CHECK(w[0] - w0[0] == doctest::Approx(w[2] - w0[2]));
  CHECK(w[3] - w0[3] != doctest::Approx(w[0] - w0[0]));
  CHECK(gen.groups()[0].offset.sizes() == Shape{2, 3});  // padded to whole blocks, never beyond one
  // Group "1" uses its own alpha: (theta - pre) / 2 is its mapper's output.
  const std::vector<float> o1 = values(gen.groups()[1].mapper->forward(gen.groups()[1].latent));
  CHECK((values(tree.at("1.weight"))[0] - values(pre.tensors.at("1.weight"))[0]) / 2.0 == doctest::Approx(o1[0]));
  // Fixed bytes: mappers plus the pretrained blocks (5 -> 6 and 4 -> 6 floats).
  size_t mapper_bytes = 0;
  for (const auto& g : gen.groups()) mapper_bytes += g.mapper->fixed_bytes();
  CHECK(gen.fixed_bytes() == mapper_bytes + 12 * 4);
  CHECK(gen.buffers().size() >= 2);

  std::vector<Tensor> zs;
  for (auto& [n, t] : gen.named_latents()) zs.push_back(t.detach().clone().requires_grad_(true));
  const auto fn = [&](const std::vector<Tensor>& v) {
    return flat(gen, {{"0", v[0]}, {"1", v[1]}});
  };
  CHECK(autograd::gradcheck(fn, zs) == "");
  // L_b = 1: every parameter its own element.
  FineTuningGenerator each(ParameterSpec::from_module(*net), 2, pre, {.block_size = 1});
  CHECK(each.groups()[0].mapper->output_dim() == 5);
  CHECK(autograd::gradcheck([&](const std::vector<Tensor>& v) { return flat(each, {{"0", v[0]}, {"1", v[1]}}); },
                            zs) == "");
  CHECK_THROWS_AS(FineTuningGenerator(ParameterSpec::from_module(*net), 2, pre, {.group_alpha = {{"2", 1.0}}}),
                  KeyError);
}

TEST_CASE("finetuning: the pretrained file must hold every parameter with its shape and a float dtype") {
  TempDir dir("mn_ft_check");
  auto lin = std::make_shared<nn::Linear>(3, 2);
  const ParameterSpec spec = ParameterSpec::from_module(*lin);
  const Tensor w = zeros({2, 3}), b = zeros({2});
  const auto message = [&](const safetensors::NamedTensors& tensors, const safetensors::StringMap& dtypes = {}) {
    const std::string path = dir.file("p.safetensors");
    safetensors::save(path, tensors, {}, dtypes);
    return error_message([&] { FineTuningGenerator(spec, 2, load_pretrained(path)); });
  };
  std::string msg = message({{"weight", w}});
  CHECK(contains(msg, "missing [bias]"));
  CHECK(contains(msg, "p.safetensors"));
  msg = message({{"weight", zeros({3, 2})}, {"bias", b}});
  CHECK(contains(msg, "shape mismatch for 'weight': file [3, 2], target [2, 3]"));
  msg = message({{"weight", w}, {"bias", from_vector(std::vector<int64_t>{1, 2}, {2})}}, {{"bias", "I32"}});
  CHECK(contains(msg, "'bias' is stored as I32"));
  // Extra entries are fine, and F16/F64 weights are floats.
  CHECK(message({{"weight", w}, {"bias", b}, {"other.running_mean", b}}, {{"weight", "F16"}, {"bias", "F64"}}) == "");
  CHECK_THROWS_AS(load_pretrained(dir.file("absent.safetensors")), IOError);
}

TEST_CASE("finetuning: export -> fine-tune round trip (zero latents give the exported model, buffers included)") {
  TempDir dir("mn_ft_roundtrip");
  manual_seed(7);
  auto make = [] {
    auto net = std::make_shared<nn::Sequential>();
    net->push_back(std::make_shared<nn::Linear>(4, 3));
    net->push_back(std::make_shared<nn::BatchNorm1d>(3));
    net->push_back(std::make_shared<nn::Linear>(3, 2));
    return net;
  };
  MappingModel source(make(), {.latent_dim = 4, .strategy = "layerwise", .seed = 2, .write_back_buffers = true});
  source.train();
  source.run(mn::testing::random_tensor({8, 4}, 3));  // moves the running statistics off their init
  source.eval();
  const std::string path = dir.file("exported.safetensors");
  export_generated_parameters(path, source);

  MappingOptions mo{.latent_dim = 5, .strategy = "finetuning", .seed = 9};
  mo.pretrained = path;
  MappingModel ft(make(), mo);
  ft.eval();
  for (const auto& [name, t] : source.buffers()) {
    INFO(name);
    const Tensor mine = ft.buffers().at(name);
    REQUIRE(mine.dtype() == t.dtype());
    if (t.dtype() == kInt64)
      CHECK(mine.to_vector<int64_t>() == t.to_vector<int64_t>());
    else
      CHECK(mine.to_vector<float>() == t.to_vector<float>());
  }
  CHECK(source.buffers().at("1.running_mean").to_vector<float>() != std::vector<float>(3, 0.0f));
  LatentOverrides zero;
  for (const auto& [name, z] : ft.named_latents()) zero[name] = zeros(z.sizes());
  const Tensor x = mn::testing::random_tensor({5, 4}, 4);
  autograd::NoGradGuard no_grad;
  CHECK(values(flat(ft.generator(), zero)) == values(flat(source.generator())));
  CHECK(values(ft.run(x, zero).predictions) == values(source.run(x).predictions));
  CHECK(values(flat(ft.generator())) != values(flat(source.generator())));  // its own latents modulate
}

TEST_CASE("finetuning: checkpoints are kilobytes and refuse another pretrained file") {
  TempDir dir("mn_ft_ckpt");
  manual_seed(8);
  auto target = make_target("cnn2");
  const std::string pre = saved(*target, dir, "pre.safetensors");
  MappingOptions mo{.latent_dim = 16, .strategy = "finetuning", .seed = 1};
  mo.pretrained = pre;
  mo.finetune_block_size = 100;
  MappingModel model(target, mo);
  CHECK(model.trainable_parameter_count() == 16 * 4);
  const std::string ckpt = dir.file("ckpt.safetensors");
  save_checkpoint(ckpt, model);
  CHECK(fs::file_size(pre) > 400'000);     // cnn2's 108,618 floats
  CHECK(fs::file_size(ckpt) < 8 * 1024);   // latents and metadata only
  const CheckpointInfo info = read_checkpoint(ckpt);
  const auto meta = nlohmann::json::parse(info.finetuning);
  CHECK(meta.at("pretrained") == pre);
  CHECK(meta.at("hash") == pretrained_hash_hex(load_pretrained(pre).hash));
  CHECK(meta.at("block_size") == 100);

  MappingModel again(make_target("cnn2"), mo);
  {
    autograd::NoGradGuard no_grad;
    Tensor z = again.named_latents()[0].second;
    z.fill_(0.0);
  }
  load_checkpoint(ckpt, again);
  CHECK(values(again.named_latents()[0].second) == values(model.named_latents()[0].second));

  // Another file (one weight changed) at the same path: refused, naming both hashes and the path.
  const std::string old_hash = pretrained_hash_hex(load_pretrained(pre).hash);
  {
    safetensors::File f = safetensors::load(pre);
    safetensors::NamedTensors tensors;
    for (auto& e : f.tensors) tensors.emplace_back(e.name, e.tensor.clone());
    tensors[0].second.fill_(0.5);
    safetensors::save(pre, tensors);
  }
  const std::string new_hash = pretrained_hash_hex(load_pretrained(pre).hash);
  REQUIRE(new_hash != old_hash);
  MappingModel other(make_target("cnn2"), mo);
  const std::string msg = error_message([&] { load_checkpoint(ckpt, other); });
  CHECK(contains(msg, old_hash));
  CHECK(contains(msg, new_hash));
  CHECK(contains(msg, pre));
  // Another block size is refused too.
  MappingOptions coarse = mo;
  coarse.finetune_block_size = 50;
  MappingModel blocky(make_target("cnn2"), coarse);
  CHECK_THROWS_AS(load_checkpoint(ckpt, blocky), ValueError);
}

namespace {
mn::testing::CommandResult mn_train(const std::string& exe, const std::string& args) {
  return mn::testing::run_command(exe + " " + args);
}
nlohmann::json json_summary(const mn::testing::CommandResult& r) {
  INFO("mn-train output:\n" << r.all());
  REQUIRE(r.status == 0);
  return nlohmann::json::parse(r.last_line());
}
}  // namespace

TEST_CASE("mn-train: --classes, --strategy finetuning --pretrained, --init-from and the hash check on --resume") {
  std::string exe;
  if (!mn::testing::mn_train_ready(exe)) return;
  TempDir dir("mn_ft_cli");
  const std::string small = "--target cnn2 --limit 512 --batch-size 128 --seed 3 --threads 1 --json";
  const auto a = json_summary(mn_train(exe, str(small, " --strategy direct --classes 0-4 --epochs 1 --out ", dir / "a")));
  const std::string weights = a.at("weights").get<std::string>();

  // The exported weights, evaluated on the same classes, give the run's accuracy; on 5-9 almost none.
  const auto same = json_summary(mn_train(
      exe, str(small, " --strategy direct --classes 0-4 --epochs 0 --init-from ", weights, " --out ", dir / "a0")));
  CHECK(same.at("test_accuracy").get<double>() == doctest::Approx(a.at("test_accuracy").get<double>()));
  const auto unseen = json_summary(mn_train(
      exe, str(small, " --strategy direct --classes 5,6,7-9 --epochs 0 --init-from ", weights, " --out ", dir / "a1")));
  CHECK(unseen.at("test_accuracy").get<double>() < 0.2);
  // --rank would replace the loaded weights it factors by freshly drawn factors: refused, not ignored.
  const auto factored = mn_train(exe, str(small, " --strategy direct --rank 4 --epochs 0 --init-from ", weights,
                                          " --out ", dir / "a2"));
  CHECK(factored.status != 0);
  CHECK(contains(factored.all(), "--init-from"));
  CHECK(contains(factored.all(), "--rank"));

  const auto b = json_summary(mn_train(exe, str(small, " --strategy finetuning --pretrained ", weights,
                                                " --block-size 100 --finetune-alpha 0.02 --latent-dim 16 --classes "
                                                "5-9 --epochs 1 --out ",
                                                dir / "b")));
  CHECK(b.at("trainable_params") == 16 * 4);
  CHECK(b.at("target_params") == 108618);
  CHECK(fs::file_size(dir / "b/checkpoint.safetensors") < 16 * 1024);
  const auto config = nlohmann::json::parse(read_checkpoint(dir / "b/checkpoint.safetensors").config);
  CHECK(config.at("classes") == nlohmann::json({5, 6, 7, 8, 9}));
  CHECK(config.at("pretrained") == weights);
  CHECK(config.at("block_size") == 100);

  // A resume flag that disagrees, then a changed pretrained file: both refused.
  auto r = mn_train(exe, str("--out ", dir / "b", " --resume --epochs 2 --block-size 50"));
  CHECK(r.status != 0);
  CHECK(contains(r.all(), "--block-size"));
  {
    safetensors::File f = safetensors::load(weights);
    safetensors::NamedTensors tensors;
    for (auto& e : f.tensors) tensors.emplace_back(e.name, e.tensor.clone());
    tensors[0].second.fill_(0.25);
    safetensors::save(weights, tensors);
  }
  r = mn_train(exe, str("--out ", dir / "b", " --resume --epochs 2 --threads 1"));
  CHECK(r.status != 0);
  CHECK(contains(r.all(), "hash"));
  CHECK(contains(r.all(), weights));

  // Misuse is named.
  r = mn_train(exe, str(small, " --strategy finetuning --epochs 1 --out ", dir / "c"));
  CHECK(contains(r.all(), "--pretrained"));
  r = mn_train(exe, str(small, " --strategy layerwise --pretrained ", weights, " --out ", dir / "c"));
  CHECK(contains(r.all(), "--init-from"));
  r = mn_train(exe, str(small, " --strategy direct --classes 3-12 --out ", dir / "c"));
  CHECK(r.status != 0);
  CHECK(contains(r.all(), "'12'"));
}

TEST_CASE("finetuning: streamed layer by layer (stream_layers) it trains the same as generated at once") {
  TempDir dir("mn_ft_stream");
  manual_seed(9);
  auto make = [] {
    auto net = std::make_shared<nn::Sequential>();
    net->push_back(std::make_shared<nn::Linear>(4, 3));
    net->push_back(std::make_shared<nn::ReLU>());
    net->push_back(std::make_shared<nn::Linear>(3, 2));
    return net;
  };
  auto first = make();
  const std::string path = saved(*first, dir, "pre.safetensors");
  MappingOptions mo{.latent_dim = 3, .strategy = "finetuning", .seed = 4};
  mo.pretrained = path;
  mo.finetune_block_size = 4;
  mo.finetune_alpha = 0.3;
  MappingModel whole(first, mo);
  mo.stream_layers = true;
  MappingModel streamed(make(), mo);
  const Tensor x = mn::testing::random_tensor({5, 4}, 5);
  const Tensor a = whole.run(x).predictions, b = streamed.run(x).predictions;
  CHECK(values(a) == values(b));
  sum(a).backward();
  sum(b).backward();
  for (size_t i = 0; i < whole.named_latents().size(); ++i) {
    INFO(whole.named_latents()[i].first);
    const std::vector<float> ga = values(whole.named_latents()[i].second.grad());
    const std::vector<float> gb = values(streamed.named_latents()[i].second.grad());
    REQUIRE(ga.size() == gb.size());
    for (size_t k = 0; k < ga.size(); ++k) CHECK(ga[k] == doctest::Approx(gb[k]).epsilon(1e-5));
  }
}
