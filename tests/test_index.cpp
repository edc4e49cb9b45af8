// Gather/scatter along a dim: index_select forward (repeated indices, strided inputs, i64), the
// index_add kernel (accumulating repeated indices, strided outputs), gradient checks, the large
// parallel paths against a host loop, and out-of-range indices.
#include "kernels/kernels.h"
#include "tests/test_support.h"

using namespace mn;
using autograd::gradcheck;
using mn::testing::check_close;
using mn::testing::random_param;
using mn::testing::tensor;

namespace {
Tensor indices(const std::vector<int64_t>& v) { return from_vector(v); }
}  // namespace

TEST_CASE("index: index_select forward") {
  Tensor x = tensor({1, 2, 3, 4, 5, 6}, {3, 2});
  check_close(index_select(x, 0, indices({2, 0, 2})), {5, 6, 1, 2, 5, 6});
  check_close(x.index_select(1, indices({1})), {2, 4, 6});
  CHECK(x.index_select(1, indices({1, 1, 0})).sizes() == Shape{3, 3});
  check_close(x.index_select(1, indices({1, 1, 0})), {2, 2, 1, 4, 4, 3, 6, 6, 5});
  // transposed input
  check_close(index_select(x.t(), 1, indices({2, 1})), {5, 3, 6, 4});
  // i64 data
  Tensor labels = from_vector(std::vector<int64_t>{10, 20, 30});
  CHECK(index_select(labels, 0, indices({2, 2, 0})).to_vector<int64_t>() == std::vector<int64_t>{30, 30, 10});
  // empty index
  CHECK(index_select(x, 0, from_vector(std::vector<int64_t>{})).sizes() == Shape{0, 2});
}

TEST_CASE("index: index_add accumulates repeated indices") {
  Tensor out = zeros({3, 2});
  kernels::index_add(kCPU, out, 0, indices({2, 0, 2}), tensor({1, 2, 3, 4, 5, 6}, {3, 2}));
  check_close(out, {3, 4, 0, 0, 6, 8});
  // along dim 1 into a transposed (strided) output
  Tensor base = zeros({2, 3});
  Tensor strided = base.t();  // [3, 2], non-contiguous view of base
  kernels::index_add(kCPU, strided, 1, indices({1, 1}), tensor({1, 10, 2, 20, 3, 30}, {3, 2}));
  check_close(base, {0, 0, 0, 11, 22, 33});
  Tensor counts = zeros({4}, DType::i64);
  kernels::index_add(kCPU, counts, 0, indices({3, 1, 3}), from_vector(std::vector<int64_t>{1, 1, 1}));
  CHECK(counts.to_vector<int64_t>() == std::vector<int64_t>{0, 1, 0, 2});
}

TEST_CASE("index: gradcheck of index_select with repeated indices") {
  Tensor x = random_param({4, 3}, 3);
  CHECK(gradcheck(
            [](const std::vector<Tensor>& in) {
              return index_select(in[0], 0, indices({3, 0, 3, 1}));
            },
            {x}) == "");
  CHECK(gradcheck(
            [](const std::vector<Tensor>& in) {
              return index_select(in[0], 1, indices({2, 2}));
            },
            {x}) == "");
  CHECK(gradcheck(
            [](const std::vector<Tensor>& in) {
              return index_select(in[0].t(), 1, indices({1, 1, 2}));
            },
            {x}) == "");
}

TEST_CASE("index: large gathers and scatters match a host loop") {
  Generator gen(4);
  Tensor table = normal({1000, 64}, 0.0, 1.0, {}, &gen);
  std::vector<int64_t> rows(5000);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int64_t>((i * 7919) % 1000);
  Tensor picked = index_select(table, 0, indices(rows));
  std::vector<float> t = table.to_vector<float>(), p = picked.to_vector<float>();
  bool same = true;
  for (size_t i = 0; i < rows.size(); ++i)
    for (int c = 0; c < 64; ++c) same = same && p[i * 64 + c] == t[rows[i] * 64 + c];
  CHECK(same);
  // Scatter back: every table row receives the sum of the picked copies of itself.
  Tensor grad = zeros({1000, 64});
  kernels::index_add(kCPU, grad, 0, indices(rows), picked);
  std::vector<double> expected(1000 * 64, 0.0);
  for (size_t i = 0; i < rows.size(); ++i)
    for (int c = 0; c < 64; ++c) expected[rows[i] * 64 + c] += t[rows[i] * 64 + c];
  std::vector<float> g = grad.to_vector<float>();
  double worst = 0;
  for (size_t i = 0; i < g.size(); ++i) worst = std::max(worst, std::abs(g[i] - expected[i]));
  CHECK(worst < 1e-4);
  // Columns of a wide matrix (dim 1, inner size 1).
  Tensor wide = normal({64, 2000}, 0.0, 1.0, {}, &gen);
  std::vector<int64_t> cols(1500);
  for (size_t i = 0; i < cols.size(); ++i) cols[i] = static_cast<int64_t>((i * 13) % 2000);
  std::vector<float> w = wide.to_vector<float>(), q = index_select(wide, 1, indices(cols)).to_vector<float>();
  same = true;
  for (int r = 0; r < 64; ++r)
    for (size_t j = 0; j < cols.size(); ++j) same = same && q[r * cols.size() + j] == w[r * 2000 + cols[j]];
  CHECK(same);
}

TEST_CASE("index: out-of-range indices throw IndexError naming the index and the dim size") {
  Tensor x = zeros({3, 2});
  CHECK_THROWS_WITH_AS(index_select(x, 0, indices({0, 5})), doctest::Contains("index 5"), IndexError);
  CHECK_THROWS_WITH_AS(index_select(x, 0, indices({0, 5})), doctest::Contains("size 3"), IndexError);
  CHECK_THROWS_WITH_AS(index_select(x, 1, indices({-1})), doctest::Contains("index -1"), IndexError);
  Tensor out = zeros({3, 2});
  CHECK_THROWS_WITH_AS(kernels::index_add(kCPU, out, 1, indices({2}), zeros({3, 1})),
                       doctest::Contains("size 2"), IndexError);
  CHECK_THROWS_WITH_AS(kernels::index_add(kCPU, out, 0, indices({1}), zeros({2, 2})),
                       doctest::Contains("[2, 2]"), ValueError);
  CHECK_THROWS_AS(index_select(x, 0, tensor({0})), TypeError);
  CHECK_THROWS_AS(index_select(x, 2, indices({0})), IndexError);
}
