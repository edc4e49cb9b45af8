// The srht mapper family on a real device (skipped without one, see main.cpp): the CUDA kernels
// (kernels/cuda/srht.cu) against their CPU twins, bit for bit, for W z and W^T u over the shapes that
// exercise full blocks, a spread tail, many blocks and a wide (transposed) W; the gradient through
// the device map; and a layerwise generator with mapper "srht" on the device against the CPU one (to
// float rounding there: the additive modulation's ||z||^2 is a reduction, summed in another order).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "autograd/ops.h"
#include "core/cuda.h"
#include "core/random.h"
#include "mapping/generator.h"
#include "mapping/orthogonal.h"
#include "mapping/targets.h"

using namespace mn;
using namespace mn::mapping;

namespace {

const Device kDevice = cuda_device(0);

bool same_bits_on_host(const Tensor& device_tensor, const Tensor& host) {
  return device_tensor.to(kCPU).to_vector<float>() == host.to_vector<float>();
}

MapperMatrixOptions srht() {
  MapperMatrixOptions o;
  o.family = MapperFamily::Srht;
  return o;
}

}  // namespace

TEST_CASE("cuda mapper families: srht W z and W^T u equal the CPU's bit for bit") {
  for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
           {64, 8}, {37, 8}, {100, 24}, {40000, 100}, {8, 37}, {70000, 2048}, {5000, 1}}) {
    INFO(rows << " x " << cols);
    const OrthogonalMatrix w = OrthogonalMatrix::build(13, "m", rows, cols, true, kCPU, srht());
    REQUIRE(w.hadamard());
    Generator gen(21);
    const Tensor z = randn({cols}, {}, &gen), u = randn({rows}, {}, &gen);
    const Tensor y = w.apply(z.to(kDevice)), g = w.apply_transpose(u.to(kDevice));
    CHECK(y.device() == kDevice);
    CHECK(same_bits_on_host(y, w.apply(z)));
    CHECK(same_bits_on_host(g, w.apply_transpose(u)));
  }
}

TEST_CASE("cuda mapper families: the gradient through the device srht map is the CPU's") {
  const OrthogonalMatrix w = OrthogonalMatrix::build(2, "m", 3000, 100, true, kCPU, srht());
  Generator gen(3);
  const Tensor z = randn({100}, {}, &gen), weights = randn({3000}, {}, &gen);
  const Tensor zh = z.clone().requires_grad_(true), zd = z.to(kDevice).requires_grad_(true);
  sum(mul(w.apply(zh), weights)).backward();
  sum(mul(w.apply(zd), weights.to(kDevice))).backward();
  CHECK(same_bits_on_host(zd.grad(), zh.grad()));
}

TEST_CASE("cuda mapper families: a layerwise srht generator on the device generates the CPU's parameters") {
  const ParameterSpec spec = target_spec("cnn2");
  GeneratorOptions host_options, dev_options;
  host_options.seed = dev_options.seed = 17;
  host_options.mapper = dev_options.mapper = "srht";
  dev_options.device = kDevice;
  LayerwiseGenerator host(spec, 96, host_options), dev(spec, 96, dev_options);
  const ParameterTree a = host.generate_parameters(), b = dev.generate_parameters();
  for (const auto& [name, t] : a.items()) {
    INFO(name);
    const std::vector<float> want = t.to_vector<float>(), got = b.at(name).to(kCPU).to_vector<float>();
    REQUIRE(got.size() == want.size());
    float scale = 0, worst = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      scale = std::max(scale, std::abs(want[i]));
      worst = std::max(worst, std::abs(got[i] - want[i]));
    }
    CHECK(worst <= 1e-5f * scale);
  }
}
