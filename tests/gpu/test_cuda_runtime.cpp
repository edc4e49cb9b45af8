// The CUDA runtime half of the backend on a real device (skipped without one, see main.cpp): device
// tensors and copies in every direction, fill and the Philox fill against the CPU, cuBLAS gemm against
// the CPU kernel, the optimizer steps, streams, and the caching allocator with real streams, real
// out-of-memory and empty_cache. Compiled only in CUDA builds (it needs the CUDA runtime headers);
// without CUDA main.cpp reports the GPU tests skipped anyway.
#ifdef MN_WITH_CUDA
#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "autograd/ops.h"
#include "core/allocator.h"
#include "core/caching_allocator.h"
#include "core/cuda.h"
#include "core/random.h"
#include "kernels/kernels.h"
#include "tests/gpu/stream_gate.h"

using namespace mn;
using mn::testing::StreamGate;

namespace {

const Device kGpu = cuda_device(0);
constexpr size_t MiB = size_t{1} << 20;

Tensor randn_on(const Shape& shape, uint64_t seed, Device d = kCPU) {
  Generator gen(seed);
  Tensor t = randn(shape, {}, &gen);
  return d.is_cpu() ? t : t.to(d);
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// |got - want| <= atol + rtol * |want| everywhere; reports the first offender.
void check_close(const std::vector<float>& got, const std::vector<float>& want, double atol, double rtol) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::fabs(double(got[i]) - want[i]) > atol + rtol * std::fabs(double(want[i]))) {
      FAIL_CHECK("element " << i << ": got " << got[i] << ", expected " << want[i]);
      return;
    }
  }
}

MemoryStats gpu_stats() { return memory_stats(kGpu); }

}  // namespace

// ---- tensors, copies, fills ----------------------------------------------------------------------

TEST_CASE("cuda runtime: factories allocate on the device and values come back") {
  Tensor t = from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3}, TensorOptions(kGpu));
  CHECK(t.device() == kGpu);
  CHECK(t.to_vector<float>() == std::vector<float>{1, 2, 3, 4, 5, 6});
  CHECK(t.select(0, 1).select(0, 2).item() == 6.0);
  CHECK(t.str().find("device=cuda:0") != std::string::npos);
  CHECK(t.str().find("[4, 5, 6]") != std::string::npos);

  CHECK(zeros({3}, kGpu).to_vector<float>() == std::vector<float>{0, 0, 0});
  CHECK(ones({2}, kGpu).to_vector<float>() == std::vector<float>{1, 1});
  CHECK(full({2}, -0.0, kGpu).to_vector<float>()[0] == 0.0f);
  CHECK(std::signbit(full({2}, -0.0, kGpu).to_vector<float>()[1]));
  CHECK(full({5}, 2.5, kGpu).to_vector<float>() == std::vector<float>(5, 2.5f));
  CHECK(full({4}, 7, TensorOptions(DType::i64).with_device(kGpu)).to_vector<int64_t>() == std::vector<int64_t>(4, 7));
  CHECK(arange(5, TensorOptions(DType::i64).with_device(kGpu)).to_vector<int64_t>() ==
        std::vector<int64_t>{0, 1, 2, 3, 4});
  CHECK(empty({0, 3}, kGpu).to_vector<float>().empty());

  // Back and forth keeps every bit.
  const Tensor host = randn_on({7, 9, 5}, 11);
  CHECK(same_bits(host.to(kGpu).to(kCPU).to_vector<float>(), host.to_vector<float>()));
}

TEST_CASE("cuda runtime: dtype conversions on the device truncate like the CPU") {
  const Tensor host = from_vector(std::vector<float>{-2.7f, -0.5f, 0.0f, 0.5f, 1.5f, 3.99f, 1e6f});
  CHECK(host.to(kGpu).to(DType::i64).to_vector<int64_t>() == host.to(DType::i64).to_vector<int64_t>());
  const Tensor ints = from_vector(std::vector<int64_t>{-3, 0, 5, int64_t{1} << 40});
  CHECK(ints.to(kGpu).to(DType::f32).to_vector<float>() == ints.to(DType::f32).to_vector<float>());
  // Conversion while crossing the host/device boundary (copy_ into a tensor of the other dtype).
  Tensor dev_i64 = empty({7}, TensorOptions(DType::i64).with_device(kGpu));
  dev_i64.copy_(host);
  CHECK(dev_i64.to_vector<int64_t>() == host.to(DType::i64).to_vector<int64_t>());
  Tensor host_f32 = empty({4});
  host_f32.copy_(ints.to(kGpu));
  CHECK(host_f32.to_vector<float>() == ints.to(DType::f32).to_vector<float>());
  // Out of range and NaN: both sides saturate and give 0 for NaN (a plain cast differs between them).
  const float inf = std::numeric_limits<float>::infinity();
  const Tensor odd = from_vector(std::vector<float>{std::nanf(""), inf, -inf, 1e19f, -1e19f});
  const std::vector<int64_t> want = {0, INT64_MAX, INT64_MIN, INT64_MAX, INT64_MIN};
  CHECK(odd.to(DType::i64).to_vector<int64_t>() == want);
  CHECK(odd.to(kGpu).to(DType::i64).to_vector<int64_t>() == want);
  // The same values read through a transposed device view: converted strided, and after a copy.
  const Tensor rows = odd.reshape({1, 5}).expand({3, 5}).contiguous();
  std::vector<int64_t> want_t;
  for (int64_t v : want) want_t.insert(want_t.end(), 3, v);
  CHECK(rows.t().to(DType::i64).to_vector<int64_t>() == want_t);
  CHECK(rows.to(kGpu).t().to(DType::i64).to_vector<int64_t>() == want_t);
  CHECK(rows.to(kGpu).t().contiguous().to(DType::i64).to_vector<int64_t>() == want_t);
}

TEST_CASE("cuda runtime: strided and expanded copies in every direction") {
  const Tensor base = randn_on({6, 8, 10}, 3);
  const Tensor dev = base.to(kGpu);
  const std::vector<std::function<Tensor(const Tensor&)>> views = {
      [](const Tensor& t) { return t.transpose(0, 2); },
      [](const Tensor& t) { return t.permute({1, 2, 0}); },
      [](const Tensor& t) { return t.slice(2, 1, 9, 3); },
      [](const Tensor& t) { return t.select(1, 4); },
      [](const Tensor& t) { return t.narrow(0, 2, 3).transpose(1, 2); },
      [](const Tensor& t) { return t.select(0, 0).select(0, 0).unsqueeze(0).expand({5, 10}); },
  };
  for (size_t v = 0; v < views.size(); ++v) {
    CAPTURE(v);
    const std::vector<float> want = views[v](base).contiguous().to_vector<float>();
    // device view -> device contiguous (strided kernel) -> host
    CHECK(same_bits(views[v](dev).contiguous().to_vector<float>(), want));
    // device view -> host directly (staged on the device)
    CHECK(same_bits(views[v](dev).to(kCPU).to_vector<float>(), want));
    // host view -> device
    CHECK(same_bits(views[v](base).to(kGpu).to_vector<float>(), want));
  }

  // copy_ into strided destinations: a device view from the host, a host view from the device, and
  // device to device.
  Tensor dst_dev = zeros({6, 8, 10}, kGpu);
  Tensor dst_host = zeros({6, 8, 10});
  Tensor ref = zeros({6, 8, 10});
  const Tensor src = randn_on({6, 4, 10}, 4);
  dst_dev.slice(1, 0, 8, 2).copy_(src);
  ref.slice(1, 0, 8, 2).copy_(src);
  CHECK(same_bits(dst_dev.to_vector<float>(), ref.to_vector<float>()));
  dst_host.slice(1, 0, 8, 2).copy_(src.to(kGpu));
  CHECK(same_bits(dst_host.to_vector<float>(), ref.to_vector<float>()));
  Tensor dst_dev2 = zeros({6, 8, 10}, kGpu);
  dst_dev2.slice(1, 0, 8, 2).copy_(src.to(kGpu).transpose(0, 2).transpose(0, 2));
  CHECK(same_bits(dst_dev2.to_vector<float>(), ref.to_vector<float>()));
  // A broadcast source (stride 0) into a device tensor.
  Tensor row = from_vector(std::vector<float>{1, 2, 3}, {1, 3});
  Tensor bdst = zeros({4, 3}, kGpu);
  bdst.copy_(row);
  CHECK(bdst.to_vector<float>() == std::vector<float>{1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3});

  // fill_ on strided device views.
  Tensor f = zeros({4, 6}, kGpu);
  f.slice(1, 1, 6, 2).fill_(3.0);
  Tensor fr = zeros({4, 6});
  fr.slice(1, 1, 6, 2).fill_(3.0);
  CHECK(f.to_vector<float>() == fr.to_vector<float>());
  Tensor fi = zeros({3, 3}, TensorOptions(DType::i64).with_device(kGpu));
  fi.transpose(0, 1).select(0, 1).fill_(-4);
  CHECK(fi.to_vector<int64_t>() == std::vector<int64_t>{0, -4, 0, 0, -4, 0, 0, -4, 0});
}

TEST_CASE("cuda runtime: copies between two devices") {
  if (cuda_device_count() < 2) return;
  const Tensor host = randn_on({33, 17}, 5);
  const Tensor on1 = host.to(kGpu).to(cuda_device(1));
  CHECK(on1.device() == cuda_device(1));
  CHECK(same_bits(on1.to_vector<float>(), host.to_vector<float>()));
  CHECK(same_bits(on1.t().to(kGpu).to_vector<float>(), host.t().contiguous().to_vector<float>()));
}

TEST_CASE("cuda runtime: random fills equal the CPU fill for the same generator state") {
  const struct {
    Distribution dist;
    double p1, p2;
  } cases[] = {{Distribution::Uniform, 0.0, 1.0},
               {Distribution::Uniform, -3.0, 5.0},
               {Distribution::Normal, 0.0, 1.0},
               {Distribution::Normal, 2.0, 0.5},
               {Distribution::Bernoulli, 0.3, 0.0},
               {Distribution::Rademacher, 0.0, 0.0}};
  for (const int64_t n : {int64_t{1}, int64_t{7}, int64_t{1001}, (int64_t{1} << 20) + 3}) {
    for (const auto& c : cases) {
      CAPTURE(n);
      CAPTURE(static_cast<int>(c.dist));
      Generator g_cpu(1234, 99), g_gpu(1234, 99);
      g_cpu.set_offset(17);
      g_gpu.set_offset(17);
      Tensor cpu = empty({n});
      Tensor gpu = empty({n}, kGpu);
      kernels::random_fill(kCPU, cpu, c.dist, c.p1, c.p2, g_cpu.reserve(n));
      kernels::random_fill(kGpu, gpu, c.dist, c.p1, c.p2, g_gpu.reserve(n));
      CHECK(g_cpu.offset() == g_gpu.offset());
      const auto want = cpu.to_vector<float>(), got = gpu.to_vector<float>();
      if (c.dist == Distribution::Normal) {
        check_close(got, want, 4e-6, 1e-6);  // logf/sinf/cosf: a few ulp apart (core/philox.h)
      } else {
        CHECK(same_bits(got, want));
      }
      // int64 fills draw the same values too.
      Tensor cpu_i = empty({n}, DType::i64);
      Tensor gpu_i = empty({n}, TensorOptions(DType::i64).with_device(kGpu));
      const double lo = c.dist == Distribution::Uniform ? -1000.0 : c.p1, hi = c.dist == Distribution::Uniform ? 1000.0 : c.p2;
      const PhiloxState st{77, 5, 3};
      kernels::random_fill(kCPU, cpu_i, c.dist, lo, hi, st);
      kernels::random_fill(kGpu, gpu_i, c.dist, lo, hi, st);
      if (c.dist != Distribution::Normal) CHECK(gpu_i.to_vector<int64_t>() == cpu_i.to_vector<int64_t>());
    }
  }
  // The factories take the same path.
  Generator a(42), b(42);
  CHECK(same_bits(rand({5000}, kGpu, &a).to_vector<float>(), rand({5000}, {}, &b).to_vector<float>()));
  CHECK_THROWS_AS(uniform({4}, 2.0, 1.0, kGpu), ValueError);
}

// ---- gemm ------------------------------------------------------------------------------------------

namespace {

using View = std::function<Tensor(const Tensor&)>;
const View kIdentity = [](const Tensor& t) { return t; };

// Runs the CPU and the CUDA kernel on the same views of the same values; out starts as `init`.
void check_gemm(const Tensor& a_base, const View& a_view, const Tensor& b_base, const View& b_view, const Shape& out_shape,
                double alpha, double beta) {
  const Tensor init = randn_on(out_shape, 99);
  Tensor out_cpu = init.clone();
  Tensor out_gpu = init.to(kGpu);
  const Tensor a_cpu = a_view(a_base), b_cpu = b_view(b_base);
  const Tensor a_gpu = a_view(a_base.to(kGpu)), b_gpu = b_view(b_base.to(kGpu));
  REQUIRE(a_gpu.strides() == a_cpu.strides());
  kernels::gemm(kCPU, a_cpu, b_cpu, out_cpu, alpha, beta);
  kernels::gemm(kGpu, a_gpu, b_gpu, out_gpu, alpha, beta);
  const int64_t k = a_cpu.size(-1);
  check_close(out_gpu.to_vector<float>(), out_cpu.to_vector<float>(), 2e-5 * (k + 1), 1e-5);
}

}  // namespace

TEST_CASE("cuda runtime: gemm matches the CPU kernel") {
  CHECK_FALSE(cuda::allow_tf32());
  SUBCASE("plain, odd sizes and vectors") {
    const std::vector<std::tuple<int64_t, int64_t, int64_t>> sizes = {{37, 61, 53}, {256, 512, 128}, {1, 40, 30},
                                                                      {30, 40, 1},  {1, 1, 1},       {64, 1, 64}};
    for (const auto& mkn : sizes) {
      const int64_t m = std::get<0>(mkn), k = std::get<1>(mkn), n = std::get<2>(mkn);
      CAPTURE(m);
      CAPTURE(k);
      CAPTURE(n);
      check_gemm(randn_on({m, k}, 1), kIdentity, randn_on({k, n}, 2), kIdentity, {m, n}, 1.0, 0.0);
    }
  }
  SUBCASE("transposed views are read in place") {
    const View t = [](const Tensor& x) { return x.t(); };
    check_gemm(randn_on({61, 37}, 1), t, randn_on({61, 53}, 2), kIdentity, {37, 53}, 1.0, 0.0);
    check_gemm(randn_on({37, 61}, 1), kIdentity, randn_on({53, 61}, 2), t, {37, 53}, 1.0, 0.0);
    check_gemm(randn_on({61, 37}, 1), t, randn_on({53, 61}, 2), t, {37, 53}, 1.0, 0.0);
    // Row-strided (padded) matrices: a narrow of the columns keeps unit column stride.
    const View pad = [](const Tensor& x) { return x.narrow(1, 0, x.size(1) - 5); };
    check_gemm(randn_on({37, 66}, 1), pad, randn_on({61, 58}, 2), pad, {37, 53}, 1.0, 0.0);
  }
  SUBCASE("views with no unit stride are copied") {
    const View every_other = [](const Tensor& x) { return x.slice(1, 0, x.size(1), 2); };
    check_gemm(randn_on({37, 122}, 1), every_other, randn_on({61, 106}, 2), every_other, {37, 53}, 1.0, 0.0);
    const View every_other_t = [](const Tensor& x) { return x.slice(0, 0, x.size(0), 2).t(); };
    check_gemm(randn_on({122, 37}, 1), every_other_t, randn_on({61, 53}, 2), kIdentity, {37, 53}, 1.0, 0.0);
  }
  SUBCASE("batched, transposed batches and broadcast batches") {
    const int64_t B = 5, m = 33, k = 47, n = 29;
    check_gemm(randn_on({B, m, k}, 1), kIdentity, randn_on({B, k, n}, 2), kIdentity, {B, m, n}, 1.0, 0.0);
    const View bt = [](const Tensor& x) { return x.transpose(1, 2); };
    check_gemm(randn_on({B, k, m}, 1), bt, randn_on({B, n, k}, 2), bt, {B, m, n}, 1.0, 0.0);
    // size-1 batch and 2-D operands broadcast over the batch (batch stride 0)
    check_gemm(randn_on({1, m, k}, 1), kIdentity, randn_on({B, k, n}, 2), kIdentity, {B, m, n}, 1.0, 0.0);
    check_gemm(randn_on({B, m, k}, 1), kIdentity, randn_on({k, n}, 2), kIdentity, {B, m, n}, 1.0, 0.0);
    check_gemm(randn_on({m, k}, 1), kIdentity, randn_on({1, n, k}, 2), bt, {B, m, n}, 1.0, 0.0);
    // an expanded batch (stride 0 in dim 0) and a non-unit-stride batch copied per matrix
    const View expand = [B](const Tensor& x) { return x.expand({B, x.size(1), x.size(2)}); };
    check_gemm(randn_on({1, m, k}, 1), expand, randn_on({B, k, n}, 2), kIdentity, {B, m, n}, 1.0, 0.0);
    const View strided = [](const Tensor& x) { return x.slice(2, 0, x.size(2), 2); };
    check_gemm(randn_on({B, m, 2 * k}, 1), strided, randn_on({B, k, n}, 2), kIdentity, {B, m, n}, 1.0, 0.0);
  }
  SUBCASE("alpha and beta") {
    check_gemm(randn_on({37, 61}, 1), kIdentity, randn_on({61, 53}, 2), kIdentity, {37, 53}, 0.5, 2.0);
    check_gemm(randn_on({4, 37, 61}, 1), kIdentity, randn_on({61, 53}, 2), kIdentity, {4, 37, 53}, -1.5, 1.0);
    check_gemm(randn_on({37, 0}, 1), kIdentity, randn_on({0, 53}, 2), kIdentity, {37, 53}, 1.0, 3.0);
    check_gemm(randn_on({37, 0}, 1), kIdentity, randn_on({0, 53}, 2), kIdentity, {37, 53}, 1.0, 0.0);
    // beta == 0 never reads the output: NaN there must not leak into the result.
    Tensor out = full({8, 8}, NAN, kGpu);
    kernels::gemm(kGpu, randn_on({8, 4}, 1, kGpu), randn_on({4, 8}, 2, kGpu), out, 1.0, 0.0);
    for (float v : out.to_vector<float>()) CHECK(std::isfinite(v));
  }
  SUBCASE("mm and bmm on device tensors, and mixed devices are refused") {
    const Tensor a = randn_on({64, 32}, 1), b = randn_on({32, 48}, 2);
    check_close(mm(a.to(kGpu), b.to(kGpu)).to_vector<float>(), mm(a, b).to_vector<float>(), 1e-4, 1e-5);
    CHECK_THROWS_WITH_AS(mm(a, b.to(kGpu)), doctest::Contains("cuda:0"), DeviceError);
    CHECK_THROWS_WITH_AS(mm(a, b.to(kGpu)), doctest::Contains("cpu"), DeviceError);
    Tensor out = empty({64, 48}, kGpu);
    CHECK_THROWS_WITH_AS(kernels::gemm(kGpu, a, b.to(kGpu), out, 1.0, 0.0), doctest::Contains("got a tensor on cpu"),
                         DeviceError);
    // elementwise kernels check their operands too (a host pointer in a launch would poison the context),
    // and a gradient set by hand must live where the parameter does
    Tensor sum_out = empty({64, 32}, kGpu);
    CHECK_THROWS_WITH_AS(kernels::binary(kGpu, kernels::BinaryOp::Add, a.to(kGpu), a, sum_out),
                         doctest::Contains("got a tensor on cpu"), DeviceError);
    const Tensor w = a.to(kGpu).requires_grad_(true);
    CHECK_THROWS_AS(w.set_grad(a), ValueError);
  }
  SUBCASE("TF32 is opt-in") {
    const Tensor a = randn_on({512, 512}, 1), b = randn_on({512, 512}, 2);
    const auto want = mm(a, b).to_vector<float>();
    cuda::set_allow_tf32(true);
    CHECK(cuda::allow_tf32());
    const auto tf32 = mm(a.to(kGpu), b.to(kGpu)).to_vector<float>();
    cuda::set_allow_tf32(false);
    check_close(tf32, want, 0.5, 1e-2);  // ~10 mantissa bits in the products
    check_close(mm(a.to(kGpu), b.to(kGpu)).to_vector<float>(), want, 1e-2, 1e-5);
  }
}

// ---- optimizer steps -------------------------------------------------------------------------------

TEST_CASE("cuda runtime: adam and sgd steps match the CPU") {
  const int64_t n = 10007;
  for (const bool decoupled : {false, true}) {
    for (const double wd : {0.0, 0.01}) {
      CAPTURE(decoupled);
      CAPTURE(wd);
      Tensor w_cpu = randn_on({n}, 1), m_cpu = zeros({n}), v_cpu = zeros({n});
      Tensor w_gpu = w_cpu.to(kGpu), m_gpu = zeros({n}, kGpu), v_gpu = zeros({n}, kGpu);
      for (int64_t step = 1; step <= 5; ++step) {
        const Tensor g = randn_on({n}, 100 + step);
        const Tensor g_gpu = g.to(kGpu);
        const kernels::AdamParams p{1e-2, 0.9, 0.999, 1e-8, wd, step, decoupled};
        kernels::adam_step(kCPU, w_cpu, g, m_cpu, v_cpu, p);
        kernels::adam_step(kGpu, w_gpu, g_gpu, m_gpu, v_gpu, p);
      }
      check_close(w_gpu.to_vector<float>(), w_cpu.to_vector<float>(), 1e-6, 1e-5);
      check_close(m_gpu.to_vector<float>(), m_cpu.to_vector<float>(), 1e-6, 1e-5);
      check_close(v_gpu.to_vector<float>(), v_cpu.to_vector<float>(), 1e-7, 1e-5);
    }
  }
  for (const double momentum : {0.0, 0.9}) {
    for (const bool nesterov : {false, true}) {
      if (nesterov && momentum == 0.0) continue;
      CAPTURE(momentum);
      CAPTURE(nesterov);
      Tensor w_cpu = randn_on({n}, 2), w_gpu = w_cpu.to(kGpu);
      Tensor b_cpu = momentum != 0.0 ? zeros({n}) : Tensor();
      Tensor b_gpu = momentum != 0.0 ? zeros({n}, kGpu) : Tensor();
      for (int step = 0; step < 5; ++step) {
        const Tensor g = randn_on({n}, 200 + step);
        const Tensor g_gpu = g.to(kGpu);
        const kernels::SgdParams p{0.1, momentum, 0.1, 1e-3, nesterov, step == 0};
        kernels::sgd_step(kCPU, w_cpu, g, b_cpu, p);
        kernels::sgd_step(kGpu, w_gpu, g_gpu, b_gpu, p);
      }
      check_close(w_gpu.to_vector<float>(), w_cpu.to_vector<float>(), 1e-6, 1e-5);
      if (b_cpu.defined()) check_close(b_gpu.to_vector<float>(), b_cpu.to_vector<float>(), 1e-6, 1e-5);
    }
  }
  Tensor w = zeros({4}, kGpu), m = zeros({4}, kGpu), v = zeros({4}, kGpu);
  const kernels::AdamParams p{1e-2, 0.9, 0.999, 1e-8, 0.0, 1, false};
  CHECK_THROWS_AS(kernels::adam_step(kGpu, w, zeros({4}), m, v, p), DeviceError);
  // A state tensor smaller than the parameter is refused before the launch instead of being overrun.
  Tensor scalar = zeros({}, kGpu);
  CHECK_THROWS_WITH_AS(kernels::adam_step(kGpu, w, zeros({4}, kGpu), scalar, v, p), doctest::Contains("'exp_avg'"),
                       ValueError);
  const kernels::SgdParams sgd{0.1, 0.9, 0.0, 0.0, false, false};
  CHECK_THROWS_WITH_AS(kernels::sgd_step(kGpu, w, zeros({4}, kGpu), scalar, sgd),
                       doctest::Contains("'momentum_buffer'"), ValueError);
}

// ---- streams -----------------------------------------------------------------------------------------

TEST_CASE("cuda runtime: current streams, guards and ordering") {
  const cuda::Stream dflt = cuda::get_current_stream(0);
  CHECK(dflt.is_default());
  CHECK(dflt == cuda::default_stream(0));
  CHECK(cuda::current_stream_id(0) == 0);
  const cuda::Stream side = cuda::new_stream(0);
  CHECK_FALSE(side.is_default());
  CHECK(side.device() == kGpu);
  {
    cuda::StreamGuard guard(side);
    CHECK(cuda::get_current_stream(0) == side);
    CHECK(cuda::current_stream_id(0) == side.id());
    // Work queued on the side stream (a fill, a copy) completes in its order.
    Tensor x = full({1000}, 3.0, kGpu);
    CHECK(x.to_vector<float>() == std::vector<float>(1000, 3.0f));
  }
  CHECK(cuda::get_current_stream(0) == dflt);

  // Stream::wait orders the default stream after the side stream's pending work.
  StreamGate gate(side);
  CHECK_FALSE(side.query());
  dflt.wait(side);
  CHECK_FALSE(dflt.query());
  gate.release();
  dflt.synchronize();
  CHECK(side.query());
  CHECK(dflt.query());
  cuda::synchronize(0);

  const cuda::MemoryInfo info = cuda::memory_info(0);
  CHECK(info.total_bytes > 0);
  CHECK(info.free_bytes <= info.total_bytes);
  CHECK_THROWS_AS(cuda::new_stream(cuda_device_count()), DeviceError);
  CHECK_THROWS_AS(cuda::StreamGuard{cuda::Stream(cuda_device_count(), 0)}, DeviceError);
}

// ---- the caching allocator on the device ---------------------------------------------------------------

TEST_CASE("cuda runtime: allocator stats, rounding and per-stream pools") {
  if (!caching_enabled(kGpu)) return;  // MN_NO_CACHING: nothing is cached
  empty_cache(kGpu);
  REQUIRE(gpu_stats().allocated_bytes.current == 0);
  reset_peak_memory_stats(kGpu);  // earlier test cases of this process left their peaks behind
  {
    Tensor t = empty({250}, kGpu);  // 1000 bytes -> one 1024-byte block of a 2 MiB segment
    const MemoryStats s = gpu_stats();
    CHECK(s.allocated_bytes.current == 1024);
    CHECK(s.requested_bytes.current == 1000);
    CHECK(s.reserved_bytes.current == static_cast<int64_t>(kSmallBuffer));
    CHECK(s.allocation.current == 1);
  }
  CHECK(gpu_stats().allocated_bytes.current == 0);
  CHECK(gpu_stats().allocated_bytes.peak == 1024);
  reset_peak_memory_stats(kGpu);
  CHECK(gpu_stats().allocated_bytes.peak == 0);
  CHECK(memory_summary(kGpu).find("cuda:0") != std::string::npos);

  // A block freed on one stream is reused on that stream only.
  const int64_t n = static_cast<int64_t>(32 * MiB / 4);
  const cuda::Stream side = cuda::new_stream(0);
  void* on_side = nullptr;
  {
    cuda::StreamGuard guard(side);
    on_side = empty({n}, kGpu).raw_data();  // freed at once, cached in the side stream's pool
  }
  {
    Tensor d = empty({n}, kGpu);
    CHECK(d.raw_data() != on_side);
    cuda::StreamGuard guard(side);
    Tensor s = empty({n}, kGpu);
    CHECK(s.raw_data() == on_side);
  }
  cuda::synchronize(0);
  empty_cache(kGpu);
  CHECK(gpu_stats().reserved_bytes.current == 0);
}

TEST_CASE("cuda runtime: record_stream keeps a block from reuse until the other stream is done") {
  if (!caching_enabled(kGpu)) return;
  empty_cache(kGpu);
  REQUIRE(gpu_stats().allocated_bytes.current == 0);
  const int64_t n = static_cast<int64_t>(32 * MiB / 4);  // a segment of its own, never split
  const cuda::Stream side = cuda::new_stream(0);

  // Control: without record_stream the freed block comes straight back.
  void* first = nullptr;
  {
    Tensor x = empty({n}, kGpu);
    first = x.raw_data();
  }
  {
    Tensor y = empty({n}, kGpu);
    CHECK(y.raw_data() == first);
  }

  StreamGate gate(side);  // the side stream is "still reading x" until released
  Tensor x = empty({n}, kGpu);
  REQUIRE(x.raw_data() == first);
  cuda::record_stream(x, side);
  cuda::record_stream(x, cuda::default_stream(0));  // the allocation stream: ignored
  x = Tensor();  // freed while the side stream still uses it
  CHECK(gpu_stats().allocated_bytes.current == 0);
  CHECK(gpu_stats().active_bytes.current == static_cast<int64_t>(32 * MiB));  // waiting on the event
  Tensor y = empty({n}, kGpu);
  CHECK(y.raw_data() != first);  // not handed out: the event has not completed
  CHECK(gpu_stats().segment.current == 2);

  gate.release();
  side.synchronize();
  Tensor z = empty({n}, kGpu);  // the event completed: the block is back in the pool
  CHECK(z.raw_data() == first);
  CHECK(gpu_stats().segment.current == 2);
  y = Tensor();
  z = Tensor();
  empty_cache(kGpu);
  CHECK(gpu_stats().reserved_bytes.current == 0);
  cuda::record_stream(zeros({2}), side);  // CPU tensors: a no-op
}

TEST_CASE("cuda runtime: fill most of the device, free, empty_cache returns it all") {
  if (!caching_enabled(kGpu)) return;
  cuda::synchronize(0);
  empty_cache(kGpu);
  REQUIRE(gpu_stats().allocated_bytes.current == 0);
  const cuda::MemoryInfo before = cuda::memory_info(0);
  const size_t chunk = size_t{1} << 30;
  const size_t target = before.free_bytes / 10 * 9;
  std::vector<Tensor> hold;
  size_t held = 0;
  while (held + chunk <= target) {
    hold.push_back(empty({static_cast<int64_t>(chunk / 4)}, kGpu));
    held += chunk;
  }
  hold.back().fill_(1.0);  // the memory is usable
  CHECK(hold.back().narrow(0, 0, 3).to_vector<float>() == std::vector<float>{1, 1, 1});
  MESSAGE("holding " << held / MiB << " MiB of " << before.total_bytes / MiB << " MiB");
  CHECK(static_cast<size_t>(gpu_stats().reserved_bytes.current) >= held);
  CHECK(cuda::memory_info(0).free_bytes < before.free_bytes - held + chunk);
  hold.clear();
  CHECK(gpu_stats().allocated_bytes.current == 0);
  CHECK(static_cast<size_t>(gpu_stats().reserved_bytes.current) >= held);  // cached
  const int64_t raw_frees = gpu_stats().num_raw_frees;
  empty_cache(kGpu);
  CHECK(gpu_stats().reserved_bytes.current == 0);
  CHECK(gpu_stats().segment.current == 0);
  CHECK(gpu_stats().num_raw_frees >= raw_frees + static_cast<int64_t>(held / chunk));
  CHECK(cuda::memory_info(0).free_bytes + 64 * MiB >= before.free_bytes);
}

TEST_CASE("cuda runtime: out of memory frees the cache, retries, then throws with the numbers") {
  if (!caching_enabled(kGpu)) return;
  empty_cache(kGpu);
  const cuda::MemoryInfo info = cuda::memory_info(0);
  {
    Tensor cached = empty({static_cast<int64_t>(64 * MiB / 4)}, kGpu);
  }  // 64 MiB cached: the retry releases it
  const MemoryStats before = gpu_stats();
  CHECK(before.reserved_bytes.current >= static_cast<int64_t>(64 * MiB));
  const int64_t too_many = static_cast<int64_t>(info.total_bytes / 4 * 2);
  try {
    Tensor t = empty({too_many}, kGpu);
    FAIL("allocating twice the device memory succeeded");
  } catch (const MemoryError& e) {
    const std::string msg = e.what();
    MESSAGE(msg);
    CHECK(msg.find("out of memory on cuda:0") != std::string::npos);
    CHECK(msg.find("tried to allocate " + std::to_string(too_many * 4) + " bytes") != std::string::npos);
    CHECK(msg.find("device capacity " + std::to_string(info.total_bytes) + " bytes") != std::string::npos);
    CHECK(msg.find("allocated") != std::string::npos);
    CHECK(msg.find("reserved") != std::string::npos);
  }
  const MemoryStats after = gpu_stats();
  CHECK(after.num_ooms == before.num_ooms + 1);
  CHECK(after.num_alloc_retries == before.num_alloc_retries + 1);
  CHECK(after.reserved_bytes.current == 0);  // the retry released the cached segment
  CHECK(cudaGetLastError() == cudaSuccess);  // the failed cudaMalloc left no error behind
  CHECK(full({3}, 2.0, kGpu).to_vector<float>() == std::vector<float>{2, 2, 2});

  // The byte cap makes the same path reachable at any size.
  set_memory_cap(64 * MiB, kGpu);
  CHECK_THROWS_WITH_AS(empty({static_cast<int64_t>(100 * MiB / 4)}, kGpu), doctest::Contains("memory cap"),
                       MemoryError);
  set_memory_cap(0, kGpu);
  CHECK(empty({static_cast<int64_t>(100 * MiB / 4)}, kGpu).numel() == static_cast<int64_t>(100 * MiB / 4));
  empty_cache(kGpu);
}

#endif  // MN_WITH_CUDA
