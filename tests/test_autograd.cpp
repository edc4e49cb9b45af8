// The autograd engine: accumulation into leaves, retain_graph, NoGradGuard, hooks and
// end-of-backward callbacks, version-counter errors, grad(), deep graphs and checkpoint (recomputation).
#include "autograd/checkpoint.h"
#include "autograd/function.h"
#include "nn/functional.h"
#include "nn/layers.h"
#include "tests/test_support.h"

using namespace mn;
using mn::testing::check_close;
using mn::testing::param;
using mn::testing::tensor;

TEST_CASE("autograd: gradients accumulate into leaves across backward calls") {
  Tensor x = param({1, 2, 3});
  Tensor y = sum(mul(x, x));
  y.backward();
  check_close(x.grad(), {2, 4, 6});
  sum(mul(x, 3.0)).backward();
  check_close(x.grad(), {5, 7, 9});
  CHECK(x.is_leaf());
  CHECK(!y.is_leaf());
  CHECK(y.grad_fn() != nullptr);
  // a gradient set by hand is later accumulated into in place: it must match shape, device and dtype
  CHECK_THROWS_WITH_AS(x.set_grad(zeros({3}, DType::i64)), doctest::Contains("dtype f32"), ValueError);
  CHECK_THROWS_AS(x.set_grad(zeros({2})), ValueError);
}

TEST_CASE("autograd: a tensor used twice sums both paths") {
  Tensor x = param({2});
  Tensor y = add(mul(x, x), mul(x, 5.0));  // 2x + 5
  y.backward();
  check_close(x.grad(), {9});
}

TEST_CASE("autograd: retain_graph allows a second backward; without it the second fails") {
  Tensor x = param({1, 2});
  Tensor y = sum(exp(x));
  y.backward({}, /*retain_graph=*/true);
  y.backward();
  check_close(x.grad(), {2 * 2.7182818f, 2 * 7.3890561f});
  CHECK_THROWS_WITH_AS(y.backward(), doctest::Contains("second time"), RuntimeError);
}

TEST_CASE("autograd: NoGradGuard records nothing") {
  Tensor x = param({1, 2});
  {
    autograd::NoGradGuard guard;
    Tensor y = mul(x, 2.0);
    CHECK(!y.requires_grad());
    CHECK(y.grad_fn() == nullptr);
  }
  CHECK(mul(x, 2.0).requires_grad());
  CHECK_THROWS_WITH_AS(sum(tensor({1, 2})).backward(), doctest::Contains("does not require grad"), RuntimeError);
}

TEST_CASE("autograd: in-place change of a saved tensor is detected with versions") {
  Tensor x = param({1, 2});
  Tensor w = tensor({3, 4});
  Tensor y = sum(mul(x, w));
  w.fill_(0.0);
  CHECK_THROWS_WITH_AS(y.backward(), doctest::Contains("version 1; expected version 0"), RuntimeError);
}

namespace {
// A custom op y = 2 x whose backward formula returns `bad(grad)` instead of 2 * grad.
template <class F>
Tensor doubled_with_backward(const Tensor& x, F bad) {
  Tensor out = mul(x.detach(), 2.0);
  autograd::record("BrokenBackward", {&x}, {&out}, [bad](const autograd::GradContext& c) -> autograd::TensorList {
    return {bad(c.grad())};
  });
  return out;
}
}  // namespace

TEST_CASE("autograd: the engine checks every gradient a node returns against its input") {
  // Wrong shape: [1, 3] used to be broadcast by the next add into the [2, 3] gradient of x.
  Tensor x = param({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor y = add(doubled_with_backward(x, [](const Tensor& g) { return sum(g, 0, true); }), x);
  CHECK_THROWS_WITH_AS(sum(y).backward(), doctest::Contains("BrokenBackward returned a gradient of shape [1, 3]"),
                       RuntimeError);
  Tensor y2 = mul(doubled_with_backward(x, [](const Tensor& g) { return sum(g, 0, true); }), 3.0);
  CHECK_THROWS_WITH_AS(sum(y2).backward(), doctest::Contains("which has shape [2, 3]"), RuntimeError);
  // Wrong dtype.
  Tensor y3 = doubled_with_backward(x, [](const Tensor& g) { return g.to(DType::i64); });
  CHECK_THROWS_WITH_AS(sum(y3).backward(), doctest::Contains("i64"), RuntimeError);
  // The same node with a right formula passes, and x's gradient is untouched by the failures above.
  CHECK_FALSE(x.grad().defined());
  Tensor ok = doubled_with_backward(x, [](const Tensor& g) { return mul(g, 2.0); });
  sum(ok).backward();
  check_close(x.grad(), {2, 2, 2, 2, 2, 2});
  // An explicit output gradient of the wrong dtype.
  Tensor z = mul(x, 1.0);
  CHECK_THROWS_WITH_AS(z.backward(zeros({2, 3}, DType::i64)), doctest::Contains("i64"), ValueError);
}

TEST_CASE("autograd: post-accumulate hooks and end-of-backward callbacks") {
  Tensor a = param({1, 2});
  Tensor b = param({3});
  std::vector<std::string> order;
  a.register_post_accumulate_grad_hook([&](const Tensor& t) {
    order.push_back("a");
    CHECK(t.grad().defined());
    autograd::queue_callback([&] { order.push_back("end"); });
  });
  b.register_post_accumulate_grad_hook([&](const Tensor&) { order.push_back("b"); });
  Tensor y = add(sum(mul(a, 2.0)), sum(b));
  CHECK(!autograd::backward_in_progress());
  y.backward();
  REQUIRE(order.size() == 3);
  CHECK(order.back() == "end");
  CHECK_THROWS_AS(autograd::queue_callback([] {}), RuntimeError);
  // Two forwards before one backward: each leaf's hook fires once.
  int fired = 0;
  Tensor c = param({1});
  c.register_post_accumulate_grad_hook([&](const Tensor&) { ++fired; });
  add(mul(c, 2.0), mul(c, 3.0)).backward();
  CHECK(fired == 1);
  check_close(c.grad(), {5});
}

TEST_CASE("autograd: grad() returns gradients without touching .grad") {
  Tensor x = param({1, 2});
  Tensor w = param({3, 4});
  Tensor y = sum(mul(x, w));
  auto g = autograd::grad({y}, {x});
  check_close(g[0], {3, 4});
  CHECK(!x.grad().defined());
  CHECK(!w.grad().defined());
  Tensor z = sum(mul(x, 2.0));
  Tensor unused = param({1});
  CHECK_THROWS_AS(autograd::grad({z}, {unused}), RuntimeError);
  CHECK(!autograd::grad({sum(mul(x, 2.0))}, {unused}, {}, false, false, true)[0].defined());
  // Gradient with respect to an intermediate tensor
  Tensor h = mul(x, 3.0);
  Tensor out = sum(mul(h, h));
  check_close(autograd::grad({out}, {h})[0], {6, 12});
}

TEST_CASE("autograd: retain_grad on intermediates and explicit output gradients") {
  Tensor x = param({1, 2});
  Tensor h = mul(x, 2.0);
  h.retain_grad();
  Tensor y = mul(h, h);
  y.backward(tensor({1, 1}));
  check_close(h.grad(), {4, 8});
  check_close(x.grad(), {8, 16});
  CHECK_THROWS_WITH_AS(mul(x, 2.0).backward(), doctest::Contains("[2]"), RuntimeError);
  CHECK_THROWS_WITH_AS(mul(x, 2.0).backward(tensor({1, 1, 1})), doctest::Contains("[3]"), ValueError);
}

TEST_CASE("autograd: deep chains do not overflow the stack") {
  Tensor x = param({1});
  Tensor y = x;
  for (int i = 0; i < 20000; ++i) y = add(y, 0.0);
  y.backward();
  check_close(x.grad(), {1});
}

TEST_CASE("autograd: detach cuts history but shares storage") {
  Tensor x = param({1, 2});
  Tensor d = mul(x, 2.0).detach();
  CHECK(!d.requires_grad());
  CHECK(d.grad_fn() == nullptr);
  Tensor x2 = x.detach();
  CHECK(x2.storage() == x.storage());
}

TEST_CASE("autograd: checkpoint recomputes in backward with the same gradients, dropout replayed") {
  namespace F = mn::nn::functional;
  Generator g(77);
  const Tensor x0 = randn({4, 6}, {}, &g), w0 = randn({6, 5}, {}, &g);
  // A function that makes a temporary the plain graph would keep (dropout's mask, the product).
  auto f = [](const autograd::TensorList& in) {
    return autograd::TensorList{tanh(F::dropout(matmul(in[0], in[1]), 0.3)), sum(in[1])};
  };
  auto grads = [&](bool checkpointed) {
    Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    manual_seed(5);
    const autograd::TensorList out = checkpointed ? autograd::checkpoint(f, {x, w}) : f({x, w});
    const double after_forward = static_cast<double>(default_generator().offset());
    add(sum(square(out[0])), mul(out[1], 0.5)).backward();
    CHECK(static_cast<double>(default_generator().offset()) == after_forward);  // backward leaves it be
    std::vector<float> v = x.grad().to_vector<float>();
    const std::vector<float> gw = w.grad().to_vector<float>();
    v.insert(v.end(), gw.begin(), gw.end());
    return v;
  };
  CHECK(grads(true) == grads(false));  // same kernels, same dropout mask: the same bits

  // Double backward through the recomputation, and first-order gradcheck.
  const Tensor a = randn({3, 4}, {}, &g).requires_grad_(true), b = randn({4, 2}, {}, &g).requires_grad_(true);
  auto smooth = [](const autograd::TensorList& in) { return autograd::TensorList{tanh(matmul(in[0], in[1]))}; };
  auto through = [&](const std::vector<Tensor>& v) { return autograd::checkpoint(smooth, v)[0]; };
  CHECK(autograd::gradcheck(through, {a, b}) == "");
  CHECK(autograd::gradgradcheck(through, {a, b}) == "");

  // Without grad mode nothing is recorded; an input changed in place before backward is refused.
  {
    autograd::NoGradGuard no_grad;
    CHECK(autograd::checkpoint(smooth, {a, b})[0].grad_fn() == nullptr);
  }
  Tensor c = randn({3, 4}, {}, &g).requires_grad_(true);
  Tensor e = randn({4, 2}, {}, &g);
  Tensor out = autograd::checkpoint(smooth, {c, e})[0];
  e.fill_(1.0);
  CHECK_THROWS_WITH_AS(sum(out).backward(), doctest::Contains("CheckpointBackward"), RuntimeError);
  // A layer's own parameters, used without being inputs, get their gradients (first order).
  {
    manual_seed(2);
    nn::Linear layer(4, 3);
    const Tensor xin = randn({5, 4}, {}, &g).requires_grad_(true);
    auto lin = [&](const autograd::TensorList& in) { return autograd::TensorList{tanh(layer.forward(in[0]))}; };
    sum(square(autograd::checkpoint(lin, {xin})[0])).backward();
    const std::vector<float> gw = layer.param("weight").grad().to_vector<float>();
    const std::vector<float> gx = xin.grad().to_vector<float>();
    layer.zero_grad();
    const Tensor xin2 = xin.detach().requires_grad_(true);
    sum(square(lin({xin2})[0])).backward();
    CHECK(gw == layer.param("weight").grad().to_vector<float>());
    CHECK(gx == xin2.grad().to_vector<float>());
    // With create_graph only inputs are differentiated: a parameter that is not one is refused.
    const Tensor o = autograd::checkpoint(lin, {xin})[0];
    CHECK_THROWS_WITH_AS(autograd::grad({sum(o)}, {xin}, {}, false, true), doctest::Contains("pass it in"),
                         RuntimeError);
  }
  // create_graph: an input whose history holds another input, and one tensor passed twice, count once.
  {
    const Tensor w = randn({3}, {}, &g).requires_grad_(true);
    auto prod = [](const autograd::TensorList& in) { return autograd::TensorList{mul(in[0], in[1])}; };
    const Tensor x = mul(w, 2.0);
    const Tensor via = autograd::grad({sum(autograd::checkpoint(prod, {x, w})[0])}, {w}, {}, false, true)[0];
    const Tensor plain = autograd::grad({sum(prod({x, w})[0])}, {w}, {}, false, true)[0];
    CHECK(via.to_vector<float>() == plain.to_vector<float>());  // 4 w
    const Tensor twice = autograd::grad({sum(autograd::checkpoint(prod, {w, w})[0])}, {w}, {}, false, true)[0];
    CHECK(twice.to_vector<float>() == mul(w, 2.0).to_vector<float>());
    CHECK(twice.requires_grad());  // history kept for a second derivative
  }
  // The output of an identity is a new tensor with history, not the input itself.
  Tensor id = autograd::checkpoint([](const autograd::TensorList& in) { return in; }, {c})[0];
  CHECK(!id.same(c));
  sum(id).backward();
  check_close(c.grad(), std::vector<float>(12, 1.0f));
}
