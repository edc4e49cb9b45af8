// Reductions: forward values by hand (all dims, chosen dims, keepdim, strided inputs, i64), the three
// kernel layouts against a naive double reference with thread-count independence, gradient checks
// (keepdim, several dims, transposed and sliced inputs), double backward, and error messages.
#include <omp.h>

#include <cmath>
#include <limits>

#include "tests/test_support.h"

using namespace mn;
using autograd::gradcheck;
using autograd::gradgradcheck;
using mn::testing::check_close;
using mn::testing::param;
using mn::testing::random_param;
using mn::testing::tensor;

namespace {

// 2x3: [[1, 2, 3], [4, 5, 6]]
Tensor two_by_three() { return tensor({1, 2, 3, 4, 5, 6}, {2, 3}); }

// Values away from zero and from each other, so max/min/prod/abs have no kinks nearby.
Tensor spread_param(const Shape& shape, uint64_t seed) {
  Generator gen(seed);
  const int64_t n = shape.numel();
  std::vector<float> values(static_cast<size_t>(n));
  Tensor noise = uniform({n}, -0.1, 0.1, {}, &gen);
  std::vector<float> jitter = noise.to_vector<float>();
  for (int64_t i = 0; i < n; ++i) {
    // A permutation of 0.5, 0.8, 1.1, ... with alternating signs.
    const int64_t k = (i * 7 + 3) % n;
    values[i] =
        static_cast<float>((k % 2 ? -1.0 : 1.0) * (0.5 + 0.3 * static_cast<double>(k)) + jitter[i] * 0.1);
  }
  return from_vector(values, shape).requires_grad_(true);
}

// Naive double reference of a sum over `mask` for a contiguous tensor, in keepdim order.
std::vector<double> naive_sum(const std::vector<float>& x, const Shape& shape, uint32_t mask) {
  Shape out_shape = shape;
  for (int d = 0; d < shape.size(); ++d)
    if (mask & (1u << d)) out_shape[d] = 1;
  std::vector<double> out(static_cast<size_t>(out_shape.numel()), 0.0);
  const Shape out_strides = contiguous_strides(out_shape);
  std::vector<int64_t> idx(shape.size(), 0);
  for (size_t flat = 0; flat < x.size(); ++flat) {
    int64_t rem = static_cast<int64_t>(flat), pos = 0;
    for (int d = shape.size() - 1; d >= 0; --d) {
      const int64_t i = rem % shape[d];
      rem /= shape[d];
      if (!(mask & (1u << d))) pos += i * out_strides[d];
    }
    out[pos] += x[flat];
  }
  return out;
}

void check_matches(const Tensor& got, const std::vector<double>& expected, double rel) {
  std::vector<float> values = got.to_vector<float>();
  REQUIRE(values.size() == expected.size());
  for (size_t i = 0; i < values.size(); ++i) {
    INFO("element " << i << ": got " << values[i] << ", expected " << expected[i]);
    CHECK(std::abs(values[i] - expected[i]) <= rel * (1.0 + std::abs(expected[i])));
  }
}

// Runs f once with one thread and once with all threads and requires bit-identical results.
template <class F>
void check_thread_independent(F f) {
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  std::vector<float> one = f().template to_vector<float>();
  omp_set_num_threads(std::max(threads, 2));
  std::vector<float> many = f().template to_vector<float>();
  omp_set_num_threads(threads);
  CHECK(one == many);
}

}  // namespace

TEST_CASE("reduce: sum and mean forward") {
  Tensor x = two_by_three();
  check_close(sum(x), {21});
  CHECK(sum(x).dim() == 0);
  check_close(sum(x, {0}), {5, 7, 9});
  check_close(sum(x, {1}), {6, 15});
  check_close(sum(x, {-1}, true), {6, 15});
  CHECK(sum(x, {-1}, true).sizes() == Shape{2, 1});
  CHECK(sum(x, {0, 1}, true).sizes() == Shape{1, 1});
  check_close(mean(x), {3.5});
  check_close(mean(x, {0}), {2.5, 3.5, 4.5});
  check_close(mean(x, {1}, true), {2, 5});
  // transposed (non-contiguous) input
  check_close(sum(x.t(), {0}), {6, 15});
  check_close(sum(x.t(), {1}), {5, 7, 9});
  // several dims of a 3-D tensor, including a middle one
  Tensor y = arange(0.0, 24.0, 1.0, DType::f32).reshape({2, 3, 4});
  check_close(sum(y, {0, 2}), {60, 92, 124});
  check_close(sum(y, {1}), {12, 15, 18, 21, 48, 51, 54, 57});
  check_close(mean(y, {0, 2}, true), {7.5, 11.5, 15.5});
  // i64 sums stay exact integers
  Tensor i = from_vector(std::vector<int64_t>{1, 2, 3, 4}, {2, 2});
  CHECK(sum(i).dtype() == DType::i64);
  CHECK(sum(i, {0}).to_vector<int64_t>() == std::vector<int64_t>{4, 6});
  // empty reductions: sum 0, mean NaN
  Tensor e = zeros({0, 3});
  check_close(sum(e, {0}), {0, 0, 0});
  CHECK(std::isnan(mean(e).item()));
}

TEST_CASE("reduce: prod, max, min, argmax") {
  Tensor x = two_by_three();
  check_close(prod(x, {1}), {6, 120});
  check_close(prod(x, {0}, true), {4, 10, 18});
  check_close(max(x), {6});
  check_close(min(x), {1});
  auto [values, indices] = max(tensor({1, 7, 3, 7, 2, 0}, {2, 3}), 1);
  check_close(values, {7, 7});
  CHECK(indices.to_vector<int64_t>() == std::vector<int64_t>{1, 0});
  auto [mv, mi] = min(x, 0, true);
  CHECK(mv.sizes() == Shape{1, 3});
  check_close(mv, {1, 2, 3});
  CHECK(mi.to_vector<int64_t>() == std::vector<int64_t>{0, 0, 0});
  // ties: the first occurrence wins
  Tensor ties = tensor({2, 5, 5, 1, 1, 0});
  CHECK(argmax(ties, 0).item() == 1);
  CHECK(argmin(ties, 0).item() == 5);
  CHECK(argmin(tensor({3, 1, 1}), 0).item() == 1);
  // over dim 0 (strided path) and keepdim
  Tensor a = argmax(tensor({1, 9, 3, 4, 2, 8}, {2, 3}), 0, true);
  CHECK(a.sizes() == Shape{1, 3});
  CHECK(a.to_vector<int64_t>() == std::vector<int64_t>{1, 0, 1});
  // NaN wins and the first NaN is reported
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Tensor with_nan = tensor({1, nan, 9, nan});
  CHECK(argmax(with_nan, 0).item() == 1);
  CHECK(argmin(with_nan, 0).item() == 1);
  CHECK(std::isnan(max(with_nan).item()));
  CHECK(std::isnan(min(with_nan).item()));
  // i64
  Tensor i = from_vector(std::vector<int64_t>{4, -2, 9});
  CHECK(max(i).to_vector<int64_t>() == std::vector<int64_t>{9});
  CHECK(min(i).to_vector<int64_t>() == std::vector<int64_t>{-2});
  CHECK(argmax(i, 0).item() == 2);
}

TEST_CASE("reduce: NaN wins max/min over all elements and over a dim, forward and backward, like PyTorch") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (bool is_max : {true, false}) {
    CAPTURE(is_max);
    // All elements: the gradient is shared by the NaN elements (torch's evenly_distribute_backward),
    // not spread as NaN over everything.
    Tensor x = param({1, nan, 3, nan});
    Tensor m = is_max ? max(x) : min(x);
    check_close(m, {nan});
    m.backward();
    check_close(x.grad(), {0, 0.5, 0, 0.5});
    // Over a dim: the value is NaN, the index the first NaN, and the gradient goes there.
    Tensor y = param({1, nan, 3, 4, 5, 6, nan, nan, 0}, {3, 3});
    auto [values, indices] = is_max ? max(y, 1) : min(y, 1);
    check_close(values, {nan, is_max ? 6.0f : 4.0f, nan});
    CHECK(indices.to_vector<int64_t>() == std::vector<int64_t>{1, is_max ? 2 : 0, 0});
    sum(values).backward();
    check_close(y.grad(), is_max ? std::vector<float>{0, 1, 0, 0, 0, 1, 1, 0, 0}
                                 : std::vector<float>{0, 1, 0, 1, 0, 0, 1, 0, 0});
    // over dim 0 (the strided kernel path)
    auto [v0, i0] = is_max ? max(y.detach(), 0) : min(y.detach(), 0);
    check_close(v0, {nan, nan, is_max ? 6.0f : 0.0f});
    CHECK(i0.to_vector<int64_t>() == std::vector<int64_t>{2, 0, is_max ? 1 : 2});
  }
}

TEST_CASE("reduce: var and std against hand values") {
  Tensor x = tensor({1, 2, 3, 4});
  // mean 2.5, sum of squared deviations 5
  check_close(var(x, {}, 0.0), {1.25});
  check_close(var(x), {5.0 / 3.0});
  check_close(std_dev(x), {std::sqrt(5.0 / 3.0)});
  Tensor m = two_by_three();
  check_close(var(m, {1}, 1.0), {1, 1});
  check_close(var(m, {0}, 0.0), {2.25, 2.25, 2.25});
  check_close(var(m, {0}, 1.0, true), {4.5, 4.5, 4.5});
  CHECK(var(m, {0}, 1.0, true).sizes() == Shape{1, 3});
  check_close(std_dev(m, {0, 1}, 0.0), {std::sqrt(35.0 / 12.0)});
  check_close(var(m.t(), {1}, 0.0), {2.25, 2.25, 2.25});
  // A large offset does not destroy the variance (two-pass, double accumulation).
  check_close(var(tensor({10000.0f, 10001.0f, 10002.0f}), {}, 0.0), {2.0 / 3.0}, 1e-4);
  // one element, unbiased: 0 / 0
  CHECK(std::isnan(var(tensor({3})).item()));
}

// The PyTorch spellings torch.var(x, 1) / torch.std(x, 1): a bare integer or a braced single dim is a
// dim, never the correction (which used to win the overload and give the all-element variance).
template <class A>
concept VarAccepts = requires(const Tensor& x, A a) { var(x, a); };
template <class A>
concept MaxAccepts = requires(const Tensor& x, A a) { max(x, a); };
static_assert(VarAccepts<int> && VarAccepts<int64_t> && VarAccepts<std::vector<int64_t>>);
static_assert(!VarAccepts<double> && !VarAccepts<float> && !VarAccepts<bool>);
static_assert(MaxAccepts<int> && !MaxAccepts<double> && !MaxAccepts<bool>);

TEST_CASE("reduce: a single dim is a dim in every reduction overload set") {
  Tensor m = two_by_three();  // rows {1, 2, 3} and {4, 5, 6}
  check_close(var(m, 1), {1, 1});
  check_close(var(m, {1}), {1, 1});
  check_close(var(m, -1, 0.0, true), {2.0 / 3.0, 2.0 / 3.0});
  CHECK(var(m, 1, 0.0, true).sizes() == Shape{2, 1});
  check_close(std_dev(m, 0), {std::sqrt(4.5), std::sqrt(4.5), std::sqrt(4.5)});
  check_close(std_dev(m, {0}), {std::sqrt(4.5), std::sqrt(4.5), std::sqrt(4.5)});
  check_close(var(m, int64_t{0}, 0.0), {2.25, 2.25, 2.25});
  check_close(sum(m, 1), {6, 15});
  check_close(mean(m, 0, true), {2.5, 3.5, 4.5});
  check_close(prod(m, 1), {6, 120});
  check_close(var(m, {}, 0.0), {35.0 / 12.0});
  check_close(var(m), {3.5});
}

TEST_CASE("reduce: norm, logsumexp and sum_to") {
  Tensor x = tensor({3, -4, 0, 1}, {2, 2});
  check_close(norm(x), {std::sqrt(26.0)});
  check_close(norm(x, 1.0), {8});
  check_close(norm(x, INFINITY), {4});
  check_close(norm(x, 0.0), {3});
  check_close(norm(x, 3.0), {std::cbrt(27.0 + 64.0 + 1.0)});
  check_close(norm(x, 2.0, {1}), {5, 1});
  check_close(norm(x, 2.0, {0}, true), {3, std::sqrt(17.0)});
  check_close(logsumexp(tensor({1, 2, 3}), 0), {3.4076059644});
  check_close(logsumexp(tensor({1000, 1000}), 0), {1000.6931472});
  check_close(logsumexp(tensor({1, 2, 3, 1000, 1000, -INFINITY}, {2, 3}), 1, true),
              {3.4076059644, 1000.6931472});
  CHECK(logsumexp(tensor({-INFINITY, -INFINITY}), 0).item() == -INFINITY);
  Tensor big = arange(0.0, 24.0, 1.0, DType::f32).reshape({2, 3, 4});
  check_close(sum_to(big, {3, 1}), {60, 92, 124});
  check_close(sum_to(big, {4}), {60, 66, 72, 78});
  check_close(sum_to(big, {1, 1, 1}), {276});
  CHECK(sum_to(big, {2, 3, 4}).same(big));
  check_close(sum_to(tensor({1, 2}, {1, 2}), {2}), {1, 2});
}

TEST_CASE("reduce: kernel layouts match a naive reference for large inputs") {
  Generator gen(7);
  // Long single row: chunked partials.
  Tensor flat = normal({1 << 20}, 1.0, 2.0, {}, &gen);
  check_matches(sum(flat), naive_sum(flat.to_vector<float>(), flat.sizes(), 1u), 1e-6);
  check_thread_independent([&] { return sum(flat); });
  check_thread_independent([&] { return norm(flat); });
  check_thread_independent([&] { return var(flat); });
  // Column reduction, tall and narrow (row blocks) and wide (column tiles).
  Tensor tall = normal({20000, 3}, 0.0, 1.0, {}, &gen);
  check_matches(sum(tall, {0}), naive_sum(tall.to_vector<float>(), tall.sizes(), 1u), 1e-6);
  check_thread_independent([&] { return sum(tall, {0}); });
  check_thread_independent([&] { return var(tall, {0}); });
  Tensor wide = normal({300, 1000}, 0.0, 1.0, {}, &gen);
  check_matches(sum(wide, {0}), naive_sum(wide.to_vector<float>(), wide.sizes(), 1u), 1e-6);
  check_matches(sum(wide, {1}), naive_sum(wide.to_vector<float>(), wide.sizes(), 2u), 1e-6);
  check_matches(
      mean(wide.t(), {1}),
      [&] {
        std::vector<double> s = naive_sum(wide.to_vector<float>(), wide.sizes(), 1u);
        for (double& v : s) v /= 300.0;
        return s;
      }(),
      1e-6);
  // Middle dim (generic path).
  Tensor cube = normal({40, 50, 30}, 0.0, 1.0, {}, &gen);
  check_matches(sum(cube, {0, 2}), naive_sum(cube.to_vector<float>(), cube.sizes(), 5u), 1e-6);
  check_thread_independent([&] { return sum(cube, {0, 2}); });
  // Max, argmax and var over a large tensor agree with host computations.
  std::vector<float> v = wide.to_vector<float>();
  auto [values, indices] = max(wide, 1);
  std::vector<int64_t> idx = indices.to_vector<int64_t>();
  std::vector<float> got = values.to_vector<float>();
  for (int r = 0; r < 300; ++r) {
    int64_t best = 0;
    for (int c = 1; c < 1000; ++c)
      if (v[r * 1000 + c] > v[r * 1000 + best]) best = c;
    CHECK(idx[r] == best);
    CHECK(got[r] == v[r * 1000 + best]);
  }
  auto [col_values, col_indices] = min(wide, 0);
  std::vector<int64_t> col_idx = col_indices.to_vector<int64_t>();
  for (int c = 0; c < 1000; c += 97) {
    int64_t best = 0;
    for (int r = 1; r < 300; ++r)
      if (v[r * 1000 + c] < v[best * 1000 + c]) best = r;
    CHECK(col_idx[c] == best);
  }
  std::vector<float> row_var = var(wide, {1}, 1.0).to_vector<float>();
  for (int r = 0; r < 300; r += 37) {
    double m = 0, m2 = 0;
    for (int c = 0; c < 1000; ++c) m += v[r * 1000 + c];
    m /= 1000;
    for (int c = 0; c < 1000; ++c) m2 += (v[r * 1000 + c] - m) * (v[r * 1000 + c] - m);
    CHECK(row_var[r] == doctest::Approx(m2 / 999).epsilon(1e-5));
  }
}

TEST_CASE("reduce: gradcheck of sum, mean and prod") {
  Tensor x = random_param({3, 4}, 11);
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return sum(in[0]); }, {x}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return sum(in[0], {1}); }, {x}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return sum(in[0], {0}, true); }, {x}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return mean(in[0], {-1}); }, {x}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return mean(in[0].t(), {0}, true); }, {x}) == "");
  Tensor cube = random_param({2, 3, 4}, 12);
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return sum(in[0], {0, 2}); }, {cube}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return mean(in[0], {0, 2}, true); }, {cube}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return sum(in[0].slice(2, 0, 4, 2), {1}); }, {cube}) ==
        "");
  Tensor p = spread_param({3, 4}, 13);
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return prod(in[0], {1}); }, {p}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return prod(in[0].t(), {1}, true); }, {p}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return prod(in[0], {0, 1}); }, {p}) == "");
  CHECK(gradgradcheck([](const std::vector<Tensor>& in) { return prod(in[0], {1}); }, {p}) == "");
  CHECK(gradgradcheck([](const std::vector<Tensor>& in) { return mul(sum(in[0], {0}), sum(in[0], {0})); },
                      {x}) == "");
}

TEST_CASE("reduce: prod gradient with zeros") {
  // d/dx_i of prod = product of the others, also when x_i (or another element) is zero.
  Tensor x = param({2, 0, 3, 0, 0, 5}, {2, 3});
  prod(x, {1}).backward(ones({2}));
  check_close(x.grad(), {0, 6, 0, 0, 0, 0});
  Tensor y = param({0, 4, 3});
  prod(y, {0}).backward();
  check_close(y.grad(), {12, 0, 0});
}

TEST_CASE("reduce: gradcheck of max, min, var, std, norm, logsumexp") {
  Tensor p = spread_param({3, 4}, 21);
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return max(in[0]); }, {p}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return min(in[0]); }, {p}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return max(in[0], 1).first; }, {p}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return min(in[0], 0, true).first; }, {p}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return max(in[0].t(), 1, true).first; }, {p}) == "");
  CHECK(gradgradcheck([](const std::vector<Tensor>& in) { return square(max(in[0], 1).first); }, {p}) == "");
  Tensor x = random_param({3, 4}, 22);
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return var(in[0]); }, {x}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return var(in[0], {1}, 0.0); }, {x}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return var(in[0].t(), {0}, 1.0, true); }, {x}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return std_dev(in[0], {0}, 1.0); }, {x}) == "");
  CHECK(gradgradcheck([](const std::vector<Tensor>& in) { return var(in[0], {1}, 1.0); }, {x}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return norm(in[0]); }, {x}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return norm(in[0], 2.0, {1}, true); }, {x}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return norm(in[0].t(), 3.0, {0}); }, {x}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return norm(in[0], 1.0, {0}); }, {p}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return norm(in[0], INFINITY, {1}); }, {p}) == "");
  CHECK(gradgradcheck([](const std::vector<Tensor>& in) { return norm(in[0], 2.0, {1}); }, {x}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return logsumexp(in[0], 1); }, {x}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return logsumexp(in[0].t(), 0, true); }, {x}) == "");
  CHECK(gradgradcheck([](const std::vector<Tensor>& in) { return logsumexp(in[0], 0); }, {x}) == "");
  // the gradient of the norm at 0 is taken as 0, not NaN
  Tensor z = zeros({3}).requires_grad_(true);
  norm(z).backward();
  check_close(z.grad(), {0, 0, 0});
}

TEST_CASE("reduce: sum_to gradcheck (the inverse of broadcasting)") {
  Tensor x = random_param({2, 3, 4}, 31);
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return sum_to(in[0], {3, 1}); }, {x}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return sum_to(in[0], {4}); }, {x}) == "");
  // broadcasting add reduces through sum_to
  Tensor b = random_param({3, 1}, 32);
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return add(in[0], in[1]); }, {x, b}) == "");
}

TEST_CASE("reduce: bad input throws with the shapes in the message") {
  CHECK_THROWS_WITH_AS(max(zeros({0, 3})), doctest::Contains("[0, 3]"), ValueError);
  CHECK_THROWS_WITH_AS(min(zeros({2, 0}), 1), doctest::Contains("[2, 0]"), ValueError);
  CHECK_THROWS_AS(sum(two_by_three(), {2}), IndexError);
  CHECK_THROWS_AS(argmax(two_by_three(), -3), IndexError);
  CHECK_THROWS_WITH_AS(sum(two_by_three(), {1, -1}), doctest::Contains("more than once"), ValueError);
  CHECK_THROWS_AS(mean(from_vector(std::vector<int64_t>{1, 2})), TypeError);
  CHECK_THROWS_AS(var(from_vector(std::vector<int64_t>{1, 2})), TypeError);
  CHECK_THROWS_WITH_AS(sum_to(zeros({2, 3}), {4}), doctest::Contains("[2, 3]"), ValueError);
  CHECK_THROWS_WITH_AS(sum_to(zeros({3}), {2, 3}), doctest::Contains("[2, 3]"), ValueError);
  CHECK_THROWS_AS(norm(two_by_three(), -1.0), ValueError);
}
