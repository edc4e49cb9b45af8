// Matrix products: mm/bmm/matmul forward by hand and against a naive triple loop (transposed views,
// broadcast batch dims, 1-D operands), the gemm kernel's alpha/beta and thread-count independence,
// gradient checks, double backward and shape errors; the packed AVX-512 kernel on its own.
#include <omp.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cpu/packed_gemm.h"
#include "kernels/kernels.h"
#include "tests/test_support.h"

using namespace mn;
using autograd::gradcheck;
using autograd::gradgradcheck;
using mn::testing::check_close;
using mn::testing::random_param;
using mn::testing::random_tensor;
using mn::testing::tensor;

namespace {

// Naive [.., M, K] x [.., K, N] with equal batch shapes, accumulated in double.
std::vector<float> naive_batched(const Tensor& a, const Tensor& b) {
  const Tensor ac = a.contiguous(), bc = b.contiguous();
  const int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  const int64_t batch = a.numel() / (m * k);
  std::vector<float> va = ac.to_vector<float>(), vb = bc.to_vector<float>(), out(batch * m * n);
  for (int64_t p = 0; p < batch; ++p)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t q = 0; q < k; ++q) s += double(va[(p * m + i) * k + q]) * vb[(p * k + q) * n + j];
        out[(p * m + i) * n + j] = static_cast<float>(s);
      }
  return out;
}

bool bitwise_equal(const Tensor& x, const Tensor& y) {
  return x.sizes() == y.sizes() && std::memcmp(x.contiguous().data<float>(), y.contiguous().data<float>(), x.nbytes()) == 0;
}

}  // namespace

TEST_CASE("matmul: 2-D product by hand") {
  Tensor a = tensor({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = tensor({7, 8, 9, 10, 11, 12}, {3, 2});
  Tensor c = matmul(a, b);
  CHECK(c.sizes() == Shape{2, 2});
  check_close(c, {58, 64, 139, 154});
  check_close(mm(a, b), {58, 64, 139, 154});
}

TEST_CASE("matmul: vector cases") {
  Tensor v = tensor({1, 2, 3});
  Tensor dot = matmul(v, tensor({4, 5, 6}));
  CHECK(dot.dim() == 0);
  CHECK(dot.item() == doctest::Approx(32));
  Tensor m = tensor({1, 2, 3, 4, 5, 6}, {3, 2});
  Tensor vm = matmul(v, m);  // [3] @ [3, 2]
  CHECK(vm.sizes() == Shape{2});
  check_close(vm, {22, 28});
  Tensor mv = matmul(m.t(), v);  // [2, 3] @ [3]
  CHECK(mv.sizes() == Shape{2});
  check_close(mv, {22, 28});
}

TEST_CASE("matmul: transposed and strided views need no copy and match the naive product") {
  Tensor a = random_tensor({7, 5}, 1), b = random_tensor({9, 7}, 2);
  // a.t(): [5, 7] column-major; b.t(): [7, 9] column-major.
  check_close(matmul(a.t(), b.t()), naive_batched(a.t(), b.t()), 1e-5);
  check_close(matmul(a.t(), b.t().contiguous()), naive_batched(a.t(), b.t()), 1e-5);
  // Every other column: no unit stride at all, so the kernel copies.
  Tensor wide = random_tensor({5, 14}, 3);
  Tensor strided = wide.slice(1, 0, 14, 2);  // [5, 7], strides [14, 2]
  check_close(matmul(strided, a), naive_batched(strided, a), 1e-5);
}

TEST_CASE("matmul: batched with broadcast batch dims") {
  Tensor a = random_tensor({2, 1, 3, 4}, 4);
  Tensor b = random_tensor({3, 4, 5}, 5);
  Tensor c = matmul(a, b);
  REQUIRE(c.sizes() == Shape{2, 3, 3, 5});
  check_close(c, naive_batched(a.expand({2, 3, 3, 4}), b.expand({2, 3, 4, 5})), 1e-5);

  // [B, M, K] @ [K, N] folds the batch into the rows.
  Tensor x = random_tensor({3, 2, 4}, 6), w = random_tensor({4, 5}, 7);
  check_close(matmul(x, w), naive_batched(x, w.expand({3, 4, 5})), 1e-5);
  // [M, K] @ [B, K, N] broadcasts the matrix with a zero batch stride.
  Tensor y = random_tensor({3, 4, 5}, 8);
  Tensor xm = random_tensor({2, 4}, 9);
  check_close(matmul(xm, y), naive_batched(xm.expand({3, 2, 4}), y), 1e-5);
  // Vectors against batches.
  Tensor v = random_tensor({4}, 10);
  Tensor vb = matmul(v, y);  // [3, 5]
  CHECK(vb.sizes() == Shape{3, 5});
  check_close(vb, naive_batched(v.reshape({1, 1, 4}).expand({3, 1, 4}), y), 1e-5);
  Tensor bv = matmul(x, v);  // [3, 2]
  CHECK(bv.sizes() == Shape{3, 2});
  check_close(bv, naive_batched(x, v.reshape({1, 4, 1}).expand({3, 4, 1})), 1e-5);
  // bmm with a transposed batch.
  Tensor p = random_tensor({3, 5, 4}, 11);
  check_close(bmm(x, p.transpose(1, 2)), naive_batched(x, p.transpose(1, 2)), 1e-5);
}

TEST_CASE("matmul: gemm kernel alpha and beta") {
  Tensor a = tensor({1, 2, 3, 4}, {2, 2});
  Tensor b = tensor({1, 0, 0, 1}, {2, 2});
  Tensor out = tensor({10, 20, 30, 40}, {2, 2});
  kernels::gemm(kCPU, a, b, out, 2.0, 0.5);
  check_close(out, {7, 14, 21, 28});
  // beta = 0 never reads the output, even when it holds NaN.
  out.fill_(std::nan(""));
  kernels::gemm(kCPU, a, b, out, 1.0, 0.0);
  check_close(out, {1, 2, 3, 4});
  // An empty inner dimension gives beta * out.
  Tensor e = empty({2, 0}), f = empty({0, 2});
  out.fill_(3.0);
  kernels::gemm(kCPU, e, f, out, 1.0, 2.0);
  check_close(out, {6, 6, 6, 6});
}

TEST_CASE("matmul: results do not depend on the thread count") {
  const int saved = omp_get_max_threads();
  const std::vector<std::array<int64_t, 3>> shapes = {
      {300, 500, 700}, {1000, 1, 777}, {1, 1000, 1200}, {517, 613, 129}, {2048, 64, 96}, {100, 3000, 40},
      {20, 3000, 50}, {64, 3000, 1}};
  for (const auto& [m, n, k] : shapes) {
    CAPTURE(m);
    CAPTURE(n);
    CAPTURE(k);
    Tensor a = random_tensor({m, k}, 12), b = random_tensor({k, n}, 13);
    omp_set_num_threads(1);
    Tensor one = mm(a, b);
    omp_set_num_threads(3);
    Tensor three = mm(a, b);
    CHECK(bitwise_equal(one, three));
  }
  Tensor a = random_tensor({6, 40, 50}, 14), b = random_tensor({6, 50, 30}, 15);
  omp_set_num_threads(1);
  Tensor one = bmm(a, b);
  omp_set_num_threads(4);
  Tensor four = bmm(a, b);
  CHECK(bitwise_equal(one, four));
  omp_set_num_threads(saved);
}

TEST_CASE("matmul: gradcheck") {
  Tensor a = random_param({3, 4}, 20), b = random_param({4, 2}, 21);
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return matmul(t[0], t[1]); }, {a, b}) == "");
  // Transposed and strided (non-contiguous) operands.
  Tensor at = random_param({4, 3}, 22), bw = random_param({4, 4}, 23);
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return matmul(t[0].t(), t[1].slice(1, 0, 4, 2)); }, {at, bw}) ==
        "");
  // 1-D cases.
  Tensor v = random_param({4}, 24), w = random_param({4}, 25);
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return matmul(t[0], t[1]); }, {v, w}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return matmul(t[0], t[1]); }, {v, b}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return matmul(t[0], t[1]); }, {a, v}) == "");
  // Broadcast batch dims: gradients sum over the broadcast copies.
  Tensor x = random_param({2, 1, 3, 4}, 26), y = random_param({3, 4, 2}, 27);
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return matmul(t[0], t[1]); }, {x, y}) == "");
  Tensor x3 = random_param({3, 2, 4}, 28);
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return matmul(t[0], t[1]); }, {x3, b}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return matmul(t[0], t[1]); }, {a, y}) == "");
  Tensor p = random_param({2, 4, 3}, 29), q = random_param({2, 4, 5}, 30);
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return bmm(t[0].transpose(1, 2), t[1].transpose(1, 2)); },
                  {p, random_param({2, 5, 4}, 31)}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return bmm(t[0], t[1]); }, {random_param({2, 3, 4}, 32), q}) ==
        "");
}

TEST_CASE("matmul: double backward") {
  Tensor a = random_param({3, 4}, 40), b = random_param({4, 2}, 41);
  CHECK(gradgradcheck([](const std::vector<Tensor>& t) { return matmul(t[0], t[1]); }, {a, b}) == "");
  CHECK(gradgradcheck([](const std::vector<Tensor>& t) { return matmul(t[0], t[1].t()); },
                      {a, random_param({2, 4}, 42)}) == "");
  Tensor x = random_param({2, 1, 2, 3}, 43), y = random_param({2, 3, 2}, 44);
  CHECK(gradgradcheck([](const std::vector<Tensor>& t) { return matmul(t[0], t[1]); }, {x, y}) == "");
  // A nonlinearity after the product makes the second derivative non-trivial in both operands.
  CHECK(gradgradcheck([](const std::vector<Tensor>& t) { return tanh(matmul(t[0], t[1])); }, {a, b}) == "");
}

TEST_CASE("matmul: the gradient of a transposed leaf keeps the leaf's layout") {
  Tensor w = random_param({5, 4}, 50);  // used as w.t(), like a linear layer's weight
  Tensor x = random_tensor({3, 4}, 51);
  sum(matmul(x, w.t())).backward();
  REQUIRE(w.grad().defined());
  CHECK(w.grad().sizes() == Shape{5, 4});
  CHECK(w.grad().is_contiguous());
}

TEST_CASE("matmul: shape and type errors") {
  Tensor a = zeros({2, 3}), b = zeros({4, 5});
  CHECK_THROWS_WITH_AS(matmul(a, b), doctest::Contains("matmul: shapes [2, 3] and [4, 5] cannot be multiplied (3 != 4)"),
                       ValueError);
  CHECK_THROWS_WITH_AS(mm(a, b), doctest::Contains("[2, 3] and [4, 5]"), ValueError);
  CHECK_THROWS_WITH_AS(mm(zeros({2, 3, 4}), b), doctest::Contains("[2, 3, 4]"), ValueError);
  CHECK_THROWS_WITH_AS(bmm(zeros({2, 3, 4}), zeros({3, 4, 5})), doctest::Contains("(2 != 3)"), ValueError);
  CHECK_THROWS_WITH_AS(matmul(zeros({2, 3, 4}), zeros({5, 4, 2})), doctest::Contains("[2] and [5]"), ValueError);
  CHECK_THROWS_WITH_AS(matmul(scalar_tensor(1.0), a), doctest::Contains("at least 1 dimension"), ValueError);
  CHECK_THROWS_WITH_AS(matmul(tensor({1, 2}), tensor({1, 2, 3})), doctest::Contains("(2 != 3)"), ValueError);
  Tensor ints = from_vector(std::vector<int64_t>{1, 2, 3, 4, 5, 6}, {3, 2});
  CHECK_THROWS_WITH_AS(matmul(a, ints), doctest::Contains("i64"), TypeError);
}

// The packed AVX-512 GEMM (kernels/cpu/packed_gemm.h) on its own, against a double-precision sum:
// shapes around its tile (8 x 48, 16-column vectors) and block sizes (K blocks of at most 256, 320
// rows, 4800 columns), operands row-major, transposed and with no unit stride, and every way C is
// stored (beta 0 with NaN in C, beta 1, another beta; alpha 1 and not).
TEST_CASE("packed gemm: tails, blocks, layouts, alpha and beta against a double sum") {
  if (!kernels::cpu::packed_gemm_built()) return;  // a build without AVX-512 has only Eigen's kernel
  using kernels::cpu::MatrixRef;
  const std::vector<std::array<int64_t, 3>> shapes = {{1, 1, 1},   {8, 48, 8},    {9, 49, 9},    {7, 15, 3},
                                                      {17, 97, 255}, {3, 33, 256}, {16, 64, 257}, {33, 17, 520},
                                                      {321, 50, 20}, {5, 4801, 2}, {64, 49, 288}};
  for (const auto& [m, n, k] : shapes) {
    for (int layout = 0; layout < 4; ++layout) {  // bit 0: A transposed, bit 1: B transposed
      for (const auto& [alpha, beta] : std::vector<std::pair<float, float>>{{1, 0}, {1, 1}, {0.5f, 0}, {-2, 0.25f}}) {
        CAPTURE(m);
        CAPTURE(n);
        CAPTURE(k);
        CAPTURE(layout);
        CAPTURE(alpha);
        CAPTURE(beta);
        // Stored with a padded leading dimension (+3) so strides differ from the extents.
        const bool ta = layout & 1, tb = layout & 2;
        const int64_t lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 3, ldc = n + 5;
        const std::vector<float> av = random_tensor({(ta ? k : m) * lda}, 21).to_vector<float>();
        const std::vector<float> bv = random_tensor({(tb ? n : k) * ldb}, 22).to_vector<float>();
        std::vector<float> c = random_tensor({m * ldc}, 23).to_vector<float>();
        if (beta == 0.0f) std::fill(c.begin(), c.end(), std::nanf(""));
        const std::vector<float> c0 = c;
        const MatrixRef a{av.data(), m, k, ta ? 1 : lda, ta ? lda : 1};
        const MatrixRef b{bv.data(), k, n, tb ? 1 : ldb, tb ? ldb : 1};
        kernels::cpu::packed_gemm(a, b, c.data(), ldc, alpha, beta);
        double worst = 0;
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            double sum = 0, magnitude = 0;
            for (int64_t q = 0; q < k; ++q) {
              const double p = double(a.data[i * a.row_stride + q * a.col_stride]) * b.data[q * b.row_stride + j * b.col_stride];
              sum += p;
              magnitude += std::fabs(p);
            }
            const double old = beta == 0.0f ? 0.0 : double(beta) * c0[i * ldc + j];
            const double want = alpha * sum + old;
            const double err = std::fabs(want - c[i * ldc + j]) / (std::fabs(alpha) * magnitude + std::fabs(old) + 1e-30);
            worst = std::max(worst, std::isnan(err) ? 1.0 : err);
          }
          // Columns past n in each row of C are untouched.
          for (int64_t j = n; j < ldc && i * ldc + j < m * ldc; ++j)
            CHECK((std::isnan(c0[i * ldc + j]) ? std::isnan(c[i * ldc + j]) : c[i * ldc + j] == c0[i * ldc + j]));
        }
        CHECK(worst < 1e-5);
      }
    }
  }
}

// A B shared by many blocks of rows (kernels/cpu/packed_gemm.h, what the mapped-group kernels use): each
// block of B packed once, then rows cut anywhere multiplied by it, give
// packed_gemm's bits; while the packing buffer is lent, packed_gemm on that thread refuses to run.
TEST_CASE("packed gemm: a shared B block by block gives packed_gemm's bits for any cut of the rows") {
  if (!kernels::cpu::packed_gemm_built()) return;
  using kernels::cpu::MatrixRef;
  for (const auto& [m, n, k] : std::vector<std::array<int64_t, 3>>{{37, 672, 672}, {9, 4850, 40}, {20, 50, 600}}) {
    for (bool tb : {false, true}) {
      CAPTURE(m);
      CAPTURE(n);
      CAPTURE(k);
      CAPTURE(tb);
      const std::vector<float> av = random_tensor({m * k}, 31).to_vector<float>();
      const std::vector<float> bv = random_tensor({k * n}, 32).to_vector<float>();
      const MatrixRef a{av.data(), m, k, k, 1};
      const MatrixRef b{bv.data(), k, n, tb ? 1 : n, tb ? k : 1};
      std::vector<float> want(static_cast<size_t>(m * n)), got(static_cast<size_t>(m * n), std::nanf(""));
      kernels::cpu::packed_gemm(a, b, want.data(), n, 1.0f, 0.0f);
      const std::vector<kernels::cpu::GemmBBlock> blocks = kernels::cpu::gemm_b_blocks(k, n);
      CHECK(blocks.size() == static_cast<size_t>(((n + 4799) / 4800) * ((k + 255) / 256)));
      int64_t floats = 0;
      for (const auto& blk : blocks) floats = std::max(floats, blk.floats());
      {
        kernels::cpu::LentBBuffer lent(floats);
        CHECK_THROWS_AS(kernels::cpu::packed_gemm(a, b, got.data(), n, 1.0f, 0.0f), std::logic_error);
        const std::vector<int64_t> cuts = {0, 1, 5, 13, m};  // rows [0, 1), [1, 5), ...: any cut
        for (const auto& blk : blocks) {
          kernels::cpu::pack_b_block(b, blk, lent.data());
          for (size_t c = 0; c + 1 < cuts.size(); ++c) {
            const int64_t r0 = std::min(cuts[c], m), r1 = std::min(cuts[c + 1], m);
            kernels::cpu::multiply_b_block(av.data() + r0 * k + blk.pc, k, 1, r1 - r0, lent.data(), blk,
                                           got.data() + r0 * n, n, 1.0f, 0.0f);
          }
        }
      }
      CHECK(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)) == 0);
      // The loan is over: packed_gemm runs again.
      CHECK_NOTHROW(kernels::cpu::packed_gemm(a, b, got.data(), n, 1.0f, 0.0f));
    }
  }
}

TEST_CASE("packed gemm: NaN and infinity propagate as in a plain sum") {
  if (!kernels::cpu::packed_gemm_built()) return;
  using kernels::cpu::MatrixRef;
  const int64_t m = 9, n = 50, k = 300;
  std::vector<float> av = random_tensor({m * k}, 31).to_vector<float>(), bv = random_tensor({k * n}, 32).to_vector<float>();
  av[2 * k + 260] = std::nanf("");                             // row 2 of A, in the second K block
  bv[7 * n + 49] = std::numeric_limits<float>::infinity();     // column 49 of B: +-inf unless a row has NaN
  std::vector<float> c(m * n);
  kernels::cpu::packed_gemm(MatrixRef{av.data(), m, k, k, 1}, MatrixRef{bv.data(), k, n, n, 1}, c.data(), n, 1.0f, 0.0f);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      CAPTURE(i);
      CAPTURE(j);
      if (i == 2) CHECK(std::isnan(c[i * n + j]));
      else if (j == 49) CHECK(std::isinf(c[i * n + j]));
      else CHECK(std::isfinite(c[i * n + j]));
    }
}

// mm runs the packed kernel by default where it is built; MN_CPU_GEMM=eigen (set_packed_gemm(false))
// switches every product back to Eigen's, to repeat runs made before it bit for bit. Both agree to
// float rounding, and the switch really changes the code that runs (the last bits differ somewhere).
TEST_CASE("packed gemm: the switch to Eigen's kernel, and both kernels agree") {
  if (!kernels::cpu::packed_gemm_built()) {
    CHECK_FALSE(kernels::cpu::packed_gemm_enabled());
    kernels::cpu::set_packed_gemm(true);  // ignored without the kernel
    CHECK_FALSE(kernels::cpu::packed_gemm_enabled());
    return;
  }
  const bool saved = kernels::cpu::packed_gemm_enabled();
  Tensor a = random_tensor({200, 300}, 41), b = random_tensor({300, 150}, 42);
  kernels::cpu::set_packed_gemm(true);
  Tensor packed = mm(a, b);
  kernels::cpu::set_packed_gemm(false);
  Tensor eigen = mm(a, b);
  kernels::cpu::set_packed_gemm(saved);
  check_close(packed, eigen.to_vector<float>(), 1e-4);
  CHECK_FALSE(bitwise_equal(packed, eigen));
}
