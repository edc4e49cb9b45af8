// The umbrella header is the whole public API: this program includes nothing of the library but
// mapping/mapping_networks.h and uses every entry point the README documents, one section per part of
// the library. It is its own executable (ctest umbrella_api), so a declaration the umbrella header
// misses fails the build here rather than hiding behind another test file's includes; the small runs
// below check that the pieces also work together. Add a section when the API grows.
#include "mapping/mapping_networks.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unistd.h>
#include <vector>

namespace F = mn::nn::functional;
namespace fs = std::filesystem;

namespace {

int g_checks = 0, g_failures = 0;

void check(bool ok, const char* what) {
  ++g_checks;
  if (!ok) {
    ++g_failures;
    std::fprintf(stderr, "umbrella_api: FAILED: %s\n", what);
  }
}
#define CHECK(expr) check(static_cast<bool>(expr), #expr)

// True when fn throws an exception of type E.
template <class E, class Fn>
bool throws(Fn&& fn) {
  try {
    fn();
  } catch (const E&) {
    return true;
  } catch (...) {
    return false;
  }
  return false;
}

// A scratch directory removed at exit.
struct Scratch {
  fs::path path = fs::temp_directory_path() / ("mn_umbrella_api_" + std::to_string(::getpid()));
  Scratch() { fs::create_directories(path); }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// Same shape and the same values, bit for bit.
bool same(const mn::Tensor& a, const mn::Tensor& b) {
  return a.sizes() == b.sizes() && a.to_vector<float>() == b.to_vector<float>();
}

// A small target for the mapping sections: 4 inputs, 3 classes.
std::shared_ptr<mn::nn::Sequential> small_net() {
  return std::make_shared<mn::nn::Sequential>(std::vector<mn::nn::ModulePtr>{
      std::make_shared<mn::nn::Linear>(4, 8), std::make_shared<mn::nn::ReLU>(), std::make_shared<mn::nn::Linear>(8, 3)});
}

// ---- core: tensors, RNG, threads, allocator, errors, CUDA queries ----
void core_api() {
  mn::manual_seed(1);
  mn::Generator gen(7);
  mn::Tensor a = mn::randn({2, 3}, {}, &gen);
  mn::Tensor b = mn::rand({2, 3});
  mn::Tensor c = mn::from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, mn::Shape{2, 3});
  CHECK((a + b * c).sizes() == mn::Shape({2, 3}));
  CHECK(mn::sum(c).item() == 21.0);
  CHECK(mn::zeros({4}).to_vector<float>() == std::vector<float>(4, 0.0f));

  const int threads = mn::get_num_threads();
  mn::set_num_threads(1);
  CHECK(mn::get_num_threads() == 1);
  mn::set_num_threads(threads);

  mn::reset_peak_memory_stats();
  CHECK(mn::memory_stats().allocated_bytes.current >= 0);
  mn::empty_cache();
  CHECK(!mn::memory_summary().empty());

  CHECK(throws<mn::Error>([] { mn::zeros({2, 3}).reshape({7}); }));
  CHECK(mn::cuda_device_count() >= 0);
  // Compiled and linked, run only with a device (DeviceError without CUDA).
  [[maybe_unused]] auto on_a_gpu = [] {
    mn::cuda::Stream stream = mn::cuda::new_stream(0);
    mn::Tensor t = mn::zeros({4}).to(mn::cuda_device(0));
    mn::cuda::record_stream(t, stream);
    mn::cuda::synchronize(0);
  };
}

// ---- autograd: backward, grad mode, recomputation, gradient checks ----
void autograd_api() {
  mn::Tensor x = mn::from_vector(std::vector<float>{1, 2, 3});
  x.requires_grad_();
  mn::Tensor y = mn::sum(x * x);
  y.backward();
  CHECK(x.grad().to_vector<float>() == std::vector<float>({2, 4, 6}));
  {
    mn::autograd::NoGradGuard no_grad;
    CHECK(!(x * 2.0).requires_grad());
  }

  mn::Tensor w = mn::from_vector(std::vector<float>{0.5f, -1.0f, 2.0f});
  w.requires_grad_();
  mn::autograd::TensorList out = mn::autograd::checkpoint(
      [](const mn::autograd::TensorList& in) { return mn::autograd::TensorList{mn::tanh(in[0]) * 3.0}; }, {w});
  mn::sum(out[0]).backward();
  CHECK(w.grad().defined());

  mn::Tensor p = mn::randn({3});
  p.requires_grad_();
  auto fn = [](const std::vector<mn::Tensor>& in) { return mn::sum(mn::tanh(in[0]) * in[0]); };
  CHECK(mn::autograd::gradcheck(fn, {p}) == "");
}

// ---- nn: modules, layers, functional ops, functional_call, init, optimizers, safetensors, Progress ----
void nn_api(const fs::path& dir) {
  mn::manual_seed(2);
  auto net = small_net();
  mn::Tensor first_weight = net->named_parameters().front().second;
  mn::nn::init::xavier_uniform_(first_weight);
  CHECK(net->parameter_count() == 4 * 8 + 8 + 8 * 3 + 3);

  mn::Tensor x = mn::randn({5, 4});
  mn::Tensor labels = mn::from_vector(std::vector<int64_t>{0, 1, 2, 0, 1});
  mn::nn::optim::Adam adam(net->parameters(), {.lr = 1e-2});
  mn::nn::optim::CosineAnnealingLR schedule(adam, 10);
  adam.zero_grad();
  mn::Tensor loss = F::cross_entropy(net->forward(x), labels);
  loss.backward();
  adam.step();
  schedule.step();
  CHECK(adam.lr() < 1e-2);

  // functional_call: the module runs on the given tensors instead of its own.
  std::map<std::string, mn::Tensor> zeroed;
  for (const auto& [name, t] : net->named_parameters()) zeroed[name] = mn::zeros(t.sizes());
  CHECK(mn::sum(mn::abs(mn::nn::functional_call(*net, zeroed, x))).item() == 0.0);

  const std::string file = (dir / "net.safetensors").string();
  mn::safetensors::save(file, net->named_parameters(), {{"note", "umbrella"}});
  const mn::safetensors::File loaded = mn::safetensors::load(file);
  CHECK(loaded.metadata.at("note") == "umbrella");
  mn::nn::StateDict state;
  for (const auto& e : loaded.tensors) state[e.name] = e.tensor;
  auto copy = small_net();
  copy->load_state_dict(state);
  CHECK(same(copy->forward(x), net->forward(x)));

  mn::Progress progress("umbrella", 2, 1);
  progress.update(1);
  progress.finish();
  CHECK(progress.elapsed_seconds() >= 0.0);
}

// ---- data: Dataset, DataLoader, Fashion-MNIST, IDX files ----
void data_api(const fs::path& dir) {
  mn::data::Dataset ds{mn::rand({10, 1, 2, 2}), mn::from_vector(std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9})};
  CHECK(ds.size() == 10);
  mn::data::DataLoader loader(ds, {.batch_size = 4, .shuffle = true, .seed = 3});
  int64_t seen = 0;
  for (const mn::data::Batch& batch : loader) seen += batch.targets.size(0);
  CHECK(seen == 10);
  CHECK(mn::data::fashion_mnist_classes().size() == 10);
  CHECK(mn::data::normalize(ds.images, 0.5, 2.0).sizes() == ds.images.sizes());

  // A labels file of three samples in the IDX format.
  const fs::path idx = dir / "labels-idx1-ubyte";
  {
    std::ofstream out(idx, std::ios::binary);
    const unsigned char bytes[] = {0, 0, 8, 1, 0, 0, 0, 3, 7, 2, 9};
    out.write(reinterpret_cast<const char*>(bytes), sizeof bytes);
  }
  CHECK(mn::data::read_idx_labels(idx.string()).to_vector<int64_t>() == std::vector<int64_t>({7, 2, 9}));

  // The real data set when it is installed.
  const fs::path root = mn::data::default_fashion_mnist_root();
  if (fs::exists(root / "t10k-labels-idx1-ubyte.gz")) CHECK(mn::data::load_fashion_mnist("test").size() == 10000);
}

// ---- compile: mn::compile, nn::compile, module guards ----
void compile_api() {
  mn::manual_seed(3);
  auto net = small_net();
  mn::Tensor x = mn::randn({5, 4});
  mn::Tensor labels = mn::from_vector(std::vector<int64_t>{0, 1, 2, 0, 1});
  mn::nn::optim::SGD sgd(net->parameters(), {.lr = 0.1});
  mn::CompiledFunction step = mn::compile(
      [&](const std::vector<mn::Tensor>& in) {
        mn::Tensor loss = F::cross_entropy(net->forward(in[0]), in[1]);
        loss.backward();
        return std::vector<mn::Tensor>{loss.detach()};
      },
      mn::nn::module_guard(*net));
  double first = 0, last = 0;
  for (int i = 0; i < 3; ++i) {
    sgd.zero_grad();
    last = step({x, labels})[0].item();
    if (i == 0) first = last;
    sgd.step();
  }
  CHECK(step.stats().replays >= 1);
  CHECK(last < first);
  CHECK(!step.explain().empty());
  step.reset();

  // nn::compile(module): the forward for inference, called under NoGradGuard.
  mn::nn::CompiledModule forward = mn::nn::compile(*net, mn::CompileOptions{.fullgraph = true});
  mn::autograd::NoGradGuard no_grad;
  const mn::Tensor eager = net->forward(x);
  CHECK(same(forward(x), eager));
  CHECK(same(forward(x), eager));  // the replay
}

// ---- mapping: specs, generators, mappers, MappingModel, losses, trainer, checkpoints, profilers ----
void mapping_api(const fs::path& dir) {
  CHECK(mn::mapping::make_target("cnn2")->parameter_count() == 108618);
  CHECK(!mn::mapping::target_names().empty());
  CHECK(mn::mapping::resnet20()->parameter_count() == 272186);
  CHECK(mn::mapping::target_spec("mlp", {.mlp_hidden = {16}}).total_numel() == 784 * 16 + 16 + 16 * 10 + 10);

  const mn::mapping::ParameterSpec spec = mn::mapping::ParameterSpec::from_module(*small_net());
  CHECK(mn::mapping::layerwise_groups(spec).size() == 2);
  const auto stats = mn::mapping::benchmark_strategies(spec, 4);
  CHECK(!mn::mapping::strategy_table(stats).empty());
  CHECK(mn::mapping::profile_peak_memory([] { (void)mn::zeros({1024}); }) >= 0);
  const auto ortho = mn::mapping::OrthogonalMatrix::build(0, "umbrella", 12, 4, true);
  CHECK(ortho.apply(mn::ones({4})).sizes() == mn::Shape({12}));
  CHECK(mn::mapping::default_mapper_factory() != nullptr);

  for (const char* strategy : {"slvt", "lazy_layerwise"}) {
    mn::mapping::MappingOptions options;
    options.strategy = strategy;
    options.latent_dim = 4;
    mn::mapping::MappingModel model(small_net(), options);
    CHECK(model.run(mn::randn({2, 4})).predictions.sizes() == mn::Shape({2, 3}));
  }

  mn::manual_seed(4);
  mn::mapping::MappingOptions options;
  options.strategy = "layerwise";
  options.latent_dim = 4;
  options.seed = 5;
  mn::mapping::MappingModel model(small_net(), options);
  CHECK(model.trainable_parameter_count() == 2 * 4);
  mn::Tensor inputs = mn::randn({16, 4});
  mn::Tensor targets = mn::from_vector(std::vector<int64_t>(16, 1));
  mn::data::DataLoader train(inputs, targets, {.batch_size = 8, .shuffle = true, .seed = 1});
  mn::data::DataLoader val(inputs, targets, {.batch_size = 16});
  mn::mapping::TrainerConfig config;
  config.max_epochs = 2;
  config.learning_rate = 1e-2;
  config.scheduler = "cosine";
  config.on_nonfinite = "warn";
  auto loss = std::make_shared<mn::mapping::MappingLoss>(std::make_shared<mn::mapping::ClassificationLoss>());
  mn::mapping::MappingTrainer trainer(model, train, &val, loss, config,
                                      {std::make_shared<mn::mapping::EarlyStopping>("val_total_loss", 5)});
  const mn::mapping::History history = trainer.fit();
  CHECK(history.epochs() == 2);
  CHECK(history.contains(mn::mapping::history_keys::kValAccuracy));
  CHECK(trainer.evaluate(val).count(mn::mapping::history_keys::kValAccuracy) == 1);

  const std::string checkpoint = (dir / "mapped.safetensors").string();
  mn::mapping::save_checkpoint(checkpoint, model, trainer);
  CHECK(mn::mapping::read_checkpoint(checkpoint).trainer_state->epoch == 2);
  mn::mapping::MappingModel restored(small_net(), options);
  mn::mapping::load_checkpoint(checkpoint, restored);
  CHECK(same(restored.parameters()[0], model.parameters()[0]));
  mn::mapping::export_generated_parameters((dir / "generated.safetensors").string(), model);
  CHECK(fs::exists(dir / "generated.safetensors"));

  // interrupt(): the next fit stops at its first batch boundary with the history it has.
  trainer.set_max_epochs(3);
  struct InterruptAtFirstBatch : mn::mapping::Callback {
    void on_batch_start(mn::train::Trainer& t, int64_t) override { t.interrupt(); }
  };
  mn::mapping::MappingTrainer interrupted(model, train, &val, loss, config,
                                          {std::make_shared<InterruptAtFirstBatch>()});
  CHECK(interrupted.fit().epochs() == 0);
  CHECK(std::string(mn::mapping::TrainingInterrupted().what()).find("interrupted") != std::string::npos);

  // The compile guard of a mapping model, as in the README's compiled step.
  mn::CompiledFunction step = mn::compile(
      [&](const std::vector<mn::Tensor>& in) {
        mn::Tensor l = F::cross_entropy(model.run(in[0]).predictions, in[1]);
        l.backward();
        return std::vector<mn::Tensor>{l.detach()};
      },
      model.compile_guard());
  model.zero_grad();
  CHECK(std::isfinite(step({inputs, targets})[0].item()));
}

// ---- train: the trainer of any module, its callbacks, loggers and checkpoints ----
void train_api(const fs::path& dir) {
  fs::create_directories(dir);
  mn::manual_seed(6);
  auto net = small_net();
  mn::Tensor inputs = mn::randn({16, 4});
  mn::Tensor targets = mn::from_vector(std::vector<int64_t>{0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0});
  mn::data::DataLoader train(inputs, targets, {.batch_size = 4, .shuffle = true, .seed = 2});
  mn::data::DataLoader val(inputs, targets, {.batch_size = 8});
  const std::string checkpoint = (dir / "module.safetensors").string();
  auto sigint = std::make_shared<mn::train::StopOnSigint>();
  mn::train::Trainer trainer(
      *net, train, &val, mn::train::classification(),
      {.max_epochs = 2, .learning_rate = 1e-2, .scheduler = "step", .gradient_clip_norm = 1.0, .accumulation_steps = 2},
      {sigint, std::make_shared<mn::train::CsvLogger>((dir / "metrics.csv").string()),
       std::make_shared<mn::train::JsonLogger>((dir / "metrics.jsonl").string()),
       std::make_shared<mn::train::ModelCheckpoint>(checkpoint, 1),
       std::make_shared<mn::train::EpochSummary>(stderr), std::make_shared<mn::train::MetricLogger>(100),
       std::make_shared<mn::train::EarlyStopping>(mn::train::history_keys::kValTotalLoss, 3)});
  const mn::train::History history = trainer.fit();
  CHECK(history.epochs() == 2 && !sigint->interrupted());
  CHECK(std::isfinite(history.last(mn::train::history_keys::kValAccuracy)));
  CHECK(fs::exists(dir / "metrics.csv") && fs::exists(dir / "metrics.jsonl"));
  CHECK(mn::train::read_module_checkpoint(checkpoint).trainer_state->epoch == 2);
  auto again = small_net();
  mn::train::Trainer resumed(*again, train, &val, mn::train::classification(0.1), {.max_epochs = 2});
  resumed.load_checkpoint(checkpoint);
  CHECK(same(again->parameters()[0], net->parameters()[0]));
  CHECK(resumed.lr_find(mn::train::LRFinderOptions{.num_iterations = 4}).lrs.size() == 4);
  const mn::train::Objective l1 = mn::train::task_loss(
      [](const mn::Tensor& p, const mn::Tensor& t) { return F::mse_loss(p, t); }, "mse");
  CHECK(l1.name == "mse" && mn::train::regression().name == "RegressionLoss");
  CHECK(mn::train::classification_loss(net->forward(inputs), targets).metrics.count("accuracy") == 1);
}

// ---- dist: stores, backends, sampler, the DDP entry points ----
void dist_api() {
  mn::dist::HashStore store;
  store.set("key", std::string("value"));
  const mn::dist::Bytes got = store.get("key");
  CHECK(std::string(got.begin(), got.end()) == "value");

  auto sampler = std::make_shared<mn::dist::DistributedSampler>(10, 2, 1, true, 0);
  sampler->set_epoch(1);
  CHECK(sampler->indices().size() == 5);
  mn::data::DataLoader loader(mn::randn({10, 3}), mn::randn({10, 1}), {.batch_size = 5, .sampler = sampler});
  CHECK(loader.size() == 1);

  for (const std::string& backend : mn::dist::available_backends()) CHECK(mn::dist::is_backend_available(backend));
  CHECK(throws<mn::RuntimeError>([] { mn::dist::check_backend("ucc"); }));  // a backend no build offers
  CHECK(!mn::dist::is_initialized());
  CHECK(mn::dist::get_world_size() == 1);
  const mn::dist::EnvConfig env = mn::dist::parse_env([](const std::string& name) -> std::optional<std::string> {
    if (name == "RANK") return "1";
    if (name == "WORLD_SIZE") return "2";
    if (name == "MASTER_ADDR") return "127.0.0.1";
    if (name == "MASTER_PORT") return "29500";
    return std::nullopt;
  });
  CHECK(env.rank == 1 && env.world_size == 2);

  // The README's data-parallel program needs several processes (tests/dist runs it under mn-run):
  // compiled and linked here, not run.
  [[maybe_unused]] auto readme_ddp = [](mn::mapping::MappingModel& model, mn::data::Dataset& train, int rank,
                                        int world_size) {
    mn::dist::setup_ddp(rank, world_size, "gloo");
    auto ddp = mn::dist::wrap_ddp(model);
    auto ranks_sampler = std::make_shared<mn::dist::DistributedSampler>(train.size(), world_size, rank, true, 0);
    mn::data::DataLoader train_loader(train, {.batch_size = 64, .sampler = ranks_sampler});
    mn::mapping::MappingTrainer trainer(model, train_loader, nullptr, nullptr, {});
    trainer.set_data_parallel(&ddp);
    trainer.fit();
    auto group = mn::dist::make_process_group("gloo", mn::dist::default_store(), rank, world_size);
    group->allreduce(mn::ones({2}), mn::dist::ReduceOp::Avg)->wait();
    mn::dist::cleanup_ddp();
  };
}


// The paper's modes through the umbrella include: mapper families, LRD, pruning, fine-tuning from an
// exported file, direct LRD and pruning, augmentation and the validation split.
void paper_modes_api(const fs::path& dir) {
  mn::manual_seed(6);
  const mn::Tensor x = mn::randn({2, 4});
  for (const char* family : {"block", "dense", "srht"}) {
    mn::mapping::MappingOptions o{.latent_dim = 4, .strategy = "layerwise"};
    o.mapper = family;
    mn::mapping::MappingModel model(small_net(), o);
    CHECK(model.run(x).predictions.sizes() == mn::Shape({2, 3}));
  }
  CHECK(mn::mapping::stored_matrix_elements(mn::mapping::MapperFamily::Srht, 1024, 16) == 0);
  mn::mapping::MappingOptions lrd{.latent_dim = 4, .strategy = "lrd"};
  lrd.lrd_rank = 2;
  lrd.prune_fraction = 0.5;
  mn::mapping::MappingModel factored(small_net(), lrd);
  CHECK(factored.run(x).predictions.sizes() == mn::Shape({2, 3}));

  const std::string pretrained = (dir / "pretrained.safetensors").string();
  mn::nn::save(*small_net(), pretrained);
  mn::mapping::MappingOptions ft{.latent_dim = 4, .strategy = "finetuning"};
  ft.pretrained = pretrained;
  ft.finetune_block_size = 2;
  mn::mapping::MappingModel tuned(small_net(), ft);
  CHECK(tuned.trainable_parameter_count() == 2 * 4);
  CHECK(tuned.run(x).predictions.sizes() == mn::Shape({2, 3}));

  mn::nn::Reparametrized direct(small_net(), {.lrd_rank = 2, .prune_fraction = 0.5});
  CHECK(direct.forward(x).sizes() == mn::Shape({2, 3}));
  CHECK(direct.trainable_parameter_count() < small_net()->parameter_count());

  const mn::data::Compose augment({std::make_shared<mn::data::RandomCrop>(4, 1),
                                   std::make_shared<mn::data::RandomHorizontalFlip>()});
  mn::data::TransformContext ctx;
  ctx.samples = {0, 1};
  CHECK(augment(mn::randn({2, 1, 4, 4}), ctx).sizes() == mn::Shape({2, 1, 4, 4}));
  const auto split = mn::data::stratified_split(mn::from_vector(std::vector<int64_t>{0, 0, 1, 1}, {4}), 0.5, 0);
  CHECK(split.train.numel() == 2 && split.val.numel() == 2);
}

// ---- mixed precision: amp::GradScaler ----
void amp_api() {
  mn::manual_seed(4);
  auto net = small_net();
  mn::nn::optim::SGD sgd(net->parameters(), {.lr = 0.1});
  mn::amp::GradScaler scaler({.init_scale = 1024, .growth_interval = 1});
  mn::Tensor loss = F::cross_entropy(net->forward(mn::randn({5, 4})), mn::from_vector(std::vector<int64_t>{0, 1, 2, 0, 1}));
  scaler.scale(loss).backward();
  scaler.unscale_(sgd);
  CHECK(scaler.step(sgd));
  scaler.update();
  CHECK(scaler.get_scale() == 2048.0);
  CHECK(scaler.state_dict().at("_growth_tracker") == 0.0);
}
}  // namespace

int main() {
  Scratch scratch;
  try {
    core_api();
    autograd_api();
    nn_api(scratch.path);
    data_api(scratch.path);
    compile_api();
    amp_api();
    mapping_api(scratch.path);
    paper_modes_api(scratch.path);
    train_api(scratch.path / "train");
    dist_api();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "umbrella_api: unexpected exception: %s\n", e.what());
    return 1;
  }
  std::printf("umbrella_api: %d checks, %d failed\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
