// Checkpoints (mapping/checkpoint.h): round trips reproduce predictions and latents exactly, files
// stay small (no mapper matrices, no target weights), incompatible models fail before they are
// touched with messages naming the difference, damaged files are IOErrors, saves are atomic,
// trainer state resumes bit for bit, and exported generated parameters load by the target's names.
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>

#include "mapping/checkpoint.h"
#include "mapping/targets.h"
#include "nn/functional.h"
#include "nn/layers.h"
#include "nn/optim.h"
#include "nn/safetensors.h"
#include "tests/test_support.h"
#include "tests/temp_dir.h"

using namespace mn;
using namespace mn::mapping;
namespace fs = std::filesystem;

namespace {

using mn::testing::contains;
using mn::testing::error_message;
using mn::testing::read_bytes;
using mn::testing::TempDir;

// A fresh directory under the system temp dir, removed at scope exit.
std::shared_ptr<nn::Sequential> mlp_target(int64_t in, int64_t hidden, int64_t out) {
  return std::make_shared<nn::Sequential>(
      std::vector<nn::ModulePtr>{std::make_shared<nn::Linear>(in, hidden), std::make_shared<nn::ReLU>(),
                                 std::make_shared<nn::Linear>(hidden, out)});
}

std::shared_ptr<nn::Sequential> small_cnn() {
  return std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
      std::make_shared<nn::Conv2d>(1, 4, 3), std::make_shared<nn::ReLU>(), std::make_shared<nn::MaxPool2d>(2),
      std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(4 * 3 * 3, 3)});
}

MappingOptions options(const std::string& strategy, int64_t latent_dim, uint64_t seed = 7) {
  MappingOptions o;
  o.strategy = strategy;
  o.latent_dim = latent_dim;
  o.seed = seed;
  return o;
}

// A few Adam steps on random regression data, so the latents differ from their initial values.
void train_a_little(MappingModel& model, const Tensor& x, const Tensor& y, int steps = 5) {
  nn::optim::Adam adam(model.parameters(), nn::optim::AdamOptions{.lr = 0.05});
  for (int i = 0; i < steps; ++i) {
    Tensor loss = nn::functional::mse_loss(model.run(x).predictions, y);
    adam.zero_grad();
    loss.backward();
    adam.step();
  }
}

Tensor predict(MappingModel& model, const Tensor& x) {
  autograd::NoGradGuard no_grad;
  return model.run(x).predictions;
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const std::vector<float> va = a.to_vector<float>(), vb = b.to_vector<float>();
  REQUIRE(va.size() == vb.size());
  double m = 0;
  for (size_t i = 0; i < va.size(); ++i) m = std::max(m, static_cast<double>(std::abs(va[i] - vb[i])));
  return m;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.sizes() == b.sizes() && a.to_vector<float>() == b.to_vector<float>();
}

void check_same_latents(const MappingModel& a, const MappingModel& b) {
  const auto la = a.named_latents(), lb = b.named_latents();
  REQUIRE(la.size() == lb.size());
  for (size_t i = 0; i < la.size(); ++i) {
    CHECK(la[i].first == lb[i].first);
    CHECK(bitwise_equal(la[i].second, lb[i].second));
  }
}

// Rewrites a checkpoint with one metadata entry changed (value "" removes it).
void rewrite_metadata(const std::string& path, const std::string& key, const std::string& value) {
  safetensors::File file = safetensors::load(path);
  safetensors::NamedTensors tensors;
  for (const auto& e : file.tensors) tensors.emplace_back(e.name, e.tensor);
  if (value.empty())
    file.metadata.erase(key);
  else
    file.metadata[key] = value;
  safetensors::save(path, tensors, file.metadata);
}

}  // namespace

TEST_CASE(
    "checkpoint: round trip restores latents and predictions exactly, into a differently initialised target") {
  TempDir dir("mn_checkpoint_test");
  manual_seed(1);
  MappingModel model(mlp_target(6, 8, 3), options("layerwise", 8));
  Tensor x = randn({5, 6}), y = randn({5, 3});
  train_a_little(model, x, y);
  const std::string path = dir.file("ckpt.safetensors");
  save_checkpoint(path, model);

  // A different target init changes the per-tensor scales; the checkpoint's scales must win.
  manual_seed(99);
  MappingModel fresh(mlp_target(6, 8, 3), options("layerwise", 8));
  CHECK(max_abs_diff(predict(fresh, x), predict(model, x)) > 1e-3);
  const Tensor latent_before = fresh.named_latents()[0].second;
  const CheckpointInfo info = load_checkpoint(path, fresh);
  CHECK(max_abs_diff(predict(fresh, x), predict(model, x)) <= 1e-6);
  check_same_latents(model, fresh);
  // In place: the model's latent tensors are the same objects (an optimizer over them stays valid).
  CHECK(fresh.named_latents()[0].second.storage() == latent_before.storage());
  CHECK(fresh.named_latents()[0].second.requires_grad());
  CHECK(fresh.generator().per_entry_scales() == model.generator().per_entry_scales());
  CHECK(info.schema_version == kCheckpointSchemaVersion);
  CHECK(info.package_version == kPackageVersion);
  CHECK(info.strategy == "layerwise");
  CHECK(info.seed == 7);
  CHECK(info.latent_dims == std::vector<std::pair<std::string, int64_t>>{{"0", 8}, {"2", 8}});
  CHECK(info.parameter_scaling);
  CHECK(info.spec.size() == 4);
  CHECK(info.spec[0] == std::pair<std::string, Shape>{"0.weight", Shape{8, 6}});
  CHECK_FALSE(info.trainer_state.has_value());
  CHECK(info.trainer_state_json.empty());
}

TEST_CASE("checkpoint: CNN, slvt, grouped and unscaled models round trip") {
  TempDir dir("mn_checkpoint_test");
  Tensor x = randn({2, 1, 8, 8}), y = randn({2, 3});
  SUBCASE("cnn layerwise") {
    manual_seed(3);
    MappingModel model(small_cnn(), options("layerwise", 6));
    train_a_little(model, x, y);
    save_checkpoint(dir.file("a.safetensors"), model);
    manual_seed(4);
    MappingModel fresh(small_cnn(), options("layerwise", 6));
    load_checkpoint(dir.file("a.safetensors"), fresh);
    CHECK(max_abs_diff(predict(fresh, x), predict(model, x)) <= 1e-6);
    check_same_latents(model, fresh);
  }
  SUBCASE("cnn slvt") {
    manual_seed(3);
    MappingModel model(small_cnn(), options("slvt", 10));
    train_a_little(model, x, y);
    save_checkpoint(dir.file("b.safetensors"), model);
    MappingModel fresh(small_cnn(), options("slvt", 10));
    load_checkpoint(dir.file("b.safetensors"), fresh);
    CHECK(max_abs_diff(predict(fresh, x), predict(model, x)) <= 1e-6);
    check_same_latents(model, fresh);
  }
  SUBCASE("grouped with per-group dims, no scaling") {
    auto build = [] {
      auto target = small_cnn();
      MappingOptions o = options("grouped", 4);
      o.parameter_scaling = false;
      o.groups = {{"weights", {"0.weight", "4.weight"}}, {"biases", {"0.bias", "4.bias"}}};
      o.group_latent_dims = {{"weights", 9}, {"biases", 3}};
      return MappingModel(target, o);
    };
    MappingModel model = build();
    train_a_little(model, x, y);
    save_checkpoint(dir.file("c.safetensors"), model);
    MappingModel fresh = build();
    const CheckpointInfo info = load_checkpoint(dir.file("c.safetensors"), fresh);
    CHECK_FALSE(info.parameter_scaling);
    CHECK(info.latent_dims == std::vector<std::pair<std::string, int64_t>>{{"weights", 9}, {"biases", 3}});
    CHECK(max_abs_diff(predict(fresh, x), predict(model, x)) <= 1e-6);
    check_same_latents(model, fresh);
  }
  SUBCASE("layerwise and lazy_layerwise checkpoints are interchangeable") {
    MappingModel model(small_cnn(), options("layerwise", 5));
    train_a_little(model, x, y);
    save_checkpoint(dir.file("d.safetensors"), model);
    MappingModel lazy(small_cnn(), options("lazy_layerwise", 5));
    load_checkpoint(dir.file("d.safetensors"), lazy);
    CHECK(bitwise_equal(predict(lazy, x), predict(model, x)));
  }
}

TEST_CASE("checkpoint: files hold kilobytes - latents, scales and metadata, never mapper or target weights") {
  TempDir dir("mn_checkpoint_test");
  SUBCASE("Linear(32, 32), L = 32") {
    auto target = std::make_shared<nn::Linear>(32, 32);
    MappingModel model(target, options("layerwise", 32));
    const std::string path = dir.file("linear.safetensors");
    save_checkpoint(path, model);
    const auto bytes = fs::file_size(path);
    MESSAGE("Linear(32,32) L=32 checkpoint: " << bytes << " bytes (mapper factors held in memory: "
                                              << model.generator().fixed_bytes() << " bytes)");
    CHECK(bytes < 100 * 1000);
    const safetensors::File file = safetensors::load(path);
    for (const auto& e : file.tensors)
      for (const auto& name : model.parameter_spec().names()) {
        INFO("tensor key " << e.name);
        CHECK(e.name != name);
        CHECK_FALSE((e.name.size() > name.size() &&
                     e.name.compare(e.name.size() - name.size() - 1, name.size() + 1, "/" + name) == 0));
      }
    CHECK(file.contains("latent/<root>"));
    CHECK(file.at("latent/<root>").sizes() == Shape{32});
    CHECK(file.contains("scales"));
    for (const char* key : {"format", "schema_version", "package_version", "strategy", "seed", "latent_dims",
                            "groups", "parameter_scaling", "mapper", "spec", "metadata"}) {
      INFO("metadata " << key);
      CHECK(file.metadata.count(key) == 1);
    }
    CHECK(file.metadata.at("schema_version") == "1");
    CHECK(file.metadata.at("strategy") == "\"layerwise\"");
  }
  SUBCASE("CNN2 layerwise, 4 x 672 latents") {
    manual_seed(0);
    MappingModel model(make_target("cnn2"), options("layerwise", 672));
    CHECK(model.target_parameter_count() == 108618);
    CHECK(model.trainable_parameter_count() == 4 * 672);
    const std::string path = dir.file("cnn2.safetensors");
    save_checkpoint(path, model);
    const auto bytes = fs::file_size(path);
    MESSAGE("CNN2 layerwise 4x672 checkpoint: " << bytes << " bytes; the dense mapper matrices would be "
                                                << model.generator().fixed_projection_bytes() << " bytes");
    CHECK(bytes < 100 * 1000);
    const safetensors::File file = safetensors::load(path);
    for (const auto& e : file.tensors) CHECK_FALSE(model.parameter_spec().contains(e.name));
  }
}

TEST_CASE("checkpoint: an incompatible model is rejected before it is touched, naming the difference") {
  TempDir dir("mn_checkpoint_test");
  const std::string path = dir.file("linear.safetensors");
  auto saved_target =
      std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{std::make_shared<nn::Linear>(4, 8)});
  MappingModel saved(saved_target, options("layerwise", 4));
  save_checkpoint(path, saved);

  SUBCASE("different shapes: the first differing parameter with both shapes") {
    auto other =
        std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{std::make_shared<nn::Linear>(4, 2)});
    MappingModel model(other, options("layerwise", 4));
    const Tensor before = model.named_latents()[0].second.clone();
    CHECK_THROWS_WITH_AS(load_checkpoint(path, model),
                         doctest::Contains("shape mismatch for '0.weight': checkpoint [8, 4], model [2, 4]"),
                         ValueError);
    CHECK_THROWS_WITH_AS(load_checkpoint(path, model), doctest::Contains("shape mismatch for '0.bias'"),
                         ValueError);
    CHECK(bitwise_equal(model.named_latents()[0].second, before));
  }
  SUBCASE("deeper model: parameter count differs") {
    MappingModel model(mlp_target(4, 8, 2), options("layerwise", 4));
    CHECK_THROWS_WITH_AS(load_checkpoint(path, model), doctest::Contains("The target architecture differs."),
                         ValueError);
  }
  SUBCASE("other strategy") {
    MappingModel model(saved_target, options("slvt", 4));
    CHECK_THROWS_WITH_AS(load_checkpoint(path, model), doctest::Contains("strategy 'layerwise'"), ValueError);
  }
  SUBCASE("other latent dimension") {
    MappingModel model(saved_target, options("layerwise", 5));
    CHECK_THROWS_WITH_AS(load_checkpoint(path, model),
                         doctest::Contains("latent dimension mismatch for group '0': checkpoint 4, model 5"),
                         ValueError);
  }
  SUBCASE("per-group latent lengths: the group whose length differs") {
    MappingOptions per_group = options("layerwise", 4);
    per_group.group_latent_dims = {{"0", 6}};
    MappingModel model(saved_target, per_group);
    CHECK_THROWS_WITH_AS(load_checkpoint(path, model),
                         doctest::Contains("latent dimension mismatch for group '0': checkpoint 4, model 6"),
                         ValueError);
  }
  SUBCASE("other seed: the mapper matrices would differ") {
    MappingModel model(saved_target, options("layerwise", 4, /*seed=*/8));
    CHECK_THROWS_WITH_AS(load_checkpoint(path, model), doctest::Contains("seed 7"), ValueError);
  }
  SUBCASE("other alpha") {
    MappingOptions o = options("layerwise", 4);
    o.alpha = 0.05;
    MappingModel model(saved_target, o);
    CHECK_THROWS_WITH_AS(load_checkpoint(path, model), doctest::Contains("alpha"), ValueError);
  }
  SUBCASE("scaling off in the checkpoint, on in the model") {
    MappingOptions o = options("layerwise", 4);
    o.parameter_scaling = false;
    MappingModel unscaled(saved_target, o);
    save_checkpoint(dir.file("unscaled.safetensors"), unscaled);
    CHECK_THROWS_WITH_AS(load_checkpoint(dir.file("unscaled.safetensors"), saved), doctest::Contains("scaling"),
                         ValueError);
  }
  SUBCASE("the same architecture loads") {
    auto same =
        std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{std::make_shared<nn::Linear>(4, 8)});
    MappingModel model(same, options("layerwise", 4));
    CHECK_NOTHROW(load_checkpoint(path, model));
  }
}

TEST_CASE("checkpoint: versions, missing and damaged files") {
  TempDir dir("mn_checkpoint_test");
  auto target = std::make_shared<nn::Linear>(3, 2);
  MappingModel model(target, options("layerwise", 4));
  const std::string path = dir.file("v.safetensors");
  save_checkpoint(path, model);

  SUBCASE("newer schema") {
    rewrite_metadata(path, "schema_version", std::to_string(kCheckpointSchemaVersion + 999));
    CHECK_THROWS_WITH_AS(load_checkpoint(path, model), doctest::Contains("newer"), ValueError);
  }
  SUBCASE("no schema_version") {
    rewrite_metadata(path, "schema_version", "");
    CHECK_THROWS_WITH_AS(load_checkpoint(path, model), doctest::Contains("'schema_version'"), KeyError);
  }
  SUBCASE("another mapper construction") {
    // A file from before the construction was recorded (double-precision factorisations).
    rewrite_metadata(path, "mapper", "{\"default\": true, \"alpha\": 0.01, \"groups\": {}}");
    CHECK_THROWS_WITH_AS(load_checkpoint(path, model), doctest::Contains("philox-householder-f64"), ValueError);
  }
  SUBCASE("a required section missing") {
    rewrite_metadata(path, "spec", "");
    CHECK_THROWS_WITH_AS(load_checkpoint(path, model), doctest::Contains("'spec'"), KeyError);
  }
  SUBCASE("missing file") {
    CHECK_THROWS_WITH_AS(load_checkpoint(dir.file("nope.safetensors"), model),
                         doctest::Contains("checkpoint not found: "), IOError);
  }
  SUBCASE("garbage bytes") {
    std::ofstream(dir.file("garbage.safetensors"), std::ios::binary)
        << "this is not a checkpoint at all \x01\x02";
    CHECK_THROWS_WITH_AS(load_checkpoint(dir.file("garbage.safetensors"), model),
                         doctest::Contains("not a valid mapping_networks checkpoint"), IOError);
  }
  SUBCASE("truncated file") {
    const std::string bytes = read_bytes(path);
    std::ofstream(dir.file("cut.safetensors"), std::ios::binary) << bytes.substr(0, bytes.size() - 7);
    CHECK_THROWS_WITH_AS(load_checkpoint(dir.file("cut.safetensors"), model),
                         doctest::Contains("not a valid mapping_networks checkpoint"), IOError);
  }
  SUBCASE("metadata that is not JSON") {
    rewrite_metadata(path, "spec", "[[\"weight\", [2, 3]]");
    CHECK_THROWS_WITH_AS(load_checkpoint(path, model),
                         doctest::Contains("not a valid mapping_networks checkpoint"), IOError);
  }
  SUBCASE("metadata of the wrong JSON type names its key and the file") {
    // Before, the JSON library's own message ("type must be number, but is string") named neither.
    for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{
             {"seed", "\"abc\""},
             {"strategy", "7"},
             {"parameter_scaling", "\"yes\""},
             {"spec", "[[\"weight\"]]"},
             {"spec", "[[\"weight\", [2e32, 3]]]"},  // found by fuzz_checkpoint: a float read as int64 was UB
             {"groups", "[[\"no_such_group\", []]]"},
             {"trainer_state", "{\"epoch\": \"one\"}"}}) {
      INFO("key " << key);
      save_checkpoint(path, model);
      rewrite_metadata(path, key, value);
      const std::string message = error_message([&] { load_checkpoint(path, model); });
      CHECK(contains(message, "malformed metadata '" + key + "'"));
      CHECK(contains(message, path));
    }
  }
  SUBCASE("a latent tensor missing") {
    safetensors::File file = safetensors::load(path);
    safetensors::NamedTensors tensors;
    for (const auto& e : file.tensors)
      if (e.name != "latent/<root>") tensors.emplace_back(e.name, e.tensor);
    safetensors::save(path, tensors, file.metadata);
    CHECK_THROWS_WITH_AS(load_checkpoint(path, model), doctest::Contains("latent/<root>"), IOError);
  }
  SUBCASE("a plain safetensors file of the target's weights is not a checkpoint") {
    export_generated_parameters(dir.file("weights.safetensors"), model);
    CHECK_THROWS_WITH_AS(load_checkpoint(dir.file("weights.safetensors"), model),
                         doctest::Contains("schema_version"), KeyError);
  }
}

TEST_CASE("checkpoint: metadata and config round trip; parent directories are created") {
  TempDir dir("mn_checkpoint_test");
  MappingModel model(std::make_shared<nn::Linear>(3, 2), options("slvt", 4));
  const std::string path = (dir.path() / "a" / "b" / "c" / "ckpt.safetensors").string();
  CheckpointExtras extras;
  extras.metadata = {{"run", "fashion-cnn2"}, {"note", "quotes \" and unicode \xc3\xbc"}};
  extras.config = R"({"target": "cnn2", "latent_dim": 4})";
  save_checkpoint(path, model, extras);
  CHECK(fs::exists(path));
  const CheckpointInfo info = read_checkpoint(path);
  CHECK(info.metadata == extras.metadata);
  CHECK(info.config == R"({"latent_dim":4,"target":"cnn2"})");
  CHECK(info.strategy == "slvt");
  CHECK(info.latent_dims == std::vector<std::pair<std::string, int64_t>>{{"all", 4}});

  save_checkpoint(path, model);
  const CheckpointInfo plain = read_checkpoint(path);
  CHECK(plain.metadata.empty());
  CHECK(plain.config.empty());
  CheckpointExtras bad_config;
  bad_config.config = "{not json";
  CHECK_THROWS_AS(save_checkpoint(path, model, bad_config), ValueError);
}

TEST_CASE("checkpoint: a failed save leaves the previous file intact and no temporary behind") {
  TempDir dir("mn_checkpoint_test");
  MappingModel model(mlp_target(16, 16, 4), options("layerwise", 16));
  const std::string path = dir.file("ckpt.safetensors");
  save_checkpoint(path, model);
  const std::string before = read_bytes(path);
  REQUIRE(before.size() > 256);

  SUBCASE("the write fails part-way (file size limit)") {
    // Changed latents would change the file; the failed save must not leave them (or half a file) there.
    {
      autograd::NoGradGuard no_grad;
      Tensor z = model.named_latents()[0].second;
      z.fill_(0.5);
    }
    struct rlimit old_limit;
    REQUIRE(getrlimit(RLIMIT_FSIZE, &old_limit) == 0);
    auto old_handler = signal(SIGXFSZ, SIG_IGN);  // EFBIG instead of being killed
    struct rlimit small = old_limit;
    small.rlim_cur = before.size() / 2;
    REQUIRE(setrlimit(RLIMIT_FSIZE, &small) == 0);
    bool threw_io_error = false;
    try {
      save_checkpoint(path, model);
    } catch (const IOError&) {
      threw_io_error = true;
    }
    setrlimit(RLIMIT_FSIZE, &old_limit);
    signal(SIGXFSZ, old_handler);
    CHECK(threw_io_error);
  }
  SUBCASE("the arguments are rejected") {
    CheckpointExtras extras;
    extras.metadata = {{"bad", std::string("\xff\xfe not utf-8")}};
    CHECK_THROWS_AS(save_checkpoint(path, model, extras), ValueError);
  }
  CHECK(read_bytes(path) == before);
  size_t entries = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    INFO("left in the directory: " << e.path());
    ++entries;
  }
  CHECK(entries == 1);
}

TEST_CASE("checkpoint: export_generated_parameters writes the target's state dict by its own names") {
  TempDir dir("mn_checkpoint_test");
  manual_seed(5);
  MappingModel model(small_cnn(), options("layerwise", 6));
  train_a_little(model, randn({2, 1, 8, 8}), randn({2, 3}));
  const std::string path = dir.file("generated.safetensors");
  export_generated_parameters(path, model);
  const safetensors::File file = safetensors::load(path);
  std::vector<std::string> names;
  for (const auto& e : file.tensors) names.push_back(e.name);
  std::vector<std::string> expected = model.parameter_spec().names();
  std::sort(names.begin(), names.end());
  std::sort(expected.begin(), expected.end());
  CHECK(names == expected);
  autograd::NoGradGuard no_grad;
  const ParameterTree tree = model.generate_parameters();
  for (const auto& [name, t] : tree.items()) {
    INFO(name);
    CHECK(file.entry(name).dtype == "F32");
    CHECK(bitwise_equal(file.at(name), t));
  }
  // The weights load into the plain target and reproduce the mapped model's predictions.
  auto plain = small_cnn();
  nn::StateDict state;
  for (const auto& e : file.tensors) state[e.name] = e.tensor;
  plain->load_state_dict(state);
  Tensor x = randn({3, 1, 8, 8});
  CHECK(max_abs_diff(plain->forward(x), model.run(x).predictions) <= 1e-6);
}

TEST_CASE("checkpoint: model buffers (BatchNorm running statistics) are saved and restored") {
  TempDir dir("mn_checkpoint_test");
  auto build = [] {
    auto target = std::make_shared<nn::Sequential>(
        std::vector<nn::ModulePtr>{std::make_shared<nn::Linear>(4, 6), std::make_shared<nn::BatchNorm1d>(6),
                                   std::make_shared<nn::Linear>(6, 2)});
    MappingOptions o = options("layerwise", 5);
    o.write_back_buffers = true;
    return MappingModel(target, o);
  };
  manual_seed(2);
  MappingModel model = build();
  Tensor x = randn({8, 4}), y = randn({8, 2});
  train_a_little(model, x, y, 3);  // train mode: the running statistics move
  model.eval();
  save_checkpoint(dir.file("bn.safetensors"), model);
  CHECK(safetensors::load(dir.file("bn.safetensors")).contains("buffer/1.running_mean"));
  MappingModel fresh = build();
  fresh.eval();
  load_checkpoint(dir.file("bn.safetensors"), fresh);
  for (const auto& [name, t] : model.buffers()) {
    INFO(name);
    CHECK(t.sizes() == fresh.buffers().at(name).sizes());
    CHECK(t.to(DType::f32).to_vector<float>() == fresh.buffers().at(name).to(DType::f32).to_vector<float>());
  }
  CHECK(max_abs_diff(predict(fresh, x), predict(model, x)) <= 1e-6);
}

TEST_CASE("checkpoint: trainer state resumes a fit bit for bit") {
  TempDir dir("mn_checkpoint_test");
  const std::string path = dir.file("trainer.safetensors");
  Generator data_gen(11);
  Tensor inputs = normal({32, 4}, 0.0, 1.0, {}, &data_gen);
  Tensor targets = normal({32, 2}, 0.0, 1.0, {}, &data_gen);
  auto make = [&]() {
    manual_seed(0);
    return std::make_unique<MappingModel>(mlp_target(4, 6, 2), options("layerwise", 6));
  };
  TrainerConfig config;
  config.max_epochs = 3;
  config.learning_rate = 0.01;
  config.seed = 21;
  // Without a scheduler the lr comes back from the checkpoint itself (exactly, not via the optimizer's
  // f32 state tensor); with one it is recomputed from the restored scheduler epoch.
  SUBCASE("constant lr") { config.scheduler = ""; }
  SUBCASE("cosine schedule") { config.scheduler = "cosine"; }
  SUBCASE("plateau schedule") {
    // No epoch counts as an improvement after the first (relative threshold 10), no patience: the lr
    // halves at every step after the first, the step of epoch 2 pending when the checkpoint is written.
    config.scheduler = "plateau";
    config.scheduler_options.plateau.patience = 0;
    config.scheduler_options.plateau.factor = 0.5;
    config.scheduler_options.plateau.threshold = 10.0;
  }
  auto loss = [] { return std::make_shared<MappingLoss>(std::make_shared<RegressionLoss>()); };
  // Never improves after epoch 1 either (min_delta 1e9): wait 1 after epoch 2, so the stop is raised at
  // the end of epoch 3 only when its state survives the checkpoint.
  auto stopper = [] { return std::make_shared<EarlyStopping>(history_keys::kTrainTotalLoss, 2, 1e9); };

  // Straight: 3 epochs.
  auto straight = make();
  data::DataLoader straight_loader(inputs, targets, {.batch_size = 8, .shuffle = true, .seed = 3});
  MappingTrainer straight_trainer(*straight, straight_loader, nullptr, loss(), config, {stopper()});
  straight_trainer.fit();
  REQUIRE(straight_trainer.should_stop());

  // Killed after epoch 2: like mn-train, the checkpoint is written from on_epoch_end, then the run
  // stops; a new process (fresh model and trainer) loads it and runs epoch 3.
  // Registered before the EarlyStopping, it still runs after it (saves_checkpoints).
  struct SaveThenStop : Callback {
    std::string path;
    explicit SaveThenStop(std::string p) : path(std::move(p)) {}
    bool saves_checkpoints() const override { return true; }
    void on_epoch_end(train::Trainer& trainer, int64_t epoch, const Metrics&) override {
      trainer.save_checkpoint(path, {.metadata = {{"stage", "2 of 3"}}});
      if (epoch == 1) throw TrainingInterrupted("killed");
    }
  };
  {
    auto first = make();
    data::DataLoader loader(inputs, targets, {.batch_size = 8, .shuffle = true, .seed = 3});
    MappingTrainer trainer(*first, loader, nullptr, loss(), config,
                           {std::make_shared<SaveThenStop>(path), stopper()});
    trainer.fit();
    REQUIRE(trainer.epoch() == 2);
  }
  auto resumed = make();
  data::DataLoader loader(inputs, targets, {.batch_size = 8, .shuffle = true, .seed = 3});
  MappingTrainer trainer(*resumed, loader, nullptr, loss(), config, {stopper()});
  const CheckpointInfo info = load_checkpoint(path, *resumed, &trainer);
  REQUIRE(info.trainer_state.has_value());
  CHECK(info.trainer_state->epoch == 2);
  CHECK_FALSE(info.trainer_state_json.empty());
  CHECK(info.metadata.at("stage") == "2 of 3");
  CHECK(trainer.epoch() == 2);
  CHECK(trainer.history().epochs() == 2);
  CHECK(trainer.optimizer().step_count() == straight_trainer.optimizer().step_count() * 2 / 3);
  const auto& early = info.trainer_state->callback_states;
  REQUIRE(early.count("EarlyStopping") == 1);
  CHECK(early.at("EarlyStopping").at("wait") == 1.0);
  CHECK(info.trainer_state->scheduler_step_metric.has_value() == !config.scheduler.empty());
  const History history = trainer.fit();
  CHECK(history.epochs() == 3);
  check_same_latents(*straight, *resumed);
  CHECK(history == straight_trainer.history());
  CHECK(trainer.should_stop());
  CHECK(trainer.learning_rate() == straight_trainer.learning_rate());
  if (config.scheduler == "plateau") CHECK(trainer.learning_rate() == doctest::Approx(0.01 * 0.25));

  // Without a trainer the state is still returned.
  auto bare = make();
  const CheckpointInfo bare_info = load_checkpoint(path, *bare);
  REQUIRE(bare_info.trainer_state.has_value());
  CHECK(bare_info.trainer_state->optimizer.count("state.0.exp_avg") == 1);
}

TEST_CASE("checkpoint: optimizer state that does not fit the trainer's parameters is refused, naming file and key") {
  // A 0-d exp_avg used to pass (dim() == 0 was allowed for the scalar step) and Adam then wrote
  // numel(parameter) floats into 4 bytes.
  TempDir dir("mn_checkpoint_test");
  const std::string path = dir.file("trainer.safetensors");
  Generator data_gen(5);
  Tensor inputs = normal({16, 4}, 0.0, 1.0, {}, &data_gen);
  Tensor targets = normal({16, 2}, 0.0, 1.0, {}, &data_gen);
  TrainerConfig config;
  config.max_epochs = 1;
  config.learning_rate = 0.01;
  auto loss = std::make_shared<MappingLoss>(std::make_shared<RegressionLoss>());
  MappingModel model(mlp_target(4, 6, 2), options("layerwise", 6));
  data::DataLoader loader(inputs, targets, {.batch_size = 8, .shuffle = true, .seed = 3});
  MappingTrainer trainer(model, loader, nullptr, loss, config);
  trainer.fit();
  save_checkpoint(path, model, checkpoint_extras(trainer));
  const Tensor latent_before = model.named_latents()[0].second.clone();
  const std::string shape = str(model.named_latents()[0].second.sizes());

  // The checkpoint rewritten with these optimizer tensors replaced or added (an undefined one removed).
  auto rewrite = [&](const std::map<std::string, Tensor>& changes) {
    safetensors::File file = safetensors::load(path);
    safetensors::NamedTensors tensors;
    for (const auto& e : file.tensors)
      if (e.name.rfind("optimizer/", 0) != 0 || !changes.count(e.name.substr(std::string("optimizer/").size())))
        tensors.emplace_back(e.name, e.tensor);
    for (const auto& [key, value] : changes)
      if (value.defined()) tensors.emplace_back("optimizer/" + key, value);
    const std::string bad = dir.file("bad.safetensors");
    safetensors::save(bad, tensors, file.metadata);
    return bad;
  };
  auto refused = [&](const std::string& bad, const std::vector<std::string>& fragments) {
    std::string message;
    try {
      load_checkpoint(bad, model, &trainer);
    } catch (const Error& e) {
      message = e.what();
    }
    INFO(message);
    CHECK(mn::testing::contains(message, bad));
    for (const std::string& f : fragments) CHECK(mn::testing::contains(message, f));
    CHECK(bitwise_equal(model.named_latents()[0].second, latent_before));
  };
  const Tensor moment = safetensors::load(path).at("optimizer/state.0.exp_avg");
  SUBCASE("a 0-d exp_avg") {
    refused(rewrite({{"state.0.exp_avg", scalar_tensor(1.0)}}), {"'state.0.exp_avg'", "[]", shape});
  }
  SUBCASE("an i64 exp_avg_sq of the right shape") {
    refused(rewrite({{"state.0.exp_avg_sq", zeros(moment.sizes(), DType::i64)}}),
            {"'state.0.exp_avg_sq'", "i64", "f32"});
  }
  SUBCASE("a key whose parameter index is not a number") {
    refused(rewrite({{"state.x.exp_avg", moment}}), {"'state.x.exp_avg'"});
  }
  SUBCASE("a renamed moment: it would be ignored and restart from zero") {
    refused(rewrite({{"state.0.exp_avg", Tensor()}, {"state.0.exp_avgX", moment}}), {"'state.0.exp_avgX'"});
    refused(rewrite({{"state.0.exp_avg", Tensor()}}), {"'state.0.exp_avg'"});
  }
  SUBCASE("the intact file loads") { CHECK_NOTHROW(load_checkpoint(path, model, &trainer)); }
}
