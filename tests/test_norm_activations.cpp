// layer_norm / group_norm (kernels/cpu/norm.cpp, nn/functional/norm.cpp) and the activations silu,
// leaky_relu, elu, hardtanh, logsigmoid and softplus(beta, threshold) (autograd/functions/activation.cpp):
// gradient checks, error messages, the layers, and values and gradients against PyTorch 1.13
// (tests/data/parity_norm_activations.safetensors, written by make_parity.py norm_activations).
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "autograd/gradcheck.h"
#include "kernels/kernels.h"
#include "nn/layers.h"
#include "nn/safetensors.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::testing;
using autograd::gradcheck;
using autograd::gradgradcheck;
namespace F = mn::nn::functional;

namespace {

using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

// A seeded normal leaf whose entries keep at least 0.05 away from the kinks (finite differences of
// step 1e-3 must not straddle one).
Tensor away_from_kinks(const Shape& shape, uint64_t seed, const std::vector<float>& kinks, double scale = 2.0) {
  std::vector<float> v = random_tensor(shape, seed).to_vector<float>();
  for (float& e : v) {
    e *= static_cast<float>(scale);
    for (float k : kinks)
      if (std::abs(e - k) < 0.05f) e = k + (e < k ? -0.1f : 0.1f);
  }
  return from_vector(v, shape).requires_grad_(true);
}

// Every element of got within tol * (1 + |expected|) of expected, NaN exactly where expected has NaN,
// infinities equal.
void check_matches(const Tensor& got, const Tensor& expected, double tol, const std::string& what) {
  INFO(what);
  REQUIRE(got.sizes() == expected.sizes());
  const std::vector<float> g = got.to_vector<float>(), e = expected.to_vector<float>();
  for (size_t i = 0; i < g.size(); ++i) {
    INFO("element " << i << ": got " << g[i] << ", expected " << e[i]);
    if (std::isnan(e[i]) || std::isinf(e[i]))
      CHECK((std::isnan(e[i]) ? std::isnan(g[i]) : g[i] == e[i]));
    else
      CHECK(std::abs(g[i] - e[i]) <= tol * (1.0 + std::abs(e[i])));
  }
}

safetensors::File parity_file() {
  return safetensors::load(std::string(MN_TEST_DATA_DIR) + "/parity_norm_activations.safetensors");
}

}  // namespace

// ---------------------------------------------------------------- activations

TEST_CASE("activations: values with PyTorch's formulas on simple inputs") {
  const Tensor x = tensor({-2.0f, -0.5f, 0.0f, 0.5f, 3.0f});
  check_close(silu(x), {-0.23840584f, -0.18877034f, 0.0f, 0.31122968f, 2.85772238f});
  check_close(leaky_relu(x), {-0.02f, -0.005f, 0.0f, 0.5f, 3.0f});
  check_close(leaky_relu(x, 0.2), {-0.4f, -0.1f, 0.0f, 0.5f, 3.0f});
  check_close(elu(x), {-0.86466472f, -0.39346934f, 0.0f, 0.5f, 3.0f});
  check_close(elu(x, 2.0), {-1.72932943f, -0.78693868f, 0.0f, 0.5f, 3.0f});
  check_close(hardtanh(x), {-1.0f, -0.5f, 0.0f, 0.5f, 1.0f});
  check_close(hardtanh(x, -0.25, 2.0), {-0.25f, -0.25f, 0.0f, 0.5f, 2.0f});
  check_close(logsigmoid(x), {-2.12692801f, -0.97407698f, -0.69314718f, -0.47407698f, -0.04858735f});
  check_close(softplus(x, 2.0, 5.0), {0.00907471f, 0.15663721f, 0.34657359f, 0.65663721f, 3.0f});
  // softplus(x) keeps its meaning: beta 1, threshold 20.
  check_close(softplus(tensor({0.0f, 20.5f, -30.0f})), {0.69314718f, 20.5f, 9.3576e-14f});
  // logsigmoid stays finite far out on both sides.
  check_close(logsigmoid(tensor({-200.0f, 200.0f})), {-200.0f, 0.0f});
}

TEST_CASE("activations: gradcheck, first and second order") {
  struct Case {
    const char* name;
    std::function<Tensor(const Tensor&)> f;
    std::vector<float> kinks;
  };
  const std::vector<Case> cases = {
      {"silu", [](const Tensor& t) { return silu(t); }, {}},
      {"logsigmoid", [](const Tensor& t) { return logsigmoid(t); }, {}},
      {"leaky_relu", [](const Tensor& t) { return leaky_relu(t, 0.2); }, {0.0f}},
      {"elu", [](const Tensor& t) { return elu(t, 1.5); }, {0.0f}},
      {"hardtanh", [](const Tensor& t) { return hardtanh(t, -0.5, 1.5); }, {-0.5f, 1.5f}},
      {"softplus", [](const Tensor& t) { return softplus(t, 2.0, 3.0); }, {1.5f}},
      {"softplus default", [](const Tensor& t) { return softplus(t); }, {}},
  };
  uint64_t seed = 40;
  for (const Case& c : cases) {
    INFO(c.name);
    const Tensor x = away_from_kinks({3, 5}, ++seed, c.kinks);
    const Fn fn = [f = c.f](const std::vector<Tensor>& v) { return f(v[0]); };
    CHECK(gradcheck(fn, {x}) == "");
    CHECK(gradgradcheck(fn, {x}) == "");
    // A transposed (non-contiguous) input takes the same path.
    const Fn fn_t = [f = c.f](const std::vector<Tensor>& v) { return f(v[0].t()); };
    CHECK(gradcheck(fn_t, {x}) == "");
  }
}

TEST_CASE("activations: layers and argument checks") {
  const Tensor x = tensor({-3.0f, -0.5f, 0.25f, 4.0f});
  check_close(nn::SiLU().forward(x), silu(x).to_vector<float>());
  check_close(nn::LogSigmoid().forward(x), logsigmoid(x).to_vector<float>());
  check_close(nn::LeakyReLU(0.3).forward(x), {-0.9f, -0.15f, 0.25f, 4.0f});
  check_close(nn::ELU(0.5).forward(x), elu(x, 0.5).to_vector<float>());
  check_close(nn::Hardtanh(-2.0, 2.0).forward(x), {-2.0f, -0.5f, 0.25f, 2.0f});
  check_close(nn::Softplus(2.0, 1.0).forward(x), softplus(x, 2.0, 1.0).to_vector<float>());
  CHECK(nn::SiLU().named_parameters().empty());
  CHECK(nn::Softplus().beta == 1.0);
  CHECK(nn::Softplus().threshold == 20.0);
  CHECK(nn::LeakyReLU().negative_slope == doctest::Approx(0.01));

  CHECK_THROWS_AS(hardtanh(x, 1.0, -1.0), ValueError);
  CHECK(contains(error_message([&] { hardtanh(x, 1.0, -1.0); }), "min_val 1 and max_val -1"));
  CHECK_THROWS_AS(nn::Hardtanh(2.0, 1.0), ValueError);
  const Tensor i = from_vector(std::vector<int64_t>{1, -2});
  for (const auto& f : std::vector<std::function<Tensor()>>{[&] { return silu(i); }, [&] { return elu(i); },
                                                            [&] { return softplus(i, 2.0); }})
    CHECK_THROWS_AS(f(), TypeError);
}

TEST_CASE("activations: the parameterised backward ops go through binary_params only") {
  const Tensor g = tensor({1.0f, 1.0f}), x = tensor({-1.0f, 2.0f});
  Tensor out = empty({2});
  CHECK_THROWS_AS(kernels::binary(kCPU, kernels::BinaryOp::LeakyReluBackward, g, x, out), TypeError);
  CHECK_THROWS_AS(kernels::binary_params(kCPU, kernels::BinaryOp::Add, g, x, out, 0, 0), TypeError);
  kernels::binary_params(kCPU, kernels::BinaryOp::LeakyReluBackward, g, x, out, 0.25, 0);
  check_close(out, {0.25f, 1.0f});
  kernels::binary_params(kCPU, kernels::BinaryOp::HardtanhBackward, g, x, out, -1.0, 3.0);
  check_close(out, {0.0f, 1.0f});  // zero at the bound itself, as PyTorch
}

TEST_CASE("activations: values and gradients match PyTorch, NaN and infinities included") {
  const auto f = parity_file();
  const Tensor x = f.at("act_x");
  const Tensor g = f.at("act_grad");
  const std::vector<std::pair<std::string, std::function<Tensor(const Tensor&)>>> cases = {
      {"silu", [](const Tensor& t) { return silu(t); }},
      {"logsigmoid", [](const Tensor& t) { return logsigmoid(t); }},
      {"leaky_relu", [](const Tensor& t) { return leaky_relu(t); }},
      {"leaky_relu_02", [](const Tensor& t) { return leaky_relu(t, 0.2); }},
      {"elu", [](const Tensor& t) { return elu(t); }},
      {"elu_15", [](const Tensor& t) { return elu(t, 1.5); }},
      {"hardtanh", [](const Tensor& t) { return hardtanh(t); }},
      {"hardtanh_m2_05", [](const Tensor& t) { return hardtanh(t, -2.0, 0.5); }},
      {"softplus", [](const Tensor& t) { return softplus(t); }},
      {"softplus_2_5", [](const Tensor& t) { return softplus(t, 2.0, 5.0); }},
  };
  for (const auto& [tag, fn] : cases) {
    Tensor xi = x.clone().requires_grad_(true);
    Tensor y = fn(xi);
    check_matches(y, f.at("act_" + tag + "_y"), 1e-5, tag + " forward");
    sum(mul(y, g)).backward();
    check_matches(xi.grad(), f.at("act_" + tag + "_gx"), 1e-5, tag + " grad");
  }
}

// ---------------------------------------------------------------- layer norm and group norm

TEST_CASE("layer_norm: gradcheck over 1, 2 and 3 normalised dims, with and without affine") {
  struct Case {
    Shape x;
    std::vector<int64_t> normalized;
  };
  uint64_t seed = 200;
  for (const Case& c : std::vector<Case>{{{4, 6}, {6}}, {{2, 3, 4}, {3, 4}}, {{2, 2, 3, 3}, {2, 3, 3}}, {{5}, {5}}}) {
    const Shape ns(c.normalized);
    INFO("x " << c.x << ", normalized_shape " << ns);
    const Tensor x = random_param(c.x, ++seed, 2.0);
    const Tensor w = add(random_tensor(ns, ++seed), 1.5).requires_grad_(true);
    const Tensor b = random_param(ns, ++seed);
    const auto affine = [&](const std::vector<Tensor>& t) { return F::layer_norm(t[0], c.normalized, t[1], t[2]); };
    const auto plain = [&](const std::vector<Tensor>& t) { return F::layer_norm(t[0], c.normalized); };
    CHECK(gradcheck(affine, {x, w, b}) == "");
    CHECK(gradcheck(plain, {x}) == "");
    CHECK(gradgradcheck(affine, {x, w, b}) == "");
  }
  // Bias without weight, over two dims, to second order.
  const Tensor x2 = random_param({2, 3, 4}, 310, 2.0), b2 = random_param({3, 4}, 311);
  const auto bias_only = [](const std::vector<Tensor>& t) { return F::layer_norm(t[0], {3, 4}, Tensor(), t[1]); };
  CHECK(gradcheck(bias_only, {x2, b2}) == "");
  CHECK(gradgradcheck(bias_only, {x2, b2}) == "");
  // A transposed input (the kernels take a dense copy) and weight only.
  const Tensor xt = random_param({5, 4}, 300);
  const Tensor w = add(random_tensor({5}, 301), 1.0).requires_grad_(true);
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::layer_norm(t[0].t(), {5}, t[1]); }, {xt, w}) == "");
}

TEST_CASE("layer_norm: rows are normalised with the biased variance; NaN stays in its row") {
  const Tensor x = tensor({1, 2, 3, 4, 10, 10, 10, 10}, {2, 4});
  // row 0: mean 2.5, var 1.25; row 1 is constant: (x - mean) = 0 -> 0.
  const float k = 1.0f / std::sqrt(1.25f + 1e-5f);
  check_close(F::layer_norm(x, {4}), {-1.5f * k, -0.5f * k, 0.5f * k, 1.5f * k, 0, 0, 0, 0});
  const Tensor xn = tensor({1, NAN, 3, 4, 5, 6}, {2, 3});
  const std::vector<float> y = F::layer_norm(xn, {3}).to_vector<float>();
  for (int i = 0; i < 3; ++i) CHECK(std::isnan(y[i]));
  for (int i = 3; i < 6; ++i) CHECK(!std::isnan(y[i]));
}

TEST_CASE("layer_norm and group_norm: error messages") {
  const Tensor x = random_tensor({2, 3, 4}, 7);
  CHECK(contains(error_message([&] { F::layer_norm(x, {3}); }), "normalized_shape [3]"));
  CHECK(contains(error_message([&] { F::layer_norm(x, {3}); }), "got input of shape [2, 3, 4]"));
  CHECK_THROWS_AS(F::layer_norm(x, {5, 3, 4}), ValueError);
  CHECK_THROWS_AS(F::layer_norm(x, {}), ValueError);
  CHECK(contains(error_message([&] { F::layer_norm(x, {4}, ones({3})); }), "expected weight of shape [4], got [3]"));
  CHECK(contains(error_message([&] { F::layer_norm(x, {3, 4}, ones({3, 4}), zeros({4})); }),
                 "expected bias of shape [3, 4], got [4]"));
  CHECK_THROWS_AS(F::layer_norm(x, {4}, Tensor(), Tensor(), -1.0), ValueError);
  CHECK_THROWS_AS(F::layer_norm(from_vector(std::vector<int64_t>{1, 2}), {2}), TypeError);

  const Tensor y = random_tensor({2, 6, 5}, 8);
  const std::string msg = error_message([&] { F::group_norm(y, 4); });
  CHECK(contains(msg, "number of channels (6)"));
  CHECK(contains(msg, "num_groups (4)"));
  CHECK_THROWS_AS(F::group_norm(y, 4), ValueError);
  CHECK_THROWS_AS(F::group_norm(y, 0), ValueError);
  CHECK_THROWS_AS(F::group_norm(random_tensor({6}, 9), 2), ValueError);
  CHECK(contains(error_message([&] { F::group_norm(y, 3, ones({5})); }), "expected weight of shape [6], got [5]"));
  CHECK(contains(error_message([] { nn::GroupNorm(4, 6); }), "num_channels (6) must be divisible by num_groups (4)"));
  CHECK_THROWS_AS(nn::LayerNorm(std::vector<int64_t>{}), ValueError);
  nn::GroupNorm gn(2, 6);
  CHECK(contains(error_message([&] { gn.forward(random_tensor({2, 4, 3}, 10)); }), "expected input of shape [N, 6, *]"));
}

TEST_CASE("group_norm: gradcheck with groups 1, 2 and C, with and without affine and spatial dims") {
  struct Case {
    Shape x;
    int64_t groups;
  };
  uint64_t seed = 500;
  // Rows of at least 4 values: with 2 the output is almost constant and the finite differences of
  // float evaluations drown the (tiny, eps-driven) derivative.
  for (const Case& c : std::vector<Case>{{{2, 4, 3}, 1}, {{2, 6, 2, 3}, 2}, {{3, 4, 5}, 4}, {{3, 8}, 2}, {{1, 4, 2, 2, 2}, 2}}) {
    INFO("x " << c.x << ", groups " << c.groups);
    const int64_t ch = c.x[1];
    const Tensor x = random_param(c.x, ++seed, 2.0);
    const Tensor w = add(random_tensor({ch}, ++seed), 1.5).requires_grad_(true);
    const Tensor b = random_param({ch}, ++seed);
    const int64_t g = c.groups;
    CHECK(gradcheck([g](const std::vector<Tensor>& t) { return F::group_norm(t[0], g, t[1], t[2]); }, {x, w, b}) == "");
    CHECK(gradcheck([g](const std::vector<Tensor>& t) { return F::group_norm(t[0], g); }, {x}) == "");
  }
  // Second order on small inputs: the numerical side sums finite differences of float gradients over
  // every element, and that noise grows with the size.
  for (int64_t g : {1, 2, 4}) {
    INFO("groups " << g);
    const Tensor x = random_param({2, 4, 3}, 600 + g, 2.0);
    const Tensor w = add(random_tensor({4}, 610 + g), 1.5).requires_grad_(true);
    const Tensor b = random_param({4}, 620 + g);
    CHECK(gradgradcheck([g](const std::vector<Tensor>& t) { return F::group_norm(t[0], g, t[1], t[2]); }, {x, w, b}) ==
          "");
  }
}

TEST_CASE("group_norm: with groups = 1 and no spatial dims it is layer norm over the channels") {
  const Tensor x = random_tensor({3, 5}, 21);
  const Tensor w = add(random_tensor({5}, 22), 1.0), b = random_tensor({5}, 23);
  check_close(F::group_norm(x, 1, w, b), F::layer_norm(x, {5}, w, b).to_vector<float>(), 1e-6);
  // groups = C: each (n, c) plane is normalised alone (instance norm).
  const Tensor y = random_tensor({2, 3, 4}, 24);
  const Tensor centered = sub(y, mean(y, 2, true));
  const Tensor expected = div(centered, sqrt(add(mean(mul(centered, centered), 2, true), 1e-5)));
  check_close(F::group_norm(y, 3), expected.to_vector<float>(), 1e-5);
}

TEST_CASE("LayerNorm and GroupNorm layers: PyTorch's parameters and defaults") {
  nn::LayerNorm ln(std::vector<int64_t>{3, 4});
  CHECK(ln.param("weight").sizes() == Shape{3, 4});
  CHECK(ln.param("weight").to_vector<float>() == std::vector<float>(12, 1.0f));
  CHECK(ln.param("bias").to_vector<float>() == std::vector<float>(12, 0.0f));
  CHECK(ln.eps == 1e-5);
  CHECK(nn::LayerNorm(8, 1e-6, false).named_parameters().empty());
  Tensor x = random_tensor({2, 3, 4}, 30);
  check_close(ln.forward(x), F::layer_norm(x, {3, 4}).to_vector<float>(), 1e-6);
  Tensor y = ln.forward(x.requires_grad_(true));
  sum(y).backward();
  CHECK(ln.param("bias").grad().to_vector<float>() == std::vector<float>(12, 2.0f));

  nn::GroupNorm gn(2, 6);
  CHECK(gn.param("weight").sizes() == Shape{6});
  CHECK(gn.param("bias").to_vector<float>() == std::vector<float>(6, 0.0f));
  CHECK(nn::GroupNorm(3, 6, 1e-5, false).named_parameters().empty());
  const Tensor z = random_tensor({2, 6, 5}, 31);
  check_close(gn.forward(z), F::group_norm(z, 2).to_vector<float>(), 1e-6);
}

TEST_CASE("layer_norm and group_norm: values and gradients of x, weight and bias match PyTorch") {
  const auto f = parity_file();
  const auto run = [&](const std::string& tag, const std::function<Tensor(const Tensor&, const Tensor&, const Tensor&)>& fn,
                       bool affine) {
    Tensor x = f.at(tag + "_x").clone().requires_grad_(true);
    Tensor w = affine ? f.at(tag + "_weight").clone().requires_grad_(true) : Tensor();
    Tensor b = affine ? f.at(tag + "_bias").clone().requires_grad_(true) : Tensor();
    Tensor y = fn(x, w, b);
    check_matches(y, f.at(tag + "_y"), 1e-5, tag + " forward");
    sum(mul(y, f.at(tag + "_y_weight"))).backward();
    check_matches(x.grad(), f.at(tag + "_gx"), 1e-4, tag + " grad x");
    if (!affine) return;
    check_matches(w.grad(), f.at(tag + "_gweight"), 1e-4, tag + " grad weight");
    check_matches(b.grad(), f.at(tag + "_gbias"), 1e-4, tag + " grad bias");
  };
  for (const auto& [tag, k, affine] : std::vector<std::tuple<std::string, int, bool>>{
           {"ln1", 1, true}, {"ln2", 2, true}, {"ln3", 3, true}, {"ln_plain", 1, false}}) {
    run(tag, [k = k](const Tensor& x, const Tensor& w, const Tensor& b) {
      std::vector<int64_t> ns = x.sizes().vec();
      ns.erase(ns.begin(), ns.end() - k);
      return F::layer_norm(x, ns, w, b);
    }, affine);
  }
  for (const auto& [tag, groups, affine] : std::vector<std::tuple<std::string, int64_t, bool>>{
           {"gn2", 2, true}, {"gn1", 1, true}, {"gnC", 4, true}, {"gn_flat", 3, true}, {"gn_plain", 3, false}}) {
    run(tag, [g = groups](const Tensor& x, const Tensor& w, const Tensor& b) { return F::group_norm(x, g, w, b); },
        affine);
  }
}

