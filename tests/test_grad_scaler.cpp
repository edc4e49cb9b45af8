// amp::GradScaler (issue 23): the fused unscale kernel against a plain composition, the scale update
// rule step by step, a sequence of steps with injected infinities and NaNs against the scale and
// growth count PyTorch's algorithm gives, skipped steps leaving parameters and optimizer state alone,
// the call-order errors, state_dict round trips and refusals, and the README example.
// (torch 1.13 has no CPU kernels for _amp_update_scale_ / _amp_foreach_non_finite_check_and_unscale_,
// so the expected values are written out from the documented rule instead of a parity golden.)
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "mapping/mapping_networks.h"
#include "tests/test_support.h"

using namespace mn;
using mn::testing::contains;
using mn::testing::error_message;
namespace F = mn::nn::functional;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

uint32_t bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

// Bitwise equal float lists (NaN matches NaN).
void check_same_bits(const std::vector<float>& got, const std::vector<float>& expected, const std::string& what) {
  INFO(what);
  REQUIRE(got.size() == expected.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("element " << i << ": got " << got[i] << ", expected " << expected[i]);
    if (std::isnan(expected[i])) CHECK(std::isnan(got[i]));
    else CHECK(bits(got[i]) == bits(expected[i]));
  }
}

// Gives `p` the gradient values * scale through a real backward of scaler.scale(sum(p * values)).
void backward_scaled(amp::GradScaler& scaler, const Tensor& p, const std::vector<float>& values) {
  const Tensor loss = sum(mul(p, from_vector(values, p.sizes())));
  scaler.scale(loss).backward();
}

}  // namespace

TEST_CASE("non_finite_check_and_unscale: one fused pass equals the plain composition") {
  // 70,001 elements: the CPU kernel's parallel path; 1 and 7: serial; 0: nothing to do.
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{70001}}) {
    for (const char* inject : {"none", "inf", "-inf", "nan"}) {
      for (float inv : {1.0f / 65536.0f, 1.0f / 3.0f, 1.0f}) {
        CAPTURE(n);
        CAPTURE(inject);
        CAPTURE(inv);
        Tensor grad = mul(mn::testing::random_tensor({n}, 5 + n), 1e4);
        std::vector<float> values = grad.to_vector<float>();
        const bool bad = std::string(inject) != "none" && n > 0;
        if (bad) {
          const float v = std::string(inject) == "inf" ? kInf : std::string(inject) == "-inf" ? -kInf : kNaN;
          values[static_cast<size_t>(n / 2)] = v;
          grad = from_vector(values, {n});
        }
        // The composition: grad * inv_scale, and "any element not finite" as sum(grad * 0) being NaN.
        const std::vector<float> expected = mul(grad, static_cast<double>(inv)).to_vector<float>();
        const bool expected_found = n > 0 && std::isnan(sum(mul(grad, 0.0)).item());
        CHECK(expected_found == bad);
        Tensor found = zeros({1});
        const Tensor inv_scale = full({1}, inv);
        kernels::non_finite_check_and_unscale(kCPU, grad, found, inv_scale);
        check_same_bits(grad.to_vector<float>(), expected, "unscaled gradient");
        CHECK(found.item() == (expected_found ? 1.0 : 0.0));
      }
    }
  }
  // found_inf collects: a clean gradient leaves a set flag set.
  Tensor found = ones({1});
  Tensor clean = from_vector(std::vector<float>{1, 2, 3});
  kernels::non_finite_check_and_unscale(kCPU, clean, found, full({1}, 0.5));
  CHECK(found.item() == 1.0);
  check_same_bits(clean.to_vector<float>(), {0.5f, 1.0f, 1.5f}, "scaled by 0.5");
}

TEST_CASE("non_finite_check_and_unscale and amp_update_scale refuse bad operands") {
  Tensor found = zeros({1});
  const Tensor inv = full({1}, 0.5);
  Tensor strided = mn::testing::random_tensor({4, 3}, 1).t();
  CHECK_THROWS_AS(kernels::non_finite_check_and_unscale(kCPU, strided, found, inv), ValueError);
  CHECK(contains(error_message([&] { kernels::non_finite_check_and_unscale(kCPU, strided, found, inv); }),
                 "expected 'grad' to be contiguous"));
  Tensor ints = from_vector(std::vector<int64_t>{1, 2});
  CHECK_THROWS_AS(kernels::non_finite_check_and_unscale(kCPU, ints, found, inv), TypeError);
  Tensor grad = ones({3});
  Tensor two = zeros({2});
  CHECK(contains(error_message([&] { kernels::non_finite_check_and_unscale(kCPU, grad, two, inv); }),
                 "expected 'found_inf' to hold one element, got shape [2]"));
  Tensor scale = full({1}, 8.0);
  Tensor tracker_f32 = zeros({1});
  CHECK(contains(error_message([&] { kernels::amp_update_scale(kCPU, scale, tracker_f32, found, 2.0, 0.5, 3); }),
                 "expected 'growth_tracker' to be i64, got f32"));
}

TEST_CASE("amp_update_scale: PyTorch's rule, growth kept only while the scale stays finite in f32") {
  Tensor scale = full({1}, 1024.0);
  Tensor tracker = zeros({1}, DType::i64);
  const Tensor clean = zeros({1}), overflow = ones({1});
  auto update = [&](const Tensor& found) { kernels::amp_update_scale(kCPU, scale, tracker, found, 2.0, 0.5, 3); };
  const std::vector<std::pair<const Tensor*, std::pair<double, int64_t>>> steps = {
      {&clean, {1024, 1}}, {&clean, {1024, 2}}, {&clean, {2048, 0}}, {&overflow, {1024, 0}},
      {&clean, {1024, 1}}, {&overflow, {512, 0}}, {&clean, {512, 1}}};
  for (size_t i = 0; i < steps.size(); ++i) {
    CAPTURE(i);
    update(*steps[i].first);
    CHECK(scale.item() == steps[i].second.first);
    CHECK(static_cast<int64_t>(tracker.item()) == steps[i].second.second);
  }
  // At 2^127 a growth by 2 would be infinite in f32: the scale stays, the count restarts.
  Tensor top = full({1}, std::ldexp(1.0, 127));
  Tensor count = full({1}, 2.0, DType::i64);
  kernels::amp_update_scale(kCPU, top, count, clean, 2.0, 0.5, 3);
  CHECK(top.item() == std::ldexp(1.0, 127));
  CHECK(count.item() == 0.0);
  // The backoff is computed in double and rounded once (0.3 of 10 is 3.0000001192092896 in f32).
  Tensor ten = full({1}, 10.0);
  kernels::amp_update_scale(kCPU, ten, count, overflow, 2.0, 0.3, 3);
  CHECK(ten.item() == static_cast<double>(static_cast<float>(10.0 * 0.3)));
}

TEST_CASE("GradScaler: injected infinities and NaNs give PyTorch's scale and growth-count sequence") {
  // init 1024, interval 3: a skip halves the scale and restarts the count; the third clean step in a
  // row doubles it. Written out by hand from torch.cuda.amp.GradScaler's documented rule.
  struct Step {
    float injected;  // 0: a clean gradient
    bool stepped;
    double scale;
    int64_t tracker;
  };
  const std::vector<Step> steps = {
      {0, true, 1024, 1},    {0, true, 1024, 2},    {0, true, 2048, 0},  {kInf, false, 1024, 0},
      {kNaN, false, 512, 0}, {0, true, 512, 1},     {0, true, 512, 2},   {-kInf, false, 256, 0},
      {0, true, 256, 1},     {0, true, 256, 2},     {0, true, 512, 0},   {0, true, 512, 1},
  };
  Tensor p = from_vector(std::vector<float>{1, 2, 3, 4}).requires_grad_(true);
  nn::optim::SGD sgd({p}, {.lr = 0.5});
  amp::GradScaler scaler({.init_scale = 1024, .growth_interval = 3});
  CHECK(scaler.get_scale() == 1024);
  std::vector<float> expected_param = p.to_vector<float>();
  for (size_t i = 0; i < steps.size(); ++i) {
    CAPTURE(i);
    const Step& s = steps[i];
    sgd.zero_grad();
    std::vector<float> g = {0.25f, -0.5f, 0.125f * static_cast<float>(i + 1), 1.0f};
    if (s.injected != 0) g[2] = s.injected;
    backward_scaled(scaler, p, g);
    scaler.unscale_(sgd);
    // Unscaled exactly (a power-of-two scale); the injected value stays non-finite.
    check_same_bits(p.grad().to_vector<float>(), g, "unscaled gradient");
    CHECK(scaler.step(sgd) == s.stepped);
    if (s.stepped)
      for (size_t k = 0; k < g.size(); ++k) expected_param[k] -= 0.5f * g[k];
    check_same_bits(p.to_vector<float>(), expected_param, "parameter after the step");
    scaler.update();
    CHECK(scaler.get_scale() == s.scale);
    CHECK(scaler.growth_tracker() == s.tracker);
  }
}

TEST_CASE("GradScaler: a skipped step leaves parameters and Adam's state alone, step count included") {
  const std::vector<std::vector<float>> grads = {{0.5f, -1}, {kInf, 2}, {0.25f, 0.75f}, {kNaN, 1}, {-1, 0.5f}};
  Tensor scaled = from_vector(std::vector<float>{1, -2}).requires_grad_(true);
  Tensor plain = from_vector(std::vector<float>{1, -2}).requires_grad_(true);
  nn::optim::Adam with_scaler({scaled}, {.lr = 0.1});
  nn::optim::Adam reference({plain}, {.lr = 0.1});
  amp::GradScaler scaler;
  for (const std::vector<float>& g : grads) {
    with_scaler.zero_grad();
    backward_scaled(scaler, scaled, g);
    const bool clean = std::isfinite(g[0]) && std::isfinite(g[1]);
    const nn::optim::OptimizerState before = with_scaler.state_dict();
    CHECK(scaler.step(with_scaler) == clean);
    scaler.update();
    if (clean) {  // the reference sees only the clean steps
      reference.zero_grad();
      sum(mul(plain, from_vector(g))).backward();
      reference.step();
    } else {
      const nn::optim::OptimizerState after = with_scaler.state_dict();
      REQUIRE(after.size() == before.size());
      for (const auto& [key, t] : before) {
        CAPTURE(key);
        check_same_bits(after.at(key).to(DType::f32).to_vector<float>(), t.to(DType::f32).to_vector<float>(), key);
      }
    }
    check_same_bits(scaled.to_vector<float>(), plain.to_vector<float>(), "parameter");
  }
  CHECK(with_scaler.step_count() == 3);
  CHECK(with_scaler.state_dict().at("state.0.step").item() == 3.0);
  CHECK(scaler.get_scale() == 16384.0);  // two skips from 65536
}

TEST_CASE("GradScaler: call order errors and update(new_scale), as PyTorch") {
  Tensor p = ones({2}).requires_grad_(true);
  nn::optim::SGD sgd({p}, {.lr = 0.1});
  amp::GradScaler scaler;
  CHECK(contains(error_message([&] { scaler.unscale_(sgd); }), "the first scale(loss) creates"));
  CHECK_THROWS_AS(scaler.update(), RuntimeError);
  backward_scaled(scaler, p, {1, 2});
  scaler.unscale_(sgd);
  CHECK(contains(error_message([&] { scaler.unscale_(sgd); }), "already been called on this optimizer"));
  CHECK(scaler.step(sgd));
  CHECK(contains(error_message([&] { scaler.step(sgd); }), "step() has already been called since the last update()"));
  CHECK(contains(error_message([&] { scaler.unscale_(sgd); }), "after step()"));
  scaler.update();
  // A fresh iteration: no check recorded yet.
  CHECK(contains(error_message([&] { scaler.update(); }), "no inf checks were recorded prior to update()"));
  sgd.zero_grad();
  CHECK(contains(error_message([&] { scaler.step(sgd); }), "none of its 1 parameters has a gradient"));
  // update(new_scale) sets the scale without a step and keeps the growth count.
  scaler.update(128.0);
  CHECK(scaler.get_scale() == 128.0);
  CHECK(scaler.growth_tracker() == 1);
  CHECK_THROWS_AS(scaler.update(0.0), ValueError);
  CHECK_THROWS_AS(scaler.update(std::numeric_limits<double>::infinity()), ValueError);
  // Options out of range.
  CHECK(contains(error_message([] { amp::GradScaler({.growth_factor = 1.0}); }), "growth_factor must be"));
  CHECK(contains(error_message([] { amp::GradScaler({.backoff_factor = 1.0}); }), "backoff_factor must be in (0, 1)"));
  CHECK_THROWS_AS(amp::GradScaler({.init_scale = 0.0}), ValueError);
  CHECK_THROWS_AS(amp::GradScaler({.growth_interval = 0}), ValueError);
}

TEST_CASE("GradScaler: disabled, every call passes through") {
  Tensor p = ones({2}).requires_grad_(true);
  nn::optim::SGD sgd({p}, {.lr = 0.5});
  amp::GradScaler scaler({.growth_factor = 0.0, .enabled = false});  // options are not checked
  const Tensor loss = sum(mul(p, from_vector(std::vector<float>{kInf, 1})));
  const Tensor same = scaler.scale(loss);
  CHECK(same.sizes() == loss.sizes());
  CHECK(same.item() == loss.item());
  same.backward();
  scaler.unscale_(sgd);
  scaler.unscale_(sgd);  // no stage bookkeeping
  CHECK(scaler.step(sgd));  // steps whatever the gradients hold
  CHECK(std::isinf(p.to_vector<float>()[0]));
  scaler.update();
  CHECK(scaler.get_scale() == 1.0);
  CHECK(scaler.state_dict().empty());
  scaler.load_state_dict({});
  CHECK(!scaler.scale_tensor().defined());
}

TEST_CASE("GradScaler: state_dict round trip, in place, and bad states refused") {
  Tensor p = ones({2}).requires_grad_(true);
  nn::optim::SGD sgd({p}, {.lr = 0.1});
  amp::GradScaler scaler({.init_scale = 256, .growth_factor = 4, .backoff_factor = 0.25, .growth_interval = 5});
  const std::vector<std::vector<float>> grads = {{1, 1}, {kInf, 1}, {1, 1}, {1, 2}};
  for (const auto& g : grads) {
    sgd.zero_grad();
    backward_scaled(scaler, p, g);
    scaler.step(sgd);
    scaler.update();
  }
  const std::map<std::string, double> state = scaler.state_dict();
  CHECK(state == std::map<std::string, double>{{"scale", 64},
                                               {"growth_factor", 4},
                                               {"backoff_factor", 0.25},
                                               {"growth_interval", 5},
                                               {"_growth_tracker", 2}});
  // Into a scaler whose tensors exist: the same memory, new values.
  amp::GradScaler other;
  other.materialize(kCPU);
  const void* memory = other.scale_tensor().raw_data();
  other.load_state_dict(state);
  CHECK(other.scale_tensor().raw_data() == memory);
  CHECK(other.state_dict() == state);
  // Both continue identically: three more clean steps grow the scale to 256.
  for (amp::GradScaler* s : {&scaler, &other})
    for (int i = 0; i < 3; ++i) {
      sgd.zero_grad();
      backward_scaled(*s, p, {1, 1});
      s->step(sgd);
      s->update();
    }
  CHECK(scaler.get_scale() == 256.0);
  CHECK(other.state_dict() == scaler.state_dict());
  // Into a fresh scaler (tensors created at its first scale()).
  amp::GradScaler fresh;
  fresh.load_state_dict(state);
  CHECK(fresh.get_scale() == 64.0);
  CHECK(fresh.growth_tracker() == 2);
  CHECK(fresh.options().growth_interval == 5);

  auto refused = [&](std::map<std::string, double> bad, const std::string& message) {
    CAPTURE(message);
    amp::GradScaler target;
    const std::string got = error_message([&] { target.load_state_dict(bad); });
    CHECK(contains(got, message));
    CHECK(target.get_scale() == 65536.0);  // nothing changed
  };
  auto with = [&](const std::string& key, double value) {
    std::map<std::string, double> s = state;
    s[key] = value;
    return s;
  };
  std::map<std::string, double> missing = state;
  missing.erase("_growth_tracker");
  refused(missing, "GradScaler: missing '_growth_tracker'");
  refused(with("scale_", 1.0), "unexpected key 'scale_'");
  refused(with("scale", 0.0), "'scale' must be a finite positive number, got 0");
  refused(with("scale", std::numeric_limits<double>::quiet_NaN()), "'scale' must be a finite positive number");
  refused(with("growth_factor", 1.0), "'growth_factor' must be a finite number > 1");
  refused(with("backoff_factor", 0.0), "'backoff_factor' must be in (0, 1)");
  refused(with("growth_interval", 2.5), "'growth_interval' must be a whole number >= 1, got 2.5");
  refused(with("_growth_tracker", 5.0), "'_growth_tracker' must be a whole number in [0, growth_interval = 5), got 5");
  refused(with("_growth_tracker", -1.0), "got -1");
  CHECK_THROWS_AS(amp::GradScaler().load_state_dict({}), RuntimeError);
  CHECK(contains(error_message([] { amp::GradScaler().load_state_dict({}); }), "saved from a disabled GradScaler"));
}

// The README's loop ("Loss scaling for f16") without its autocast scope: the scaler alone, which a
// power-of-two scale makes exact. (The README's own block, with autocast, is compiled by the README
// extraction; its f16 forward differs from f32, so it is not compared bit for bit.)
namespace readme {
void train_f16(mn::nn::Module& net, mn::data::DataLoader& loader, mn::nn::optim::Optimizer& optimizer) {
  mn::amp::GradScaler scaler;  // {.init_scale = 65536, .growth_factor = 2, .backoff_factor = 0.5, .growth_interval = 2000}
  for (const mn::data::Batch& batch : loader) {
    optimizer.zero_grad();
    mn::Tensor loss = F::cross_entropy(net.forward(batch.inputs), batch.targets);
    scaler.scale(loss).backward();   // loss * scale
    scaler.unscale_(optimizer);      // optional: clipping then sees the true gradients
    mn::nn::optim::clip_grad_norm_(optimizer.params(), 1.0);
    scaler.step(optimizer);          // false when a gradient overflowed: the step was skipped
    scaler.update();                 // back off after a skip, grow after growth_interval clean steps
  }
}
}  // namespace readme

TEST_CASE("GradScaler: the README loop (f32 forward) trains as the unscaled loop does, bit for bit") {
  Generator gen(3);
  const Tensor x = randn({16, 4}, {}, &gen);
  const Tensor y = from_vector(std::vector<int64_t>{0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0}, {16});
  data::DataLoader loader(x, y, {.batch_size = 4});
  auto make = [] {
    manual_seed(11);
    return std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
        std::make_shared<nn::Linear>(4, 8), std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(8, 3)});
  };
  auto scaled_net = make(), plain_net = make();
  nn::optim::Adam scaled_opt(scaled_net->parameters(), {.lr = 1e-2});
  nn::optim::Adam plain_opt(plain_net->parameters(), {.lr = 1e-2});
  readme::train_f16(*scaled_net, loader, scaled_opt);
  for (const data::Batch& batch : loader) {
    plain_opt.zero_grad();
    F::cross_entropy(plain_net->forward(batch.inputs), batch.targets).backward();
    nn::optim::clip_grad_norm_(plain_opt.params(), 1.0);
    plain_opt.step();
  }
  // A power-of-two scale scales every gradient exactly, so the unscaled ones are the plain ones.
  const auto a = scaled_net->named_parameters(), b = plain_net->named_parameters();
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i)
    check_same_bits(a[i].second.to_vector<float>(), b[i].second.to_vector<float>(), a[i].first);
  CHECK(scaled_opt.step_count() == 4);
}
