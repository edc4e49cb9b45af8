// batch_norm (training and eval forward by hand, running statistics with momentum, gradient checks
// in both modes, double backward), dropout (statistics, scaling, seeded determinism, identity cases,
// errors) and linear (forward by hand, gradient checks, errors).
#include <cmath>

#include "nn/functional.h"
#include "tests/test_support.h"

using namespace mn;
using autograd::gradcheck;
using autograd::gradgradcheck;
using mn::testing::check_close;
using mn::testing::param;
using mn::testing::random_param;
using mn::testing::random_tensor;
using mn::testing::tensor;
namespace F = mn::nn::functional;

namespace {

// Batch norm from elementary ops (reference for the fused kernel).
Tensor reference_batch_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
  std::vector<int64_t> dims{0};
  for (int d = 2; d < x.dim(); ++d) dims.push_back(d);
  Shape channel = Shape::filled(x.dim(), 1);
  channel[1] = x.size(1);
  Tensor centered = x - mean(x, dims, true);
  Tensor normed = centered / sqrt(var(x, dims, 0.0, true) + eps);
  return normed * w.reshape(channel) + b.reshape(channel);
}

}  // namespace

TEST_CASE("batch_norm: training forward and running statistics by hand") {
  // Channel 0: 1 2 3 4 (mean 2.5, biased var 1.25); channel 1: 2 4 6 8 (mean 5, biased var 5).
  Tensor x = tensor({1, 2, 2, 4, 3, 6, 4, 8}, {4, 2});
  Tensor running_mean = zeros({2}), running_var = ones({2});
  const uint32_t version = running_mean.version();
  Tensor y = F::batch_norm(x, running_mean, running_var, tensor({2, 1}), tensor({0, 1}), true, 0.1, 0.0);
  const float a = 1.5f / std::sqrt(1.25f), c = 0.5f / std::sqrt(1.25f);
  check_close(y, {-2 * a, -a + 1, -2 * c, -c + 1, 2 * c, c + 1, 2 * a, a + 1}, 1e-5);
  // running = 0.9 running + 0.1 batch statistic, the variance unbiased (x 4/3).
  check_close(running_mean, {0.25, 0.5});
  check_close(running_var, {0.9f + 0.1f * 1.25f * 4 / 3, 0.9f + 0.1f * 5.0f * 4 / 3});
  CHECK(running_mean.version() > version);
  CHECK(running_var.version() > version);
  // Without running statistics training mode still normalises with the batch statistics.
  check_close(F::batch_norm(x, Tensor(), Tensor(), Tensor(), Tensor(), true, 0.1, 0.0), {-a, -a, -c, -c, c, c, a, a},
              1e-5);
}

TEST_CASE("batch_norm: eval forward uses the running statistics and leaves them alone") {
  Tensor x = tensor({1, 2, 3, 5}, {2, 2});
  Tensor running_mean = tensor({1, 2}), running_var = tensor({4, 9});
  Tensor y = F::batch_norm(x, running_mean, running_var, tensor({1, 2}), tensor({0, 1}), false, 0.1, 0.0);
  check_close(y, {0, 1, 1, 3});  // (x - m) / sqrt(v) * w + b
  check_close(running_mean, {1, 2});
  check_close(running_var, {4, 9});
}

TEST_CASE("batch_norm: [N, C, H, W] matches the composite formula") {
  Tensor x = random_tensor({4, 3, 5, 6}, 1);
  Tensor w = random_tensor({3}, 2), b = random_tensor({3}, 3);
  const std::vector<float> expected = reference_batch_norm(x, w, b, 1e-5).to_vector<float>();
  check_close(F::batch_norm(x, Tensor(), Tensor(), w, b, true, 0.1, 1e-5), expected, 1e-4);
  // A channels-last view gives the same result.
  Tensor nhwc = x.permute({0, 2, 3, 1}).contiguous().permute({0, 3, 1, 2});
  check_close(F::batch_norm(nhwc, Tensor(), Tensor(), w, b, true, 0.1, 1e-5), expected, 1e-4);
}

TEST_CASE("batch_norm: gradcheck in training and eval mode") {
  Tensor x = random_param({3, 2, 2, 2}, 10), w = random_param({2}, 11), b = random_param({2}, 12);
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::batch_norm(t[0], Tensor(), Tensor(), t[1], t[2], true); },
                  {x, w, b}) == "");
  Tensor rm = tensor({0.2f, -0.1f}), rv = tensor({1.5f, 0.7f});
  CHECK(gradcheck([&](const std::vector<Tensor>& t) { return F::batch_norm(t[0], rm, rv, t[1], t[2], false); },
                  {x, w, b}) == "");
  // [N, C] input, no affine parameters, non-contiguous input.
  Tensor x2 = random_param({5, 3}, 13);
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::batch_norm(t[0], Tensor(), Tensor(), Tensor(), Tensor(), true); },
                  {x2}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) {
          return F::batch_norm(t[0].t(), Tensor(), Tensor(), t[1], Tensor(), true);
        },
                  {random_param({3, 5}, 14), random_param({3}, 15)}) == "");
}

TEST_CASE("batch_norm: double backward") {
  Tensor x = random_param({3, 2, 2}, 20), w = random_param({2}, 21), b = random_param({2}, 22);
  CHECK(gradgradcheck([](const std::vector<Tensor>& t) { return F::batch_norm(t[0], Tensor(), Tensor(), t[1], t[2], true); },
                      {x, w, b}) == "");
  Tensor rm = tensor({0.2f, -0.1f}), rv = tensor({1.5f, 0.7f});
  CHECK(gradgradcheck([&](const std::vector<Tensor>& t) { return square(F::batch_norm(t[0], rm, rv, t[1], t[2], false)); },
                      {x, w, b}) == "");
}

TEST_CASE("batch_norm: errors") {
  Tensor x = zeros({4, 3});
  CHECK_THROWS_WITH_AS(F::batch_norm(x, Tensor(), Tensor(), zeros({2}), Tensor(), true), doctest::Contains("[2]"),
                       ValueError);
  CHECK_THROWS_WITH_AS(F::batch_norm(zeros({1, 3}), Tensor(), Tensor(), Tensor(), Tensor(), true),
                       doctest::Contains("more than 1 value per channel"), ValueError);
  CHECK_THROWS_WITH_AS(F::batch_norm(x, Tensor(), Tensor(), Tensor(), Tensor(), false),
                       doctest::Contains("evaluation mode"), ValueError);
  CHECK_THROWS_WITH_AS(F::batch_norm(zeros({4}), Tensor(), Tensor(), Tensor(), Tensor(), true),
                       doctest::Contains("[4]"), ValueError);
}

TEST_CASE("dropout: statistics and scaling") {
  const int64_t n = 200000;
  Generator gen(123);
  Tensor y = F::dropout(ones({n}), 0.3, true, &gen);
  std::vector<float> v = y.to_vector<float>();
  int64_t zeros_seen = 0, wrong_scale = 0;
  for (float value : v) {
    if (value == 0.0f) ++zeros_seen;
    else if (std::abs(value - 1.0 / 0.7) > 1e-6) ++wrong_scale;
  }
  CHECK(wrong_scale == 0);
  const double dropped = static_cast<double>(zeros_seen) / n;
  CHECK(dropped == doctest::Approx(0.3).epsilon(0.02));
  CHECK(mean(y).item() == doctest::Approx(1.0).epsilon(0.02));
}

TEST_CASE("dropout: a seeded generator reproduces the mask") {
  Tensor x = random_tensor({64}, 5);
  Generator a(7), b(7), c(8);
  Tensor ya = F::dropout(x, 0.5, true, &a), yb = F::dropout(x, 0.5, true, &b), yc = F::dropout(x, 0.5, true, &c);
  CHECK(ya.to_vector<float>() == yb.to_vector<float>());
  CHECK(ya.to_vector<float>() != yc.to_vector<float>());
  // The generator advances: the next mask differs from the first.
  CHECK(F::dropout(x, 0.5, true, &a).to_vector<float>() != ya.to_vector<float>());
}

TEST_CASE("dropout: identity cases, p = 1 and errors") {
  Tensor x = random_param({4, 3}, 6);
  CHECK(F::dropout(x, 0.0, true).same(x));
  CHECK(F::dropout(x, 0.7, false).same(x));
  Tensor all = F::dropout(x, 1.0, true);
  check_close(all, std::vector<float>(12, 0.0f));
  sum(all).backward();
  check_close(x.grad(), std::vector<float>(12, 0.0f));
  CHECK_THROWS_WITH_AS(F::dropout(x, 1.5), doctest::Contains("1.5"), ValueError);
  CHECK_THROWS_WITH_AS(F::dropout(x, -0.1), doctest::Contains("-0.1"), ValueError);
}

TEST_CASE("dropout: gradient is the scaled mask") {
  Tensor x = random_param({3, 4}, 30);
  auto fn = [](const std::vector<Tensor>& t) {
    Generator gen(99);  // the same mask on every evaluation
    return F::dropout(t[0], 0.4, true, &gen);
  };
  CHECK(gradcheck(fn, {x}) == "");
  CHECK(gradgradcheck([&](const std::vector<Tensor>& t) { return square(fn(t)); }, {x}) == "");
}

TEST_CASE("linear: forward by hand") {
  Tensor x = tensor({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor w = tensor({1, 0, -1, 2, 1, 0}, {2, 3});
  check_close(F::linear(x, w, tensor({10, 20})), {8, 24, 8, 33});
  check_close(F::linear(x, w), {-2, 4, -2, 13});
  Tensor y = F::linear(tensor({1, 2, 3}), w);  // 1-D input
  CHECK(y.sizes() == Shape{2});
  check_close(y, {-2, 4});
}

TEST_CASE("linear: gradcheck and double backward") {
  Tensor x = random_param({4, 3}, 40), w = random_param({2, 3}, 41), b = random_param({2}, 42);
  auto fn = [](const std::vector<Tensor>& t) { return F::linear(t[0], t[1], t[2]); };
  CHECK(gradcheck(fn, {x, w, b}) == "");
  CHECK(gradcheck(fn, {random_param({2, 3, 3}, 43), w, b}) == "");
  // A transposed (non-contiguous) input.
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::linear(t[0].t(), t[1]); },
                  {random_param({3, 4}, 44), random_param({2, 3}, 45)}) == "");
  CHECK(gradgradcheck([](const std::vector<Tensor>& t) { return tanh(F::linear(t[0], t[1], t[2])); }, {x, w, b}) == "");
  // The weight gradient arrives in the weight's own (contiguous) layout.
  sum(F::linear(x, w, b)).backward();
  CHECK(w.grad().is_contiguous());
}

TEST_CASE("linear: errors name the shapes") {
  CHECK_THROWS_WITH_AS(F::linear(zeros({4, 3}), zeros({2, 5})), doctest::Contains("[4, 3]"), ValueError);
  CHECK_THROWS_WITH_AS(F::linear(zeros({4, 3}), zeros({2, 3}), zeros({3})), doctest::Contains("[3]"), ValueError);
  CHECK_THROWS_WITH_AS(F::linear(zeros({4, 3}), zeros({3})), doctest::Contains("[3]"), ValueError);
}
