// Optimizers against hand-computed updates, schedulers' learning rates, clipping and optimizer
// state round trips. (PyTorch trajectories are compared in test_parity.)
#include "nn/optim.h"
#include "kernels/kernels.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::nn::optim;
using mn::testing::check_close;
using mn::testing::contains;
using mn::testing::error_message;
using mn::testing::param;
using mn::testing::tensor;

TEST_CASE("optim: SGD with momentum, dampening, nesterov and weight decay") {
  Tensor p = param({1.0f, -2.0f});
  SGD sgd({p}, SGDOptions{.lr = 0.1, .momentum = 0.9, .dampening = 0.0, .weight_decay = 0.0, .nesterov = false});
  p.set_grad(tensor({1, 1}));
  sgd.step();  // buf = g; p -= 0.1 * g
  check_close(p, {0.9f, -2.1f});
  p.set_grad(tensor({1, 1}));
  sgd.step();  // buf = 0.9 + 1 = 1.9
  check_close(p, {0.71f, -2.29f});

  Tensor q = param({1.0f});
  SGD nesterov({q}, SGDOptions{.lr = 0.1, .momentum = 0.5, .dampening = 0.0, .weight_decay = 0.1, .nesterov = true});
  q.set_grad(tensor({2}));
  nesterov.step();  // g = 2 + 0.1*1 = 2.1; buf = 2.1; g' = 2.1 + 0.5*2.1 = 3.15
  check_close(q, {1.0f - 0.315f});
  CHECK_THROWS_AS(SGD({param({1})}, SGDOptions{.lr = 0.1, .nesterov = true}), ValueError);
}

TEST_CASE("optim: Adam and AdamW first steps by hand") {
  Tensor p = param({1.0f});
  Adam adam({p}, AdamOptions{.lr = 0.1, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.0});
  p.set_grad(tensor({0.5f}));
  adam.step();  // m_hat = g, v_hat = g^2 -> step = lr * g/|g| = 0.1
  check_close(p, {0.9f}, 1e-6);
  p.set_grad(tensor({0.5f}));
  adam.step();
  check_close(p, {0.8f}, 1e-6);

  Tensor w = param({2.0f});
  AdamOptions o;
  o.lr = 0.1;
  o.weight_decay = 0.5;
  AdamW adamw({w}, o);
  w.set_grad(tensor({1.0f}));
  adamw.step();  // w *= 1 - 0.05 -> 1.9; then -0.1
  check_close(w, {1.8f}, 1e-6);

  Tensor a = param({2.0f});
  Adam adam_l2({a}, o);  // coupled: g = 1 + 0.5*2 = 2 -> still a unit step of 0.1
  a.set_grad(tensor({1.0f}));
  adam_l2.step();
  check_close(a, {1.9f}, 1e-6);
  CHECK_THROWS_AS(Adam({param({1})}, AdamOptions{.lr = 0.1, .beta1 = 1.5}), ValueError);
}

TEST_CASE("optim: parameters without gradients are skipped; state round trip resumes exactly") {
  Tensor a = param({1, 2}), b = param({3});
  Adam first({a, b}, AdamOptions{});
  a.set_grad(tensor({0.1f, -0.2f}));
  first.step();
  CHECK(b.to_vector<float>()[0] == 3.0f);
  OptimizerState saved = first.state_dict();
  Tensor a2 = param({0, 0});
  a2.detach().copy_(a.detach());
  Adam second({a2, param({3})}, AdamOptions{});
  second.load_state_dict(saved);
  a.set_grad(tensor({0.3f, 0.1f}));
  a2.set_grad(tensor({0.3f, 0.1f}));
  first.step();
  second.step();
  CHECK(a.to_vector<float>() == a2.to_vector<float>());
  OptimizerState wrong = saved;
  wrong["state.0.exp_avg"] = zeros({5});
  CHECK_THROWS_WITH_AS(second.load_state_dict(wrong), doctest::Contains("[5]"), ValueError);
}

TEST_CASE("optim: load_state_dict checks every state tensor against its parameter and names the key") {
  Tensor a = param({1, 2, 3}), b = param({4});
  Adam adam({a, b}, AdamOptions{});
  a.set_grad(tensor({0.1f, 0.2f, 0.3f}));
  b.set_grad(tensor({0.5f}));
  adam.step();
  const OptimizerState good = adam.state_dict();
  const std::vector<float> moment_before = good.at("state.0.exp_avg").to_vector<float>();
  // `good` with these entries replaced or added (an undefined tensor removes the key); the message of
  // the mn::Error loading it raises, "" when it loads.
  auto load = [&](const OptimizerState& changes) {
    OptimizerState state = good;
    for (const auto& [key, value] : changes)
      if (value.defined())
        state[key] = value;
      else
        state.erase(key);
    try {
      adam.load_state_dict(state);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  auto refused = [&](const OptimizerState& changes, const std::vector<std::string>& fragments) {
    const std::string message = load(changes);
    INFO(message);
    CHECK(!message.empty());
    for (const std::string& f : fragments) CHECK(contains(message, f));
    // Nothing was restored from the refused state.
    CHECK(adam.step_count() == 1);
    CHECK(adam.state_dict().at("state.0.exp_avg").to_vector<float>() == moment_before);
  };
  // A 0-d moment used to pass (dim() == 0 was allowed for the scalar step): a heap overflow in step().
  refused({{"state.0.exp_avg", scalar_tensor(1.0)}}, {"'state.0.exp_avg'", "[]", "[3]"});
  refused({{"state.0.exp_avg_sq", zeros({2})}}, {"'state.0.exp_avg_sq'", "[2]", "[3]"});
  // Right shape, wrong dtype: step() used to fail with "data<f32>() called on ... i64".
  refused({{"state.1.exp_avg", zeros({1}, DType::i64)}}, {"'state.1.exp_avg'", "i64", "f32"});
  // The step count is a non-negative whole 0-d number.
  refused({{"state.0.step", zeros({3}, DType::i64)}}, {"'state.0.step'", "[3]"});
  refused({{"state.0.step", scalar_tensor(-1.0)}}, {"'state.0.step'", "-1"});
  refused({{"state.0.step", scalar_tensor(1.5)}}, {"'state.0.step'", "1.5"});
  refused({{"step", scalar_tensor(-2.0, DType::i64)}}, {"'step'", "-2"});
  refused({{"lr", zeros({2})}}, {"'lr'"});
  refused({{"lr", scalar_tensor(-0.1)}}, {"'lr'"});
  // Malformed keys: std::stoul used to leak std::invalid_argument.
  refused({{"state.x.exp_avg", zeros({3})}}, {"'state.x.exp_avg'"});
  refused({{"state.", zeros({3})}}, {"'state.'"});
  refused({{"state.0", zeros({3})}}, {"'state.0'"});
  refused({{"state.-0.exp_avg", zeros({3})}}, {"'state.-0.exp_avg'"});
  refused({{"state.99999999999999999999999.exp_avg", zeros({3})}}, {"'state.99999999999999999999999.exp_avg'"});
  refused({{"state.2.exp_avg", zeros({3})}}, {"'state.2.exp_avg'", "2 parameters"});
  // A key that would be ignored: the moments would silently restart from zero.
  refused({{"state.0.exp_avgX", zeros({3})}}, {"'state.0.exp_avgX'", "exp_avg"});
  refused({{"state.0.exp_avg", Tensor()}}, {"'state.0.exp_avg'"});
  refused({{"momentum", scalar_tensor(0.9)}}, {"'momentum'"});
  // Another optimizer's state.
  Tensor c = param({1, 2, 3});
  SGD sgd({c}, SGDOptions{.lr = 0.1, .momentum = 0.9});
  c.set_grad(tensor({1, 1, 1}));
  sgd.step();
  const std::string message = error_message([&] { adam.load_state_dict(sgd.state_dict()); });
  CHECK(contains(message, "'state.0.momentum_buffer'"));
  CHECK(contains(error_message([&] { sgd.load_state_dict(good); }), "'state.0.exp_avg'"));

  CHECK(load({}).empty());
  // An untouched parameter has no state at all (it never had a gradient), as in PyTorch.
  CHECK(load({{"state.1.exp_avg", Tensor()}, {"state.1.exp_avg_sq", Tensor()}, {"state.1.step", Tensor()}}).empty());
}

TEST_CASE("optim: the kernels check their operands before touching memory") {
  Tensor w = zeros({4}), g = ones({4}), m = zeros({4}), v = zeros({4});
  const kernels::AdamParams adam{1e-2, 0.9, 0.999, 1e-8, 0.0, 1, false};
  // Wrong size (the 4 bytes a 0-d tensor owns), wrong dtype, right size but strided.
  Tensor small = scalar_tensor(0.0), wrong_type = zeros({4}, DType::i64), strided = zeros({4, 2}).select(1, 0);
  CHECK_THROWS_WITH_AS(kernels::adam_step(kCPU, w, g, small, v, adam), doctest::Contains("'exp_avg'"), ValueError);
  CHECK_THROWS_WITH_AS(kernels::adam_step(kCPU, w, g, m, small, adam), doctest::Contains("'exp_avg_sq'"), ValueError);
  CHECK_THROWS_WITH_AS(kernels::adam_step(kCPU, w, small, m, v, adam), doctest::Contains("'grad'"), ValueError);
  CHECK_THROWS_WITH_AS(kernels::adam_step(kCPU, w, g, m, wrong_type, adam), doctest::Contains("i64"), TypeError);
  CHECK_THROWS_WITH_AS(kernels::adam_step(kCPU, w, g, strided, v, adam), doctest::Contains("not contiguous"),
                       ValueError);
  const kernels::SgdParams sgd{0.1, 0.9, 0.0, 0.0, false, false};
  CHECK_THROWS_WITH_AS(kernels::sgd_step(kCPU, w, g, small, sgd), doctest::Contains("'momentum_buffer'"),
                       ValueError);
  CHECK_THROWS_WITH_AS(kernels::sgd_step(kCPU, w, wrong_type, m, sgd), doctest::Contains("'grad'"), TypeError);
  Tensor none;
  kernels::sgd_step(kCPU, w, g, none, sgd);  // no momentum buffer: fine
  check_close(w, {-0.1f, -0.1f, -0.1f, -0.1f});
}

TEST_CASE("optim: options.lr is the learning rate; set_lr, lr(), schedulers and state_dict share it") {
  Tensor p = param({1.0f});
  SGD sgd({p}, SGDOptions{.lr = 0.1});
  sgd.options.lr = 0.5;  // used to be ignored: step() read a private copy
  CHECK(sgd.lr() == 0.5);
  p.set_grad(tensor({1.0f}));
  sgd.step();
  check_close(p, {0.5f});
  sgd.set_lr(0.25);
  CHECK(sgd.options.lr == 0.25);
  CHECK(sgd.state_dict().at("lr").item() == 0.25);

  Tensor q = param({1.0f});
  Adam adam({q}, AdamOptions{.lr = 0.1});
  adam.options.lr = 0.2;
  q.set_grad(tensor({3.0f}));
  adam.step();  // the first Adam step moves by lr
  check_close(q, {0.8f}, 1e-6);
  StepLR schedule(adam, 1, 0.5);
  CHECK(schedule.base_lr() == 0.2);
  schedule.step();
  CHECK(adam.options.lr == doctest::Approx(0.1));
  OptimizerState state = adam.state_dict();
  state["lr"] = scalar_tensor(0.375);
  adam.load_state_dict(state);
  CHECK(adam.options.lr == 0.375);
  // A bad value set through the options is caught where it is used.
  adam.options.lr = -1.0;
  q.set_grad(tensor({3.0f}));
  CHECK_THROWS_WITH_AS(adam.step(), doctest::Contains("learning rate"), ValueError);
  adam.options.lr = 0.1;
  adam.options.beta2 = 1.0;
  CHECK_THROWS_WITH_AS(adam.step(), doctest::Contains("betas"), ValueError);
}

TEST_CASE("optim: schedulers") {
  Tensor p = param({1});
  SGD sgd({p}, SGDOptions{.lr = 1.0});
  StepLR step(sgd, 2, 0.5);
  std::vector<double> lrs;
  for (int i = 0; i < 5; ++i) {
    step.step();
    lrs.push_back(sgd.lr());
  }
  CHECK(lrs == std::vector<double>{1.0, 0.5, 0.5, 0.25, 0.25});

  SGD sgd2({p}, SGDOptions{.lr = 1.0});
  CosineAnnealingLR cosine(sgd2, 4, 0.0);
  cosine.step();
  CHECK(sgd2.lr() == doctest::Approx(0.5 * (1 + std::cos(M_PI / 4))));
  for (int i = 0; i < 3; ++i) cosine.step();
  CHECK(sgd2.lr() == doctest::Approx(0.0));

  SGD sgd3({p}, SGDOptions{.lr = 1.0});
  ExponentialLR expo(sgd3, 0.9);
  expo.step();
  expo.step();
  CHECK(sgd3.lr() == doctest::Approx(0.81));

  SGD sgd4({p}, SGDOptions{.lr = 1.0});
  ReduceLROnPlateau::Options po;
  po.patience = 1;
  ReduceLROnPlateau plateau(sgd4, po);
  plateau.step(1.0);
  plateau.step(1.0);  // 1 bad epoch (not more than patience)
  CHECK(sgd4.lr() == 1.0);
  plateau.step(1.0);  // 2 bad epochs > patience -> reduce
  CHECK(sgd4.lr() == doctest::Approx(0.1));
  plateau.step(0.5);  // improvement
  CHECK(sgd4.lr() == doctest::Approx(0.1));
}

TEST_CASE("optim: scheduler state_dict resumes the schedule; bad state is refused") {
  Tensor p = param({1});
  // Plateau: counters and best survive; the resumed scheduler reduces exactly when the original does.
  ReduceLROnPlateau::Options po;
  po.patience = 2;
  po.cooldown = 1;
  SGD a_opt({p}, SGDOptions{.lr = 1.0}), b_opt({p}, SGDOptions{.lr = 1.0});
  ReduceLROnPlateau a(a_opt, po), b(b_opt, po);
  CHECK(a.state_dict().count("best") == 0);  // nothing seen yet
  for (double m : {1.0, 0.9, 0.95, 0.95}) a.step(m);
  const auto saved = a.state_dict();
  CHECK(saved.at("epoch") == 4.0);
  CHECK(saved.at("best") == 0.9);
  CHECK(saved.at("bad_epochs") == 2.0);
  b_opt.set_lr(a_opt.lr());
  b.load_state_dict(saved);
  CHECK(b_opt.lr() == 1.0);  // a plateau scheduler does not touch the lr on load
  for (double m : {0.95, 0.95, 0.95, 0.95, 0.5, 0.6}) {
    a.step(m);
    b.step(m);
    CHECK(b_opt.lr() == a_opt.lr());
  }
  CHECK(a_opt.lr() < 1.0);
  // Time-based: the epoch, and with it the lr.
  SGD c_opt({p}, SGDOptions{.lr = 1.0}), d_opt({p}, SGDOptions{.lr = 1.0});
  StepLR c(c_opt, 2, 0.5), d(d_opt, 2, 0.5);
  for (int i = 0; i < 5; ++i) c.step();
  d.load_state_dict(c.state_dict());
  CHECK(d.epoch() == 5);
  CHECK(d_opt.lr() == c_opt.lr());

  CHECK(contains(error_message([&] { b.load_state_dict({{"epoch", 1.0}}); }), "no 'bad_epochs'"));
  CHECK(contains(error_message([&] { d.load_state_dict({{"epoch", -1.0}}); }),
                 "'epoch' must be a non-negative whole number, got -1"));
  CHECK_THROWS_AS(b.load_state_dict({{"epoch", 1.0}, {"bad_epochs", 0.5}, {"cooldown_left", 0.0}}), ValueError);
}

TEST_CASE("optim: gradient clipping") {
  Tensor a = param({0, 0}), b = param({0});
  a.set_grad(tensor({3, 0}));
  b.set_grad(tensor({4}));
  const double total = clip_grad_norm_({a, b}, 1.0);
  CHECK(total == doctest::Approx(5.0));
  check_close(a.grad(), {0.6f, 0}, 1e-5);
  check_close(b.grad(), {0.8f}, 1e-5);
  a.set_grad(tensor({3, -5}));
  clip_grad_value_({a}, 1.0);
  check_close(a.grad(), {1, -1});
}
