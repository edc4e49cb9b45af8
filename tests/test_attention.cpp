// scaled_dot_product_attention and MultiheadAttention: PyTorch 1.13 goldens
// (tests/data/parity_attention.safetensors, make_parity.py's attention()), gradchecks, masks,
// dropout, initialisation and the errors. Goldens agree to 1e-5 relative (worst measured 7e-7).
#include <cmath>
#include <limits>

#include "nn/functional_call.h"
#include "nn/layers.h"
#include "nn/safetensors.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::testing;
using autograd::gradcheck;
namespace F = mn::nn::functional;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

safetensors::File golden() {
  return safetensors::load(std::string(MN_TEST_DATA_DIR) + "/parity_attention.safetensors");
}

// Every element within tol * (1 + |expected|); NaN exactly where PyTorch has NaN.
void check_golden(const Tensor& got, const Tensor& expected, double tol, const std::string& what) {
  INFO(what);
  REQUIRE(got.sizes() == expected.sizes());
  const std::vector<float> g = got.contiguous().to_vector<float>(), e = expected.to_vector<float>();
  double worst = 0.0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isnan(e[i]) || std::isnan(g[i])) {
      INFO("element " << i << ": got " << g[i] << ", expected " << e[i]);
      CHECK(std::isnan(e[i]) == std::isnan(g[i]));
      continue;
    }
    worst = std::max(worst, std::abs(g[i] - e[i]) / (1.0 + std::abs(e[i])));
  }
  INFO("worst relative error " << worst);
  CHECK(worst <= tol);
}

Tensor leaf(const safetensors::File& f, const std::string& name) { return f.at(name).clone().requires_grad_(true); }

// The golden module's parameters (stored as <tag>_<name>) as fresh leaves, by our names.
std::map<std::string, Tensor> golden_parameters(const safetensors::File& f, const std::string& tag,
                                                const nn::Module& module) {
  std::map<std::string, Tensor> params;
  for (const auto& [name, t] : module.named_parameters()) params[name] = leaf(f, tag + "_" + name);
  return params;
}

}  // namespace

TEST_CASE("attention: scaled_dot_product_attention matches PyTorch math (mask, causal, scale, hidden row)") {
  const auto f = golden();
  for (const std::string tag : {"plain", "mask", "causal", "causal_rect", "scale", "hidden_row"}) {
    const std::string p = "sdpa_" + tag + "_";
    const std::vector<int64_t> cfg = f.at(p + "config").to_vector<int64_t>();
    Tensor q = leaf(f, p + "q"), k = leaf(f, p + "k"), v = leaf(f, p + "v");
    const Tensor mask = f.contains(p + "mask") ? f.at(p + "mask") : Tensor();
    std::optional<double> scale;
    if (cfg[1]) scale = f.at(p + "scale").to_vector<float>()[0];
    Tensor y = F::scaled_dot_product_attention(q, k, v, mask, 0.0, cfg[0] != 0, scale);
    check_golden(y, f.at(p + "y"), 1e-5, tag + " output");
    sum(mul(y, f.at(p + "y_weight"))).backward();
    check_golden(q.grad(), f.at(p + "gq"), 1e-5, tag + " grad query");
    check_golden(k.grad(), f.at(p + "gk"), 1e-5, tag + " grad key");
    check_golden(v.grad(), f.at(p + "gv"), 1e-5, tag + " grad value");
  }
}

TEST_CASE("attention: MultiheadAttention matches torch.nn.MultiheadAttention (batch_first both ways, masks)") {
  const auto f = golden();
  for (const bool batch_first : {false, true}) {
    const std::string tag = batch_first ? "mha_bf1" : "mha_bf0";
    nn::MultiheadAttention mha(8, 2, 0.0, true, batch_first);
    auto params = golden_parameters(f, tag, mha);
    REQUIRE(params.size() == 4);
    Tensor q = leaf(f, tag + "_q"), k = leaf(f, tag + "_k"), v = leaf(f, tag + "_v");
    auto out = nn::functional_call(mha, params, [&] {
      return mha.forward_attention(q, k, v, f.at(tag + "_key_padding_mask"), true, f.at(tag + "_attn_mask"));
    });
    check_golden(out.output, f.at(tag + "_y"), 1e-5, tag + " output");
    check_golden(out.weights, f.at(tag + "_w"), 1e-5, tag + " averaged weights");
    add(sum(mul(out.output, f.at(tag + "_y_weight"))), sum(mul(out.weights, f.at(tag + "_w_weight")))).backward();
    check_golden(q.grad(), f.at(tag + "_gq"), 1e-5, tag + " grad query");
    check_golden(k.grad(), f.at(tag + "_gk"), 1e-5, tag + " grad key");
    check_golden(v.grad(), f.at(tag + "_gv"), 1e-5, tag + " grad value");
    for (auto& [name, t] : params) check_golden(t.grad(), f.at(tag + "_grad_" + name), 1e-5, tag + " grad " + name);
  }
  // Self-attention (one fused in-projection) with per-head weights.
  nn::MultiheadAttention mha(8, 4);
  auto params = golden_parameters(f, "mha_self", mha);
  Tensor x = leaf(f, "mha_self_x");
  auto out = nn::functional_call(mha, params, [&] { return mha.forward_attention(x, x, x, {}, true, {}, false); });
  check_golden(out.output, f.at("mha_self_y"), 1e-5, "self output");
  check_golden(out.weights, f.at("mha_self_w"), 1e-5, "self per-head weights");
  add(sum(mul(out.output, f.at("mha_self_y_weight"))), sum(mul(out.weights, f.at("mha_self_w_weight")))).backward();
  check_golden(x.grad(), f.at("mha_self_gx"), 1e-5, "self grad x");
  for (auto& [name, t] : params) check_golden(t.grad(), f.at("mha_self_grad_" + name), 1e-5, "self grad " + name);
}

TEST_CASE("attention: gradcheck of scaled_dot_product_attention with a mask, causal and a scale") {
  Tensor q = random_param({2, 3, 4}, 1, 0.7), k = random_param({2, 5, 4}, 2, 0.7), v = random_param({2, 5, 3}, 3);
  // With one hidden key (the mask's -inf element has no finite difference, so the mask's own
  // gradient is checked with a finite mask).
  const Tensor hidden = where(eq(arange(15, DType::f32).reshape({3, 5}), 7.0), scalar_tensor(-kInf), zeros({3, 5}));
  Tensor mask = random_param({3, 5}, 4);
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return F::scaled_dot_product_attention(in[0], in[1], in[2]); },
                  {q, k, v}) == "");
  CHECK(gradcheck([&](const std::vector<Tensor>& in) {
          return F::scaled_dot_product_attention(in[0], in[1], in[2], add(in[3], hidden));
        }, {q, k, v, mask}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) {
          return F::scaled_dot_product_attention(in[0], in[1], in[2], {}, 0.0, true, 0.8);
        }, {q, k, v}) == "");
  // Second order through the composition.
  CHECK(autograd::gradgradcheck([](const std::vector<Tensor>& in) {
          return F::scaled_dot_product_attention(in[0], in[1], in[2], {}, 0.0, true);
        }, {q, k, v}) == "");
}

TEST_CASE("attention: causal equals the explicit mask; masks broadcast; a 0/1 mask converts as documented") {
  Tensor q = random_tensor({2, 4, 3}, 5), k = random_tensor({2, 6, 3}, 6), v = random_tensor({2, 6, 2}, 7);
  std::vector<float> m(24, 0.0f);
  for (int i = 0; i < 4; ++i)
    for (int j = i + 1; j < 6; ++j) m[i * 6 + j] = -kInf;
  const Tensor explicit_mask = from_vector(m, {4, 6});
  check_close(F::scaled_dot_product_attention(q, k, v, {}, 0.0, true),
              F::scaled_dot_product_attention(q, k, v, explicit_mask).to_vector<float>(), 1e-6);
  // Built from a 0/1 "take part" mask as the header says; the first query then sees key 0 only.
  const Tensor keep = eq(explicit_mask, 0.0);
  const Tensor additive = where(keep, scalar_tensor(0.0), scalar_tensor(-INFINITY));
  const Tensor y = F::scaled_dot_product_attention(q, k, v, additive);
  check_close(y, F::scaled_dot_product_attention(q, k, v, explicit_mask).to_vector<float>(), 0.0);
  check_close(select(select(y, 0, 0), 0, 0), select(select(v, 0, 0), 0, 0).to_vector<float>(), 1e-6);
  // Default scale is 1/sqrt(E).
  check_close(F::scaled_dot_product_attention(q, k, v),
              F::scaled_dot_product_attention(q, k, v, {}, 0.0, false, 1.0 / std::sqrt(3.0)).to_vector<float>(), 0.0);
}

TEST_CASE("attention: dropout on the weights draws from the given generator") {
  Tensor q = random_tensor({2, 4, 3}, 8), k = random_tensor({2, 5, 3}, 9), v = random_tensor({2, 5, 2}, 10);
  Generator g1(42), g2(42), g3(42);
  auto a = F::scaled_dot_product_attention_with_weights(q, k, v, {}, 0.4, false, std::nullopt, &g1);
  const Tensor b = F::scaled_dot_product_attention(q, k, v, {}, 0.4, false, std::nullopt, &g2);
  check_close(b, a.output.to_vector<float>(), 0.0);
  // The same as dropping softmax's weights by hand with the same draws.
  const Tensor w = F::dropout(softmax(div(matmul(q, k.transpose(-2, -1)), std::sqrt(3.0)), -1), 0.4, true, &g3);
  check_close(a.weights, w.to_vector<float>(), 1e-6);
  check_close(a.output, matmul(w, v).to_vector<float>(), 1e-5);
  // Some weights were dropped, the rest scaled by 1/(1-p).
  const double dropped = sum(eq(a.weights, 0.0)).item();
  CHECK(dropped > 0.0);
  CHECK(dropped < 40.0);
}

TEST_CASE("attention: scaled_dot_product_attention refuses bad input with named errors") {
  Tensor q = random_tensor({2, 4, 3}, 1), k = random_tensor({2, 5, 3}, 2), v = random_tensor({2, 5, 2}, 3);
  CHECK_THROWS_WITH_AS(F::scaled_dot_product_attention(q, k, v, zeros({4, 5}), 0.0, true),
                       doctest::Contains("mutually exclusive"), ValueError);
  CHECK_THROWS_WITH_AS(F::scaled_dot_product_attention(q, k, v, zeros({4, 5}, DType::i64)),
                       doctest::Contains("additive f32 mask"), TypeError);
  CHECK_THROWS_WITH_AS(F::scaled_dot_product_attention(q, random_tensor({2, 5, 4}, 4), v),
                       doctest::Contains("share the last dim E"), ValueError);
  CHECK_THROWS_WITH_AS(F::scaled_dot_product_attention(q, k, random_tensor({2, 6, 2}, 5)),
                       doctest::Contains("same sequence length S"), ValueError);
  CHECK_THROWS_WITH_AS(F::scaled_dot_product_attention(q, k, v, zeros({3, 5})),
                       doctest::Contains("broadcast to the scores"), ValueError);
  CHECK_THROWS_WITH_AS(F::scaled_dot_product_attention(q, k, v, {}, 1.5), doctest::Contains("dropout_p"), ValueError);
  CHECK_THROWS_WITH_AS(F::scaled_dot_product_attention(random_tensor({3}, 1), k, v),
                       doctest::Contains("at least 2 dims"), ValueError);
}

TEST_CASE("attention: MultiheadAttention parameters, initialisation and layouts") {
  manual_seed(3);
  nn::MultiheadAttention mha(16, 4);
  std::vector<std::string> names;
  for (const auto& [name, t] : mha.named_parameters()) names.push_back(name);
  CHECK(names == std::vector<std::string>{"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"});
  CHECK(mha.param("in_proj_weight").sizes() == Shape{48, 16});
  CHECK(mha.head_dim == 4);
  CHECK(max(abs(mha.param("in_proj_bias"))).item() == 0.0f);
  CHECK(max(abs(mha.out_proj->param("bias"))).item() == 0.0f);
  // xavier-uniform: U(-b, b) with b = sqrt(6 / (fan_in + fan_out)) = sqrt(6 / 64).
  const double bound = std::sqrt(6.0 / 64.0);
  const Tensor w = mha.param("in_proj_weight");
  CHECK(max(abs(w)).item() <= bound);
  CHECK(max(abs(w)).item() > 0.9 * bound);
  CHECK(std::abs(std_dev(w).item() - bound / std::sqrt(3.0)) < 0.05 * bound);
  nn::MultiheadAttention no_bias(8, 2, 0.0, false);
  CHECK(no_bias.named_parameters().size() == 2);

  // Unbatched [L, E] equals the batch of one; forward(x) is self-attention and sits in a Sequential.
  Tensor x = random_tensor({5, 1, 16}, 11);
  const auto batched = mha.forward_attention(x, x, x);
  const auto single = mha.forward_attention(x.squeeze(1), x.squeeze(1), x.squeeze(1));
  check_close(single.output, batched.output.to_vector<float>(), 1e-6);
  check_close(single.weights, batched.weights.to_vector<float>(), 1e-6);
  CHECK(single.weights.sizes() == Shape{5, 5});
  nn::Sequential seq;
  seq.push_back(std::make_shared<nn::MultiheadAttention>(16, 4));
  CHECK(seq.forward(x).sizes() == Shape{5, 1, 16});
  CHECK_FALSE(mha.forward_attention(x, x, x, {}, false).weights.defined());
  // Cross-attention with two separate key/value copies equals the fused self-attention path.
  const auto cross = mha.forward_attention(x, x.clone(), x.clone());
  check_close(cross.output, batched.output.to_vector<float>(), 1e-5);

  // A key hidden for every query of batch 1 gets no weight there.
  Tensor xs = random_tensor({4, 2, 16}, 12);
  Tensor padding = zeros({2, 4});
  padding = where(eq(arange(8, DType::f32).reshape({2, 4}), 6.0), scalar_tensor(-kInf), padding);
  const auto masked = mha.forward_attention(xs, xs, xs, padding);
  CHECK(max(abs(select(select(masked.weights, 0, 1), -1, 2))).item() == 0.0f);
}

TEST_CASE("attention: MultiheadAttention gradcheck w.r.t. inputs and parameters; dropout in training only") {
  manual_seed(4);
  nn::MultiheadAttention mha(6, 2, 0.0, true, true);
  Tensor q = random_param({2, 3, 6}, 1), k = random_param({2, 4, 6}, 2), v = random_param({2, 4, 6}, 3);
  Tensor mask = random_tensor({3, 4}, 4);
  CHECK(gradcheck([&](const std::vector<Tensor>& in) {
          auto o = mha.forward_attention(in[0], in[1], in[2], {}, true, mask);
          return add(sum(o.output), mul(sum(mul(o.weights, o.weights)), 3.0));
        }, {q, k, v}) == "");
  std::vector<Tensor> params;
  std::vector<std::string> names;
  for (const auto& [name, t] : mha.named_parameters()) {
    names.push_back(name);
    params.push_back(t.detach().clone().requires_grad_(true));
  }
  CHECK(gradcheck([&](const std::vector<Tensor>& in) {
          std::map<std::string, Tensor> tensors;
          for (size_t i = 0; i < names.size(); ++i) tensors[names[i]] = in[i];
          return nn::functional_call(mha, tensors, [&] {
            auto o = mha.forward_attention(q.detach(), k.detach(), v.detach());
            return cat({o.output.flatten(), o.weights.flatten()});
          });
        }, params) == "");

  nn::MultiheadAttention dropping(6, 2, 0.5, true, true);
  Tensor x = random_tensor({2, 3, 6}, 5);
  dropping.eval();
  check_close(dropping.forward(x), dropping.forward(x).to_vector<float>(), 0.0);
  const Tensor eval_out = dropping.forward(x);
  dropping.train();
  CHECK(max(abs(sub(dropping.forward(x), eval_out))).item() > 1e-4f);
}

TEST_CASE("attention: MultiheadAttention refuses bad configuration and input with named errors") {
  CHECK_THROWS_WITH_AS(nn::MultiheadAttention(10, 3), doctest::Contains("divisible by num_heads"), ValueError);
  CHECK_THROWS_WITH_AS(nn::MultiheadAttention(8, 0), doctest::Contains("must be positive"), ValueError);
  CHECK_THROWS_WITH_AS(nn::MultiheadAttention(8, 2, 1.0), doctest::Contains("dropout"), ValueError);
  nn::MultiheadAttention mha(8, 2);
  Tensor x = random_tensor({4, 2, 8}, 1);
  CHECK_THROWS_WITH_AS(mha.forward(random_tensor({4, 2, 6}, 2)), doctest::Contains("last dim 8"), ValueError);
  CHECK_THROWS_WITH_AS(mha.forward(random_tensor({2, 4, 2, 8}, 2)), doctest::Contains("must all be 3-D"), ValueError);
  CHECK_THROWS_WITH_AS(mha.forward_attention(x, random_tensor({5, 3, 8}, 3), random_tensor({5, 3, 8}, 4)),
                       doctest::Contains("batch size"), ValueError);
  CHECK_THROWS_WITH_AS(mha.forward_attention(x, x, x, zeros({2, 5})), doctest::Contains("key_padding_mask"),
                       ValueError);
  CHECK_THROWS_WITH_AS(mha.forward_attention(x, x, x, zeros({2, 4}, DType::i64)), doctest::Contains("additive f32"),
                       TypeError);
  CHECK_THROWS_WITH_AS(mha.forward_attention(x, x, x, {}, true, zeros({3, 4})), doctest::Contains("attn_mask must be"),
                       ValueError);
  CHECK_NOTHROW(mha.forward_attention(x, x, x, {}, true, zeros({4, 4, 4})));
}
