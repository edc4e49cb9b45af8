// MappingTrainer: training loop, validation, callbacks, accumulation, clipping, schedulers,
// determinism, resumable state and the learning-rate range test (the reference's "Trainer" and
// "LR finder" behaviours plus the port's fixes: task-only bare losses, explicit history keys, stepping
// a partial accumulation window, resume from the stored epoch, bitwise restore after a sweep).
#include <cmath>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "mapping/trainer.h"
#include "nn/layers.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::mapping;
using mn::testing::contains;
using mn::testing::error_message;
namespace keys = mn::mapping::history_keys;

namespace {

std::unique_ptr<MappingModel> linear_model(uint64_t seed = 0, int64_t in = 4, int64_t out = 2) {
  manual_seed(seed + 1000);  // the target's own init (it sets the parameter scales)
  MappingOptions options;
  options.latent_dim = 8;
  options.seed = seed;
  return std::make_unique<MappingModel>(std::make_shared<nn::Linear>(in, out), options);
}

// y = x A + noise, x [n, 4], y [n, 2].
data::DataLoader regression_loader(int64_t n = 8, int64_t batch_size = 4, uint64_t seed = 1, bool shuffle = false) {
  Generator gen(seed);
  Tensor x = randn({n, 4}, {}, &gen);
  Tensor a = randn({4, 2}, {}, &gen);
  Tensor y = add(matmul(x, a), mul(randn({n, 2}, {}, &gen), 0.1));
  data::DataLoaderOptions o;
  o.batch_size = batch_size;
  o.shuffle = shuffle;
  o.seed = seed;
  return data::DataLoader(x, y, o);
}

std::vector<std::vector<float>> latent_values(const MappingModel& model) {
  std::vector<std::vector<float>> out;
  for (const Tensor& z : model.parameters()) out.push_back(z.to_vector<float>());
  return out;
}

// A tiny CNN target (conv, relu, flatten, linear) and 8 labelled 4x4 images in batches of 4.
std::shared_ptr<nn::Sequential> tiny_cnn() {
  manual_seed(7);
  return std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
      std::make_shared<nn::Conv2d>(1, 2, 3), std::make_shared<nn::ReLU>(), std::make_shared<nn::Flatten>(),
      std::make_shared<nn::Linear>(8, 2)});
}
data::DataLoader tiny_images() {
  Generator gen(8);
  Tensor x = randn({8, 1, 4, 4}, {}, &gen);
  Tensor y = from_vector(std::vector<int64_t>{0, 1, 0, 1, 1, 0, 1, 0}, {8});
  return data::DataLoader(x, y, {.batch_size = 4});
}

std::shared_ptr<MappingLoss> full_mapping_loss() {
  return std::make_shared<MappingLoss>(std::make_shared<RegressionLoss>());
}

// Records every hook as one string.
class Recorder : public Callback {
 public:
  std::vector<std::string> events;
  void on_fit_start(train::Trainer&) override { events.push_back("fit_start"); }
  void on_fit_end(train::Trainer&) override { events.push_back("fit_end"); }
  void on_epoch_start(train::Trainer&, int64_t e) override { events.push_back("epoch_start " + std::to_string(e)); }
  void on_epoch_end(train::Trainer&, int64_t e, const Metrics&) override {
    events.push_back("epoch_end " + std::to_string(e));
  }
  void on_batch_start(train::Trainer&, int64_t b) override { events.push_back("batch_start " + std::to_string(b)); }
  void on_batch_end(train::Trainer&, int64_t b, const LossOutput&) override {
    events.push_back("batch_end " + std::to_string(b));
  }
  void on_validation_start(train::Trainer&) override { events.push_back("val_start"); }
  void on_validation_end(train::Trainer&, const Metrics&) override { events.push_back("val_end"); }
};

class BrokenCallback : public Callback {
 public:
  void on_epoch_start(train::Trainer&, int64_t) override { throw ValueError("intentional error"); }
};

class InterruptAt : public Callback {
 public:
  explicit InterruptAt(int64_t epoch) : epoch_(epoch) {}
  bool fit_ended = false;
  void on_epoch_end(train::Trainer&, int64_t e, const Metrics&) override {
    if (e >= epoch_) throw TrainingInterrupted();
  }
  void on_fit_end(train::Trainer&) override { fit_ended = true; }

 private:
  int64_t epoch_;
};

}  // namespace

// ---- training ----

TEST_CASE("trainer: a mapped Linear(4,2) learns a regression (loss falls over 30 epochs)") {
  auto model = linear_model();
  auto loader = regression_loader();
  TrainerConfig config;
  config.max_epochs = 30;
  config.learning_rate = 0.01;
  MappingTrainer trainer(*model, loader, nullptr, full_mapping_loss(), config);
  History history = trainer.fit();
  const auto& losses = history[keys::kTrainTaskLoss];
  REQUIRE(losses.size() == 30);
  CHECK(losses.back() < losses.front());
  CHECK(history[keys::kTrainTotalLoss].size() == 30);
  CHECK(history[keys::kLearningRate].size() == 30);
  CHECK_FALSE(history.contains("train_loss"));  // explicit names only
  CHECK(history.epochs() == 30);
  CHECK(trainer.epoch() == 30);
}

TEST_CASE("trainer: a streamed model (stream_layers) trains as the plain one; smoothness refuses it") {
  auto run = [](bool stream, std::shared_ptr<Loss> loss) {
    MappingOptions options;
    options.latent_dim = 8;
    options.stream_layers = stream;
    MappingModel model(tiny_cnn(), options);
    data::DataLoader loader = tiny_images();
    TrainerConfig config;
    config.max_epochs = 3;
    config.learning_rate = 0.03;
    MappingTrainer trainer(model, loader, nullptr, loss, config);
    History history = trainer.fit();
    std::vector<float> out;
    for (const Tensor& z : model.parameters())
      for (float v : z.to_vector<float>()) out.push_back(v);
    for (double v : history[keys::kTrainTaskLoss]) out.push_back(static_cast<float>(v));
    return out;
  };
  auto classification = std::make_shared<ClassificationLoss>();
  CHECK(run(true, classification) == run(false, classification));
  auto smooth = std::make_shared<MappingLoss>(std::make_shared<ClassificationLoss>());  // all three terms
  CHECK_THROWS_WITH_AS(run(true, smooth), doctest::Contains("stream_layers"), ValueError);
}

TEST_CASE("trainer: a tiny mapped CNN learns (classification, accuracy recorded)") {
  MappingOptions options;
  options.latent_dim = 8;
  MappingModel model(tiny_cnn(), options);
  data::DataLoader loader = tiny_images();
  TrainerConfig config;
  config.max_epochs = 30;
  config.learning_rate = 0.03;
  MappingTrainer trainer(model, loader, nullptr, std::make_shared<ClassificationLoss>(), config);
  History history = trainer.fit();
  CHECK(history[keys::kTrainTaskLoss].back() < history[keys::kTrainTaskLoss].front());
  REQUIRE(history.contains(keys::kTrainAccuracy));
  for (double acc : history[keys::kTrainAccuracy]) {
    CHECK(acc >= 0.0);
    CHECK(acc <= 1.0);
  }
}

TEST_CASE("trainer: validation adds val_task_loss, val_total_loss and one entry per epoch") {
  auto model = linear_model();
  auto train = regression_loader(8, 4, 1);
  auto val = regression_loader(8, 4, 2);
  TrainerConfig config;
  config.max_epochs = 3;
  MappingTrainer trainer(*model, train, &val, full_mapping_loss(), config);
  History history = trainer.fit();
  for (const char* key : {keys::kValTaskLoss, keys::kValTotalLoss}) {
    REQUIRE(history[key].size() == 3);
    for (double v : history[key]) CHECK(v >= 0.0);
  }
  CHECK_FALSE(history.contains(keys::kValAccuracy));
  CHECK_THROWS_AS(history.at("val_loss"), KeyError);
}

TEST_CASE("trainer: hooks fire in the reference order") {
  auto model = linear_model();
  auto train = regression_loader(8, 4);
  auto val = regression_loader(4, 4, 2);
  auto recorder = std::make_shared<Recorder>();
  TrainerConfig config;
  config.max_epochs = 2;
  MappingTrainer trainer(*model, train, &val, nullptr, config, {recorder});
  trainer.fit();
  const std::vector<std::string> epoch = {"batch_start 0", "batch_end 0", "batch_start 1", "batch_end 1",
                                          "val_start", "val_end"};
  std::vector<std::string> expected = {"fit_start"};
  for (int e = 0; e < 2; ++e) {
    expected.push_back("epoch_start " + std::to_string(e));
    expected.insert(expected.end(), epoch.begin(), epoch.end());
    expected.push_back("epoch_end " + std::to_string(e));
  }
  expected.push_back("fit_end");
  CHECK(recorder->events == expected);
}

// ---- losses handed to the trainer ----

TEST_CASE("trainer: a bare task loss trains the task only; regularisers are opt-in and logged") {
  auto model = linear_model();
  auto loader = regression_loader();
  std::ostringstream log;
  TrainerConfig config;
  config.max_epochs = 2;
  config.log = &log;
  MappingTrainer bare(*model, loader, nullptr, std::make_shared<RegressionLoss>(), config);
  CHECK(bare.loss().stability() == nullptr);
  CHECK(bare.loss().smoothness() == nullptr);
  CHECK(bare.loss().alignment() == nullptr);
  History history = bare.fit();
  CHECK(history[keys::kTrainTaskLoss] == history[keys::kTrainTotalLoss]);
  CHECK(contains(log.str(), "loss = task,"));

  // No loss at all: regression, task only.
  auto other = linear_model();
  MappingTrainer defaulted(*other, loader, nullptr, nullptr, config);
  CHECK(defaulted.loss().describe() == "task");
  CHECK(defaulted.fit()[keys::kTrainTaskLoss].size() == 2);

  // An explicit MappingLoss keeps its regularisers and the log names them.
  std::ostringstream log2;
  config.log = &log2;
  auto third = linear_model();
  MappingTrainer full(*third, loader, nullptr, full_mapping_loss(), config);
  full.fit();
  CHECK(contains(log2.str(), "task + 0.1*stability + 0.01*smoothness + 0.01*alignment"));
}

TEST_CASE("trainer: the optimizer holds only trainable tensors (latents, then the loss's rho's)") {
  manual_seed(3);
  auto target = std::make_shared<nn::Sequential>(
      std::vector<nn::ModulePtr>{std::make_shared<nn::Linear>(4, 3), std::make_shared<nn::Linear>(3, 2)});
  MappingOptions options;
  options.latent_dim = 8;
  MappingModel model(target, options);
  auto loader = regression_loader();
  MappingTrainer fixed(model, loader, nullptr, full_mapping_loss());
  CHECK(fixed.optimizer().params().size() == 2);  // two layer-wise latents, no target tensors
  for (const Tensor& p : fixed.optimizer().params()) CHECK(p.numel() == 8);

  auto trainable = std::make_shared<MappingLoss>(std::make_shared<RegressionLoss>(),
                                                 MappingLossOptions{.trainable_coefficients = true});
  MappingTrainer with_rho(model, loader, nullptr, trainable);
  REQUIRE(with_rho.optimizer().params().size() == 5);
  CHECK(with_rho.optimizer().params()[2].same(trainable->coefficient_parameters()[0]));
}

TEST_CASE("trainer: integration with stability (S = 2), alignment and trainable coefficients") {
  auto model = linear_model();
  auto loader = regression_loader();
  MappingLossOptions o;
  o.stability = std::make_shared<StabilityLoss>(0.01, 2);
  o.alignment = std::make_shared<AlignmentLoss>();
  o.lambda_alignment = 0.1;
  o.smoothness = no_term;
  o.trainable_coefficients = true;
  auto loss = std::make_shared<MappingLoss>(std::make_shared<RegressionLoss>(), o);
  const double stability_before = loss->lambda_stability(), alignment_before = loss->lambda_alignment();
  TrainerConfig config;
  config.max_epochs = 5;
  config.learning_rate = 0.05;
  MappingTrainer trainer(*model, loader, nullptr, loss, config);
  History history = trainer.fit();
  CHECK(history.epochs() == 5);
  // Minimisation pushes every trainable lambda down (the documented trap).
  CHECK(loss->lambda_stability() < stability_before);
  CHECK(loss->lambda_alignment() < alignment_before);
}

TEST_CASE("trainer: the perturbed forward sees the same inputs; alignment reads the clean latents") {
  auto model = linear_model();
  auto loader = regression_loader(4, 4);
  MappingLossOptions o;
  o.smoothness = no_term;
  auto loss = std::make_shared<MappingLoss>(std::make_shared<RegressionLoss>(), o);
  TrainerConfig config;
  config.max_epochs = 1;
  config.optimizer = "sgd";
  config.learning_rate = 0.0;  // latents stay put, so the expected values can be recomputed
  MappingTrainer trainer(*model, loader, nullptr, loss, config);
  std::vector<std::vector<float>> seen_inputs;
  trainer.set_batch_forward([&](nn::Module& target, const data::Batch& batch) {
    seen_inputs.push_back(batch.inputs.to_vector<float>());
    return target.forward(batch.inputs);
  });
  struct Capture : Callback {
    Metrics metrics;
    void on_batch_end(train::Trainer&, int64_t, const LossOutput& out) override { metrics = out.metrics; }
  };
  auto capture = std::make_shared<Capture>();
  trainer.add_callback(capture);
  trainer.fit();
  REQUIRE(seen_inputs.size() == 2);  // clean + perturbed
  CHECK(seen_inputs[0] == seen_inputs[1]);

  TrainingContext clean;
  for (const auto& [name, z] : model->named_latents()) clean.latent_vectors[name] = z;
  clean.mapper_column_means = model->modulated_column_means();
  CHECK(capture->metrics.at("alignment") == doctest::Approx(AlignmentLoss()(clean).total.item()).epsilon(1e-6));
}

// ---- callbacks ----

TEST_CASE("trainer: early stopping stops a run long before max_epochs; the stop applies at the next epoch") {
  auto model = linear_model();
  auto train = regression_loader(8, 4, 1);
  auto val = regression_loader(8, 4, 2);
  TrainerConfig config;
  config.max_epochs = 200;
  config.learning_rate = 0.1;
  auto stopper = std::make_shared<EarlyStopping>(keys::kValTotalLoss, 5, 1e-3);
  MappingTrainer trainer(*model, train, &val, nullptr, config, {stopper});
  History history = trainer.fit();
  CHECK(history.epochs() < 200);
  CHECK(trainer.should_stop());
  CHECK(stopper->wait() >= 5);

  // A stop requested at the end of epoch 1 lets epoch 1 finish and prevents epoch 2.
  struct StopAfter : Callback {
    void on_epoch_end(train::Trainer& t, int64_t e, const Metrics&) override {
      if (e == 1) t.set_should_stop(true);
    }
  };
  auto recorder = std::make_shared<Recorder>();
  auto other = linear_model();
  config.max_epochs = 10;
  MappingTrainer stopped(*other, train, nullptr, nullptr, config, {std::make_shared<StopAfter>(), recorder});
  CHECK(stopped.fit().epochs() == 2);
  CHECK(recorder->events.back() == "fit_end");
  CHECK(stopped.current_epoch() == 2);
}

TEST_CASE("trainer: EarlyStopping modes and validation") {
  EarlyStopping maximise("train_accuracy", 2, 0.0, "max");
  auto model = linear_model();
  auto loader = regression_loader();
  MappingTrainer trainer(*model, loader);
  maximise.on_epoch_end(trainer, 0, {{"train_accuracy", 0.5}});
  maximise.on_epoch_end(trainer, 1, {{"train_accuracy", 0.4}});
  CHECK_FALSE(trainer.should_stop());
  maximise.on_epoch_end(trainer, 2, {{"other", 1.0}});  // key absent: ignored
  CHECK_FALSE(trainer.should_stop());
  maximise.on_epoch_end(trainer, 3, {{"train_accuracy", 0.5}});  // not > best
  CHECK(trainer.should_stop());
  CHECK(maximise.best() == 0.5);

  const std::string msg = error_message([] { EarlyStopping("x", 1, 0.0, "invalid"); });
  CHECK(contains(msg, "'min' or 'max'"));
  CHECK_THROWS_AS(EarlyStopping("x", -1), ValueError);

  // State: best and wait carry over; the restored stopper raises the stop when the original would.
  EarlyStopping copy("train_accuracy", 2, 0.0, "max");
  copy.load_state_dict(maximise.state_dict());
  CHECK(copy.best() == 0.5);
  CHECK(copy.wait() == maximise.wait());
  CHECK(EarlyStopping().state_dict().count("best") == 0);
  CHECK(contains(error_message([&] { copy.load_state_dict({}); }), "no 'wait'"));
  CHECK_THROWS_AS(copy.load_state_dict({{"wait", -1.0}}), ValueError);
}

TEST_CASE("trainer: state() keys callback states by name, numbering repeats; load_state() restores them") {
  auto model = linear_model();
  auto loader = regression_loader();
  auto a = std::make_shared<EarlyStopping>(keys::kTrainTotalLoss, 5);
  auto b = std::make_shared<EarlyStopping>(keys::kTrainTotalLoss, 5, 1e9);
  TrainerConfig config;
  config.max_epochs = 2;
  MappingTrainer trainer(*model, loader, nullptr, nullptr, config, {a, std::make_shared<MetricLogger>(), b});
  trainer.fit();
  const TrainerState state = trainer.state();
  REQUIRE(state.callback_states.size() == 2);  // MetricLogger has no state
  CHECK(state.callback_states.at("EarlyStopping").at("wait") == 0.0);   // improving loss
  CHECK(state.callback_states.at("EarlyStopping#2").at("wait") == 1.0);  // never improves after epoch 1

  auto other = linear_model();
  auto fresh_a = std::make_shared<EarlyStopping>(keys::kTrainTotalLoss, 5);
  auto fresh_b = std::make_shared<EarlyStopping>(keys::kTrainTotalLoss, 5, 1e9);
  MappingTrainer resumed(*other, loader, nullptr, nullptr, config, {fresh_a, fresh_b});
  resumed.load_state(state);
  CHECK(fresh_a->best() == a->best());
  CHECK(fresh_b->wait() == 1);
}

TEST_CASE("trainer: MetricLogger writes epoch, batch and validation lines") {
  auto model = linear_model();
  auto train = regression_loader(8, 4);
  auto val = regression_loader(4, 4, 2);
  std::ostringstream out;
  TrainerConfig config;
  config.max_epochs = 2;
  MappingTrainer trainer(*model, train, &val, nullptr, config, {std::make_shared<MetricLogger>(1, out)});
  trainer.fit();
  const std::string text = out.str();
  CHECK(contains(text, "Epoch 1/2 started\n"));
  CHECK(contains(text, "  batch 1: task="));
  CHECK(contains(text, "  batch 2: "));
  CHECK(contains(text, "  validation: val_task_loss="));
  CHECK(contains(text, "Epoch 2/2: lr=0.0010, train_task_loss="));
  CHECK_THROWS_AS(MetricLogger(0), ValueError);
}

TEST_CASE("trainer: ProgressCallback runs through a fit") {
  auto model = linear_model();
  auto train = regression_loader(8, 4);
  TrainerConfig config;
  config.max_epochs = 1;
  MappingTrainer trainer(*model, train, nullptr, nullptr, config, {std::make_shared<ProgressCallback>()});
  CHECK(trainer.fit().epochs() == 1);
}

TEST_CASE("trainer: a failing callback is reported with its name and hook") {
  auto model = linear_model();
  auto loader = regression_loader();
  auto recorder = std::make_shared<Recorder>();
  TrainerConfig config;
  config.max_epochs = 1;
  MappingTrainer trainer(*model, loader, nullptr, nullptr, config, {std::make_shared<BrokenCallback>(), recorder});
  const std::string msg = error_message([&] { trainer.fit(); });
  CHECK(contains(msg, "Callback 'BrokenCallback' failed during on_epoch_start: intentional error"));
  CHECK_THROWS_AS(trainer.fit(), RuntimeError);
  CHECK(recorder->events.back() == "fit_end");  // on_fit_end runs even then
}

TEST_CASE("trainer: an interrupt returns the partial history and still ends the fit") {
  auto model = linear_model();
  auto loader = regression_loader();
  auto interrupt = std::make_shared<InterruptAt>(2);
  TrainerConfig config;
  config.max_epochs = 100;
  MappingTrainer trainer(*model, loader, nullptr, nullptr, config, {interrupt});
  History history = trainer.fit();
  CHECK(history.epochs() == 3);
  CHECK(interrupt->fit_ended);
  CHECK(trainer.epoch() == 3);

  // interrupt() (e.g. from a signal handler) stops at the next batch boundary.
  struct InterruptMidEpoch : Callback {
    void on_batch_end(train::Trainer& t, int64_t batch, const LossOutput&) override {
      if (t.current_epoch() == 1 && batch == 0) t.interrupt();
    }
  };
  auto other = linear_model();
  MappingTrainer second(*other, loader, nullptr, nullptr, config, {std::make_shared<InterruptMidEpoch>()});
  CHECK(second.fit().epochs() == 1);
}

// ---- optimizers, schedulers, clipping, accumulation ----

TEST_CASE("trainer: sgd and adamw train; unknown names are rejected with the choices") {
  for (const char* name : {"sgd", "adamw", "ADAM"}) {
    auto model = linear_model();
    auto loader = regression_loader();
    TrainerConfig config;
    config.max_epochs = 3;
    config.optimizer = name;
    config.learning_rate = 0.01;
    config.weight_decay = 0.01;
    config.momentum = std::string(name) == "sgd" ? 0.9 : 0.0;
    MappingTrainer trainer(*model, loader, nullptr, nullptr, config);
    CHECK(trainer.fit().epochs() == 3);
  }
  auto model = linear_model();
  auto loader = regression_loader();
  TrainerConfig bad;
  bad.optimizer = "nonexistent";
  CHECK(contains(error_message([&] { MappingTrainer(*model, loader, nullptr, nullptr, bad); }),
                 "Unknown optimizer 'nonexistent'; available: adam, adamw, rmsprop, sgd"));
  bad = {};
  bad.scheduler = "nonexistent";
  CHECK(contains(error_message([&] { MappingTrainer(*model, loader, nullptr, nullptr, bad); }),
                 "Unknown scheduler 'nonexistent'; available: cosine, exponential, plateau, step"));
  bad = {};
  bad.accumulation_steps = 0;
  CHECK_THROWS_AS(MappingTrainer(*model, loader, nullptr, nullptr, bad), ValueError);
}

TEST_CASE("trainer: schedulers step once per epoch") {
  auto run = [](const char* scheduler, int64_t epochs, bool with_val) {
    auto model = linear_model();
    auto train = regression_loader();
    auto val = regression_loader(4, 4, 2);
    TrainerConfig config;
    config.max_epochs = epochs;
    config.scheduler = scheduler;
    MappingTrainer trainer(*model, train, with_val ? &val : nullptr, nullptr, config);
    History history = trainer.fit();
    CHECK(history.epochs() == static_cast<size_t>(epochs));
    return std::make_pair(history[keys::kLearningRate], trainer.learning_rate());
  };
  auto [cosine_lrs, cosine_final] = run("cosine", 5, false);
  CHECK(cosine_lrs.front() == doctest::Approx(1e-3));
  CHECK(cosine_final < 1e-3);
  for (size_t i = 1; i < cosine_lrs.size(); ++i) CHECK(cosine_lrs[i] < cosine_lrs[i - 1]);
  auto [step_lrs, step_final] = run("step", 5, false);  // step_size = max(1, 5 / 3) = 1
  CHECK(step_lrs[1] == doctest::Approx(1e-4));
  auto [exp_lrs, exp_final] = run("exponential", 3, false);
  CHECK(exp_lrs[2] == doctest::Approx(1e-3 * 0.95 * 0.95));
  auto [plateau_lrs, plateau_final] = run("plateau", 5, true);
  CHECK(plateau_final <= 1e-3);
}

TEST_CASE("trainer: gradient clipping by norm and by value bounds the latent updates") {
  for (bool by_value : {false, true}) {
    auto model = linear_model();
    auto loader = regression_loader(4, 4);
    TrainerConfig config;
    config.max_epochs = 1;
    config.optimizer = "sgd";
    config.learning_rate = 1.0;
    if (by_value) config.gradient_clip_value = 1e-3;
    else config.gradient_clip_norm = 1e-3;
    const auto before = latent_values(*model);
    MappingTrainer trainer(*model, loader, nullptr, nullptr, config);
    trainer.fit();
    const auto after = latent_values(*model);
    double squared = 0.0, largest = 0.0;
    for (size_t g = 0; g < before.size(); ++g)
      for (size_t i = 0; i < before[g].size(); ++i) {
        const double d = after[g][i] - before[g][i];
        squared += d * d;
        largest = std::max(largest, std::abs(d));
      }
    INFO("by value: " << by_value);
    CHECK(largest > 0.0);
    if (by_value) CHECK(largest <= 1e-3 + 1e-7);
    else CHECK(std::sqrt(squared) <= 1e-3 + 1e-6);
  }
}

TEST_CASE("trainer: accumulation steps every k batches and steps the partial window at epoch end") {
  auto steps_after_one_epoch = [](int64_t k, bool discard) {
    auto model = linear_model();
    auto loader = regression_loader(5, 1);  // five batches
    TrainerConfig config;
    config.max_epochs = 1;
    config.accumulation_steps = k;
    config.discard_partial_accumulation = discard;
    MappingTrainer trainer(*model, loader, nullptr, nullptr, config);
    trainer.fit();
    return trainer.optimizer().step_count();
  };
  CHECK(steps_after_one_epoch(1, false) == 5);
  CHECK(steps_after_one_epoch(2, false) == 3);
  CHECK(steps_after_one_epoch(2, true) == 2);
  CHECK(steps_after_one_epoch(10, false) == 1);

  auto model = linear_model();
  auto loader = regression_loader(8, 4);
  TrainerConfig config;
  config.max_epochs = 3;
  config.accumulation_steps = 2;
  MappingTrainer trainer(*model, loader, nullptr, nullptr, config);
  CHECK(trainer.fit().epochs() == 3);
}

TEST_CASE("trainer: k accumulated batches of one equal one batch of k, a partial window included") {
  // MSE is a mean over the batch, so with SGD the accumulated mean gradient is the batch gradient.
  for (int64_t samples : {int64_t{4}, int64_t{3}}) {
    auto run = [&](int64_t batch_size, int64_t k) {
      auto model = linear_model(5);
      auto loader = regression_loader(samples, batch_size, 9);
      TrainerConfig config;
      config.max_epochs = 1;
      config.optimizer = "sgd";
      config.learning_rate = 0.1;
      config.accumulation_steps = k;
      MappingTrainer trainer(*model, loader, nullptr, nullptr, config);
      trainer.fit();
      return latent_values(*model);
    };
    const auto whole = run(samples, 1);
    const auto accumulated = run(1, 4);  // one full window (4) or a partial one (3 of 4)
    INFO("samples " << samples);
    REQUIRE(whole.size() == accumulated.size());
    for (size_t g = 0; g < whole.size(); ++g)
      for (size_t i = 0; i < whole[g].size(); ++i)
        CHECK(accumulated[g][i] == doctest::Approx(whole[g][i]).epsilon(1e-5));
  }
}

// ---- determinism and resumption ----

TEST_CASE("trainer: the same seed gives identical losses (stability noise and probes included)") {
  auto run = [](uint64_t seed) {
    auto model = linear_model();
    auto loader = regression_loader(8, 4, 1, /*shuffle=*/true);
    TrainerConfig config;
    config.max_epochs = 5;
    config.seed = seed;
    MappingTrainer trainer(*model, loader, nullptr, full_mapping_loss(), config);
    return trainer.fit()[keys::kTrainTotalLoss];
  };
  const auto first = run(42);
  CHECK(first == run(42));
  CHECK(first != run(43));
}

TEST_CASE("trainer: state() and load_state() resume a fit exactly where it stopped") {
  TrainerConfig config;
  config.max_epochs = 5;
  config.seed = 11;
  config.scheduler = "cosine";
  auto train = regression_loader(8, 4, 1, /*shuffle=*/true);
  auto val = regression_loader(4, 4, 2);

  // Uninterrupted: five epochs.
  auto straight_model = linear_model();
  MappingTrainer straight(*straight_model, train, &val, full_mapping_loss(), config);
  const History straight_history = straight.fit();

  // Three epochs, then a fresh trainer and model continue from the saved state.
  auto first_model = linear_model();
  TrainerConfig three = config;
  three.max_epochs = 3;
  three.scheduler_options.cosine_t_max = 5;
  MappingTrainer first(*first_model, train, &val, full_mapping_loss(), three);
  first.fit();
  const TrainerState saved = first.state();
  CHECK(saved.epoch == 3);
  CHECK(saved.scheduler_epoch == 3);
  CHECK(saved.history.epochs() == 3);

  auto resumed_model = linear_model();
  {
    autograd::NoGradGuard no_grad;
    const auto source = first_model->parameters();
    auto dest = resumed_model->parameters();
    for (size_t i = 0; i < source.size(); ++i) dest[i].copy_(source[i]);
  }
  MappingTrainer resumed(*resumed_model, train, &val, full_mapping_loss(), config);
  resumed.load_state(saved);
  CHECK(resumed.epoch() == 3);
  const History resumed_history = resumed.fit();
  CHECK(resumed_history.epochs() == 5);
  for (const auto& key : straight_history.keys()) {
    INFO(key);
    REQUIRE(resumed_history.contains(key));
    const auto& a = straight_history[key];
    const auto& b = resumed_history[key];
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) CHECK(b[i] == doctest::Approx(a[i]).epsilon(1e-6));
  }
  CHECK(latent_values(*resumed_model) == latent_values(*straight_model));
}

TEST_CASE("trainer: a restored should_stop does not abort the next fit; a finished fit trains no more") {
  auto model = linear_model();
  auto loader = regression_loader();
  TrainerConfig config;
  config.max_epochs = 2;
  MappingTrainer trainer(*model, loader, nullptr, nullptr, config);
  TrainerState state = trainer.state();
  state.should_stop = true;
  trainer.load_state(state);
  CHECK(trainer.should_stop());
  CHECK(trainer.learning_rate() == 1e-3);  // full precision, not the optimizer state's f32
  CHECK(trainer.fit().epochs() == 2);

  CHECK(trainer.fit().epochs() == 2);  // already at max_epochs
  trainer.set_max_epochs(4);
  CHECK(trainer.fit().epochs() == 4);
  CHECK(trainer.history()[keys::kTrainTaskLoss].size() == 4);
}

TEST_CASE("trainer: fit_epoch runs one pass over any loader") {
  auto model = linear_model();
  auto loader = regression_loader(8, 4);
  auto other = regression_loader(6, 3, 4);
  MappingTrainer trainer(*model, loader);
  const auto before = latent_values(*model);
  Metrics metrics = trainer.fit_epoch(other);
  CHECK(metrics.count(keys::kTrainTaskLoss) == 1);
  CHECK(metrics.count(keys::kTrainTotalLoss) == 1);
  CHECK(latent_values(*model) != before);
  CHECK(trainer.epoch() == 0);  // fit_epoch keeps no epoch count
  CHECK(trainer.optimizer().step_count() == 2);
}

// ---- non-finite steps ----

namespace {
// The regression data of regression_loader(n, batch_size) with a NaN in the inputs of sample `bad`.
data::DataLoader regression_loader_with_nan(int64_t n, int64_t batch_size, int64_t bad) {
  Generator gen(1);
  Tensor x = randn({n, 4}, {}, &gen);
  Tensor y = randn({n, 2}, {}, &gen);
  std::vector<float> xv = x.to_vector<float>();
  xv[static_cast<size_t>(bad * 4 + 2)] = std::numeric_limits<float>::quiet_NaN();
  return data::DataLoader(from_vector(xv, {n, 4}), y, {.batch_size = batch_size});
}

bool all_finite(const std::vector<std::vector<float>>& values) {
  for (const auto& v : values)
    for (float f : v)
      if (!std::isfinite(f)) return false;
  return true;
}
}  // namespace

TEST_CASE("trainer: a NaN loss stops fit() with an error naming the step, before the step is applied") {
  auto model = linear_model();
  auto loader = regression_loader_with_nan(8, 4, 5);  // the second of two batches
  TrainerConfig config;
  config.max_epochs = 3;
  MappingTrainer trainer(*model, loader, nullptr, nullptr, config);
  trainer.set_epoch(1);  // resumed: the failing step is epoch 2, batch 2, global step 1 * 2 + 1
  const std::string message = error_message([&] { trainer.fit(); });
  INFO(message);
  CHECK(contains(message, "non-finite"));
  CHECK(contains(message, "epoch 2/3, batch 2 (global step 3"));
  CHECK(contains(message, "loss (task = nan, total = nan)"));
  CHECK(contains(message, "gradient of latent"));
  CHECK_THROWS_AS(trainer.fit(), RuntimeError);
  // the NaN step never reached the optimizer: the latents are still finite
  CHECK(all_finite(latent_values(*model)));
}

TEST_CASE("trainer: a NaN latent stops the first step; a non-finite gradient alone is named as such") {
  {
    auto model = linear_model();
    auto loader = regression_loader();
    {
      autograd::NoGradGuard no_grad;
      model->parameters()[0].fill_(std::numeric_limits<double>::quiet_NaN());
    }
    MappingTrainer trainer(*model, loader);
    const std::string message = error_message([&] { trainer.fit(); });
    INFO(message);
    CHECK(contains(message, "epoch 1/100, batch 1 (global step 0"));
    CHECK(contains(message, "loss ("));
  }
  // finite loss, NaN gradients: y + 0 * sqrt(y - y) has the value y and the gradient 0 * inf
  auto model = linear_model();
  auto loader = regression_loader();
  MappingTrainer trainer(*model, loader);
  trainer.set_batch_forward([](nn::Module& target, const data::Batch& batch) {
    Tensor y = target.forward(batch.inputs);
    return add(y, mul(sqrt(sub(y, y)), 0.0));
  });
  const std::string message = error_message([&] { trainer.fit(); });
  INFO(message);
  CHECK(contains(message, "batch 1 (global step 0"));
  CHECK(contains(message, "gradient of latent"));
  CHECK_FALSE(contains(message, "loss ("));
}

TEST_CASE("trainer: on_nonfinite = warn reports once per epoch with a count, and trains on") {
  auto model = linear_model();
  auto loader = regression_loader_with_nan(12, 4, 5);  // batch 2 of 3; the NaN then reaches the latents
  std::ostringstream log;
  TrainerConfig config;
  config.max_epochs = 2;
  config.on_nonfinite = "warn";
  config.log = &log;
  MappingTrainer trainer(*model, loader, nullptr, nullptr, config);
  const History history = trainer.fit();
  CHECK(history.epochs() == 2);
  const std::string text = log.str();
  INFO(text);
  CHECK(contains(text, "warning: MappingTrainer: non-finite values at epoch 1/2, batch 2 (global step 1"));
  CHECK(contains(text, "2 of 3 steps of epoch 1 were not finite"));
  CHECK(contains(text, "non-finite values at epoch 2/2, batch 1 (global step 3"));
  CHECK(contains(text, "3 of 3 steps of epoch 2 were not finite"));

  TrainerConfig bad;
  bad.on_nonfinite = "ignore";
  CHECK(contains(error_message([&] { MappingTrainer t(*model, loader, nullptr, nullptr, bad); }), "on_nonfinite"));
}

// ---- learning-rate finder ----

TEST_CASE("lr finder: suggestion heuristics on a fixed sweep") {
  LRFinderResult r;
  r.lrs = {1e-4, 1e-3, 1e-2, 1e-1, 1.0};
  r.losses = {2.0, 1.8, 1.0, 0.5, 3.0};
  r.smoothed_losses = r.losses;
  CHECK(std::log10(r.suggestion("steep")) == doctest::Approx(-2.0));
  CHECK(std::log10(r.suggestion()) == doctest::Approx(-2.0));
  CHECK(std::log10(r.suggestion("valley")) == doctest::Approx(-3.0));
  CHECK(std::log10(r.suggestion("minimum")) == doctest::Approx(-2.0));
  CHECK(contains(error_message([&] { r.suggestion("invalid"); }),
                 "Unknown suggestion method: 'invalid'. Choose from: 'steep', 'valley', 'minimum'"));

  LRFinderResult single;
  single.lrs = {1e-3};
  single.losses = single.smoothed_losses = {1.0};
  CHECK(single.suggestion("steep") == 1e-3);
  CHECK(single.suggestion("valley") == 1e-3);
  LRFinderResult empty;
  CHECK(contains(error_message([&] { empty.suggestion(); }), "No suggested learning rate found"));
}

TEST_CASE("lr finder: a sweep records every step and restores the trainer bitwise") {
  auto model = linear_model();
  auto loader = regression_loader(16, 4);
  TrainerConfig config;
  config.max_epochs = 2;
  config.seed = 3;
  MappingTrainer trainer(*model, loader, nullptr, full_mapping_loss(), config);
  trainer.fit();  // some optimizer state and history to preserve
  const auto latents = latent_values(*model);
  const double lr = trainer.learning_rate();
  const int64_t steps = trainer.optimizer().step_count();
  const TrainerState before = trainer.state();

  LRFinderResult result = trainer.lr_find(1e-6, 1.0, 10);
  CHECK(result.lrs.size() == 10);
  CHECK(result.losses.size() == 10);
  CHECK(result.smoothed_losses.size() == 10);
  CHECK(result.lrs.front() == 1e-6);
  CHECK(result.lrs.back() == doctest::Approx(1.0));
  CHECK(result.smoothed_losses.front() == result.losses.front());
  CHECK(result.smoothed_losses[1] == doctest::Approx(0.95 * result.losses[0] + 0.05 * result.losses[1]));
  REQUIRE(result.suggested_lr.has_value());

  CHECK(latent_values(*model) == latents);  // bitwise
  CHECK(trainer.learning_rate() == lr);
  CHECK(trainer.optimizer().step_count() == steps);
  const TrainerState after = trainer.state();
  CHECK(after.epoch == before.epoch);
  CHECK(after.should_stop == before.should_stop);
  CHECK(after.rng.trainer_offset == before.rng.trainer_offset);
  CHECK(after.rng.global_offset == before.rng.global_offset);
  CHECK(after.history == before.history);
  for (const auto& [key, saved] : before.optimizer) {
    INFO(key);
    const Tensor& now = after.optimizer.at(key);
    if (saved.dtype() == DType::i64) CHECK(now.to_vector<int64_t>() == saved.to_vector<int64_t>());
    else CHECK(now.to_vector<float>() == saved.to_vector<float>());
  }
  // Everything restored: a second sweep repeats the first exactly.
  LRFinderResult again = trainer.lr_find(1e-6, 1.0, 10);
  CHECK(again.losses == result.losses);
  CHECK_THROWS_AS(trainer.lr_find(0.0, 1.0), ValueError);
  CHECK_THROWS_AS(trainer.lr_find(1e-3, 1.0, 0), ValueError);
}

TEST_CASE("lr finder: the sweep stops once the smoothed loss diverges") {
  auto model = linear_model();
  auto loader = regression_loader(16, 4);
  auto calls = std::make_shared<int>(0);
  auto exploding = std::make_shared<TaskLoss>([calls](const Tensor& p, const Tensor& y) {
    Tensor mse = mean(square(sub(p, y)));
    return (*calls)++ >= 3 ? add(mse, 1000.0) : mse;
  });
  MappingTrainer trainer(*model, loader, nullptr, exploding);
  LRFinderResult result = trainer.lr_find(1e-5, 10.0, 20, 2.0);
  CHECK(result.lrs.size() < 20);
  CHECK(result.lrs.size() == 4);
}

TEST_CASE("lr finder: with a metrics reducer the sweep follows the reduced loss (the same on every rank)") {
  // A stand-in for the other ranks: the reduced loss is this rank's until the 4th step, then it explodes.
  // The sweep must record and stop on the reduced values, as every rank of a DDP job then does.
  auto model = linear_model();
  auto loader = regression_loader(16, 4);
  MappingTrainer trainer(*model, loader);
  std::vector<int64_t> samples_seen;
  trainer.set_metrics_reducer([&](const Metrics& m, int64_t samples) {
    samples_seen.push_back(samples);
    REQUIRE(m.size() == 1);
    const double local = m.at("lr_find_loss");
    return Metrics{{"lr_find_loss", samples_seen.size() >= 4 ? local + 1000.0 : local}};
  });
  // No smoothing and a threshold of 100x the best loss: the local losses of this tiny lr range stay
  // well inside it, the reduced jump of +1000 does not.
  LRFinderResult result = trainer.lr_find(1e-5, 1e-4, 20, 100.0, /*beta=*/0.0);
  CHECK(result.lrs.size() == 4);
  CHECK(result.losses.back() > 1000.0);
  CHECK(samples_seen == std::vector<int64_t>(4, 4));
  trainer.set_metrics_reducer(nullptr);
  CHECK(trainer.lr_find(1e-5, 1e-4, 20, 100.0, 0.0).lrs.size() == 20);
}

TEST_CASE("lr finder: fit(auto_lr_find) trains with the suggested learning rate") {
  auto model = linear_model();
  auto loader = regression_loader(16, 4);
  TrainerConfig config;
  config.max_epochs = 1;
  config.lr_finder.num_iterations = 12;
  config.lr_finder.min_lr = 1e-5;
  config.lr_finder.max_lr = 1.0;
  MappingTrainer trainer(*model, loader, nullptr, nullptr, config);
  const double expected = trainer.lr_find(1e-5, 1.0, 12).suggestion("steep");
  History history = trainer.fit(/*auto_lr_find=*/true);
  CHECK(trainer.learning_rate() == expected);
  CHECK(history[keys::kLearningRate].front() == expected);
  CHECK(trainer.config().learning_rate == expected);
}

TEST_CASE("trainer: compiled steps give the same history and latents bit for bit") {
  // Every regulariser (stability noise, smoothness probes through a double backward, alignment),
  // trainable coefficients, a partial last batch (a second signature) and accumulation (a graph that
  // accumulates into the gradients of the first).
  // Classification adds accuracy, a metric divided by the batch size (a constant of each graph).
  for (auto [k, classify] : {std::pair{int64_t{1}, false}, std::pair{int64_t{2}, false}, std::pair{int64_t{1}, true}}) {
    auto run = [&](bool compile) {
      auto model = linear_model(3);
      data::DataLoader loader = regression_loader(10, 4, 2, /*shuffle=*/true);
      if (classify) {
        Generator gen(5);
        Tensor x = randn({10, 4}, {}, &gen);
        Tensor y = uniform({10}, 0.0, 2.0, {}, &gen).to(DType::i64);
        loader = data::DataLoader(x, y, {.batch_size = 4, .shuffle = true, .seed = 2});
      }
      MappingLossOptions o;
      o.stability = std::make_shared<StabilityLoss>(0.01, 2);
      o.alignment = std::make_shared<AlignmentLoss>();
      o.trainable_coefficients = true;
      std::shared_ptr<Loss> task = std::make_shared<RegressionLoss>();
      if (classify) task = std::make_shared<ClassificationLoss>();
      auto loss = std::make_shared<MappingLoss>(task, o);
      TrainerConfig config;
      config.max_epochs = 3;
      config.seed = 11;
      config.learning_rate = 0.05;
      config.accumulation_steps = k;
      config.compile = compile;
      config.compile_fullgraph = compile;
      MappingTrainer trainer(*model, loader, nullptr, loss, config);
      const History history = trainer.fit();
      if (compile) {
        INFO(trainer.compile_report());
        CHECK(!contains(trainer.compile_report(), " 0 replays"));
        CHECK(contains(trainer.compile_report(), " 0 eager"));
      }
      std::vector<std::vector<double>> out;
      for (const std::string& key : history.keys()) out.push_back(history[key]);
      for (const auto& z : latent_values(*model)) out.emplace_back(z.begin(), z.end());
      return out;
    };
    INFO("accumulation " << k << (classify ? ", classification" : ", regression"));
    CHECK(run(false) == run(true));
  }
}
