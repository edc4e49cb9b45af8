// Tensor core: factories, metadata, views sharing storage and the version counter, copies,
// conversion, printing and argument errors.
#include <cmath>
#include <limits>

#include "autograd/gradcheck.h"
#include "tests/test_support.h"

using namespace mn;
using mn::testing::check_close;
using mn::testing::tensor;

TEST_CASE("tensor: factories and metadata") {
  Tensor z = zeros({2, 3});
  CHECK(z.sizes() == Shape{2, 3});
  CHECK(z.strides() == Shape{3, 1});
  CHECK(z.numel() == 6);
  CHECK(z.dtype() == DType::f32);
  CHECK(z.device() == kCPU);
  CHECK(z.is_contiguous());
  CHECK(zeros({37, 0}).is_contiguous());  // nothing to be out of place; random fills accept it
  CHECK(randn({37, 0}).numel() == 0);
  check_close(z, {0, 0, 0, 0, 0, 0});
  check_close(ones({3}), {1, 1, 1});
  check_close(full({2}, 2.5), {2.5, 2.5});
  Tensor r = arange(5);
  CHECK(r.dtype() == DType::i64);
  CHECK(r.to_vector<int64_t>() == std::vector<int64_t>{0, 1, 2, 3, 4});
  check_close(arange(0.0, 1.0, 0.25, DType::f32), {0, 0.25, 0.5, 0.75});
  CHECK(scalar_tensor(3.0).dim() == 0);
  CHECK(scalar_tensor(3.0).item() == 3.0);
  CHECK(zeros({0, 4}).numel() == 0);
}

TEST_CASE("tensor: random factories are seeded and reproducible") {
  manual_seed(7);
  Tensor a = randn({100});
  manual_seed(7);
  Tensor b = randn({100});
  CHECK(a.to_vector<float>() == b.to_vector<float>());
  Tensor c = randn({100});
  CHECK(a.to_vector<float>() != c.to_vector<float>());
  Generator g(3);
  Tensor u = rand({1000}, {}, &g);
  double lo = 1, hi = 0;
  for (float v : u.to_vector<float>()) {
    lo = std::min<double>(lo, v);
    hi = std::max<double>(hi, v);
  }
  CHECK(lo >= 0.0);
  CHECK(hi < 1.0);
  Tensor bern = bernoulli({1000}, 0.25, {}, &g);
  for (float v : bern.to_vector<float>()) CHECK((v == 0.0f || v == 1.0f));
  for (float v : rademacher({64}, {}, &g).to_vector<float>()) CHECK((v == 1.0f || v == -1.0f));
}

TEST_CASE("tensor: views share storage and version") {
  Tensor x = arange(0.0, 6.0, 1.0, DType::f32).reshape({2, 3});
  Tensor t = x.t();
  CHECK(t.sizes() == Shape{3, 2});
  CHECK(t.strides() == Shape{1, 3});
  CHECK(!t.is_contiguous());
  CHECK(t.storage() == x.storage());
  check_close(t, {0, 3, 1, 4, 2, 5});
  Tensor row = x.select(0, 1);
  check_close(row, {3, 4, 5});
  const uint32_t v0 = x.version();
  row.fill_(9);
  CHECK(x.version() == v0 + 1);
  CHECK(t.version() == v0 + 1);
  check_close(x, {0, 1, 2, 9, 9, 9});
  Tensor n = x.narrow(1, 1, 2);
  CHECK(n.sizes() == Shape{2, 2});
  check_close(n, {1, 2, 9, 9});
  check_close(x.slice(1, 0, 3, 2), {0, 2, 9, 9});
  check_close(x.unsqueeze(0).squeeze(0), {0, 1, 2, 9, 9, 9});
  CHECK(x.unsqueeze(1).sizes() == Shape{2, 1, 3});
  check_close(x.flatten(), {0, 1, 2, 9, 9, 9});
  Tensor e = tensor({1, 2, 3}).expand({2, 3});
  CHECK(e.strides() == Shape{0, 1});
  check_close(e, {1, 2, 3, 1, 2, 3});
  check_close(x.permute({1, 0}).contiguous(), {0, 9, 1, 9, 2, 9});
  CHECK(x.reshape({3, -1}).sizes() == Shape{3, 2});
  // A transposed tensor cannot be viewed flat; reshape copies.
  CHECK_THROWS_AS(t.view({6}), ValueError);
  check_close(t.reshape({6}), {0, 9, 1, 9, 2, 9});
}

TEST_CASE("tensor: cat, stack, split, index_select") {
  Tensor a = tensor({1, 2, 3, 4}, {2, 2});
  Tensor b = tensor({5, 6}, {1, 2});
  check_close(cat({a, b}, 0), {1, 2, 3, 4, 5, 6});
  check_close(cat({a, a}, 1), {1, 2, 1, 2, 3, 4, 3, 4});
  Tensor s = stack({tensor({1, 2}), tensor({3, 4})}, 1);
  CHECK(s.sizes() == Shape{2, 2});
  check_close(s, {1, 3, 2, 4});
  auto parts = split(arange(0.0, 5.0, 1.0, DType::f32), 2);
  REQUIRE(parts.size() == 3);
  check_close(parts[2], {4});
  // split_with_sizes: views, one node, the pieces' gradients joined once (zeros where one got none).
  Tensor x = randn({7, 3}).requires_grad_(true);
  auto pieces = split_with_sizes(x, {2, 0, 5}, 0);
  REQUIRE(pieces.size() == 3);
  CHECK(pieces[2].sizes() == Shape{5, 3});
  CHECK(pieces[0].storage() == x.storage());
  CHECK(pieces[0].grad_fn() == pieces[2].grad_fn());
  sum(mul(pieces[2], 2.0)).backward();
  check_close(x.grad().narrow(0, 0, 2), std::vector<float>(6, 0.0f));
  check_close(x.grad().narrow(0, 2, 5), std::vector<float>(15, 2.0f));
  CHECK(autograd::gradcheck(
            [](const std::vector<Tensor>& v) {
              auto p = split_with_sizes(v[0], {1, 3}, 1);
              return add(sum(mul(p[0], p[0])), sum(mul(p[1], 3.0)));
            },
            {randn({2, 4}).requires_grad_(true)}) == "");
  CHECK_THROWS_WITH_AS(split_with_sizes(x, {2, 2}, 0), doctest::Contains("add up to 4"), ValueError);
  auto chunks = chunk(arange(0.0, 6.0, 1.0, DType::f32), 3);
  REQUIRE(chunks.size() == 3);
  check_close(chunks[1], {2, 3});
  Tensor idx = from_vector(std::vector<int64_t>{2, 0, 2});
  check_close(tensor({10, 20, 30}).index_select(0, idx), {30, 10, 30});
  CHECK_THROWS_WITH_AS(cat({a, tensor({1, 2, 3}, {1, 3})}, 0), doctest::Contains("[1, 3]"), ValueError);
  CHECK_THROWS_AS(tensor({1, 2}).index_select(0, from_vector(std::vector<int64_t>{5})), IndexError);
}

TEST_CASE("tensor: f32 -> i64 truncates toward zero, saturates at the i64 range, NaN -> 0") {
  const float inf = std::numeric_limits<float>::infinity();
  const Tensor odd = from_vector(std::vector<float>{-2.7f, 2.7f, std::nanf(""), inf, -inf, 1e19f, -1e19f});
  const std::vector<int64_t> want = {-2, 2, 0, INT64_MAX, INT64_MIN, INT64_MAX, INT64_MIN};
  CHECK(odd.to(DType::i64).to_vector<int64_t>() == want);
  CHECK(full({2}, 1e30, DType::i64).to_vector<int64_t>() == std::vector<int64_t>{INT64_MAX, INT64_MAX});
  // a one-sided clamp passes the missing bound as +-2^63, which must not wrap
  const Tensor i = from_vector(std::vector<int64_t>{-5, 0, 3, 100});
  CHECK(clamp(i, 0.0, std::nullopt).to_vector<int64_t>() == std::vector<int64_t>{0, 0, 3, 100});
  CHECK(clamp(i, std::nullopt, 3.0).to_vector<int64_t>() == std::vector<int64_t>{-5, 0, 3, 3});
}

TEST_CASE("tensor: copy_, fill_, dtype conversion, item, printing") {
  Tensor x = zeros({2, 2});
  x.copy_(tensor({1, 2}));  // broadcast source
  check_close(x, {1, 2, 1, 2});
  Tensor i = x.to(DType::i64);
  CHECK(i.dtype() == DType::i64);
  CHECK(i.to_vector<int64_t>() == std::vector<int64_t>{1, 2, 1, 2});
  CHECK(tensor({1.5f}).reshape({}).item() == 1.5);
  CHECK_THROWS_WITH_AS(x.item(), doctest::Contains("[2, 2]"), ValueError);
  const std::string text = tensor({1, 2.5f}).str();
  CHECK(text.find("2.5") != std::string::npos);
  CHECK(text.find("shape=[2]") != std::string::npos);
  CHECK(zeros({20, 20}).str().find("...") != std::string::npos);
}

TEST_CASE("tensor: bad input errors name shapes and dims") {
  Tensor a = zeros({2, 3});
  CHECK_THROWS_WITH_AS(add(a, zeros({4})), doctest::Contains("[2, 3]"), ValueError);
  CHECK_THROWS_WITH_AS(a.size(5), doctest::Contains("out of range"), IndexError);
  CHECK_THROWS_AS(a.transpose(0, 2), IndexError);
  CHECK_THROWS_WITH_AS(add(a, zeros({2, 3}, DType::i64)), doctest::Contains("i64"), TypeError);
  CHECK_THROWS_AS(a.reshape({4, 2}), ValueError);
  CHECK_THROWS_AS(a.narrow(1, 2, 2), IndexError);
  CHECK_THROWS_AS(a.data<int64_t>(), TypeError);
  CHECK_THROWS_AS(Tensor().numel(), ValueError);
  if (!cuda_available()) CHECK_THROWS_AS(zeros({2}).to(cuda_device(0)), DeviceError);  // a GPU host moves it
  CHECK_THROWS_AS(zeros({2}).to(cuda_device(63)), DeviceError);  // no such device anywhere
  CHECK_THROWS_AS(Device::parse("tpu"), ValueError);
  CHECK(Device::parse("cuda:1") == cuda_device(1));
  CHECK(Device::parse("auto") == (cuda_available() ? cuda_device(0) : kCPU));
  CHECK_THROWS_WITH_AS(Device::parse("cuda:x"), doctest::Contains("'cpu', 'cuda', 'cuda:N' or 'auto'"), ValueError);
  CHECK_THROWS_AS(empty({-1}), ValueError);
  CHECK_THROWS_AS(zeros({2}).requires_grad_(true).fill_(1.0), RuntimeError);
  CHECK_THROWS_AS(zeros({2}, DType::i64).requires_grad_(true), TypeError);
  Shape too_many;
  for (int i = 0; i < kMaxDims; ++i) too_many.push_back(1);
  CHECK_THROWS_AS(too_many.push_back(1), ValueError);
}

TEST_CASE("tensor: element and byte counts are checked, never wrapped") {
  // (2^62 + 1) * 4 wraps to 4 in int64: the tensor was 16 bytes and a later narrow().contiguous() crashed.
  const int64_t big = (int64_t{1} << 62) + 1;
  CHECK_THROWS_WITH_AS(zeros({big, 4}), doctest::Contains("[4611686018427387905, 4]"), ValueError);
  CHECK_THROWS_WITH_AS(Shape({big, 4}).numel(), doctest::Contains("int64"), ValueError);
  // 2^80 elements used to be numel 0 without error; a zero size does not hide the overflow.
  CHECK_THROWS_WITH_AS(empty({int64_t{1} << 40, int64_t{1} << 40}), doctest::Contains("[1099511627776, 1099511627776]"),
                       ValueError);
  CHECK_THROWS_AS(empty({0, int64_t{1} << 40, int64_t{1} << 40}), ValueError);
  CHECK(Shape({0, int64_t{1} << 40}).numel() == 0);
  // The element count fits but the bytes do not (2^62 f32 = 2^64 bytes wrapped to 0), or pass the cap.
  CHECK_THROWS_WITH_AS(empty({int64_t{1} << 62}), doctest::Contains("[4611686018427387904]"), ValueError);
  CHECK_THROWS_WITH_AS(empty({int64_t{1} << 47}), doctest::Contains("bytes any machine can address"), ValueError);
  CHECK(zeros({0, 5}).numel() == 0);
}

TEST_CASE("tensor: make_view stays inside its storage") {
  Tensor base = zeros({2, 3});  // 24 bytes
  const auto& st = base.storage();
  CHECK(make_view(st, {3}, {2}, 1, DType::f32).sizes() == Shape{3});  // elements 1, 3, 5
  CHECK(make_view(st, {0}, {1}, 100, DType::f32).numel() == 0);       // no element, nothing reached
  CHECK_THROWS_WITH_AS(make_view(st, {3}, {2}, 2, DType::f32), doctest::Contains("reaches element 6"), IndexError);
  CHECK_THROWS_AS(make_view(st, {7}, {1}, 0, DType::f32), IndexError);
  CHECK_THROWS_AS(make_view(st, {6}, {1}, 0, DType::i64), IndexError);  // 48 bytes as i64
  CHECK_THROWS_AS(make_view(st, {2}, {-1}, 1, DType::f32), ValueError);
  CHECK_THROWS_AS(make_view(st, {2}, {1}, -1, DType::f32), ValueError);
  CHECK_THROWS_AS(make_view(st, {-2}, {1}, 0, DType::f32), ValueError);
  CHECK_THROWS_AS(make_view(st, {2}, {int64_t{1} << 62}, int64_t{1} << 62, DType::f32), ValueError);  // wraps
  CHECK_THROWS_AS(make_view(st, {2}, {INT64_MAX}, 0, DType::f32), IndexError);  // element INT64_MAX
  CHECK_THROWS_AS(make_view(st, {2, 3}, {3}, 0, DType::f32), ValueError);
}

TEST_CASE("tensor: copy_ refuses overlapping source and destination") {
  Tensor x = tensor({1, 2, 3, 4, 5});
  CHECK_THROWS_WITH_AS(x.narrow(0, 1, 3).copy_(x.narrow(0, 0, 3)),
                       doctest::Contains("refer to a single memory location"), RuntimeError);
  CHECK_THROWS_AS(x.narrow(0, 0, 3).copy_(x.narrow(0, 2, 3)), RuntimeError);
  CHECK_THROWS_AS(x.copy_(x.detach().narrow(0, 4, 1)), RuntimeError);  // a broadcast source inside it
  check_close(x, {1, 2, 3, 4, 5});
  // Disjoint parts of one storage, and the very same view, are fine.
  x.narrow(0, 0, 2).copy_(x.narrow(0, 3, 2));
  check_close(x, {4, 5, 3, 4, 5});
  x.copy_(x.detach());
  check_close(x, {4, 5, 3, 4, 5});
  // A destination whose elements alias each other (an expanded view).
  Tensor e = tensor({1}).expand({3});
  CHECK_THROWS_WITH_AS(e.copy_(tensor({1, 2, 3})), doctest::Contains("more than one element"), RuntimeError);
}

TEST_CASE("tensor: copy_ from a tensor that requires grad is recorded") {
  Tensor src = tensor({1, 2, 3}).requires_grad_(true);
  Tensor dst = zeros({2, 3});
  dst.copy_(src);  // broadcast: the gradient sums over the copies
  REQUIRE(dst.requires_grad());
  CHECK(dst.grad_fn()->name() == "CopyBackward");
  sum(mul(dst, tensor({1, 2, 3, 4, 5, 6}, {2, 3}))).backward();
  check_close(src.grad(), {5, 7, 9});
  CHECK(autograd::gradcheck(
            [](const std::vector<Tensor>& in) {
              Tensor out = zeros({2, 3});
              out.copy_(in[0]);
              return mul(out, out);
            },
            {tensor({0.5f, -1.5f, 2.0f}).requires_grad_(true)}) == "");
  // A non-leaf destination: its old value is overwritten, so its history gets zero.
  Tensor a = tensor({1, 2}).requires_grad_(true);
  Tensor b = tensor({3, 4}).requires_grad_(true);
  Tensor y = mul(a, 2.0);
  const uint32_t before = y.version();
  y.copy_(b);
  CHECK(y.version() > before);
  sum(mul(y, y)).backward();
  check_close(b.grad(), {6, 8});
  check_close(a.grad(), {0, 0});
  // In-place rules: a leaf that requires grad, or memory other tensors share, is refused.
  Tensor leaf = zeros({3}).requires_grad_(true);
  CHECK_THROWS_WITH_AS(leaf.copy_(src), doctest::Contains("leaf"), RuntimeError);
  Tensor buffer = zeros({2, 3});
  CHECK_THROWS_WITH_AS(buffer.select(0, 1).copy_(src), doctest::Contains("share"), RuntimeError);
  {
    autograd::NoGradGuard no_grad;
    leaf.copy_(src);  // initialisation
    buffer.select(0, 1).copy_(src);
  }
  check_close(buffer, {0, 0, 0, 1, 2, 3});
  CHECK_FALSE(buffer.requires_grad());
}
