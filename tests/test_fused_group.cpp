// The fused mapped-group kernels (mapping/fused_group.h, kernels/cpu/mapped_group.cpp) against the
// composition they replace, kept here as the reference: mapper.forward(z) (the sign products, GEMMs and
// modulation add of MLPMapper) times the per-element scale, the groups concatenated. Values and
// gradients agree up to float rounding, first- and second-order gradchecks pass, the bits do not
// depend on the thread count, the generators take the fused path only where it computes the same
// thing, and bad operands are refused.
#include <omp.h>

#include "autograd/engine.h"
#include "autograd/gradcheck.h"
#include "kernels/kernels.h"
#include "mapping/fused_group.h"
#include "mapping/generator.h"
#include "mapping/targets.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::mapping;
using mn::testing::check_close;

namespace {

std::shared_ptr<MLPMapper> mapper(int64_t latent, int64_t out, double alpha, MapperFamily family = MapperFamily::Block,
                                  std::vector<int64_t> hidden = {}) {
  MapperMatrixOptions o;
  o.family = family;
  return std::make_shared<MLPMapper>(latent, out, 3, "mapper/test", std::move(hidden), Modulation::additive(alpha),
                                     nullptr, nullptr, o);
}

Tensor positive_scale(int64_t n, uint64_t seed) {
  Generator gen(seed);
  return uniform({n}, 0.5, 2.0, DType::f32, &gen);
}

// The unfused composition the generators ran before: mapper.forward(z) * scale.
Tensor composed(const Mapper& m, const Tensor& z, const Tensor& scale) {
  const Tensor theta = m.forward(z);
  return scale.defined() ? mul(theta, scale) : theta;
}

Tensor grad_of(const Tensor& out, const Tensor& upstream, const Tensor& z) {
  return autograd::grad({out}, {z}, {upstream})[0];
}

bool same_bits(const Tensor& a, const Tensor& b) { return a.to_vector<float>() == b.to_vector<float>(); }

struct Case {
  int64_t latent, rows;
  MapperFamily family;
  const char* what;
};

// Repeated blocks with a tail: few sign rows (L above the rows of a chunk: a sign-product buffer per
// thread), several chunks of sign rows with L at most a chunk's rows (65,536 / L rows: the small-block
// path, one [L, L] buffer) and with L above them; tail only (rows < 2L), wide (rows < L) and the
// dense family.
const Case kCases[] = {{16, 16 * 5 + 3, MapperFamily::Block, "block, 4 repeats + tail"},
                       {16, 16 * 9000 + 21, MapperFamily::Block, "small block, 3 chunks of sign rows"},
                       {600, 600 * 250 + 77, MapperFamily::Block, "large block, 3 chunks of sign rows"},
                       {64, 100, MapperFamily::Block, "tail only"},
                       {64, 40, MapperFamily::Block, "wide (orthonormal rows)"},
                       {24, 300, MapperFamily::Dense, "dense family"}};

}  // namespace

TEST_CASE("fused group: values and gradients match the composition, with and without scales") {
  for (const Case& c : kCases)
    for (bool scaled : {false, true})
      for (double alpha : {0.0, 0.01, 0.5}) {
        INFO(std::string(c.what) << ", scaled " << scaled << ", alpha " << alpha);
        const auto m = mapper(c.latent, c.rows, alpha, c.family);
        const Tensor scale = scaled ? positive_scale(c.rows, 11) : Tensor();
        const std::optional<FusedGroup> f = fused_group(*m, scale);
        REQUIRE(f.has_value());
        const Tensor z = testing::random_param({c.latent}, 7, 0.3);
        const Tensor fused = generate_fused({*f}, {z});
        const Tensor reference = composed(*m, z, scale);
        check_close(fused, reference.to_vector<float>(), 2e-5);
        Generator gen(9);
        const Tensor upstream = randn({c.rows}, {}, &gen);
        const std::vector<float> expected = grad_of(reference, upstream, z).to_vector<float>();
        check_close(grad_of(fused, upstream, z), expected, 5e-4);
        // The differentiable formula (create_graph's path) is the same gradient.
        check_close(fused_group_backward_reference(*f, z.detach(), upstream), expected, 5e-4);
      }
}

TEST_CASE("fused group: gradcheck, and double backward through the composition's formula") {
  const auto m = mapper(6, 6 * 3 + 4, 0.3);
  const FusedGroup f = *fused_group(*m, positive_scale(22, 5));
  const Tensor z = testing::random_param({6}, 4, 0.5);
  auto fn = [&](const std::vector<Tensor>& in) { return generate_fused({f}, {in[0]}); };
  CHECK(autograd::gradcheck(fn, {z}) == "");
  CHECK(autograd::gradgradcheck(fn, {z}) == "");
  // Two groups in one vector: each latent gets its own slice's gradient.
  const auto m2 = mapper(5, 12, 0.1);
  const FusedGroup f2 = *fused_group(*m2, Tensor());
  const Tensor z2 = testing::random_param({5}, 8, 0.5);
  auto both = [&](const std::vector<Tensor>& in) { return generate_fused({f, f2}, {in[0], in[1]}); };
  CHECK(autograd::gradcheck(both, {z, z2}) == "");
  CHECK(autograd::gradgradcheck(both, {z, z2}) == "");
  // The small-block path (L no more than the sign rows): 9 sign rows of L = 4.
  const auto m3 = mapper(4, 4 * 10 + 1, 0.2);
  const FusedGroup f3 = *fused_group(*m3, positive_scale(41, 6));
  auto small = [&](const std::vector<Tensor>& in) { return generate_fused({f3}, {in[0]}); };
  const Tensor z3 = testing::random_param({4}, 9, 0.5);
  CHECK(autograd::gradcheck(small, {z3}) == "");
  CHECK(autograd::gradgradcheck(small, {z3}) == "");
}

TEST_CASE("fused group: the bits do not depend on the thread count") {
  const int saved = omp_get_max_threads();
  // The small-block backward cuts the full chunks the team does not divide into K blocks: at 3 threads
  // both of the first shape's two (2,048 sign rows each), at 2 threads the third of the second's.
  for (auto [latent, rows] :
       {std::pair<int64_t, int64_t>{32, 32 * 5000 + 17}, {64, 64 * 3140 + 5}, {300, 300 * 700 + 450}}) {
    INFO(latent << " -> " << rows);
    const auto m = mapper(latent, rows, 0.01);
    const FusedGroup f = *fused_group(*m, positive_scale(rows, 2));
    const Tensor z = testing::random_param({latent}, 1, 0.2);
    Generator gen(3);
    const Tensor upstream = randn({f.rows}, {}, &gen);
    std::vector<Tensor> values, grads;
    for (int threads : {1, 2, 3}) {
      omp_set_num_threads(threads);
      const Tensor y = generate_fused({f}, {z});
      values.push_back(y.detach());
      grads.push_back(grad_of(y, upstream, z));
    }
    omp_set_num_threads(saved);
    CHECK(same_bits(values[0], values[1]));
    CHECK(same_bits(values[0], values[2]));
    CHECK(same_bits(grads[0], grads[1]));
    CHECK(same_bits(grads[0], grads[2]));
  }
}

TEST_CASE("fused group: only the mappers it computes exactly have a fused form") {
  CHECK(fused_group(*mapper(8, 40, 0.01), Tensor()).has_value());
  CHECK(fused_group(*mapper(8, 40, 0.01, MapperFamily::Dense), Tensor()).has_value());
  CHECK_FALSE(fused_group(*mapper(8, 40, 0.01, MapperFamily::Srht), Tensor()).has_value());
  CHECK_FALSE(fused_group(*mapper(8, 40, 0.01, MapperFamily::Block, {16}), Tensor()).has_value());
  const MLPMapper affine(8, 40, 3, "m", {}, Modulation::affine(0.1, 0.1));
  CHECK_FALSE(fused_group(affine, Tensor()).has_value());
  const MLPMapper activated(8, 40, 3, "m", {}, Modulation::additive(0.01), [](const Tensor& x) { return tanh(x); });
  CHECK_FALSE(fused_group(activated, Tensor()).has_value());
}

TEST_CASE("fused group: layer-wise generators give the composition's parameters and latent gradients") {
  const ParameterSpec spec = target_spec("cnn2");
  for (const char* strategy : {"layerwise", "lazy_layerwise", "slvt"}) {
    INFO(strategy);
    auto gen = make_generator(strategy, spec, 48);
    std::vector<float> scales;
    for (size_t i = 0; i < spec.size(); ++i) scales.push_back(0.05f + 0.01f * static_cast<float>(i));
    gen->set_scales(scales);
    std::vector<std::vector<Tensor>> params(2), grads(2);
    Generator noise(4);
    std::vector<Tensor> upstream;
    for (const auto& e : spec.entries()) upstream.push_back(randn(e.shape, {}, &noise));
    for (int fused = 0; fused < 2; ++fused) {
      set_fused_generation(fused == 1);
      const ParameterTree tree = gen->generate_parameters();
      std::vector<Tensor> roots;
      for (const auto& [name, t] : tree.items()) {
        roots.push_back(t);
        params[fused].push_back(t.detach());
      }
      grads[fused] = autograd::grad(roots, gen->latents(), upstream);
    }
    set_fused_generation(true);
    for (size_t i = 0; i < params[0].size(); ++i) check_close(params[1][i], params[0][i].to_vector<float>(), 2e-5);
    for (size_t i = 0; i < grads[0].size(); ++i) check_close(grads[1][i], grads[0][i].to_vector<float>(), 1e-3);
  }
}

TEST_CASE("fused group: NaN in the latent reaches every generated value, as in the composition") {
  const auto m = mapper(8, 8 * 3 + 2, 0.01);
  const FusedGroup f = *fused_group(*m, Tensor());
  Tensor z = testing::random_tensor({8}, 2);
  z.data<float>()[3] = std::nanf("");
  for (float v : generate_fused({f}, {z}).to_vector<float>()) CHECK(std::isnan(v));
  for (float v : composed(*m, z, Tensor()).to_vector<float>()) CHECK(std::isnan(v));
}

TEST_CASE("fused group: bad operands are refused with what was expected") {
  const auto m = mapper(8, 30, 0.01);
  const FusedGroup f = *fused_group(*m, Tensor());
  CHECK_THROWS_AS(generate_fused({f}, {zeros({7})}), ValueError);
  CHECK(testing::contains(testing::error_message([&] { generate_fused({f}, {zeros({7})}); }), "shape [8]"));
  CHECK_THROWS_AS(generate_fused({f}, {zeros({8}, TensorOptions().with_dtype(DType::i64))}), ValueError);
  CHECK_THROWS_AS(generate_fused({f, f}, {zeros({8})}), ValueError);
  Tensor out = empty({29});
  CHECK(testing::contains(testing::error_message([&] {
                            kernels::mapped_group_forward(kCPU, f.block, f.signs, f.tail, Tensor(), 0.0, zeros({8}),
                                                          out);
                          }),
                          "30 rows"));
  Tensor grad_z = empty({8});
  CHECK_THROWS_AS(kernels::mapped_group_backward(kCPU, f.block, f.signs, f.tail, zeros({5}), 0.0, zeros({8}),
                                                 zeros({30}), grad_z),
                  ValueError);
}
