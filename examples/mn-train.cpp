// mn-train: trains a built-in target on Fashion-MNIST, either directly (--strategy direct: the
// target's own parameters with the chosen optimizer, like mn-demo) or as a mapping network (the
// target frozen, its parameters generated from trainable latents by the MappingTrainer).
//
//   mn-train --target cnn2 --strategy layerwise --latent-dim 672 --epochs 10 --out runs/cnn2-lwt
//   mn-train --out runs/cnn2-lwt --resume --epochs 15
//
// --resume continues the run in --out from its checkpoint: the options that define the run (target,
// strategy, latent dim, batch size, optimizer, lr, seed, limit, loss and its weights, scheduler, the
// mapper's alpha, clipping, accumulation, early stopping, weight decay, --mapper, --rank, --prune, the
// fine-tuning options, --classes, augmentation, validation split) and its --epochs come from the
// checkpoint, so `mn-train --out DIR --resume` is enough; a flag given with --resume must agree with the
// run (--epochs may differ: the run then continues to that many epochs in total). A checkpoint written
// before an option existed ran with its default.
// Every epoch writes DIR/metrics.csv and DIR/checkpoint.safetensors (atomically); the end of the run
// draws DIR/curves.png (loss and accuracy per epoch, through DIR/curves.gp) with gnuplot, or warns on
// stderr that gnuplot is missing. --resume continues from the checkpoint's epoch with the stored latents,
// optimizer state, history and random-number positions, so 1 + 1 epochs give the same latents as 2.
// With --json the last line on stdout is one JSON object summarising the run: test_accuracy (after
// the last epoch), train_accuracy (running accuracy over the last epoch's batches), trainable_params,
// target_params, compression_ratio, epochs (completed in total), seconds and steps_per_second (of
// this invocation's training, validation included), cpu_threads (see --threads), interrupted,
// stopped_early (--early-stopping-patience), weights and curves (the files written); with
// --checkpoint-every also checkpoint_saves and checkpoint_seconds (files written and time spent writing).
//
// Validation: by default the trainer's validation pass runs on the test set (metrics.csv's test_*
// columns are its val_* metrics), so --early-stopping-patience and --scheduler plateau then select on
// the test set. --val-split F holds out a stratified fraction F of the (--limit'ed) training images
// instead (nn/data/split.h, fixed by --seed): metrics.csv then has val_loss and val_accuracy, early
// stopping and the plateau schedule read them, and the test set is evaluated once after training
// (test_accuracy, test_loss; --json adds val_accuracy, val_loss and their per-epoch lists).
// --augment crop,flip transforms every training batch anew each epoch (nn/data/transforms.h): crop =
// RandomCrop(28, padding 2, fill black), flip = RandomHorizontalFlip(0.5), both pure functions of
// (--seed, epoch, image), so --resume and data-parallel runs see the same augmented images.
//
// --write-config FILE saves the options (defaults, --config's, the command line's) as TOML and exits;
// --config FILE runs them, flags given overriding the file. --version prints the version.
//
// Ctrl-C (SIGINT) in a single-process run stops training before the next batch: the epoch in progress
// is dropped, the completed ones stay in metrics.csv and the checkpoint, the summary is printed (with
// "interrupted": true), and the exit status is 130; --resume continues from there. A second Ctrl-C
// kills at once. Data-parallel ranks keep the default (the launcher stops them all), as does a process
// started with SIGINT ignored (e.g. a background job of a non-interactive shell).
//
// Data-parallel training (any strategy): start one process per rank with mn-run and add --backend,
//
//   mn-run --nproc-per-node 2 mn-train --backend gloo --target cnn2 --strategy layerwise --latent-dim 672
//
// Each rank reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (env://), builds the same
// model, wraps it for DDP (a mapped run all-reduces only the latents' gradients, a direct one the
// target's) and trains on its DistributedSampler shard of every epoch's shuffle; --batch-size is per
// rank, so the global batch is --batch-size x WORLD_SIZE. Rank r's shard of an epoch holds positions r, r + W, r + 2W, ... of the
// permutation a single process would use, so W ranks with batch B see, step for step, the samples of one
// process with batch W x B (when the sample count is a multiple of W) and reach the same latents up to
// floating-point rounding. The test set is split over the ranks too; the epoch metrics are sums over
// all ranks, so every rank records the same history. Only rank 0 writes metrics.csv, the checkpoint,
// the curves and stdout. --resume works as usual (every rank loads rank 0's checkpoint); a run's identity
// holds the global batch, so it may continue with another rank count of the same global batch.
// gloo trains on CPU tensors; nccl needs --device cuda (rank r uses cuda:LOCAL_RANK unless an index is
// given) and a CUDA build.
// mpi (builds with MPI) trains on CPU tensors too, started by mpirun instead of mn-run:
//   mpirun -np 2 mn-train --backend mpi ...
// rank and size come from RANK / WORLD_SIZE when set, else from Open MPI's variables or MPI itself; no
// MASTER_ADDR or MASTER_PORT (dist::launch_env).
//
// --compile captures each training step (forward, loss, backward; not the optimizer step) once per
// batch shape and replays its kernels afterwards (mn::compile, nn/compile.h): same results bit for bit.
// With --backend the all-reduce is replayed inside the step. What cannot be captured runs eagerly; the end
// of the run prints what was captured, or "compiled" in the JSON summary holds that report.
//
// Transfer: --strategy finetuning --pretrained FILE generates the target as FILE's weights plus
// --finetune-alpha x the latents' modulation, one element per --block-size parameters (--alpha stays
// the mapper's own modulation); the checkpoint records FILE's path and content hash, and --resume refuses
// a changed FILE. --strategy direct --init-from FILE starts from FILE's weights. --classes 0-4 (or 5,7,9)
// trains and tests on those labels only (before --limit); the model keeps its 10 outputs. All of them
// are run options (recorded in the config, checked by --resume). examples/transfer.sh compares them.
//
// Mid-epoch checkpoints and restarts: --checkpoint-every STEPS also writes the checkpoint (atomically)
// after every STEPS optimizer steps inside an epoch, with the position in the epoch (batches trained), the
// epoch's metric sums so far (every rank's under --backend), the global step and, as always, the optimizer
// state, the random generators' positions and the callbacks' and scheduler's state; --resume from it
// continues at the next batch and ends with the checkpoint and metrics.csv of the uninterrupted run, byte
// for byte (metrics.csv's seconds column aside). It does not define the run: a resume may change or drop
// it. --auto-resume resumes when --out holds a checkpoint and starts the run otherwise, so one command
// line serves the first start and every restart (mn-run --max-restarts); a checkpoint of another run is
// refused as with --resume.
//
// Mixed precision: --amp bf16|f16 sets TrainerConfig::amp (nn/train/config.h); f16 scales the loss
// (amp::GradScaler), skips steps whose gradients overflow and counts them (train_skipped_steps in the
// history), and keeps the scaler's state in the checkpoint. A run option: recorded, checked by --resume.
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "cli_checks.h"
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
#include "nn/reparametrize.h"
#include "nn/data/split.h"
#include "nn/data/transforms.h"
#include "nn/safetensors.h"
#include "nn/serialize.h"
#include "nn/train/interrupt.h"
#include "nn/train/loggers.h"
#include "nn/train/trainer.h"

using namespace mn;
using namespace mn::examples;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

struct Options {
  std::string target = "cnn2";
  std::vector<int64_t> mlp_hidden{256, 256};
  std::string strategy = "layerwise";
  int64_t latent_dim = 256;
  // Per-group latent lengths (MappingOptions::group_latent_dims): --latent-dims "NAME=L,..." names some
  // groups (latent_dim is the rest's); --latent-budget T shares T over all groups with
  // mapping::capped_latent_dims. Mapped strategies layerwise, lazy_layerwise and grouped only.
  std::string latent_dims;
  int64_t latent_budget = 0;  // 0: off
  int64_t epochs = 5;
  int64_t batch_size = 128;
  double lr = 0;  // 0: 1e-3 for direct training, 1e-2 for latents
  std::string optimizer = "adam";
  bool amsgrad = false;  // adam, adamw
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
  int threads = 0;  // 0: the library's default (OMP_NUM_THREADS, else the free CPUs, core/parallel.h)
  bool json = false;
  bool compile = false;
  std::string backend;  // empty: one process
  std::string on_nonfinite = "error";  // a NaN/inf loss or gradient: stop (error) or warn and train on
  std::string export_path;  // the target's weights after training; empty: OUT/weights.safetensors
  // Trainer knobs; their defaults are the library's.
  double alpha = 0.01;                // MappingOptions::alpha (mapped runs)
  double lambda_stability = 0.1;      // MappingLossOptions weights (--mapping-loss); 0 turns a term off
  double lambda_smoothness = 0.01;
  double lambda_alignment = 0.01;
  double clip_norm = 0;               // TrainerConfig::gradient_clip_norm; 0: off
  double clip_value = 0;              // TrainerConfig::gradient_clip_value; 0: off
  int64_t accumulation_steps = 1;
  int64_t early_stopping_patience = 0;  // EarlyStopping on val_total_loss; 0: off
  double weight_decay = -1;           // below 0: the optimizer's usual (see effective_weight_decay)
  std::string write_config;           // --write-config
  // --mapper: the family of the mappers' fixed matrices (MappingOptions::mapper): block, dense, srht.
  std::string mapper = "block";
  // LRD and pruning add-ons (paper Table 8): --rank factors every 2-D weight [m, n] with rank < min(m, n)
  // (--strategy lrd: generated as U V^T, mapping/lrd.h; --strategy direct: trained as factors U, V,
  // nn/reparametrize.h); --prune masks that fraction of every weight tensor by initial magnitude.
  int64_t rank = 0;   // 0: no factorisation
  double prune = 0;   // 0: no pruning; else in [0, 1)
  // Transfer (issue 19): --strategy finetuning adds the latents' block modulation to --pretrained's
  // weights; --init-from starts a direct run from a file; --classes keeps some labels (train and test).
  std::string pretrained;             // MappingOptions::pretrained (finetuning)
  int64_t block_size = 250;           // MappingOptions::finetune_block_size (finetuning)
  double finetune_alpha = 0.01;       // MappingOptions::finetune_alpha (finetuning)
  std::string init_from;              // direct: the target's starting weights (a safetensors state dict)
  std::string classes;                // "0-4", "5,7,9", "0-2,8"; empty: all ten
  bool finetuning() const { return strategy == "finetuning"; }
  // Augmentation and the validation split (issue 19).
  std::vector<std::string> augment;   // --augment: "crop" (RandomCrop 28, padding 2), "flip" (p 0.5); empty: off
  double val_split = 0;               // --val-split F: validate on a stratified F of the training set (0: test set)
  double label_smoothing = 0;         // --label-smoothing: the classification loss's (PyTorch's label_smoothing)
  bool direct() const { return strategy == "direct"; }
  // Mid-epoch checkpoints and restarts (issue 20). None defines the run (not in kRunOptions: a resume may
  // change them).
  int64_t checkpoint_every = 0;  // --checkpoint-every STEPS: also save after every STEPS optimizer steps (0: epoch ends)
  bool auto_resume = false;      // --auto-resume: --resume when --out holds a checkpoint, else start the run
  int64_t crash_after_step = 0;  // hidden test hook --crash-after-step N (see CrashAfterStep); 0: off
  int crash_rank = 0;            // hidden --crash-rank R: the rank that crashes
  // Mixed precision (issue 23): --amp bf16|f16 sets TrainerConfig::amp (f16 adds the gradient scaler);
  // empty: f32. Defines the run (in kRunOptions).
  std::string amp;
};

// The data-parallel job this process belongs to (a job of one when --backend is not given).
struct DistInfo {
  bool active = false;
  int rank = 0;
  int world_size = 1;
  std::string backend;
  bool main() const { return rank == 0; }
};

// The options that define a run, with their flags: a resumed run takes them from its checkpoint
// (giving one with another value is an error), so `--out DIR --resume` alone continues it. batch_size
// is the global batch (per-rank batch x ranks): a run may resume with another rank count.
struct RunOption {
  const char* key;
  const char* flag;
  // Sets the option from the checkpoint's value (not null; batch_size is set by adopt_saved_run).
  void (*adopt)(Options&, const json&);
  // A checkpoint written before the option existed: false, the run's value is unknown and any flag is
  // taken (lr); true, the run had the option's default (the knobs added later).
  bool absent_means_default = false;
};
const RunOption kRunOptions[] = {
    {"target", "--target", [](Options& o, const json& v) { o.target = v.get<std::string>(); }},
    {"mlp_hidden", "--mlp-hidden",
     [](Options& o, const json& v) {
       if (!v.is_null()) o.mlp_hidden = v.get<std::vector<int64_t>>();
     }},
    {"strategy", "--strategy", [](Options& o, const json& v) { o.strategy = v.get<std::string>(); }},
    {"latent_dim", "--latent-dim",
     [](Options& o, const json& v) {
       if (!v.is_null()) o.latent_dim = v.get<int64_t>();
     }},
    // Per-group latent lengths; runs saved before they existed gave every group latent_dim.
    {"latent_dims", "--latent-dims",
     [](Options& o, const json& v) {
       std::string text;
       if (v.is_object())
         for (const auto& [name, dim] : v.items())
           text += (text.empty() ? "" : ",") + name + "=" + std::to_string(dim.get<int64_t>());
       o.latent_dims = text;
     },
     true},
    {"latent_budget", "--latent-budget",
     [](Options& o, const json& v) {
       if (!v.is_null()) o.latent_budget = v.get<int64_t>();
     },
     true},
    {"batch_size", "--batch-size", nullptr},
    {"optimizer", "--optimizer", [](Options& o, const json& v) { o.optimizer = v.get<std::string>(); }},
    {"seed", "--seed", [](Options& o, const json& v) { o.seed = v.get<uint64_t>(); }},
    {"mapping_loss", "--mapping-loss", [](Options& o, const json& v) { o.mapping_loss = v.get<bool>(); }},
    {"limit", "--limit", [](Options& o, const json& v) { o.limit = v.get<int64_t>(); }},
    {"scheduler", "--scheduler", [](Options& o, const json& v) { o.scheduler = v.get<std::string>(); }},
    {"lr", "--lr", [](Options& o, const json& v) { o.lr = v.get<double>(); }},
    {"alpha", "--alpha",
     [](Options& o, const json& v) {
       if (!v.is_null()) o.alpha = v.get<double>();
     },
     true},
    {"lambda_stability", "--lambda-stability",
     [](Options& o, const json& v) {
       if (!v.is_null()) o.lambda_stability = v.get<double>();
     },
     true},
    {"lambda_smoothness", "--lambda-smoothness",
     [](Options& o, const json& v) {
       if (!v.is_null()) o.lambda_smoothness = v.get<double>();
     },
     true},
    {"lambda_alignment", "--lambda-alignment",
     [](Options& o, const json& v) {
       if (!v.is_null()) o.lambda_alignment = v.get<double>();
     },
     true},
    {"clip_norm", "--clip-norm", [](Options& o, const json& v) { o.clip_norm = v.get<double>(); }, true},
    {"clip_value", "--clip-value", [](Options& o, const json& v) { o.clip_value = v.get<double>(); }, true},
    {"accumulation_steps", "--accumulation-steps",
     [](Options& o, const json& v) { o.accumulation_steps = v.get<int64_t>(); }, true},
    {"early_stopping_patience", "--early-stopping-patience",
     [](Options& o, const json& v) { o.early_stopping_patience = v.get<int64_t>(); }, true},
    {"weight_decay", "--weight-decay", [](Options& o, const json& v) { o.weight_decay = v.get<double>(); }, true},
    {"amsgrad", "--amsgrad", [](Options& o, const json& v) { o.amsgrad = v.get<bool>(); }, true},
    // The mapper family; runs saved before it existed used block.
    {"mapper", "--mapper",
     [](Options& o, const json& v) {
       if (!v.is_null()) o.mapper = v.get<std::string>();
     },
     true},
    // LRD and pruning add-ons.
    {"rank", "--rank", [](Options& o, const json& v) { o.rank = v.get<int64_t>(); }, true},
    {"prune", "--prune", [](Options& o, const json& v) { o.prune = v.get<double>(); }, true},
    // Transfer options (null where the run does not use them). The pretrained file's content is checked
    // by the checkpoint itself (its hash), so --resume refuses a changed file.
    {"pretrained", "--pretrained",
     [](Options& o, const json& v) {
       if (!v.is_null()) o.pretrained = v.get<std::string>();
     },
     true},
    {"block_size", "--block-size",
     [](Options& o, const json& v) {
       if (!v.is_null()) o.block_size = v.get<int64_t>();
     },
     true},
    {"finetune_alpha", "--finetune-alpha",
     [](Options& o, const json& v) {
       if (!v.is_null()) o.finetune_alpha = v.get<double>();
     },
     true},
    {"init_from", "--init-from",
     [](Options& o, const json& v) {
       if (!v.is_null()) o.init_from = v.get<std::string>();
     },
     true},
    {"classes", "--classes",
     [](Options& o, const json& v) {
       std::string text;
       for (const json& c : v) text += (text.empty() ? "" : ",") + std::to_string(c.get<int64_t>());
       o.classes = text;
     },
     true},
    // Augmentation and the validation split (issue 19).
    {"augment", "--augment", [](Options& o, const json& v) { o.augment = v.get<std::vector<std::string>>(); }, true},
    // Runs saved before it existed trained without smoothing.
    {"label_smoothing", "--label-smoothing", [](Options& o, const json& v) { o.label_smoothing = v.get<double>(); },
     true},
    {"val_split", "--val-split", [](Options& o, const json& v) { o.val_split = v.get<double>(); }, true},
    // Mixed precision (issue 23); runs saved before it existed trained in f32 ("").
    {"amp", "--amp", [](Options& o, const json& v) { o.amp = v.get<std::string>(); }, true},
};

// --classes: "a-b" ranges and single labels, comma-separated, each in 0..9; sorted, without repeats.
// Empty text: all ten (an empty list).
std::vector<int64_t> parse_classes(const std::string& text) {
  std::vector<int64_t> out;
  if (text.empty()) return out;
  std::istringstream items(text);
  std::string item;
  const auto label = [&text](const std::string& word) {
    size_t used = 0;
    int64_t v = -1;
    try {
      v = std::stoll(word, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    MN_CHECK(!word.empty() && used == word.size() && v >= 0 && v <= 9, ValueError, "--classes '", text,
             "': expected labels 0-9 as ranges (a-b) or comma-separated numbers, got '", word, "'");
    return v;
  };
  while (std::getline(items, item, ',')) {
    const size_t dash = item.find('-');
    const int64_t lo = label(item.substr(0, dash));
    const int64_t hi = dash == std::string::npos ? lo : label(item.substr(dash + 1));
    MN_CHECK(lo <= hi, ValueError, "--classes '", text, "': the range '", item, "' is empty");
    for (int64_t c = lo; c <= hi; ++c) out.push_back(c);
  }
  MN_CHECK(!text.empty() && text.back() != ',', ValueError, "--classes '", text, "' ends with a comma");
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// --latent-dims "NAME=L,NAME=L": group names (which may hold dots) each with a positive length, no name
// twice. Empty text: none.
std::map<std::string, int64_t> parse_latent_dims(const std::string& text) {
  std::map<std::string, int64_t> dims;
  if (text.empty()) return dims;
  MN_CHECK(text.back() != ',', ValueError, "--latent-dims '", text, "' ends with a comma");
  std::istringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    const size_t eq = item.rfind('=');
    MN_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < item.size(), ValueError, "--latent-dims '", text,
             "': expected GROUP=LENGTH, got '", item, "'");
    const std::string number = item.substr(eq + 1);
    int64_t dim = 0;
    const auto [stop, error] = std::from_chars(number.data(), number.data() + number.size(), dim);
    MN_CHECK(error == std::errc() && stop == number.data() + number.size() && dim > 0, ValueError, "--latent-dims '",
             text, "': the length of '", item.substr(0, eq), "' must be a whole number >= 1, got '", number, "'");
    MN_CHECK(dims.emplace(item.substr(0, eq), dim).second, ValueError, "--latent-dims '", text, "' names group '",
             item.substr(0, eq), "' twice");
  }
  return dims;
}

double effective_lr(const Options& o) { return o.lr > 0 ? o.lr : (o.direct() ? 1e-3 : 1e-2); }

// Without --weight-decay, direct training keeps its optimizer's usual setting (AdamW's default decay);
// otherwise none.
double effective_weight_decay(const Options& o) {
  if (o.weight_decay >= 0) return o.weight_decay;
  return o.direct() && o.optimizer == "adamw" ? nn::optim::AdamW::with_default_decay().weight_decay : 0.0;
}

// What the checkpoint's config records: the run options and the planned --epochs. An option that
// does not apply to the run (the mapper's alpha of a direct run, the weights without --mapping-loss)
// is null.
json run_config(const Options& o, int world_size) {
  const auto mapped = [&o](const json& value) { return o.direct() ? json(nullptr) : value; };
  const auto regularised = [&o](double weight) { return o.mapping_loss ? json(weight) : json(nullptr); };
  return {{"target", o.target},
          {"mlp_hidden", o.target == "mlp" ? json(o.mlp_hidden) : json(nullptr)},
          {"strategy", o.strategy},
          {"latent_dim", mapped(o.latent_dim)},
          {"latent_dims", mapped(json(parse_latent_dims(o.latent_dims)))},
          {"latent_budget", mapped(o.latent_budget)},
          {"batch_size", o.batch_size * world_size},
          {"optimizer", o.optimizer},
          {"seed", o.seed},
          {"mapping_loss", o.mapping_loss},
          {"limit", o.limit},
          {"scheduler", o.scheduler},
          {"lr", effective_lr(o)},
          {"alpha", mapped(o.alpha)},
          {"lambda_stability", regularised(o.lambda_stability)},
          {"lambda_smoothness", regularised(o.lambda_smoothness)},
          {"lambda_alignment", regularised(o.lambda_alignment)},
          {"clip_norm", o.clip_norm},
          {"clip_value", o.clip_value},
          {"accumulation_steps", o.accumulation_steps},
          {"early_stopping_patience", o.early_stopping_patience},
          {"weight_decay", effective_weight_decay(o)},
          {"amsgrad", o.amsgrad},
          {"epochs", o.epochs},
          {"mapper", mapped(o.mapper)},
          {"rank", o.rank},
          {"prune", o.prune},
          {"pretrained", o.finetuning() ? json(o.pretrained) : json(nullptr)},
          {"block_size", o.finetuning() ? json(o.block_size) : json(nullptr)},
          {"finetune_alpha", o.finetuning() ? json(o.finetune_alpha) : json(nullptr)},
          {"init_from", o.direct() ? json(o.init_from) : json(nullptr)},
          {"classes", parse_classes(o.classes)},
          {"augment", o.augment},
          {"label_smoothing", o.label_smoothing},
          {"val_split", o.val_split},
          {"amp", o.amp}};
}

// What run_config records for `key` when the knob has its default, for the run `o` describes (the
// knobs' entries depend only on themselves and on strategy, optimizer and --mapping-loss).
json default_entry(const Options& o, const char* key, int world_size) {
  Options defaults;
  defaults.strategy = o.strategy;
  defaults.optimizer = o.optimizer;
  defaults.mapping_loss = o.mapping_loss;
  return run_config(defaults, world_size).at(key);
}

// The config of the run saved at `path` (either checkpoint format), after the checks that it holds a
// run mn-train can continue.
json saved_run_config(const std::string& path) {
  MN_CHECK(fs::exists(path), IOError, "--resume: checkpoint not found: ", path,
           " (--out names the run's directory); start without --resume");
  const safetensors::File file = safetensors::load(path);
  const auto format = file.metadata.find("format");
  std::string config;
  if (format != file.metadata.end() && format->second == json("mapping_networks.checkpoint").dump()) {
    const mapping::CheckpointInfo saved = mapping::read_checkpoint(path);
    // Without the trainer's state there is no epoch to continue from: resuming would silently start over
    // at epoch 0 and rewrite metrics.csv.
    MN_CHECK(saved.trainer_state.has_value(), ValueError, "--resume: ", path,
             " holds latents but no trainer state (epoch, optimizer, history), so there is no run to continue; "
             "it was not written by mn-train. Start a new run without --resume, or use another --out");
    config = saved.config;
  } else {
    config = train::read_module_checkpoint(path).metadata.config;
  }
  MN_CHECK(!config.empty(), ValueError, "--resume: ", path,
           " lacks the metadata key 'config' (the options of the run), so it was not written by mn-train");
  json saved;
  try {
    saved = json::parse(config);
  } catch (const json::exception& e) {
    throw IOError(str("--resume: ", path, ": metadata 'config' is not JSON: ", e.what()));
  }
  MN_CHECK(saved.is_object(), IOError, "--resume: ", path, ": metadata 'config' is not a JSON object");
  return saved;
}

// --resume: the run's options come from its checkpoint. A flag given on the command line must agree
// with the run (an error names each flag that does not, with both values); --epochs may extend the run
// (default: the epochs it was started with).
void adopt_saved_run(Options& o, const CLI::App& app, const json& saved, int world_size, const std::string& path) {
  std::string conflicts;
  // A flag given must match the run's value; an option not given takes it. The command line's entry is
  // computed as the options stand (what an entry depends on comes earlier in kRunOptions).
  const auto take = [&](const RunOption& option, const json& value) {
    if (app.count(option.flag) > 0) {
      const json given = run_config(o, world_size).at(option.key);
      if (value != given)
        conflicts += str("\n  ", option.flag, ": the run has ", value.dump(), ", the command line ", given.dump());
    } else if (option.adopt != nullptr) {
      option.adopt(o, value);
    } else {  // batch_size
      const int64_t global = value.get<int64_t>();
      MN_CHECK(global > 0 && global % world_size == 0, ValueError, "--resume: ", path, ": the run's global batch ",
               global, " does not split over ", world_size, " ranks; give --batch-size");
      o.batch_size = global / world_size;
    }
  };
  try {
    for (const RunOption& option : kRunOptions)
      if (saved.contains(option.key)) take(option, saved.at(option.key));
    // Knobs newer than the checkpoint: it ran with their defaults (known once strategy, optimizer and
    // --mapping-loss are the run's).
    for (const RunOption& option : kRunOptions)
      if (!saved.contains(option.key) && option.absent_means_default)
        take(option, default_entry(o, option.key, world_size));
    if (app.count("--epochs") == 0) {
      MN_CHECK(saved.contains("epochs"), ValueError, "--resume: ", path,
               " does not record how many epochs the run was started with; give --epochs");
      o.epochs = saved.at("epochs").get<int64_t>();
    }
  } catch (const json::exception& e) {
    throw IOError(str("--resume: ", path, ": metadata 'config' is malformed: ", e.what()));
  }
  MN_CHECK(conflicts.empty(), ValueError, "--resume: ", path, " continues a run whose options differ from the "
           "command line (leave them out to use the run's):", conflicts);
}

// A knob set away from its default where the run has no use for it is an error rather than ignored.
void check_knobs_apply(const Options& o) {
  const Options defaults;
  MN_CHECK(!o.direct() || o.alpha == defaults.alpha, ValueError, "--alpha ", o.alpha,
           " modulates a mapper, and --strategy direct trains the target without one");
  const std::pair<const char*, double> weights[] = {{"--lambda-stability", o.lambda_stability - defaults.lambda_stability},
                                                    {"--lambda-smoothness", o.lambda_smoothness - defaults.lambda_smoothness},
                                                    {"--lambda-alignment", o.lambda_alignment - defaults.lambda_alignment}};
  for (const auto& [flag, change] : weights)
    MN_CHECK(o.mapping_loss || change == 0, ValueError, flag, " weighs a term of --mapping-loss; add --mapping-loss");
  MN_CHECK(!o.mapping_loss || !o.direct(), ValueError,
           "--mapping-loss regularises the latents of a mapped run, and --strategy direct has none");
  MN_CHECK(!o.amsgrad || o.optimizer == "adam" || o.optimizer == "adamw", ValueError,
           "--amsgrad is an option of --optimizer adam and adamw, not ", o.optimizer);
  MN_CHECK(!o.direct() || o.mapper == defaults.mapper, ValueError, "--mapper ", o.mapper,
           " chooses the fixed matrices of a mapper, and --strategy direct trains the target without one");
  MN_CHECK(o.rank >= 0, ValueError, "rank must be positive, got ", o.rank);
  MN_CHECK(o.strategy != "lrd" || o.rank > 0, ValueError,
           "--strategy lrd factors the 2-D weights at a rank: give --rank R (R > 0)");
  MN_CHECK(o.rank == 0 || o.strategy == "lrd" || o.strategy == "slvt" || o.direct(), ValueError, "--rank ", o.rank,
           " factors the weights of --strategy lrd (layer-wise), slvt (slvt + LRD) or direct, not ", o.strategy);
  nn::check_prune_fraction(o.prune);
  MN_CHECK(o.finetuning() == !o.pretrained.empty(), ValueError,
           o.finetuning() ? "--strategy finetuning needs --pretrained FILE (the weights to fine-tune)"
                          : "--pretrained is the starting point of --strategy finetuning; for a direct run from a "
                            "file use --init-from");
  MN_CHECK(o.finetuning() || (o.block_size == defaults.block_size && o.finetune_alpha == defaults.finetune_alpha),
           ValueError, "--block-size and --finetune-alpha shape the modulation of --strategy finetuning");
  MN_CHECK(o.direct() || o.init_from.empty(), ValueError,
           "--init-from sets the starting weights of --strategy direct; a mapped run generates them "
           "(--strategy finetuning --pretrained FILE starts from a file)");
  MN_CHECK(o.init_from.empty() || o.rank == 0, ValueError, "--init-from ", o.init_from,
           " holds whole weights, and --rank ", o.rank, " would train freshly drawn factors U, V in place of "
           "the 2-D ones: drop --rank, or start the factored run from its own init");
  parse_classes(o.classes);  // checks the syntax before any data is read
  const bool per_group = !o.latent_dims.empty() || o.latent_budget > 0;
  MN_CHECK(!per_group || o.strategy == "layerwise" || o.strategy == "lazy_layerwise" || o.strategy == "grouped",
           ValueError, !o.latent_dims.empty() ? "--latent-dims" : "--latent-budget",
           " sets per-group latent lengths, which --strategy layerwise, lazy_layerwise and grouped have; ", o.strategy,
           o.direct() ? " trains the target without latents" : " takes one --latent-dim");
  MN_CHECK(o.latent_dims.empty() || o.latent_budget == 0, ValueError,
           "--latent-dims names each group's length and --latent-budget shares a total; give one of them");
  parse_latent_dims(o.latent_dims);
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

// --classes first, then --limit (the first N images of those classes).
data::Dataset prepare(const data::Dataset& ds, const std::string& classes, int64_t limit, Device device) {
  const std::vector<int64_t> kept = parse_classes(classes);
  data::Dataset out = (kept.empty() ? ds : data::select_classes(ds, kept)).head(limit);
  out.images = data::normalize(out.images);
  return out.to(device);
}

// The directory entry of PATH holding an executable `name` ("" when none does): the shell's lookup.
std::string find_program(const std::string& name) {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return "";
  std::istringstream dirs(path);
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    const fs::path candidate = fs::path(dir.empty() ? "." : dir) / name;
    std::error_code ec;
    if (fs::is_regular_file(candidate, ec) && ::access(candidate.c_str(), X_OK) == 0) return candidate.string();
  }
  return "";
}

// `text` as one shell word.
std::string shell_quote(const std::string& text) {
  std::string quoted = "'";
  for (char c : text) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

// OUT/curves.png from OUT/metrics.csv: loss (left) and accuracy in percent (right) per epoch, training
// and test, drawn by gnuplot through OUT/curves.gp (kept: `gnuplot curves.gp` in OUT draws it again).
// Returns the picture's path, or "" with a one-line warning on stderr when gnuplot is not on PATH or
// fails; nothing when no epoch was recorded.
std::string plot(const fs::path& out_dir) {
  std::ifstream csv(out_dir / "metrics.csv");
  std::string header, row;
  if (!std::getline(csv, header) || !std::getline(csv, row) || row.empty()) return "";
  int64_t rows = 1;
  while (std::getline(csv, row))
    if (!row.empty()) ++rows;
  // 1-based column numbers by name, so the plot follows CsvLogger's columns.
  std::map<std::string, int> column;
  {
    std::istringstream names(header);
    std::string name;
    for (int i = 1; std::getline(names, name, ','); ++i) column[name] = i;
  }
  // The held-out columns: val_* with --val-split, else test_*.
  const std::string held = column.count("val_loss") > 0 ? "val" : "test";
  const std::string held_loss = held + "_loss", held_accuracy = held + "_accuracy";
  for (const char* name : {"epoch", "train_loss", held_loss.c_str(), "train_accuracy", held_accuracy.c_str()})
    if (column.count(name) == 0) {
      std::fprintf(stderr, "mn-train: warning: no curves.png: %s lacks the column '%s'\n",
                   (out_dir / "metrics.csv").c_str(), name);
      return "";
    }
  const auto series = [&column](const char* y, const char* scale, const char* title) {
    return str("'metrics.csv' using ", column["epoch"], ":($", column[y], scale, ") with linespoints title '", title,
               "'");
  };
  {
    std::ofstream gp(out_dir / "curves.gp");
    gp << "# mn-train's curves: run `gnuplot curves.gp` in this directory\n"
       << "set datafile separator ','\n"
       << "set terminal pngcairo size 1000,400\n"
       << "set output 'curves.png'\n"
       << "set multiplot layout 1,2\n"
       << "set xlabel 'epoch'\nset xtics " << std::max<int64_t>(1, rows / 10) << "\nset grid\nset key top right\n"
       << "set ylabel 'loss'\nset title 'loss'\n"
       << "plot " << series("train_loss", "", "train") << ", " << series(held_loss.c_str(), "", held.c_str()) << "\n"
       << "set key bottom right\nset ylabel 'accuracy (%)'\nset title 'accuracy'\n"
       << "plot " << series("train_accuracy", "*100", "train") << ", "
       << series(held_accuracy.c_str(), "*100", held.c_str())
       << "\n"
       << "unset multiplot\n";
  }
  std::error_code ec;
  fs::remove(out_dir / "curves.png", ec);  // an earlier run's picture would pass for this one's
  const std::string gnuplot = find_program("gnuplot");
  if (gnuplot.empty()) {
    std::fprintf(stderr, "mn-train: warning: no curves.png: gnuplot is not on PATH (install gnuplot-nox, e.g. with "
                 "./mn deps); the numbers are in %s\n", (out_dir / "metrics.csv").c_str());
    return "";
  }
  const std::string command = str("cd ", shell_quote(out_dir.string()), " && ", shell_quote(gnuplot),
                                  " curves.gp >/dev/null 2>&1");
  if (std::system(command.c_str()) != 0) {
    std::fprintf(stderr, "mn-train: warning: no curves.png: gnuplot failed on %s (run it there to see why)\n",
                 (out_dir / "curves.gp").c_str());
    return "";
  }
  return (out_dir / "curves.png").string();
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
  bool stopped_early = false;  // --early-stopping-patience ended the run before --epochs
  std::string exported;        // where the weights went ("" when they were not written)
  int64_t fixed_bytes = 0;     // mapped runs: the generator's fixed tensors (mappers, scales, pretrained)
  // --val-split: the validation part's last-epoch and per-epoch figures, and the test loss at the end.
  double val_accuracy = NAN, val_loss = NAN, test_loss = NAN;
  std::vector<double> val_accuracy_per_epoch, val_loss_per_epoch;
  int64_t checkpoint_saves = 0;    // checkpoint files written by this invocation (rank 0)
  double checkpoint_seconds = 0;   // ... and the time spent writing them
};

std::vector<std::pair<std::string, std::vector<std::string>>> weight_bias_groups(const nn::Module& target) {
  std::vector<std::string> weights, others;
  for (const auto& [name, t] : target.named_parameters())
    (name.size() >= 6 && name.compare(name.size() - 6, 6, "weight") == 0 ? weights : others).push_back(name);
  std::vector<std::pair<std::string, std::vector<std::string>>> groups{{"weights", weights}};
  if (!others.empty()) groups.emplace_back("biases", others);
  return groups;
}

// The test set split over the ranks without repeats (rank r: r, r + W, ...); the metrics are then
// reduced with each rank's true sample count, so they are those of the whole test set.
data::Dataset test_shard(const data::Dataset& test, const DistInfo& dist) {
  if (!dist.active) return test;
  MN_CHECK(test.size() >= dist.world_size, ValueError, "the test set has ", test.size(),
           " images, fewer than the ", dist.world_size, " ranks; raise --limit");
  std::vector<int64_t> mine;
  for (int64_t i = dist.rank; i < test.size(); i += dist.world_size) mine.push_back(i);
  return test.select(from_vector(mine, Shape{static_cast<int64_t>(mine.size())}));
}

// The trainer's configuration. Direct training keeps its optimizers' usual settings (SGD with momentum
// 0.9, AdamW with its default decay unless --weight-decay) and leaves the global generator where the
// target's init left it.
train::TrainerConfig trainer_config(const Options& o) {
  train::TrainerConfig c{.max_epochs = o.epochs,
                         .optimizer = o.optimizer,
                         .learning_rate = effective_lr(o),
                         .weight_decay = effective_weight_decay(o),
                         .amsgrad = o.amsgrad,
                         .scheduler = o.scheduler,
                         .accumulation_steps = o.accumulation_steps,
                         .seed = o.direct() ? std::nullopt : std::optional<uint64_t>(o.seed),
                         .compile = o.compile,
                         .on_nonfinite = o.on_nonfinite};
  if (o.direct() && o.optimizer == "sgd") c.momentum = 0.9;
  if (o.clip_norm > 0) c.gradient_clip_norm = o.clip_norm;
  if (o.clip_value > 0) c.gradient_clip_value = o.clip_value;
  c.amp = o.amp;  // mixed precision (issue 23)
  return c;
}

// --mapping-loss: the library's regularisers with the weights given; a weight of 0 leaves its term out.
mapping::MappingLossOptions mapping_loss_options(const Options& o) {
  mapping::MappingLossOptions m{.lambda_stability = o.lambda_stability,
                                .lambda_smoothness = o.lambda_smoothness,
                                .lambda_alignment = o.lambda_alignment};
  if (o.lambda_stability == 0) m.stability = mapping::no_term;
  if (o.lambda_smoothness == 0) m.smoothness = mapping::no_term;
  if (o.lambda_alignment == 0) m.alignment = mapping::no_term;
  return m;
}

// --augment: the training batches' transforms in a fixed order (crop, then flip), or null. The crop pads
// with the normalised value of a black pixel, as torchvision's fill 0 does before Normalize.
std::shared_ptr<const data::Transform> make_augmentation(const Options& o) {
  std::vector<std::shared_ptr<data::Transform>> transforms;
  const auto has = [&o](const char* name) { return std::count(o.augment.begin(), o.augment.end(), name) > 0; };
  if (has("crop"))
    transforms.push_back(std::make_shared<data::RandomCrop>(
        28, 2, (0.0 - data::kFashionMnistMean) / data::kFashionMnistStd));
  if (has("flip")) transforms.push_back(std::make_shared<data::RandomHorizontalFlip>(0.5));
  if (transforms.empty()) return nullptr;
  return std::make_shared<data::Compose>(std::move(transforms));
}

// --augment as the run records it: each name once, in the order applied (crop, flip).
void canonicalize_augment(Options& o) {
  std::vector<std::string> canonical;
  for (const char* name : {"crop", "flip"})
    if (std::count(o.augment.begin(), o.augment.end(), name) > 0) canonical.push_back(name);
  o.augment = canonical;
}

// --crash-after-step N, a hidden test hook: the process sends itself SIGKILL (a crash: nothing flushed, no
// handler runs) at the first batch or epoch end where the trainer's global step has reached N, after that
// hook's checkpoint writers (it runs among them, registered after ModelCheckpoint). Only on --crash-rank
// (0 by default; the single process of a run without --backend), and only in a job's first attempt
// (TORCHELASTIC_RESTART_COUNT unset or 0), so an `mn-run --max-restarts` restart with the same command
// line does not crash again. The tests use it to stop a run at an exact step.
class CrashAfterStep : public train::Callback {
 public:
  explicit CrashAfterStep(int64_t step) : step_(step) {}
  std::string name() const override { return "CrashAfterStep"; }
  bool saves_checkpoints() const override { return true; }  // after ModelCheckpoint (registered before it)
  void on_batch_end(train::Trainer& trainer, int64_t, const train::LossOutput&) override { check(trainer); }
  void on_epoch_end(train::Trainer& trainer, int64_t, const train::Metrics&) override { check(trainer); }

 private:
  void check(const train::Trainer& trainer) const {
    if (trainer.global_step() >= step_) std::raise(SIGKILL);
  }
  int64_t step_;
};

bool first_attempt() {
  const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return restarts == nullptr || *restarts == '\0' || std::string(restarts) == "0";
}

// Builds the model (the target, or a MappingModel around it), its trainer and the callbacks, resumes,
// wraps for data parallel, trains, and says what happened.
// val_set: the --val-split part (the trainer validates on it and the test set is evaluated once at the
// end), or null (the trainer validates on the test set, as before --val-split existed).
Summary run(const Options& o, Device device, const data::Dataset& train_set, const data::Dataset* val_set,
            const data::Dataset& test, const fs::path& out_dir, bool tty, const DistInfo& dist) {
  const std::string checkpoint = (out_dir / "checkpoint.safetensors").string();

  manual_seed(o.seed);
  auto target = mapping::make_target(o.target, {o.mlp_hidden});
  std::optional<mapping::MappingModel> model;
  // Direct training with --rank or --prune trains the target through its factors and masks; the masks
  // and factors are drawn from the seeded generator here, so a resumed run rebuilds the same ones.
  std::shared_ptr<nn::Reparametrized> reparametrized;
  if (o.direct()) {
    // --init-from: the starting weights (strict: every name, no extra). A resumed run's checkpoint
    // holds the trained ones.
    if (!o.init_from.empty() && !o.resume) nn::load(*target, o.init_from);
    if (!device.is_cpu()) target->to(device);
    if (o.rank > 0 || o.prune > 0)
      reparametrized = std::make_shared<nn::Reparametrized>(
          target, nn::ReparametrizeOptions{.lrd_rank = o.rank, .prune_fraction = o.prune});
  } else {
    mapping::MappingOptions mo{.latent_dim = o.latent_dim,
                               .strategy = o.strategy,
                               .seed = o.seed,
                               .alpha = o.alpha,
                               .allow_large = o.allow_large,
                               .empty_cache_on_cuda = !o.keep_cuda_cache,
                               // BatchNorm targets (resnet*): the running statistics the mapped model
                               // trains are kept for evaluation, the checkpoint and the export.
                               .write_back_buffers = true,
                               .stream_layers = o.stream_layers,
                               .lrd_rank = o.rank,
                               .prune_fraction = o.prune};
    mo.mapper = o.mapper;  // --mapper
    if (o.strategy == "grouped") mo.groups = weight_bias_groups(*target);
    mo.group_latent_dims = parse_latent_dims(o.latent_dims);
    if (o.latent_budget > 0) {
      const mapping::ParameterSpec spec = mapping::ParameterSpec::from_module(*target);
      mo.group_latent_dims = mapping::capped_latent_dims(
          spec, o.strategy == "grouped" ? mo.groups : mapping::layerwise_groups(spec), o.latent_budget);
    }
    if (o.finetuning()) {
      mo.pretrained = o.pretrained;
      mo.finetune_block_size = o.block_size;
      mo.finetune_alpha = o.finetune_alpha;
    }
    try {
      model.emplace(target, mo);
    } catch (const MemoryError& e) {
      // The slvt guard speaks of MappingOptions::allow_large; here it is a flag.
      if (o.allow_large) throw;
      throw MemoryError(str(e.what(), "; on mn-train's command line: --allow-large"));
    }
    if (!device.is_cpu()) model->to(device);
  }

  // One process: the loader shuffles the whole set itself. Data parallel: a DistributedSampler gives it this
  // rank's shard of every epoch (the same permutation, split over the ranks); the trainer's set_epoch
  // reaches the sampler through the loader.
  data::DataLoaderOptions train_options{.batch_size = o.batch_size, .shuffle = true, .seed = o.seed};
  train_options.transform = make_augmentation(o);
  if (dist.active) {
    train_options.shuffle = false;
    train_options.sampler =
        std::make_shared<dist::DistributedSampler>(train_set.size(), dist.world_size, dist.rank, true, o.seed, false);
  }
  data::DataLoader train_loader(train_set, train_options);
  const data::Dataset my_test = test_shard(test, dist);
  data::DataLoader test_loader(my_test, {.batch_size = 1000, .shuffle = false});
  // --val-split: the trainer's validation pass (early stopping, the plateau schedule, metrics.csv's val_*)
  // sees only the held-out training images; the test set is evaluated once, after training.
  std::optional<data::Dataset> my_val;
  std::optional<data::DataLoader> val_loader;
  if (val_set != nullptr) {
    my_val = test_shard(*val_set, dist);
    val_loader.emplace(*my_val, data::DataLoaderOptions{.batch_size = 1000, .shuffle = false});
  }
  data::DataLoader* validation = val_loader ? &*val_loader : &test_loader;
  const char* held_out = val_loader ? "val" : "test";

  // Only rank 0 writes files and stdout; Ctrl-C stops a single-process run (the launcher stops ranks).
  std::vector<std::shared_ptr<train::Callback>> callbacks;
  auto sigint = std::make_shared<train::StopOnSigint>();
  if (!dist.active) callbacks.push_back(sigint);
  if (dist.main()) {
    train::CsvLogger::Columns columns = train::CsvLogger::default_columns();
    for (auto& [column, key] : columns)
      if (column.rfind("test_", 0) == 0) column = held_out + column.substr(4);
    callbacks.push_back(std::make_shared<train::CsvLogger>((out_dir / "metrics.csv").string(), columns));
    // A bar on a terminal; in logs plain progress lines, except with --json (stdout for programs: a
    // line per epoch, then the summary).
    if (tty || !o.json) callbacks.push_back(std::make_shared<train::ProgressCallback>());
    if (!tty) callbacks.push_back(std::make_shared<train::EpochSummary>(stdout, held_out));
  }
  // On every rank: the ranks see the same (all-reduced) validation loss, so they stop together.
  if (o.early_stopping_patience > 0)
    callbacks.push_back(std::make_shared<train::EarlyStopping>(train::history_keys::kValTotalLoss,
                                                                o.early_stopping_patience));
  // On every rank: its mid-epoch saves (--checkpoint-every) gather the ranks' metric sums; rank 0 writes.
  auto saver = std::make_shared<train::ModelCheckpoint>(
      checkpoint, 1, train::CheckpointMetadata{{{"program", "mn-train"}}, run_config(o, dist.world_size).dump()},
      o.checkpoint_every);
  callbacks.push_back(saver);
  if (o.crash_after_step > 0 && dist.rank == o.crash_rank && first_attempt())
    callbacks.push_back(std::make_shared<CrashAfterStep>(o.crash_after_step));
  std::unique_ptr<train::Trainer> trainer;
  nn::Module& direct_module = reparametrized ? static_cast<nn::Module&>(*reparametrized) : *target;
  if (o.direct()) {
    trainer = std::make_unique<train::Trainer>(direct_module, train_loader, validation,
                                               train::classification(o.label_smoothing),
                                               trainer_config(o), callbacks);
  } else {
    std::shared_ptr<mapping::Loss> loss = std::make_shared<mapping::ClassificationLoss>(o.label_smoothing);
    if (o.mapping_loss) loss = std::make_shared<mapping::MappingLoss>(loss, mapping_loss_options(o));
    trainer = std::make_unique<mapping::MappingTrainer>(*model, train_loader, validation, loss, trainer_config(o),
                                                        callbacks);
  }
  int64_t resumed_batches = 0;  // a mid-epoch checkpoint: the batches of its epoch already trained
  if (o.resume) {
    trainer->load_checkpoint(checkpoint);  // in place: the trained tensors stay the same tensors
    if (const auto progress = trainer->state().progress) resumed_batches = progress->batches;
    if (!o.json && dist.main()) {
      if (resumed_batches > 0)
        std::printf("resumed %s in epoch %lld after batch %lld (step %lld)\n", checkpoint.c_str(),
                    static_cast<long long>(trainer->epoch() + 1), static_cast<long long>(resumed_batches),
                    static_cast<long long>(trainer->global_step()));
      else
        std::printf("resumed %s at epoch %lld\n", checkpoint.c_str(), static_cast<long long>(trainer->epoch()));
    }
  }

  // Wrapped after the move and the resume: the wrapper broadcasts rank 0's trainable tensors (the
  // latents of a mapped run, the target's parameters of a direct one), checks that every rank built the
  // same mappers and hooks the gradients; the trainer averages its metrics over the ranks.
  std::optional<dist::DistributedDataParallel> ddp;
  if (dist.active) {
    ddp.emplace(dist::wrap_ddp(o.direct() ? direct_module : *model));
    trainer->set_data_parallel(&*ddp);
  }

  // Direct with --prune: the entries the masks leave trainable (what the paper counts).
  const int64_t trainable = o.direct() ? (reparametrized ? reparametrized->trainable_parameter_count()
                                                         : target->parameter_count())
                                       : model->trainable_parameter_count();
  const int64_t target_params = o.direct() ? target->parameter_count() : model->target_parameter_count();
  if ((!o.json || tty) && dist.main()) {
    if (o.direct())
      std::printf("%s direct: %lld parameters, %lld train / %lld test images, %s lr %g\n", o.target.c_str(),
                  static_cast<long long>(trainable), static_cast<long long>(train_set.size()),
                  static_cast<long long>(test.size()), o.optimizer.c_str(), trainer->learning_rate());
    else
      std::printf(
          "%s %s: %lld target parameters from %lld trainable (%.1fx), %lld train / %lld test images, %s lr %g\n",
          o.target.c_str(), o.strategy.c_str(), static_cast<long long>(target_params),
          static_cast<long long>(trainable), model->compression_ratio(), static_cast<long long>(train_set.size()),
          static_cast<long long>(test.size()), o.optimizer.c_str(), trainer->learning_rate());
    if (!o.latent_dims.empty() || o.latent_budget > 0) {
      std::string lengths;
      for (const auto& g : model->generator().groups())
        lengths += str(lengths.empty() ? "" : ", ", g.name, ": ", g.latent_dim, " for ", g.local_spec.total_numel());
      std::printf("latent length per group (for its parameters): %s\n", lengths.c_str());
    }
    if (ddp)
      std::printf("data parallel: %d ranks (%s), batch %lld per rank = %lld global, %lld steps per epoch, "
                  "%zu bytes all-reduced per step\n",
                  dist.world_size, dist.backend.c_str(), static_cast<long long>(o.batch_size),
                  static_cast<long long>(o.batch_size * dist.world_size),
                  static_cast<long long>(train_loader.size()), ddp->bytes_per_step());
  }
  const int64_t first_epoch = trainer->epoch();
  const auto start = std::chrono::steady_clock::now();
  const train::History history = trainer->fit();
  Summary s;
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  s.epochs = trainer->epoch();
  s.steps = (trainer->epoch() - first_epoch) * train_loader.size() - (trainer->epoch() > first_epoch ? resumed_batches : 0);
  s.test_accuracy = history.last(train::history_keys::kValAccuracy);
  s.train_accuracy = history.last(train::history_keys::kTrainAccuracy);
  s.trainable_params = trainable;
  s.target_params = target_params;
  if (ddp) s.bytes_per_step = static_cast<int64_t>(ddp->bytes_per_step());
  s.compile_report = trainer->compile_report();
  s.checkpoint_saves = saver->saves();
  s.checkpoint_seconds = saver->save_seconds();
  if (model) s.fixed_bytes = static_cast<int64_t>(model->generator().fixed_bytes());
  s.interrupted = sigint->interrupted() && trainer->epoch() < o.epochs;
  s.stopped_early = !s.interrupted && trainer->epoch() < o.epochs;
  if (val_loader) {
    s.val_accuracy = history.last(train::history_keys::kValAccuracy);
    s.val_loss = history.last(train::history_keys::kValTaskLoss);
    if (history.contains(train::history_keys::kValAccuracy))
      s.val_accuracy_per_epoch = history.at(train::history_keys::kValAccuracy);
    if (history.contains(train::history_keys::kValTaskLoss))
      s.val_loss_per_epoch = history.at(train::history_keys::kValTaskLoss);
    s.test_accuracy = NAN;  // the history's val_* are the split's; the test set is measured below
  }
  if ((trainer->epoch() == first_epoch || val_loader) && !s.interrupted) {
    // Nothing trained in this invocation (--epochs 0, or the run already has them all), or --val-split
    // (the epochs validated on the split): the test accuracy is measured now, once.
    train::Metrics m = trainer->evaluate(test_loader);
    if (ddp) m = ddp->average_metrics(m, my_test.size());
    s.test_accuracy = m.at(train::history_keys::kValAccuracy);
    s.test_loss = m.at(train::history_keys::kValTaskLoss);
    s.evaluated_only = trainer->epoch() == first_epoch;
  }
  // The target's weights alone, under its own names (what torch's load_state_dict(strict=True) takes):
  // generated from the latents for a mapped run. Not after an interrupt, whose weights are those of
  // an unfinished epoch (the checkpoint holds the last completed one).
  if (dist.main() && !s.interrupted) {
    s.exported = o.export_path.empty() ? (out_dir / "weights.safetensors").string() : o.export_path;
    if (reparametrized) {
      // The target's own names and shapes (W = U V^T, masks applied), as for a plain direct run.
      safetensors::save(s.exported, reparametrized->effective_state_dict(), {{"format", "pt"}});
    } else if (o.direct()) {
      nn::save(*target, s.exported);
    } else {
      mapping::export_generated_parameters(s.exported, *model);
    }
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train a built-in target on Fashion-MNIST, directly or as a mapping network"};
  Options o;
  add_version_flag(app, "mn-train");
  add_config_options(app, o.write_config);
  app.add_option("--target", o.target, "target network")
      ->check(CLI::IsMember(mapping::target_names()))
      ->capture_default_str();
  app.add_option("--mlp-hidden", o.mlp_hidden, "hidden widths of --target mlp")
      ->check(whole_number_at_least(1))
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--strategy", o.strategy, "direct, or how the latents generate the parameters")
      ->check(CLI::IsMember({"direct", "slvt", "layerwise", "lazy_layerwise", "grouped", "lrd", "finetuning"}))
      ->capture_default_str();
  app.add_option("--latent-dim", o.latent_dim, "latent length per group (grouped: weights and biases)")
      ->check(whole_number_at_least(1))
      ->capture_default_str();
  app.add_option("--latent-dims", o.latent_dims,
                 "GROUP=L,...: these groups' own latent lengths (layer-wise groups are the owner modules, as "
                 "PyTorch names them: 0, 3, layer1.0.conv1, ...; --latent-dim for the rest)");
  app.add_option("--latent-budget", o.latent_budget,
                 "share this many latent values over the groups: equal shares, none longer than its group's "
                 "parameter count (replaces --latent-dim)")
      ->check(whole_number_at_least(1));
  app.add_option("--epochs", o.epochs, "train up to this many epochs in total (0: only evaluate)")
      ->check(whole_number_at_least(0))
      ->capture_default_str();
  app.add_option("--batch-size", o.batch_size, "batch size; with --backend per rank (global = this x WORLD_SIZE)")
      ->check(whole_number_at_least(1))
      ->capture_default_str();
  app.add_option("--lr", o.lr, "learning rate (default 1e-3 direct, 1e-2 mapped)")->check(positive_finite_number());
  app.add_option("--weight-decay", o.weight_decay,
                 "optimizer weight decay (default: AdamW's 0.01 for direct adamw, else 0)")
      ->check(finite_number_in_range(0));
  app.add_option("--label-smoothing", o.label_smoothing,
                 "the cross-entropy's label smoothing, as PyTorch's: each target puts F / C on each of the C classes "
                 "and 1 - F more on its own; the reported losses include it (default 0)")
      ->check(finite_number_in_range(0, 1));
  app.add_option("--clip-norm", o.clip_norm, "clip the gradients' total L2 norm to this (0: no clipping)")
      ->check(finite_number_in_range(0))
      ->capture_default_str();
  app.add_option("--clip-value", o.clip_value, "clip every gradient element to [-v, v] (0: no clipping)")
      ->check(finite_number_in_range(0))
      ->capture_default_str();
  app.add_option("--accumulation-steps", o.accumulation_steps,
                 "batches whose gradients add up before each optimizer step")
      ->check(whole_number_at_least(1))
      ->capture_default_str();
  app.add_option("--early-stopping-patience", o.early_stopping_patience,
                 "stop when the validation loss (val_total_loss: the --val-split part, else the test set) has not "
                 "improved for this many epochs (0: never)")
      ->check(whole_number_at_least(0))
      ->capture_default_str();
  app.add_option("--alpha", o.alpha, "mapped runs: modulation of the fixed mappers by the latents (W + alpha 1 z^T)")
      ->check(finite_number_in_range(0))
      ->capture_default_str();
  app.add_option("--optimizer", o.optimizer, "optimizer")
      ->check(CLI::IsMember({"adam", "adamw", "sgd", "rmsprop"}))
      ->capture_default_str();
  app.add_flag("--amsgrad", o.amsgrad, "adam/adamw: the amsgrad variant (running maximum of the second moment)");
  app.add_option("--scheduler", o.scheduler, "learning-rate schedule (default none)")
      ->check(CLI::IsMember({"", "cosine", "step", "exponential", "plateau"}));
  app.add_option("--seed", o.seed, "seed of the target init, mappers, latents and shuffling")
      ->check(unsigned_whole_number())
      ->capture_default_str();
  app.add_option("--device", o.device, "cpu, cuda[:N] or auto (cuda when a GPU is usable)")->capture_default_str();
  app.add_option("--out", o.out, "directory for metrics.csv, checkpoint.safetensors and curves.png")
      ->capture_default_str();
  app.add_option("--data", o.data, "Fashion-MNIST directory")->capture_default_str();
  app.add_flag("--resume", o.resume,
               "continue the run in --out from its checkpoint, with the run's options (flags given must agree)");
  app.add_option("--export", o.export_path,
                 "write the target's trained weights (only them, PyTorch names) here; default OUT/weights.safetensors");
  app.add_flag("--mapping-loss", o.mapping_loss, "add the stability, smoothness and alignment regularisers");
  app.add_option("--lambda-stability", o.lambda_stability, "--mapping-loss: weight of the stability term (0: off)")
      ->check(finite_number_in_range(0))
      ->capture_default_str();
  app.add_option("--lambda-smoothness", o.lambda_smoothness, "--mapping-loss: weight of the smoothness term (0: off)")
      ->check(finite_number_in_range(0))
      ->capture_default_str();
  app.add_option("--lambda-alignment", o.lambda_alignment, "--mapping-loss: weight of the alignment term (0: off)")
      ->check(finite_number_in_range(0))
      ->capture_default_str();
  app.add_flag("--allow-large", o.allow_large, "allow fixed projections above 1e8 elements");
  app.add_flag("--stream-layers", o.stream_layers,
               "generate each layer's parameters just before it runs and again in backward: one layer's "
               "parameters in memory instead of all (layerwise / lazy_layerwise; a second forward per step)");
  app.add_flag("--keep-cuda-cache", o.keep_cuda_cache,
               "lazy_layerwise on cuda: keep the allocator's cache between groups (no per-group device sync "
               "and re-allocation, and --compile can capture; reserved memory then stays at the peak)");
  app.add_option("--limit", o.limit, "use only the first N training and test images (0 = all)")
      ->check(whole_number_at_least(0))
      ->capture_default_str();
  app.add_option("--threads", o.threads,
                 "threads of the CPU kernels, used whatever else runs (default: OMP_NUM_THREADS, else the CPUs "
                 "this process may use that other processes leave free, within its cgroup CPU limit, re-measured every 0.2 s; "
                 "MN_THREAD_POLICY=static: all)")
      ->check(whole_number_in_range(1, std::numeric_limits<int>::max()));
  app.add_flag("--json", o.json, "print a JSON summary as the last line of stdout");
  app.add_flag("--compile", o.compile,
               "capture each training step (forward, loss, backward) once per batch shape and replay it "
               "(mn::compile); prints what was captured at the end");
  app.add_option("--backend", o.backend,
                 "data-parallel training under mn-run: gloo (CPU) or nccl (--device cuda); under mpirun -np N: mpi "
                 "(CPU; builds with MPI); default: one process");
  app.add_option("--on-nonfinite", o.on_nonfinite,
                 "a step whose loss or gradients hold NaN or inf: error (stop, naming the step) or warn")
      ->check(CLI::IsMember({"error", "warn"}))
      ->capture_default_str();
  app.add_option("--mapper", o.mapper,
                 "mapped runs: family of the mappers' fixed matrices: block (one orthogonal block reused), dense "
                 "(the reference's explicit matrix, refused above 1 GiB unless --allow-large) or srht (a "
                 "randomised Hadamard map that stores nothing)")
      ->check(CLI::IsMember({"block", "dense", "srht"}))
      ->capture_default_str();
  // LRD and pruning add-ons (paper Table 8).
  app.add_option("--rank", o.rank,
                 "--strategy lrd (layer-wise groups) or slvt (one group): generate every 2-D weight [m, n] with "
                 "rank < min(m, n) as U V^T of this rank; --strategy direct: train such weights as factors U [m, rank], V [n, rank]")
      ->capture_default_str();
  app.add_option("--prune", o.prune,
                 "unstructured magnitude pruning: mask this fraction (0 <= F < 1) of every weight tensor by its "
                 "initial |value| (biases and 1-D tensors are kept); any strategy")
      ->capture_default_str();
  // Transfer: fine-tuning a pretrained target through latents, direct runs from a file, class subsets.
  app.add_option("--pretrained", o.pretrained,
                 "--strategy finetuning: the pretrained weights (safetensors state dict, e.g. another run's "
                 "weights.safetensors); the run generates them plus the latents' modulation");
  app.add_option("--block-size", o.block_size,
                 "--strategy finetuning: parameters sharing one modulation element (L_b; 1: one each)")
      ->check(whole_number_at_least(1))
      ->capture_default_str();
  app.add_option("--finetune-alpha", o.finetune_alpha,
                 "--strategy finetuning: strength of the modulation added to the pretrained weights "
                 "(theta = pre + A * repeat_each(o, L_b)); --alpha stays the mapper's own modulation")
      ->check(finite_number_in_range(0))
      ->capture_default_str();
  app.add_option("--init-from", o.init_from,
                 "--strategy direct: start from these weights (safetensors state dict) instead of the init");
  app.add_option("--classes", o.classes,
                 "train and test on these labels only: ranges and lists such as 0-4 or 5,7,9 (the model "
                 "keeps 10 outputs; default all)");
  // Augmentation and the validation split (issue 19).
  app.add_option("--augment", o.augment,
                 "augment the training images each epoch: crop (RandomCrop 28, padding 2), flip (horizontal, p 0.5); "
                 "e.g. --augment crop,flip (default: none)")
      ->check(CLI::IsMember({"crop", "flip"}))
      ->delimiter(',');
  app.add_option("--val-split", o.val_split,
                 "hold out this fraction of the training images (stratified by class, by --seed) for validation: "
                 "metrics.csv's val_*, early stopping and the plateau schedule use it, the test set is measured "
                 "once at the end (default 0: validate on the test set)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  // Mid-epoch checkpoints and restarts (issue 20).
  app.add_option("--checkpoint-every", o.checkpoint_every,
                 "also write the checkpoint after every STEPS optimizer steps inside epochs, with the position in "
                 "the epoch, so --resume continues at the next batch exactly (default 0: at epoch ends only)")
      ->check(whole_number_at_least(0))
      ->capture_default_str();
  app.add_flag("--auto-resume", o.auto_resume,
               "--resume when --out holds a checkpoint, else start the run: one command line for the first start and "
               "for restarts (mn-run --max-restarts); the checkpoint must be this run's, as with --resume");
  // Hidden test hooks (CrashAfterStep): not in --help.
  app.add_option("--crash-after-step", o.crash_after_step, "test hook: SIGKILL after this global step")
      ->check(whole_number_at_least(0))
      ->group("");
  app.add_option("--crash-rank", o.crash_rank, "test hook: the rank --crash-after-step kills")
      ->check(whole_number_at_least(0))
      ->group("");
  // Mixed precision (issue 23).
  app.add_option("--amp", o.amp,
                 "mixed precision: bf16 or f16 (forward and loss under autocast; f16 adds dynamic loss scaling, "
                 "skipping steps whose gradients overflow); default: f32")
      ->check(CLI::IsMember({"bf16", "f16"}));
  CLI11_PARSE(app, argc, argv);

  DistInfo dist;
  try {
    if (write_config_if_asked(app, o.write_config, "mn-train")) return 0;
    if (o.threads > 0) set_num_threads(o.threads);
    // --device auto: the GPU when there is one, except for gloo ranks, which train on the CPU.
    Device device = o.device == "auto" && (o.backend == "gloo" || o.backend == "mpi") ? kCPU : Device::parse(o.device);
    if (!o.backend.empty()) {
      MN_CHECK(o.backend == "gloo" || o.backend == "nccl" || o.backend == "mpi", ValueError, "--backend '", o.backend,
               "' is not supported; use gloo (CPU), nccl (CUDA) or mpi (CPU, under mpirun), or leave --backend out "
               "for one process");
      if (o.backend == "nccl") {
        MN_CHECK(dist::is_backend_available("nccl"), RuntimeError,
                 "--backend nccl needs a CUDA build with NCCL, and this build has no CUDA; use --backend gloo "
                 "(CPU)");
        MN_CHECK(device.is_cuda(), ValueError,
                 "--backend nccl moves CUDA tensors only; add --device cuda, or use --backend gloo for CPU training");
        MN_CHECK(cuda_available(), DeviceError, "--device ", o.device,
                 ": CUDA is not available here (no usable GPU), so --backend nccl cannot run; use --backend gloo");
      } else {
        MN_CHECK(device.is_cpu(), ValueError, "--backend ", o.backend,
                 " trains on the CPU; use --backend nccl with --device ", o.device, ", or --device cpu");
      }
      if (o.backend == "mpi") dist::check_backend("mpi");  // a build without MPI says how to get it
      dist::EnvConfig env;
      try {
        env = dist::launch_env(o.backend);  // mpi: MPI's rank and size, no MASTER_ADDR / MASTER_PORT
      } catch (const Error& e) {
        if (o.backend == "mpi") throw;
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
    canonicalize_augment(o);
    MN_CHECK(o.val_split >= 0 && o.val_split < 1, ValueError, "--val-split must be in [0, 1), got ", o.val_split);
    // --auto-resume: the same command line starts the run and continues it after a restart. (Checked on the
    // values, not with CLI11's excludes, which a --write-config file's "resume=false" would trip.)
    MN_CHECK(!(o.resume && o.auto_resume), ValueError,
             "--auto-resume already resumes when --out holds a checkpoint; give it or --resume, not both");
    if (o.auto_resume && fs::exists(fs::path(o.out) / "checkpoint.safetensors")) o.resume = true;
    if (o.resume) {
      const std::string checkpoint = (fs::path(o.out) / "checkpoint.safetensors").string();
      adopt_saved_run(o, app, saved_run_config(checkpoint), dist.world_size, checkpoint);
    }
    check_knobs_apply(o);
    MN_CHECK(o.latent_budget == 0 || app.count("--latent-dim") == 0, ValueError, "--latent-budget ", o.latent_budget,
             " decides every group's latent length; leave out --latent-dim ", o.latent_dim);
    if (device.is_cuda())
      MN_CHECK(cuda_available() && device.index < cuda_device_count(), DeviceError, "--device ", o.device,
               ": CUDA is not available here (built without CUDA, or no usable GPU); use --device cpu");
    // Open MPI gives every rank a pseudo-terminal, wherever mpirun's own output goes (a log file, a pipe):
    // under --backend mpi isatty says nothing, so rank 0 writes as to a log (with --json the JSON line only).
    const bool tty = dist.main() && isatty(STDOUT_FILENO) != 0 && dist.backend != "mpi";
    const fs::path out_dir(o.out);
    check_writable_directory(out_dir);
    if (dist.active) dist::setup_ddp(dist.rank, dist.world_size, dist.backend);
    data::Dataset train_set = prepare(data::load_fashion_mnist("train", o.data), o.classes, o.limit, device);
    const data::Dataset test = prepare(data::load_fashion_mnist("test", o.data), o.classes, o.limit, device);
    // --val-split: carved from the (--classes and --limit'ed) training images; the same split on every rank
    // and resume.
    std::optional<data::Dataset> val_set;
    if (o.val_split > 0) {
      const data::SplitIndices split = data::stratified_split(train_set.labels, o.val_split, o.seed);
      val_set = train_set.select(split.val);
      train_set = train_set.select(split.train);
    }

    const Summary s = run(o, device, train_set, val_set ? &*val_set : nullptr, test, out_dir, tty, dist);
    if (dist.active) dist::cleanup_ddp();
    if (!dist.main()) return 0;  // rank 0 reports for the job
    const std::string curves = plot(out_dir);
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
                {"interrupted", s.interrupted},
                {"stopped_early", s.stopped_early}};
      if (!o.direct()) {  // --mapper
        j["mapper"] = o.mapper;
        j["fixed_bytes"] = s.fixed_bytes;
      }
      if (!curves.empty()) j["curves"] = curves;
      if (o.val_split > 0) {
        j["val_accuracy"] = num(s.val_accuracy);
        j["val_loss"] = num(s.val_loss);
        j["test_loss"] = num(s.test_loss);
        json per_epoch_accuracy = json::array(), per_epoch_loss = json::array();
        for (double v : s.val_accuracy_per_epoch) per_epoch_accuracy.push_back(num(v));
        for (double v : s.val_loss_per_epoch) per_epoch_loss.push_back(num(v));
        j["val_accuracy_per_epoch"] = per_epoch_accuracy;
        j["val_loss_per_epoch"] = per_epoch_loss;
      }
      if (!o.augment.empty()) j["augment"] = o.augment;
      if (o.checkpoint_every > 0) {  // what the checkpoints cost
        j["checkpoint_saves"] = s.checkpoint_saves;
        j["checkpoint_seconds"] = s.checkpoint_seconds;
      }
      if (!s.compile_report.empty()) j["compiled"] = s.compile_report;
      if (!s.exported.empty()) j["weights"] = s.exported;
      if (!o.direct()) j["fixed_bytes"] = s.fixed_bytes;
      if (dist.active) {
        j["world_size"] = dist.world_size;
        j["backend"] = dist.backend;
        j["global_batch_size"] = o.batch_size * dist.world_size;
        j["bytes_per_step"] = s.bytes_per_step;
      }
      std::printf("%s\n", j.dump().c_str());
    } else if (s.evaluated_only && std::isnan(s.train_accuracy)) {
      std::printf("test %.2f%% accuracy without training (0 epochs)\n", 100.0 * s.test_accuracy);
    } else {
      if (s.stopped_early)
        std::printf("stopped early: the test loss did not improve for %s\n",
                    count_of(o.early_stopping_patience, "epoch").c_str());
      char val[32] = "";
      if (o.val_split > 0) std::snprintf(val, sizeof val, ", val %.2f%%", 100.0 * s.val_accuracy);
      std::printf("test %.2f%%%s, train %.2f%% accuracy after %s, %.1f s; %s\n", 100.0 * s.test_accuracy, val,
                  100.0 * s.train_accuracy, count_of(s.epochs, "epoch").c_str(), s.seconds,
                  (out_dir / "metrics.csv").c_str());
      if (!s.exported.empty()) std::printf("weights: %s\n", s.exported.c_str());
      if (!curves.empty()) std::printf("curves: %s\n", curves.c_str());
      if (!s.compile_report.empty()) std::printf("%s", s.compile_report.c_str());
    }
    if (s.interrupted) {
      // What was saved: the checkpoint of the last completed epoch, if any epoch ever completed.
      if (o.checkpoint_every > 0 && fs::exists(out_dir / "checkpoint.safetensors"))
        std::fprintf(stderr, "mn-train: interrupted (SIGINT); %s holds the last checkpoint written (at an epoch end "
                     "or every %lld steps), and `mn-train --out %s --resume` continues from there\n",
                     (out_dir / "checkpoint.safetensors").c_str(), static_cast<long long>(o.checkpoint_every),
                     out_dir.c_str());
      else if (s.epochs > 0)
        std::fprintf(stderr, "mn-train: interrupted (SIGINT); %s holds epoch %lld, and `mn-train --out %s --resume` "
                     "continues from there\n", (out_dir / "checkpoint.safetensors").c_str(),
                     static_cast<long long>(s.epochs), out_dir.c_str());
      else
        std::fprintf(stderr, "mn-train: interrupted (SIGINT) in the first epoch: nothing was saved; start the run "
                     "again without --resume\n");
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
