// MappingOptions::stream_layers on a target that is not a Sequential: a residual network written as
// C++ modules (forward calls children through operator() and Module::call, with skip connections and
// a nested Sequential). Streamed and plain runs must agree bit for bit (predictions, latent gradients,
// BatchNorm statistics), nested owners included; a child run through forward() directly is refused.
#include <algorithm>

#include "core/allocator.h"
#include "core/caching_allocator.h"
#include "mapping/mapping_model.h"
#include "nn/functional.h"
#include "nn/layers.h"
#include "nn/optim.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::mapping;

namespace {

// a * gain + b, per channel: a two-input module called through Module::call.
class GainAdd : public nn::Module {
 public:
  explicit GainAdd(int64_t channels) : nn::Module("GainAdd") {
    register_parameter("gain", full({channels, 1, 1}, 1.0f));
  }
  Tensor mix(const Tensor& a, const Tensor& b) {
    const auto body = [this](const std::vector<Tensor>& in) { return std::vector<Tensor>{in[0] * param("gain") + in[1]}; };
    return call({a, b}, body)[0];
  }
};

// A BasicBlock: conv-bn-relu-conv-bn, plus the input (or its 1x1 projection, a nested Sequential).
class Block : public nn::Module {
 public:
  Block(int64_t in, int64_t out, int64_t stride, bool direct_calls = false)
      : nn::Module("Block"), direct_calls_(direct_calls) {
    conv1_ = register_module("conv1", std::make_shared<nn::Conv2d>(in, out, 3, stride, 1));
    bn1_ = register_module("bn1", std::make_shared<nn::BatchNorm2d>(out));
    conv2_ = register_module("conv2", std::make_shared<nn::Conv2d>(out, out, 3, 1, 1));
    bn2_ = register_module("bn2", std::make_shared<nn::BatchNorm2d>(out));
    add_ = register_module("add", std::make_shared<GainAdd>(out));
    if (stride != 1 || in != out)
      shortcut_ = register_module("shortcut", std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
                                                  std::make_shared<nn::Conv2d>(in, out, 1, stride, 0),
                                                  std::make_shared<nn::BatchNorm2d>(out)}));
  }
  Tensor forward(const Tensor& x) override {
    // direct_calls: the libtorch habit of calling a child's forward(), which bypasses streaming.
    Tensor h = direct_calls_ ? conv1_->forward(x) : (*conv1_)(x);
    h = relu((*bn1_)(h));
    h = (*bn2_)((*conv2_)(h));
    return relu(add_->mix(h, shortcut_ ? (*shortcut_)(x) : x));
  }

 private:
  bool direct_calls_;
  std::shared_ptr<nn::Module> conv1_, bn1_, conv2_, bn2_, shortcut_;
  std::shared_ptr<GainAdd> add_;
};

class ResidualNet : public nn::Module {
 public:
  ResidualNet(int64_t width, int64_t side, int64_t blocks, int64_t classes, bool direct_calls = false)
      : nn::Module("ResidualNet") {
    stem_ = register_module("stem", std::make_shared<nn::Conv2d>(1, width, 3, 1, 1));
    bn_ = register_module("bn", std::make_shared<nn::BatchNorm2d>(width));
    auto body = std::make_shared<nn::Sequential>();
    body->push_back(std::make_shared<Block>(width, width, 1, direct_calls));
    for (int64_t b = 1; b < blocks; ++b)
      body->push_back(b == 1 ? std::make_shared<Block>(width, 2 * width, 2)
                             : std::make_shared<Block>(2 * width, 2 * width, 1));
    body_ = register_module("body", body);
    const int64_t out_side = blocks > 1 ? (side + 1) / 2 : side;
    head_ = register_module("head", std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
                                        std::make_shared<nn::Flatten>(),
                                        std::make_shared<nn::Linear>((blocks > 1 ? 2 : 1) * width * out_side * out_side,
                                                                     classes)}));
  }
  Tensor forward(const Tensor& x) override { return (*head_)((*body_)(relu((*bn_)((*stem_)(x))))); }

 private:
  std::shared_ptr<nn::Module> stem_, bn_, body_, head_;
};

std::shared_ptr<ResidualNet> small_net(bool direct_calls = false) {
  manual_seed(12);
  return std::make_shared<ResidualNet>(3, 6, 2, 4, direct_calls);
}

// The grouped strategy by module, nested: block 1's main path and its projection shortcut are
// separate groups, so the shortcut's owner runs inside the block's.
std::vector<std::pair<std::string, std::vector<std::string>>> module_groups(const nn::Module& net) {
  std::vector<std::pair<std::string, std::vector<std::string>>> groups;
  auto group_of = [](const std::string& name) -> std::string {
    for (const char* prefix : {"body.1.shortcut.", "body.1.", "body.0.", "stem.", "bn.", "head."})
      if (name.rfind(prefix, 0) == 0) return prefix;
    return name;
  };
  for (const auto& [name, t] : net.named_parameters()) {
    const std::string g = group_of(name);
    if (groups.empty() || groups.back().first != g) {
      auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& e) { return e.first == g; });
      if (it == groups.end()) it = groups.insert(groups.end(), {g, {}});
      it->second.push_back(name);
    } else {
      groups.back().second.push_back(name);
    }
  }
  return groups;
}

std::vector<float> flat(const Tensor& t) { return t.detach().to(DType::f32).to_vector<float>(); }

}  // namespace

TEST_CASE("streaming: a residual C++ module tree streams bit-identically to the plain mapped model") {
  namespace F = mn::nn::functional;
  Generator g(5);
  const Tensor x = randn({4, 1, 6, 6}, {}, &g);
  const Tensor y = from_vector(std::vector<int64_t>{0, 3, 1, 2});
  for (std::string strategy : {"layerwise", "lazy_layerwise", "grouped"}) {
    CAPTURE(strategy);
    // Two SGD steps in train mode (BatchNorm statistics written back), then an evaluation.
    auto run = [&](bool stream) {
      MappingOptions o;
      o.latent_dim = 5;
      o.strategy = strategy;
      o.write_back_buffers = true;
      o.stream_layers = stream;
      auto net = small_net();
      if (strategy == "grouped") o.groups = module_groups(*net);
      MappingModel model(net, o);
      nn::optim::SGD sgd(model.parameters(), nn::optim::SGDOptions{.lr = 0.1});
      std::vector<std::vector<float>> seen;
      for (int step = 0; step < 2; ++step) {
        sgd.zero_grad();
        ForwardResult r = model.run(x);
        CHECK(r.streamed == stream);
        seen.push_back(flat(r.predictions));
        F::cross_entropy(r.predictions, y).backward();
        for (const auto& [name, z] : model.named_latents()) {
          INFO(name);
          REQUIRE(z.grad().defined());
          seen.push_back(flat(z.grad()));
        }
        sgd.step();
      }
      for (const auto& [name, b] : model.buffers()) seen.push_back(flat(b));
      model.eval();
      seen.push_back(flat(model.run(x).predictions));
      return seen;
    };
    const auto streamed = run(true), plain = run(false);
    REQUIRE(streamed.size() == plain.size());
    for (size_t i = 0; i < plain.size(); ++i) {
      INFO("record " << i);
      CHECK(streamed[i] == plain[i]);
    }
  }
}

TEST_CASE("streaming: refusals: a child run through forward(), slvt, run_with, nothing to stream") {
  const Tensor x = randn({2, 1, 6, 6});
  MappingOptions o;
  o.latent_dim = 4;
  o.stream_layers = true;
  // body.0.conv1 owns a layerwise group but its parent calls conv1->forward(x): its weight was never
  // generated, and its first read says so instead of running on the target's frozen tensor.
  MappingModel direct(small_net(/*direct_calls=*/true), o);
  const std::string message = mn::testing::error_message([&] { direct.run(x); });
  INFO(message);
  CHECK(mn::testing::contains(message, "'body.0.conv1."));
  CHECK(mn::testing::contains(message, "operator()"));
  CHECK_THROWS_AS(direct.run(x), ValueError);
  // The same target runs unstreamed, and streamed when the block owns the whole group (grouped by block).
  o.stream_layers = false;
  CHECK(MappingModel(small_net(true), o).run(x).predictions.sizes() == Shape{2, 4});
  o.stream_layers = true;
  o.strategy = "grouped";
  o.groups = module_groups(*small_net(true));
  CHECK(MappingModel(small_net(true), o).run(x).predictions.sizes() == Shape{2, 4});

  o.groups.clear();
  o.strategy = "slvt";
  CHECK_THROWS_WITH_AS(MappingModel(small_net(), o), doctest::Contains("not slvt"), ValueError);
  o.strategy = "layerwise";
  MappingModel streamed(small_net(), o);
  CHECK_THROWS_WITH_AS(streamed.run_with([&](nn::Module& m) { return m(x); }), doctest::Contains("run(input)"),
                       ValueError);
  CHECK_THROWS_WITH_AS(MappingModel(std::make_shared<nn::Linear>(3, 2), o), doctest::Contains("nothing to stream"),
                       ValueError);
}

TEST_CASE("streaming: a wide residual target streams with a fraction of the plain model's peak memory") {
  if (!caching_enabled(kCPU)) return;  // the peak comes from the caching allocator's counters
  namespace F = mn::nn::functional;
  // Width 96 on 8x8 inputs at batch 2: 5 blocks, 2.7 M parameters (11 MB), small activations.
  Generator g(9);
  const Tensor x = randn({2, 1, 8, 8}, {}, &g);
  const Tensor y = from_vector(std::vector<int64_t>{1, 7});
  auto peak_of_step = [&](bool stream, std::vector<float>& grads, int64_t& params) {
    MappingOptions o;
    o.latent_dim = 8;
    o.stream_layers = stream;
    manual_seed(2);
    MappingModel model(std::make_shared<ResidualNet>(96, 8, 5, 10), o);
    params = model.target_parameter_count();
    reset_peak_memory_stats(kCPU);
    const int64_t before = memory_stats(kCPU).allocated_bytes.current;
    F::cross_entropy(model.run(x).predictions, y).backward();
    const int64_t peak = memory_stats(kCPU).allocated_bytes.peak - before;
    for (const Tensor& z : model.parameters()) {
      const std::vector<float> v = flat(z.grad());
      grads.insert(grads.end(), v.begin(), v.end());
    }
    return peak;
  };
  std::vector<float> plain_grads, streamed_grads;
  int64_t params = 0;
  const int64_t plain = peak_of_step(false, plain_grads, params);
  const int64_t streamed = peak_of_step(true, streamed_grads, params);
  CHECK(streamed_grads == plain_grads);
  MESSAGE("residual target, " << params << " parameters: step peak above the model: plain " << plain
                              << " B, streamed " << streamed << " B");
  CHECK(plain >= params * 4);      // every generated parameter at once
  // The largest owner's (a 192x192x3x3 conv: 1.3 MB) generated weight, its gradient and the mapper's
  // temporaries, besides the activations: measured here 7,797,248 B streamed vs 43,401,216 B plain.
  CHECK(4 * streamed < plain);
}

TEST_CASE("streaming: building blocks: CallInterceptor sees operator() and call(), not forward(); blocked parameters") {
  // An interceptor that records which modules were called and doubles their outputs.
  struct Recorder : nn::CallInterceptor {
    std::vector<std::string> seen;
    std::vector<Tensor> intercept(nn::Module& m, const std::vector<Tensor>& in,
                                  const nn::ModuleBody& body) override {
      seen.push_back(m.type_name());
      std::vector<Tensor> out = body(in);
      for (Tensor& t : out) t = t * 2.0;
      return out;
    }
  } recorder;
  manual_seed(1);
  auto lin = std::make_shared<nn::Linear>(3, 2);
  auto gain = std::make_shared<GainAdd>(2);
  const Tensor x = randn({4, 3});
  const Tensor plain = (*lin)(x);
  {
    nn::CallInterceptorGuard guard(&recorder);
    CHECK(flat((*lin)(x)) == flat(plain * 2.0));
    CHECK(flat(lin->forward(x)) == flat(plain));  // bypasses the interceptor
    const Tensor a = randn({1, 2, 1, 1}), b = randn({1, 2, 1, 1});
    CHECK(flat(gain->mix(a, b)) == flat((a + b) * 2.0));
    {
      nn::CallInterceptorGuard none(nullptr);
      CHECK(flat((*lin)(x)) == flat(plain));
    }
  }
  CHECK(recorder.seen == std::vector<std::string>{"Linear", "GainAdd"});
  CHECK(flat((*lin)(x)) == flat(plain));  // uninstalled

  // Blocked: with strict = false, an unsupplied parameter read is an error with the given text; a
  // nested call that supplies it wins; supplied ones read as usual.
  nn::FunctionalCallOptions blocked;
  blocked.strict = false;
  blocked.blocked_parameter_error = [](const std::string& name) { return "no " + name + " here"; };
  const Tensor w = zeros({2, 3});
  {
    nn::FunctionalCallGuard outer(*lin, {{"weight", w}}, blocked);
    CHECK(flat(lin->param("weight")) == flat(w));
    CHECK_THROWS_WITH_AS(lin->param("bias"), "no bias here", ValueError);
    nn::FunctionalCallGuard inner(*lin, {{"bias", ones({2})}}, nn::FunctionalCallOptions{.strict = false});
    CHECK(flat((*lin)(x)) == std::vector<float>(8, 1.0f));
  }
  CHECK(flat((*lin)(x)) == flat(plain));
}
