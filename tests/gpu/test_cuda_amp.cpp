// The gradient scaler's CUDA kernels against their CPU twins (skipped without a device, see main.cpp):
// the fused non-finite check and unscale (bit for bit: one multiply per element) over gradients with
// and without injected infinities and NaNs, sizes from one element to more than a grid's worth, and
// the scale update; then GradScaler end to end on the device, where a skipped step reads found_inf once.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "core/random.h"
#include "kernels/kernels.h"
#include "nn/grad_scaler.h"
#include "nn/optim.h"

using namespace mn;
namespace K = mn::kernels;

namespace {

const Device kDevice = cuda_device(0);

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("cuda amp: non_finite_check_and_unscale matches the CPU bit for bit") {
  // 3,000,001 elements: more than 65535 * 8 blocks of 256 threads cover, so the grid-stride loop repeats.
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{3000001}}) {
    for (const char* inject : {"none", "inf", "nan"}) {
      for (float inv : {1.0f / 65536.0f, 1.0f / 3.0f, 1.0f}) {
        CAPTURE(n);
        CAPTURE(inject);
        CAPTURE(inv);
        Generator gen(static_cast<uint64_t>(n));
        std::vector<float> values = mul(randn({n}, {}, &gen), 1e3).to_vector<float>();
        if (std::string(inject) == "inf") values[static_cast<size_t>(n - 1)] = std::numeric_limits<float>::infinity();
        if (std::string(inject) == "nan") values[0] = std::numeric_limits<float>::quiet_NaN();
        Tensor cpu = from_vector(values, {n});
        Tensor gpu = cpu.to(kDevice);
        Tensor found_cpu = zeros({1}), found_gpu = zeros({1}, TensorOptions(kDevice));
        K::non_finite_check_and_unscale(kCPU, cpu, found_cpu, full({1}, inv));
        K::non_finite_check_and_unscale(kDevice, gpu, found_gpu, full({1}, inv, TensorOptions(kDevice)));
        CHECK(found_gpu.item() == found_cpu.item());
        CHECK(found_cpu.item() == (std::string(inject) == "none" ? 0.0 : 1.0));
        // NaN payloads are not compared (the device may write its canonical NaN): mask them first.
        std::vector<float> g = gpu.to_vector<float>(), c = cpu.to_vector<float>();
        for (size_t i = 0; i < c.size(); ++i)
          if (std::isnan(c[i]) && std::isnan(g[i])) g[i] = c[i] = 0.0f;
        CHECK(same_bits(g, c));
      }
    }
  }
}

TEST_CASE("cuda amp: amp_update_scale matches the CPU over a sequence of steps") {
  Tensor scale_cpu = full({1}, 1024.0), scale_gpu = full({1}, 1024.0, TensorOptions(kDevice));
  Tensor tracker_cpu = zeros({1}, DType::i64), tracker_gpu = zeros({1}, TensorOptions(kDevice).with_dtype(DType::i64));
  const std::vector<float> found = {0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0};
  for (size_t i = 0; i < found.size(); ++i) {
    CAPTURE(i);
    const Tensor f_cpu = full({1}, found[i]), f_gpu = full({1}, found[i], TensorOptions(kDevice));
    K::amp_update_scale(kCPU, scale_cpu, tracker_cpu, f_cpu, 2.0, 0.3, 3);
    K::amp_update_scale(kDevice, scale_gpu, tracker_gpu, f_gpu, 2.0, 0.3, 3);
    CHECK(scale_gpu.item() == scale_cpu.item());
    CHECK(tracker_gpu.item() == tracker_cpu.item());
  }
}

TEST_CASE("cuda amp: GradScaler on the device skips an overflowing step and backs off") {
  Tensor p = from_vector(std::vector<float>{1, 2, 3}).to(kDevice).requires_grad_(true);
  nn::optim::Adam adam({p}, {.lr = 0.1});
  amp::GradScaler scaler;
  const std::vector<std::vector<float>> grads = {{1, 2, 3}, {1, std::numeric_limits<float>::infinity(), 3}, {1, 1, 1}};
  for (const auto& g : grads) {
    adam.zero_grad();
    scaler.scale(sum(mul(p, from_vector(g).to(kDevice)))).backward();
    CHECK(scaler.scale_tensor().device() == kDevice);
    const std::vector<float> before = p.to_vector<float>();
    const bool stepped = scaler.step(adam);
    CHECK(stepped == std::isfinite(g[1]));
    if (!stepped) CHECK(same_bits(p.to_vector<float>(), before));
    scaler.update();
  }
  CHECK(adam.step_count() == 2);
  CHECK(scaler.get_scale() == 32768.0);
  CHECK(scaler.growth_tracker() == 1);
}
