// Elementwise ops: forward values by hand, gradient checks (broadcasting and non-contiguous inputs)
// and double backward of mul, tanh and gelu.
#include <limits>

#include "kernels/kernels.h"
#include "tests/test_support.h"

using namespace mn;
using autograd::gradcheck;
using autograd::gradgradcheck;
using mn::testing::check_close;
using mn::testing::param;
using mn::testing::random_param;
using mn::testing::tensor;

TEST_CASE("elementwise: binary forward with broadcasting") {
  Tensor a = tensor({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = tensor({10, 20, 30});
  check_close(a + b, {11, 22, 33, 14, 25, 36});
  check_close(a - b, {-9, -18, -27, -6, -15, -24});
  check_close(a * tensor({2}, {1}), {2, 4, 6, 8, 10, 12});
  check_close(a / tensor({2, 4}, {2, 1}), {0.5, 1, 1.5, 1, 1.25, 1.5});
  check_close(pow(tensor({2, 3}), tensor({3, 2})), {8, 9});
  check_close(maximum(tensor({1, 5}), tensor({3, 2})), {3, 5});
  check_close(minimum(tensor({1, 5}), tensor({3, 2})), {1, 2});
  check_close(a * 2.0 + 1.0, {3, 5, 7, 9, 11, 13});
  check_close(1.0 - tensor({0.25f}), {0.75});
  check_close(2.0 / tensor({4}), {0.5});
  // i64 arithmetic stays integral
  Tensor i = from_vector(std::vector<int64_t>{1, 2}) + from_vector(std::vector<int64_t>{3, 4});
  CHECK(i.to_vector<int64_t>() == std::vector<int64_t>{4, 6});
}

TEST_CASE("elementwise: unary forward") {
  Tensor x = tensor({-1, 0, 0.5f, 2});
  check_close(relu(x), {0, 0, 0.5, 2});
  check_close(abs(x), {1, 0, 0.5, 2});
  check_close(sign(x), {-1, 0, 1, 1});
  check_close(neg(x), {1, 0, -0.5, -2});
  check_close(exp(tensor({0, 1})), {1, 2.7182818f});
  check_close(log(tensor({1, 2.7182818f})), {0, 1});
  check_close(sqrt(tensor({4, 9})), {2, 3});
  check_close(rsqrt(tensor({4})), {0.5});
  check_close(tanh(tensor({0, 1})), {0, 0.76159416f});
  check_close(sigmoid(tensor({0, 2, -100})), {0.5, 0.88079708f, 0});
  check_close(gelu(tensor({0, 1, -1})), {0, 0.84134475f, -0.15865525f});
  check_close(softplus(tensor({0, 30})), {0.69314718f, 30});
  check_close(square(tensor({3})), {9});
  check_close(reciprocal(tensor({4})), {0.25});
  check_close(clamp(x, -0.5, 1.0), {-0.5, 0, 0.5, 1});
  check_close(clamp(x, std::nullopt, 0.0), {-1, 0, 0, 0});
  check_close(erf(tensor({0, 1})), {0, 0.84270079f});
  check_close(log1p(tensor({0})), {0});
  check_close(pow(tensor({2, 3}), 2.0), {4, 9});
}

TEST_CASE("elementwise: comparisons and where") {
  Tensor a = tensor({1, 2, 3});
  Tensor b = tensor({3, 2, 1});
  check_close(eq(a, b), {0, 1, 0});
  check_close(ne(a, b), {1, 0, 1});
  check_close(lt(a, b), {1, 0, 0});
  check_close(le(a, b), {1, 1, 0});
  check_close(gt(a, 1.5), {0, 1, 1});
  check_close(ge(a, 2.0), {0, 1, 1});
  check_close(where(gt(a, 1.5), a, b), {3, 2, 3});
  check_close(where(tensor({1, 0}, {2, 1}), a, tensor({0})), {1, 2, 3, 0, 0, 0});
}

// NaN follows PyTorch 1.13 (tests/parity holds the same cases computed by PyTorch): relu, clamp,
// maximum and minimum keep a NaN; relu's gradient passes where the output is NaN; clamp's gradient
// is 0 there; maximum/minimum give the whole gradient to both sides of a pair involving a NaN.
TEST_CASE("elementwise: NaN propagates through relu, clamp, maximum and minimum like PyTorch") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Tensor x = param({nan, -1, 2, 0});
  Tensor y = relu(x);
  check_close(y, {nan, 0, 2, 0});
  y.backward(tensor({1, 1, 1, 1}));  // the fused backward kernel (no graph)
  check_close(x.grad(), {1, 0, 1, 0});
  // with create_graph the backward is built from differentiable ops: the same values
  Tensor g = autograd::grad({relu(x)}, {x}, {tensor({1, 1, 1, 1})}, false, true)[0];
  check_close(g, {1, 0, 1, 0});

  x.set_grad(Tensor());
  Tensor c = clamp(x, -0.5, 1.0);
  check_close(c, {nan, -0.5, 1, 0});
  c.backward(tensor({1, 1, 1, 1}));
  check_close(x.grad(), {0, 0, 0, 1});
  CHECK(testing::contains(testing::error_message([&] { clamp(x, nan, 1.0); }), "NaN"));

  for (bool is_max : {true, false}) {
    CAPTURE(is_max);
    Tensor a = param({nan, 1, nan, 2}), b = param({1, nan, nan, 2});
    Tensor m = is_max ? maximum(a, b) : minimum(a, b);
    check_close(m, {nan, nan, nan, 2});
    m.backward(tensor({1, 1, 1, 1}));
    check_close(a.grad(), {1, 1, 1, 0.5});
    check_close(b.grad(), {1, 1, 1, 0.5});
  }
  // abs keeps NaN, sign(NaN) is 0 (as torch.sign)
  check_close(abs(tensor({nan, -2})), {nan, 2});
  check_close(sign(tensor({nan, -2})), {0, -1});
}

TEST_CASE("elementwise: an op outside the enum is an error on the CPU, not a silent value") {
  Tensor x = tensor({1, 2}), out = empty({2});
  CHECK_THROWS_AS(kernels::unary(kCPU, static_cast<kernels::UnaryOp>(200), x, out, 0, 0), RuntimeError);
  CHECK_THROWS_AS(kernels::binary(kCPU, static_cast<kernels::BinaryOp>(200), x, x, out), RuntimeError);
  // float-only ops refuse i64 with the dtype named
  Tensor i = from_vector(std::vector<int64_t>{1, 2}), io = empty({2}, TensorOptions(DType::i64));
  CHECK(testing::contains(testing::error_message([&] { kernels::unary(kCPU, kernels::UnaryOp::Exp, i, io, 0, 0); }),
                          "i64"));
  CHECK(testing::contains(
      testing::error_message([&] { kernels::binary(kCPU, kernels::BinaryOp::ReluBackward, i, i, io); }), "i64"));
}

TEST_CASE("elementwise: gradients of binary ops with broadcasting") {
  Tensor a = random_param({2, 3}, 1);
  Tensor b = random_param({3}, 2);
  Tensor pos = add(abs(random_param({2, 3}, 3)), 0.5).detach().requires_grad_(true);
  Tensor pos_b = add(abs(random_param({1, 3}, 4)), 0.5).detach().requires_grad_(true);
  CHECK(gradcheck([](const std::vector<Tensor>& v) { return add(v[0], v[1]); }, {a, b}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& v) { return sub(v[0], v[1]); }, {a, b}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& v) { return mul(v[0], v[1]); }, {a, b}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& v) { return div(v[0], v[1]); }, {a, pos_b}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& v) { return pow(v[0], v[1]); }, {pos, b}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& v) { return maximum(v[0], v[1]); }, {a, b}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& v) { return minimum(v[0], v[1]); }, {a, b}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& v) { return where(gt(v[0], 0.0), v[0], v[1]); }, {a, b}) == "");
  // Scalar variants
  CHECK(gradcheck([](const std::vector<Tensor>& v) { return (v[0] * 3.0 - 1.0) / 2.0; }, {a}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& v) { return 2.0 / v[0]; }, {pos}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& v) { return 1.0 - v[0]; }, {a}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& v) { return pow(v[0], 3.0); }, {pos}) == "");
}

TEST_CASE("elementwise: gradients of unary ops, also on non-contiguous inputs") {
  Tensor x = random_param({3, 4}, 5);
  Tensor xt = x.detach().t().contiguous().t().requires_grad_(true);  // transposed layout leaf
  REQUIRE(!xt.is_contiguous());
  Tensor pos = add(abs(random_param({3, 4}, 6)), 0.5).detach().requires_grad_(true);
  using F = Tensor (*)(const Tensor&);
  const std::vector<std::pair<const char*, F>> smooth = {
      {"neg", neg},         {"exp", exp},   {"tanh", tanh},      {"sigmoid", sigmoid},
      {"gelu", gelu},       {"sin", sin},   {"cos", cos},        {"erf", erf},
      {"softplus", softplus}, {"square", square}};
  for (auto [name, f] : smooth) {
    INFO(name);
    CHECK(gradcheck([f](const std::vector<Tensor>& v) { return f(v[0]); }, {x}) == "");
    CHECK(gradcheck([f](const std::vector<Tensor>& v) { return f(v[0].t()); }, {xt}) == "");
  }
  const std::vector<std::pair<const char*, F>> positive = {
      {"log", log}, {"sqrt", sqrt}, {"rsqrt", rsqrt}, {"reciprocal", reciprocal}, {"log1p", log1p}};
  for (auto [name, f] : positive) {
    INFO(name);
    CHECK(gradcheck([f](const std::vector<Tensor>& v) { return f(v[0]); }, {pos}) == "");
  }
  // Kinked ops away from their kinks
  Tensor away = param({-1.5f, -0.7f, 0.6f, 1.2f});
  CHECK(gradcheck([](const std::vector<Tensor>& v) { return relu(v[0]); }, {away}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& v) { return abs(v[0]); }, {away}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& v) { return clamp(v[0], -1.0, 1.0); }, {away}) == "");
}

TEST_CASE("elementwise: double backward of mul, tanh, gelu, exp, sigmoid") {
  Tensor a = random_param({2, 3}, 7);
  Tensor b = random_param({3}, 8);
  CHECK(gradgradcheck([](const std::vector<Tensor>& v) { return mul(v[0], v[1]); }, {a, b}) == "");
  CHECK(gradgradcheck([](const std::vector<Tensor>& v) { return tanh(v[0]); }, {a}) == "");
  CHECK(gradgradcheck([](const std::vector<Tensor>& v) { return gelu(v[0]); }, {a}) == "");
  CHECK(gradgradcheck([](const std::vector<Tensor>& v) { return exp(v[0]); }, {a}) == "");
  CHECK(gradgradcheck([](const std::vector<Tensor>& v) { return sigmoid(v[0]); }, {a}) == "");
  CHECK(gradgradcheck([](const std::vector<Tensor>& v) { return mul(tanh(v[0]), v[1]); }, {a, b}) == "");
  // d2/dx2 of x^3 at x = 2 is 12
  Tensor x = param({2.0f});
  Tensor y = mul(mul(x, x), x);
  Tensor g = autograd::grad({y}, {x}, {}, true, true)[0];
  check_close(g, {12});
  Tensor gg = autograd::grad({g}, {x})[0];
  check_close(gg, {12});
}
