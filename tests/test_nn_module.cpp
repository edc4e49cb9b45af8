// nn::Module registration and listing, state dicts, layers' shapes and initialisation, and
// functional_call (overrides without mutation, strict checks, buffers, gradients, LSTM).
#include "nn/functional_call.h"
#include "nn/layers.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::nn;
using mn::testing::check_close;

namespace {
std::vector<std::string> names_of(const NamedTensors& list) {
  std::vector<std::string> out;
  for (auto& [n, t] : list) out.push_back(n);
  return out;
}

std::shared_ptr<Sequential> cnn2() {
  auto net = std::make_shared<Sequential>();
  net->push_back(std::make_shared<Conv2d>(1, 16, 3));
  net->push_back(std::make_shared<ReLU>());
  net->push_back(std::make_shared<MaxPool2d>(2));
  net->push_back(std::make_shared<Conv2d>(16, 32, 3));
  net->push_back(std::make_shared<ReLU>());
  net->push_back(std::make_shared<MaxPool2d>(2));
  net->push_back(std::make_shared<Flatten>());
  net->push_back(std::make_shared<Linear>(800, 128));
  net->push_back(std::make_shared<ReLU>());
  net->push_back(std::make_shared<Linear>(128, 10));
  return net;
}
}  // namespace

TEST_CASE("nn: registration order, dotted names and parameter count of CNN2") {
  manual_seed(0);
  auto net = cnn2();
  CHECK(names_of(net->named_parameters()) ==
        std::vector<std::string>{"0.weight", "0.bias", "3.weight", "3.bias", "7.weight", "7.bias", "9.weight", "9.bias"});
  CHECK(net->parameter_count() == 108618);
  Tensor y = net->forward(randn({2, 1, 28, 28}));
  CHECK(y.sizes() == Shape{2, 10});
  CHECK_THROWS_AS(net->register_parameter("a.b", zeros({1})), ValueError);
  CHECK_THROWS_AS(net->register_parameter("", zeros({1})), ValueError);
}

TEST_CASE("nn: default initialisation matches PyTorch's distributions") {
  manual_seed(1);
  Linear lin(400, 300);
  const double bound = 1.0 / std::sqrt(400.0);
  Tensor w = lin.param("weight");
  CHECK(max(abs(w)).item() <= bound);
  CHECK(max(abs(w)).item() > 0.95 * bound);
  // U(-b, b) has std b / sqrt(3).
  CHECK(std::abs(mn::std_dev(w).item() - bound / std::sqrt(3.0)) < 0.02 * bound);
  BatchNorm2d bn(4);
  check_close(bn.param("weight"), {1, 1, 1, 1});
  check_close(bn.buffer("running_var"), {1, 1, 1, 1});
}

TEST_CASE("nn: state_dict round trip and strict loading errors") {
  manual_seed(2);
  auto a = cnn2();
  manual_seed(3);
  auto b = cnn2();
  b->load_state_dict(a->state_dict());
  Tensor x = randn({1, 1, 28, 28});
  check_close(b->forward(x), a->forward(x).to_vector<float>());
  StateDict bad = a->state_dict();
  bad.erase("0.bias");
  bad["extra"] = zeros({1});
  bad["9.weight"] = zeros({3, 3});
  try {
    b->load_state_dict(bad);
    FAIL("expected an error");
  } catch (const ValueError& e) {
    const std::string msg = e.what();
    CHECK(msg.find("missing=[0.bias]") != std::string::npos);
    CHECK(msg.find("unexpected=[extra]") != std::string::npos);
    CHECK(msg.find("9.weight (expected [10, 128], got [3, 3])") != std::string::npos);
  }
}

TEST_CASE("nn: functional_call uses supplied tensors, never mutates the module, and routes gradients") {
  manual_seed(4);
  Linear lin(3, 2);
  const std::vector<float> before = lin.param("weight").to_vector<float>();
  Tensor w = mn::testing::param({1, 0, 0, 0, 1, 0}, {2, 3});
  Tensor b = mn::testing::param({10, 20});
  Tensor x = mn::testing::tensor({1, 2, 3}, {1, 3});
  Tensor y = functional_call(lin, {{"weight", w}, {"bias", b}}, x);
  check_close(y, {11, 22});
  sum(y).backward();
  check_close(w.grad(), {1, 2, 3, 1, 2, 3});
  check_close(b.grad(), {1, 1});
  CHECK(lin.param("weight").to_vector<float>() == before);
  CHECK(!lin.param("weight").grad().defined());
  // Strict names and shapes
  CHECK_THROWS_WITH_AS(functional_call(lin, {{"weight", w}}, x), doctest::Contains("missing=[bias]"), KeyError);
  CHECK_THROWS_WITH_AS(functional_call(lin, {{"weight", w}, {"bias", b}, {"typo", b}}, x),
                       doctest::Contains("unexpected=[typo]"), KeyError);
  CHECK_THROWS_WITH_AS(functional_call(lin, {{"weight", zeros({3, 2})}, {"bias", b}}, x),
                       doctest::Contains("expected shape [2, 3] for 'weight', got [3, 2]"), ValueError);
}

TEST_CASE("nn: functional_call on nested modules and BatchNorm buffers") {
  manual_seed(5);
  auto net = std::make_shared<Sequential>(std::vector<ModulePtr>{std::make_shared<Linear>(4, 3),
                                                                  std::make_shared<BatchNorm1d>(3)});
  std::map<std::string, Tensor> params;
  for (auto& [n, t] : net->named_parameters()) params[n] = t.detach().clone().requires_grad_(true);
  Tensor x = randn({8, 4});
  StateDict buffers_after;
  FunctionalCallOptions opts;
  opts.buffers_out = &buffers_after;
  Tensor y = functional_call(*net, params, [&] { return net->forward(x); }, opts);
  // Train-mode BN normalises with batch statistics: per-feature mean ~ 0.
  check_close(mean(y, {0}), {0, 0, 0}, 1e-4);
  // The module's running stats are untouched; the call's copies moved.
  check_close((*net)[1]->buffer("running_mean"), {0, 0, 0});
  CHECK(buffers_after.count("1.running_mean"));
  CHECK(sum(abs(buffers_after["1.running_mean"])).item() > 0);
  sum(mul(y, y)).backward();
  for (auto& [n, t] : params) CHECK(t.grad().defined());
  // Eval mode uses running statistics (initial 0/1 inside a functional call).
  net->eval();
  Tensor y_eval = functional_call(*net, params, [&] { return net->forward(x); });
  Tensor lin_out = functional::linear(x, params["0.weight"], params["0.bias"]);
  Tensor expected = add(mul(lin_out, 1.0 / std::sqrt(1.0 + 1e-5)), 0.0);
  check_close(y_eval, expected.to_vector<float>(), 1e-4);
}

TEST_CASE("nn: LSTM shapes, batch_first and gradients through functional_call") {
  manual_seed(6);
  LSTM lstm(3, 4, 2, true, true);
  CHECK(names_of(lstm.named_parameters()).front() == "weight_ih_l0");
  CHECK(lstm.named_parameters().size() == 8);
  Tensor x = randn({2, 5, 3});
  auto out = lstm.forward_with_state(x);
  CHECK(out.output.sizes() == Shape{2, 5, 4});
  CHECK(out.h_n.sizes() == Shape{2, 2, 4});
  CHECK(out.c_n.sizes() == Shape{2, 2, 4});
  // The last output step equals the top layer's final hidden state.
  check_close(out.output.select(1, 4), out.h_n.select(0, 1).to_vector<float>());
  std::map<std::string, Tensor> params;
  for (auto& [n, t] : lstm.named_parameters()) params[n] = t.detach().clone().requires_grad_(true);
  Tensor y = functional_call(lstm, params, x);
  sum(y).backward();
  for (auto& [n, t] : params) {
    INFO(n);
    CHECK(t.grad().defined());
  }
  CHECK_THROWS_WITH_AS(lstm.forward(randn({2, 5, 7})), doctest::Contains("[2, 5, 7]"), ValueError);
}

TEST_CASE("nn: train/eval propagate, zero_grad clears, Dropout respects mode") {
  auto net = std::make_shared<Sequential>(std::vector<ModulePtr>{std::make_shared<Linear>(4, 4),
                                                                  std::make_shared<Dropout>(0.5)});
  net->eval();
  CHECK(!(*net)[1]->is_training());
  Tensor x = ones({2, 4});
  check_close(net->forward(x), net->forward(x).to_vector<float>());
  sum(net->forward(x)).backward();
  CHECK(net->named_parameters()[0].second.grad().defined());
  net->zero_grad();
  CHECK(!net->named_parameters()[0].second.grad().defined());
  CHECK_THROWS_AS(Dropout(1.5), ValueError);
}
