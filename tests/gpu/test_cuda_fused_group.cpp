// The fused mapped-group kernels on a real device (skipped without one, see main.cpp): the CUDA twins
// (kernels/cuda/mapped_group.cu) against the CPU kernels (kernels/cpu/mapped_group.cpp) for values and
// latent gradients, to float rounding (the sums run in another order), over shapes with several
// 32-row tiles and a tail, a length that is not a multiple of 32, tail only, a wide W and the dense
// family; the same run twice gives the same bits (no atomics); and a layer-wise generator with
// per-element scales on the device against the same generator on the CPU.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "autograd/engine.h"
#include "autograd/ops.h"
#include "core/cuda.h"
#include "core/random.h"
#include "mapping/fused_group.h"
#include "mapping/generator.h"
#include "mapping/targets.h"

using namespace mn;
using namespace mn::mapping;

namespace {

const Device kDevice = cuda_device(0);

void check_close_on_host(const Tensor& device_tensor, const Tensor& host, double tol) {
  const std::vector<float> got = device_tensor.to(kCPU).to_vector<float>(), want = host.to_vector<float>();
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("element " << i << ": device " << got[i] << ", host " << want[i]);
    CHECK(std::abs(got[i] - want[i]) <= tol * (1.0 + std::abs(want[i])));
  }
}

Tensor grad_of(const Tensor& out, const Tensor& upstream, const Tensor& z) {
  return autograd::grad({out}, {z}, {upstream})[0];
}

}  // namespace

TEST_CASE("cuda fused group: values and gradients equal the CPU kernels' to rounding, and repeat bit for bit") {
  struct Case {
    int64_t latent, rows;
    MapperFamily family;
  };
  for (const Case c : {Case{16, 16 * 70 + 5, MapperFamily::Block}, Case{37, 37 * 40 + 50, MapperFamily::Block},
                       Case{64, 100, MapperFamily::Block}, Case{64, 40, MapperFamily::Block},
                       Case{24, 3000, MapperFamily::Dense}, Case{672, 672 * 12 + 300, MapperFamily::Block}})
    for (bool scaled : {false, true}) {
      INFO(c.latent << " -> " << c.rows << ", scaled " << scaled);
      MapperMatrixOptions o;
      o.family = c.family;
      MLPMapper host(c.latent, c.rows, 5, "m", {}, Modulation::additive(0.05), nullptr, nullptr, o);
      MLPMapper device(c.latent, c.rows, 5, "m", {}, Modulation::additive(0.05), nullptr, nullptr, o);
      device.to(kDevice);
      Generator gen(8);
      const Tensor scale = scaled ? uniform({c.rows}, 0.5, 2.0, DType::f32, &gen) : Tensor();
      const Tensor z = randn({c.latent}, {}, &gen).requires_grad_(true);
      const Tensor zd = z.detach().to(kDevice).requires_grad_(true);
      const Tensor upstream = randn({c.rows}, {}, &gen);
      const FusedGroup fh = *fused_group(host, scale);
      const FusedGroup fd = *fused_group(device, scaled ? scale.to(kDevice) : Tensor());
      const Tensor yh = generate_fused({fh}, {z}), yd = generate_fused({fd}, {zd});
      CHECK(yd.device() == kDevice);
      check_close_on_host(yd, yh, 1e-5);
      const Tensor gd = grad_of(yd, upstream.to(kDevice), zd);
      check_close_on_host(gd, grad_of(yh, upstream, z), 1e-4);
      // Deterministic: the same launch again gives the same bits.
      const Tensor yd2 = generate_fused({fd}, {zd});
      CHECK(yd2.to(kCPU).to_vector<float>() == yd.to(kCPU).to_vector<float>());
      CHECK(grad_of(yd2, upstream.to(kDevice), zd).to(kCPU).to_vector<float>() == gd.to(kCPU).to_vector<float>());
    }
}

TEST_CASE("cuda fused group: a scaled layer-wise generator on the device matches the CPU one") {
  const ParameterSpec spec = target_spec("cnn2");
  auto host = make_generator("layerwise", spec, 96);
  auto device = make_generator("layerwise", spec, 96);
  std::vector<float> scales;
  for (size_t i = 0; i < spec.size(); ++i) scales.push_back(0.1f + 0.02f * static_cast<float>(i));
  host->set_scales(scales);
  device->set_scales(scales);
  device->to(kDevice);
  const ParameterTree th = host->generate_parameters(), td = device->generate_parameters();
  Generator noise(3);
  std::vector<Tensor> rh, rd, uh, ud;
  for (const auto& [name, t] : th.items()) {
    rh.push_back(t);
    rd.push_back(td.at(name));
    uh.push_back(randn(t.sizes(), {}, &noise));
    ud.push_back(uh.back().to(kDevice));
    check_close_on_host(rd.back(), t.detach(), 1e-5);
  }
  const std::vector<Tensor> gh = autograd::grad(rh, host->latents(), uh);
  const std::vector<Tensor> gd = autograd::grad(rd, device->latents(), ud);
  for (size_t i = 0; i < gh.size(); ++i) check_close_on_host(gd[i], gh[i], 1e-3);
}
