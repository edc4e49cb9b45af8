// The CUDA kernels issue 18 changed or added, against their CPU twins (skipped without a device, see
// main.cpp): the class-weighted cross entropy (forward and backward, with label smoothing and
// ignore_index, short and long rows), the functional losses end to end on the device, and the fused
// amsgrad and RMSprop steps.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "autograd/ops.h"
#include "core/random.h"
#include "kernels/kernels.h"
#include "nn/functional.h"

using namespace mn;
namespace K = mn::kernels;
namespace F = mn::nn::functional;

namespace {

const Device kDevice = cuda_device(0);

Tensor uniform_cpu(const Shape& shape, uint64_t seed, double lo = -3.0, double hi = 3.0) {
  Generator gen(seed);
  return uniform(shape, lo, hi, {}, &gen);
}

void expect_close(const Tensor& gpu, const Tensor& cpu, double atol, double rtol, const std::string& what) {
  INFO(what);
  REQUIRE(gpu.device().is_cuda());
  REQUIRE(gpu.sizes() == cpu.sizes());
  const std::vector<float> g = gpu.to_vector<float>(), c = cpu.to_vector<float>();
  for (size_t i = 0; i < g.size(); ++i) {
    INFO("element " << i << ": gpu " << g[i] << ", cpu " << c[i]);
    if (std::isnan(c[i]) || std::isnan(g[i])) {
      CHECK(std::isnan(c[i]) == std::isnan(g[i]));
      continue;
    }
    CHECK(std::fabs(g[i] - c[i]) <= atol + rtol * std::fabs(c[i]));
  }
}

}  // namespace

TEST_CASE("cuda losses: class-weighted cross entropy kernels match the CPU") {
  // Large logits (offset 1e4): the smoothing term's sums must not cancel in float (the CPU sums in double).
  for (auto [classes, offset] : {std::pair<int64_t, double>{7, 0.0}, {1500, 0.0}, {1500, 1e4}}) {
    const int64_t rows = 33;
    const Tensor logits = add(uniform_cpu({classes, rows}, 1800 + classes), offset).t();  // non-contiguous
    CAPTURE(offset);
    std::vector<int64_t> t(rows);
    for (int64_t i = 0; i < rows; ++i) t[i] = (i * 11) % classes;
    t[5] = -100;
    const Tensor target = from_vector(t);
    const Tensor weight = uniform_cpu({classes}, 1801, 0.2, 2.0);
    const Tensor grad_loss = uniform_cpu({rows}, 1802);
    for (int64_t ignore : {int64_t{-100}, int64_t{0}}) {
      for (double smoothing : {0.0, 0.15}) {
        CAPTURE(classes);
        CAPTURE(ignore);
        CAPTURE(smoothing);
        Tensor loss = empty({rows}), lse = empty({rows});
        Tensor loss_d = empty({rows}, TensorOptions().with_device(kDevice));
        Tensor lse_d = empty({rows}, TensorOptions().with_device(kDevice));
        const Tensor x_d = logits.to(kDevice), t_d = target.to(kDevice), w_d = weight.to(kDevice);
        K::cross_entropy_forward(kCPU, logits, target, weight, smoothing, ignore, loss, lse);
        K::cross_entropy_forward(kDevice, x_d, t_d, w_d, smoothing, ignore, loss_d, lse_d);
        expect_close(loss_d, loss, 1e-5, 1e-5, "loss");
        expect_close(lse_d, lse, 1e-5, 1e-5, "lse");
        Tensor grad = empty({rows, classes});
        Tensor grad_d = empty({rows, classes}, TensorOptions().with_device(kDevice));
        K::cross_entropy_backward(kCPU, grad_loss, logits, target, weight, lse, smoothing, ignore, grad);
        K::cross_entropy_backward(kDevice, grad_loss.to(kDevice), x_d, t_d, w_d, lse_d, smoothing, ignore, grad_d);
        expect_close(grad_d, grad, 1e-6, 1e-4, "grad");
      }
    }
  }
  // weights of the wrong length or on another device are refused
  const Tensor x = zeros({2, 3}, kDevice), t = from_vector(std::vector<int64_t>{0, 1}).to(kDevice);
  Tensor loss = empty({2}, TensorOptions().with_device(kDevice)), lse = empty({2}, TensorOptions().with_device(kDevice));
  CHECK_THROWS_AS(K::cross_entropy_forward(kDevice, x, t, zeros({2}, kDevice), 0.0, -100, loss, lse), ValueError);
  CHECK_THROWS_AS(K::cross_entropy_forward(kDevice, x, t, zeros({3}), 0.0, -100, loss, lse), ValueError);
}

TEST_CASE("cuda losses: the functional losses and their gradients on the device equal the CPU's") {
  const Tensor a = uniform_cpu({6, 5}, 1810), b = uniform_cpu({6, 5}, 1811, 0.0, 1.0);
  const Tensor w = uniform_cpu({5}, 1812, 0.5, 1.5), pw = uniform_cpu({5}, 1813, 0.5, 2.0);
  const Tensor target = from_vector(std::vector<int64_t>{0, 4, -100, 2, 1, 3});
  using Loss = std::function<Tensor(const Tensor&, Device)>;
  const std::vector<std::pair<std::string, Loss>> losses = {
      {"cross_entropy", [&](const Tensor& x, Device d) {
         return F::cross_entropy(x, target.to(d), 0.1, F::Reduction::Mean, -100, w.to(d));
       }},
      {"nll_loss", [&](const Tensor& x, Device d) {
         return F::nll_loss(log_softmax(x, 1), target.to(d), F::Reduction::Mean, -100, w.to(d));
       }},
      {"bce_with_logits", [&](const Tensor& x, Device d) {
         return F::binary_cross_entropy_with_logits(x, b.to(d), w.to(d), pw.to(d));
       }},
      {"l1", [&](const Tensor& x, Device d) { return F::l1_loss(x, b.to(d)); }},
      {"smooth_l1", [&](const Tensor& x, Device d) { return F::smooth_l1_loss(x, b.to(d), F::Reduction::Sum, 0.5); }},
      {"kl_div", [&](const Tensor& x, Device d) {
         return F::kl_div(log_softmax(x, 1), b.to(d), F::Reduction::BatchMean);
       }},
  };
  for (const auto& [name, loss] : losses) {
    Tensor x_cpu = a.clone().requires_grad_(true), x_gpu = a.to(kDevice).requires_grad_(true);
    Tensor y_cpu = loss(x_cpu, kCPU), y_gpu = loss(x_gpu, kDevice);
    y_cpu.backward();
    y_gpu.backward();
    expect_close(y_gpu, y_cpu, 1e-5, 1e-5, name + " value");
    expect_close(x_gpu.grad(), x_cpu.grad(), 1e-6, 1e-4, name + " gradient");
  }
}

TEST_CASE("cuda optim: amsgrad and RMSprop steps match the CPU") {
  const int64_t n = 10007;
  for (const bool decoupled : {false, true}) {
    CAPTURE(decoupled);
    Tensor w = uniform_cpu({n}, 1820), m = zeros({n}), v = zeros({n}), vmax = zeros({n});
    Tensor w_d = w.to(kDevice), m_d = zeros({n}, kDevice), v_d = zeros({n}, kDevice), vmax_d = zeros({n}, kDevice);
    for (int64_t step = 1; step <= 6; ++step) {
      // shrinking gradients, so the maximum and the moment part ways
      const Tensor g = mul(uniform_cpu({n}, 1830 + step), 4.0 / static_cast<double>(step));
      const K::AdamParams p{1e-2, 0.9, 0.99, 1e-8, 0.01, step, decoupled};
      K::adam_amsgrad_step(kCPU, w, g, m, v, vmax, p);
      K::adam_amsgrad_step(kDevice, w_d, g.to(kDevice), m_d, v_d, vmax_d, p);
    }
    expect_close(w_d, w, 1e-6, 1e-5, "param");
    expect_close(vmax_d, vmax, 1e-7, 1e-5, "max_exp_avg_sq");
  }
  for (const double momentum : {0.0, 0.9}) {
    for (const bool centered : {false, true}) {
      CAPTURE(momentum);
      CAPTURE(centered);
      Tensor w = uniform_cpu({n}, 1840), sq = zeros({n});
      Tensor buf = momentum > 0 ? zeros({n}) : Tensor(), avg = centered ? zeros({n}) : Tensor();
      Tensor w_d = w.to(kDevice), sq_d = zeros({n}, kDevice);
      Tensor buf_d = momentum > 0 ? zeros({n}, kDevice) : Tensor(), avg_d = centered ? zeros({n}, kDevice) : Tensor();
      for (int step = 0; step < 6; ++step) {
        const Tensor g = uniform_cpu({n}, 1850 + step);
        const K::RmspropParams p{1e-2, 0.95, 1e-8, 0.01, momentum, centered};
        K::rmsprop_step(kCPU, w, g, sq, buf, avg, p);
        K::rmsprop_step(kDevice, w_d, g.to(kDevice), sq_d, buf_d, avg_d, p);
      }
      expect_close(w_d, w, 1e-6, 1e-5, "param");
      expect_close(sq_d, sq, 1e-7, 1e-5, "square_avg");
      if (buf.defined()) expect_close(buf_d, buf, 1e-6, 1e-5, "momentum_buffer");
      if (avg.defined()) expect_close(avg_d, avg, 1e-7, 1e-5, "grad_avg");
    }
  }
}
