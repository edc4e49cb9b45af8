// The losses of issue 18: class weights for cross_entropy and nll_loss (with label smoothing and
// ignore_index), binary_cross_entropy_with_logits, l1_loss, smooth_l1_loss and kl_div. PyTorch 1.13
// values and gradients (tests/data/parity_losses_ext.safetensors, make_parity.py losses_ext) for every
// reduction, gradient checks (double backward where the op is fused), the gradients at the kinks and
// the error messages.
#include <cmath>

#include "nn/functional.h"
#include "nn/safetensors.h"
#include "tests/test_support.h"

using namespace mn;
using autograd::gradcheck;
using autograd::gradgradcheck;
using mn::testing::contains;
using mn::testing::error_message;
using mn::testing::random_param;
using mn::testing::random_tensor;
using mn::testing::tensor;
namespace F = mn::nn::functional;
using F::Reduction;

namespace {

safetensors::File golden() {
  return safetensors::load(std::string(MN_TEST_DATA_DIR) + "/parity_losses_ext.safetensors");
}

const std::pair<const char*, Reduction> kReductions[] = {
    {"none", Reduction::None}, {"mean", Reduction::Mean}, {"sum", Reduction::Sum}};

// Runs loss(x) on a copy of f[input], backpropagates sum(w * y) with PyTorch's w, and compares the
// value and the input's gradient with f[<tag>_y] and f[<tag>_g].
// zero_grad_at: elements whose expected gradient is 0 rather than PyTorch's (see the smooth L1 case).
template <class Loss>
void check_case(const safetensors::File& f, const std::string& input, const std::string& tag, Loss loss,
                const std::vector<size_t>& zero_grad_at = {}) {
  INFO(tag);
  Tensor x = f.at(input).clone().requires_grad_(true);
  Tensor y = loss(x);
  sum(mul(y, f.at(tag + "_weight").reshape(y.sizes()))).backward();
  mn::testing::check_close(y.reshape({y.numel()}), f.at(tag + "_y").to_vector<float>(), 2e-5);
  std::vector<float> expected = f.at(tag + "_g").to_vector<float>();
  for (size_t i : zero_grad_at) expected[i] = 0.0f;
  mn::testing::check_close(x.grad(), expected, 2e-5);
}

Tensor labels(const std::vector<int64_t>& v) { return from_vector(v); }

}  // namespace

TEST_CASE("losses ext: class-weighted cross_entropy and nll_loss match PyTorch") {
  const auto f = golden();
  const Tensor target = f.at("ce_target"), weight = f.at("ce_weight");
  for (const auto& [name, r] : kReductions) {
    for (double s : {0.0, 0.2}) {
      const std::string tag = std::string("ce_s") + (s == 0.0 ? "0" : "2") + "_" + name;
      check_case(f, "ce_logits", tag, [&](const Tensor& x) { return F::cross_entropy(x, target, s, r, -100, weight); });
    }
    for (const bool weighted : {true, false}) {
      const std::string tag = std::string("nll_") + (weighted ? "w_" : "nw_") + name;
      check_case(f, "nll_input", tag, [&](const Tensor& x) {
        return F::nll_loss(x, target, r, -100, weighted ? weight : Tensor());
      });
    }
  }
  // ignore_index inside [0, C) with weights and smoothing
  Tensor x = f.at("ce_logits").clone().requires_grad_(true);
  Tensor clamped = labels({0, 4, 0, 2, 1, 3, 2});
  Tensor y = F::cross_entropy(x, clamped, 0.1, Reduction::Mean, 2, weight);
  y.backward();
  mn::testing::check_close(y, f.at("ce_ign2_y").to_vector<float>(), 2e-5);
  mn::testing::check_close(x.grad(), f.at("ce_ign2_g").to_vector<float>(), 2e-5);
}

TEST_CASE("losses ext: binary_cross_entropy_with_logits, l1, smooth l1 and kl_div match PyTorch") {
  const auto f = golden();
  const Tensor b = f.at("pw_b"), l1_b = f.at("l1_b"), bw = f.at("bce_weight"), pw = f.at("bce_pos_weight");
  for (const auto& [name, r] : kReductions) {
    const std::string n = name;
    check_case(f, "pw_a", "bce_" + n, [&](const Tensor& x) { return F::binary_cross_entropy_with_logits(x, b, {}, {}, r); });
    check_case(f, "pw_a", "bce_w_" + n,
               [&](const Tensor& x) { return F::binary_cross_entropy_with_logits(x, b, bw, pw, r); });
    // l1_b holds exact ties (gradient 0) and |x - y| == 1 (smooth L1's kink for beta 1)
    check_case(f, "pw_a", "l1_" + n, [&](const Tensor& x) { return F::l1_loss(x, l1_b, r); });
    check_case(f, "pw_a", "sl1_" + n, [&](const Tensor& x) { return F::smooth_l1_loss(x, l1_b, r); });
    check_case(f, "pw_a", "sl1_b05_" + n, [&](const Tensor& x) { return F::smooth_l1_loss(x, l1_b, r, 0.5); });
    // beta 0 is l1_loss, its gradient at a tie (element 0) included: 0. PyTorch 1.13 computes the
    // value with l1 but differentiates with smooth L1's backward, which gives -1 there.
    check_case(f, "pw_a", "sl1_b0_" + n, [&](const Tensor& x) { return F::smooth_l1_loss(x, l1_b, r, 0.0); }, {0});
  }
  const Tensor log_b = log(add(b, 1e-3));
  for (const auto& [name, r] : {std::pair<const char*, Reduction>{"none", Reduction::None}, {"mean", Reduction::Mean},
                                {"sum", Reduction::Sum}, {"batchmean", Reduction::BatchMean}}) {
    const std::string n = name;
    check_case(f, "kl_input", "kl_prob_" + n, [&](const Tensor& x) { return F::kl_div(x, b, r); });
    check_case(f, "kl_input", "kl_log_" + n, [&](const Tensor& x) { return F::kl_div(x, log_b, r, true); });
  }
}

TEST_CASE("losses ext: weighted mean divides by the counted weights; nothing counted is NaN") {
  Tensor x = tensor({1, 2, 3, 0, 0, 0}, {2, 3});
  Tensor w = tensor({1, 2, 4});
  // rows: -log p(2) * 4 and -log p(0) * 1, divided by 4 + 1
  const double lse0 = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0)), lse1 = std::log(3.0);
  const double expected = ((lse0 - 3) * 4 + lse1 * 1) / 5;
  CHECK(F::cross_entropy(x, labels({2, 0}), 0.0, Reduction::Mean, -100, w).item() ==
        doctest::Approx(expected).epsilon(1e-6));
  Tensor lp = log_softmax(x, 1);
  CHECK(F::nll_loss(lp, labels({2, 0}), Reduction::Mean, -100, w).item() == doctest::Approx(expected).epsilon(1e-6));
  CHECK(std::isnan(F::cross_entropy(x, labels({-100, -100}), 0.1, Reduction::Mean, -100, w).item()));
  CHECK(std::isnan(F::nll_loss(lp, labels({-100, -100}), Reduction::Mean, -100, w).item()));
  CHECK(std::isnan(F::nll_loss(lp, labels({-100, -100})).item()));
  CHECK(F::nll_loss(lp, labels({-100, -100}), Reduction::Sum).item() == 0.0);
  // a -inf log-probability outside the picked class neither poisons the loss nor its gradient
  Tensor with_inf = tensor({-INFINITY, -1.0f, -0.5f, -INFINITY, -2.0f, -0.1f}, {2, 3}).requires_grad_(true);
  Tensor loss = F::nll_loss(with_inf, labels({2, -100}), Reduction::Sum, -100, w);
  CHECK(loss.item() == doctest::Approx(2.0));
  loss.backward();
  mn::testing::check_close(with_inf.grad(), {0, 0, -4, 0, 0, 0});
}

TEST_CASE("losses ext: gradchecks for every reduction, double backward of the weighted fused cross entropy") {
  Tensor x = random_param({5, 4}, 31);
  Tensor t = labels({1, 3, -100, 0, 2});
  Tensor in_range = labels({1, 3, 3, 0, 2});  // ignore_index 3 inside [0, C)
  Tensor w = add(abs(random_tensor({4}, 32)), 0.5);
  for (const auto& [name, r] : kReductions) {
    CAPTURE(name);
    for (double s : {0.0, 0.3}) {
      CHECK(gradcheck([&](const std::vector<Tensor>& in) { return F::cross_entropy(in[0], t, s, r, -100, w); }, {x}) ==
            "");
      CHECK(gradgradcheck([&](const std::vector<Tensor>& in) { return F::cross_entropy(in[0], t, s, r, -100, w); },
                          {x}) == "");
    }
    CHECK(gradcheck([&](const std::vector<Tensor>& in) { return F::nll_loss(in[0], t, r, -100, w); }, {x}) == "");
    CHECK(gradgradcheck([&](const std::vector<Tensor>& in) { return F::nll_loss(in[0], in_range, r, 3); }, {x}) == "");
  }
  // [C] input with weights, on a transposed (non-contiguous) view
  CHECK(gradcheck([&](const std::vector<Tensor>& in) { return F::cross_entropy(in[0].select(0, 1), labels({2}), 0.1,
                                                                               Reduction::Mean, -100, w); },
                  {x}) == "");
  CHECK(gradcheck([&](const std::vector<Tensor>& in) {
          return F::cross_entropy(in[0].t(), labels({0, 2, 1, 4}), 0.1, Reduction::Mean, -100,
                                  tensor({1, 2, 3, 4, 5}));
        }, {x}) == "");

  // elementwise losses: away from the kinks (the finite differences straddle them otherwise)
  Tensor a = random_param({3, 4}, 33, 2.0);
  Tensor b = add(random_tensor({3, 4}, 34), 3.0).requires_grad_(true);  // |a - b| > 0 mostly far
  Tensor prob = softmax(random_tensor({3, 4}, 35), 1).requires_grad_(true);
  Tensor bw = add(abs(random_tensor({4}, 36)), 0.5), pw = add(abs(random_tensor({4}, 37)), 0.5).requires_grad_(true);
  Tensor logp = log_softmax(random_tensor({3, 4}, 38), 1).requires_grad_(true);
  Tensor log_target = log_softmax(random_tensor({3, 4}, 39), 1).requires_grad_(true);
  for (const auto& [name, r] : kReductions) {
    CAPTURE(name);
    CHECK(gradcheck([&](const std::vector<Tensor>& in) {
            return F::binary_cross_entropy_with_logits(in[0], in[1], bw, in[2], r);
          }, {a, prob, pw}) == "");
    CHECK(gradcheck([&](const std::vector<Tensor>& in) { return F::l1_loss(in[0], in[1], r); }, {a, b}) == "");
    CHECK(gradcheck([&](const std::vector<Tensor>& in) { return F::smooth_l1_loss(in[0], in[1], r, 1.0); }, {a, b}) ==
          "");
    CHECK(gradcheck([&](const std::vector<Tensor>& in) { return F::smooth_l1_loss(in[0], in[1], r, 10.0); }, {a, b}) ==
          "");
    CHECK(gradcheck([&](const std::vector<Tensor>& in) { return F::kl_div(in[0], in[1], r); }, {logp, prob}) == "");
    CHECK(gradcheck([&](const std::vector<Tensor>& in) { return F::kl_div(in[0], in[1], r, true); }, {logp, log_target}) ==
          "");
  }
  CHECK(gradcheck([&](const std::vector<Tensor>& in) { return F::kl_div(in[0], in[1], Reduction::BatchMean); },
                  {logp, prob}) == "");
  CHECK(gradgradcheck([&](const std::vector<Tensor>& in) { return F::binary_cross_entropy_with_logits(in[0], in[1]); },
                      {a, prob}) == "");
}

TEST_CASE("losses ext: gradients at the kinks and extreme logits follow PyTorch") {
  // l1 and smooth l1 at d == 0 give 0; smooth l1 at |d| == beta gives sign(d); beta 0 is l1.
  Tensor x = tensor({0, 1, -1, 2, -0.5f}).requires_grad_(true);
  F::l1_loss(x, zeros({5}), Reduction::Sum).backward();
  mn::testing::check_close(x.grad(), {0, 1, -1, 1, -1});
  x.set_grad(Tensor());
  F::smooth_l1_loss(x, zeros({5}), Reduction::Sum).backward();
  mn::testing::check_close(x.grad(), {0, 1, -1, 1, -0.5f});
  x.set_grad(Tensor());
  Tensor sl0 = F::smooth_l1_loss(x, zeros({5}), Reduction::None, 0.0);
  mn::testing::check_close(sl0, {0, 1, 1, 2, 0.5f});
  // BCE with logits: d/dx at 0 is sigmoid(0) - y; huge logits stay finite
  Tensor z = tensor({0, 100, -100}).requires_grad_(true);
  Tensor t = tensor({1, 0, 1});
  Tensor l = F::binary_cross_entropy_with_logits(z, t, {}, {}, Reduction::None);
  mn::testing::check_close(l, {std::log(2.0f), 100, 100});
  sum(l).backward();
  mn::testing::check_close(z.grad(), {-0.5f, 1, -1});
  // kl_div: 0 where target == 0, and there the t log t term adds nothing to the target's gradient
  // (-x remains; PyTorch's xlogy gives NaN); a NaN target gives NaN; 0 * -inf input is NaN as in PyTorch.
  Tensor p = tensor({0, 0.5f}).requires_grad_(true);
  Tensor kl = F::kl_div(tensor({-2, -1}), p, Reduction::None);
  mn::testing::check_close(kl, {0, 0.5f * (std::log(0.5f) + 1)});
  sum(kl).backward();
  mn::testing::check_close(p.grad(), {2, std::log(0.5f) + 1 + 1});
  const std::vector<float> odd = F::kl_div(tensor({-1, -INFINITY}), tensor({NAN, 0}), Reduction::None).to_vector<float>();
  CHECK((std::isnan(odd[0]) && std::isnan(odd[1])));
}

TEST_CASE("losses ext: bad shapes, dtypes and options are errors naming what was expected") {
  Tensor x = random_tensor({3, 4}, 40);
  Tensor t = labels({0, 1, 2});
  CHECK(contains(error_message([&] { F::cross_entropy(x, t, 0.0, Reduction::Mean, -100, zeros({3})); }),
                 "cross_entropy: expected weight of shape [4] (f32, one per class of input [3, 4]), got f32[3]"));
  CHECK(contains(error_message([&] { F::nll_loss(x, t, Reduction::Mean, -100, zeros({4}, DType::i64)); }),
                 "nll_loss: expected weight of shape [4]"));
  CHECK_THROWS_AS(F::nll_loss(x, labels({0, 1, 4})), IndexError);
  CHECK(contains(error_message([&] { F::nll_loss(x, labels({0, -1, 2})); }), "target -1 at position 1 is out of range"));
  CHECK(contains(error_message([&] { F::cross_entropy(x, t, 0.0, Reduction::Mean, -100, ones({4}).requires_grad_(true)); }),
                 "weight requires grad"));
  CHECK(contains(error_message([&] { F::cross_entropy(x, t, 0.0, Reduction::BatchMean); }), "kl_div's alone"));
  CHECK(contains(error_message([&] { F::l1_loss(x, x, Reduction::BatchMean); }), "l1_loss: reduction BatchMean"));
  CHECK(contains(error_message([&] { F::l1_loss(x, zeros({4, 3})); }),
                 "l1_loss: expected target of the input's shape [3, 4], got [4, 3]"));
  CHECK(contains(error_message([&] { F::kl_div(x, zeros({3, 4}, DType::i64)); }), "kl_div: expected 'target' of a floating-point dtype"));
  CHECK(contains(error_message([&] { F::smooth_l1_loss(x, x, Reduction::Mean, -1.0); }),
                 "smooth_l1_loss: beta must be non-negative, got -1"));
  CHECK(contains(error_message([&] { F::binary_cross_entropy_with_logits(x, x, zeros({3})); }),
                 "expected weight to broadcast to the input's shape [3, 4], got shape [3]"));
  CHECK(contains(error_message([&] { F::binary_cross_entropy_with_logits(x, x, {}, zeros({2, 3, 4})); }),
                 "expected pos_weight to broadcast"));
}
