// bf16 / f16 on the device against the CPU (skipped without a device, see main.cpp): the copy kernel's
// conversions (every 16-bit pattern, and f32 values with ties, subnormals and overflow) give the CPU's
// bits; the native 16-bit GEMM (cuBLAS, f32 accumulation) matches the CPU's widened GEMM to bf16/f16
// rounding for plain, transposed and batched operands; the native 16-bit elementwise kernels (f32 math,
// one rounding) and the widened ones (conv, pool, softmax) give the CPU's bits or agree to rounding;
// and an autocast forward/backward on the device matches the same one on the CPU.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "autograd/autocast.h"
#include "autograd/ops.h"
#include "core/random.h"
#include "nn/functional.h"

using namespace mn;
namespace F = mn::nn::functional;

namespace {

const Device kDev = cuda_device(0);

Tensor randn_cpu(const Shape& shape, uint64_t seed, double scale = 1.0) {
  Generator gen(seed);
  return mul(randn(shape, {}, &gen), scale);
}

std::vector<uint16_t> raw16(const Tensor& t) {
  const Tensor host = t.to(kCPU).contiguous();
  const uint16_t* p = static_cast<const uint16_t*>(host.raw_data());
  return std::vector<uint16_t>(p, p + host.numel());
}

void check_close_rel(const Tensor& got, const Tensor& want, double rel) {
  const std::vector<float> g = got.to(kCPU).to(DType::f32).to_vector<float>();
  const std::vector<float> w = want.to(kCPU).to(DType::f32).to_vector<float>();
  REQUIRE(g.size() == w.size());
  double scale = 0;
  for (float v : w) scale = std::max(scale, static_cast<double>(std::abs(v)));
  for (size_t i = 0; i < g.size(); ++i) {
    INFO("element " << i << ": got " << g[i] << ", want " << w[i]);
    CHECK(std::abs(g[i] - w[i]) <= rel * (scale + 1e-6));
  }
}

}  // namespace

TEST_CASE("cuda mixed precision: conversions give the CPU's bits") {
  std::vector<float> values = {0.0f, -0.0f, 1.0f, 1.0f + 1.0f / 256, 1.0f + 3.0f / 256, 65504.0f, 65519.0f, 65520.0f,
                               -70000.0f, 6.1035156e-05f, 5.9604645e-08f, 2.9802322e-08f, 4.4703484e-08f, 1e-40f,
                               INFINITY, -INFINITY, NAN, 3.4e38f};
  Tensor x = cat({from_vector(values), randn_cpu({4096}, 1, 100.0), randn_cpu({1024}, 2, 1e-6)}, 0);
  for (DType t : {DType::bf16, DType::f16}) {
    INFO(t);
    const Tensor on_cpu = x.to(t), on_gpu = x.to(kDev).to(t);
    CHECK(raw16(on_gpu) == raw16(on_cpu));
    // Widening on the device is exact, and a strided (transposed) source converts the same.
    const Tensor m = x.narrow(0, 0, 4096).view({64, 64});
    CHECK(raw16(m.t().to(kDev).to(t)) == raw16(m.t().contiguous().to(t)));
    std::vector<float> back = on_gpu.to(DType::f32).to(kCPU).to_vector<float>();
    std::vector<float> want = on_cpu.to(DType::f32).to_vector<float>();
    for (size_t i = 0; i < back.size(); ++i)
      if (!std::isnan(want[i])) CHECK(back[i] == want[i]);
  }
}

TEST_CASE("cuda mixed precision: the native 16-bit GEMM matches the CPU's widened one") {
  for (DType t : {DType::bf16, DType::f16}) {
    INFO(t);
    const double rel = t == DType::bf16 ? 1.6e-2 : 2e-3;
    const Tensor a = randn_cpu({37, 61}, 3).to(t), b = randn_cpu({61, 53}, 4).to(t);
    check_close_rel(matmul(a.to(kDev), b.to(kDev)), matmul(a, b), rel);
    check_close_rel(matmul(a.t().to(kDev).t(), b.to(kDev)), matmul(a, b), rel);  // a transposed view
    const Tensor ba = randn_cpu({4, 19, 23}, 5).to(t), bb = randn_cpu({4, 23, 17}, 6).to(t);
    check_close_rel(bmm(ba.to(kDev), bb.to(kDev)), bmm(ba, bb), rel);
    CHECK(matmul(a.to(kDev), b.to(kDev)).dtype() == t);
  }
}

TEST_CASE("cuda mixed precision: widened kernels give the CPU's bits") {
  const Tensor x = randn_cpu({2, 3, 8, 8}, 7).to(DType::bf16), w = randn_cpu({4, 3, 3, 3}, 8).to(DType::bf16);
  CHECK(raw16(F::max_pool2d(x.to(kDev), {2, 2})) == raw16(F::max_pool2d(x, {2, 2})));
  CHECK(raw16(relu(x.to(kDev))) == raw16(relu(x)));
  check_close_rel(F::conv2d(x.to(kDev), w.to(kDev), Tensor(), {1, 1}, {1, 1}),
                  F::conv2d(x, w, Tensor(), {1, 1}, {1, 1}), 1.6e-2);
  check_close_rel(softmax(x.to(kDev), 1), softmax(x, 1), 1.6e-2);
}

TEST_CASE("cuda mixed precision: native 16-bit elementwise kernels match the CPU's widened ones") {
  for (DType t : {DType::bf16, DType::f16}) {
    INFO(t);
    const Tensor a = randn_cpu({33, 65}, 12).to(t), b = randn_cpu({33, 65}, 13).to(t);
    const Tensor ga = a.to(kDev), gb = b.to(kDev);
    // Correctly rounded f32 results rounded once: the very bits.
    CHECK(raw16(add(ga, gb)) == raw16(add(a, b)));
    CHECK(raw16(mul(ga, gb)) == raw16(mul(a, b)));
    CHECK(raw16(sub(ga.t(), gb.t())) == raw16(sub(a.t(), b.t())));     // strided operands
    CHECK(raw16(add(ga, gb.narrow(0, 0, 1))) == raw16(add(a, b.narrow(0, 0, 1))));  // broadcast
    CHECK(raw16(neg(ga)) == raw16(neg(a)));
    CHECK(raw16(relu(ga)) == raw16(relu(a)));
    CHECK(gt(ga, gb).dtype() == DType::f32);
    CHECK(gt(ga, gb).to(kCPU).to_vector<float>() == gt(a, b).to_vector<float>());
    // Transcendentals: the device's f32 formulas may differ in the last f32 bit.
    check_close_rel(exp(ga), exp(a), 8e-3);
    check_close_rel(gelu(ga), gelu(a), 8e-3);
    // Mixed dtypes promote and run on widened copies.
    const Tensor f = randn_cpu({33, 65}, 14);
    CHECK(add(ga, f.to(kDev)).dtype() == DType::f32);
    check_close_rel(add(ga, f.to(kDev)), add(a, f), 1e-6);
  }
}

TEST_CASE("cuda mixed precision: an autocast step on the device matches the CPU's") {
  const Tensor x = randn_cpu({8, 3, 6, 6}, 9);
  const Tensor w = randn_cpu({5, 3, 3, 3}, 10, 0.3), fc = randn_cpu({4, 5}, 11, 0.3);
  const Tensor y = from_vector(std::vector<int64_t>{0, 1, 2, 3, 0, 1, 2, 3});
  auto run = [&](Device d) {
    Tensor wl = w.to(d).requires_grad_(true), fl = fc.to(d).requires_grad_(true);
    Tensor loss;
    {
      autocast scope(d, DType::bf16);
      Tensor h = mean(relu(F::conv2d(x.to(d), wl, Tensor(), {1, 1}, {1, 1})), {2, 3});
      loss = F::cross_entropy(F::linear(h, fl), y.to(d));
    }
    loss.backward();
    return std::vector<Tensor>{loss, wl.grad(), fl.grad()};
  };
  const auto cpu = run(kCPU), gpu = run(kDev);
  CHECK(gpu[0].dtype() == DType::f32);
  CHECK(gpu[1].dtype() == DType::f32);
  for (size_t i = 0; i < cpu.size(); ++i) check_close_rel(gpu[i], cpu[i], 3e-2);
}
