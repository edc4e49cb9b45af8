// mn-train: trains a built-in target on Fashion-MNIST, either directly (--strategy direct: the
// target's own parameters with the chosen optimizer, like mn_demo) or as a mapping network (the
// target frozen, its parameters generated from trainable latents by the MappingTrainer).
//
//   mn-train --target cnn2 --strategy layerwise --latent-dim 672 --epochs 10 --out runs/cnn2-lwt
//   mn-train --target cnn2 --strategy layerwise --latent-dim 672 --epochs 15 --out runs/cnn2-lwt --resume
//
// --resume continues the run to --epochs in total; the options that define the run (target, strategy,
// latent dim, batch size, optimizer, seed, limit, loss, scheduler) must be the ones it started with.
// Every epoch writes DIR/metrics.csv and DIR/checkpoint.safetensors (atomically), and DIR/curves.png
// when gnuplot is installed. --resume continues from the checkpoint's epoch with the stored latents,
// optimizer state, history and random-number positions, so 1 + 1 epochs give the same latents as 2.
// With --json the last line on stdout is one JSON object summarising the run: test_accuracy (after
// the last epoch), train_accuracy (running accuracy over the last epoch's batches), trainable_params,
// target_params, compression_ratio, epochs (completed in total), seconds and steps_per_second (of
// this invocation's training, validation included), cpu_threads (see --threads), interrupted.
//
// Ctrl-C (SIGINT) in a single-process run stops training before the next batch: the epoch in progress
// is dropped, the completed ones stay in metrics.csv and the checkpoint, the summary is printed (with
// "interrupted": true), and the exit status is 130; --resume continues from there. A second Ctrl-C
// kills at once. Data-parallel ranks keep the default (the launcher stops them all), as does a process
// started with SIGINT ignored (e.g. a background job of a non-interactive shell).
//
// Data-parallel training (mapped strategies): start one process per rank with mn-run and add --backend,
//
//   mn-run --nproc-per-node 2 mn-train --backend gloo --target cnn2 --strategy layerwise --latent-dim 672
//
// Each rank reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (env://), builds the same
// model, wraps it for DDP (only the latents' gradients are all-reduced) and trains on its
// DistributedSampler shard of every epoch's shuffle; --batch-size is per rank, so the global batch is
// --batch-size x WORLD_SIZE. Rank r's shard of an epoch holds positions r, r + W, r + 2W, ... of the
// permutation a single process would use, so W ranks with batch B see, step for step, the samples of one
// process with batch W x B (when the sample count is a multiple of W) and reach the same latents up to
// floating-point rounding. The test set is split over the ranks too; the epoch metrics are sums over
// all ranks, so every rank records the same history. Only rank 0 writes metrics.csv, the checkpoint,
// the curves and stdout. --resume works as usual (every rank loads rank 0's checkpoint); a run's identity
// holds the global batch, so it may continue with another rank count of the same global batch.
// gloo trains on CPU tensors; nccl needs --device cuda (rank r uses cuda:LOCAL_RANK unless an index is
// given) and a CUDA build.
//
// --compile captures each training step (forward, loss, backward; not the optimizer step) once per
// batch shape and replays its kernels afterwards (mn::compile, nn/compile.h): same results bit for bit.
// With --backend the all-reduce is replayed inside the step. What cannot be captured runs eagerly; the end
// of the run prints what was captured, or "compiled" in the JSON summary holds that report.
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <limits>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "autograd/node.h"
#include "core/parallel.h"
#include "core/random.h"
#include "dist/ddp.h"
#include "dist/env.h"
#include "dist/process_group.h"
#include "dist/sampler.h"
#include "mapping/checkpoint.h"
#include "mapping/targets.h"
#include "mapping/trainer.h"
#include "nn/data/dataloader.h"
#include "nn/data/fashion_mnist.h"
#include "nn/functional.h"
#include "nn/optim.h"
#include "nn/progress.h"
#include "nn/safetensors.h"

using namespace mn;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

struct Options {
  std::string target = "cnn2";
  std::vector<int64_t> mlp_hidden{256, 256};
  std::string strategy = "layerwise";
  int64_t latent_dim = 256;
  int64_t epochs = 5;
  int64_t batch_size = 128;
  double lr = 0;  // 0: 1e-3 for direct training, 1e-2 for latents
  std::string optimizer = "adam";
  std::string scheduler;
  uint64_t seed = 0;
  std::string device = "cpu";
  std::string out = "out/mn-train";
  std::string data = data::default_fashion_mnist_root();
  bool resume = false;
  bool mapping_loss = false;
  bool allow_large = false;
  bool keep_cuda_cache = false;
  bool stream_layers = false;
  int64_t limit = 0;
  int threads = 0;  // 0: OpenMP's default (OMP_NUM_THREADS, else the CPUs the process may use)
  bool json = false;
  bool compile = false;
  std::string backend;  // empty: one process
  std::string on_nonfinite = "error";  // a NaN/inf loss or gradient: stop (error) or warn and train on
};

// ---- flag values ----
// CLI11's numeric checks let NaN through (every comparison with it is false), read "-1" into an unsigned
// seed as 2^64 - 1, and report a bound as a 309-digit number; these say what a flag takes and what came.

CLI::Validator whole_number_at_least(int64_t min) {
  return CLI::Validator(
      [min](std::string& text) -> std::string {
        int64_t value = 0;
        const char* end = text.data() + text.size();
        const auto [stop, error] = std::from_chars(text.data(), end, value);
        if (error == std::errc::result_out_of_range)
          return str("expected a whole number from ", min, " to ", std::numeric_limits<int64_t>::max(), ", got ",
                     text);
        if (error != std::errc() || stop != end || value < min)
          return str("expected a whole number of at least ", min, ", got '", text, "'");
        return "";
      },
      str("INT>=", min));
}

CLI::Validator unsigned_whole_number() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        uint64_t value = 0;
        const char* end = text.data() + text.size();
        const auto [stop, error] = std::from_chars(text.data(), end, value);
        if (error != std::errc() || stop != end)
          return str("expected a whole number from 0 to ", std::numeric_limits<uint64_t>::max(), ", got '", text,
                     "'");
        return "";
      },
      "UINT");
}

CLI::Validator positive_finite_number() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        char* end = nullptr;
        errno = 0;
        const double value = std::strtod(text.c_str(), &end);
        if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(value) || value <= 0 || errno == ERANGE)
          return str("expected a finite number above 0, got '", text, "'");
        return "";
      },
      "NUMBER>0");
}

// ---- Ctrl-C ----

// Set by the SIGINT handler (a lock-free atomic store is all it does); read at batch boundaries.
std::atomic<bool> g_sigint{false};
static_assert(std::atomic<bool>::is_always_lock_free);

extern "C" void on_sigint(int) { g_sigint.store(true); }

// Installs on_sigint for one SIGINT (SA_RESETHAND: a second one has the default effect) unless SIGINT
// is ignored; restores the previous action when it goes out of scope.
class SigintGuard {
 public:
  SigintGuard() {
    struct sigaction current {};
    if (sigaction(SIGINT, nullptr, &current) != 0 || current.sa_handler == SIG_IGN) return;
    struct sigaction action {};
    action.sa_handler = on_sigint;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESETHAND;
    installed_ = sigaction(SIGINT, &action, &previous_) == 0;
  }
  ~SigintGuard() {
    if (installed_) sigaction(SIGINT, &previous_, nullptr);
  }
  SigintGuard(const SigintGuard&) = delete;
  SigintGuard& operator=(const SigintGuard&) = delete;

 private:
  struct sigaction previous_ {};
  bool installed_ = false;
};

// Ends MappingTrainer::fit before the next batch once Ctrl-C was pressed (the trainer keeps the
// completed epochs and runs on_fit_end).
class StopOnSigint : public mapping::Callback {
 public:
  std::string name() const override { return "StopOnSigint"; }
  void on_batch_start(mapping::MappingTrainer&, int64_t) override {
    if (g_sigint.load()) throw mapping::TrainingInterrupted("interrupted by SIGINT");
  }
};

// The data-parallel job this process belongs to (a job of one when --backend is not given).
struct DistInfo {
  bool active = false;
  int rank = 0;
  int world_size = 1;
  std::string backend;
  bool main() const { return rank == 0; }
};

// The options that must agree between a run and its resumption (the others may change).
// batch_size is the global batch (per-rank batch x ranks): a run may resume with another rank count.
json run_identity(const Options& o, int world_size) {
  return {{"target", o.target},
          {"mlp_hidden", o.target == "mlp" ? json(o.mlp_hidden) : json(nullptr)},
          {"strategy", o.strategy},
          {"latent_dim", o.strategy == "direct" ? json(nullptr) : json(o.latent_dim)},
          {"batch_size", o.batch_size * world_size},
          {"optimizer", o.optimizer},
          {"seed", o.seed},
          {"mapping_loss", o.mapping_loss},
          {"limit", o.limit},
          {"scheduler", o.scheduler}};
}

void check_same_run(const json& saved, const Options& o, int world_size, const std::string& path) {
  const json now = run_identity(o, world_size);
  std::vector<std::string> differences;
  for (const auto& [key, value] : now.items())
    if (!saved.contains(key) || saved.at(key) != value)
      differences.push_back(str(key, ": checkpoint ", saved.contains(key) ? saved.at(key).dump() : "absent",
                                ", now ", value.dump()));
  if (!differences.empty()) {
    std::ostringstream os;
    for (const auto& d : differences) os << "\n  " << d;
    throw ValueError(str("--resume: ", path, " belongs to a different run:", os.str()));
  }
}

// --out must take files before any training: otherwise the first epoch's work is lost when its
// checkpoint cannot be written. Creates the directory and writes (then removes) a probe file.
void check_writable_directory(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  MN_CHECK(!ec, IOError, "--out ", dir.string(), ": cannot create the directory: ", ec.message());
  MN_CHECK(fs::is_directory(dir, ec), IOError, "--out ", dir.string(), " exists and is not a directory");
  const fs::path probe = dir / str(".mn-train-probe.", ::getpid());
  {
    std::ofstream out(probe);
    out << "probe\n";
    out.flush();
    MN_CHECK(out.good(), IOError, "--out ", dir.string(), ": cannot write files there: ", std::strerror(errno));
  }
  fs::remove(probe, ec);
}

data::Dataset prepare(const data::Dataset& ds, int64_t limit, Device device) {
  data::Dataset out = ds;
  if (limit > 0 && limit < ds.size())
    out = {ds.images.narrow(0, 0, limit).contiguous(), ds.labels.narrow(0, 0, limit).contiguous()};
  out.images = data::normalize(out.images);
  if (!device.is_cpu()) out = {out.images.to(device), out.labels.to(device)};
  return out;
}

// metrics.csv: rows of earlier epochs are kept on resume, later ones dropped (they are redone).
class MetricsFile {
 public:
  // Rewritten whole and atomically (a kill while it is rewritten keeps the old file); rows are then appended.
  MetricsFile(const fs::path& path, int64_t keep_epochs) : path_(path) {
    std::string text = std::string(kHeader) + '\n';
    if (keep_epochs > 0) {
      std::ifstream in(path);
      std::string line;
      std::getline(in, line);  // header
      for (int64_t kept = 0; kept < keep_epochs && std::getline(in, line); ++kept) text += line + '\n';
    }
    safetensors::write_file_atomically(path.string(), text.data(), text.size());
  }
  void append(int64_t epoch, double seconds, double train_loss, double train_acc, double test_loss,
              double test_acc, double lr) {
    std::ofstream out(path_, std::ios::app);
    out << epoch << ',' << seconds << ',' << train_loss << ',' << train_acc << ',' << test_loss << ','
        << test_acc << ',' << lr << '\n';
  }
  const fs::path& path() const { return path_; }
  static constexpr const char* kHeader = "epoch,seconds,train_loss,train_accuracy,test_loss,test_accuracy,lr";

 private:
  fs::path path_;
};

void plot(const fs::path& csv, const fs::path& png, bool quiet) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) return;
  const std::string script =
      "set datafile separator ','; set terminal png size 800,400; set output '" + png.string() +
      "'; set key autotitle columnhead; set xlabel 'epoch'; set ylabel 'accuracy'; plot '" + csv.string() +
      "' using 1:4 with linespoints, '' using 1:6 with linespoints";
  if (std::system(("gnuplot -e \"" + script + "\" 2>/dev/null").c_str()) == 0 && !quiet)
    std::printf("curves: %s\n", png.c_str());
}

double last(const mapping::History& h, const char* key) {
  return h.contains(key) && !h.at(key).empty() ? h.at(key).back() : std::nan("");
}

json num(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

struct Summary {
  double test_accuracy = 0, train_accuracy = 0;
  int64_t trainable_params = 0, target_params = 0, epochs = 0, steps = 0;
  double seconds = 0;
  int64_t bytes_per_step = 0;  // data parallel: bytes all-reduced per step
  std::string compile_report;  // --compile: CompiledFunction::explain()
  bool interrupted = false;    // Ctrl-C stopped it
  bool evaluated_only = false; // no epoch trained in this invocation: test_accuracy measured at the end
};

// ---- mapping-network training ----

// Writes metrics.csv, the checkpoint and a console line at the end of every epoch.
class EpochWriter : public mapping::Callback {
 public:
  EpochWriter(const Options& o, MetricsFile& metrics, std::string checkpoint, std::string config,
              bool progress_line)
      : options_(o),
        metrics_(metrics),
        checkpoint_(std::move(checkpoint)),
        config_(std::move(config)),
        progress_line_(progress_line) {}
  std::string name() const override { return "EpochWriter"; }
  bool saves_checkpoints() const override { return true; }
  void on_epoch_start(mapping::MappingTrainer&, int64_t) override { start_ = std::chrono::steady_clock::now(); }
  void on_epoch_end(mapping::MappingTrainer& trainer, int64_t epoch, const mapping::Metrics& m) override {
    namespace k = mapping::history_keys;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    auto get = [&](const char* key) { return m.count(key) ? m.at(key) : std::nan(""); };
    metrics_.append(epoch + 1, seconds, get(k::kTrainTaskLoss), get(k::kTrainAccuracy), get(k::kValTaskLoss),
                    get(k::kValAccuracy), get(k::kLearningRate));
    mapping::CheckpointExtras extras = mapping::checkpoint_extras(trainer, {{"program", "mn-train"}});
    extras.config = config_;
    mapping::save_checkpoint(checkpoint_, trainer.model(), extras);
    if (!progress_line_)
      std::printf("epoch %lld/%lld: train loss %.4f acc %.4f, test acc %.4f (%.1f s)\n",
                  static_cast<long long>(epoch + 1), static_cast<long long>(options_.epochs),
                  get(k::kTrainTaskLoss), get(k::kTrainAccuracy), get(k::kValAccuracy), seconds);
    std::fflush(stdout);
  }

 private:
  const Options& options_;
  MetricsFile& metrics_;
  std::string checkpoint_, config_;
  bool progress_line_;
  std::chrono::steady_clock::time_point start_;
};

std::vector<std::pair<std::string, std::vector<std::string>>> weight_bias_groups(const nn::Module& target) {
  std::vector<std::string> weights, others;
  for (const auto& [name, t] : target.named_parameters())
    (name.size() >= 6 && name.compare(name.size() - 6, 6, "weight") == 0 ? weights : others).push_back(name);
  std::vector<std::pair<std::string, std::vector<std::string>>> groups{{"weights", weights}};
  if (!others.empty()) groups.emplace_back("biases", others);
  return groups;
}

// ---- data-parallel pieces ----

// Rows `indices` (i64, CPU) of a data set, as a new data set on the same device.
data::Dataset select_rows(const data::Dataset& ds, const Tensor& indices) {
  const Tensor on_images = indices.to(ds.images.device());
  const Tensor on_labels = indices.to(ds.labels.device());
  return {index_select(ds.images, 0, on_images), index_select(ds.labels, 0, on_labels)};
}

// The test set split over the ranks without repeats (rank r: r, r + W, ...); the metrics are then
// reduced with each rank's true sample count, so they are those of the whole test set.
data::Dataset test_shard(const data::Dataset& test, const DistInfo& dist) {
  if (!dist.active) return test;
  MN_CHECK(test.size() >= dist.world_size, ValueError, "the test set has ", test.size(),
           " images, fewer than the ", dist.world_size, " ranks; raise --limit");
  std::vector<int64_t> mine;
  for (int64_t i = dist.rank; i < test.size(); i += dist.world_size) mine.push_back(i);
  return select_rows(test, from_vector(mine, Shape{static_cast<int64_t>(mine.size())}));
}

Summary train_mapped(const Options& o, Device device, const data::Dataset& train, const data::Dataset& test,
                     const fs::path& out_dir, bool tty, const DistInfo& dist) {
  const std::string checkpoint = (out_dir / "checkpoint.safetensors").string();
  std::optional<mapping::CheckpointInfo> saved;
  if (o.resume) {
    saved = mapping::read_checkpoint(checkpoint);
    // Without the trainer's state there is no epoch to continue from: resuming would silently start over
    // at epoch 0 and rewrite metrics.csv.
    MN_CHECK(saved->trainer_state.has_value(), ValueError, "--resume: ", checkpoint,
             " holds latents but no trainer state (epoch, optimizer, history), so there is no run to continue; "
             "it was not written by mn-train. Start a new run without --resume, or use another --out");
    json config;
    try {
      config = saved->config.empty() ? json::object() : json::parse(saved->config);
    } catch (const json::exception& e) {
      throw IOError(str("--resume: ", checkpoint, ": metadata 'config' is not JSON: ", e.what()));
    }
    check_same_run(config, o, dist.world_size, checkpoint);
  }

  manual_seed(o.seed);
  auto target = mapping::make_target(o.target, {o.mlp_hidden});
  mapping::MappingOptions mo;
  mo.latent_dim = o.latent_dim;
  mo.strategy = o.strategy;
  mo.seed = o.seed;
  mo.allow_large = o.allow_large;
  mo.empty_cache_on_cuda = !o.keep_cuda_cache;
  mo.stream_layers = o.stream_layers;
  if (o.strategy == "grouped") mo.groups = weight_bias_groups(*target);
  mapping::MappingModel model(target, mo);
  if (!device.is_cpu()) model.to(device);

  // One process: the loader shuffles the whole set itself. Data parallel: a DistributedSampler gives it this
  // rank's shard of every epoch (the same permutation, split over the ranks); the trainer's set_epoch
  // reaches the sampler through the loader.
  data::DataLoaderOptions train_options{o.batch_size, true, o.seed, false};
  if (dist.active) {
    train_options.shuffle = false;
    train_options.sampler =
        std::make_shared<dist::DistributedSampler>(train.size(), dist.world_size, dist.rank, true, o.seed, false);
  }
  data::DataLoader train_loader(train, train_options);
  const data::Dataset my_test = test_shard(test, dist);
  data::DataLoader test_loader(my_test, {1000, false, 0, false});
  std::shared_ptr<mapping::Loss> loss = std::make_shared<mapping::ClassificationLoss>();
  if (o.mapping_loss) loss = std::make_shared<mapping::MappingLoss>(loss);
  mapping::TrainerConfig config;
  config.max_epochs = o.epochs;
  config.optimizer = o.optimizer;
  config.learning_rate = o.lr > 0 ? o.lr : 1e-2;
  config.scheduler = o.scheduler;
  config.seed = o.seed;
  config.compile = o.compile;
  config.on_nonfinite = o.on_nonfinite;

  // Only rank 0 writes files and stdout (MetricsFile rewrites metrics.csv as it opens).
  std::optional<MetricsFile> metrics;
  if (dist.main())
    metrics.emplace(out_dir / "metrics.csv", saved && saved->trainer_state ? saved->trainer_state->epoch : 0);
  std::vector<std::shared_ptr<mapping::Callback>> callbacks;
  if (!dist.active) callbacks.push_back(std::make_shared<StopOnSigint>());
  if (tty && dist.main()) callbacks.push_back(std::make_shared<mapping::ProgressCallback>());
  if (dist.main())
    callbacks.push_back(std::make_shared<EpochWriter>(o, *metrics, checkpoint,
                                                      run_identity(o, dist.world_size).dump(), tty));
  mapping::MappingTrainer trainer(model, train_loader, &test_loader, loss, config, callbacks);
  if (o.resume) {
    mapping::load_checkpoint(checkpoint, model, &trainer);  // in place: the latents stay the same tensors
    if (!o.json && dist.main())
      std::printf("resumed %s at epoch %lld\n", checkpoint.c_str(), static_cast<long long>(trainer.epoch()));
  }

  // Wrapped after the move and the resume: the wrapper broadcasts rank 0's latents, checks that every
  // rank built the same mappers and hooks the latents' gradients. The trainer calls the model directly;
  // the hooks all-reduce the latent gradients during each backward.
  std::optional<dist::DistributedDataParallel> ddp;
  if (dist.active) {
    ddp.emplace(dist::wrap_ddp(model));
    trainer.set_metrics_reducer(dist::average_metrics(device));
  }

  if ((!o.json || tty) && dist.main()) {
    std::printf(
        "%s %s: %lld target parameters from %lld trainable (%.1fx), %lld train / %lld test images, %s lr %g\n",
        o.target.c_str(), o.strategy.c_str(), static_cast<long long>(model.target_parameter_count()),
        static_cast<long long>(model.trainable_parameter_count()), model.compression_ratio(),
        static_cast<long long>(train.size()), static_cast<long long>(test.size()), o.optimizer.c_str(),
        trainer.learning_rate());
    if (ddp)
      std::printf("data parallel: %d ranks (%s), batch %lld per rank = %lld global, %lld steps per epoch, "
                  "%zu bytes all-reduced per step\n",
                  dist.world_size, dist.backend.c_str(), static_cast<long long>(o.batch_size),
                  static_cast<long long>(o.batch_size * dist.world_size),
                  static_cast<long long>(train_loader.size()), ddp->bytes_per_step());
  }
  const int64_t first_epoch = trainer.epoch();
  const auto start = std::chrono::steady_clock::now();
  const mapping::History history = trainer.fit();
  Summary s;
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  s.epochs = trainer.epoch();
  s.steps = (trainer.epoch() - first_epoch) * train_loader.size();
  s.test_accuracy = last(history, mapping::history_keys::kValAccuracy);
  s.train_accuracy = last(history, mapping::history_keys::kTrainAccuracy);
  s.trainable_params = model.trainable_parameter_count();
  s.target_params = model.target_parameter_count();
  if (ddp) s.bytes_per_step = static_cast<int64_t>(ddp->bytes_per_step());
  s.compile_report = trainer.compile_report();
  s.interrupted = !dist.active && g_sigint.load() && trainer.epoch() < config.max_epochs;
  if (trainer.epoch() == first_epoch && !s.interrupted) {
    // Nothing trained in this invocation (--epochs 0, or the run already has them all): the test
    // accuracy is measured now instead of read from a history that may be empty.
    mapping::Metrics m = trainer.validate(test_loader);
    if (ddp) m = dist::average_metrics(device)(m, my_test.size());
    s.test_accuracy = m.at(mapping::history_keys::kValAccuracy);
    s.evaluated_only = true;
  }
  return s;
}

// ---- direct training ----

std::unique_ptr<nn::optim::Optimizer> make_optimizer(const std::string& name, std::vector<Tensor> params,
                                                     double lr) {
  if (name == "adam") return std::make_unique<nn::optim::Adam>(std::move(params), nn::optim::AdamOptions{lr});
  if (name == "adamw") {
    nn::optim::AdamOptions a = nn::optim::AdamW::with_default_decay();
    a.lr = lr;
    return std::make_unique<nn::optim::AdamW>(std::move(params), a);
  }
  if (name == "sgd") return std::make_unique<nn::optim::SGD>(std::move(params), nn::optim::SGDOptions{lr, 0.9});
  throw ValueError(str("Unknown optimizer '", name, "'; available: adam, adamw, sgd"));
}

// Accuracy and mean cross-entropy over a data set, without gradients, in eval mode.
std::pair<double, double> evaluate(nn::Module& net, const data::Dataset& ds) {
  autograd::NoGradGuard no_grad;
  net.eval();
  double loss_sum = 0;
  int64_t correct = 0;
  data::DataLoader loader(ds, {1000, false, 0, false});
  for (const data::Batch& b : loader) {
    Tensor logits = net.forward(b.inputs);
    loss_sum +=
        nn::functional::cross_entropy(logits, b.targets).item() * static_cast<double>(b.targets.size(0));
    correct += static_cast<int64_t>(sum(eq(argmax(logits, 1), b.targets)).item());
  }
  net.train();
  const double n = static_cast<double>(ds.size());
  return {static_cast<double>(correct) / n, loss_sum / n};
}

// The direct run's checkpoint: the target's state dict under its own names, optimizer/<key>, and the
// epoch, history and exact lr as JSON metadata.
void save_direct(const std::string& path, nn::Module& net, const nn::optim::Optimizer& opt, int64_t epoch,
                 const json& history, const json& identity) {
  safetensors::NamedTensors tensors;
  for (const auto& [name, t] : net.state_dict()) tensors.emplace_back(name, t.detach());
  for (const auto& [key, t] : opt.state_dict()) tensors.emplace_back("optimizer/" + key, t);
  safetensors::StringMap meta{{"format", json("mn-train.direct").dump()},
                              {"epoch", json(epoch).dump()},
                              {"optimizer_lr", json(opt.lr()).dump()},
                              {"history", history.dump()},
                              {"config", identity.dump()}};
  safetensors::save(path, tensors, meta);
}

// --on-nonfinite for direct training (the mapped path hands it to the MappingTrainer): a step whose loss
// or gradients hold a NaN or an infinity stops the run, or is reported once per epoch.
void report_nonfinite(const Options& o, float loss, int64_t epoch, int64_t batch, int64_t global_step,
                      int64_t& reported) {
  const std::string what =
      str("non-finite ", std::isfinite(loss) ? "gradients" : str("loss (", std::isnan(loss) ? std::string("nan") : str(loss), ")"), " at epoch ", epoch + 1, "/",
          o.epochs, ", batch ", batch + 1, " (global step ", global_step, ", counted from 0)");
  if (o.on_nonfinite == "error")
    throw RuntimeError(str(what, "; lower --lr or check the data, or pass --on-nonfinite warn to train on"));
  if (reported++ == 0) std::fprintf(stderr, "warning: %s (training on; reported once per epoch)\n", what.c_str());
}

Summary train_direct(const Options& o, Device device, const data::Dataset& train, const data::Dataset& test,
                     const fs::path& out_dir, bool tty) {
  const std::string checkpoint = (out_dir / "checkpoint.safetensors").string();
  manual_seed(o.seed);
  auto net = mapping::make_target(o.target, {o.mlp_hidden});
  if (!device.is_cpu()) net->to(device);
  auto optimizer = make_optimizer(o.optimizer, net->parameters(), o.lr > 0 ? o.lr : 1e-3);
  MN_CHECK(o.scheduler.empty(), ValueError, "--scheduler is only supported for mapped strategies");
  int64_t first_epoch = 0;
  json history = {
      {"train_loss", json::array()}, {"train_accuracy", json::array()}, {"test_accuracy", json::array()}};
  if (o.resume) {
    MN_CHECK(fs::exists(checkpoint), IOError, "checkpoint not found: ", checkpoint);
    safetensors::File file = safetensors::load(checkpoint);
    // One metadata value as JSON; a missing key or a value that is not JSON names the file and the key.
    auto metadata = [&](const char* key) {
      auto it = file.metadata.find(key);
      MN_CHECK(it != file.metadata.end(), IOError, "--resume: ", checkpoint, " lacks the metadata key '", key,
               "' of a direct-training checkpoint of mn-train");
      try {
        return json::parse(it->second);
      } catch (const json::exception& e) {
        throw IOError(str("--resume: ", checkpoint, ": metadata '", key, "' is not JSON: ", e.what()));
      }
    };
    MN_CHECK(file.metadata.count("format") && metadata("format") == "mn-train.direct", ValueError, "--resume: ",
             checkpoint, " is not a direct-training checkpoint of mn-train");
    check_same_run(metadata("config"), o, 1, checkpoint);
    const json saved_lr = metadata("optimizer_lr"), saved_epoch = metadata("epoch");
    history = metadata("history");
    MN_CHECK(saved_lr.is_number() && saved_epoch.is_number_integer() && saved_epoch.get<int64_t>() >= 0 &&
                 history.is_object(),
             IOError, "--resume: ", checkpoint, ": malformed metadata (optimizer_lr ", saved_lr.dump(), ", epoch ",
             saved_epoch.dump(), ", history of type ", history.type_name(), ")");
    for (const char* key : {"train_loss", "train_accuracy", "test_accuracy"})
      MN_CHECK(history.contains(key) && history.at(key).is_array(), IOError, "--resume: ", checkpoint,
               ": metadata 'history' lacks the list '", key, "'");
    nn::StateDict state;
    nn::optim::OptimizerState opt_state;
    for (const auto& e : file.tensors) {
      if (e.name.rfind("optimizer/", 0) == 0)
        opt_state[e.name.substr(10)] = e.tensor.to(device);
      else
        state[e.name] = e.tensor.to(device);
    }
    // Checked before the network changes, so a bad optimizer state leaves nothing half loaded.
    optimizer->check_state_dict(opt_state, str("checkpoint ", checkpoint, ": optimizer state"));
    {
      autograd::NoGradGuard no_grad;
      net->load_state_dict(state);
    }
    optimizer->load_state_dict(opt_state);
    optimizer->set_lr(saved_lr.get<double>());
    first_epoch = saved_epoch.get<int64_t>();
    if (!o.json)
      std::printf("resumed %s at epoch %lld\n", checkpoint.c_str(), static_cast<long long>(first_epoch));
  }
  if (!o.json || tty)
    std::printf("%s direct: %lld parameters, %lld train / %lld test images, %s lr %g\n", o.target.c_str(),
                static_cast<long long>(net->parameter_count()), static_cast<long long>(train.size()),
                static_cast<long long>(test.size()), o.optimizer.c_str(), optimizer->lr());

  MetricsFile metrics(out_dir / "metrics.csv", first_epoch);
  data::DataLoader loader(train, {o.batch_size, true, o.seed, false});
  // One step without the optimizer: returns the loss and the number of correct predictions.
  auto backward_step = [&](const std::vector<Tensor>& in) {
    Tensor logits = net->forward(in[0]);
    Tensor loss = nn::functional::cross_entropy(logits, in[1]);
    loss.backward();
    autograd::NoGradGuard no_grad;
    return std::vector<Tensor>{loss.detach(), sum(eq(argmax(logits, 1), in[1]))};
  };
  std::optional<CompiledFunction> compiled;
  if (o.compile) compiled.emplace(backward_step, nn::module_guard(*net));
  Summary s;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t epoch = first_epoch; epoch < o.epochs && !s.interrupted; ++epoch) {
    loader.set_epoch(static_cast<uint64_t>(epoch));
    const double epoch_lr = optimizer->lr();
    Progress progress(str("epoch ", epoch + 1, "/", o.epochs), loader.size());
    const auto epoch_start = std::chrono::steady_clock::now();
    double loss_sum = 0;
    int64_t correct = 0, seen = 0, step = 0, batch = 0, nonfinite_steps = 0;
    for (const data::Batch& b : loader) {
      if (g_sigint.load()) {  // as the mapped path: the epoch in progress is dropped
        s.interrupted = true;
        break;
      }
      optimizer->zero_grad();
      std::vector<Tensor> out = compiled ? (*compiled)({b.inputs, b.targets}) : backward_step({b.inputs, b.targets});
      out.push_back(nn::optim::nonfinite_grad_probe(net->parameters()));  // 0, or NaN for a NaN/inf gradient
      optimizer->step();
      const std::vector<float> values = stack(out, 0).to_vector<float>();  // one host read per step
      if (!std::isfinite(values[0]) || !std::isfinite(values[2]))
        report_nonfinite(o, values[0], epoch, batch, epoch * loader.size() + batch, nonfinite_steps);
      ++batch;
      loss_sum += static_cast<double>(values[0]) * static_cast<double>(b.targets.size(0));
      correct += static_cast<int64_t>(values[1]);
      seen += b.targets.size(0);
      ++s.steps;
      if (tty) progress.update(++step, str("loss ", loss_sum / static_cast<double>(seen)));
    }
    if (s.interrupted) {
      if (tty) progress.finish("interrupted");
      break;
    }
    const auto [test_acc, test_loss] = evaluate(*net, test);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_start).count();
    const double train_loss = loss_sum / static_cast<double>(seen);
    const double train_acc = static_cast<double>(correct) / static_cast<double>(seen);
    if (tty)
      progress.finish(str("loss ", train_loss, " train acc ", train_acc, " test acc ", test_acc));
    else
      std::printf("epoch %lld/%lld: train loss %.4f acc %.4f, test acc %.4f (%.1f s)\n",
                  static_cast<long long>(epoch + 1), static_cast<long long>(o.epochs), train_loss, train_acc,
                  test_acc, seconds);
    history["train_loss"].push_back(num(train_loss));
    history["train_accuracy"].push_back(num(train_acc));
    history["test_accuracy"].push_back(num(test_acc));
    metrics.append(epoch + 1, seconds, train_loss, train_acc, test_loss, test_acc, epoch_lr);
    save_direct(checkpoint, *net, *optimizer, epoch + 1, history, run_identity(o, 1));
    std::fflush(stdout);
  }
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  s.epochs = static_cast<int64_t>(history.at("test_accuracy").size());
  auto back = [&](const char* key) {
    const json& v = history.at(key);
    return v.empty() || v.back().is_null() ? std::nan("") : v.back().get<double>();
  };
  s.test_accuracy = back("test_accuracy");
  s.train_accuracy = back("train_accuracy");
  s.trainable_params = s.target_params = net->parameter_count();
  if (compiled) s.compile_report = compiled->explain();
  if (s.steps == 0 && !s.interrupted) {  // as in train_mapped: nothing trained now, so evaluate
    s.test_accuracy = evaluate(*net, test).first;
    s.evaluated_only = true;
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train a built-in target on Fashion-MNIST, directly or as a mapping network"};
  Options o;
  app.add_option("--target", o.target, "target network")
      ->check(CLI::IsMember(mapping::target_names()))
      ->capture_default_str();
  app.add_option("--mlp-hidden", o.mlp_hidden, "hidden widths of --target mlp")
      ->check(whole_number_at_least(1))
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--strategy", o.strategy, "direct, or how the latents generate the parameters")
      ->check(CLI::IsMember({"direct", "slvt", "layerwise", "lazy_layerwise", "grouped"}))
      ->capture_default_str();
  app.add_option("--latent-dim", o.latent_dim, "latent length per group (grouped: weights and biases)")
      ->check(whole_number_at_least(1))
      ->capture_default_str();
  app.add_option("--epochs", o.epochs, "train up to this many epochs in total (0: only evaluate)")
      ->check(whole_number_at_least(0))
      ->capture_default_str();
  app.add_option("--batch-size", o.batch_size, "batch size; with --backend per rank (global = this x WORLD_SIZE)")
      ->check(whole_number_at_least(1))
      ->capture_default_str();
  app.add_option("--lr", o.lr, "learning rate (default 1e-3 direct, 1e-2 mapped)")->check(positive_finite_number());
  app.add_option("--optimizer", o.optimizer, "optimizer")
      ->check(CLI::IsMember({"adam", "adamw", "sgd"}))
      ->capture_default_str();
  app.add_option("--scheduler", o.scheduler, "learning-rate schedule of mapped runs (default none)")
      ->check(CLI::IsMember({"", "cosine", "step", "exponential", "plateau"}));
  app.add_option("--seed", o.seed, "seed of the target init, mappers, latents and shuffling")
      ->check(unsigned_whole_number())
      ->capture_default_str();
  app.add_option("--device", o.device, "cpu, cuda[:N] or auto (cuda when a GPU is usable)")->capture_default_str();
  app.add_option("--out", o.out, "directory for metrics.csv, checkpoint.safetensors and curves.png")
      ->capture_default_str();
  app.add_option("--data", o.data, "Fashion-MNIST directory")->capture_default_str();
  app.add_flag("--resume", o.resume, "continue from OUT/checkpoint.safetensors");
  app.add_flag("--mapping-loss", o.mapping_loss, "add the stability, smoothness and alignment regularisers");
  app.add_flag("--allow-large", o.allow_large, "allow fixed projections above 1e8 elements");
  app.add_flag("--stream-layers", o.stream_layers,
               "generate each layer's parameters just before it runs and again in backward: one layer's "
               "parameters in memory instead of all (layerwise / lazy_layerwise; a second forward per step)");
  app.add_flag("--keep-cuda-cache", o.keep_cuda_cache,
               "lazy_layerwise on cuda: keep the allocator's cache between groups (no per-group device sync "
               "and re-allocation, and --compile can capture; reserved memory then stays at the peak)");
  app.add_option("--limit", o.limit, "use only the first N training and test images (0 = all)")
      ->check(whole_number_at_least(0));
  app.add_option("--threads", o.threads,
                 "threads of the CPU kernels (default: OMP_NUM_THREADS, else every CPU this process may use); "
                 "on a shared machine, the free cores")
      ->check(whole_number_at_least(1));
  app.add_flag("--json", o.json, "print a JSON summary as the last line of stdout");
  app.add_flag("--compile", o.compile,
               "capture each training step (forward, loss, backward) once per batch shape and replay it "
               "(mn::compile); prints what was captured at the end");
  app.add_option("--backend", o.backend,
                 "data-parallel training under mn-run: gloo (CPU) or nccl (--device cuda); default: one process");
  app.add_option("--on-nonfinite", o.on_nonfinite,
                 "a step whose loss or gradients hold NaN or inf: error (stop, naming the step) or warn")
      ->check(CLI::IsMember({"error", "warn"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  DistInfo dist;
  try {
    if (o.threads > 0) set_num_threads(o.threads);
    // --device auto: the GPU when there is one, except for gloo ranks, which train on the CPU.
    Device device = o.device == "auto" && o.backend == "gloo" ? kCPU : Device::parse(o.device);
    if (!o.backend.empty()) {
      MN_CHECK(o.backend == "gloo" || o.backend == "nccl", ValueError, "--backend '", o.backend,
               "' is not supported; use gloo (CPU) or nccl (CUDA), or leave --backend out for one process");
      MN_CHECK(o.strategy != "direct", ValueError,
               "--backend: data-parallel training needs a mapped strategy; the DDP wrapper synchronises a "
               "MappingModel's latents, and --strategy direct trains a plain module (not supported)");
      if (o.backend == "nccl") {
        MN_CHECK(dist::is_backend_available("nccl"), RuntimeError,
                 "--backend nccl needs a CUDA build with NCCL, and this build has no CUDA; use --backend gloo "
                 "(CPU)");
        MN_CHECK(device.is_cuda(), ValueError,
                 "--backend nccl moves CUDA tensors only; add --device cuda, or use --backend gloo for CPU training");
        MN_CHECK(cuda_available(), DeviceError, "--device ", o.device,
                 ": CUDA is not available here (no usable GPU), so --backend nccl cannot run; use --backend gloo");
      } else {
        MN_CHECK(device.is_cpu(), ValueError, "--backend gloo trains on the CPU; use --backend nccl with --device ",
                 o.device, ", or --device cpu");
      }
      dist::EnvConfig env;
      try {
        env = dist::from_env();
      } catch (const Error& e) {
        throw ValueError(str("--backend ", o.backend, " runs one process per rank under a launcher (mn-run "
                             "--nproc-per-node N mn-train --backend ", o.backend, " ...): ", e.what()));
      }
      // One GPU per rank: plain "cuda" means this rank's local device.
      if (o.backend == "nccl" && (o.device == "cuda" || o.device == "auto")) device = cuda_device(env.local_rank);
      dist.active = true;
      dist.rank = env.rank;
      dist.world_size = env.world_size;
      dist.backend = o.backend;
    }
    if (device.is_cuda())
      MN_CHECK(cuda_available() && device.index < cuda_device_count(), DeviceError, "--device ", o.device,
               ": CUDA is not available here (built without CUDA, or no usable GPU); use --device cpu");
    const bool tty = dist.main() && isatty(STDOUT_FILENO) != 0;
    const fs::path out_dir(o.out);
    check_writable_directory(out_dir);
    if (dist.active) dist::setup_ddp(dist.rank, dist.world_size, dist.backend);
    const data::Dataset train = prepare(data::load_fashion_mnist("train", o.data), o.limit, device);
    const data::Dataset test = prepare(data::load_fashion_mnist("test", o.data), o.limit, device);

    std::optional<SigintGuard> sigint;
    if (!dist.active) sigint.emplace();
    const Summary s = o.strategy == "direct" ? train_direct(o, device, train, test, out_dir, tty)
                                             : train_mapped(o, device, train, test, out_dir, tty, dist);
    sigint.reset();
    if (dist.active) dist::cleanup_ddp();
    if (!dist.main()) return 0;  // rank 0 reports for the job
    plot(out_dir / "metrics.csv", out_dir / "curves.png", o.json);
    if (o.json) {
      json j = {{"target", o.target},
                {"strategy", o.strategy},
                {"test_accuracy", num(s.test_accuracy)},
                {"train_accuracy", num(s.train_accuracy)},
                {"trainable_params", s.trainable_params},
                {"target_params", s.target_params},
                {"compression_ratio",
                 num(static_cast<double>(s.target_params) / static_cast<double>(s.trainable_params))},
                {"epochs", s.epochs},
                {"seconds", s.seconds},
                {"steps_per_second", num(s.seconds > 0 ? static_cast<double>(s.steps) / s.seconds : 0.0)},
                {"cpu_threads", get_num_threads()},
                {"interrupted", s.interrupted}};
      if (!s.compile_report.empty()) j["compiled"] = s.compile_report;
      if (dist.active) {
        j["world_size"] = dist.world_size;
        j["backend"] = dist.backend;
        j["global_batch_size"] = o.batch_size * dist.world_size;
        j["bytes_per_step"] = s.bytes_per_step;
      }
      std::printf("%s\n", j.dump().c_str());
    } else if (s.evaluated_only && std::isnan(s.train_accuracy)) {
      std::printf("test accuracy %.2f%% without training (0 epochs)\n", 100.0 * s.test_accuracy);
    } else {
      std::printf("test accuracy %.2f%%, train accuracy %.2f%% after %lld epochs (%.1f s); %s\n",
                  100.0 * s.test_accuracy, 100.0 * s.train_accuracy, static_cast<long long>(s.epochs),
                  s.seconds, (out_dir / "metrics.csv").c_str());
      if (!s.compile_report.empty()) std::printf("%s", s.compile_report.c_str());
    }
    if (s.interrupted) {
      std::fprintf(stderr, "mn-train: interrupted (SIGINT) after %lld epochs; --resume continues from %s\n",
                   static_cast<long long>(s.epochs), (out_dir / "checkpoint.safetensors").c_str());
      return 130;
    }
  } catch (const std::exception& e) {
    // Under a launcher, name the rank (also for errors before the group exists).
    const char* rank = std::getenv("RANK");
    if (dist.active)
      std::fprintf(stderr, "mn-train: rank %d: %s\n", dist.rank, e.what());
    else if (!o.backend.empty() && rank != nullptr && *rank != '\0')
      std::fprintf(stderr, "mn-train: rank %s: %s\n", rank, e.what());
    else
      std::fprintf(stderr, "mn-train: %s\n", e.what());
    return 1;
  }
  return 0;
}
