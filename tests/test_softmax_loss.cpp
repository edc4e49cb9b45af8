// softmax / log_softmax and the losses: forward values worked by hand (label smoothing 0.1,
// ignore_index, reductions, [C] logits), numerical stability, the large-row kernels against a double
// reference, gradient checks (non-contiguous inputs, double backward) and error messages.
#include <cmath>

#include "nn/functional.h"
#include "tests/test_support.h"

using namespace mn;
using autograd::gradcheck;
using autograd::gradgradcheck;
using mn::testing::check_close;
using mn::testing::param;
using mn::testing::random_param;
using mn::testing::tensor;
namespace F = mn::nn::functional;
using F::Reduction;

namespace {

Tensor labels(const std::vector<int64_t>& v) { return from_vector(v); }

// [[1, 2, 3], [1, 0, -1], [0.5, 0.5, 2]] with targets [2, 0, 1]
Tensor example_logits() { return tensor({1, 2, 3, 1, 0, -1, 0.5f, 0.5f, 2}, {3, 3}); }

}  // namespace

TEST_CASE("softmax: forward values and stability") {
  check_close(softmax(tensor({1, 2, 3}), 0), {0.09003057f, 0.24472847f, 0.66524096f});
  check_close(log_softmax(tensor({1, 2, 3}), 0), {-2.40760596f, -1.40760596f, -0.40760596f});
  // huge logits do not overflow
  check_close(softmax(tensor({1000, 1000}), 0), {0.5, 0.5});
  check_close(log_softmax(tensor({1000, 0}), 0), {0, -1000});
  // along dim 0 (strided slices) and on a transposed input
  Tensor x = tensor({1, 1, 2, 1, 3, 1}, {3, 2});
  check_close(softmax(x, 0), {0.09003057f, 1.0f / 3, 0.24472847f, 1.0f / 3, 0.66524096f, 1.0f / 3});
  check_close(softmax(x.t(), 1), {0.09003057f, 0.24472847f, 0.66524096f, 1.0f / 3, 1.0f / 3, 1.0f / 3});
  check_close(log_softmax(x, -2),
              {-2.40760596f, -1.09861229f, -1.40760596f, -1.09861229f, -0.40760596f, -1.09861229f});
}

TEST_CASE("softmax: large rows and columns match a double reference") {
  Generator gen(3);
  Tensor x = normal({256, 1000}, 0.0, 3.0, {}, &gen);
  std::vector<float> v = x.to_vector<float>();
  std::vector<float> rows = softmax(x, 1).to_vector<float>();
  std::vector<float> cols = log_softmax(x, 0).to_vector<float>();
  for (int r = 0; r < 256; r += 51) {
    double m = -INFINITY, s = 0;
    for (int c = 0; c < 1000; ++c) m = std::max<double>(m, v[r * 1000 + c]);
    for (int c = 0; c < 1000; ++c) s += std::exp(v[r * 1000 + c] - m);
    for (int c = 0; c < 1000; c += 111)
      CHECK(rows[r * 1000 + c] == doctest::Approx(std::exp(v[r * 1000 + c] - m) / s).epsilon(1e-5));
  }
  for (int c = 0; c < 1000; c += 199) {
    double m = -INFINITY, s = 0;
    for (int r = 0; r < 256; ++r) m = std::max<double>(m, v[r * 1000 + c]);
    for (int r = 0; r < 256; ++r) s += std::exp(v[r * 1000 + c] - m);
    for (int r = 0; r < 256; r += 17)
      CHECK(cols[r * 1000 + c] == doctest::Approx(v[r * 1000 + c] - m - std::log(s)).epsilon(1e-5));
  }
}

TEST_CASE("softmax: gradcheck and double backward") {
  Tensor x = random_param({3, 4}, 5);
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return softmax(in[0], 1); }, {x}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return softmax(in[0], 0); }, {x}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return log_softmax(in[0], 1); }, {x}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return log_softmax(in[0].t(), 1); }, {x}) == "");
  Tensor cube = random_param({2, 3, 4}, 6);
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return softmax(in[0], 1); }, {cube}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return log_softmax(in[0].slice(2, 1, 4), -1); },
                  {cube}) == "");
  CHECK(gradgradcheck([](const std::vector<Tensor>& in) { return softmax(in[0], 1); }, {x}) == "");
  CHECK(gradgradcheck([](const std::vector<Tensor>& in) { return log_softmax(in[0], 0); }, {x}) == "");
}

TEST_CASE("loss: cross entropy forward against hand-computed values") {
  Tensor logits = example_logits();
  Tensor target = labels({2, 0, 1});
  check_close(F::cross_entropy(logits, target, 0.0, Reduction::None),
              {0.40760596f, 0.40760596f, 1.86898114f});
  check_close(F::cross_entropy(logits, target), {0.89473102f});
  // label smoothing 0.1: loss = 0.9 * (lse - x_t) + 0.1 * (lse - mean(x))
  check_close(F::cross_entropy(logits, target, 0.1, Reduction::None),
              {0.50760596f, 0.50760596f, 1.81898114f});
  check_close(F::cross_entropy(logits, target, 0.1), {0.94473102f});
  check_close(F::cross_entropy(logits, target, 0.1, Reduction::Sum), {2.83419307f});
  // ignore_index: the row contributes 0 and the mean is over the 2 remaining rows
  Tensor ignored = labels({2, -100, 1});
  check_close(F::cross_entropy(logits, ignored, 0.1, Reduction::None), {0.50760596f, 0, 1.81898114f});
  check_close(F::cross_entropy(logits, ignored, 0.1), {1.16329355f});
  check_close(F::cross_entropy(logits, labels({2, 7, 1}), 0.1, Reduction::Mean, 7), {1.16329355f});
  CHECK(std::isnan(F::cross_entropy(logits, labels({-100, -100, -100})).item()));
  // [C] logits with a scalar target
  Tensor single = F::cross_entropy(tensor({1, 2, 3}), from_vector(std::vector<int64_t>{2}, Shape{}));
  CHECK(single.dim() == 0);
  check_close(single, {0.40760596f});
  // numerically stable for huge logits
  check_close(F::cross_entropy(tensor({1000, 0, -1000}, {1, 3}), labels({0})), {0});
  check_close(F::cross_entropy(tensor({1000, 0}, {1, 2}), labels({1})), {1000});
}

TEST_CASE("loss: cross entropy backward values, gradcheck and double backward") {
  Tensor logits = example_logits().requires_grad_(true);
  F::cross_entropy(logits, labels({2, 0, 1})).backward();
  // row 0: (softmax - onehot) / 3
  std::vector<float> g = logits.grad().to_vector<float>();
  CHECK(g[0] == doctest::Approx(0.09003057 / 3).epsilon(1e-5));
  CHECK(g[1] == doctest::Approx(0.24472847 / 3).epsilon(1e-5));
  CHECK(g[2] == doctest::Approx((0.66524096 - 1) / 3).epsilon(1e-5));

  Tensor x = random_param({4, 5}, 8);
  Tensor t = labels({1, 4, 0, 2});
  for (double s : {0.0, 0.1})
    for (Reduction r : {Reduction::Mean, Reduction::Sum, Reduction::None}) {
      CHECK(gradcheck([&](const std::vector<Tensor>& in) { return F::cross_entropy(in[0], t, s, r); }, {x}) ==
            "");
    }
  Tensor with_ignored = labels({1, -100, 0, 2});
  CHECK(gradcheck([&](const std::vector<Tensor>& in) { return F::cross_entropy(in[0], with_ignored, 0.1); },
                  {x}) == "");
  CHECK(gradcheck(
            [&](const std::vector<Tensor>& in) {
              return F::cross_entropy(in[0].t(), labels({0, 2, 1, 1, 0}), 0.1);
            },
            {x}) == "");
  CHECK(gradcheck(
            [&](const std::vector<Tensor>& in) { return F::cross_entropy(in[0].select(0, 1), labels({3})); },
            {x}) == "");
  CHECK(gradgradcheck(
            [&](const std::vector<Tensor>& in) { return F::cross_entropy(in[0], with_ignored, 0.1); }, {x}) ==
        "");
}

TEST_CASE("loss: fused cross entropy matches log_softmax + nll on a large batch") {
  Generator gen(9);
  Tensor x = normal({256, 1000}, 0.0, 2.0, {}, &gen);
  std::vector<int64_t> t(256);
  for (int i = 0; i < 256; ++i) t[i] = (i * 37) % 1000;
  Tensor target = labels(t);
  check_close(F::cross_entropy(x, target, 0.0, Reduction::None),
              F::nll_loss(log_softmax(x, 1), target, Reduction::None).to_vector<float>(), 1e-5);
  // gradients agree too
  Tensor a = x.detach().requires_grad_(true), b = x.detach().requires_grad_(true);
  F::cross_entropy(a, target).backward();
  F::nll_loss(log_softmax(b, 1), target).backward();
  std::vector<float> fused = a.grad().to_vector<float>(), composed = b.grad().to_vector<float>();
  double worst = 0;
  for (size_t i = 0; i < fused.size(); ++i) worst = std::max(worst, double(std::abs(fused[i] - composed[i])));
  CHECK(worst < 1e-7);
}

TEST_CASE("loss: nll_loss and mse_loss") {
  Tensor lp = log_softmax(example_logits(), 1);
  check_close(F::nll_loss(lp, labels({2, 0, 1}), Reduction::None), {0.40760596f, 0.40760596f, 1.86898114f});
  check_close(F::nll_loss(lp, labels({2, 0, 1})), {0.89473102f});
  check_close(F::nll_loss(tensor({-1, -2}), from_vector(std::vector<int64_t>{1}, Shape{})), {2});
  Tensor in = tensor({1, 2, 3, 4}, {2, 2}), target = tensor({1, 0, 5, 4}, {2, 2});
  check_close(F::mse_loss(in, target), {2});
  check_close(F::mse_loss(in, target, Reduction::Sum), {8});
  check_close(F::mse_loss(in, target, Reduction::None), {0, 4, 4, 0});
  Tensor x = random_param({3, 4}, 10), y = random_param({3, 4}, 11);
  CHECK(gradcheck([](const std::vector<Tensor>& v) { return F::mse_loss(v[0], v[1]); }, {x, y}) == "");
  CHECK(
      gradcheck([](const std::vector<Tensor>& v) { return F::mse_loss(v[0].t(), v[1].t(), Reduction::None); },
                {x, y}) == "");
  CHECK(gradcheck(
            [](const std::vector<Tensor>& v) {
              return F::nll_loss(v[0], labels({0, 3, 1}));
            },
            {x}) == "");
}

TEST_CASE("loss: bad input throws with the shapes in the message") {
  Tensor logits = zeros({4, 10});
  CHECK_THROWS_WITH_AS(
      F::cross_entropy(logits, labels({1, 2, 3})),
      doctest::Contains("expected target of shape [4] (i64 class indices) for logits of shape "
                        "[4, 10], got i64[3]"),
      ValueError);
  CHECK_THROWS_WITH_AS(F::cross_entropy(logits, zeros({4})), doctest::Contains("f32[4]"), ValueError);
  CHECK_THROWS_WITH_AS(F::cross_entropy(logits, labels({1, 2, 10, 3})), doctest::Contains("target 10"),
                       IndexError);
  CHECK_THROWS_AS(F::cross_entropy(logits, labels({1, 2, -1, 3})), IndexError);
  CHECK_THROWS_WITH_AS(F::cross_entropy(zeros({2, 3, 4}), labels({1, 2})), doctest::Contains("[2, 3, 4]"),
                       ValueError);
  CHECK_THROWS_AS(F::cross_entropy(logits, labels({1, 2, 3, 4}), 1.5), ValueError);
  CHECK_THROWS_WITH_AS(F::nll_loss(zeros({2, 3}), labels({0, 3})), doctest::Contains("target 3"), IndexError);
  CHECK_THROWS_WITH_AS(F::mse_loss(zeros({2, 3}), zeros({3, 2})), doctest::Contains("[3, 2]"), ValueError);
  CHECK_THROWS_AS(softmax(zeros({2, 3}), 2), IndexError);
  CHECK_THROWS_AS(softmax(from_vector(std::vector<int64_t>{1, 2}), 0), TypeError);
}
