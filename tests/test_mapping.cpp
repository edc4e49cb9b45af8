// Mapping core: ParameterSpec/Tree, orthogonal mapper matrices, mappers and modulation, generators
// (slvt, layerwise, lazy_layerwise, grouped) and MappingModel - the reference library's behaviours
// plus the values it never tested (lazy == layerwise bitwise, identical scales across strategies), and
// stream_layers (generation layer by layer, recomputed in backward; other module trees: test_streaming.cpp).
#include <omp.h>

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
using mn::testing::check_close;
using mn::testing::tensor;

namespace {
std::shared_ptr<nn::Sequential> two_linear() {
  auto net = std::make_shared<nn::Sequential>();
  net->push_back(std::make_shared<nn::Linear>(3, 2));
  net->push_back(std::make_shared<nn::Linear>(2, 1, false));
  return net;
}
bool bitwise_equal(const Tensor& a, const Tensor& b) { return a.to_vector<float>() == b.to_vector<float>(); }
}  // namespace

TEST_CASE("mapping: ParameterTree::map keeps names and order, refuses what a tree refuses") {
  const ParameterTree tree({{"b", tensor({1, 2})}, {"a", tensor({3})}});
  const ParameterTree doubled = tree.map([](const Tensor& t) { return mul(t, 2.0); });
  CHECK(doubled.names() == std::vector<std::string>{"b", "a"});
  check_close(doubled.at("b"), {2, 4});
  check_close(doubled.at("a"), {6});
  check_close(tree.at("b"), {1, 2});  // the source is unchanged
  CHECK_THROWS_WITH_AS(tree.map([](const Tensor&) { return Tensor(); }), doctest::Contains("Parameter 'b'"),
                       TypeError);
  CHECK_THROWS_AS(tree.map(nullptr), ValueError);
}

TEST_CASE("mapping: ParameterSpec layout, unflatten views and flatten order") {
  auto net = two_linear();
  ParameterSpec spec = ParameterSpec::from_module(*net);
  CHECK(spec.names() == std::vector<std::string>{"0.weight", "0.bias", "1.weight"});
  CHECK(spec.entry("0.bias").start == 6);
  CHECK(spec.entry("0.bias").stop == 8);
  CHECK(spec.entry("1.weight").start == 8);
  CHECK(spec.total_numel() == 10);
  Tensor flat = arange(0.0, 10.0, 1.0, DType::f32).requires_grad_(true);
  ParameterTree tree = spec.unflatten(flat);
  CHECK(tree.at("0.weight").sizes() == Shape{2, 3});
  CHECK(tree.at("0.weight").storage() == flat.storage());
  Tensor total = zeros({});
  for (auto& [n, t] : tree.items()) total = add(total, sum(t));
  total.backward();
  check_close(flat.grad(), std::vector<float>(10, 1.0f));
  // flatten follows spec order whatever the map order
  std::map<std::string, Tensor> bias_first{{"0.bias", tensor({6, 7})}, {"1.weight", tensor({8, 9}, {1, 2})},
                                           {"0.weight", tensor({0, 1, 2, 3, 4, 5}, {2, 3})}};
  check_close(spec.flatten(bias_first), {0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  CHECK_THROWS_WITH_AS(spec.unflatten(zeros({2, 5})), doctest::Contains("1D vector"), ValueError);
  CHECK_THROWS_WITH_AS(spec.unflatten(zeros({4})), doctest::Contains("Expected 10 values"), ValueError);
  bias_first.erase("0.weight");
  CHECK_THROWS_WITH_AS(spec.flatten(bias_first), doctest::Contains("missing=[0.weight]"), ValueError);
  bias_first["0.weight"] = zeros({3, 2});
  CHECK_THROWS_WITH_AS(spec.flatten(bias_first), doctest::Contains("Expected shape"), ValueError);
  CHECK_THROWS_WITH_AS(ParameterSpec::from_shapes({{"a", {2}}, {"a", {3}}}), doctest::Contains("duplicate"), ValueError);
  CHECK_THROWS_WITH_AS(ParameterSpec({{"a", {2}, 2, 0, 2}, {"b", {3}, 3, 3, 6}}), doctest::Contains("Non-contiguous"),
                       ValueError);
  CHECK_THROWS_AS(spec.entry("nope"), KeyError);
  ParameterSpec empty_spec = ParameterSpec::from_shapes({});
  CHECK(empty_spec.total_numel() == 0);
  CHECK(empty_spec.unflatten(zeros({0})).size() == 0);
  CHECK(empty_spec.flatten(std::map<std::string, Tensor>{}).numel() == 0);
}

TEST_CASE("mapping: orthogonal mapper matrices are exact, expanded and a pure function of the seed") {
  for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{40, 8}, {37, 8}, {8, 8}, {5, 8}, {16, 8}}) {
    INFO(rows << "x" << cols);
    OrthogonalMatrix w = OrthogonalMatrix::build(7, "g", rows, cols, /*expand=*/true);
    Tensor dense = w.materialize();
    CHECK(dense.sizes() == Shape{rows, cols});
    const double expansion = static_cast<double>(std::max(rows, cols));
    Tensor gram = rows >= cols ? matmul(dense.t(), dense) : matmul(dense, dense.t());
    const int64_t k = std::min(rows, cols);
    std::vector<float> eye(static_cast<size_t>(k * k), 0.0f);
    for (int64_t i = 0; i < k; ++i) eye[static_cast<size_t>(i * k + i)] = static_cast<float>(expansion);
    check_close(gram, eye, 2e-5);
    CHECK(sum(mul(dense, dense)).item() == doctest::Approx(rows * cols).epsilon(1e-4));
    // Structured application equals the explicit matrix.
    Tensor z = randn({cols});
    check_close(w.apply(z), matmul(dense, z).to_vector<float>(), 1e-4);
    Tensor u = randn({rows});
    check_close(w.apply_transpose(u), matmul(dense.t(), u).to_vector<float>(), 1e-4);
    check_close(w.column_mean(), mean(dense, {0}).to_vector<float>(), 1e-4);
  }
  // Same (seed, key, shape) -> same bits, whatever the thread count; other keys differ.
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  Tensor one = OrthogonalMatrix::build(3, "layer", 300, 16, true).materialize();
  omp_set_num_threads(std::max(2, threads));
  Tensor two = OrthogonalMatrix::build(3, "layer", 300, 16, true).materialize();
  omp_set_num_threads(threads);
  CHECK(bitwise_equal(one, two));
  CHECK(!bitwise_equal(one, OrthogonalMatrix::build(3, "other", 300, 16, true).materialize()));
  CHECK(!bitwise_equal(one, OrthogonalMatrix::build(4, "layer", 300, 16, true).materialize()));
}

TEST_CASE("mapping: mappers, modulation examples and errors") {
  MLPMapper m(4, 6, 0, "m");
  Tensor z = randn({4}).requires_grad_(true);
  Tensor y = m.forward(z);
  CHECK(y.sizes() == Shape{6});
  sum(y).backward();
  CHECK(z.grad().defined());
  MLPMapper hidden(3, 13, 0, "h", {7});
  CHECK(hidden.layer_count() == 2);
  CHECK(sum(square(hidden.layer(0).materialize())).item() == doctest::Approx(3.0).epsilon(1e-4));
  CHECK(sum(square(hidden.layer(1).materialize())).item() == doctest::Approx(91.0).epsilon(1e-4));
  Tensor zz = randn({3});
  CHECK(bitwise_equal(hidden.forward(zz), hidden.forward(zz)));
  ResidualMLPMapper res(3, 7, 0, "r", 5, 3);
  CHECK(res.forward(randn({3})).sizes() == Shape{7});
  // The hidden activation (the reference's activation=gelu): GELU unless another is given.
  const Modulation additive = Modulation::additive();
  auto relu_fn = [](const Tensor& x) { return relu(x); };
  auto gelu_fn = [](const Tensor& x) { return gelu(x); };
  MLPMapper with_relu(3, 13, 0, "h", {7}, additive, nullptr, relu_fn);
  CHECK(bitwise_equal(with_relu.forward(zz),
                      additive.apply(with_relu.layer(1), relu(additive.apply(with_relu.layer(0), zz)))));
  CHECK(!bitwise_equal(with_relu.forward(zz), hidden.forward(zz)));
  CHECK(bitwise_equal(MLPMapper(3, 13, 0, "h", {7}, additive, nullptr, gelu_fn).forward(zz), hidden.forward(zz)));
  const Tensor z3 = randn({3});
  CHECK(bitwise_equal(ResidualMLPMapper(3, 7, 0, "r", 5, 3, additive, gelu_fn).forward(z3), res.forward(z3)));
  CHECK(!bitwise_equal(ResidualMLPMapper(3, 7, 0, "r", 5, 3, additive, relu_fn).forward(z3), res.forward(z3)));
  CHECK_THROWS_WITH_AS(m.forward(randn({3})), doctest::Contains("4 values"), ValueError);
  CHECK_THROWS_AS(MLPMapper(0, 3, 0, "x"), ValueError);
  CHECK_THROWS_WITH_AS(MLPMapper(3, 4, 0, "x", {}, Modulation::low_rank(1)), doctest::Contains("Low-rank"), ValueError);

  // Additive: W = ones(2,3), z = [1,2,3], alpha = 0.5 -> rows [1.5, 2, 2.5]; d(sum W' z)... input untouched.
  Tensor w = ones({2, 3});
  Tensor v = tensor({1, 2, 3}).requires_grad_(true);
  Tensor mod = Modulation::additive(0.5).modulate(w, v);
  check_close(mod, {1.5, 2, 2.5, 1.5, 2, 2.5});
  check_close(w, {1, 1, 1, 1, 1, 1});
  sum(mod).backward();
  check_close(v.grad(), {1, 1, 1});
  // Affine: v = 0 returns W exactly.
  check_close(Modulation::affine().modulate(w, zeros({3})), {1, 1, 1, 1, 1, 1});
  // Low rank: W = 0 (2x3), rank 1, v = [2,3,1,2,4] -> A = [2,3]^T, B = [1,2,4] -> [[2,4,8],[3,6,12]]
  Modulation lr = Modulation::low_rank(1);
  CHECK(lr.latent_dim_for(2, 3) == 5);
  check_close(lr.modulate(zeros({2, 3}), tensor({2, 3, 1, 2, 4})), {2, 4, 8, 3, 6, 12});
  CHECK_THROWS_WITH_AS(Modulation::additive().modulate(w, zeros({4})), doctest::Contains("input width"), ValueError);
  CHECK_THROWS_WITH_AS(Modulation::additive(-1), doctest::Contains("alpha must be non-negative"), ValueError);
  // The structured additive mapper equals the explicit W' z.
  MLPMapper single(5, 9, 1, "s", {}, Modulation::additive(0.3));
  Tensor z5 = randn({5});
  Tensor explicit_out = matmul(Modulation::additive(0.3).modulate(single.layer(0).materialize(), z5), z5);
  check_close(single.forward(z5), explicit_out.to_vector<float>(), 1e-4);
}

TEST_CASE("mapping: gradients of mappers and generators (gradcheck and double backward)") {
  MLPMapper m(4, 30, 2, "g", {}, Modulation::additive(0.1));
  Tensor z = mn::testing::random_param({4}, 11, 0.5);
  CHECK(autograd::gradcheck([&](const std::vector<Tensor>& v) { return m.forward(v[0]); }, {z}) == "");
  CHECK(autograd::gradgradcheck([&](const std::vector<Tensor>& v) { return m.forward(v[0]); }, {z}) == "");
  MLPMapper deep(3, 10, 2, "d", {6}, Modulation::affine());
  Tensor z3 = mn::testing::random_param({3}, 12, 0.5);
  CHECK(autograd::gradcheck([&](const std::vector<Tensor>& v) { return deep.forward(v[0]); }, {z3}) == "");
  ResidualMLPMapper res(3, 8, 2, "r", 4, 2);
  CHECK(autograd::gradcheck([&](const std::vector<Tensor>& v) { return res.forward(v[0]); }, {z3}) == "");
  auto net = two_linear();
  for (std::string strategy : {"slvt", "layerwise", "lazy_layerwise"}) {
    INFO(strategy);
    auto gen = make_generator(strategy, ParameterSpec::from_module(*net), 4);
    gen->initialize_parameter_scaling(*net);
    std::vector<Tensor> zs;
    for (auto& [n, t] : gen->named_latents()) zs.push_back(t.detach().clone().requires_grad_(true));
    auto fn = [&](const std::vector<Tensor>& v) {
      LatentOverrides o;
      auto names = gen->group_names();
      for (size_t i = 0; i < v.size(); ++i) o[names[i]] = v[i];
      return gen->parameter_spec().flatten(gen->generate_parameters(o));
    };
    CHECK(autograd::gradcheck(fn, zs) == "");
  }
}

TEST_CASE("mapping: generator strategies, groups, guard and overrides") {
  auto net = two_linear();
  ParameterSpec spec = ParameterSpec::from_module(*net);
  SingleVectorGenerator slvt(spec, 4);
  CHECK(slvt.group_names() == std::vector<std::string>{"all"});
  CHECK(slvt.generate_parameters().names() == spec.names());
  CHECK(slvt.trainable_parameter_count() == 4);

  auto groups = layerwise_groups(spec);
  REQUIRE(groups.size() == 2);
  CHECK(groups[0].first == "0");
  CHECK(groups[0].second == std::vector<std::string>{"0.weight", "0.bias"});
  LayerwiseGenerator lw(spec, 3);
  CHECK(lw.group_names() == std::vector<std::string>{"0", "1"});
  CHECK(lw.trainable_parameter_count() == 6);
  ParameterTree t = lw.generate_parameters();
  Tensor loss = zeros({});
  for (auto& [n, p] : t.items()) loss = add(loss, sum(p));
  loss.backward();
  for (auto& [n, z] : lw.named_latents()) CHECK(z.grad().defined());

  GroupedGenerator grouped(spec, {{"weights", {"0.weight", "1.weight"}}, {"biases", {"0.bias"}}},
                           std::map<std::string, int64_t>{{"weights", 5}, {"biases", 2}});
  CHECK(grouped.generate_parameters().names() == std::vector<std::string>{"0.weight", "1.weight", "0.bias"});
  CHECK(grouped.named_latents()[0].second.sizes() == Shape{5});
  CHECK_THROWS_WITH_AS(GroupedGenerator(spec, {{"a", {"0.weight"}}, {"a", {"0.bias", "1.weight"}}}, 2),
                       doctest::Contains("duplicate"), ValueError);
  CHECK_THROWS_WITH_AS(GroupedGenerator(spec, {{"a", {"0.weight"}}}, 2), doctest::Contains("cover the spec"),
                       ValueError);
  CHECK_THROWS_WITH_AS(GroupedGenerator(spec, {{"a", {"0.weight", "0.bias", "1.weight", "ghost"}}}, 2),
                       doctest::Contains("unexpected=[ghost]"), ValueError);
  CHECK_THROWS_WITH_AS(GroupedGenerator(spec, {}, 2), doctest::Contains("At least one"), ValueError);

  // Guard: Linear(10,10) -> N = 110, L = 10 -> 1,100 elements > 100
  ParameterSpec big = ParameterSpec::from_module(nn::Linear(10, 10));
  GeneratorOptions small_limit;
  small_limit.max_projection_elements = 100;
  CHECK_THROWS_WITH_AS(SingleVectorGenerator(big, 10, small_limit), doctest::Contains("layerwise/grouped"), MemoryError);
  CHECK_THROWS_WITH_AS(SingleVectorGenerator(big, 10, small_limit), doctest::Contains("1,100"), MemoryError);
  // As in the reference, only slvt is guarded: layerwise is what the message recommends.
  CHECK_NOTHROW(LayerwiseGenerator(big, 10, small_limit));
  small_limit.allow_large = true;
  CHECK_NOTHROW(SingleVectorGenerator(big, 10, small_limit));
  // The guard counts what the family stores, not L x N: Linear(100, 100) (N = 10,100) at L = 20 is 202,000
  // elements as a dense matrix, but the block family stores 20 x 20 + 504 x 20 signs + a 40 x 20 tail =
  // 10,880 and srht nothing; only dense is refused.
  ParameterSpec wide = ParameterSpec::from_module(nn::Linear(100, 100));
  GeneratorOptions limit;
  limit.max_projection_elements = 100'000;
  CHECK(stored_matrix_elements(MapperFamily::Block, 10'100, 20) == 10'880);
  CHECK(stored_matrix_elements(MapperFamily::Srht, 10'100, 20) == 0);
  CHECK(stored_matrix_elements(MapperFamily::Dense, 10'100, 20) == 202'000);
  CHECK_NOTHROW(SingleVectorGenerator(wide, 20, limit));
  limit.mapper = "srht";
  CHECK_NOTHROW(SingleVectorGenerator(wide, 20, limit));
  limit.mapper = "dense";
  CHECK_THROWS_WITH_AS(SingleVectorGenerator(wide, 20, limit), doctest::Contains("'dense' family"), MemoryError);
  // A custom mapper stores what it likes: the reference's L x N count applies.
  limit.mapper = "block";
  limit.mapper_factory = default_mapper_factory();
  CHECK_THROWS_WITH_AS(SingleVectorGenerator(wide, 20, limit), doctest::Contains("202,000"), MemoryError);
  // L * N overflowing int64 used to wrap negative and pass the guard; a latent of 2^62 floats wrapped to a
  // 0-byte tensor (a bare std::bad_alloc from Eigen followed). Both are clear errors naming the size now.
  CHECK_THROWS_WITH_AS(SingleVectorGenerator(big, 84914745327985664, GeneratorOptions{}),
                       doctest::Contains("latent_dim 84914745327985664"), ValueError);
  CHECK_THROWS_WITH_AS(SingleVectorGenerator(big, int64_t{1} << 62, small_limit), doctest::Contains("int64"),
                       ValueError);
  CHECK_THROWS_WITH_AS(LayerwiseGenerator(big, int64_t{1} << 62), doctest::Contains("4611686018427387904"), ValueError);
  CHECK_THROWS_WITH_AS(Modulation::low_rank(int64_t{1} << 62).latent_dim_for(2, 3), doctest::Contains("int64"),
                       ValueError);

  // Overrides: unknown names are refused (the reference silently ignores typos).
  CHECK_THROWS_WITH_AS(lw.generate_parameters({{"typo", zeros({3})}}), doctest::Contains("unknown group 'typo'"),
                       KeyError);
  CHECK_THROWS_AS(lw.generate_parameters({{"0", zeros({4})}}), ValueError);
  ParameterTree shifted = lw.generate_parameters({{"0", zeros({3})}});
  // z = 0 -> theta = 0 for group "0"; group "1" uses its own latent.
  check_close(shifted.at("0.weight"), std::vector<float>(6, 0.0f));
  CHECK(bitwise_equal(shifted.at("1.weight"), t.at("1.weight")));
  CHECK_THROWS_WITH_AS(make_generator("fancy", spec, 4), doctest::Contains("Unknown strategy 'fancy'"), ValueError);
}

TEST_CASE("mapping: lazy_layerwise equals layerwise bit for bit, scaling included") {
  manual_seed(3);
  auto net = std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
      std::make_shared<nn::Conv2d>(1, 4, 3), std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(4 * 6 * 6, 5)});
  ParameterSpec spec = ParameterSpec::from_module(*net);
  GeneratorOptions o;
  o.seed = 42;
  LayerwiseGenerator eager(spec, 16, o);
  LazyLayerwiseGenerator lazy(spec, 16, o);
  eager.initialize_parameter_scaling(*net);
  lazy.initialize_parameter_scaling(*net);
  ParameterTree a = eager.generate_parameters(), b = lazy.generate_parameters();
  REQUIRE(a.names() == b.names());
  for (auto& [n, t] : a.items()) {
    INFO(n);
    CHECK(bitwise_equal(t, b.at(n)));
  }
  // One std convention for every strategy (the reference mixes biased and unbiased).
  SingleVectorGenerator slvt(spec, 16, o);
  slvt.initialize_parameter_scaling(*net);
  CHECK(slvt.per_entry_scales() == eager.per_entry_scales());
  // Scales are population std; the generated tensors start near the target's own spread.
  std::vector<float> scales = eager.per_entry_scales();
  const Tensor conv_weight = net->named_parameters()[0].second;
  CHECK(scales[0] == doctest::Approx(std_dev(conv_weight.detach(), {}, 0.0).item()).epsilon(1e-6));
  Tensor generated = a.at("0.weight");
  CHECK(std_dev(generated.detach(), {}, 0.0).item() == doctest::Approx(scales[0]).epsilon(0.5));
}

TEST_CASE("mapping: per-group latent lengths for layer-wise generators, and a budget shared by water-filling") {
  // CNN2's layer groups: 160, 4,640, 102,528 and 1,290 values. An equal share of 2,688 would give the first
  // 672 latents for 160 values; capped, it keeps 160 and the rest share 2,528 (842 to the smallest, the
  // larger two absorb the rounding).
  const ParameterSpec cnn2 = ParameterSpec::from_shapes({{"0.weight", {16, 1, 3, 3}}, {"0.bias", {16}},
                                                         {"3.weight", {32, 16, 3, 3}}, {"3.bias", {32}},
                                                         {"7.weight", {128, 800}}, {"7.bias", {128}},
                                                         {"9.weight", {10, 128}}, {"9.bias", {10}}});
  const auto groups = layerwise_groups(cnn2);
  const std::map<std::string, int64_t> shared = capped_latent_dims(cnn2, groups, 2688);
  CHECK(shared == std::map<std::string, int64_t>{{"0", 160}, {"3", 843}, {"7", 843}, {"9", 842}});
  // Without a cap in play the shares are equal up to rounding; every value goes somewhere.
  CHECK(capped_latent_dims(cnn2, groups, 403) == std::map<std::string, int64_t>{{"0", 100}, {"3", 101}, {"7", 101}, {"9", 101}});
  CHECK(capped_latent_dims(cnn2, groups, 4) == std::map<std::string, int64_t>{{"0", 1}, {"3", 1}, {"7", 1}, {"9", 1}});
  // Everything: each group its whole count.
  CHECK(capped_latent_dims(cnn2, groups, 108'618) ==
        std::map<std::string, int64_t>{{"0", 160}, {"3", 4'640}, {"7", 102'528}, {"9", 1'290}});
  CHECK_THROWS_WITH_AS(capped_latent_dims(cnn2, groups, 3), doctest::Contains("at least one value per group"),
                       ValueError);
  CHECK_THROWS_WITH_AS(capped_latent_dims(cnn2, groups, 108'619), doctest::Contains("at most their 108618"),
                       ValueError);

  // The lengths reach the generator: named groups get theirs, the others latent_dim; a generator with
  // all four equal to the default is the plain layer-wise one, bit for bit.
  auto net = two_linear();  // groups "0" (Linear(3, 2): 8 values) and "1" (Linear(2, 1): 3)
  const ParameterSpec spec = ParameterSpec::from_module(*net);
  GeneratorOptions o;
  o.seed = 5;
  LayerwiseGenerator plain(spec, 3, o);
  LayerwiseGenerator same(spec, 3, o, {{"1", 3}});
  LayerwiseGenerator mixed(spec, 3, o, {{"0", 6}});
  LazyLayerwiseGenerator lazy(spec, 3, o, {{"0", 6}});
  CHECK(mixed.named_latents()[0].second.sizes() == Shape{6});
  CHECK(mixed.named_latents()[1].second.sizes() == Shape{3});
  CHECK(mixed.trainable_parameter_count() == 9);
  CHECK(mixed.strategy() == "layerwise");
  const ParameterTree a = plain.generate_parameters(), b = same.generate_parameters(), m = mixed.generate_parameters(),
                      l = lazy.generate_parameters();
  for (const auto& [name, t] : a.items()) CHECK(bitwise_equal(t, b.at(name)));
  // Group "1" keeps its latent and mapper (a function of seed and group name): the same values.
  CHECK(bitwise_equal(m.at("1.weight"), a.at("1.weight")));
  for (const auto& [name, t] : m.items()) CHECK(bitwise_equal(t, l.at(name)));
  auto made = make_generator("layerwise", spec, 3, o, {}, {{"0", 6}});
  CHECK(made->trainable_parameter_count() == 9);
  // A name that is no group is refused with the groups (a typo would otherwise be ignored).
  CHECK_THROWS_WITH_AS(LayerwiseGenerator(spec, 3, o, {{"2", 4}}),
                       doctest::Contains("'2', which is not a parameter group; the groups are [0, 1]"), KeyError);
  CHECK_THROWS_WITH_AS(LayerwiseGenerator(spec, 3, o, {{"0", 0}}), doctest::Contains("for group '0'"), ValueError);
  CHECK_THROWS_WITH_AS(make_generator("slvt", spec, 3, o, {}, {{"all", 4}}),
                       doctest::Contains("strategy 'slvt' takes one latent_dim"), ValueError);
  // Through MappingModel (test_checkpoint: a checkpoint refuses a model whose lengths differ).
  MappingOptions mo;
  mo.latent_dim = 3;
  mo.group_latent_dims = {{"0", 6}};
  MappingModel model(two_linear(), mo);
  CHECK(model.trainable_parameter_count() == 9);
  mo.strategy = "finetuning";
  CHECK_THROWS_WITH_AS(MappingModel(two_linear(), mo), doctest::Contains("'finetuning' takes one latent_dim"),
                       ValueError);
}

TEST_CASE("mapping: scaling fallbacks for biases, root-level bias and one-element tensors") {
  nn::Linear lin(3, 1);
  {
    autograd::NoGradGuard no_grad;
    Tensor b = lin.param("bias").detach();
    b.fill_(0.0);
  }
  ParameterSpec spec = ParameterSpec::from_module(lin);
  std::vector<float> s = parameter_scales(spec, lin);
  // weight: its own std; bias (root-level name "bias", one element) -> 1.
  CHECK(s[0] == doctest::Approx(std_dev(lin.param("weight").detach(), {}, 0.0).item()));
  CHECK(s[1] == 1.0f);
  nn::Linear wide(3, 4);
  {
    autograd::NoGradGuard no_grad;
    Tensor b = wide.param("bias").detach();
    b.fill_(0.0);
  }
  std::vector<float> s2 = parameter_scales(ParameterSpec::from_module(wide), wide);
  CHECK(s2[1] == doctest::Approx(s2[0]));  // zero bias borrows the weight's std
}

TEST_CASE("mapping: MappingModel counts, gradients, untouched target, strategies and errors") {
  manual_seed(5);
  auto lin = std::make_shared<nn::Linear>(10, 5);
  MappingOptions o;
  o.latent_dim = 4;
  o.strategy = "layerwise";
  MappingModel model(lin, o);
  CHECK(model.target_parameter_count() == 55);
  CHECK(model.trainable_parameter_count() == 4);
  CHECK(model.compression_ratio() == doctest::Approx(13.75));
  const std::vector<float> before = lin->param("weight").to_vector<float>();
  Tensor x = randn({3, 10});
  ForwardResult r = model.run(x);
  CHECK(r.predictions.sizes() == Shape{3, 5});
  CHECK(r.generated_parameters.names() == std::vector<std::string>{"weight", "bias"});
  sum(r.predictions).backward();
  for (auto& [n, z] : model.named_latents()) CHECK(z.grad().defined());
  CHECK(!lin->param("weight").grad().defined());
  CHECK(lin->param("weight").to_vector<float>() == before);
  // Overrides change the predictions but latent_vectors stay the model's own.
  ForwardResult shifted = model.run(x, {{"<root>", zeros({4})}});
  check_close(shifted.predictions, std::vector<float>(15, 0.0f));
  CHECK(shifted.latent_vectors[0].second.same(model.named_latents()[0].second));
  // to() the current device keeps the latents: optimizers (and DDP hooks, compiled graphs) hold them
  const Tensor z0 = model.named_latents()[0].second;
  model.to(kCPU);
  CHECK(model.named_latents()[0].second.same(z0));
  o.latent_dim = 0;
  CHECK_THROWS_WITH_AS(MappingModel(lin, o), doctest::Contains("positive"), ValueError);
  o.latent_dim = 4;
  o.strategy = "nope";
  CHECK_THROWS_WITH_AS(MappingModel(lin, o), doctest::Contains("Unknown strategy"), ValueError);
  for (std::string s : {"slvt", "lazy_layerwise"}) {
    o.strategy = s;
    MappingModel m(lin, o);
    CHECK(m.run(x).predictions.sizes() == Shape{3, 5});
  }
  o.strategy = "grouped";
  o.groups = {{"w", {"weight"}}, {"b", {"bias"}}};
  o.group_latent_dims = {{"w", 6}};
  MappingModel grouped(lin, o);
  CHECK(grouped.trainable_parameter_count() == 10);
}

namespace {

// Sequential(Sequential(Linear 4->6, BatchNorm1d), ReLU, Linear 6->3): layerwise groups "0.0", "0.1", "2".
std::shared_ptr<nn::Sequential> nested_target() {
  manual_seed(8);
  auto inner = std::make_shared<nn::Sequential>(
      std::vector<nn::ModulePtr>{std::make_shared<nn::Linear>(4, 6), std::make_shared<nn::BatchNorm1d>(6)});
  return std::make_shared<nn::Sequential>(
      std::vector<nn::ModulePtr>{inner, std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(6, 3)});
}

MappingOptions nested_options() {
  MappingOptions o;
  o.latent_dim = 5;
  o.seed = 2;
  o.write_back_buffers = true;
  return o;
}

// A larger module around a MappingModel: the mapped network, then a trainable head.
class MappedWithHead : public nn::Module {
 public:
  MappedWithHead() : nn::Module("MappedWithHead") {
    mapped_ = register_module("mapped", std::make_shared<MappingModel>(nested_target(), nested_options()));
    manual_seed(9);
    head_ = register_module("head", std::make_shared<nn::Linear>(3, 2));
  }
  Tensor forward(const Tensor& x) override { return (*head_)(relu((*mapped_)(x))); }
  MappingModel& mapped() { return *mapped_; }

 private:
  std::shared_ptr<MappingModel> mapped_;
  std::shared_ptr<nn::Linear> head_;
};

std::vector<std::string> names_of(const nn::NamedTensors& tensors) {
  std::vector<std::string> out;
  for (const auto& [name, t] : tensors) out.push_back(name);
  return out;
}

nn::StateDict cloned(const nn::StateDict& state) {
  nn::StateDict out;
  for (const auto& [name, t] : state) out[name] = t.clone();
  return out;
}

}  // namespace

TEST_CASE("mapping: MappingModel is an nn::Module: latents as parameters, carried buffers, state_dict, modes") {
  // {} means the options (the generator constructor is a template a braced list cannot match).
  MappingModel defaults(nested_target(), {});
  CHECK(defaults.strategy() == "layerwise");
  CHECK(defaults.options().latent_dim == 256);

  auto target = nested_target();
  MappingModel model(target, nested_options());
  nn::Module& as_module = model;
  CHECK(as_module.type_name() == "MappingModel");
  // Parameters: the generator's latents themselves, named after their groups (dots kept), in group order.
  const auto latents = model.named_latents();
  const nn::NamedTensors params = as_module.named_parameters();
  CHECK(names_of(params) == std::vector<std::string>{"latents.0.0", "latents.0.1", "latents.2"});
  REQUIRE(params.size() == latents.size());
  for (size_t i = 0; i < params.size(); ++i) CHECK(params[i].second.same(latents[i].second));
  CHECK(as_module.parameter_count() == model.trainable_parameter_count());
  // Buffers: the carried copies (not the target's own tensors), under "buffers.".
  const nn::NamedTensors buffers = as_module.named_buffers();
  std::vector<std::string> expected;
  for (const auto& [name, b] : target->named_buffers()) expected.push_back("buffers." + name);
  std::sort(expected.begin(), expected.end());
  CHECK(names_of(buffers) == expected);
  for (const auto& [name, b] : buffers) {
    CHECK(b.same(model.buffers().at(name.substr(8))));
    for (const auto& [target_name, own] : target->named_buffers()) CHECK_FALSE(b.same(own));
  }

  // forward and operator() are run(x).predictions; eval() reaches the target.
  Generator gen(4);
  const Tensor x = randn({5, 4}, {}, &gen);
  model.eval();
  CHECK_FALSE(model.is_training());
  for (const auto& [name, m] : target->named_modules()) CHECK_FALSE(m->is_training());
  const std::vector<float> eval_out = as_module(x).to_vector<float>();
  CHECK(eval_out == model.run(x).predictions.to_vector<float>());
  as_module.train();
  for (const auto& [name, m] : target->named_modules()) CHECK(m->is_training());

  // zero_grad through nn::Module& clears the latents' gradients.
  sum(as_module.forward(x)).backward();  // training mode: the BatchNorm statistics move
  for (const auto& [name, z] : latents) CHECK(z.grad().defined());
  as_module.zero_grad();
  for (const auto& [name, z] : latents) CHECK_FALSE(z.grad().defined());
  // to() the current device keeps every tensor.
  as_module.to(kCPU);
  for (size_t i = 0; i < params.size(); ++i) CHECK(as_module.named_parameters()[i].second.same(latents[i].second));

  // state_dict round-trips in place: the generator keeps its tensors, the values come back.
  const nn::StateDict saved = cloned(model.state_dict());
  CHECK(saved.size() == params.size() + buffers.size());
  model.eval();
  const std::vector<float> saved_out = model.forward(x).to_vector<float>();
  model.train();
  {
    autograd::NoGradGuard no_grad;
    for (const auto& [name, z] : latents) z.detach().copy_(add(z.detach(), 1.0));
  }
  sum(model.forward(x)).backward();  // moves the carried statistics again
  model.load_state_dict(saved);
  for (size_t i = 0; i < latents.size(); ++i) {
    CHECK(model.named_latents()[i].second.same(latents[i].second));
    CHECK(latents[i].second.to_vector<float>() == saved.at(params[i].first).to_vector<float>());
  }
  for (const auto& [name, b] : buffers) {
    CHECK(b.same(model.buffers().at(name.substr(8))));
    CHECK(b.to(DType::f32).to_vector<float>() == saved.at(name).to(DType::f32).to_vector<float>());
  }
  model.eval();
  CHECK(model.forward(x).to_vector<float>() == saved_out);
  // strict: a missing latent is named.
  nn::StateDict partial = saved;
  partial.erase("latents.2");
  CHECK_THROWS_WITH_AS(model.load_state_dict(partial), doctest::Contains("missing=[latents.2]"), ValueError);
  // set_buffers takes the target's buffer names only.
  CHECK_THROWS_WITH_AS(model.set_buffers({{"nope", zeros({1})}}), doctest::Contains("expected the target's buffers"),
                       KeyError);
}

TEST_CASE("mapping: a MappingModel nested in a module trains with a plain optimizer, saves, loads and compiles") {
  namespace F = mn::nn::functional;
  auto net = std::make_shared<MappedWithHead>();
  const auto latents = net->mapped().named_latents();
  // The parent's parameters: the nested latents (not the frozen target's tensors) and the head.
  CHECK(names_of(net->named_parameters()) ==
        std::vector<std::string>{"mapped.latents.0.0", "mapped.latents.0.1", "mapped.latents.2", "head.weight",
                                 "head.bias"});
  for (size_t i = 0; i < latents.size(); ++i) CHECK(net->parameters()[i].same(latents[i].second));

  Generator gen(12);
  const Tensor x = randn({16, 4}, {}, &gen);
  const Tensor y = randn({16, 2}, {}, &gen);
  const std::vector<float> latents_before = latents[0].second.to_vector<float>();
  nn::optim::Adam opt(net->parameters(), nn::optim::AdamOptions{.lr = 1e-2});
  double first = 0, last = 0;
  for (int step = 0; step < 40; ++step) {
    net->zero_grad();
    for (const auto& [name, z] : latents) CHECK_FALSE(z.grad().defined());
    Tensor loss = F::mse_loss(net->forward(x), y);
    loss.backward();
    for (const auto& [name, z] : latents) {
      REQUIRE(z.grad().defined());
      CHECK(max(abs(z.grad())).item() > 0.0);
    }
    opt.step();
    (step == 0 ? first : last) = loss.item();
  }
  CHECK(last < 0.8 * first);
  CHECK(latents[0].second.to_vector<float>() != latents_before);

  // The parent's state_dict holds the latents and carried buffers; a fresh copy loads it and agrees.
  net->eval();
  CHECK_FALSE(net->mapped().target().is_training());
  const Tensor want = net->forward(x);
  const nn::StateDict state = cloned(net->state_dict());
  CHECK(state.count("mapped.latents.0.0") == 1);
  CHECK(state.count("mapped.buffers.0.1.running_mean") == 1);
  auto fresh = std::make_shared<MappedWithHead>();
  fresh->load_state_dict(state);
  fresh->eval();
  check_close(fresh->forward(x), want.to_vector<float>(), 0.0);

  // nn::compile in eval mode: the first call captures, the second replays, both as the eager forward.
  autograd::NoGradGuard no_grad;
  nn::CompiledModule compiled = nn::compile(*net);
  check_close(compiled(x), want.to_vector<float>(), 1e-6);
  check_close(compiled(x), want.to_vector<float>(), 1e-6);
  CHECK(compiled.function().stats().captures == 1);
  CHECK(compiled.function().stats().replays == 1);
  // Changing a mapping state the forward reads (the target's mode) captures again.
  net->mapped().target().train();
  compiled(x);
  CHECK(compiled.function().stats().captures == 2);
}

TEST_CASE("mapping: conv and LSTM targets route gradients to every latent; tied parameters refused") {
  manual_seed(6);
  auto cnn = std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
      std::make_shared<nn::Conv2d>(1, 2, 3), std::make_shared<nn::ReLU>(), std::make_shared<nn::Flatten>(),
      std::make_shared<nn::Linear>(2 * 4 * 4, 3)});
  MappingOptions o;
  o.latent_dim = 8;
  MappingModel model(cnn, o);
  sum(model.run(randn({2, 1, 6, 6})).predictions).backward();
  for (auto& [n, z] : model.named_latents()) CHECK(z.grad().defined());
  auto lstm = std::make_shared<nn::LSTM>(4, 4, 1, true, true);
  MappingModel lm(lstm, o);
  ForwardResult r = lm.run_with([&](nn::Module& m) {
    auto out = static_cast<nn::LSTM&>(m).forward_with_state(randn({2, 3, 4}));
    CHECK(out.h_n.sizes() == Shape{1, 2, 4});
    return out.output;
  });
  sum(r.predictions).backward();
  for (auto& [n, z] : lm.named_latents()) CHECK(z.grad().defined());
  // A tied model: the same Linear registered twice.
  auto shared = std::make_shared<nn::Linear>(2, 2);
  auto tied = std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{shared, shared});
  CHECK_THROWS_WITH_AS(MappingModel(tied, o), doctest::Contains("0.weight = 1.weight"), ValueError);
}

namespace {
// The libtorch idiom this library cannot follow: the weight kept in a member and used directly, so a
// functional call (which overrides param()) never reaches it.
class MemberWeightLinear : public nn::Module {
 public:
  MemberWeightLinear() : nn::Module("MemberWeightLinear") {
    weight_ = register_parameter("weight", randn({2, 3}));
    register_parameter("bias", zeros({2}));
  }
  Tensor forward(const Tensor& x) override { return nn::functional::linear(x, weight_, param("bias")); }

 private:
  Tensor weight_;
};
}  // namespace

TEST_CASE("mapping: a target that computes with a stored parameter member is refused at its first forward") {
  manual_seed(8);
  auto net = std::make_shared<nn::Sequential>(
      std::vector<nn::ModulePtr>{std::make_shared<MemberWeightLinear>(), std::make_shared<nn::ReLU>()});
  const Tensor x = randn({4, 3});
  for (bool streamed : {false, true}) {
    INFO("stream_layers " << streamed);
    MappingOptions o;
    o.latent_dim = 4;
    o.stream_layers = streamed;
    MappingModel model(net, o);
    // Every forward until one passes checks again: a caught error does not switch the check off.
    for (int attempt = 0; attempt < 2; ++attempt) {
      const std::string message = mn::testing::error_message([&] { model.run(x); });
      CHECK(mn::testing::contains(message, "[0.weight]"));
      CHECK(mn::testing::contains(message, "param(\"name\")"));
      CHECK(mn::testing::contains(message, "allow_unused_parameters"));
      CHECK_THROWS_AS(model.run(x), ValueError);
    }
    // Declared unused: the forward runs (on the member) and the bias still trains the latent.
    o.allow_unused_parameters = true;
    MappingModel allowed(net, o);
    sum(allowed.run(x).predictions).backward();
    for (auto& [n, z] : allowed.named_latents()) CHECK(z.grad().defined());
  }
  // run_with runs the same check.
  MappingOptions o;
  o.latent_dim = 4;
  MappingModel model(net, o);
  CHECK_THROWS_WITH_AS(model.run_with([&](nn::Module& m) { return m.forward(x); }),
                       doctest::Contains("[0.weight]"), ValueError);
}

TEST_CASE("mapping: stream_layers generates layer by layer: same results, one layer's parameters in memory") {
  namespace F = mn::nn::functional;
  Generator g(31);
  const Tensor x = randn({5, 1, 8, 8}, {}, &g);
  const Tensor y = from_vector(std::vector<int64_t>{0, 2, 1, 1, 0});
  auto cnn = [] {
    manual_seed(3);
    return std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
        std::make_shared<nn::Conv2d>(1, 4, 3), std::make_shared<nn::BatchNorm2d>(4), std::make_shared<nn::ReLU>(),
        std::make_shared<nn::MaxPool2d>(2), std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(36, 3)});
  };
  for (std::string strategy : {"layerwise", "lazy_layerwise"}) {
    CAPTURE(strategy);
    // Two training steps (BatchNorm statistics carried) and an evaluation, streamed or not.
    auto run = [&](bool stream) {
      MappingOptions o;
      o.latent_dim = 6;
      o.strategy = strategy;
      o.write_back_buffers = true;
      o.stream_layers = stream;
      MappingModel model(cnn(), o);
      std::vector<float> seen;
      for (int step = 0; step < 2; ++step) {
        model.zero_grad();
        ForwardResult r = model.run(x);
        CHECK(r.streamed == stream);
        CHECK(r.generated_parameters.size() == (stream ? 0u : 6u));  // conv w, b; bn w, b; linear w, b
        F::cross_entropy(r.predictions, y).backward();
        for (const Tensor& z : model.parameters()) {
          const std::vector<float> v = z.grad().to_vector<float>();
          seen.insert(seen.end(), v.begin(), v.end());
        }
      }
      for (const auto& [name, b] : model.buffers())
        for (float v : b.to(DType::f32).to_vector<float>()) seen.push_back(v);
      model.eval();
      const std::vector<float> eval = model.run(x).predictions.to_vector<float>();
      seen.insert(seen.end(), eval.begin(), eval.end());
      // Overrides reach the streamed layers too.
      const std::vector<float> shifted =
          model.run(x, {{"0", zeros({6})}}).predictions.to_vector<float>();
      seen.insert(seen.end(), shifted.begin(), shifted.end());
      return seen;
    };
    CHECK(run(true) == run(false));
  }

  // Groups that span layers cannot stream; neither can a whole-target run_with.
  MappingOptions o;
  o.latent_dim = 6;
  o.strategy = "slvt";
  o.stream_layers = true;
  CHECK_THROWS_WITH_AS(MappingModel(cnn(), o), doctest::Contains("not slvt"), ValueError);
  o.strategy = "layerwise";
  MappingModel streamed(cnn(), o);
  CHECK_THROWS_WITH_AS(streamed.run_with([&](nn::Module& m) { return m.forward(x); }), doctest::Contains("run(input)"),
                       ValueError);
  CHECK_THROWS_AS(streamed.run(x, {{"nope", zeros({6})}}), KeyError);
  // A lone layer has only the root's own parameters: nothing to generate module by module.
  CHECK_THROWS_WITH_AS(MappingModel(std::make_shared<nn::Linear>(3, 2), o), doctest::Contains("nothing to stream"),
                       ValueError);
}

TEST_CASE("mapping: stream_layers keeps one layer's generated parameters alive, not all of them") {
  if (!caching_enabled(kCPU)) return;  // the peak comes from the caching allocator's counters
  namespace F = mn::nn::functional;
  // Six 512x512 layers (1 MiB of weights each) at batch 2: the parameters dominate the memory.
  auto mlp = [] {
    manual_seed(4);
    auto net = std::make_shared<nn::Sequential>();
    for (int i = 0; i < 6; ++i) {
      net->push_back(std::make_shared<nn::Linear>(512, 512));
      net->push_back(std::make_shared<nn::Tanh>());
    }
    net->push_back(std::make_shared<nn::Linear>(512, 10));
    return net;
  };
  Generator g(8);
  const Tensor x = randn({2, 512}, {}, &g);
  const Tensor y = from_vector(std::vector<int64_t>{3, 7});
  auto peak_of_step = [&](bool stream, std::vector<float>& grads) {
    MappingOptions o;
    o.latent_dim = 8;
    o.stream_layers = stream;
    MappingModel model(mlp(), o);
    reset_peak_memory_stats(kCPU);
    const int64_t before = memory_stats(kCPU).allocated_bytes.current;
    F::cross_entropy(model.run(x).predictions, y).backward();
    const int64_t peak = memory_stats(kCPU).allocated_bytes.peak - before;
    for (const Tensor& z : model.parameters()) {
      const std::vector<float> v = z.grad().to_vector<float>();
      grads.insert(grads.end(), v.begin(), v.end());
    }
    return peak;
  };
  std::vector<float> plain_grads, streamed_grads;
  const int64_t plain = peak_of_step(false, plain_grads);
  const int64_t streamed = peak_of_step(true, streamed_grads);
  CHECK(streamed_grads == plain_grads);
  MESSAGE("step peak above the model: plain " << plain << " B, streamed " << streamed << " B");
  const int64_t layer = 512 * 512 * 4;
  CHECK(plain >= 6 * layer);     // every layer's weights (and generation temporaries) at once
  CHECK(streamed <= 4 * layer);  // one layer's: its weights, their gradient, the mapper's temporaries
  CHECK(4 * streamed < plain);   // measured here: 25,300,480 vs 3,190,784 bytes
}
