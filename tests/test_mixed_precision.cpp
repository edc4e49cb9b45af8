// Mixed precision (issue 23 section 3): the bf16 and f16 dtypes, their conversions against PyTorch
// 1.13's (tests/data/parity_mixed_precision.safetensors, make_parity.py mixed_precision), ops on 16-bit
// tensors through the dispatcher's widening (kernels/dispatch.h), promotion and gradients across
// dtypes, and the autocast scope (autograd/autocast.h) against torch.autocast("cpu", bfloat16).
#include <cmath>
#include <cstring>

#include "autograd/autocast.h"
#include "mapping/mapping_networks.h"
#include "tests/temp_dir.h"
#include "tests/test_support.h"

using namespace mn;
using mn::testing::check_close;
using mn::testing::contains;
using mn::testing::error_message;
using mn::testing::random_tensor;
using mn::testing::tensor;
namespace F = mn::nn::functional;

namespace {

safetensors::File golden() {
  return safetensors::load(std::string(MN_TEST_DATA_DIR) + "/parity_mixed_precision.safetensors");
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// Every element bit-identical (any NaN matches any NaN).
void check_same_values(const Tensor& got, const Tensor& expected) {
  REQUIRE(got.sizes() == expected.sizes());
  const std::vector<float> g = got.to_vector<float>(), e = expected.to_vector<float>();
  for (size_t i = 0; i < g.size(); ++i) {
    INFO("element " << i << ": got " << g[i] << ", expected " << e[i]);
    if (std::isnan(e[i]))
      CHECK(std::isnan(g[i]));
    else
      CHECK(bits_of(g[i]) == bits_of(e[i]));
  }
}

// Within `ulps` units in the last place of bf16 (2^-8 relative), plus a small absolute floor; with
// `of_largest`, ulps of the tensor's largest magnitude (results that went through several roundings
// and cancel).
void check_bf16_close(const Tensor& got, const Tensor& expected, double ulps = 2, bool of_largest = false) {
  REQUIRE(got.sizes() == expected.sizes());
  const std::vector<float> g = got.to_vector<float>(), e = expected.to_vector<float>();
  double largest = 0;
  for (float v : e) largest = std::max(largest, static_cast<double>(std::abs(v)));
  for (size_t i = 0; i < g.size(); ++i) {
    INFO("element " << i << ": got " << g[i] << ", expected " << e[i]);
    const double ref = of_largest ? largest : std::abs(e[i]);
    CHECK(std::abs(g[i] - e[i]) <= ulps * std::ldexp(ref, -8) + 1e-6);
  }
}

}  // namespace

TEST_CASE("mixed precision: dtype properties and promotion") {
  CHECK(dtype_size(DType::bf16) == 2);
  CHECK(dtype_size(DType::f16) == 2);
  CHECK(std::string(dtype_name(DType::bf16)) == "bf16");
  CHECK(std::string(dtype_name(DType::f16)) == "f16");
  CHECK(promote_types(DType::bf16, DType::f32) == DType::f32);
  CHECK(promote_types(DType::bf16, DType::f16) == DType::f32);
  CHECK(promote_types(DType::f16, DType::f16) == DType::f16);
  CHECK(promote_types(DType::i64, DType::bf16) == DType::bf16);
  Tensor h = zeros({3, 5}, DType::bf16);
  CHECK(h.dtype() == DType::bf16);
  CHECK(h.nbytes() == 30);
  CHECK(ones({}, DType::f16).item() == 1.0);
  CHECK(arange(4.0, TensorOptions(DType::bf16)).to_vector<float>() == std::vector<float>{0, 1, 2, 3});
  CHECK(contains(tensor({1.5f}).to(DType::bf16).str(), "dtype=bf16"));
}

TEST_CASE("mixed precision: f32 -> bf16 / f16 conversions match PyTorch bit for bit") {
  const auto f = golden();
  const Tensor x = f.at("conv_x");
  // The file's 16-bit tensors load as f32 holding the exact 16-bit values.
  check_same_values(x.to(DType::bf16).to(DType::f32), f.at("conv_bf16"));
  check_same_values(x.to(DType::f16).to(DType::f32), f.at("conv_f16"));
  // Narrowing from i64 goes through f32, widening to i64 saturates as for f32.
  CHECK(from_vector(std::vector<int64_t>{3, -70000}).to(DType::f16).to_vector<float>() ==
        std::vector<float>{3.0f, -INFINITY});
  CHECK(tensor({2.75f, -1e30f}).to(DType::bf16).to(DType::i64).to_vector<int64_t>() ==
        std::vector<int64_t>{2, INT64_MIN});
}

TEST_CASE("mixed precision: every f16 pattern survives f16 -> f32 -> f16, bf16 likewise") {
  for (DType t : {DType::f16, DType::bf16}) {
    INFO(t);
    std::vector<int64_t> patterns(65536);
    for (int64_t i = 0; i < 65536; ++i) patterns[static_cast<size_t>(i)] = i;
    // Build the 16-bit tensor from raw patterns: an i64 tensor's low halves viewed through a copy.
    Tensor h = empty({65536}, t);
    uint16_t* p = static_cast<uint16_t*>(h.raw_data());
    for (int64_t i = 0; i < 65536; ++i) p[i] = static_cast<uint16_t>(i);
    Tensor back = h.to(DType::f32).to(t);
    const uint16_t* q = static_cast<const uint16_t*>(back.raw_data());
    const std::vector<float> wide = h.to(DType::f32).to_vector<float>();
    int mismatches = 0;
    for (int64_t i = 0; i < 65536; ++i)
      if (!std::isnan(wide[static_cast<size_t>(i)]) && q[i] != p[i]) ++mismatches;
    CHECK(mismatches == 0);
  }
}

TEST_CASE("mixed precision: bf16 ops compute in f32 and round once, as PyTorch") {
  const auto f = golden();
  const Tensor a = f.at("op_a").to(DType::bf16), b = f.at("op_b").to(DType::bf16);
  REQUIRE(a.dtype() == DType::bf16);
  // One correctly rounded f32 operation then one rounding: the very bits PyTorch gives.
  check_same_values(add(a, b).to(DType::f32), f.at("op_add"));
  check_same_values(mul(a, b).to(DType::f32), f.at("op_mul"));
  check_same_values(div(a, b).to(DType::f32), f.at("op_div"));
  check_same_values(relu(a).to(DType::f32), f.at("op_relu"));
  // Transcendentals and reductions: f32 formulas and summation orders differ in the last f32 bits,
  // which can flip a bf16 rounding.
  check_bf16_close(gelu(a).to(DType::f32), f.at("op_gelu"), 1);
  check_bf16_close(exp(a).to(DType::f32), f.at("op_exp"), 1);
  check_bf16_close(tanh(a).to(DType::f32), f.at("op_tanh"), 1);
  check_bf16_close(sum(a, {1}).to(DType::f32), f.at("op_sum1"), 1);
  check_bf16_close(mean(a).to(DType::f32), f.at("op_mean"), 1);
  check_bf16_close(softmax(a, 1).to(DType::f32), f.at("op_softmax"), 1);
  check_bf16_close(matmul(a, b.t()).to(DType::f32), f.at("op_mm"), 2);
  CHECK(add(a, b).dtype() == DType::bf16);
  CHECK(sum(a, {1}).dtype() == DType::bf16);
  CHECK(matmul(a, b.t()).dtype() == DType::bf16);
  const Tensor a16 = f.at("op_a16").to(DType::f16), b16 = f.at("op_b16").to(DType::f16);
  check_same_values(add(a16, b16).to(DType::f32), f.at("op_add_f16"));
}

TEST_CASE("mixed precision: kernels of every family take 16-bit tensors") {
  const Tensor x32 = random_tensor({2, 3, 6, 6}, 7), w32 = random_tensor({4, 3, 3, 3}, 8);
  for (DType t : {DType::bf16, DType::f16}) {
    INFO(t);
    const Tensor x = x32.to(t), w = w32.to(t);
    // The result of each op equals the f32 op on the widened values, rounded once.
    auto same = [&](const Tensor& low, const Tensor& reference) {
      CHECK(low.dtype() == t);
      check_same_values(low.to(DType::f32), reference.to(t).to(DType::f32));
    };
    const Tensor xw = x.to(DType::f32), ww = w.to(DType::f32);
    same(F::conv2d(x, w, Tensor(), {1, 1}, {1, 1}), F::conv2d(xw, ww, Tensor(), {1, 1}, {1, 1}));
    same(F::max_pool2d(x, {2, 2}), F::max_pool2d(xw, {2, 2}));
    same(amax(x, {1, 2}), amax(xw, {1, 2}));
    same(cat({x, x}, 1), cat({xw, xw}, 1));
    same(x.index_select(0, from_vector(std::vector<int64_t>{1, 0})), xw.index_select(0, from_vector(std::vector<int64_t>{1, 0})));
    same(where(gt(x, 0.0), x, neg(x)), where(gt(xw, 0.0), xw, neg(xw)));
    CHECK(gt(x, 0.0).dtype() == DType::f32);  // comparisons still give f32 masks
    CHECK(argmax(x).item() == argmax(xw).item());
    const Tensor third = full({}, 1.0 / 3.0, t);
    CHECK(third.item() == full({}, static_cast<double>(1.0f / 3.0f), t).item());
  }
}

TEST_CASE("mixed precision: gradients cross dtypes and arrive in each leaf's dtype") {
  Tensor w = tensor({0.5f, -1.25f, 2.0f}).requires_grad_(true);  // f32 leaf
  Tensor h = w.to(DType::bf16);
  CHECK(h.dtype() == DType::bf16);
  Tensor y = mul(relu(h), tensor({1.0f, 2.0f, 3.0f}));  // bf16 * f32 promotes to f32
  CHECK(y.dtype() == DType::f32);
  sum(y).backward();
  REQUIRE(w.grad().defined());
  CHECK(w.grad().dtype() == DType::f32);
  CHECK(w.grad().to_vector<float>() == std::vector<float>{1.0f, 0.0f, 3.0f});

  // A 16-bit leaf receives a 16-bit gradient, whatever dtype the op computed it in.
  Tensor b = tensor({1.0f, 2.0f}).to(DType::f16).requires_grad_(true);
  sum(mul(b, tensor({0.1f, 0.2f}))).backward();
  CHECK(b.grad().dtype() == DType::f16);
  check_same_values(b.grad().to(DType::f32), tensor({0.1f, 0.2f}).to(DType::f16).to(DType::f32));

  // i64 never carries gradients, and mixing it with a float stays an error.
  CHECK(contains(error_message([] { from_vector(std::vector<int64_t>{1}).requires_grad_(true); }), "floating-point"));
  CHECK(contains(error_message([] { add(from_vector(std::vector<int64_t>{1}), tensor({1.0f})); }), "one dtype"));
  CHECK(contains(error_message([] { matmul(ones({2, 2}, DType::bf16), ones({2, 2})); }), "one dtype"));
}

TEST_CASE("mixed precision: autocast matches torch.autocast(cpu, bfloat16) on linear, conv and a loss") {
  const auto f = golden();
  auto leaf = [&](const std::string& name) { return f.at("ac_" + name).clone().requires_grad_(true); };
  Tensor w0 = leaf("0.weight"), b0 = leaf("0.bias"), w2 = leaf("2.weight"), b2 = leaf("2.bias");
  Tensor cw = leaf("conv.weight"), cb = leaf("conv.bias");
  Tensor h, c, z, loss;
  {
    autocast scope(kCPU, DType::bf16);
    CHECK(is_autocast_enabled(DeviceType::CPU));
    h = F::linear(relu(F::linear(f.at("ac_x"), w0, b0)), w2, b2);
    c = F::conv2d(f.at("ac_img"), cw, cb, {1, 1}, {1, 1});
    z = add(h, mean(c, {2, 3}));
    loss = F::cross_entropy(z, f.at("ac_y"));
  }
  CHECK_FALSE(is_autocast_enabled(DeviceType::CPU));
  CHECK(h.dtype() == DType::bf16);  // torch: bfloat16 (metadata h_dtype)
  CHECK(c.dtype() == DType::bf16);
  CHECK(z.dtype() == DType::bf16);
  CHECK(loss.dtype() == DType::f32);
  CHECK(f.metadata.at("h_dtype") == "torch.bfloat16");
  CHECK(f.metadata.at("loss_dtype") == "torch.float32");
  // PyTorch's linear adds the bias inside the GEMM (one rounding); ours rounds the product and the sum,
  // and the second layer multiplies what the first rounded: a few ulps of the largest output.
  check_bf16_close(h.to(DType::f32), f.at("ac_h"), 4, /*of_largest=*/true);
  check_bf16_close(c.to(DType::f32), f.at("ac_c"), 4, /*of_largest=*/true);
  check_close(loss, f.at("ac_loss").to_vector<float>(), 1e-2);
  loss.backward();
  for (auto [name, p] : {std::pair{"0.weight", w0}, {"0.bias", b0}, {"2.weight", w2}, {"2.bias", b2},
                         {"conv.weight", cw}, {"conv.bias", cb}}) {
    INFO(name);
    CHECK(p.grad().dtype() == DType::f32);
    const std::vector<float> got = p.grad().to_vector<float>(), want = f.at(std::string("ac_") + name + ".grad").to_vector<float>();
    double scale = 0;
    for (float v : want) scale = std::max(scale, static_cast<double>(std::abs(v)));
    for (size_t i = 0; i < got.size(); ++i) CHECK(std::abs(got[i] - want[i]) <= 0.03 * scale + 1e-5);
  }
}

TEST_CASE("mixed precision: autocast scopes nest, cache weight casts, and leave backward alone") {
  Tensor w = random_tensor({4, 3}, 3).requires_grad_(true);
  Tensor x = random_tensor({2, 3}, 4);
  {
    autocast outer(kCPU, DType::f16);
    CHECK(autocast_dtype(DeviceType::CPU) == DType::f16);
    Tensor y1 = F::linear(x, w);
    Tensor y2 = F::linear(x, w);
    CHECK(y1.dtype() == DType::f16);
    // One cast of the weight per scope: both products saw the same f16 copy.
    CHECK(amp::cast_lower(w).same(amp::cast_lower(w)));
    CHECK_FALSE(amp::cast_lower(x).same(amp::cast_lower(x)));  // not a leaf needing grad: cast at each use
    {
      autocast off(kCPU, DType::f16, /*enabled=*/false);
      CHECK(F::linear(x, w).dtype() == DType::f32);
    }
    CHECK(softmax(y1, 1).dtype() == DType::f32);  // an f32 op
    // backward inside the scope: the formulas keep the forward's dtypes, the leaf's gradient is f32.
    sum(add(y1, y2)).backward();
    CHECK(w.grad().dtype() == DType::f32);
    // An in-place change of the weight makes the next use cast it again.
    {
      autograd::NoGradGuard no_grad;
      w.copy_(mul(w, 2.0));
    }
    Tensor y3 = F::linear(x, w);
    check_close(y3.to(DType::f32), mul(y1.to(DType::f32), 2.0).to_vector<float>(), 2e-3);
  }
  CHECK(F::linear(x, w).dtype() == DType::f32);
  CHECK(contains(error_message([] { autocast bad(kCPU, DType::f32); }), "bf16 or f16"));
}

TEST_CASE("mixed precision: a mapped model under autocast generates f32 parameters and trains its latents") {
  auto target = std::make_shared<nn::Sequential>();
  target->push_back(std::make_shared<nn::Linear>(6, 5));
  target->push_back(std::make_shared<nn::ReLU>());
  target->push_back(std::make_shared<nn::Linear>(5, 3));
  mapping::MappingOptions options;
  options.strategy = "layerwise";
  options.latent_dim = 4;
  mapping::MappingModel model(target, options);
  const Tensor x = random_tensor({8, 6}, 5);
  const Tensor y = from_vector(std::vector<int64_t>{0, 1, 2, 0, 1, 2, 0, 1});
  Tensor loss;
  mapping::ForwardResult r;
  {
    autocast scope(kCPU, DType::bf16);
    r = model.run(x);
    loss = F::cross_entropy(r.predictions, y);
  }
  CHECK(r.predictions.dtype() == DType::bf16);
  for (const auto& [name, t] : r.generated_parameters.items()) {
    INFO(name);
    CHECK(t.dtype() == DType::f32);
  }
  loss.backward();
  for (const Tensor& z : model.parameters()) {
    REQUIRE(z.grad().defined());
    CHECK(z.grad().dtype() == DType::f32);
  }
  // The bf16 loss is the f32 one to bf16 accuracy.
  const Tensor exact = F::cross_entropy(model.run(x).predictions, y);
  CHECK(std::abs(loss.item() - exact.item()) <= 0.02 * std::abs(exact.item()) + 1e-3);
}

TEST_CASE("mixed precision: 16-bit tensors save in their own safetensors dtype") {
  mn::testing::TempDir dir;
  const Tensor v = tensor({1.0f / 3.0f, -2.5f, 65504.0f});
  safetensors::save(dir / "h.safetensors",
                    safetensors::NamedTensors{{"b", v.to(DType::bf16)}, {"h", v.to(DType::f16)}});
  const auto file = safetensors::load(dir / "h.safetensors");
  check_same_values(file.at("b"), v.to(DType::bf16).to(DType::f32));
  check_same_values(file.at("h"), v.to(DType::f16).to(DType::f32));
  const auto bytes = safetensors::serialize({{"b", v.to(DType::bf16)}});
  CHECK(contains(std::string(bytes.begin(), bytes.end()), "\"BF16\""));
}
