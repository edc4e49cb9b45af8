// The CUDA kernels of issue 18's normalisation and activation ops against their CPU twins (skipped
// without a device, see main.cpp): the new unary activations and their backward ops (with and
// without scalar parameters) on random values, NaN and infinities; the row_norm kernels for layer
// norm and group norm layouts (short, long and many rows, with and without affine, every subset of
// gradients), run-to-run reproducibility; and gradchecks through layer_norm / group_norm / the
// activations on the device.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "autograd/gradcheck.h"
#include "autograd/ops.h"
#include "core/random.h"
#include "kernels/kernels.h"
#include "nn/functional.h"
#include "nn/layers.h"

using namespace mn;
namespace K = mn::kernels;
namespace F = mn::nn::functional;

namespace {

const Device kDev = cuda_device(0);

// A CPU tensor and its copy on the device.
struct Twin {
  Tensor cpu, gpu;
};

Twin twin_of(const Tensor& cpu) { return {cpu, cpu.to(kDev)}; }
Twin twin_uniform(const Shape& shape, uint64_t seed, double lo, double hi) {
  Generator gen(seed);
  return twin_of(uniform(shape, lo, hi, {}, &gen));
}
Twin twin_empty(const Shape& shape) { return {empty(shape), empty(shape, TensorOptions().with_device(kDev))}; }

// The device result equals the CPU one within atol + rtol * |cpu| (NaN for NaN, infinities equal).
void check_twin(const Twin& t, double atol, double rtol, const char* what) {
  INFO(what);
  REQUIRE(t.gpu.sizes() == t.cpu.sizes());
  const std::vector<float> g = t.gpu.to_vector<float>(), c = t.cpu.to_vector<float>();
  for (size_t i = 0; i < c.size(); ++i) {
    const bool ok = std::isnan(c[i])   ? std::isnan(g[i])
                    : std::isinf(c[i]) ? g[i] == c[i]
                                       : std::fabs(g[i] - c[i]) <= atol + rtol * std::fabs(c[i]);
    if (!ok) {
      FAIL_CHECK("element " << i << " of " << c.size() << ": device " << g[i] << ", cpu " << c[i]);
      return;
    }
  }
}

bool identical(const Tensor& a, const Tensor& b) {
  const std::vector<float> x = a.to_vector<float>(), y = b.to_vector<float>();
  return x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0);
}

// Random values in [-30, 30] followed by NaN, +-inf and the kinks of the activations below.
Twin activation_inputs(uint64_t seed) {
  Generator gen(seed);
  std::vector<float> v = uniform({200}, -30.0, 30.0, {}, &gen).to_vector<float>();
  const float inf = std::numeric_limits<float>::infinity();
  for (float e : {std::numeric_limits<float>::quiet_NaN(), inf, -inf, 0.0f, -1.0f, 1.0f, -2.0f, 0.5f, 2.5f, 20.0f})
    v.push_back(e);
  return twin_of(from_vector(v));
}

struct RowNormRun {
  Shape x;
  K::RowNormLayout layout;
  bool affine;
};

// Forward and backward of the row_norm kernels on both devices from the same data, compared; the
// need_* flags select which gradients the backward is asked for.
void row_norm_on_both(const RowNormRun& run, uint64_t seed, bool need_x, bool need_w, bool need_b) {
  const K::RowNormLayout& s = run.layout;
  const int64_t c = s.channels();
  const Twin x = twin_uniform(run.x, seed, -3.0, 5.0);
  const Twin w = run.affine ? twin_uniform({c}, seed + 1, 0.5, 1.5) : Twin{};
  const Twin b = run.affine ? twin_uniform({c}, seed + 2, -1.0, 1.0) : Twin{};
  Twin y = twin_empty(run.x), mean = twin_empty({s.rows}), rstd = twin_empty({s.rows});
  K::row_norm_forward(kCPU, x.cpu, w.cpu, b.cpu, s, 1e-5, y.cpu, mean.cpu, rstd.cpu);
  K::row_norm_forward(kDev, x.gpu, w.gpu, b.gpu, s, 1e-5, y.gpu, mean.gpu, rstd.gpu);
  check_twin(y, 1e-5, 1e-5, "forward");
  check_twin(mean, 1e-6, 1e-5, "mean");
  check_twin(rstd, 1e-6, 1e-5, "rstd");

  const Twin g = twin_uniform(run.x, seed + 3, -1.0, 1.0);
  Twin gx = need_x ? twin_empty(run.x) : Twin{};
  Twin gw = run.affine && need_w ? twin_empty({c}) : Twin{};
  Twin gb = run.affine && need_b ? twin_empty({c}) : Twin{};
  K::row_norm_backward(kCPU, g.cpu, x.cpu, w.cpu, mean.cpu, rstd.cpu, s, gx.cpu, gw.cpu, gb.cpu);
  K::row_norm_backward(kDev, g.gpu, x.gpu, w.gpu, mean.gpu, rstd.gpu, s, gx.gpu, gw.gpu, gb.gpu);
  if (gx.cpu.defined()) check_twin(gx, 1e-5, 1e-4, "grad x");
  // Long sums (thousands of rows per channel) round differently in the two summation orders.
  if (gw.cpu.defined()) check_twin(gw, 2e-4, 1e-5, "grad weight");
  if (gb.cpu.defined()) check_twin(gb, 2e-4, 1e-5, "grad bias");
}

K::RowNormLayout layer_layout(int64_t rows, int64_t n) { return {rows, n, 1, 1}; }
K::RowNormLayout group_layout(const Shape& x, int64_t groups) {
  int64_t inner = 1;
  for (int d = 2; d < x.size(); ++d) inner *= x[d];
  return {x[0] * groups, x[1] / groups * inner, groups, inner};
}

}  // namespace

TEST_CASE("cuda norm: activations and their backward ops match the CPU, NaN and infinities included") {
  const Twin x = activation_inputs(1801);
  struct Unary {
    K::UnaryOp op;
    double alpha, beta;
  };
  for (const Unary& u : {Unary{K::UnaryOp::Silu, 0, 0}, Unary{K::UnaryOp::LogSigmoid, 0, 0},
                         Unary{K::UnaryOp::LeakyRelu, 0.01, 0}, Unary{K::UnaryOp::LeakyRelu, 0.3, 0},
                         Unary{K::UnaryOp::Elu, 1.0, 0}, Unary{K::UnaryOp::Elu, 1.7, 0},
                         Unary{K::UnaryOp::Hardtanh, -1.0, 1.0}, Unary{K::UnaryOp::Hardtanh, -2.0, 0.5},
                         Unary{K::UnaryOp::Softplus, 1.0, 20.0}, Unary{K::UnaryOp::Softplus, 2.0, 5.0}}) {
    CAPTURE(static_cast<int>(u.op));
    CAPTURE(u.alpha);
    Twin y = twin_empty(x.cpu.sizes());
    K::unary(kCPU, u.op, x.cpu, y.cpu, u.alpha, u.beta);
    K::unary(kDev, u.op, x.gpu, y.gpu, u.alpha, u.beta);
    check_twin(y, 1e-6, 2e-6, "unary");
  }
  const Twin g = twin_uniform(x.cpu.sizes(), 1802, 0.5, 1.5);
  for (K::BinaryOp op : {K::BinaryOp::SiluBackward, K::BinaryOp::LogSigmoidBackward}) {
    CAPTURE(static_cast<int>(op));
    Twin out = twin_empty(x.cpu.sizes());
    K::binary(kCPU, op, g.cpu, x.cpu, out.cpu);
    K::binary(kDev, op, g.gpu, x.gpu, out.gpu);
    check_twin(out, 1e-6, 2e-6, "backward");
  }
  struct Params {
    K::BinaryOp op;
    double alpha, beta;
  };
  for (const Params& p : {Params{K::BinaryOp::LeakyReluBackward, 0.2, 0}, Params{K::BinaryOp::EluBackward, 1.5, 0},
                          Params{K::BinaryOp::HardtanhBackward, -1.0, 1.0},
                          Params{K::BinaryOp::SoftplusBackward, 1.0, 20.0},
                          Params{K::BinaryOp::SoftplusBackward, 2.0, 5.0}}) {
    CAPTURE(static_cast<int>(p.op));
    Twin out = twin_empty(x.cpu.sizes());
    K::binary_params(kCPU, p.op, g.cpu, x.cpu, out.cpu, p.alpha, p.beta);
    K::binary_params(kDev, p.op, g.gpu, x.gpu, out.gpu, p.alpha, p.beta);
    check_twin(out, 1e-6, 2e-6, "backward with parameters");
  }
  Twin out = twin_empty(x.cpu.sizes());
  CHECK_THROWS_AS(K::binary(kDev, K::BinaryOp::EluBackward, g.gpu, x.gpu, out.gpu), TypeError);
  CHECK_THROWS_AS(K::binary_params(kDev, K::BinaryOp::Mul, g.gpu, x.gpu, out.gpu, 0, 0), TypeError);
}

TEST_CASE("cuda norm: row_norm forward and backward, layer and group layouts, every gradient subset") {
  uint64_t seed = 1850;
  const std::vector<RowNormRun> runs = {
      {{6, 10}, layer_layout(6, 10), true},
      {{3, 700}, layer_layout(3, 700), true},        // rows longer than a block
      {{2, 3, 4, 5}, layer_layout(6, 20), false},
      {{1000, 48}, layer_layout(1000, 48), true},    // many rows: the affine gradients span chunks
      {{4, 6, 5, 3}, group_layout({4, 6, 5, 3}, 2), true},
      {{3, 4, 7}, group_layout({3, 4, 7}, 4), true},  // groups = C
      {{3, 4, 7}, group_layout({3, 4, 7}, 1), false},
      {{5, 6}, group_layout({5, 6}, 3), true},        // no spatial dims
      {{2, 8, 40, 40}, group_layout({2, 8, 40, 40}, 4), true},
  };
  for (const RowNormRun& run : runs) {
    CAPTURE(run.x);
    CAPTURE(run.layout.groups);
    CAPTURE(run.affine);
    row_norm_on_both(run, seed += 10, true, true, true);
    row_norm_on_both(run, seed += 10, true, false, false);
    row_norm_on_both(run, seed += 10, false, true, false);
    row_norm_on_both(run, seed += 10, false, false, true);
  }
}

TEST_CASE("cuda norm: row_norm is reproducible run to run and keeps NaN in its row") {
  const K::RowNormLayout s = layer_layout(12800, 128);  // the ViT shape: [256 * 50, 128]
  const Twin x = twin_uniform({12800, 128}, 1901, -2.0, 2.0);
  const Twin w = twin_uniform({128}, 1902, 0.5, 1.5), b = twin_uniform({128}, 1903, -1.0, 1.0);
  Tensor y1 = empty({12800, 128}, TensorOptions().with_device(kDev)), y2 = empty_like(y1);
  Tensor m = empty({12800}, TensorOptions().with_device(kDev)), k = empty_like(m);
  K::row_norm_forward(kDev, x.gpu, w.gpu, b.gpu, s, 1e-5, y1, m, k);
  K::row_norm_forward(kDev, x.gpu, w.gpu, b.gpu, s, 1e-5, y2, m, k);
  CHECK(identical(y1, y2));
  const Twin g = twin_uniform({12800, 128}, 1904, -1.0, 1.0);
  Tensor gx1 = empty_like(y1), gx2 = empty_like(y1);
  Tensor gw1 = empty({128}, TensorOptions().with_device(kDev)), gw2 = empty_like(gw1), gb1 = empty_like(gw1),
         gb2 = empty_like(gw1);
  K::row_norm_backward(kDev, g.gpu, x.gpu, w.gpu, m, k, s, gx1, gw1, gb1);
  K::row_norm_backward(kDev, g.gpu, x.gpu, w.gpu, m, k, s, gx2, gw2, gb2);
  CHECK(identical(gx1, gx2));
  CHECK(identical(gw1, gw2));
  CHECK(identical(gb1, gb2));

  const Twin xn = twin_of(from_vector(std::vector<float>{1, std::numeric_limits<float>::quiet_NaN(), 3, 4, 5, 6}, {2, 3}));
  const std::vector<float> yn = F::layer_norm(xn.gpu, {3}).to_vector<float>();
  CHECK(std::isnan(yn[0]));
  CHECK(std::isnan(yn[2]));
  CHECK(!std::isnan(yn[3]));
}

TEST_CASE("cuda norm: gradcheck through layer_norm, group_norm and the activations on the device") {
  using autograd::gradcheck;
  const auto on_device = [](const Shape& shape, uint64_t seed, double lo, double hi) {
    Generator gen(seed);
    Tensor t = uniform(shape, lo, hi, {}, &gen).to(kDev);
    t.requires_grad_(true);
    return t;
  };
  const Tensor x = on_device({3, 4, 5}, 1951, -2.0, 2.0);
  const Tensor w = on_device({4, 5}, 1952, 0.5, 1.5), b = on_device({4, 5}, 1953, -1.0, 1.0);
  const Tensor wc = on_device({4}, 1954, 0.5, 1.5), bc = on_device({4}, 1955, -1.0, 1.0);
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::layer_norm(t[0], {4, 5}, t[1], t[2]); }, {x, w, b}) ==
        "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::group_norm(t[0], 2, t[1], t[2]); }, {x, wc, bc}) == "");
  // Values kept away from the kinks at 0 and +-1 (finite differences must not straddle one).
  const Tensor a = add(mul(sign(on_device({3, 4}, 1956, -1.0, 1.0)), 0.25), on_device({3, 4}, 1957, -0.2, 0.2))
                       .detach()
                       .requires_grad_(true);
  CHECK(gradcheck(
            [](const std::vector<Tensor>& t) {
              return silu(t[0]) + leaky_relu(t[0], 0.2) + elu(t[0], 1.5) + hardtanh(t[0]) + logsigmoid(t[0]) +
                     softplus(t[0], 2.0, 3.0);
            },
            {a}) == "");
}
