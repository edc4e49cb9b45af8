// Adam/AdamW with amsgrad and RMSprop (issue 18): PyTorch 1.13 trajectories over 10 steps
// (tests/data/parity_losses_ext.safetensors), state saved to a safetensors file and restored midway
// continuing bit for bit, the state an older Adam wrote still loading, make_optimizer's names and
// the kernels' operand checks.
#include <cmath>
#include <functional>
#include <memory>

#include "kernels/kernels.h"
#include "nn/optim.h"
#include "nn/safetensors.h"
#include "nn/train/config.h"
#include "tests/temp_dir.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::nn::optim;
using mn::testing::contains;
using mn::testing::error_message;

namespace {

safetensors::File golden() {
  return safetensors::load(std::string(MN_TEST_DATA_DIR) + "/parity_losses_ext.safetensors");
}

using Make = std::function<std::unique_ptr<Optimizer>(const Tensor&)>;

const std::vector<std::pair<std::string, Make>>& cases() {
  static const std::vector<std::pair<std::string, Make>> all = {
      {"adam_ams",
       [](const Tensor& p) {
         return std::make_unique<Adam>(std::vector<Tensor>{p}, AdamOptions{.lr = 0.05, .beta1 = 0.8, .beta2 = 0.95,
                                                                           .eps = 1e-6, .weight_decay = 0.1,
                                                                           .amsgrad = true});
       }},
      {"adamw_ams",
       [](const Tensor& p) {
         return std::make_unique<AdamW>(std::vector<Tensor>{p}, AdamOptions{.lr = 0.05, .beta1 = 0.9, .beta2 = 0.99,
                                                                            .eps = 1e-8, .weight_decay = 0.1,
                                                                            .amsgrad = true});
       }},
      {"rms", [](const Tensor& p) { return std::make_unique<RMSprop>(std::vector<Tensor>{p}); }},
      {"rms_mom",
       [](const Tensor& p) {
         return std::make_unique<RMSprop>(std::vector<Tensor>{p},
                                          RMSpropOptions{.lr = 0.01, .alpha = 0.9, .momentum = 0.9});
       }},
      {"rms_centered",
       [](const Tensor& p) {
         return std::make_unique<RMSprop>(std::vector<Tensor>{p},
                                          RMSpropOptions{.lr = 0.01, .eps = 1e-6, .centered = true});
       }},
      {"rms_all",
       [](const Tensor& p) {
         return std::make_unique<RMSprop>(std::vector<Tensor>{p},
                                          RMSpropOptions{.lr = 0.02, .alpha = 0.95, .weight_decay = 0.05,
                                                         .momentum = 0.5, .centered = true});
       }},
  };
  return all;
}

Tensor grad_at(const safetensors::File& f, int i) { return f.at("opt_grad_" + std::to_string(i)).clone(); }

}  // namespace

TEST_CASE("optim ext: Adam/AdamW amsgrad and RMSprop follow PyTorch's trajectories") {
  const auto f = golden();
  for (const auto& [name, make] : cases()) {
    CAPTURE(name);
    Tensor p = f.at("opt_init").clone().requires_grad_(true);
    auto opt = make(p);
    for (int i = 0; i < 10; ++i) {
      p.set_grad(grad_at(f, i));
      opt->step();
      CAPTURE(i);
      mn::testing::check_close(p.detach(), f.at(name + "_step" + std::to_string(i)).to_vector<float>(), 2e-6);
    }
  }
}

TEST_CASE("optim ext: state saved to a file midway and restored continues bit for bit") {
  const auto f = golden();
  mn::testing::TempDir dir("optim_ext");
  for (const auto& [name, make] : cases()) {
    CAPTURE(name);
    Tensor straight = f.at("opt_init").clone().requires_grad_(true);
    auto a = make(straight);
    for (int i = 0; i < 10; ++i) {
      straight.set_grad(grad_at(f, i));
      a->step();
    }
    Tensor first = f.at("opt_init").clone().requires_grad_(true);
    auto b = make(first);
    for (int i = 0; i < 4; ++i) {
      first.set_grad(grad_at(f, i));
      b->step();
    }
    const OptimizerState saved = b->state_dict();
    if (name.rfind("adam", 0) == 0) CHECK(saved.count("state.0.max_exp_avg_sq") == 1);
    if (name == "rms_all") CHECK((saved.count("state.0.grad_avg") == 1 && saved.count("state.0.momentum_buffer") == 1));
    safetensors::save(dir / "opt.safetensors", safetensors::NamedTensors(saved.begin(), saved.end()));
    const safetensors::File file = safetensors::load(dir / "opt.safetensors");
    OptimizerState loaded;
    for (const auto& [key, t] : saved) loaded[key] = file.at(key);
    Tensor resumed = first.detach().clone().requires_grad_(true);
    auto c = make(resumed);
    c->load_state_dict(loaded);
    for (int i = 4; i < 10; ++i) {
      resumed.set_grad(grad_at(f, i));
      c->step();
    }
    CHECK(resumed.detach().to_vector<float>() == straight.detach().to_vector<float>());
    const OptimizerState end_a = a->state_dict(), end_c = c->state_dict();
    for (const auto& [key, t] : end_a) {
      CAPTURE(key);
      REQUIRE(end_c.count(key) == 1);
      if (t.dtype() == DType::f32) CHECK(end_c.at(key).to_vector<float>() == t.to_vector<float>());
    }
  }
}

TEST_CASE("optim ext: an Adam state without amsgrad's maximum loads; wrong state is refused by name") {
  // An Adam run without amsgrad, saved after 3 steps (what a checkpoint from before amsgrad holds).
  Tensor p = from_vector(std::vector<float>{0.5f, -1.0f, 2.0f}).requires_grad_(true);
  Adam plain({p}, AdamOptions{.lr = 0.1});
  for (int i = 0; i < 3; ++i) {
    p.set_grad(from_vector(std::vector<float>{1.0f, -2.0f, 0.5f * static_cast<float>(i)}));
    plain.step();
  }
  const OptimizerState old_state = plain.state_dict();
  CHECK(old_state.count("state.0.max_exp_avg_sq") == 0);
  // Into a plain Adam as before, and into an amsgrad one: its maximum restarts at the next step's
  // second moment, so that step equals the plain Adam's.
  Tensor q = p.detach().clone().requires_grad_(true), r = p.detach().clone().requires_grad_(true);
  Adam same({q}, AdamOptions{.lr = 0.1});
  same.load_state_dict(old_state);
  Adam ams({r}, AdamOptions{.lr = 0.1, .amsgrad = true});
  ams.load_state_dict(old_state);
  const Tensor g = from_vector(std::vector<float>{0.1f, 0.2f, -0.3f});
  q.set_grad(g.clone());
  r.set_grad(g.clone());
  same.step();
  ams.step();
  CHECK(q.detach().to_vector<float>() == r.detach().to_vector<float>());
  CHECK(ams.state_dict().at("state.0.max_exp_avg_sq").to_vector<float>() ==
        same.state_dict().at("state.0.exp_avg_sq").to_vector<float>());
  // An amsgrad state does not fit a plain Adam; a wrong-shaped maximum is refused naming the key.
  CHECK(contains(error_message([&] { same.load_state_dict(ams.state_dict()); }), "'state.0.max_exp_avg_sq'"));
  OptimizerState bad = ams.state_dict();
  bad["state.0.max_exp_avg_sq"] = zeros({4});
  CHECK(contains(error_message([&] { ams.load_state_dict(bad); }), "'state.0.max_exp_avg_sq' has shape [4]"));
  // RMSprop: centered state needs grad_avg; an uncentered one refuses it.
  Tensor w = zeros({3}).requires_grad_(true);
  RMSprop centered({w}, RMSpropOptions{.momentum = 0.5, .centered = true});
  w.set_grad(ones({3}));
  centered.step();
  OptimizerState rms = centered.state_dict();
  RMSprop plain_rms({w}, RMSpropOptions{.momentum = 0.5});
  CHECK(contains(error_message([&] { plain_rms.load_state_dict(rms); }), "'state.0.grad_avg'"));
  rms.erase("state.0.grad_avg");
  CHECK(contains(error_message([&] { centered.load_state_dict(rms); }), "lacks 'state.0.grad_avg'"));
}

TEST_CASE("optim ext: make_optimizer builds rmsprop and amsgrad; options are checked") {
  Tensor p = zeros({2}).requires_grad_(true);
  train::TrainerConfig c;
  c.optimizer = "RMSprop";
  c.learning_rate = 0.02;
  c.momentum = 0.9;
  c.centered = true;
  auto rms = train::make_optimizer(c, {p});
  REQUIRE(rms->name() == "rmsprop");
  const auto& o = dynamic_cast<RMSprop&>(*rms).options;
  CHECK((o.lr == 0.02 && o.momentum == 0.9 && o.centered && o.alpha == 0.99 && o.eps == 1e-8));
  c = {};
  c.optimizer = "adamw";
  c.amsgrad = true;
  auto adamw = train::make_optimizer(c, {p});
  CHECK(adamw->name() == "adamw");
  CHECK(dynamic_cast<Adam&>(*adamw).options.amsgrad);
  c.optimizer = "sgd";
  CHECK(contains(error_message([&] { train::make_optimizer(c, {p}); }),
                 "amsgrad applies to the adam and adamw optimizers, not 'sgd'"));
  c = {};
  c.centered = true;
  CHECK(contains(error_message([&] { train::make_optimizer(c, {p}); }), "centered applies to the rmsprop optimizer"));
  CHECK(contains(error_message([&] { RMSprop({p}, RMSpropOptions{.alpha = -0.1}); }), "RMSprop: alpha must be >= 0"));
  CHECK(contains(error_message([&] { RMSprop({p}, RMSpropOptions{.lr = -1}); }), "learning rate must be non-negative"));
}

TEST_CASE("optim ext: the fused kernels check their operands before touching memory") {
  Tensor w = zeros({4}), g = zeros({4}), m = zeros({4}), v = zeros({4});
  Tensor small = zeros({3});
  const kernels::AdamParams adam{1e-2, 0.9, 0.999, 1e-8, 0.0, 1, false};
  CHECK_THROWS_WITH_AS(kernels::adam_amsgrad_step(kCPU, w, g, m, v, small, adam), doctest::Contains("'max_exp_avg_sq'"),
                       ValueError);
  const kernels::RmspropParams rms{1e-2, 0.99, 1e-8, 0.0, 0.9, true};
  Tensor none;
  CHECK_THROWS_WITH_AS(kernels::rmsprop_step(kCPU, w, g, m, none, v, rms), doctest::Contains("'momentum_buffer'"),
                       ValueError);
  CHECK_THROWS_WITH_AS(kernels::rmsprop_step(kCPU, w, g, m, v, none, rms), doctest::Contains("'grad_avg'"), ValueError);
  CHECK_THROWS_WITH_AS(kernels::rmsprop_step(kCPU, w, g, small, v, m, rms), doctest::Contains("'square_avg'"),
                       ValueError);
  // amsgrad's maximum keeps a NaN (torch.maximum propagates it)
  Tensor vmax = from_vector(std::vector<float>{NAN, 0, 0, 0});
  kernels::adam_amsgrad_step(kCPU, w, from_vector(std::vector<float>{1, 1, 1, 1}), m, v, vmax, adam);
  CHECK(std::isnan(vmax.to_vector<float>()[0]));
  CHECK(std::isnan(w.to_vector<float>()[0]));
  CHECK(std::isfinite(w.to_vector<float>()[1]));
}
