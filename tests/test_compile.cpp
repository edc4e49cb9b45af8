// mn::compile (nn/compile.h) over capture and replay (core/capture.h): replays equal eager calls bit
// for bit, signatures and guards capture again, what cannot be replayed falls back or throws.
#include <functional>

#include "compile_test_support.h"
#include "core/allocator.h"
#include "core/capture.h"
#include "mapping/mapping_networks.h"
#include "test_support.h"

using namespace mn;
using namespace mn::testing;
using mapping::MappingModel;
using mapping::MappingOptions;
namespace F = nn::functional;

namespace {

struct Batch {
  Tensor x, y;
};

std::vector<Batch> batches(int n, int64_t size, uint64_t seed) {
  Generator g(seed);
  std::vector<Batch> out;
  for (int i = 0; i < n; ++i) {
    Tensor x = randn({size, 6}, {}, &g);
    Tensor y = from_vector(std::vector<int64_t>(static_cast<size_t>(size), i % 3));
    out.push_back({x, y});
  }
  return out;
}

}  // namespace

TEST_CASE("compile: a replayed training step (BatchNorm, dropout, SGD outside) equals eager steps bit for bit") {
  const auto data = batches(5, 4, 11);
  auto run = [&](bool compiled) {
    manual_seed(3);
    auto net = small_net();
    nn::optim::SGD opt(net->parameters(), {.lr = 0.1, .momentum = 0.9});
    auto body = [&](const std::vector<Tensor>& in) {
      Tensor loss = F::cross_entropy(net->forward(in[0]), in[1]);
      loss.backward();
      return std::vector<Tensor>{loss.detach()};
    };
    CompiledFunction step = compile(body, nn::module_guard(*net));
    std::vector<float> losses;
    for (const Batch& b : data) {
      opt.zero_grad();
      Tensor loss = compiled ? step({b.x, b.y})[0] : body({b.x, b.y})[0];
      losses.push_back(static_cast<float>(loss.item()));
      opt.step();
    }
    if (compiled) {
      CHECK(step.stats().captures == 1);
      CHECK(step.stats().replays == 4);
      CHECK(step.stats().eager == 0);
      CHECK(step.num_graphs() == 1);
      CHECK(step.explain().find("captured") != std::string::npos);
    }
    std::vector<float> state = flat(all_state(*net));
    state.insert(state.end(), losses.begin(), losses.end());
    return state;
  };
  const std::vector<float> eager = run(false);
  const std::vector<float> replayed = run(true);
  CHECK(eager == replayed);
}

TEST_CASE("compile: mapped training steps replay bit for bit for every strategy") {
  Generator g(21);
  const Tensor x = randn({3, 1, 8, 8}, {}, &g);
  const Tensor y = from_vector(std::vector<int64_t>{0, 2, 1});
  for (std::string strategy : {"slvt", "layerwise", "lazy_layerwise"}) {
    for (bool write_back : {false, true}) {
      CAPTURE(strategy);
      CAPTURE(write_back);
      auto run = [&](bool compiled) {
        manual_seed(9);
        auto cnn = std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
            std::make_shared<nn::Conv2d>(1, 4, 3), std::make_shared<nn::BatchNorm2d>(4), std::make_shared<nn::ReLU>(),
            std::make_shared<nn::MaxPool2d>(2), std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(36, 3)});
        MappingOptions o;
        o.latent_dim = 12;
        o.strategy = strategy;
        o.write_back_buffers = write_back;  // BatchNorm's running stats carried across calls, replays included
        MappingModel model(cnn, o);
        nn::optim::Adam opt(model.parameters(), {.lr = 0.05});
        auto body = [&](const std::vector<Tensor>& in) {
          Tensor loss = F::cross_entropy(model.run(in[0]).predictions, in[1]);
          loss.backward();
          return std::vector<Tensor>{loss.detach()};
        };
        CompiledFunction step = compile(body, model.compile_guard(), {.fullgraph = true});
        std::vector<float> out;
        for (int i = 0; i < 4; ++i) {
          opt.zero_grad();
          out.push_back(static_cast<float>((compiled ? step({x, y}) : body({x, y}))[0].item()));
          opt.step();
        }
        if (compiled) CHECK(step.stats().replays == 3);
        std::vector<float> latents = flat(model.parameters());
        out.insert(out.end(), latents.begin(), latents.end());
        for (const auto& [name, b] : model.buffers()) {
          const Tensor f = b.to(DType::f32);
          for (float v : f.to_vector<float>()) out.push_back(v);
          if (write_back && name.find("num_batches_tracked") != std::string::npos) CHECK(f.item() == 4.0);
        }
        return out;
      };
      CHECK(run(false) == run(true));
    }
  }
}

TEST_CASE("compile: new shapes capture again, max_graphs bounds them, accumulation gets its own graph") {
  manual_seed(4);
  auto lin = std::make_shared<nn::Linear>(6, 3);
  auto body = [&](const std::vector<Tensor>& in) {
    Tensor loss = sum(mul(lin->forward(in[0]), 0.5));
    loss.backward();
    return std::vector<Tensor>{loss.detach()};
  };
  CompiledFunction step = compile(body, nn::module_guard(*lin), {.max_graphs = 2});
  const Tensor a = random_tensor({4, 6}, 1), b = random_tensor({2, 6}, 2), c = random_tensor({5, 6}, 3);
  std::vector<float> expected_grads, got_grads;
  for (const Tensor& x : {a, b, a, b}) {
    lin->zero_grad();
    const float e = static_cast<float>(body({x})[0].item());
    expected_grads = flat({lin->param("weight").grad()});
    lin->zero_grad();
    CHECK(static_cast<float>(step({x})[0].item()) == e);
    CHECK(flat({lin->param("weight").grad()}) == expected_grads);
  }
  CHECK(step.num_graphs() == 2);
  CHECK(step.stats().replays == 2);
  lin->zero_grad();
  step({c});  // a third signature: eager
  CHECK(step.stats().eager == 1);
  CHECK(step.explain().find("max_graphs (2) reached") != std::string::npos);

  // Two calls without zero_grad accumulate, as eager backward does: the second call's gradients are
  // the first graph's tensors, so a second graph (accumulating in place) is captured once and reused.
  std::vector<float> eager_acc;
  lin->zero_grad();
  body({a});
  body({a});
  eager_acc = flat({lin->param("weight").grad()});
  CompiledFunction acc = compile(body, nn::module_guard(*lin));
  for (int round = 0; round < 3; ++round) {
    lin->zero_grad();
    acc({a});
    acc({a});
    CHECK(flat({lin->param("weight").grad()}) == eager_acc);
  }
  CHECK(acc.num_graphs() == 2);
  CHECK(acc.stats().replays == 4);
}

TEST_CASE("compile: what a replay cannot repeat runs eagerly (and names why), or throws under fullgraph") {
  manual_seed(5);
  auto lin = std::make_shared<nn::Linear>(4, 2);
  const Tensor x = random_tensor({3, 4}, 7);
  struct Case {
    const char* what;
    std::function<std::vector<Tensor>(const std::vector<Tensor>&)> fn;
    bool pure = true;  // repeated calls give the same result
  };
  nn::optim::SGD opt(lin->parameters(), {.lr = 0.1});
  const std::vector<Case> cases = {
      {"item()", [&](const std::vector<Tensor>& in) {
         Tensor s = sum(lin->forward(in[0]));
         if (s.item() > 1e30) s = mul(s, 2.0);  // data-dependent control flow
         return std::vector<Tensor>{s.detach()};
       }},
      {"SGD::step()", [&](const std::vector<Tensor>& in) {
         opt.zero_grad();
         Tensor s = sum(lin->forward(in[0]));
         s.backward();
         opt.step();
         return std::vector<Tensor>{s.detach()};
       },
       false},
      {"empty_cache()", [&](const std::vector<Tensor>& in) {
         Tensor s = sum(lin->forward(in[0]));
         empty_cache();
         return std::vector<Tensor>{s.detach()};
       }},
      {"Tensor::data", [&](const std::vector<Tensor>& in) {
         autograd::NoGradGuard no_grad;
         Tensor t = mul(lin->forward(in[0]), 2.0);
         t.data<float>()[0] = 5.0f;  // a host write no replay would repeat
         return std::vector<Tensor>{sum(t)};
       }},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    CompiledFunction lenient = compile(c.fn, nn::module_guard(*lin));
    for (int i = 0; i < 3; ++i) {
      const std::vector<float> eager = flat(c.fn({x}));
      const std::vector<float> got = flat(lenient({x}));
      if (c.pure) CHECK(got == eager);
    }
    CHECK(lenient.stats().captures == 0);
    CHECK(lenient.stats().eager == 3);
    CHECK(lenient.explain().find(c.what) != std::string::npos);
    CompiledFunction strict = compile(c.fn, nn::module_guard(*lin), {.fullgraph = true});
    CHECK_THROWS_WITH_AS(strict({x}), doctest::Contains(c.what), RuntimeError);
    CHECK(!capture::recording());
  }
  // A compiled function called while another one captures runs eagerly inside the outer graph.
  CompiledFunction inner = compile([&](const std::vector<Tensor>& in) { return std::vector<Tensor>{mul(in[0], 3.0)}; });
  CompiledFunction outer = compile([&](const std::vector<Tensor>& in) { return std::vector<Tensor>{add(inner(in)[0], 1.0)}; },
                                   {}, {.fullgraph = true});
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    const Tensor v = random_tensor({4}, seed);
    CHECK(flat(outer({v})) == flat({add(mul(v, 3.0), 1.0)}));
  }
  CHECK(outer.stats().replays == 2);
  CHECK(inner.stats().calls == 1);
  // An input that requires grad cannot receive gradients from a replay.
  CompiledFunction f = compile([&](const std::vector<Tensor>& in) { return std::vector<Tensor>{sum(in[0]).detach()}; });
  f({random_param({2}, 1)});
  CHECK(f.explain().find("input 0 requires grad") != std::string::npos);
}

TEST_CASE("compile: guards see replaced tensors and training flags; inference modules compile") {
  manual_seed(6);
  auto net = small_net();
  nn::CompiledModule fast = nn::compile(*net);
  const Tensor x = random_tensor({5, 6}, 8);
  net->eval();
  {
    // Under grad mode the output requires grad: forward and backward are captured (a graph of its own;
    // tests/test_compile_training.cpp trains through it).
    Tensor out = fast(x);
    CHECK(out.requires_grad());
    CHECK(flat({out}) == flat({net->forward(x)}));
    CHECK(fast.function().num_graphs() == 1);
  }
  autograd::NoGradGuard no_grad;
  for (int i = 0; i < 3; ++i) CHECK(flat({fast(x)}) == flat({net->forward(x)}));
  CHECK(fast.function().num_graphs() == 2);
  // A replaced buffer (a different tensor, not an in-place update) captures again.
  auto& bn = static_cast<nn::BatchNorm1d&>(*net->named_children()[1].second);
  bn.set_buffer("running_mean", full({8}, 0.25));
  CHECK(flat({fast(x)}) == flat({net->forward(x)}));
  CHECK(fast.function().num_graphs() == 3);
  // Training mode is part of the signature (dropout and batch statistics).
  net->train();
  Tensor t1 = fast(x), t2 = fast(x);
  CHECK(fast.function().num_graphs() == 4);
  CHECK(flat({t1}) != flat({t2}));  // dropout draws new numbers at every replay
}

TEST_CASE("capture: host-written constants survive pool reuse; the pool reuses freed blocks") {
  const std::vector<float> values{1, 2, 3, 4, 5, 6, 7, 8};
  auto fn = [&](const std::vector<Tensor>& in) {
    Tensor y;
    {
      Tensor c = from_vector(values);  // written on the host, then freed
      y = mul(in[0], c);
    }
    Tensor filler = full({8}, 7.0);  // may take c's block in the pool
    for (int i = 0; i < 20; ++i) y = add(y, filler);  // 20 temporaries, each dead after the next
    return std::vector<Tensor>{y};
  };
  CompiledFunction f = compile(fn, {}, {.fullgraph = true});
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    const Tensor x = random_tensor({8}, seed);
    CHECK(flat(f({x})) == flat(fn({x})));
  }
  // Big temporaries: a chain of 1 MiB tensors needs a few blocks, not one per temporary.
  auto chain = [](const std::vector<Tensor>& in) {
    Tensor y = in[0];
    for (int i = 0; i < 16; ++i) y = mul(add(y, 1.0), 0.5);
    return std::vector<Tensor>{y};
  };
  capture::Graph graph;
  const Tensor x = random_tensor({1 << 18}, 4);
  {
    capture::Recording rec(graph);
    chain({x});
    CHECK(!rec.broken());
  }
  CHECK(graph.num_steps() == 32);
  CHECK(graph.peak_allocated_bytes() <= 4 * (int64_t{1} << 20));  // 32 MiB without reuse
  // Replays do not allocate from the device allocator.
  const int64_t before = memory_stats().allocation.allocated;
  graph.replay();
  CHECK(memory_stats().allocation.allocated == before);
}

TEST_CASE("capture: a destroyed generator, nested recordings and kernel errors at replay are errors") {
  capture::Graph graph;
  {
    auto gen = std::make_unique<Generator>(3);
    capture::Recording rec(graph);
    Tensor r = rand({4}, {}, gen.get());
    capture::Graph other;
    CHECK_THROWS_WITH_AS([&] { capture::Recording nested(other); }(), doctest::Contains("do not nest"), RuntimeError);
  }
  CHECK_THROWS_WITH_AS(graph.replay(), doctest::Contains("generator"), RuntimeError);

  // Index bounds are checked by the kernel, so a replay with a bad index throws as eager code would.
  Tensor table = random_tensor({5, 2}, 1);
  auto gather = [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{index_select(table, 0, in[0])}; };
  CompiledFunction g = compile(gather);
  CHECK(flat(g({from_vector(std::vector<int64_t>{4, 0})})) == flat(gather({from_vector(std::vector<int64_t>{4, 0})})));
  CHECK_THROWS_AS(g({from_vector(std::vector<int64_t>{9, 0})}), IndexError);
}

TEST_CASE("compile: a function without inputs: lazy_layerwise generation replays (empty_cache is CUDA-only)") {
  manual_seed(8);
  auto net = small_net();
  const mapping::ParameterSpec spec = mapping::ParameterSpec::from_module(*net);
  mapping::GeneratorOptions o;
  o.empty_cache_on_cuda = true;  // no effect on the CPU, so nothing breaks the capture
  mapping::LazyLayerwiseGenerator gen(spec, 16, o);
  auto generate = [&gen](const std::vector<Tensor>&) {
    autograd::NoGradGuard no_grad;
    const mapping::ParameterTree tree = gen.generate_parameters();
    std::vector<Tensor> out;
    for (const auto& [name, t] : tree.items()) out.push_back(t);
    return out;
  };
  CompiledFunction f = compile(generate, {}, {.fullgraph = true});
  for (int i = 0; i < 3; ++i) {
    // A latent changed in place between calls: the replay reads it.
    {
      autograd::NoGradGuard no_grad;
      for (const Tensor& z : gen.latents()) z.detach().copy_(random_tensor(z.sizes(), 40 + i));
    }
    CHECK(flat(f({})) == flat(generate({})));
  }
  CHECK(f.stats().replays == 2);
}
