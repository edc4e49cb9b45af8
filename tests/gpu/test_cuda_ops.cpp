// The CUDA compute kernels against their CPU twins (skipped without a device, see main.cpp): every
// elementwise, reduction, indexing, softmax/loss, convolution, pooling and batch-norm kernel on random
// inputs, including non-contiguous and expanded views and edge cases (empty tensors, NaN, i64, ignore
// index, label smoothing, ceil_mode, padding, groups, dilation); run-to-run reproducibility of the
// reductions; gradchecks on the device through the autograd ops; and a small CNN whose loss and
// gradients on CUDA equal those on the CPU.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
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

const Device kGpu = cuda_device(0);
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// The same tensor on the CPU and on the GPU.
struct Pair {
  Tensor cpu, gpu;
};

Pair pair_of(const Tensor& cpu) { return {cpu, cpu.to(kGpu)}; }

template <class Fn>
Pair map(const Pair& p, Fn f) {
  return {f(p.cpu), f(p.gpu)};
}

Pair empty_pair(const Shape& shape, DType dtype = DType::f32) {
  return {empty(shape, TensorOptions(dtype)), empty(shape, TensorOptions(dtype).with_device(kGpu))};
}

Pair uniform_pair(const Shape& shape, uint64_t seed, double lo = -2.0, double hi = 2.0) {
  Generator gen(seed);
  return pair_of(uniform(shape, lo, hi, {}, &gen));
}

Pair int_pair(const Shape& shape, uint64_t seed, int64_t lo, int64_t hi) {
  Generator gen(seed);
  std::vector<float> u = uniform(shape, 0.0, 1.0, {}, &gen).to_vector<float>();
  std::vector<int64_t> v(u.size());
  for (size_t i = 0; i < u.size(); ++i) v[i] = lo + static_cast<int64_t>(u[i] * static_cast<float>(hi - lo));
  return pair_of(from_vector(v, shape));
}

// Values with many ties (small integers as floats), for max/min/arg tests.
Pair tie_pair(const Shape& shape, uint64_t seed) {
  Pair p = int_pair(shape, seed, -3, 4);
  return pair_of(p.cpu.to(DType::f32));
}

bool close(double got, double want, double atol, double rtol) {
  if (std::isnan(want) || std::isnan(got)) return std::isnan(want) && std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::fabs(got - want) <= atol + rtol * std::fabs(want);
}

// The GPU tensor equals the CPU tensor (shape, dtype, values within tolerance; NaN matches NaN).
void expect_close(const Tensor& gpu, const Tensor& cpu, double atol = 1e-5, double rtol = 1e-5) {
  REQUIRE(gpu.device().is_cuda());
  REQUIRE(gpu.sizes() == cpu.sizes());
  REQUIRE(gpu.dtype() == cpu.dtype());
  if (cpu.dtype() == DType::i64) {
    const std::vector<int64_t> g = gpu.to_vector<int64_t>(), c = cpu.to_vector<int64_t>();
    for (size_t i = 0; i < c.size(); ++i)
      if (g[i] != c[i]) {
        FAIL_CHECK("i64 element " << i << ": got " << g[i] << ", expected " << c[i]);
        return;
      }
    return;
  }
  const std::vector<float> g = gpu.to_vector<float>(), c = cpu.to_vector<float>();
  for (size_t i = 0; i < c.size(); ++i)
    if (!close(g[i], c[i], atol, rtol)) {
      FAIL_CHECK("element " << i << " of " << c.size() << ": got " << g[i] << ", expected " << c[i]);
      return;
    }
}

void expect_close(const Pair& p, double atol = 1e-5, double rtol = 1e-5) { expect_close(p.gpu, p.cpu, atol, rtol); }

bool same_bits(const Tensor& a, const Tensor& b) {
  const std::vector<float> x = a.to_vector<float>(), y = b.to_vector<float>();
  return x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0);
}

// Views applied identically to the CPU and GPU copies of a base tensor of `shape`.
using ViewFn = std::function<Tensor(const Tensor&)>;
struct NamedView {
  const char* name;
  Shape base;  // shape of the base tensor the view is taken from
  ViewFn view;
};

// Views of shape [4, 3, 5]: contiguous, transposed, expanded from [4, 1, 5], sliced with a step.
std::vector<NamedView> views_435() {
  return {
      {"contiguous", {4, 3, 5}, [](const Tensor& t) { return t; }},
      {"transposed", {5, 3, 4}, [](const Tensor& t) { return t.transpose(0, 2); }},
      {"expanded", {4, 1, 5}, [](const Tensor& t) { return t.expand({4, 3, 5}); }},
      {"sliced", {4, 6, 5}, [](const Tensor& t) { return t.slice(1, 0, 6, 2); }},
  };
}

}  // namespace

// ---------------------------------------------------------------- elementwise

TEST_CASE("cuda ops: unary f32 matches the CPU on every view") {
  const K::UnaryOp ops[] = {K::UnaryOp::Neg,     K::UnaryOp::Exp,        K::UnaryOp::Log,       K::UnaryOp::Log1p,
                            K::UnaryOp::Sqrt,    K::UnaryOp::Rsqrt,      K::UnaryOp::Abs,       K::UnaryOp::Sign,
                            K::UnaryOp::Relu,    K::UnaryOp::Gelu,       K::UnaryOp::Tanh,      K::UnaryOp::Sigmoid,
                            K::UnaryOp::Softplus, K::UnaryOp::Square,    K::UnaryOp::Reciprocal, K::UnaryOp::Sin,
                            K::UnaryOp::Cos,     K::UnaryOp::Erf,        K::UnaryOp::PowScalar, K::UnaryOp::Clamp,
                            K::UnaryOp::AddScalar, K::UnaryOp::MulScalar, K::UnaryOp::RDivScalar, K::UnaryOp::RSubScalar};
  int seed = 1;
  for (const NamedView& v : views_435()) {
    for (K::UnaryOp op : ops) {
      const bool positive = op == K::UnaryOp::Log || op == K::UnaryOp::Sqrt || op == K::UnaryOp::Rsqrt ||
                            op == K::UnaryOp::PowScalar;
      const Pair base = positive ? uniform_pair(v.base, ++seed, 0.1, 3.0) : uniform_pair(v.base, ++seed, -25.0, 25.0);
      const Pair in = map(base, v.view);
      for (double alpha : {2.0, 0.5, -1.3}) {
        CAPTURE(v.name);
        CAPTURE(static_cast<int>(op));
        CAPTURE(alpha);
        Pair out = empty_pair({4, 3, 5});
        K::unary(kCPU, op, in.cpu, out.cpu, alpha, 1.5);
        K::unary(kGpu, op, in.gpu, out.gpu, alpha, 1.5);
        expect_close(out, 1e-6, 2e-6);
      }
    }
  }
}

TEST_CASE("cuda ops: unary in place, into a strided output, on NaN and on empty tensors") {
  Pair x = uniform_pair({6, 7}, 11);
  K::unary(kCPU, K::UnaryOp::Tanh, x.cpu, x.cpu, 0, 0);
  K::unary(kGpu, K::UnaryOp::Tanh, x.gpu, x.gpu, 0, 0);
  expect_close(x, 1e-6, 1e-6);

  Pair big = empty_pair({7, 6});
  Pair out = map(big, [](const Tensor& t) { return t.t(); });  // [6, 7] with strides (1, 6)
  K::unary(kCPU, K::UnaryOp::Exp, x.cpu, out.cpu, 0, 0);
  K::unary(kGpu, K::UnaryOp::Exp, x.gpu, out.gpu, 0, 0);
  expect_close(out, 1e-6, 1e-6);

  Pair special = pair_of(from_vector(std::vector<float>{kNaN, -0.0f, 0.0f, INFINITY, -INFINITY, 3.0f}));
  for (K::UnaryOp op : {K::UnaryOp::Abs, K::UnaryOp::Sign, K::UnaryOp::Relu, K::UnaryOp::Clamp, K::UnaryOp::Sigmoid,
                        K::UnaryOp::Softplus, K::UnaryOp::Tanh}) {
    CAPTURE(static_cast<int>(op));
    Pair o = empty_pair({6});
    K::unary(kCPU, op, special.cpu, o.cpu, -1.0, 1.0);
    K::unary(kGpu, op, special.gpu, o.gpu, -1.0, 1.0);
    expect_close(o, 0, 1e-6);
  }

  Pair e = empty_pair({0, 3}), eo = empty_pair({0, 3});
  K::unary(kGpu, K::UnaryOp::Exp, e.gpu, eo.gpu, 0, 0);  // no launch, no error
  CHECK(eo.gpu.numel() == 0);
}

TEST_CASE("cuda ops: NaN through relu, clamp, maximum/minimum, max/min and max_pool2d, with gradients") {
  // The same values and gradients on both devices, NaN for NaN (the CPU side is checked against
  // PyTorch in tests/test_parity.cpp). Relu's backward is the fused kernel here (no create_graph).
  const std::vector<float> xv{kNaN, -1, 2, 0, 1.5f, kNaN, -3, 0.25f};
  const Tensor x = from_vector(xv, {2, 4});
  const Tensor other = from_vector(std::vector<float>{1, kNaN, 2, -1, kNaN, 0, -3, 5}, {2, 4});
  using Fn = std::function<Tensor(const Tensor&, const Tensor&)>;
  const std::vector<std::pair<const char*, Fn>> cases = {
      {"relu", [](const Tensor& a, const Tensor&) { return relu(a); }},
      {"clamp", [](const Tensor& a, const Tensor&) { return clamp(a, -0.5, 0.5); }},
      {"maximum", [](const Tensor& a, const Tensor& b) { return maximum(a, b); }},
      {"minimum", [](const Tensor& a, const Tensor& b) { return minimum(a, b); }},
      {"max", [](const Tensor& a, const Tensor&) { return max(a); }},
      {"min over dim 1", [](const Tensor& a, const Tensor&) { return min(a, 1).first; }},
      {"max over dim 0", [](const Tensor& a, const Tensor&) { return max(a, 0).first; }},
      {"max_pool2d", [](const Tensor& a, const Tensor&) { return F::max_pool2d(a.reshape({1, 2, 2, 2}), {2, 2}); }},
  };
  for (const auto& [name, fn] : cases) {
    CAPTURE(name);
    Pair a = pair_of(x.clone()), b = pair_of(other.clone());
    for (Tensor* t : {&a.cpu, &a.gpu, &b.cpu, &b.gpu}) t->requires_grad_(true);
    const Pair y = {fn(a.cpu, b.cpu), fn(a.gpu, b.gpu)};
    expect_close(y, 0, 0);
    sum(y.cpu).backward();
    sum(y.gpu).backward();
    expect_close(a.gpu.grad(), a.cpu.grad(), 0, 0);
    if (b.cpu.grad().defined()) expect_close(b.gpu.grad(), b.cpu.grad(), 0, 0);
  }
  // relu keeps NaN and its backward passes the gradient there (fixed values, not only CPU == GPU)
  const Pair nan_in = pair_of(from_vector(std::vector<float>{kNaN, -1, 2}));
  Pair r = empty_pair({3}), g = empty_pair({3});
  K::unary(kGpu, K::UnaryOp::Relu, nan_in.gpu, r.gpu, 0, 0);
  K::binary(kGpu, K::BinaryOp::ReluBackward, ones({3}).to(kGpu), r.gpu, g.gpu);
  const std::vector<float> rv = r.gpu.to_vector<float>(), gv = g.gpu.to_vector<float>();
  CHECK(std::isnan(rv[0]));
  CHECK(gv == std::vector<float>{1, 0, 1});
}

TEST_CASE("cuda ops: unary i64 variants and refusals") {
  const Pair in = int_pair({5, 8}, 21, -50, 50);
  for (K::UnaryOp op : {K::UnaryOp::Neg, K::UnaryOp::Abs, K::UnaryOp::Sign, K::UnaryOp::AddScalar,
                        K::UnaryOp::MulScalar, K::UnaryOp::RSubScalar, K::UnaryOp::Clamp}) {
    CAPTURE(static_cast<int>(op));
    const Pair v = map(in, [](const Tensor& t) { return t.t(); });
    Pair out = empty_pair({8, 5}, DType::i64);
    K::unary(kCPU, op, v.cpu, out.cpu, 7.0, 20.0);
    K::unary(kGpu, op, v.gpu, out.gpu, 7.0, 20.0);
    expect_close(out);
  }
  // a one-sided clamp passes the missing bound as +-2^63: it saturates, never wraps
  const Pair small = pair_of(from_vector(std::vector<int64_t>{-5, 0, 3, 100}));
  for (const Tensor& t : {small.cpu, small.gpu}) {
    CHECK(clamp(t, 0.0, std::nullopt).to_vector<int64_t>() == std::vector<int64_t>{0, 0, 3, 100});
    CHECK(clamp(t, std::nullopt, 3.0).to_vector<int64_t>() == std::vector<int64_t>{-5, 0, 3, 3});
  }
  Pair out = empty_pair({5, 8}, DType::i64);
  CHECK_THROWS_AS(K::unary(kGpu, K::UnaryOp::Exp, in.gpu, out.gpu, 0, 0), TypeError);
}

TEST_CASE("cuda ops: binary f32 arithmetic, comparisons and backward ops with broadcasting") {
  const K::BinaryOp ops[] = {K::BinaryOp::Add,          K::BinaryOp::Sub,          K::BinaryOp::Mul,
                             K::BinaryOp::Div,          K::BinaryOp::Pow,          K::BinaryOp::Maximum,
                             K::BinaryOp::Minimum,      K::BinaryOp::Eq,           K::BinaryOp::Ne,
                             K::BinaryOp::Lt,           K::BinaryOp::Le,           K::BinaryOp::Gt,
                             K::BinaryOp::Ge,           K::BinaryOp::ReluBackward, K::BinaryOp::GeluBackward,
                             K::BinaryOp::TanhBackward, K::BinaryOp::SigmoidBackward};
  int seed = 100;
  const std::vector<NamedView> views = views_435();
  for (size_t vi = 0; vi < views.size(); ++vi) {
    const NamedView& va = views[vi];
    const NamedView& vb = views[(vi + 1) % views.size()];
    for (K::BinaryOp op : ops) {
      CAPTURE(va.name);
      CAPTURE(vb.name);
      CAPTURE(static_cast<int>(op));
      const bool positive = op == K::BinaryOp::Pow;
      Pair a = map(positive ? uniform_pair(va.base, ++seed, 0.1, 3.0) : tie_pair(va.base, ++seed), va.view);
      Pair b = map(uniform_pair(vb.base, ++seed, -2.0, 2.0), vb.view);
      if (op >= K::BinaryOp::Eq && op <= K::BinaryOp::Ge) b = map(tie_pair(vb.base, ++seed), vb.view);
      Pair out = empty_pair({4, 3, 5});
      K::binary(kCPU, op, a.cpu, b.cpu, out.cpu);
      K::binary(kGpu, op, a.gpu, b.gpu, out.gpu);
      expect_close(out, 1e-6, 2e-6);
    }
  }
}

TEST_CASE("cuda ops: binary NaN rules, i64 ops, aliasing and refusals") {
  const Pair a = pair_of(from_vector(std::vector<float>{kNaN, 1.0f, kNaN, 2.0f, -1.0f}));
  const Pair b = pair_of(from_vector(std::vector<float>{1.0f, kNaN, kNaN, 3.0f, -1.0f}));
  for (K::BinaryOp op : {K::BinaryOp::Maximum, K::BinaryOp::Minimum, K::BinaryOp::Eq, K::BinaryOp::Ne,
                         K::BinaryOp::Lt, K::BinaryOp::Ge}) {
    CAPTURE(static_cast<int>(op));
    Pair out = empty_pair({5});
    K::binary(kCPU, op, a.cpu, b.cpu, out.cpu);
    K::binary(kGpu, op, a.gpu, b.gpu, out.gpu);
    expect_close(out, 0, 0);
  }

  const Pair x = int_pair({6, 4}, 31, -9, 9), y = int_pair({4}, 32, -9, 9);
  const Pair ye = map(y, [](const Tensor& t) { return t.unsqueeze(0).expand({6, 4}); });
  for (K::BinaryOp op : {K::BinaryOp::Add, K::BinaryOp::Sub, K::BinaryOp::Mul, K::BinaryOp::Maximum,
                         K::BinaryOp::Minimum}) {
    CAPTURE(static_cast<int>(op));
    Pair out = empty_pair({6, 4}, DType::i64);
    K::binary(kCPU, op, x.cpu, ye.cpu, out.cpu);
    K::binary(kGpu, op, x.gpu, ye.gpu, out.gpu);
    expect_close(out);
  }
  for (K::BinaryOp op : {K::BinaryOp::Eq, K::BinaryOp::Ne, K::BinaryOp::Lt, K::BinaryOp::Le, K::BinaryOp::Gt,
                         K::BinaryOp::Ge}) {
    CAPTURE(static_cast<int>(op));
    Pair out = empty_pair({6, 4});
    K::binary(kCPU, op, x.cpu, ye.cpu, out.cpu);
    K::binary(kGpu, op, x.gpu, ye.gpu, out.gpu);
    expect_close(out, 0, 0);
  }
  Pair out = empty_pair({6, 4}, DType::i64);
  CHECK_THROWS_AS(K::binary(kGpu, K::BinaryOp::Div, x.gpu, ye.gpu, out.gpu), TypeError);

  // out aliases a
  Pair p = uniform_pair({3, 5}, 33), q = uniform_pair({3, 5}, 34);
  K::binary(kCPU, K::BinaryOp::Mul, p.cpu, q.cpu, p.cpu);
  K::binary(kGpu, K::BinaryOp::Mul, p.gpu, q.gpu, p.gpu);
  expect_close(p, 0, 0);
}

TEST_CASE("cuda ops: where for f32 and i64 with broadcast condition") {
  const Pair cond = map(tie_pair({1, 3, 5}, 41), [](const Tensor& t) { return t.expand({4, 3, 5}); });
  const Pair a = map(uniform_pair({5, 3, 4}, 42), [](const Tensor& t) { return t.transpose(0, 2); });
  const Pair b = map(uniform_pair({5}, 43), [](const Tensor& t) { return t.expand({4, 3, 5}); });
  Pair out = empty_pair({4, 3, 5});
  K::where(kCPU, cond.cpu, a.cpu, b.cpu, out.cpu);
  K::where(kGpu, cond.gpu, a.gpu, b.gpu, out.gpu);
  expect_close(out, 0, 0);

  const Pair ai = int_pair({4, 3, 5}, 44, -100, 100), bi = int_pair({4, 3, 5}, 45, -100, 100);
  Pair outi = empty_pair({4, 3, 5}, DType::i64);
  K::where(kCPU, cond.cpu, ai.cpu, bi.cpu, outi.cpu);
  K::where(kGpu, cond.gpu, ai.gpu, bi.gpu, outi.gpu);
  expect_close(outi);
}

// ---------------------------------------------------------------- reductions

namespace {

Shape reduced_shape(const Shape& s, uint32_t mask) {
  Shape r = s;
  for (int d = 0; d < s.size(); ++d)
    if (mask & (1u << d)) r[d] = 1;
  return r;
}

void check_reduce(K::ReduceOp op, const Pair& in, uint32_t mask, double param, double atol, double rtol) {
  const Shape shape = reduced_shape(in.cpu.sizes(), mask);
  Pair out = empty_pair(shape, in.cpu.dtype());
  K::reduce(kCPU, op, in.cpu, mask, out.cpu, param);
  K::reduce(kGpu, op, in.gpu, mask, out.gpu, param);
  expect_close(out, atol, rtol);
}

}  // namespace

TEST_CASE("cuda ops: reduce f32 over every dim mask and layout") {
  struct OpCase {
    K::ReduceOp op;
    double param;
  };
  const OpCase cases[] = {{K::ReduceOp::Sum, 0},  {K::ReduceOp::Mean, 0}, {K::ReduceOp::Max, 0},
                          {K::ReduceOp::Min, 0},  {K::ReduceOp::Prod, 0}, {K::ReduceOp::Norm, 2},
                          {K::ReduceOp::Norm, 1}, {K::ReduceOp::Norm, 3}, {K::ReduceOp::Norm, INFINITY},
                          {K::ReduceOp::Norm, -INFINITY}, {K::ReduceOp::Norm, 0}};
  int seed = 200;
  for (const NamedView& v : views_435()) {
    for (const OpCase& c : cases) {
      const Pair in = map(c.op == K::ReduceOp::Prod ? uniform_pair(v.base, ++seed, 0.5, 1.5)
                                                    : uniform_pair(v.base, ++seed),
                          v.view);
      for (uint32_t mask = 0; mask < 8; ++mask) {
        CAPTURE(v.name);
        CAPTURE(static_cast<int>(c.op));
        CAPTURE(c.param);
        CAPTURE(mask);
        check_reduce(c.op, in, mask, c.param, 1e-5, 1e-5);
      }
    }
  }
}

TEST_CASE("cuda ops: long reductions are split, merged in order and reproducible") {
  // rows: one long row, a few long rows; columns: tall and narrow; and a 0-d-like full reduction
  const Pair rows = uniform_pair({3, 200003}, 301);
  const Pair tall = uniform_pair({150001, 3}, 302);
  for (K::ReduceOp op : {K::ReduceOp::Sum, K::ReduceOp::Mean, K::ReduceOp::Max, K::ReduceOp::Min}) {
    CAPTURE(static_cast<int>(op));
    check_reduce(op, rows, 0b10, 0, 1e-4, 1e-5);
    check_reduce(op, rows, 0b11, 0, 1e-4, 1e-5);
    check_reduce(op, tall, 0b01, 0, 1e-4, 1e-5);
    check_reduce(op, tall, 0b11, 0, 1e-4, 1e-5);
  }
  check_reduce(K::ReduceOp::Norm, rows, 0b10, 2.0, 1e-4, 1e-5);
  // many short rows (a thread per row) and many rows just past that limit (a block per row)
  for (const Shape& shape : {Shape{2000, 7}, Shape{1500, 40}}) {
    const Pair many = uniform_pair(shape, 303);
    for (K::ReduceOp op : {K::ReduceOp::Sum, K::ReduceOp::Max, K::ReduceOp::Prod}) check_reduce(op, many, 0b10, 0, 1e-5, 1e-5);
  }
  Tensor first = empty({1, 3}, TensorOptions().with_device(kGpu)), second = empty({1, 3}, TensorOptions().with_device(kGpu));
  K::reduce(kGpu, K::ReduceOp::Sum, tall.gpu, 0b01, first, 0);
  K::reduce(kGpu, K::ReduceOp::Sum, tall.gpu, 0b01, second, 0);
  CHECK(same_bits(first, second));
  Tensor v1 = empty({3, 1}, TensorOptions().with_device(kGpu)), v2 = empty({3, 1}, TensorOptions().with_device(kGpu));
  K::var(kGpu, rows.gpu, 0b10, 1.0, v1);
  K::var(kGpu, rows.gpu, 0b10, 1.0, v2);
  CHECK(same_bits(v1, v2));
  // split variance (rows and columns paths, many pieces) against the CPU
  Pair vr = empty_pair({3, 1}), vt = empty_pair({1, 3});
  K::var(kCPU, rows.cpu, 0b10, 1.0, vr.cpu);
  K::var(kGpu, rows.gpu, 0b10, 1.0, vr.gpu);
  expect_close(vr, 1e-6, 1e-5);
  K::var(kCPU, tall.cpu, 0b01, 0.0, vt.cpu);
  K::var(kGpu, tall.gpu, 0b01, 0.0, vt.gpu);
  expect_close(vt, 1e-6, 1e-5);
}

TEST_CASE("cuda ops: reduce i64, NaN, empty and refusals") {
  const Pair xi = int_pair({4, 6, 5}, 311, -4, 5);
  for (K::ReduceOp op : {K::ReduceOp::Sum, K::ReduceOp::Max, K::ReduceOp::Min, K::ReduceOp::Prod})
    for (uint32_t mask : {1u, 2u, 4u, 5u, 7u}) {
      CAPTURE(static_cast<int>(op));
      CAPTURE(mask);
      check_reduce(op, map(xi, [](const Tensor& t) { return t.transpose(0, 1); }), mask, 0, 0, 0);
    }
  Pair out = empty_pair({1, 6, 5}, DType::i64);
  CHECK_THROWS_AS(K::reduce(kGpu, K::ReduceOp::Mean, xi.gpu, 1u, out.gpu, 0), TypeError);

  // a NaN wins max and min and propagates through sums
  const Pair nan = pair_of(from_vector(std::vector<float>{1, kNaN, 3, 4, 5, 6, kNaN, 8}, {2, 4}));
  for (K::ReduceOp op : {K::ReduceOp::Sum, K::ReduceOp::Max, K::ReduceOp::Min})
    for (uint32_t mask : {1u, 2u, 3u}) check_reduce(op, nan, mask, 0, 0, 1e-6);

  // empty reductions: sum 0, mean NaN; and an empty output
  const Pair empty_rows = pair_of(zeros({0, 4}));
  check_reduce(K::ReduceOp::Sum, empty_rows, 1u, 0, 0, 0);
  check_reduce(K::ReduceOp::Mean, empty_rows, 1u, 0, 0, 0);
  check_reduce(K::ReduceOp::Sum, empty_rows, 2u, 0, 0, 0);
}

TEST_CASE("cuda ops: arg max / arg min with ties, NaN, i64 and long dims") {
  // Max and min of f32 `in` over `dim` on both devices: values and indices must agree exactly.
  auto check_both_ops = [](const Pair& in, int dim) {
    Shape s = in.cpu.sizes();
    s.erase(dim);
    for (K::ReduceOp op : {K::ReduceOp::Max, K::ReduceOp::Min}) {
      Pair values = empty_pair(s), indices = empty_pair(s, DType::i64);
      K::arg_reduce(kCPU, op, in.cpu, dim, values.cpu, indices.cpu);
      K::arg_reduce(kGpu, op, in.gpu, dim, values.gpu, indices.gpu);
      expect_close(values, 0, 0);
      expect_close(indices);
    }
  };
  int seed = 400;
  for (const NamedView& v : views_435()) {
    const Pair in = map(tie_pair(v.base, ++seed), v.view);
    for (int dim = 0; dim < 3; ++dim) {
      CAPTURE(v.name);
      CAPTURE(dim);
      check_both_ops(in, dim);
    }
  }
  // NaN: the first NaN wins
  check_both_ops(pair_of(from_vector(std::vector<float>{1, kNaN, 3, kNaN, 9, 2, 9, 0}, {2, 4})), 1);
  // long dims take the block path (ties and NaN included)
  Pair longer = tie_pair({3, 5000}, 420);
  longer.cpu = longer.cpu.clone();
  {
    std::vector<float> v = longer.cpu.to_vector<float>();
    v[2 * 5000 + 4321] = kNaN;
    v[2 * 5000 + 4400] = kNaN;
    longer = pair_of(from_vector(v, {3, 5000}));
  }
  check_both_ops(longer, 1);
  const Pair xi = int_pair({5, 7}, 430, -3, 3);
  Pair values = empty_pair({7}, DType::i64), indices = empty_pair({7}, DType::i64);
  K::arg_reduce(kCPU, K::ReduceOp::Max, xi.cpu, 0, values.cpu, indices.cpu);
  K::arg_reduce(kGpu, K::ReduceOp::Max, xi.gpu, 0, values.gpu, indices.gpu);
  expect_close(values);
  expect_close(indices);
  Pair e = pair_of(zeros({3, 0})), ev = empty_pair({3}), ei = empty_pair({3}, DType::i64);
  CHECK_THROWS_AS(K::arg_reduce(kGpu, K::ReduceOp::Max, e.gpu, 1, ev.gpu, ei.gpu), ValueError);
}

TEST_CASE("cuda ops: var over every mask with both corrections") {
  int seed = 500;
  for (const NamedView& v : views_435()) {
    const Pair in = map(uniform_pair(v.base, ++seed), v.view);
    for (uint32_t mask = 1; mask < 8; ++mask)
      for (double correction : {0.0, 1.0}) {
        CAPTURE(v.name);
        CAPTURE(mask);
        CAPTURE(correction);
        Pair out = empty_pair(reduced_shape(in.cpu.sizes(), mask));
        K::var(kCPU, in.cpu, mask, correction, out.cpu);
        K::var(kGpu, in.gpu, mask, correction, out.gpu);
        expect_close(out, 1e-5, 1e-5);
      }
  }
}

// ---------------------------------------------------------------- indexing

TEST_CASE("cuda ops: index_select on every dim, strided inputs, i64, repeats and bad indices") {
  const Pair in = map(uniform_pair({6, 5, 4}, 601), [](const Tensor& t) { return t.transpose(0, 2); });  // [4,5,6]
  const Pair idx = pair_of(from_vector(std::vector<int64_t>{3, 0, 3, 1, 2}));
  for (int dim = 0; dim < 3; ++dim) {
    CAPTURE(dim);
    Shape s = in.cpu.sizes();
    s[dim] = 5;
    const Pair index = map(idx, [&](const Tensor& t) {
      return dim == 0 ? t : t.slice(0, 0, 5, 1);
    });
    Pair out = empty_pair(s);
    K::index_select(kCPU, in.cpu, dim, index.cpu, out.cpu);
    K::index_select(kGpu, in.gpu, dim, index.gpu, out.gpu);
    expect_close(out, 0, 0);
  }
  // strided index and i64 values
  const Pair xi = int_pair({7, 3}, 602, -100, 100);
  const Pair wide = pair_of(from_vector(std::vector<int64_t>{6, 9, 0, 9, 6, 9}));
  const Pair strided_idx = map(wide, [](const Tensor& t) { return t.slice(0, 0, 6, 2); });  // {6, 0, 6}
  Pair out = empty_pair({3, 3}, DType::i64);
  K::index_select(kCPU, xi.cpu, 0, strided_idx.cpu, out.cpu);
  K::index_select(kGpu, xi.gpu, 0, strided_idx.gpu, out.gpu);
  expect_close(out);
  // empty index
  const Pair none = pair_of(from_vector(std::vector<int64_t>{}));
  Pair eo = empty_pair({0, 3}, DType::i64);
  K::index_select(kGpu, xi.gpu, 0, none.gpu, eo.gpu);
  // out of range and negative
  for (int64_t bad : {7, -1}) {
    CAPTURE(bad);
    const Pair b = pair_of(from_vector(std::vector<int64_t>{0, 2, bad, 1}));
    Pair o = empty_pair({4, 3}, DType::i64);
    CHECK_THROWS_AS(K::index_select(kGpu, xi.gpu, 0, b.gpu, o.gpu), IndexError);
  }
}

TEST_CASE("cuda ops: index_add by owner threads and by atomics, strided out, i64") {
  // owner path: many (outer, inner) positions
  {
    const Pair src = uniform_pair({40, 6, 500}, 701);
    const Pair idx = pair_of(from_vector(std::vector<int64_t>{2, 0, 2, 3, 2, 1}));
    Pair out = uniform_pair({40, 4, 500}, 702);
    K::index_add(kCPU, out.cpu, 1, idx.cpu, src.cpu);
    K::index_add(kGpu, out.gpu, 1, idx.gpu, src.gpu);
    expect_close(out, 1e-5, 1e-5);
  }
  // atomic path: few positions, many indices (an embedding-style gradient)
  {
    Generator gen(703);
    std::vector<int64_t> ids(3000);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>((i * 7919) % 50);
    const Pair idx = pair_of(from_vector(ids));
    const Pair src = uniform_pair({3000, 16}, 704);
    Pair out = pair_of(zeros({50, 16}));
    K::index_add(kCPU, out.cpu, 0, idx.cpu, src.cpu);
    K::index_add(kGpu, out.gpu, 0, idx.gpu, src.gpu);
    expect_close(out, 1e-4, 1e-5);
    const Pair srci = int_pair({3000, 16}, 705, -1000, 1000);
    Pair outi = pair_of(zeros({50, 16}, DType::i64));
    K::index_add(kCPU, outi.cpu, 0, idx.cpu, srci.cpu);
    K::index_add(kGpu, outi.gpu, 0, idx.gpu, srci.gpu);
    expect_close(outi);
  }
  // strided out and src
  {
    Pair base = uniform_pair({5, 4}, 706);
    Pair out = map(base, [](const Tensor& t) { return t.t(); });  // [4, 5] with strides (1, 4)
    const Pair src = map(uniform_pair({5, 3}, 707), [](const Tensor& t) { return t.t(); });  // [3, 5]
    const Pair idx = pair_of(from_vector(std::vector<int64_t>{3, 3, 0}));
    K::index_add(kCPU, out.cpu, 0, idx.cpu, src.cpu);
    K::index_add(kGpu, out.gpu, 0, idx.gpu, src.gpu);
    expect_close(out, 1e-6, 1e-6);
    expect_close(base, 1e-6, 1e-6);
  }
  Pair out = pair_of(zeros({4, 5}));
  const Pair src = uniform_pair({2, 5}, 708);
  const Pair bad = pair_of(from_vector(std::vector<int64_t>{1, 4}));
  CHECK_THROWS_AS(K::index_add(kGpu, out.gpu, 0, bad.gpu, src.gpu), IndexError);
}

// ---------------------------------------------------------------- softmax and losses

TEST_CASE("cuda ops: softmax and log_softmax forward and backward along every dim") {
  int seed = 800;
  for (const NamedView& v : views_435()) {
    const Pair x = map(uniform_pair(v.base, ++seed, -5, 5), v.view);
    const Pair g = uniform_pair({4, 3, 5}, ++seed);
    for (int dim = 0; dim < 3; ++dim)
      for (bool log : {false, true}) {
        CAPTURE(v.name);
        CAPTURE(dim);
        CAPTURE(log);
        Pair y = empty_pair({4, 3, 5});
        K::softmax(kCPU, x.cpu, dim, log, y.cpu);
        K::softmax(kGpu, x.gpu, dim, log, y.gpu);
        expect_close(y, 1e-6, 1e-5);
        Pair gi = empty_pair({4, 3, 5});
        K::softmax_backward(kCPU, g.cpu, y.cpu, dim, log, gi.cpu);
        K::softmax_backward(kGpu, g.gpu, y.gpu, dim, log, gi.gpu);
        expect_close(gi, 1e-5, 1e-4);
      }
  }
  // long rows (block path with several strides per thread) and large values
  const Pair x = uniform_pair({3, 3001}, 850, -60, 60);
  const Pair g = uniform_pair({3, 3001}, 851);
  for (bool log : {false, true}) {
    Pair y = empty_pair({3, 3001});
    K::softmax(kCPU, x.cpu, 1, log, y.cpu);
    K::softmax(kGpu, x.gpu, 1, log, y.gpu);
    expect_close(y, 1e-6, 1e-4);
    // the block-per-row backward (long rows, inner 1); atol covers the float sum of 3001 gradients
    Pair gi = empty_pair({3, 3001});
    K::softmax_backward(kCPU, g.cpu, y.cpu, 1, log, gi.cpu);
    K::softmax_backward(kGpu, g.gpu, y.gpu, 1, log, gi.gpu);
    expect_close(gi, 1e-4, 1e-4);
  }
}

TEST_CASE("cuda ops: cross entropy with smoothing, ignore_index and bad targets") {
  for (int64_t classes : {10, 1000}) {
    const int64_t rows = 37;
    const Pair logits = map(uniform_pair({classes, rows}, 900 + classes, -4, 4),
                            [](const Tensor& t) { return t.t(); });  // non-contiguous [rows, classes]
    std::vector<int64_t> t(rows);
    for (int64_t i = 0; i < rows; ++i) t[i] = (i * 13) % classes;
    t[3] = -100;
    t[20] = -100;
    const Pair target = pair_of(from_vector(t));
    const Pair grad_loss = uniform_pair({rows}, 901);
    for (double smoothing : {0.0, 0.1}) {
      CAPTURE(classes);
      CAPTURE(smoothing);
      Pair loss = empty_pair({rows}), lse = empty_pair({rows});
      K::cross_entropy_forward(kCPU, logits.cpu, target.cpu, Tensor(), smoothing, -100, loss.cpu, lse.cpu);
      K::cross_entropy_forward(kGpu, logits.gpu, target.gpu, Tensor(), smoothing, -100, loss.gpu, lse.gpu);
      expect_close(loss, 1e-5, 1e-5);
      expect_close(lse, 1e-5, 1e-5);
      Pair grad = empty_pair({rows, classes});
      K::cross_entropy_backward(kCPU, grad_loss.cpu, logits.cpu, target.cpu, Tensor(), lse.cpu, smoothing, -100, grad.cpu);
      K::cross_entropy_backward(kGpu, grad_loss.gpu, logits.gpu, target.gpu, Tensor(), lse.gpu, smoothing, -100, grad.gpu);
      expect_close(grad, 1e-6, 1e-5);
    }
  }
  const Pair logits = uniform_pair({3, 5}, 902);
  Pair loss = empty_pair({3}), lse = empty_pair({3});
  for (int64_t bad : {5, -1}) {
    const Pair target = pair_of(from_vector(std::vector<int64_t>{0, bad, 2}));
    CHECK_THROWS_AS(K::cross_entropy_forward(kGpu, logits.gpu, target.gpu, Tensor(), 0.0, -100, loss.gpu, lse.gpu), IndexError);
  }
}

// ---------------------------------------------------------------- convolution

namespace {

struct ConvCase {
  const char* name;
  int64_t n, c, h, w, o, kh, kw;
  K::Conv2dParams p;
  bool bias;
};

int64_t conv_out(int64_t in, int64_t k, int64_t stride, int64_t pad, int64_t dil) {
  return (in + 2 * pad - dil * (k - 1) - 1) / stride + 1;
}

}  // namespace

TEST_CASE("cuda ops: conv2d forward, backward input and weight against the CPU") {
  auto params = [](int64_t s_h, int64_t s_w, int64_t p_h, int64_t p_w, int64_t d_h, int64_t d_w, int64_t g) {
    K::Conv2dParams p;
    p.stride_h = s_h, p.stride_w = s_w, p.pad_h = p_h, p.pad_w = p_w, p.dilation_h = d_h, p.dilation_w = d_w;
    p.groups = g;
    return p;
  };
  const ConvCase cases[] = {
      {"plain 3x2", 2, 3, 7, 6, 4, 3, 2, params(1, 1, 0, 0, 1, 1, 1), true},
      {"stride 2 pad 1", 3, 2, 9, 8, 5, 3, 3, params(2, 2, 1, 1, 1, 1, 1), true},
      {"dilation and asymmetric stride", 2, 3, 11, 10, 4, 3, 2, params(2, 1, 2, 1, 2, 3, 1), false},
      {"groups 2", 2, 4, 6, 7, 6, 3, 3, params(1, 1, 1, 1, 1, 1, 2), true},
      {"depthwise", 2, 3, 5, 5, 3, 3, 3, params(1, 2, 1, 0, 1, 1, 3), true},
      {"pointwise", 3, 5, 4, 6, 7, 1, 1, params(1, 1, 0, 0, 1, 1, 1), true},
      {"batch of one, big kernel", 1, 2, 8, 8, 3, 5, 5, params(1, 1, 2, 2, 1, 1, 1), true},
  };
  uint64_t seed = 1000;
  for (const ConvCase& c : cases) {
    for (bool permuted : {false, true}) {
      CAPTURE(c.name);
      CAPTURE(permuted);
      const int64_t oh = conv_out(c.h, c.kh, c.p.stride_h, c.p.pad_h, c.p.dilation_h);
      const int64_t ow = conv_out(c.w, c.kw, c.p.stride_w, c.p.pad_w, c.p.dilation_w);
      // x as an NHWC buffer seen as NCHW when permuted
      const Pair x = permuted ? map(uniform_pair({c.n, c.h, c.w, c.c}, ++seed),
                                    [](const Tensor& t) { return t.permute({0, 3, 1, 2}); })
                              : uniform_pair({c.n, c.c, c.h, c.w}, ++seed);
      const Pair w = uniform_pair({c.o, c.c / c.p.groups, c.kh, c.kw}, ++seed, -0.5, 0.5);
      const Pair b = c.bias ? uniform_pair({c.o}, ++seed) : Pair{};
      Pair out = empty_pair({c.n, c.o, oh, ow});
      K::conv2d_forward(kCPU, x.cpu, w.cpu, b.cpu, c.p, out.cpu);
      K::conv2d_forward(kGpu, x.gpu, w.gpu, b.gpu, c.p, out.gpu);
      expect_close(out, 1e-4, 1e-4);

      const Pair go = uniform_pair({c.n, c.o, oh, ow}, ++seed);
      Pair gx = empty_pair({c.n, c.c, c.h, c.w});
      K::conv2d_backward_input(kCPU, go.cpu, w.cpu, c.p, gx.cpu);
      K::conv2d_backward_input(kGpu, go.gpu, w.gpu, c.p, gx.gpu);
      expect_close(gx, 1e-4, 1e-4);

      Pair gw = empty_pair(w.cpu.sizes());
      Pair gb = c.bias ? empty_pair({c.o}) : Pair{};
      K::conv2d_backward_weight(kCPU, go.cpu, x.cpu, c.p, gw.cpu, gb.cpu);
      K::conv2d_backward_weight(kGpu, go.gpu, x.gpu, c.p, gw.gpu, gb.gpu);
      expect_close(gw, 1e-4, 1e-4);
      if (c.bias) expect_close(gb, 1e-4, 1e-5);

      // reproducible
      Pair gw2 = empty_pair(w.cpu.sizes());
      Tensor none;
      K::conv2d_backward_weight(kGpu, go.gpu, x.gpu, c.p, gw2.gpu, none);
      CHECK(same_bits(gw.gpu, gw2.gpu));
    }
  }
  // grad_bias only (x undefined), and an empty batch
  {
    const Pair go = uniform_pair({2, 3, 4, 4}, 1100);
    Tensor none;
    Pair gb = empty_pair({3});
    K::conv2d_backward_weight(kCPU, go.cpu, none, K::Conv2dParams{}, none, gb.cpu);
    K::conv2d_backward_weight(kGpu, go.gpu, none, K::Conv2dParams{}, none, gb.gpu);
    expect_close(gb, 1e-5, 1e-5);
  }
  {
    const Pair x = pair_of(zeros({0, 2, 5, 5}));
    const Pair w = uniform_pair({3, 2, 3, 3}, 1101);
    const Pair go = pair_of(zeros({0, 3, 3, 3}));
    Pair gw = empty_pair({3, 2, 3, 3}), gb = empty_pair({3});
    K::conv2d_backward_weight(kCPU, go.cpu, x.cpu, K::Conv2dParams{}, gw.cpu, gb.cpu);
    K::conv2d_backward_weight(kGpu, go.gpu, x.gpu, K::Conv2dParams{}, gw.gpu, gb.gpu);
    expect_close(gw, 0, 0);
    expect_close(gb, 0, 0);
  }
}

// ---------------------------------------------------------------- pooling

namespace {

int64_t pool_out(int64_t in, int64_t k, int64_t s, int64_t p, bool ceil_mode) {
  const int64_t span = in + 2 * p - k;
  int64_t o = (ceil_mode ? (span + s - 1) / s : span / s) + 1;
  if (ceil_mode && (o - 1) * s >= in + p) --o;  // the last window must start inside the input or left padding
  return o;
}

K::Pool2dParams pool_params(int64_t k, int64_t s, int64_t p, bool ceil_mode, bool include_pad) {
  K::Pool2dParams q;
  q.kernel_h = q.kernel_w = k;
  q.stride_h = q.stride_w = s;
  q.pad_h = q.pad_w = p;
  q.ceil_mode = ceil_mode;
  q.count_include_pad = include_pad;
  return q;
}

}  // namespace

TEST_CASE("cuda ops: max and avg pooling forward and backward") {
  struct PoolCase {
    int64_t k, s, p;
    bool ceil_mode, include_pad;
  };
  const PoolCase cases[] = {{2, 2, 0, false, true}, {3, 2, 1, false, true}, {3, 2, 1, true, false},
                            {3, 1, 1, false, false}, {2, 3, 0, true, true},  {3, 2, 0, true, true}};
  uint64_t seed = 1200;
  for (const PoolCase& c : cases)
    // few planes (atomics); many planes (a warp per plane), short and long (several warp steps) planes
    for (const Shape& shape : {Shape{2, 3, 7, 9}, Shape{64, 40, 5, 4}, Shape{16, 40, 15, 13}}) {
      CAPTURE(c.k);
      CAPTURE(c.s);
      CAPTURE(c.p);
      CAPTURE(c.ceil_mode);
      CAPTURE(c.include_pad);
      CAPTURE(shape);
      const K::Pool2dParams q = pool_params(c.k, c.s, c.p, c.ceil_mode, c.include_pad);
      const int64_t oh = pool_out(shape[2], c.k, c.s, c.p, c.ceil_mode);
      const int64_t ow = pool_out(shape[3], c.k, c.s, c.p, c.ceil_mode);
      const Shape out_shape{shape[0], shape[1], oh, ow};
      // ties (integers) so that the first-max rule is exercised; a transposed view of H and W
      const Pair x = map(tie_pair({shape[0], shape[1], shape[3], shape[2]}, ++seed),
                         [](const Tensor& t) { return t.transpose(2, 3); });
      Pair out = empty_pair(out_shape), idx = empty_pair(out_shape, DType::i64);
      K::max_pool2d_forward(kCPU, x.cpu, q, out.cpu, idx.cpu);
      K::max_pool2d_forward(kGpu, x.gpu, q, out.gpu, idx.gpu);
      expect_close(out, 0, 0);
      expect_close(idx);
      const Pair go = uniform_pair(out_shape, ++seed);
      Pair gx = empty_pair(shape);
      K::max_pool2d_backward(kCPU, go.cpu, idx.cpu, gx.cpu);
      K::max_pool2d_backward(kGpu, go.gpu, idx.gpu, gx.gpu);
      expect_close(gx, 1e-6, 1e-5);

      Pair avg = empty_pair(out_shape);
      K::avg_pool2d_forward(kCPU, x.cpu, q, avg.cpu);
      K::avg_pool2d_forward(kGpu, x.gpu, q, avg.gpu);
      expect_close(avg, 1e-6, 1e-5);
      Pair agx = empty_pair(shape);
      K::avg_pool2d_backward(kCPU, go.cpu, q, agx.cpu);
      K::avg_pool2d_backward(kGpu, go.gpu, q, agx.gpu);
      expect_close(agx, 1e-6, 1e-5);
    }
  // NaN wins its window
  std::vector<float> v(16);
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(i);
  v[5] = kNaN;
  const Pair x = pair_of(from_vector(v, {1, 1, 4, 4}));
  Pair out = empty_pair({1, 1, 2, 2}), idx = empty_pair({1, 1, 2, 2}, DType::i64);
  K::max_pool2d_forward(kCPU, x.cpu, pool_params(2, 2, 0, false, true), out.cpu, idx.cpu);
  K::max_pool2d_forward(kGpu, x.gpu, pool_params(2, 2, 0, false, true), out.gpu, idx.gpu);
  expect_close(out, 0, 0);
  expect_close(idx);
}

// ---------------------------------------------------------------- batch norm

namespace {

struct BatchNormRun {
  Pair x, w, b, out, mean, invstd, go, gx, gw, gb;
};

// Forward and backward of batch norm on both devices from the same data, compared with the CPU twin.
// param_grad_atol: the CPU sums long channels in float lanes, so on ~16k values per channel its
// grad_weight / grad_bias carry more rounding than the device's double sums.
BatchNormRun batch_norm_on_both(const Shape& shape, uint64_t& seed, bool affine, bool training,
                                double param_grad_atol = 1e-5) {
  const int64_t c = shape[1];
  BatchNormRun r;
  r.x = uniform_pair(shape, ++seed, -3, 5);
  r.w = affine ? uniform_pair({c}, ++seed, 0.5, 1.5) : Pair{};
  r.b = affine ? uniform_pair({c}, ++seed) : Pair{};
  Pair rm = uniform_pair({c}, ++seed, -0.5, 0.5);
  Pair rv = uniform_pair({c}, ++seed, 0.5, 2.0);
  r.out = empty_pair(shape), r.mean = empty_pair({c}), r.invstd = empty_pair({c});
  K::batch_norm_forward(kCPU, r.x.cpu, r.w.cpu, r.b.cpu, rm.cpu, rv.cpu, training, 0.1, 1e-5, r.out.cpu, r.mean.cpu,
                        r.invstd.cpu);
  K::batch_norm_forward(kGpu, r.x.gpu, r.w.gpu, r.b.gpu, rm.gpu, rv.gpu, training, 0.1, 1e-5, r.out.gpu, r.mean.gpu,
                        r.invstd.gpu);
  expect_close(r.out, 1e-5, 1e-5);
  expect_close(r.mean, 1e-6, 1e-5);
  expect_close(r.invstd, 1e-6, 1e-5);
  expect_close(rm, 1e-6, 1e-5);
  expect_close(rv, 1e-6, 1e-5);

  r.go = uniform_pair(shape, ++seed);
  r.gx = empty_pair(shape);
  r.gw = affine ? empty_pair({c}) : Pair{}, r.gb = affine ? empty_pair({c}) : Pair{};
  K::batch_norm_backward(kCPU, r.go.cpu, r.x.cpu, r.w.cpu, r.mean.cpu, r.invstd.cpu, training, r.gx.cpu, r.gw.cpu,
                         r.gb.cpu);
  K::batch_norm_backward(kGpu, r.go.gpu, r.x.gpu, r.w.gpu, r.mean.gpu, r.invstd.gpu, training, r.gx.gpu, r.gw.gpu,
                         r.gb.gpu);
  expect_close(r.gx, 1e-5, 1e-4);
  if (affine) {
    expect_close(r.gw, param_grad_atol, 1e-5);
    expect_close(r.gb, param_grad_atol, 1e-5);
  }
  return r;
}

}  // namespace

TEST_CASE("cuda ops: batch norm training and eval, forward and backward") {
  uint64_t seed = 1300;
  for (const Shape& shape : {Shape{8, 3}, Shape{4, 5, 6, 7}, Shape{3, 4, 10}})
    for (bool affine : {true, false})
      for (bool training : {true, false}) {
        CAPTURE(shape);
        CAPTURE(affine);
        CAPTURE(training);
        batch_norm_on_both(shape, seed, affine, training);
      }
  // non-contiguous x, training without running stats
  const Pair x = map(uniform_pair({6, 5, 4}, 1399), [](const Tensor& t) { return t.transpose(0, 2); });  // [4,5,6]
  Tensor none_cpu, none_gpu, none_w;
  Pair out = empty_pair({4, 5, 6}), mean = empty_pair({5}), invstd = empty_pair({5});
  K::batch_norm_forward(kCPU, x.cpu, none_w, none_w, none_cpu, none_cpu, true, 0.1, 1e-5, out.cpu, mean.cpu,
                        invstd.cpu);
  K::batch_norm_forward(kGpu, x.gpu, none_w, none_w, none_gpu, none_gpu, true, 0.1, 1e-5, out.gpu, mean.gpu,
                        invstd.gpu);
  expect_close(out, 1e-5, 1e-5);
}

TEST_CASE("cuda ops: batch norm over long channels (statistics split over blocks), reproducible") {
  // N*S = 16384 per channel (the rows path, cut into pieces) and [20000, 4] (S = 1: the columns path)
  uint64_t seed = 1450;
  for (const Shape& shape : {Shape{16, 8, 32, 32}, Shape{20000, 4}}) {
    CAPTURE(shape);
    const int64_t c = shape[1];
    const BatchNormRun r = batch_norm_on_both(shape, seed, true, true, 2e-4);
    const Pair &x = r.x, &w = r.w, &b = r.b, &go = r.go, &mean = r.mean, &invstd = r.invstd;
    const Pair &out = r.out, &gx = r.gx, &gw = r.gw, &gb = r.gb;

    // the same bits on a second run
    Tensor none;
    Pair out2 = empty_pair(shape), mean2 = empty_pair({c}), invstd2 = empty_pair({c});
    K::batch_norm_forward(kGpu, x.gpu, w.gpu, b.gpu, none, none, true, 0.1, 1e-5, out2.gpu, mean2.gpu, invstd2.gpu);
    CHECK(same_bits(out.gpu, out2.gpu));
    CHECK(same_bits(mean.gpu, mean2.gpu));
    CHECK(same_bits(invstd.gpu, invstd2.gpu));
    Pair gx2 = empty_pair(shape), gw2 = empty_pair({c}), gb2 = empty_pair({c});
    K::batch_norm_backward(kGpu, go.gpu, x.gpu, w.gpu, mean.gpu, invstd.gpu, true, gx2.gpu, gw2.gpu, gb2.gpu);
    CHECK(same_bits(gx.gpu, gx2.gpu));
    CHECK(same_bits(gw.gpu, gw2.gpu));
    CHECK(same_bits(gb.gpu, gb2.gpu));
  }
}

// ---------------------------------------------------------------- gradchecks on the device

namespace {

Tensor gpu_param(const Shape& shape, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  Generator gen(seed);
  Tensor t = uniform(shape, lo, hi, {}, &gen).to(kGpu);
  t.requires_grad_(true);
  return t;
}

}  // namespace

TEST_CASE("cuda ops: gradcheck through the autograd ops on the device") {
  using autograd::gradcheck;
  const Tensor a = gpu_param({3, 4}, 1401), b = gpu_param({3, 4}, 1402), pos = gpu_param({3, 4}, 1403, 0.5, 2.0);
  const Tensor row = gpu_param({4}, 1404);
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return gelu(t[0]) * softplus(t[1]); }, {a, b}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return tanh(t[0]) + sigmoid(t[1]) * t[2]; }, {a, b, row}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return div(t[0], t[1]) + pow(t[1], t[0]); }, {a, pos}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return maximum(t[0], t[1]) - exp(t[0]) * log(t[2]); },
                  {a, b, pos}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return where(gt(t[0], 0.0), t[0], t[1]); }, {a, b}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return softmax(t[0], 1) + log_softmax(t[0], 0); }, {a}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return sum(t[0], {1}) * mean(t[0], {1}); }, {a}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return prod(t[0], {0}); }, {pos}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return var(t[0], {1}) + sum(norm(t[0], 2.0, {0})); }, {a}) ==
        "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return max(t[0], 1).first; }, {a}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return logsumexp(t[0], 0); }, {a}) == "");
  const Tensor index = from_vector(std::vector<int64_t>{2, 0, 2, 1}).to(kGpu);
  CHECK(gradcheck([&](const std::vector<Tensor>& t) { return index_select(t[0], 0, index); }, {a}) == "");
  const Tensor target = from_vector(std::vector<int64_t>{1, -100, 3}).to(kGpu);
  CHECK(gradcheck([&](const std::vector<Tensor>& t) { return F::cross_entropy(t[0], target, 0.1); }, {a}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return matmul(t[0], t[1].t()); }, {a, b}) == "");

  const Tensor x = gpu_param({2, 4, 6, 5}, 1410), w = gpu_param({6, 2, 3, 3}, 1411, -0.5, 0.5);
  const Tensor bias = gpu_param({6}, 1412);
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::conv2d(t[0], t[1], t[2], {2, 1}, {1, 1}, {1, 1}, 2); },
                  {x, w, bias}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::max_pool2d(t[0], {3, 2}, {2, 1}, {1, 0}, true); },
                  {x}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::avg_pool2d(t[0], {3, 3}, {2, 2}, {1, 1}, true, false); },
                  {x}) == "");
  const Tensor gamma = gpu_param({4}, 1413, 0.5, 1.5), beta = gpu_param({4}, 1414);
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::batch_norm(t[0], Tensor(), Tensor(), t[1], t[2], true); },
                  {x, gamma, beta}) == "");
}

// ---------------------------------------------------------------- a small CNN end to end

namespace {

std::shared_ptr<nn::Sequential> small_cnn() {
  auto net = std::make_shared<nn::Sequential>();
  net->push_back(std::make_shared<nn::Conv2d>(1, 4, 3, 1, 1));
  net->push_back(std::make_shared<nn::BatchNorm2d>(4));
  net->push_back(std::make_shared<nn::ReLU>());
  net->push_back(std::make_shared<nn::MaxPool2d>(2));
  net->push_back(std::make_shared<nn::Conv2d>(4, 6, std::array<int64_t, 2>{3, 3}, std::array<int64_t, 2>{1, 1},
                                              std::array<int64_t, 2>{0, 0}, std::array<int64_t, 2>{1, 1}, 2));
  net->push_back(std::make_shared<nn::GELU>());
  net->push_back(std::make_shared<nn::AvgPool2d>(2));
  net->push_back(std::make_shared<nn::Flatten>());
  net->push_back(std::make_shared<nn::Linear>(6 * 2 * 2, 10));
  return net;
}

}  // namespace

TEST_CASE("cuda ops: a small CNN gives the same loss and gradients on CUDA as on the CPU") {
  manual_seed(1500);
  auto net = small_cnn();
  Generator gen(1501);
  const Tensor x = normal({16, 1, 12, 12}, 0.0, 1.0, {}, &gen);
  std::vector<int64_t> labels(16);
  for (int i = 0; i < 16; ++i) labels[i] = (i * 7) % 10;
  const Tensor y = from_vector(labels);

  // CPU
  net->train();
  Tensor loss_cpu = F::cross_entropy(net->forward(x), y, 0.05);
  loss_cpu.backward();
  std::vector<std::pair<std::string, std::vector<float>>> grads_cpu, buffers_cpu;
  for (auto& [name, p] : net->named_parameters()) grads_cpu.push_back({name, p.grad().to_vector<float>()});
  for (auto& [name, b] : net->named_buffers())
    if (b.dtype() == DType::f32) buffers_cpu.push_back({name, b.to_vector<float>()});
  const float loss_value = loss_cpu.to_vector<float>()[0];

  // the same parameters and running stats as before the CPU step, on the GPU
  manual_seed(1500);
  auto net_gpu = small_cnn();
  net_gpu->to(kGpu);
  net_gpu->train();
  Tensor loss_gpu = F::cross_entropy(net_gpu->forward(x.to(kGpu)), y.to(kGpu), 0.05);
  loss_gpu.backward();
  CHECK(loss_gpu.device().is_cuda());
  CHECK(close(loss_gpu.to_vector<float>()[0], loss_value, 1e-5, 1e-4));

  const auto params_gpu = net_gpu->named_parameters();
  REQUIRE(params_gpu.size() == grads_cpu.size());
  for (size_t i = 0; i < params_gpu.size(); ++i) {
    CAPTURE(params_gpu[i].first);
    REQUIRE(params_gpu[i].second.grad().defined());
    const std::vector<float> g = params_gpu[i].second.grad().to_vector<float>();
    const std::vector<float>& want = grads_cpu[i].second;
    REQUIRE(g.size() == want.size());
    for (size_t j = 0; j < g.size(); ++j)
      if (!close(g[j], want[j], 1e-4, 1e-3)) {
        FAIL_CHECK("gradient element " << j << ": got " << g[j] << ", expected " << want[j]);
        break;
      }
  }
  size_t k = 0;
  for (auto& [name, b] : net_gpu->named_buffers()) {
    if (b.dtype() != DType::f32) continue;
    CAPTURE(name);
    REQUIRE(k < buffers_cpu.size());
    const std::vector<float> got = b.to_vector<float>();
    for (size_t j = 0; j < got.size(); ++j) CHECK(close(got[j], buffers_cpu[k].second[j], 1e-5, 1e-4));
    ++k;
  }
}
