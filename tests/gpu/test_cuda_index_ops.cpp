// The CUDA kernels of gather / scatter_add, cumsum / topk and adaptive pooling against their CPU twins
// (skipped without a device, see main.cpp), on contiguous and strided inputs, i64 data, NaN, ties and
// bad indices; the ops built on them (embedding, masked_fill, amax, full argmax) on the device; and
// gradchecks through the autograd ops on the device.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
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

const Device kGpu = cuda_device(0);
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

Tensor uniform_cpu(const Shape& shape, uint64_t seed, double lo = -2.0, double hi = 2.0) {
  Generator gen(seed);
  return uniform(shape, lo, hi, {}, &gen);
}

// i64 values in [lo, hi) of the given shape.
Tensor ints_cpu(const Shape& shape, uint64_t seed, int64_t lo, int64_t hi) {
  std::vector<float> u = uniform_cpu(shape, seed, 0.0, 1.0).to_vector<float>();
  std::vector<int64_t> v(u.size());
  for (size_t i = 0; i < u.size(); ++i) v[i] = lo + static_cast<int64_t>(u[i] * static_cast<float>(hi - lo));
  return from_vector(v, shape);
}

// The GPU tensor holds exactly the CPU tensor's values (NaN matches NaN; f32 compared bit for bit
// unless a tolerance is given).
void expect_same(const Tensor& gpu, const Tensor& cpu, double tol = 0.0) {
  REQUIRE(gpu.device().is_cuda());
  REQUIRE(gpu.sizes() == cpu.sizes());
  REQUIRE(gpu.dtype() == cpu.dtype());
  if (cpu.dtype() == DType::i64) {
    CHECK(gpu.to_vector<int64_t>() == cpu.to_vector<int64_t>());
    return;
  }
  const std::vector<float> g = gpu.to_vector<float>(), c = cpu.to_vector<float>();
  for (size_t i = 0; i < c.size(); ++i) {
    const bool ok = (std::isnan(c[i]) && std::isnan(g[i])) || g[i] == c[i] ||  // equal infinities too
                    std::fabs(g[i] - c[i]) <= tol * (1.0 + std::fabs(c[i]));
    if (!ok) {
      FAIL_CHECK("element " << i << " of " << c.size() << ": got " << g[i] << ", expected " << c[i]);
      return;
    }
  }
}

Tensor empty_on(const Shape& shape, Device device, DType dtype = DType::f32) {
  return empty(shape, TensorOptions(dtype).with_device(device));
}

}  // namespace

TEST_CASE("cuda index ops: gather kernel on every dim, strided input and index, i64, bad indices") {
  const Tensor x = uniform_cpu({4, 5, 6}, 1);
  for (int dim = 0; dim < 3; ++dim) {
    Shape ishape{3, 4, 5};
    const Tensor index = ints_cpu(ishape, 10 + dim, 0, x.size(dim));
    for (const bool transposed : {false, true}) {
      INFO("dim " << dim << (transposed ? " transposed" : ""));
      const Tensor in = transposed ? x.transpose(0, 2).contiguous().transpose(0, 2) : x;
      Tensor oc = empty_on(ishape, kCPU), og = empty_on(ishape, kGpu);
      K::gather(kCPU, in, dim, index, oc);
      K::gather(kGpu, in.to(kGpu), dim, index.to(kGpu), og);
      expect_same(og, oc);
    }
  }
  const Tensor xi = ints_cpu({6, 3}, 2, -50, 50);
  const Tensor idx = ints_cpu({3, 6}, 3, 0, 6).t();  // strided [6, 3]
  Tensor oc = empty_on({6, 3}, kCPU, DType::i64), og = empty_on({6, 3}, kGpu, DType::i64);
  K::gather(kCPU, xi, 0, idx, oc);
  K::gather(kGpu, xi.to(kGpu), 0, idx.to(kGpu), og);
  expect_same(og, oc);
  Tensor bad = from_vector(std::vector<int64_t>{0, 6, 1}, {3, 1}).to(kGpu);
  Tensor ob = empty_on({3, 1}, kGpu, DType::i64);
  CHECK_THROWS_AS(K::gather(kGpu, xi.to(kGpu), 0, bad, ob), IndexError);
}

TEST_CASE("cuda index ops: scatter_add kernel accumulates repeats in the CPU's order") {
  for (int dim = 0; dim < 3; ++dim) {
    INFO("dim " << dim);
    const Tensor base = uniform_cpu({5, 4, 6}, 20 + dim);
    const Tensor index = ints_cpu({5, 3, 6}, 30 + dim, 0, base.size(dim));
    const Tensor src = uniform_cpu({6, 4, 7}, 40 + dim);
    Tensor oc = base.clone(), og = base.to(kGpu);
    K::scatter_add(kCPU, oc, dim, index, src);
    K::scatter_add(kGpu, og, dim, index.to(kGpu), src.to(kGpu));
    expect_same(og, oc);  // same order of additions: bitwise equal
  }
  // many repeats into few rows (an embedding gradient's shape), strided output
  const Tensor index = ints_cpu({4000, 1}, 50, 0, 3).expand({4000, 8});
  const Tensor src = uniform_cpu({4000, 8}, 51);
  Tensor oc = zeros({8, 3}).t(), og = zeros({8, 3}, TensorOptions().with_device(kGpu)).t();
  K::scatter_add(kCPU, oc, 0, index, src);
  K::scatter_add(kGpu, og, 0, index.to(kGpu), src.to(kGpu));
  expect_same(og, oc);
  Tensor ic = zeros({4}, DType::i64), ig = zeros({4}, TensorOptions(DType::i64).with_device(kGpu));
  const Tensor ii = ints_cpu({50}, 52, 0, 4), vals = ints_cpu({50}, 53, -9, 9);
  K::scatter_add(kCPU, ic, 0, ii, vals);
  K::scatter_add(kGpu, ig, 0, ii.to(kGpu), vals.to(kGpu));
  expect_same(ig, ic);
  Tensor bad = from_vector(std::vector<int64_t>{-1}).to(kGpu);
  CHECK_THROWS_AS(K::scatter_add(kGpu, ig, 0, bad, vals.to(kGpu).narrow(0, 0, 1)), IndexError);
}

TEST_CASE("cuda index ops: cumsum kernel forward and reverse, f32 and i64, strided, NaN") {
  Tensor x = uniform_cpu({3, 50, 7}, 60);
  x.narrow(1, 10, 1).fill_(kNaN);
  for (int dim = 0; dim < 3; ++dim)
    for (const bool reverse : {false, true}) {
      INFO("dim " << dim << " reverse " << reverse);
      const Tensor in = x.transpose(0, 2);
      Tensor oc = empty_on(in.sizes(), kCPU), og = empty_on(in.sizes(), kGpu);
      K::cumsum(kCPU, in, dim, reverse, oc);
      K::cumsum(kGpu, in.to(kGpu), dim, reverse, og);
      expect_same(og, oc);
    }
  const Tensor xi = ints_cpu({4, 9}, 61, -100, 100);
  Tensor oc = empty_on({4, 9}, kCPU, DType::i64), og = empty_on({4, 9}, kGpu, DType::i64);
  K::cumsum(kCPU, xi, 1, false, oc);
  K::cumsum(kGpu, xi.to(kGpu), 1, false, og);
  expect_same(og, oc);
}

TEST_CASE("cuda index ops: topk kernel largest and smallest with ties and NaN, every dim") {
  Tensor ties = ints_cpu({6, 40, 5}, 70, -4, 5).to(DType::f32);
  ties.narrow(1, 3, 2).fill_(kNaN);
  for (int dim = 0; dim < 3; ++dim)
    for (const bool largest : {true, false})
      for (const int64_t k : {int64_t{1}, int64_t{3}, ties.size(dim)}) {
        INFO("dim " << dim << " largest " << largest << " k " << k);
        Shape shape = ties.sizes();
        shape[dim] = k;
        Tensor vc = empty_on(shape, kCPU), ic = empty_on(shape, kCPU, DType::i64);
        Tensor vg = empty_on(shape, kGpu), ig = empty_on(shape, kGpu, DType::i64);
        K::topk(kCPU, ties, dim, k, largest, vc, ic);
        K::topk(kGpu, ties.to(kGpu).transpose(0, 1).contiguous().transpose(0, 1), dim, k, largest, vg, ig);
        expect_same(vg, vc);
        expect_same(ig, ic);
      }
  const Tensor xi = ints_cpu({3, 30}, 71, -5, 5);
  Tensor vc = empty_on({3, 4}, kCPU, DType::i64), ic = empty_on({3, 4}, kCPU, DType::i64);
  Tensor vg = empty_on({3, 4}, kGpu, DType::i64), ig = empty_on({3, 4}, kGpu, DType::i64);
  K::topk(kCPU, xi, 1, 4, true, vc, ic);
  K::topk(kGpu, xi.to(kGpu), 1, 4, true, vg, ig);
  expect_same(vg, vc);
  expect_same(ig, ic);
}

TEST_CASE("cuda index ops: adaptive pooling kernels against the CPU for many output sizes") {
  Tensor x = uniform_cpu({2, 3, 11, 9}, 80);
  x.narrow(2, 4, 1).narrow(3, 2, 1).fill_(kNaN);
  const Tensor strided = x.transpose(2, 3).contiguous().transpose(2, 3);
  for (std::array<int64_t, 2> size : {std::array<int64_t, 2>{1, 1}, {3, 3}, {4, 5}, {11, 9}, {13, 20}, {2, 9}}) {
    INFO("output " << size[0] << "x" << size[1]);
    const Shape shape{2, 3, size[0], size[1]};
    Tensor ac = empty_on(shape, kCPU), ag = empty_on(shape, kGpu);
    K::adaptive_avg_pool2d_forward(kCPU, x, ac);
    K::adaptive_avg_pool2d_forward(kGpu, strided.to(kGpu), ag);
    expect_same(ag, ac);
    Tensor mc = empty_on(shape, kCPU), mg = empty_on(shape, kGpu);
    Tensor ic = empty_on(shape, kCPU, DType::i64), ig = empty_on(shape, kGpu, DType::i64);
    K::adaptive_max_pool2d_forward(kCPU, x, mc, ic);
    K::adaptive_max_pool2d_forward(kGpu, strided.to(kGpu), mg, ig);
    expect_same(mg, mc);
    expect_same(ig, ic);
    const Tensor g = uniform_cpu(shape, 81);
    Tensor gc = empty_on(x.sizes(), kCPU), gg = empty_on(x.sizes(), kGpu);
    K::adaptive_avg_pool2d_backward(kCPU, g, gc);
    K::adaptive_avg_pool2d_backward(kGpu, g.to(kGpu), gg);
    expect_same(gg, gc);  // the same windows summed in the same order: bitwise equal
  }
}

TEST_CASE("cuda index ops: the ops on the device match the CPU, with gradients") {
  using autograd::gradcheck;
  const Tensor w = uniform_cpu({9, 4}, 90);
  const Tensor idx = ints_cpu({3, 5}, 91, 0, 9);
  Tensor wc = w.clone().requires_grad_(true), wg = w.to(kGpu).requires_grad_(true);
  Tensor ec = F::embedding(idx, wc, 2), eg = F::embedding(idx.to(kGpu), wg, 2);
  expect_same(eg, ec);
  sum(mul(ec, ec)).backward();
  sum(mul(eg, eg)).backward();
  expect_same(wg.grad(), wc.grad(), 1e-6);
  CHECK_THROWS_AS(F::embedding(from_vector(std::vector<int64_t>{9}).to(kGpu), wg), IndexError);

  const Tensor r = uniform_cpu({3, 6, 5}, 92);
  expect_same(amax(r.to(kGpu), {0, 2}), amax(r, {0, 2}));
  expect_same(amin(r.to(kGpu), {1}), amin(r, {1}));
  expect_same(argmax(r.to(kGpu)), argmax(r));
  expect_same(argmin(r.to(kGpu)), argmin(r));
  expect_same(masked_fill(r.to(kGpu), gt(r.to(kGpu), 0.5), -1.0), masked_fill(r, gt(r, 0.5), -1.0));

  auto param = [](const Tensor& t) { return t.to(kGpu).requires_grad_(true); };
  const Tensor gi = ints_cpu({3, 4, 5}, 93, 0, 6).to(kGpu);
  CHECK(gradcheck([&](const std::vector<Tensor>& in) { return gather(in[0], 1, gi); }, {param(r)}) == "");
  CHECK(gradcheck([&](const std::vector<Tensor>& in) { return scatter_add(in[0], 1, gi, in[1]); },
                  {param(r), param(uniform_cpu({3, 4, 5}, 94))}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return cumsum(in[0], 1); }, {param(r)}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return topk(in[0], 2, 1).first; }, {param(r)}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return amax(in[0], {0, 2}); }, {param(r)}) == "");
  const Tensor p = uniform_cpu({2, 2, 7, 5}, 95);
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return F::adaptive_avg_pool2d(in[0], {3, 2}); }, {param(p)}) ==
        "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return F::adaptive_max_pool2d(in[0], {3, 4}); }, {param(p)}) ==
        "");
  CHECK(gradcheck([&](const std::vector<Tensor>& in) { return F::embedding(idx.to(kGpu), in[0], 2); }, {param(w)}) ==
        "");
}
