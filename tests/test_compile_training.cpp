// mn::compile of a forward whose outputs require grad (nn/compile.h): the backward is captured with the
// forward and replayed by loss.backward(); training through it equals eager training bit for bit.
#include <functional>

#include "compile_test_support.h"
#include "core/capture.h"
#include "mapping/mapping_networks.h"
#include "test_support.h"

using namespace mn;
using namespace mn::testing;
using mapping::MappingModel;
using mapping::MappingOptions;
namespace F = nn::functional;

TEST_CASE("compile(model) in training: BatchNorm, dropout, Adam outside; losses, parameters and buffers equal eager") {
  Generator g(4);
  std::vector<Tensor> xs, ys;
  for (int i = 0; i < 5; ++i) {
    xs.push_back(randn({4, 6}, {}, &g));
    ys.push_back(from_vector(std::vector<int64_t>{0, 1, 2, static_cast<int64_t>(i % 3)}));
  }
  auto run = [&](bool compiled) {
    manual_seed(3);
    auto net = small_net();
    nn::optim::Adam opt(net->parameters(), {.lr = 0.05});
    nn::CompiledModule fast = nn::compile(*net, {.fullgraph = true});
    std::vector<float> out;
    for (size_t i = 0; i < xs.size(); ++i) {
      opt.zero_grad();
      Tensor logits = compiled ? fast(xs[i]) : net->forward(xs[i]);
      CHECK(logits.requires_grad());
      Tensor loss = F::cross_entropy(logits, ys[i]);
      loss.backward();
      out.push_back(static_cast<float>(loss.item()));
      const std::vector<float> grads = flat([&] {
        std::vector<Tensor> gs;
        for (const Tensor& p : net->parameters()) gs.push_back(p.grad());
        return gs;
      }());
      out.insert(out.end(), grads.begin(), grads.end());
      opt.step();
    }
    if (compiled) {
      const auto& s = fast.function().stats();
      CHECK(s.captures == 1);
      CHECK(s.replays == 4);
      CHECK(s.eager == 0);
      CHECK(fast.function().explain().find("captured") != std::string::npos);
    }
    const std::vector<float> state = flat(all_state(*net));
    out.insert(out.end(), state.begin(), state.end());
    return out;
  };
  const std::vector<float> eager = run(false);
  const std::vector<float> replayed = run(true);
  CHECK(eager.size() == replayed.size());
  CHECK(eager == replayed);
}

TEST_CASE("compile of a mapped model's forward in training equals eager for every strategy") {
  Generator g(21);
  const Tensor x = randn({3, 1, 8, 8}, {}, &g);
  const Tensor y = from_vector(std::vector<int64_t>{0, 2, 1});
  for (std::string strategy : {"slvt", "layerwise", "lazy_layerwise"}) {
    CAPTURE(strategy);
    auto run = [&](bool compiled) {
      manual_seed(9);
      auto cnn = std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
          std::make_shared<nn::Conv2d>(1, 4, 3), std::make_shared<nn::BatchNorm2d>(4), std::make_shared<nn::ReLU>(),
          std::make_shared<nn::Dropout>(0.2), std::make_shared<nn::MaxPool2d>(2), std::make_shared<nn::Flatten>(),
          std::make_shared<nn::Linear>(36, 3)});
      MappingOptions o;
      o.latent_dim = 12;
      o.strategy = strategy;
      o.write_back_buffers = true;
      MappingModel model(cnn, o);
      nn::optim::Adam opt(model.parameters(), {.lr = 0.05});
      CompiledFunction forward = compile(
          [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{model.run(in[0]).predictions}; },
          model.compile_guard(), {.fullgraph = true});
      std::vector<float> out;
      for (int i = 0; i < 4; ++i) {
        opt.zero_grad();
        Tensor logits = compiled ? forward({x})[0] : model.run(x).predictions;
        Tensor loss = F::cross_entropy(logits, y);
        loss.backward();
        out.push_back(static_cast<float>(loss.item()));
        opt.step();
      }
      if (compiled) CHECK(forward.stats().replays == 3);
      const std::vector<float> latents = flat(model.parameters());
      out.insert(out.end(), latents.begin(), latents.end());
      for (const auto& [name, b] : model.buffers()) {
        const std::vector<float> v = flat({b});
        out.insert(out.end(), v.begin(), v.end());
      }
      return out;
    };
    CHECK(run(false) == run(true));
  }
}

TEST_CASE("compile with grad outputs: accumulation, unused outputs, hooks, stale outputs and in-place updates") {
  manual_seed(12);
  auto lin = std::make_shared<nn::Linear>(5, 4);
  const Tensor x1 = random_tensor({3, 5}, 1), x2 = random_tensor({3, 5}, 2);
  // Two outputs; the loss may use either or both.
  auto fn = [&](const std::vector<Tensor>& in) {
    Tensor h = lin->forward(in[0]);
    return std::vector<Tensor>{tanh(h), sum(mul(h, h))};
  };
  CompiledFunction compiled = compile(fn, nn::module_guard(*lin), {.fullgraph = true});
  auto grads_after = [&](const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& f, int which) {
    for (const Tensor& p : lin->parameters()) p.set_grad(Tensor());
    // Two micro-batches accumulate into .grad, as after eager forwards.
    for (const Tensor& x : {x1, x2}) {
      std::vector<Tensor> out = f({x});
      Tensor loss = which == 0 ? sum(out[0]) : which == 1 ? out[1] : add(sum(mul(out[0], 3.0)), out[1]);
      loss.backward();
    }
    std::vector<Tensor> gs;
    for (const Tensor& p : lin->parameters()) gs.push_back(p.grad().clone());
    return flat(gs);
  };
  for (int which : {0, 1, 2}) {
    CAPTURE(which);
    CHECK(grads_after([&](const std::vector<Tensor>& in) { return compiled(in); }, which) == grads_after(fn, which));
  }
  CHECK(compiled.stats().captures == 1);
  CHECK(compiled.stats().replays == 5);

  // Post-accumulate hooks (DDP's) run for the gradients a replayed backward hands back.
  int hook_calls = 0;
  lin->parameters()[0].register_post_accumulate_grad_hook([&](const Tensor&) { ++hook_calls; });
  sum(compiled({x1})[0]).backward();
  CHECK(hook_calls == 1);

  // A later call overwrites the activations an earlier output's backward needs.
  Tensor first = compiled({x1})[0];
  Tensor second = compiled({x2})[0];
  CHECK_THROWS_WITH_AS(sum(first).backward(), doctest::Contains("later call"), RuntimeError);
  sum(second).backward();

  // Parameters changed in place between forward and backward: refused, as eager refuses it.
  Tensor out = compiled({x1})[0];
  {
    autograd::NoGradGuard no_grad;
    lin->parameters()[0].copy_(mul(lin->parameters()[0], 0.5));
  }
  CHECK_THROWS_WITH_AS(sum(out).backward(), doctest::Contains("in-place"), RuntimeError);

  // Double backward is refused with a clear message.
  Tensor o = compiled({x1})[0];
  CHECK_THROWS_WITH_AS(autograd::grad({sum(o)}, {lin->parameters()[0]}, {}, true, /*create_graph=*/true),
                       doctest::Contains("double backward"), RuntimeError);
  CHECK(!capture::recording());
}

TEST_CASE("compile with grad outputs: a forward that cannot be captured runs eagerly with its history") {
  manual_seed(13);
  auto lin = std::make_shared<nn::Linear>(4, 2);
  const Tensor x = random_tensor({3, 4}, 7);
  auto fn = [&](const std::vector<Tensor>& in) {
    Tensor h = lin->forward(in[0]);
    if (sum(h).item() > 1e30) h = mul(h, 2.0);  // a host read: not replayable
    return std::vector<Tensor>{h};
  };
  CompiledFunction lenient = compile(fn, nn::module_guard(*lin));
  for (int i = 0; i < 2; ++i) {
    for (const Tensor& p : lin->parameters()) p.set_grad(Tensor());
    sum(lenient({x})[0]).backward();
    const std::vector<float> got = flat({lin->parameters()[0].grad()});
    for (const Tensor& p : lin->parameters()) p.set_grad(Tensor());
    sum(fn({x})[0]).backward();
    CHECK(got == flat({lin->parameters()[0].grad()}));
  }
  CHECK(lenient.stats().eager == 2);
  CHECK(lenient.explain().find("item()") != std::string::npos);
  CompiledFunction strict = compile(fn, nn::module_guard(*lin), {.fullgraph = true});
  CHECK_THROWS_AS(strict({x}), RuntimeError);
}
