// Mapping-network losses: task losses, the three regularisers and the composite MappingLoss
// (the reference's "Losses" behaviours plus the port's own: S-independent stability, smoothness
// absent without gradients, exact values on small hand-checkable cases).
#include <cmath>
#include <memory>

#include "mapping/losses.h"
#include "mapping/mapping_model.h"
#include "nn/functional.h"
#include "nn/layers.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::mapping;
using mn::testing::contains;
using mn::testing::error_message;
using mn::testing::param;
using mn::testing::random_param;
using mn::testing::tensor;

namespace {

// predictions [4, 3] requiring grad, class targets, one latent and an unrelated generated tree.
TrainingContext classification_context(uint64_t seed = 1) {
  Generator gen(seed);
  TrainingContext c;
  c.predictions = randn({4, 3}, {}, &gen).requires_grad_(true);
  c.targets = from_vector(std::vector<int64_t>{0, 2, 1, 2}, {4});
  c.latent_vectors["layer0"] = random_param({8}, seed + 1);
  c.generated_parameters = ParameterTree({{"weight", random_param({3, 4}, seed + 2)}});
  return c;
}

// g = W tanh(z): a non-linear generator, so the Jacobian depends on z.
TrainingContext linked_context(uint64_t seed = 3) {
  Tensor z = random_param({4}, seed);
  Generator gen(seed + 10);
  Tensor w = randn({6, 4}, {}, &gen);
  Tensor flat = matmul(w, tanh(z));
  TrainingContext c;
  c.predictions = random_param({2, 2}, seed + 20);
  c.targets = randn({2, 2}, {}, &gen);
  c.latent_vectors["layer0"] = z;
  c.generated_parameters =
      ParameterTree({{"weight", flat.narrow(0, 0, 4).view({2, 2})}, {"bias", flat.narrow(0, 4, 2)}});
  return c;
}

double value(const Tensor& t) { return t.detach().item(); }

}  // namespace

// ---- task losses ----

TEST_CASE("mapping loss: classification gives a scalar cross-entropy, task and accuracy metrics and gradients") {
  TrainingContext c = classification_context();
  ClassificationLoss loss;
  LossOutput out = loss(c);
  CHECK(out.total.dim() == 0);
  CHECK(out.components.count("task") == 1);
  REQUIRE(out.metrics.count("task") == 1);
  REQUIRE(out.metrics.count("accuracy") == 1);
  CHECK(out.metrics["accuracy"] >= 0.0);
  CHECK(out.metrics["accuracy"] <= 1.0);
  CHECK(out.metrics["task"] == doctest::Approx(value(nn::functional::cross_entropy(c.predictions, c.targets))));
  out.total.backward();
  CHECK(c.predictions.grad().defined());

  // Label smoothing changes the value; it must lie in [0, 1].
  CHECK(value(ClassificationLoss(0.1)(c).total) != doctest::Approx(value(ClassificationLoss(0.0)(c).total)));
  CHECK_THROWS_AS(ClassificationLoss(1.5), ValueError);
}

TEST_CASE("mapping loss: classification accuracy counts argmax hits exactly") {
  TrainingContext c;
  c.predictions = tensor({5, 0, 0, /**/ 0, 5, 0, /**/ 0, 0, 5, /**/ 5, 0, 0}, {4, 3});
  c.targets = from_vector(std::vector<int64_t>{0, 1, 0, 0}, {4});
  LossOutput out = ClassificationLoss()(c);
  CHECK(out.metrics["accuracy"] == doctest::Approx(0.75));
  // Integer-valued float labels are read as class indices.
  c.targets = tensor({0, 1, 0, 0});
  CHECK(ClassificationLoss()(c).metrics["accuracy"] == doctest::Approx(0.75));
}

TEST_CASE("mapping loss: regression is the mean squared error, with gradients and a strict shape check") {
  TrainingContext c;
  c.predictions = param({1, 2, 3, 4}, {2, 2});
  c.targets = tensor({1, 0, 3, 0}, {2, 2});
  LossOutput out = RegressionLoss()(c);
  CHECK(out.total.dim() == 0);
  CHECK(value(out.total) == doctest::Approx((4.0 + 16.0) / 4.0));
  CHECK(out.components.count("task") == 1);
  CHECK(out.metrics.at("task") == doctest::Approx(5.0));
  out.total.backward();
  CHECK(c.predictions.grad().defined());

  c.targets = tensor({1, 0, 3, 0}, {4});
  const std::string msg = error_message([&] { RegressionLoss()(c); });
  CHECK(contains(msg, "[2, 2]"));
  CHECK(contains(msg, "[4]"));
}

TEST_CASE("mapping loss: TaskLoss wraps any differentiable function (L1 here)") {
  TrainingContext c;
  c.predictions = random_param({4, 3}, 5);
  c.targets = zeros({4, 3});
  TaskLoss l1([](const Tensor& p, const Tensor& y) { return mean(abs(sub(p, y))); }, "L1");
  LossOutput out = l1(c);
  CHECK(value(out.total) >= 0.0);
  CHECK(out.metrics.count("task") == 1);
  CHECK(l1.name() == "L1");
  out.total.backward();
  CHECK(c.predictions.grad().defined());

  CHECK_THROWS_AS(TaskLoss(nullptr), ValueError);
  TaskLoss not_scalar([](const Tensor& p, const Tensor&) { return p; });
  CHECK_THROWS_AS(not_scalar(c), ValueError);
}

// ---- stability ----

TEST_CASE("mapping loss: stability is positive for differing predictions and zero for identical ones") {
  TrainingContext c;
  c.predictions = tensor({1, 2, 3, 4}, {2, 2});
  c.perturbed_predictions = tensor({1, 3, 3, 2}, {2, 2});
  StabilityLoss loss(0.01);
  LossOutput out = loss(c);
  // mean over the batch of the per-row sum of squares: ((0 + 1) + (0 + 4)) / 2
  CHECK(value(out.total) == doctest::Approx(2.5));
  CHECK(out.components.count("stability") == 1);
  CHECK(out.metrics.at("stability") == doctest::Approx(2.5));

  c.perturbed_predictions = c.predictions;
  CHECK(value(loss(c).total) == doctest::Approx(0.0).epsilon(1e-7));

  // One-dimensional predictions: mean of squares.
  c.predictions = tensor({1, 2});
  c.perturbed_predictions = tensor({2, 2});
  CHECK(value(loss(c).total) == doctest::Approx(0.5));
}

TEST_CASE("mapping loss: stability errors name what is missing or wrong") {
  TrainingContext c = classification_context();
  CHECK(contains(error_message([&] { StabilityLoss()(c); }), "perturbed_predictions"));
  CHECK(contains(error_message([] { StabilityLoss(0.0); }), "positive"));
  CHECK(contains(error_message([] { StabilityLoss(-1.0); }), "positive"));
  CHECK(contains(error_message([] { StabilityLoss(0.01, 0); }), "at least 1"));
  c.perturbed_predictions = zeros({2, 2, 2, 2});
  CHECK_THROWS_AS(StabilityLoss()(c), ValueError);
}

TEST_CASE("mapping loss: stability with stacked samples averages the per-sample losses (scale independent of S)") {
  TrainingContext c;
  c.predictions = tensor({0, 0, 0, 0}, {2, 2});
  Tensor first = tensor({1, 0, 0, 1}, {2, 2});   // per-sample loss (1 + 1) / 2 = 1
  Tensor second = tensor({2, 0, 0, 0}, {2, 2});  // per-sample loss (4 + 0) / 2 = 2
  c.perturbed_predictions = first;
  const double l1 = value(StabilityLoss()(c).total);
  c.perturbed_predictions = second;
  const double l2 = value(StabilityLoss()(c).total);
  c.perturbed_predictions = stack({first, second}, 0);
  CHECK(value(StabilityLoss(0.01, 2)(c).total) == doctest::Approx((l1 + l2) / 2.0));
  // The same sample twice gives that sample's loss, not twice it.
  c.perturbed_predictions = stack({second, second}, 0);
  CHECK(value(StabilityLoss(0.01, 2)(c).total) == doctest::Approx(l2));
}

TEST_CASE("mapping loss: stability gradients flow through both the clean and the perturbed prediction") {
  TrainingContext c;
  Tensor clean = param({1, 2, 3, 4}, {2, 2});
  Tensor perturbed = param({0, 2, 3, 5}, {2, 2});
  c.predictions = clean;
  c.perturbed_predictions = perturbed;
  StabilityLoss()(c).total.backward();
  // d/dclean of mean_rows sum (clean - pert)^2 = (clean - pert) (2 / 2 rows)
  mn::testing::check_close(clean.grad(), {1, 0, 0, -1});
  mn::testing::check_close(perturbed.grad(), {-1, 0, 0, 1});
}

// ---- smoothness ----

TEST_CASE("mapping loss: exact smoothness is non-negative and equals ||A||_F^2 / L for a linear map") {
  TrainingContext nonlinear = linked_context();
  LossOutput out = SmoothnessLoss("exact")(nonlinear);
  CHECK(value(out.total) >= 0.0);
  CHECK(out.components.count("smoothness") == 1);
  CHECK(out.metrics.count("smoothness") == 1);

  // g = A z: J = A, so the value is sum(A^2) / len(z).
  Tensor z = random_param({3}, 7);
  Tensor a = tensor({1, 2, 0, -1, 0.5f, 3, 0, 1, 1, 2, 2, 2}, {4, 3});
  TrainingContext c;
  c.latent_vectors["g"] = z;
  c.generated_parameters = ParameterTree({{"theta", matmul(a, z)}});
  const double frobenius = value(sum(square(a)));
  CHECK(value(SmoothnessLoss("exact")(c).total) == doctest::Approx(frobenius / 3.0));
}

TEST_CASE("mapping loss: the Hutchinson estimate is unbiased for ||J||_F^2 and trains the latents") {
  TrainingContext c = linked_context();
  const double exact = value(SmoothnessLoss("exact")(c).total);
  Generator probes(11);
  c.generator = &probes;
  const double estimate = value(SmoothnessLoss("stochastic", 3000)(c).total);
  CHECK(estimate == doctest::Approx(exact).epsilon(0.05));

  // A fixed probe generator makes the estimate reproducible.
  Generator a(5), b(5);
  c.generator = &a;
  const double first = value(SmoothnessLoss("stochastic", 2)(c).total);
  c.generator = &b;
  CHECK(value(SmoothnessLoss("stochastic", 2)(c).total) == first);

  TrainingContext fresh = linked_context();
  LossOutput out = SmoothnessLoss("stochastic", 2)(fresh);
  CHECK(value(out.total) >= 0.0);
  out.total.backward();
  CHECK(fresh.latent_vectors["layer0"].grad().defined());
}

TEST_CASE("mapping loss: smoothness of the default mapper matches its closed form s * (W + 2 alpha 1 z^T)") {
  manual_seed(21);
  MappingOptions options;
  options.latent_dim = 8;
  options.seed = 3;
  MappingModel model(std::make_shared<nn::Linear>(4, 2), options);
  ForwardResult result = model.run(zeros({1, 4}));
  TrainingContext c = make_training_context(result, zeros({1, 2}));
  const double exact = value(SmoothnessLoss("exact")(c).total);

  // One group ("<root>"): theta = s * (W z + alpha |z|^2 1)  ->  row i of J = s_i (W_i + 2 alpha z).
  const Group& group = model.generator().groups().at(0);
  auto mapper = std::dynamic_pointer_cast<MLPMapper>(group.mapper);
  REQUIRE(mapper != nullptr);
  Tensor w = mapper->layer(0).materialize();
  Tensor rows = add(w, mul(group.latent.detach().unsqueeze(0), 2.0 * options.alpha));
  Tensor scaled = mul(rows, group.scale.unsqueeze(1));
  CHECK(exact == doctest::Approx(value(sum(square(scaled))) / 8.0).epsilon(1e-4));
}

TEST_CASE("mapping loss: smoothness validates its options") {
  const std::string msg = error_message([] { SmoothnessLoss("invalid"); });
  CHECK(contains(msg, "'exact' or 'stochastic'"));
  CHECK(contains(msg, "invalid"));
  CHECK(contains(error_message([] { SmoothnessLoss("stochastic", 0); }), "at least 1"));
  CHECK(SmoothnessLoss().method() == "stochastic");
  CHECK(SmoothnessLoss().num_projections() == 4);
}

TEST_CASE("mapping loss: without gradients smoothness is reported absent, not zero") {
  TrainingContext c = linked_context();
  {
    autograd::NoGradGuard no_grad;
    LossOutput out = SmoothnessLoss("stochastic", 1)(c);
    CHECK_FALSE(out.total.defined());
    CHECK(out.components.count("smoothness") == 0);
    CHECK(out.metrics.count("smoothness") == 0);
    CHECK(out.metrics.at("smoothness_absent") == 1.0);
  }
  // Generated tensors that do not depend on the latents: absent as well.
  TrainingContext detached = classification_context();
  detached.generated_parameters = ParameterTree({{"w", zeros({2, 2})}});
  CHECK_FALSE(SmoothnessLoss()(detached).total.defined());
}

TEST_CASE("mapping loss: MappingLoss leaves an absent smoothness out of its total") {
  TrainingContext c = linked_context();
  MappingLossOptions o;
  o.stability = no_term;
  o.alignment = no_term;
  MappingLoss loss(std::make_shared<RegressionLoss>(), o);
  autograd::NoGradGuard no_grad;
  LossOutput out = loss(c);
  CHECK(out.components.count("smoothness") == 0);
  CHECK(out.metrics.at("smoothness_absent") == 1.0);
  CHECK(value(out.total) == doctest::Approx(out.metrics.at("task")));
}

// ---- alignment ----

TEST_CASE("mapping loss: alignment is a cosine distance in [0, 2] with gradients to the latent") {
  Tensor z = random_param({8}, 31);
  Generator gen(32);
  TrainingContext c = classification_context();
  c.latent_vectors = {{"layer0", z}};
  c.mapper_column_means = {{"layer0", randn({8}, {}, &gen)}};
  LossOutput out = AlignmentLoss()(c);
  CHECK(value(out.total) >= 0.0);
  CHECK(value(out.total) <= 2.0);
  CHECK(out.components.count("alignment") == 1);
  CHECK(out.metrics.count("alignment") == 1);
  out.total.backward();
  CHECK(z.grad().defined());
}

TEST_CASE("mapping loss: alignment values, truncation and zero padding of the column mean") {
  TrainingContext c;
  c.latent_vectors = {{"a", param({1, 0})}};
  c.mapper_column_means = {{"a", tensor({2, 0})}};
  CHECK(value(AlignmentLoss()(c).total) == doctest::Approx(0.0));  // parallel
  c.mapper_column_means = {{"a", tensor({-3, 0})}};
  CHECK(value(AlignmentLoss()(c).total) == doctest::Approx(2.0));  // opposite
  c.mapper_column_means = {{"a", tensor({0, 1, 5})}};               // truncated to (0, 1): orthogonal
  CHECK(value(AlignmentLoss()(c).total) == doctest::Approx(1.0));
  c.latent_vectors = {{"a", param({1, 1, 1})}};
  c.mapper_column_means = {{"a", tensor({1, 1})}};  // padded to (1, 1, 0): cos = 2 / (sqrt3 sqrt2)
  CHECK(value(AlignmentLoss()(c).total) == doctest::Approx(1.0 - 2.0 / std::sqrt(6.0)));
  // Mean over the latents that have a summary; others are ignored.
  c.latent_vectors = {{"a", param({1, 0})}, {"b", param({0, 1})}, {"c", param({1, 1})}};
  c.mapper_column_means = {{"a", tensor({1, 0})}, {"b", tensor({0, -1})}};
  CHECK(value(AlignmentLoss()(c).total) == doctest::Approx(1.0));
  // No matching names: zero.
  c.mapper_column_means = {{"zzz", tensor({1, 0})}};
  CHECK(value(AlignmentLoss()(c).total) == doctest::Approx(0.0));
  // A zero latent stays finite.
  Tensor zero = param({0, 0});
  c.latent_vectors = {{"a", zero}};
  c.mapper_column_means = {{"a", tensor({1, 0})}};
  AlignmentLoss()(c).total.backward();
  CHECK(std::isfinite(zero.grad().to_vector<float>()[0]));
}

TEST_CASE("mapping loss: alignment requires the column means") {
  TrainingContext c = classification_context();
  const std::string msg = error_message([&] { AlignmentLoss()(c); });
  CHECK(contains(msg, "mapper_weights"));
  CHECK(contains(msg, "mapper_column_means"));
}

// ---- MappingLoss ----

namespace {
TrainingContext full_context() {
  Tensor z = random_param({4}, 41);
  Generator gen(42);
  Tensor w = randn({6, 4}, {}, &gen);
  Tensor flat = matmul(w, z);
  TrainingContext c;
  c.predictions = randn({4, 3}, {}, &gen).requires_grad_(true);
  c.targets = randn({4, 3}, {}, &gen);
  c.perturbed_predictions = add(c.predictions, mul(randn({4, 3}, {}, &gen), 0.1));
  c.latent_vectors = {{"layer0", z}};
  c.generated_parameters =
      ParameterTree({{"weight", flat.narrow(0, 0, 4).view({2, 2})}, {"bias", flat.narrow(0, 4, 2)}});
  c.mapper_column_means = {{"layer0", randn({4}, {}, &gen)}};
  return c;
}
}  // namespace

TEST_CASE("mapping loss: MappingLoss sums the task and the weighted regularisers; components stay unweighted") {
  TrainingContext c = full_context();
  Generator probes(1);
  c.generator = &probes;
  MappingLossOptions o;
  o.stability = std::make_shared<StabilityLoss>(0.01);
  o.smoothness = std::make_shared<SmoothnessLoss>("exact");
  o.alignment = std::make_shared<AlignmentLoss>();
  MappingLoss loss(std::make_shared<RegressionLoss>(), o);
  LossOutput out = loss(c);
  for (const char* key : {"task", "stability", "smoothness", "alignment"}) CHECK(out.components.count(key) == 1);
  CHECK(out.total.dim() == 0);
  const double expected = value(out.components["task"]) + 0.1 * value(out.components["stability"]) +
                          0.01 * value(out.components["smoothness"]) + 0.01 * value(out.components["alignment"]);
  CHECK(value(out.total) == doctest::Approx(expected));
  CHECK(out.metrics.at("total") == doctest::Approx(expected));
  CHECK(out.metrics.at("lambda_stability") == doctest::Approx(0.1));
  CHECK(out.metrics.at("lambda_smoothness") == doctest::Approx(0.01));
  CHECK(out.metrics.at("lambda_alignment") == doctest::Approx(0.01));
  // Components are the unweighted terms.
  CHECK(value(out.components["stability"]) == doctest::Approx(value(StabilityLoss()(c).total)));
}

TEST_CASE("mapping loss: MappingLoss term selection - auto, none, custom") {
  auto task = std::make_shared<RegressionLoss>();
  MappingLoss defaults(task);
  REQUIRE(defaults.stability() != nullptr);
  REQUIRE(defaults.smoothness() != nullptr);
  REQUIRE(defaults.alignment() != nullptr);
  CHECK(defaults.stability()->epsilon() == doctest::Approx(0.01));
  CHECK(defaults.stability()->num_samples() == 1);
  CHECK(defaults.smoothness()->method() == "stochastic");
  CHECK(defaults.smoothness()->num_projections() == 1);  // auto uses one projection
  CHECK(defaults.lambda_stability() == doctest::Approx(0.1));
  CHECK(defaults.lambda_smoothness() == doctest::Approx(0.01));
  CHECK(defaults.lambda_alignment() == doctest::Approx(0.01));

  MappingLoss none(task, {.stability = no_term, .smoothness = no_term, .alignment = no_term});
  CHECK(none.stability() == nullptr);
  CHECK(none.smoothness() == nullptr);
  CHECK(none.alignment() == nullptr);
  CHECK(none.describe() == "task");
  TrainingContext c = full_context();
  LossOutput out = none(c);
  CHECK(out.components.size() == 1);
  CHECK(out.components.count("task") == 1);
  CHECK(out.metrics.count("lambda_stability") == 0);
  CHECK(value(out.total) == doctest::Approx(value(RegressionLoss()(c).total)));

  auto custom = std::make_shared<StabilityLoss>(0.05);
  MappingLoss mixed(task, {.stability = custom, .smoothness = no_term});
  CHECK(mixed.stability() == custom);
  CHECK(mixed.smoothness() == nullptr);
  CHECK(mixed.alignment() != nullptr);
  CHECK(mixed.describe() == "task + 0.1*stability + 0.01*alignment");
  CHECK(MappingLoss::task_only(task)->describe() == "task");

  CHECK_THROWS_AS(MappingLoss(nullptr), ValueError);
  CHECK_THROWS_AS(MappingLoss(task, {.lambda_stability = -1.0}), ValueError);
}

TEST_CASE("mapping loss: lambda metrics follow the configured weights") {
  TrainingContext c = full_context();
  MappingLoss loss(std::make_shared<RegressionLoss>(),
                   {.smoothness = no_term, .alignment = no_term, .lambda_stability = 0.5});
  LossOutput out = loss(c);
  CHECK(out.metrics.count("task") == 1);
  CHECK(out.metrics.count("stability") == 1);
  CHECK(out.metrics.at("lambda_stability") == doctest::Approx(0.5));
  CHECK(out.metrics.count("lambda_alignment") == 0);
}

TEST_CASE("mapping loss: trainable coefficients are softplus(rho) and descent shrinks them") {
  auto task = std::make_shared<RegressionLoss>();
  MappingLoss fixed(task);
  CHECK(fixed.coefficient_parameters().empty());
  CHECK_FALSE(fixed.trainable_coefficients());

  MappingLoss trainable(task,
                        {.smoothness = std::make_shared<SmoothnessLoss>("exact"), .trainable_coefficients = true});
  auto named = trainable.named_coefficient_parameters();
  REQUIRE(named.size() == 3);
  CHECK(named[0].first == "raw_lambda_stability");
  CHECK(named[1].first == "raw_lambda_smoothness");
  CHECK(named[2].first == "raw_lambda_alignment");
  CHECK(trainable.lambda_stability() == doctest::Approx(0.1).epsilon(1e-5));
  CHECK(trainable.lambda_smoothness() == doctest::Approx(0.01).epsilon(1e-4));
  CHECK(trainable.lambda_alignment() >= 0.0);
  for (const auto& [name, rho] : named) CHECK(rho.requires_grad());

  // d total / d rho = term * sigmoid(rho) >= 0: a descent step lowers every lambda.
  TrainingContext c = full_context();
  trainable(c).total.backward();
  for (const auto& [name, rho] : named) {
    INFO(name);
    REQUIRE(rho.grad().defined());
    CHECK(rho.grad().item() >= 0.0);
  }
  const double before = trainable.lambda_stability();
  {
    autograd::NoGradGuard no_grad;
    named[0].second.copy_(sub(named[0].second, mul(named[0].second.grad(), 1.0)));
  }
  CHECK(trainable.lambda_stability() < before);

  // Only active terms get a rho.
  MappingLoss partial(task, {.smoothness = no_term, .trainable_coefficients = true});
  CHECK(partial.coefficient_parameters().size() == 2);
}

TEST_CASE("mapping loss: inverse softplus") {
  CHECK(inverse_softplus(std::log1p(std::exp(0.3))) == doctest::Approx(0.3));
  CHECK(inverse_softplus(25.0) == 25.0);
  CHECK(contains(error_message([] { inverse_softplus(0.0); }),
                 "Cannot compute inverse softplus of non-positive value"));
  CHECK(contains(error_message([] { MappingLoss(std::make_shared<RegressionLoss>(),
                                                {.lambda_alignment = 0.0, .trainable_coefficients = true}); }),
                 "Cannot compute inverse softplus of non-positive value"));
}

TEST_CASE("mapping loss: gradients reach predictions (task, stability) and latents (smoothness, alignment)") {
  auto task = std::make_shared<RegressionLoss>();
  SUBCASE("task") {
    TrainingContext c = full_context();
    MappingLoss::task_only(task)->compute(c).total.backward();
    CHECK(c.predictions.grad().defined());
  }
  SUBCASE("stability") {
    TrainingContext c = full_context();
    TrainingContext only;
    only.predictions = random_param({4, 3}, 50);
    only.targets = c.targets;
    only.perturbed_predictions = zeros({4, 3});
    MappingLoss loss(std::make_shared<TaskLoss>([](const Tensor& p, const Tensor&) { return mul(sum(p), 0.0); }),
                     {.smoothness = no_term, .alignment = no_term});
    loss(only).total.backward();
    REQUIRE(only.predictions.grad().defined());
    CHECK(value(sum(abs(only.predictions.grad()))) > 0.0);
  }
  SUBCASE("smoothness") {
    TrainingContext c = linked_context();
    MappingLoss loss(task, {.stability = no_term, .smoothness = std::make_shared<SmoothnessLoss>("stochastic", 1),
                            .alignment = no_term});
    loss(c).total.backward();
    CHECK(c.latent_vectors["layer0"].grad().defined());
  }
  SUBCASE("alignment") {
    TrainingContext c = full_context();
    c.generated_parameters = ParameterTree();
    MappingLoss loss(task, {.stability = no_term, .smoothness = no_term});
    loss(c).total.backward();
    CHECK(c.latent_vectors["layer0"].grad().defined());
  }
}

TEST_CASE("mapping loss: the full default MappingLoss on a real mapping model trains the latents") {
  manual_seed(61);
  MappingOptions options;
  options.latent_dim = 8;
  MappingModel model(std::make_shared<nn::Linear>(4, 2), options);
  Generator gen(62);
  Tensor x = randn({3, 4}, {}, &gen);
  ForwardResult clean = model.run(x);
  TrainingContext c = make_training_context(clean, randn({3, 2}, {}, &gen));
  LatentOverrides nudged;
  for (const auto& [name, z] : clean.latent_vectors) nudged[name] = add(z, mul(randn(z.sizes(), {}, &gen), 0.01));
  c.perturbed_predictions = model.run(x, nudged).predictions;
  c.mapper_column_means = model.modulated_column_means();
  c.generator = &gen;
  LossOutput out = MappingLoss(std::make_shared<RegressionLoss>())(c);
  CHECK(out.components.size() == 4);
  CHECK(std::isfinite(value(out.total)));
  out.total.backward();
  for (const Tensor& z : model.parameters()) {
    REQUIRE(z.grad().defined());
    CHECK(value(sum(abs(z.grad()))) > 0.0);
  }
}
