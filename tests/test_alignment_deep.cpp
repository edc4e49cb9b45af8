// The alignment summary W_m = colmean(W') of multi-layer mappers (the first layer's, see
// Mapper::modulated_column_mean): the closed forms of Modulation::column_mean against the mean of an
// explicitly modulated matrix, their gradients, and the full Mapping Loss (stability, smoothness,
// alignment) training hidden-layer and residual mappers through the MappingTrainer.
#include "autograd/gradcheck.h"
#include "mapping/losses.h"
#include "mapping/mapping_model.h"
#include "mapping/trainer.h"
#include "nn/data/dataloader.h"
#include "nn/layers.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::mapping;

namespace {

std::vector<Modulation> layer_modulations() {
  return {Modulation::none(), Modulation::additive(0.3), Modulation::affine(0.4, 0.2)};
}

// The literal reference: mean over the rows of modulate(W, v) for the explicit W.
Tensor explicit_column_mean(const Modulation& m, const OrthogonalMatrix& w, const Tensor& v) {
  return mean(m.modulate(w.materialize(), v), {0});
}

double max_abs_diff(const Tensor& a, const Tensor& b) { return max(abs(sub(a, b))).item(); }

}  // namespace

TEST_CASE("alignment: Modulation::column_mean equals the row mean of the modulated matrix, every kind") {
  Generator gen(5);
  const Tensor w = randn({7, 4}, {}, &gen);
  const Tensor cm = mean(w, {0});
  const Tensor v = randn({4}, {}, &gen);
  for (const Modulation& m : layer_modulations()) {
    INFO(m.name());
    CHECK(max_abs_diff(m.column_mean(cm, v, 7), mean(m.modulate(w, v), {0})) < 1e-5);
  }
  // Low-rank: v holds A [7, r] then B [r, 4]; the summary has W's input width (4).
  for (int64_t r : {1, 3}) {
    INFO("rank " << r);
    const Modulation lr = Modulation::low_rank(r, 0.7);
    const Tensor u = randn({lr.latent_dim_for(7, 4)}, {}, &gen);
    const Tensor got = lr.column_mean(cm, u, 7);
    CHECK(got.sizes() == Shape{4});
    CHECK(max_abs_diff(got, mean(lr.modulate(w, u), {0})) < 1e-5);
  }
  // A worked value: W = 0 (2x3), rank 1, v = [2,3,1,2,4]: A = [2,3]^T, B = [1,2,4] -> mean(A) B = 2.5 B.
  mn::testing::check_close(Modulation::low_rank(1).column_mean(zeros({3}), mn::testing::tensor({2, 3, 1, 2, 4}), 2),
                           {2.5, 5, 10});
  // Wrong lengths say what was expected.
  CHECK_THROWS_WITH_AS(Modulation::additive().column_mean(cm, zeros({5}), 7), doctest::Contains("input width 4"),
                       ValueError);
  CHECK_THROWS_WITH_AS(Modulation::low_rank(2).column_mean(cm, zeros({5}), 7), doctest::Contains("22 values"),
                       ValueError);
  CHECK_THROWS_WITH_AS(Modulation::additive().column_mean(w, v, 7), doctest::Contains("1D"), ValueError);
}

TEST_CASE("alignment: gradcheck of the closed forms in the latent") {
  Generator gen(6);
  const Tensor cm = randn({5}, {}, &gen);
  for (const Modulation& m : {Modulation::additive(0.3), Modulation::affine(0.4, 0.2)}) {
    INFO(m.name());
    const Tensor v = mn::testing::random_param({5}, 21, 0.5);
    CHECK(autograd::gradcheck([&](const std::vector<Tensor>& x) { return m.column_mean(cm, x[0], 3); }, {v}) == "");
  }
  const Modulation lr = Modulation::low_rank(2, 0.5);
  const Tensor u = mn::testing::random_param({lr.latent_dim_for(3, 5)}, 22, 0.5);
  CHECK(autograd::gradcheck([&](const std::vector<Tensor>& x) { return lr.column_mean(cm, x[0], 3); }, {u}) == "");
}

TEST_CASE("alignment: hidden-layer MLPMapper summarises its first layer, matching the explicit matrix") {
  for (const Modulation& m : layer_modulations()) {
    INFO(m.name());
    MLPMapper deep(4, 23, 3, "deep", {9, 6}, m);
    REQUIRE(deep.layer_count() == 3);
    const Tensor z = mn::testing::random_param({4}, 31, 0.7);
    const Tensor summary = deep.modulated_column_mean(z);
    CHECK(summary.sizes() == Shape{4});  // comparable with z
    CHECK(max_abs_diff(summary, explicit_column_mean(m, deep.layer(0), z)) < 1e-5);
    if (m.kind != Modulation::Kind::None) {
      CHECK(autograd::gradcheck([&](const std::vector<Tensor>& x) { return deep.modulated_column_mean(x[0]); }, {z}) ==
            "");
      // Through the cosine distance too (the alignment loss's own composition).
      CHECK(autograd::gradcheck(
                [&](const std::vector<Tensor>& x) {
                  TrainingContext ci;
                  ci.latent_vectors["g"] = x[0];
                  ci.mapper_column_means["g"] = deep.modulated_column_mean(x[0]);
                  return AlignmentLoss()(ci).total;
                },
                {z}) == "");
    }
  }
  // A single layer keeps its summary: the only layer is the first (and the last).
  MLPMapper single(5, 11, 2, "single", {}, Modulation::additive(0.2));
  const Tensor z5 = randn({5});
  CHECK(max_abs_diff(single.modulated_column_mean(z5),
                     explicit_column_mean(Modulation::additive(0.2), single.layer(0), z5)) < 1e-5);
}

TEST_CASE("alignment: ResidualMLPMapper summarises its input layer, matching the explicit matrix") {
  for (const Modulation& m : layer_modulations()) {
    INFO(m.name());
    ResidualMLPMapper res(4, 17, 8, "res", 6, 2, m);
    const Tensor z = mn::testing::random_param({4}, 41, 0.7);
    const Tensor summary = res.modulated_column_mean(z);
    CHECK(summary.sizes() == Shape{4});
    CHECK(max_abs_diff(summary, explicit_column_mean(m, res.input_layer(), z)) < 1e-5);
    if (m.kind != Modulation::Kind::None)
      CHECK(autograd::gradcheck([&](const std::vector<Tensor>& x) { return res.modulated_column_mean(x[0]); }, {z}) ==
            "");
  }
}

TEST_CASE("alignment: a custom mapper without a layer structure still says it has no summary") {
  struct Doubler : Mapper {
    Doubler() : Mapper(3, 3) {}
    size_t fixed_bytes() const override { return 0; }
    size_t dense_bytes() const override { return 0; }
    std::vector<Tensor> buffers() const override { return {}; }
    void to(Device) override {}
    std::string describe() const override { return "Doubler"; }

   protected:
    Tensor compute(const Tensor& z) const override { return mul(z, 2.0); }
  };
  CHECK_THROWS_WITH_AS(Doubler().modulated_column_mean(zeros({3})), doctest::Contains("override"),
                       NotImplementedError);
}

TEST_CASE("alignment: the full Mapping Loss trains hidden-layer and residual mappers through the trainer") {
  const std::vector<std::pair<std::string, MapperFactory>> families = {
      {"mlp hidden", [](int64_t L, int64_t n, uint64_t seed, const std::string& key) -> std::shared_ptr<Mapper> {
         return std::make_shared<MLPMapper>(L, n, seed, key, std::vector<int64_t>{12}, Modulation::affine());
       }},
      {"residual", [](int64_t L, int64_t n, uint64_t seed, const std::string& key) -> std::shared_ptr<Mapper> {
         return std::make_shared<ResidualMLPMapper>(L, n, seed, key, 10, 2);
       }}};
  for (const auto& [family, factory] : families) {
    INFO(family);
    manual_seed(71);
    MappingOptions options;
    options.latent_dim = 6;
    options.mapper_factory = factory;
    auto target = std::make_shared<nn::Sequential>();
    target->push_back(std::make_shared<nn::Linear>(5, 4));
    target->push_back(std::make_shared<nn::Linear>(4, 3));
    MappingModel model(target, options);
    Generator gen(72);
    data::DataLoader loader(randn({16, 5}, {}, &gen), randn({16, 3}, {}, &gen), {.batch_size = 8});
    auto loss = std::make_shared<MappingLoss>(std::make_shared<RegressionLoss>());
    train::TrainerConfig config;
    config.max_epochs = 2;
    config.learning_rate = 0.05;
    MappingTrainer trainer(model, loader, &loader, loss, config);
    std::vector<Tensor> before;
    for (const Tensor& z : model.parameters()) before.push_back(z.detach().clone());
    struct Capture : train::Callback {
      train::Metrics metrics;
      void on_batch_end(train::Trainer&, int64_t, const LossOutput& out) override { metrics = out.metrics; }
    };
    auto capture = std::make_shared<Capture>();
    trainer.add_callback(capture);
    const train::History history = trainer.fit();
    CHECK(history.epochs() == 2);
    for (const char* key : {"task", "stability", "smoothness", "alignment"}) CHECK(capture->metrics.count(key) == 1);
    CHECK(std::isfinite(capture->metrics.at("alignment")));
    CHECK(capture->metrics.at("alignment") >= 0.0);
    CHECK(capture->metrics.at("alignment") <= 2.0);
    size_t i = 0;
    for (const Tensor& z : model.parameters()) CHECK(max_abs_diff(z, before[i++]) > 0.0);
  }
}
