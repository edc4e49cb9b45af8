// TrainerConfig::amp (issue 23): forward and loss run under autocast (bf16/f16 predictions from a
// Linear, f32 gradients); "f16" trains through a GradScaler. The scaler's tests use elementwise models
// (no op on autocast's lists, so autocast leaves them in f32) to compare it with f32 alone: without
// overflow bit for bit as f32 (clipping and accumulation included: the scale is a power of two,
// unscaled before clipping and once per window), overflowing steps skipped and counted rather than reported, a non-finite loss still
// an error, the scaler's state in checkpoints (absent: defaults) and trainer state, restored by lr_find,
// and the same with compiled steps. "bf16" has no scaler; other values are refused.
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "mapping/mapping_networks.h"
#include "tests/temp_dir.h"
#include "tests/test_support.h"

using namespace mn;
using mn::testing::contains;
using mn::testing::error_message;
namespace keys = mn::train::history_keys;

namespace {

// y = x * weight + bias elementwise over the features, then summed (outputs 0) or its first `outputs`
// features kept: nothing autocast recasts.
class Elementwise : public nn::Module {
 public:
  Elementwise(int64_t features, int64_t outputs) : nn::Module("Elementwise"), outputs_(outputs) {
    register_parameter("weight", randn({features}));
    register_parameter("bias", zeros({outputs == 0 ? int64_t{1} : outputs}));
  }
  Tensor forward(const Tensor& x) override {
    Tensor y = mul(x, param("weight"));
    return add(outputs_ == 0 ? sum(y, {1}, true) : y.narrow(1, 0, outputs_), param("bias"));
  }

 private:
  int64_t outputs_;
};

std::shared_ptr<nn::Sequential> small_classifier(uint64_t seed = 21) {
  manual_seed(seed);
  return std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
      std::make_shared<Elementwise>(4, 4), std::make_shared<nn::Tanh>(), std::make_shared<Elementwise>(4, 3)});
}

data::DataLoader classification_loader() {
  Generator gen(4);
  const Tensor x = randn({20, 4}, {}, &gen);
  std::vector<int64_t> labels(20);
  for (int64_t i = 0; i < 20; ++i) labels[static_cast<size_t>(i)] = (i * 7) % 3;
  return data::DataLoader(x, from_vector(labels, {20}), {.batch_size = 4, .shuffle = true, .seed = 2});
}

std::vector<std::vector<float>> values(const nn::Module& net) {
  std::vector<std::vector<float>> out;
  for (const auto& [name, t] : net.named_parameters()) out.push_back(t.to_vector<float>());
  return out;
}

bool same_bits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0)
      return false;
  return true;
}

// An elementwise Linear(2, 1) (summed x * w + b) on inputs of ones, loss = sum(predictions) * 2^112 over batches of 4: every gradient is
// scale * 2^114, which overflows f32 exactly while the scale is at least 2^14. From 65536 the scaler
// therefore skips three steps (at 2^16, 2^15, 2^14) and then trains at 2^13; the loss itself (~2^113)
// stays finite.
struct Overflowing {
  std::shared_ptr<Elementwise> net;
  data::DataLoader loader;
  Overflowing() : net((manual_seed(5), std::make_shared<Elementwise>(2, 0))), loader(ones({8, 2}), zeros({8, 1}), {.batch_size = 4}) {}
  static train::Objective objective() {
    return train::task_loss([](const Tensor& pred, const Tensor&) { return mul(sum(pred), std::ldexp(1.0, 112)); },
                            "scaled_sum");
  }
};

}  // namespace

TEST_CASE("amp: check_config takes \"\", bf16 and f16 only") {
  train::TrainerConfig c;
  for (const char* ok : {"", "bf16", "f16"}) {
    c.amp = ok;
    CHECK_NOTHROW(train::check_config(c, "TrainerConfig"));
  }
  c.amp = "fp16";
  CHECK_THROWS_AS(train::check_config(c, "TrainerConfig"), ValueError);
  CHECK(contains(error_message([&] { train::check_config(c, "TrainerConfig"); }),
                 "amp must be \"\" (f32), \"bf16\" or \"f16\", got \"fp16\""));
  auto net = small_classifier();
  data::DataLoader loader = classification_loader();
  train::Trainer bf16(*net, loader, nullptr, train::classification(), {.max_epochs = 1, .amp = "bf16"});
  CHECK(bf16.grad_scaler() == nullptr);  // bf16 keeps f32's range: no scaler, as in PyTorch
  train::Trainer f16(*net, loader, nullptr, train::classification(), {.max_epochs = 1, .amp = "f16"});
  REQUIRE(f16.grad_scaler() != nullptr);
  CHECK(f16.grad_scaler()->get_scale() == 65536.0);
}

TEST_CASE("amp: the trainer runs forward and loss under autocast, backward and the optimizer in f32") {
  for (const char* amp : {"bf16", "f16"}) {
    CAPTURE(amp);
    manual_seed(3);
    auto net = std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
        std::make_shared<nn::Linear>(4, 8), std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(8, 3)});
    data::DataLoader loader = classification_loader(), val = classification_loader();
    std::vector<DType> seen;
    auto loss = train::task_loss(
        [&](const Tensor& pred, const Tensor& target) {
          seen.push_back(pred.dtype());
          return nn::functional::cross_entropy(pred, target);
        },
        "ce");
    train::Trainer trainer(*net, loader, &val, loss, {.max_epochs = 2, .learning_rate = 1e-2, .amp = amp});
    const train::History h = trainer.fit();
    const DType want = std::string(amp) == "f16" ? DType::f16 : DType::bf16;
    REQUIRE(!seen.empty());
    for (DType t : seen) CHECK(t == want);  // training and validation batches alike
    for (const Tensor& p : net->parameters()) CHECK(p.dtype() == DType::f32);
    CHECK_FALSE(is_autocast_enabled(DeviceType::CPU));  // the scope ends with each batch's loss
    const auto& losses = h.at(keys::kTrainTotalLoss);
    CHECK(losses.back() < losses.front());
  }
}

TEST_CASE("amp bf16: compiled training steps under autocast give the eager run's parameters bit for bit") {
  // The captured graph holds the casts and the widened kernels' copies as steps of their own.
  auto make = [] {
    manual_seed(7);
    return std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
        std::make_shared<nn::Linear>(4, 8), std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(8, 3)});
  };
  auto eager_net = make(), compiled_net = make();
  data::DataLoader a = classification_loader(), b = classification_loader();
  train::TrainerConfig config{.max_epochs = 2, .learning_rate = 1e-2, .amp = "bf16"};
  train::Trainer eager(*eager_net, a, nullptr, train::classification(), config);
  config.compile = true;
  config.compile_fullgraph = true;
  train::Trainer compiled(*compiled_net, b, nullptr, train::classification(), config);
  const train::History he = eager.fit(), hc = compiled.fit();
  CHECK(same_bits(values(*compiled_net), values(*eager_net)));
  CHECK(hc.at(keys::kTrainTotalLoss) == he.at(keys::kTrainTotalLoss));
  CHECK(contains(compiled.compile_report(), "0 eager"));
}

TEST_CASE("amp f16: without overflow the trainer's run is f32's bit for bit (clipping, accumulation)") {
  for (int64_t k : {int64_t{1}, int64_t{3}}) {
    CAPTURE(k);
    train::TrainerConfig config{.max_epochs = 2, .learning_rate = 1e-2, .gradient_clip_norm = 0.05,
                                .accumulation_steps = k};
    auto f32_net = small_classifier(), f16_net = small_classifier();
    data::DataLoader a = classification_loader(), b = classification_loader();
    train::Trainer f32(*f32_net, a, nullptr, train::classification(), config);
    config.amp = "f16";
    train::Trainer f16(*f16_net, b, nullptr, train::classification(), config);
    const train::History ha = f32.fit(), hb = f16.fit();
    CHECK(same_bits(values(*f32_net), values(*f16_net)));
    CHECK(ha.at(keys::kTrainTotalLoss) == hb.at(keys::kTrainTotalLoss));
    CHECK(hb.at(keys::kTrainSkippedSteps) == std::vector<double>{0, 0});
    CHECK(!ha.contains(keys::kTrainSkippedSteps));
    CHECK(f16.optimizer().step_count() == f32.optimizer().step_count());
    // Clean steps only: the growth count is the number of optimizer steps.
    CHECK(f16.grad_scaler()->growth_tracker() == f16.global_step());
  }
}

TEST_CASE("amp f16: overflowing steps are skipped and counted, not reported; a non-finite loss still is") {
  Overflowing o;
  std::ostringstream log;
  train::Trainer trainer(*o.net, o.loader, nullptr, Overflowing::objective(),
                         {.max_epochs = 3, .learning_rate = 1e-3, .log = &log, .amp = "f16"});
  const train::History h = trainer.fit();  // on_nonfinite "error": a reported step would throw
  CHECK(h.at(keys::kTrainSkippedSteps) == std::vector<double>{2, 1, 0});
  CHECK(trainer.grad_scaler()->get_scale() == 8192.0);
  CHECK(trainer.grad_scaler()->growth_tracker() == 3);
  CHECK(trainer.optimizer().step_count() == 3);
  CHECK(trainer.global_step() == 6);
  CHECK(contains(log.str(), "the gradient scaler skipped 2 optimizer steps of epoch 1 (gradients not finite); "
                            "loss scale now 16384"));
  // Without the scaler the same gradients are finite (2^114): six steps, no skip.
  Overflowing plain;
  train::Trainer f32(*plain.net, plain.loader, nullptr, Overflowing::objective(), {.max_epochs = 3});
  f32.fit();
  CHECK(f32.optimizer().step_count() == 6);

  Overflowing bad;
  train::Trainer nan_loss(*bad.net, bad.loader, nullptr,
                          train::task_loss([](const Tensor& pred, const Tensor&) {
                            return mul(sum(pred), std::numeric_limits<double>::quiet_NaN());
                          }, "nan"),
                          {.max_epochs = 1, .amp = "f16"});
  const std::string message = error_message([&] { nan_loss.fit(); });
  CHECK(contains(message, "non-finite values at epoch 1/1, batch 1"));
  INFO(message);
  CHECK(contains(message, "total = nan"));
}

TEST_CASE("amp f16: the scaler's state goes through checkpoints, trainer state and lr_find") {
  mn::testing::TempDir dir("amp_trainer");
  const std::string path = (dir.path() / "checkpoint.safetensors").string();
  train::TrainerConfig config{.max_epochs = 3, .learning_rate = 1e-3, .amp = "f16"};
  Overflowing whole;
  train::Trainer uninterrupted(*whole.net, whole.loader, nullptr, Overflowing::objective(), config);
  uninterrupted.fit();

  Overflowing first;
  config.max_epochs = 1;
  train::Trainer part(*first.net, first.loader, nullptr, Overflowing::objective(), config);
  part.fit();
  CHECK(part.grad_scaler()->get_scale() == 16384.0);
  part.save_checkpoint(path);
  CHECK(part.state().grad_scaler.at("scale") == 16384.0);

  Overflowing second;
  config.max_epochs = 3;
  train::Trainer resumed(*second.net, second.loader, nullptr, Overflowing::objective(), config);
  resumed.load_checkpoint(path);
  CHECK(resumed.grad_scaler()->state_dict() == part.grad_scaler()->state_dict());
  const train::History h = resumed.fit();
  CHECK(same_bits(values(*second.net), values(*whole.net)));
  CHECK(h.at(keys::kTrainSkippedSteps) == uninterrupted.history().at(keys::kTrainSkippedSteps));
  CHECK(resumed.grad_scaler()->state_dict() == uninterrupted.grad_scaler()->state_dict());

  // A checkpoint without scaler state (an f32 run's, or older files): the scaler starts from its defaults.
  Overflowing f32_run;
  train::Trainer f32(*f32_run.net, f32_run.loader, nullptr, Overflowing::objective(), {.max_epochs = 1});
  f32.fit();
  f32.save_checkpoint(path);
  resumed.load_checkpoint(path);
  CHECK(resumed.grad_scaler()->get_scale() == 65536.0);
  CHECK(resumed.grad_scaler()->growth_tracker() == 0);

  // A bad scaler state is refused before anything changes.
  train::TrainerState state = uninterrupted.state();
  state.grad_scaler["_growth_tracker"] = 5000;
  CHECK(contains(error_message([&] { resumed.load_state(state); }),
                 "TrainerState: grad_scaler: '_growth_tracker' must be a whole number in [0, growth_interval = 2000)"));
  CHECK(resumed.epoch() == 1);

  // JSON: the scaler state and a mid-epoch position's skipped steps round-trip; bad values are refused.
  state = uninterrupted.state();
  state.progress = train::EpochProgress{.batches = 1, .nonfinite_steps = 0, .sums = {{}}, .skipped_steps = 2};
  const train::TrainerState back = train::trainer_state_from_json(train::trainer_state_to_json(state));
  CHECK(back.grad_scaler == state.grad_scaler);
  CHECK(back.progress == state.progress);
  std::string text = train::trainer_state_to_json(state);
  const std::string key = "\"scale\":8192.0";
  REQUIRE(contains(text, key));
  text.replace(text.find(key), key.size(), "\"scale\":-1.0");
  CHECK(contains(error_message([&] { train::trainer_state_from_json(text); }),
                 "grad_scaler: 'scale' must be a finite positive number, got -1"));

  // lr_find sweeps with the scaler and puts its state back.
  Overflowing sweep;
  train::Trainer finder(*sweep.net, sweep.loader, nullptr, Overflowing::objective(), config);
  finder.lr_find(1e-4, 1e-2, 4);
  CHECK(finder.grad_scaler()->get_scale() == 65536.0);
  CHECK(finder.grad_scaler()->growth_tracker() == 0);
}

TEST_CASE("amp f16: compiled steps read the scale update() rewrites, as the eager steps do") {
  train::TrainerConfig config{.max_epochs = 3, .learning_rate = 1e-3, .amp = "f16"};
  Overflowing eager_run, compiled_run;
  train::Trainer eager(*eager_run.net, eager_run.loader, nullptr, Overflowing::objective(), config);
  config.compile = true;
  config.compile_fullgraph = true;
  train::Trainer compiled(*compiled_run.net, compiled_run.loader, nullptr, Overflowing::objective(), config);
  const train::History he = eager.fit(), hc = compiled.fit();
  CHECK(hc.at(keys::kTrainSkippedSteps) == he.at(keys::kTrainSkippedSteps));
  CHECK(same_bits(values(*compiled_run.net), values(*eager_run.net)));
  CHECK(compiled.grad_scaler()->state_dict() == eager.grad_scaler()->state_dict());
  CHECK(contains(compiled.compile_report(), "6 calls, 1 captures, 5 replays, 0 eager"));
}
