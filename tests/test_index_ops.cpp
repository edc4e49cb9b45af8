// gather, scatter_add, masked_fill, full-tensor argmax/argmin, amax/amin, cumsum, topk, adaptive
// pooling and embedding: values against hand-computed results, gradchecks of every differentiable op
// (gradgradchecks where the backward is itself differentiable), refusals with their messages, and
// PyTorch 1.13 parity (tests/data/parity_index_ops.safetensors, tests/parity/make_parity.py).
#include <limits>

#include "nn/layers.h"
#include "nn/safetensors.h"
#include "tests/test_support.h"

using namespace mn;
using autograd::gradcheck;
using autograd::gradgradcheck;
using mn::testing::check_close;
using mn::testing::contains;
using mn::testing::error_message;
using mn::testing::random_param;
using mn::testing::tensor;
namespace F = mn::nn::functional;

namespace {
// An i64 tensor of the given shape (1-D when none is given).
Tensor longs(const std::vector<int64_t>& v, const Shape& shape = {}) {
  return shape.size() == 0 ? from_vector(v) : from_vector(v, shape);
}
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
}  // namespace

TEST_CASE("index ops: gather with a smaller index, along each dim, and its gradient") {
  Tensor x = tensor({1, 2, 3, 4, 5, 6}, {2, 3});
  check_close(gather(x, 1, longs({2, 0, 1, 1}, {2, 2})), {3, 1, 5, 5});
  check_close(gather(x, 0, longs({1, 0, 1}, {1, 3})), {4, 2, 6});
  check_close(gather(x, -1, longs({0}, {1, 1})), {1});
  check_close(gather(x.t(), 0, longs({2, 1}, {2, 1})), {3, 2});  // strided input [3, 2]
  CHECK(gather(x, 1, longs({}, {2, 0})).sizes() == Shape{2, 0});
  Tensor xp = random_param({3, 4}, 1);
  Tensor idx = longs({3, 3, 0, 1, 2, 2, 0, 0, 1}, {3, 3});
  CHECK(gradcheck([&](const std::vector<Tensor>& in) { return gather(in[0], 1, idx); }, {xp}) == "");
  CHECK(gradgradcheck([&](const std::vector<Tensor>& in) { return gather(in[0], 1, idx); }, {xp}) == "");
  CHECK(gradcheck([&](const std::vector<Tensor>& in) { return gather(in[0], 0, longs({2, 0, 2}, {3, 1})); }, {xp}) ==
        "");
}

TEST_CASE("index ops: scatter_add accumulates repeats; gradients to x and src") {
  Tensor x = zeros({2, 3});
  Tensor out = scatter_add(x, 1, longs({0, 0, 2, 1}, {2, 2}), tensor({1, 2, 3, 4}, {2, 2}));
  check_close(out, {3, 0, 0, 0, 4, 3});
  check_close(x, {0, 0, 0, 0, 0, 0});  // out of place
  // src larger than index: only the index's extent is added
  check_close(scatter_add(zeros({3}), 0, longs({2, 2}), tensor({1, 10, 100})), {0, 0, 11});
  // i64 data
  CHECK(scatter_add(zeros({3}, DType::i64), 0, longs({1, 1, 0}), longs({5, 6, 7})).to_vector<int64_t>() ==
        std::vector<int64_t>{7, 11, 0});
  Tensor xp = random_param({3, 4}, 2), src = random_param({4, 5}, 3);
  Tensor idx = longs({0, 2, 2, 1, 1, 1, 0, 0, 2, 0, 1, 2}, {4, 3});
  auto g = [&](const std::vector<Tensor>& in) { return scatter_add(in[0], 1, longs({3, 0, 3, 1, 1, 2}, {3, 2}), in[1]); };
  // a strided index narrower than src: src's extra column gets a zero gradient
  CHECK(gradcheck([&](const std::vector<Tensor>& in) { return scatter_add(in[0], 0, idx.narrow(1, 0, 3), in[1]); },
                  {xp, src.narrow(1, 0, 4).detach().requires_grad_(true)}) == "");
  CHECK(gradcheck(g, {xp, src}) == "");
  CHECK(gradgradcheck(g, {xp, src}) == "");
}

TEST_CASE("index ops: gather and scatter_add refuse bad indices and shapes") {
  Tensor x = zeros({2, 3});
  std::string msg = error_message([&] { gather(x, 1, longs({0, 7}, {1, 2})); });
  CHECK(contains(msg, "index 7 is out of range for dimension 1 of size 3"));
  CHECK_THROWS_AS(gather(x, 1, longs({0, -1}, {1, 2})), IndexError);
  check_close(gather(tensor({1, 2, 3, 4, 5, 6}, {2, 3}), 0, longs({0, 1, 0}, {3, 1})), {1, 4, 1});  // longer along dim
  msg = error_message([&] { gather(x, 1, longs({0, 1, 0, 1}, {4, 1})); });
  CHECK(contains(msg, "larger than input"));
  CHECK_THROWS_AS(gather(x, 1, longs({0, 1})), ValueError);           // rank mismatch
  CHECK_THROWS_AS(gather(x, 1, tensor({0, 1}, {1, 2})), TypeError);  // f32 index
  CHECK_THROWS_AS(gather(x, 2, longs({0}, {1, 1})), IndexError);      // dim
  msg = error_message([&] { scatter_add(x, 0, longs({2}, {1, 1}), ones({1, 1})); });
  CHECK(contains(msg, "index 2 is out of range for dimension 0 of size 2"));
  CHECK_THROWS_AS(scatter_add(x, 0, longs({0, 1}, {2, 1}), ones({1, 1})), ValueError);  // src too small
  CHECK_THROWS_AS(scatter_add(x, 0, longs({0}, {1, 1}), ones({1, 1}, DType::i64)), TypeError);
}

TEST_CASE("index ops: masked_fill with f32 and i64 masks, broadcasting, NaN and gradient") {
  Tensor x = tensor({1, 2, 3, 4, 5, 6}, {2, 3});
  check_close(masked_fill(x, gt(x, 3.5), -1.0), {1, 2, 3, -1, -1, -1});
  check_close(masked_fill(x, longs({1, 0, 1}), 0.5), {0.5, 2, 0.5, 0.5, 5, 0.5});  // broadcast [3]
  check_close(masked_fill(x, tensor({0, 1}, {2, 1}), kNaN), {1, 2, 3, kNaN, kNaN, kNaN});
  check_close(masked_fill(tensor({kNaN, 1}), tensor({0, 1}), 2.0), {kNaN, 2});
  Tensor xp = random_param({2, 3}, 4);
  Tensor mask = tensor({1, 0, 0, 0, 1, 1}, {2, 3});
  CHECK(gradcheck([&](const std::vector<Tensor>& in) { return masked_fill(in[0], mask, 3.0); }, {xp}) == "");
  Tensor y = masked_fill(xp, mask, 3.0);
  sum(y).backward();
  check_close(xp.grad(), {0, 1, 1, 1, 0, 0});
  CHECK_THROWS_AS(masked_fill(x, ones({4}), 0.0), ValueError);
}

TEST_CASE("index ops: full-tensor argmax and argmin: flat index, first occurrence, NaN") {
  Tensor x = tensor({1, 5, 5, -2, 0, -2}, {2, 3});
  Tensor a = argmax(x);
  CHECK(a.dim() == 0);
  CHECK(a.dtype() == DType::i64);
  CHECK(a.to_vector<int64_t>()[0] == 1);
  CHECK(argmin(x).to_vector<int64_t>()[0] == 3);
  CHECK(argmax(x.t()).to_vector<int64_t>()[0] == 2);  // flat index of the transposed view [3, 2]
  Tensor n = tensor({1, kNaN, 3, kNaN});
  CHECK(argmax(n).to_vector<int64_t>()[0] == 1);
  CHECK(argmin(n).to_vector<int64_t>()[0] == 1);
  CHECK(argmax(tensor({7}, {})).to_vector<int64_t>()[0] == 0);
  CHECK(contains(error_message([] { argmax(zeros({0, 3})); }), "empty"));
}

TEST_CASE("index ops: amax and amin over several dims, ties share the gradient, NaN") {
  Tensor x = tensor({1, 4, 4, 2, 0, 4, 3, 1}, {2, 2, 2});
  check_close(amax(x, {0, 2}), {4, 4});
  check_close(amin(x, {1, 2}), {1, 0});
  check_close(amax(x), {4});
  CHECK(amax(x, {0, 2}, true).sizes() == Shape{1, 2, 1});
  CHECK(amax(x, -1).sizes() == Shape{2, 2});
  Tensor xp = x.clone().requires_grad_(true);
  sum(amax(xp, {0, 2})).backward();
  // slice 0 (dim 1 = 0): values 1,4,0,4 -> two ties share 0.5; slice 1: 4,2,3,1 -> 4 alone
  check_close(xp.grad(), {0, 0.5, 1, 0, 0, 0.5, 0, 0});
  Tensor r = random_param({3, 4, 2}, 5);
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return amax(in[0], {0, 2}); }, {r}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return amin(in[0], {1}, true); }, {r}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return amin(in[0]); }, {r}) == "");
  // NaN wins the value; its slice gets NaN gradients (as PyTorch)
  Tensor np = tensor({1, kNaN, 2, 3}, {2, 2}).requires_grad_(true);
  Tensor m = amax(np, {1});
  check_close(m, {kNaN, 3});
  sum(m).backward();
  check_close(np.grad(), {kNaN, kNaN, 0, 1});
  CHECK(contains(error_message([] { amax(zeros({2, 0}), {1}); }), "dimension 1 of size 0"));
}

TEST_CASE("index ops: cumsum forward on each dim, i64, and gradients") {
  Tensor x = tensor({1, 2, 3, 4, 5, 6}, {2, 3});
  check_close(cumsum(x, 1), {1, 3, 6, 4, 9, 15});
  check_close(cumsum(x, 0), {1, 2, 3, 5, 7, 9});
  check_close(cumsum(x.t(), -1), {1, 5, 2, 7, 3, 9});
  CHECK(cumsum(longs({3, -1, 4}), 0).to_vector<int64_t>() == std::vector<int64_t>{3, 2, 6});
  check_close(cumsum(tensor({1, kNaN, 2}), 0), {1, kNaN, kNaN});
  Tensor xp = x.clone().requires_grad_(true);
  sum(cumsum(xp, 1)).backward();
  check_close(xp.grad(), {3, 2, 1, 3, 2, 1});
  Tensor r = random_param({3, 4, 2}, 6);
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return cumsum(in[0], 1); }, {r}) == "");
  CHECK(gradgradcheck([](const std::vector<Tensor>& in) { return cumsum(mul(in[0], in[0]), 0); }, {r}) == "");
  CHECK_THROWS_AS(cumsum(x, 2), IndexError);
}

TEST_CASE("index ops: topk largest and smallest, ties, NaN, dims, gradient") {
  Tensor x = tensor({3, 1, 4, 1, 5, 9, 2, 6}, {2, 4});
  auto [v, i] = topk(x, 2);
  check_close(v, {4, 3, 9, 6});
  CHECK(i.to_vector<int64_t>() == std::vector<int64_t>{2, 0, 1, 3});
  auto [vs, is] = topk(x, 3, 1, false);
  check_close(vs, {1, 1, 3, 2, 5, 6});
  CHECK(is.to_vector<int64_t>() == std::vector<int64_t>{1, 3, 0, 2, 0, 3});  // tie 1,1: lower position first
  auto [v0, i0] = topk(x, 1, 0);
  check_close(v0, {5, 9, 4, 6});
  CHECK(i0.to_vector<int64_t>() == std::vector<int64_t>{1, 1, 0, 1});
  auto [vn, in_] = topk(tensor({1, kNaN, 3, kNaN}), 3);
  check_close(vn, {kNaN, kNaN, 3});
  CHECK(in_.to_vector<int64_t>() == std::vector<int64_t>{1, 3, 2});
  auto [vm, im] = topk(tensor({1, kNaN, 3, kNaN}), 2, -1, false);
  CHECK(im.to_vector<int64_t>() == std::vector<int64_t>{0, 2});
  CHECK(topk(x, 0).first.sizes() == Shape{2, 0});
  CHECK(contains(error_message([&] { topk(x, 5); }), "k = 5 is out of range for dimension -1 of size 4"));
  Tensor r = random_param({3, 5}, 7);
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return topk(in[0], 3).first; }, {r}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return topk(in[0], 2, 0, false).first; }, {r}) == "");
}

TEST_CASE("index ops: adaptive average and max pooling: windows, sizes, layouts, gradients") {
  // H = 5 -> 3 rows: windows [0,2), [1,4), [3,5)
  Tensor x = arange(0.0, 10.0, 1.0, DType::f32).reshape({1, 1, 5, 2});
  check_close(F::adaptive_avg_pool2d(x, {3, 1}), {1.5, 4.5, 7.5});
  check_close(F::adaptive_max_pool2d(x, {3, 1}), {3, 7, 9});
  auto [mv, mi] = F::adaptive_max_pool2d_with_indices(x, {3, 2});
  check_close(mv, {2, 3, 6, 7, 8, 9});
  CHECK(mi.to_vector<int64_t>() == std::vector<int64_t>{2, 3, 6, 7, 8, 9});
  check_close(F::adaptive_avg_pool2d(x, 1), {4.5});
  CHECK(F::adaptive_avg_pool2d(random_param({3, 4, 4}, 1).detach(), {2, 2}).sizes() == Shape{3, 2, 2});  // CHW
  CHECK(F::adaptive_avg_pool2d(x, {7, 3}).sizes() == Shape{1, 1, 7, 3});  // larger than the input
  check_close(F::adaptive_max_pool2d(tensor({1, kNaN, 3, 2}, {1, 1, 2, 2}), 1), {kNaN});
  // equals avg_pool2d when the sizes divide
  Tensor r = random_param({2, 3, 6, 4}, 8);
  check_close(F::adaptive_avg_pool2d(r.detach(), {3, 2}), F::avg_pool2d(r.detach(), {2, 2}).to_vector<float>());
  check_close(F::adaptive_max_pool2d(r.detach(), {3, 2}), F::max_pool2d(r.detach(), {2, 2}).to_vector<float>());
  Tensor p = random_param({2, 2, 5, 7}, 9);
  for (std::array<int64_t, 2> size : {std::array<int64_t, 2>{3, 3}, {1, 1}, {2, 5}, {6, 8}}) {
    INFO("output " << size[0] << "x" << size[1]);
    CHECK(gradcheck([&](const std::vector<Tensor>& in) { return F::adaptive_avg_pool2d(in[0], size); }, {p}) == "");
    CHECK(gradcheck([&](const std::vector<Tensor>& in) { return F::adaptive_max_pool2d(in[0], size); }, {p}) == "");
  }
  CHECK(gradgradcheck([](const std::vector<Tensor>& in) { return F::adaptive_avg_pool2d(in[0], {2, 3}); },
                      {random_param({1, 2, 5, 4}, 10)}) == "");
  Tensor pt = random_param({2, 7, 5}, 11);  // CHW through a transposed view
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return F::adaptive_max_pool2d(in[0].transpose(1, 2), 3); },
                  {pt}) == "");
  CHECK_THROWS_AS(F::adaptive_avg_pool2d(zeros({2, 3}), 1), ValueError);
  CHECK_THROWS_AS(F::adaptive_avg_pool2d(zeros({1, 1, 0, 3}), 1), ValueError);
  CHECK(F::adaptive_avg_pool2d(zeros({1, 2, 3, 3}), {0, 2}).sizes() == Shape{1, 2, 0, 2});
  nn::AdaptiveAvgPool2d gap(1);
  CHECK(gap.forward(r).sizes() == Shape{2, 3, 1, 1});
  nn::AdaptiveMaxPool2d amp({2, 1});
  CHECK(amp.forward(r).sizes() == Shape{2, 3, 2, 1});
}

TEST_CASE("index ops: embedding lookup, padding_idx, repeated indices, errors, layer") {
  Tensor w = tensor({0, 1, 10, 11, 20, 21}, {3, 2});
  Tensor out = F::embedding(longs({2, 0, 2, 1}, {2, 2}), w);
  CHECK(out.sizes() == Shape{2, 2, 2});
  check_close(out, {20, 21, 0, 1, 20, 21, 10, 11});
  Tensor wp = w.clone().requires_grad_(true);
  sum(mul(F::embedding(longs({2, 0, 2, 1}), wp, 1), tensor({1, 2, 3, 4, 5, 6, 7, 8}, {4, 2}))).backward();
  check_close(wp.grad(), {3, 4, 0, 0, 6, 8});  // row 2 twice (1+5, 2+6), padding row 1 none
  sum(F::embedding(longs({0, 2}), wp, -1)).backward();  // -1 = the last row (as PyTorch)
  check_close(wp.grad(), {4, 5, 0, 0, 6, 8});
  std::string msg = error_message([&] { F::embedding(longs({0, 3}), w); });
  CHECK(contains(msg, "index 3 is out of range for an embedding of 3 rows"));
  CHECK(contains(error_message([&] { F::embedding(longs({-1}), w); }), "index -1"));
  CHECK_THROWS_AS(F::embedding(longs({0}), w, 3), ValueError);
  CHECK_THROWS_AS(F::embedding(tensor({0}), w), TypeError);
  Tensor r = random_param({5, 3}, 12);
  // (the padding row's gradient is 0 by definition, so the checked lookups avoid it)
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return F::embedding(longs({4, 1, 4, 0, 4}), in[0], 2); },
                  {r}) == "");
  nn::Embedding emb(6, 4, 2);
  Tensor ew = emb.param("weight");
  CHECK(ew.sizes() == Shape{6, 4});
  check_close(ew.narrow(0, 2, 1), {0, 0, 0, 0});
  CHECK(std::abs(ew.narrow(0, 0, 1).to_vector<float>()[0]) > 0.0f);
  CHECK(emb.forward(longs({2, 5})).sizes() == Shape{2, 4});
  CHECK(emb.named_parameters().size() == 1);
}

TEST_CASE("index ops: parity with PyTorch 1.13") {
  auto f = safetensors::load(std::string(MN_TEST_DATA_DIR) + "/parity_index_ops.safetensors");
  auto leaf = [&](const std::string& name) { return f.at(name).clone().requires_grad_(true); };
  auto backward = [&](const Tensor& y, const std::string& tag) { sum(mul(y, f.at(tag + "_w"))).backward(); };
  auto near = [](const Tensor& got, const Tensor& want, double tol) { check_close(got, want.to_vector<float>(), tol); };
  {
    Tensor x = leaf("pool_x");
    Tensor a = F::adaptive_avg_pool2d(x, {3, 4});
    near(a, f.at("avg_y"), 1e-6);
    backward(a, "avg");
    near(x.grad(), f.at("avg_gx"), 1e-6);
    Tensor x2 = leaf("pool_x");
    auto [m, mi] = F::adaptive_max_pool2d_with_indices(x2, {3, 4});
    near(m, f.at("max_y"), 0);
    CHECK(mi.to_vector<int64_t>() == f.at("max_i").to_vector<int64_t>());
    backward(m, "max");
    near(x2.grad(), f.at("max_gx"), 1e-6);
  }
  {
    Tensor x = leaf("g_x"), src = leaf("s_src");
    Tensor g = gather(x, 1, f.at("g_index"));
    near(g, f.at("g_y"), 0);
    backward(g, "g");
    near(x.grad(), f.at("g_gx"), 1e-6);
    Tensor x2 = leaf("g_x");
    Tensor s = scatter_add(x2, 0, f.at("s_index"), src);
    near(s, f.at("s_y"), 1e-6);
    backward(s, "s");
    near(x2.grad(), f.at("s_gx"), 1e-6);
    near(src.grad(), f.at("s_gsrc"), 1e-6);
  }
  {
    Tensor x = leaf("r_x");
    Tensor c = cumsum(x, 1);
    near(c, f.at("cumsum_y"), 1e-6);
    backward(c, "cumsum");
    near(x.grad(), f.at("cumsum_gx"), 1e-5);
    Tensor x2 = leaf("r_x");
    Tensor m = amax(x2, {0, 2});
    near(m, f.at("amax_y"), 0);
    backward(m, "amax");
    near(x2.grad(), f.at("amax_gx"), 1e-6);
    Tensor x3 = leaf("r_x");
    auto [tv, ti] = topk(x3, 3, 1, true);
    near(tv, f.at("topk_y"), 0);
    CHECK(ti.to_vector<int64_t>() == f.at("topk_i").to_vector<int64_t>());
    backward(tv, "topk");
    near(x3.grad(), f.at("topk_gx"), 1e-6);
    CHECK(argmax(x3).to_vector<int64_t>()[0] == f.at("argmax").to_vector<int64_t>()[0]);
    CHECK(argmin(x3).to_vector<int64_t>()[0] == f.at("argmin").to_vector<int64_t>()[0]);
  }
  {
    Tensor w = leaf("e_weight");
    Tensor e = F::embedding(f.at("e_index"), w, 1);
    near(e, f.at("e_y"), 0);
    backward(e, "e");
    near(w.grad(), f.at("e_gw"), 1e-6);
    Tensor x = leaf("mf_x");
    Tensor mf = masked_fill(x, f.at("mf_mask"), -2.5);
    near(mf, f.at("mf_y"), 0);
    backward(mf, "mf");
    near(x.grad(), f.at("mf_gx"), 0);
  }
}
