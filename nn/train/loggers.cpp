#include "nn/train/loggers.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "nn/safetensors.h"
#include "nn/train/trainer.h"

namespace mn::train {

namespace {

double metric_or_nan(const Metrics& metrics, const std::string& key) {
  auto it = metrics.find(key);
  return it == metrics.end() ? std::numeric_limits<double>::quiet_NaN() : it->second;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// value with `decimals` digits after the point.
std::string fixed(double value, int decimals) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.*f", decimals, value);
  return text;
}

}  // namespace

// ---- metric files ----

EpochFileLogger::EpochFileLogger(std::string path) : path_(std::move(path)) {
  MN_CHECK(!path_.empty(), ValueError, name(), ": the path must be non-empty");
}

void EpochFileLogger::on_fit_start(Trainer& trainer) {
  // Rewritten whole and atomically (a kill meanwhile keeps the old file): the header, then the records
  // of the epochs the trainer has already completed (a resumed run); later records are redone.
  const std::string head = header();
  std::string text = head.empty() ? std::string() : head + '\n';
  const int64_t keep = trainer.epoch();
  if (keep > 0) {
    std::ifstream in(path_);
    std::string line;
    if (!head.empty()) std::getline(in, line);
    for (int64_t kept = 0; kept < keep && std::getline(in, line); ++kept) text += line + '\n';
  }
  safetensors::write_file_atomically(path_, text.data(), text.size());
}

void EpochFileLogger::on_epoch_start(Trainer&, int64_t) { start_ = std::chrono::steady_clock::now(); }

void EpochFileLogger::on_epoch_end(Trainer&, int64_t epoch, const Metrics& metrics) {
  std::ofstream out(path_, std::ios::app);
  out << record(epoch, seconds_since(start_), metrics) << '\n';
  out.flush();
  MN_CHECK(out.good(), IOError, name(), ": cannot append to ", path_);
}

CsvLogger::Columns CsvLogger::default_columns() {
  namespace k = history_keys;
  return {{"train_loss", k::kTrainTaskLoss},
          {"train_accuracy", k::kTrainAccuracy},
          {"test_loss", k::kValTaskLoss},
          {"test_accuracy", k::kValAccuracy},
          {"lr", k::kLearningRate}};
}

CsvLogger::CsvLogger(std::string path, Columns columns) : EpochFileLogger(std::move(path)), columns_(std::move(columns)) {}

std::string CsvLogger::header() const {
  std::string h = "epoch,seconds";
  for (const auto& [title, key] : columns_) h += "," + title;
  return h;
}

std::string CsvLogger::record(int64_t epoch, double seconds, const Metrics& metrics) const {
  std::ostringstream os;
  os << epoch + 1 << ',' << seconds;
  for (const auto& [title, key] : columns_) os << ',' << metric_or_nan(metrics, key);
  return os.str();
}

JsonLogger::JsonLogger(std::string path) : EpochFileLogger(std::move(path)) {}

std::string JsonLogger::record(int64_t epoch, double seconds, const Metrics& metrics) const {
  nlohmann::ordered_json j;
  j["epoch"] = epoch + 1;
  j["seconds"] = seconds;
  for (const auto& [key, value] : metrics) j[key] = std::isfinite(value) ? nlohmann::ordered_json(value) : nullptr;
  return j.dump();
}

// ---- checkpoints ----

ModelCheckpoint::ModelCheckpoint(std::string path, int64_t every_n_epochs, CheckpointMetadata metadata,
                                 int64_t every_n_steps)
    : path_(std::move(path)),
      every_n_epochs_(every_n_epochs),
      metadata_(std::move(metadata)),
      every_n_steps_(every_n_steps) {
  MN_CHECK(!path_.empty(), ValueError, "ModelCheckpoint: the path must be non-empty");
  MN_CHECK(every_n_epochs >= 1, ValueError, "ModelCheckpoint: every_n_epochs must be at least 1, got ",
           every_n_epochs);
  MN_CHECK(every_n_steps >= 0, ValueError, "ModelCheckpoint: every_n_steps must be >= 0 (0: only at epoch ends), got ",
           every_n_steps);
}

void ModelCheckpoint::save(Trainer& trainer) {
  if (!trainer.is_main_process()) return;
  const auto start = std::chrono::steady_clock::now();
  trainer.save_checkpoint(path_, metadata_);
  save_seconds_ += seconds_since(start);
  ++saves_;
}

void ModelCheckpoint::on_batch_end(Trainer& trainer, int64_t batch, const LossOutput&) {
  if (every_n_steps_ == 0 || !trainer.at_step_boundary() || trainer.global_step() % every_n_steps_ != 0) return;
  // The epoch's last batch: its end (validation, history, the epoch-end save) follows. A stop requested
  // at this batch ends the epoch here, which a resumed fit could not know.
  if (batch + 1 >= trainer.active_loader().size() || trainer.should_stop()) return;
  trainer.sync_epoch_progress();
  save(trainer);
}

void ModelCheckpoint::on_epoch_end(Trainer& trainer, int64_t epoch, const Metrics&) {
  const bool last = epoch + 1 >= trainer.config().max_epochs;
  if ((epoch + 1) % every_n_epochs_ != 0 && !last) return;
  save(trainer);
  saved_epoch_ = trainer.epoch();
}

void ModelCheckpoint::on_fit_start(Trainer& trainer) { saved_epoch_ = trainer.epoch(); }

void ModelCheckpoint::on_fit_end(Trainer& trainer) {
  // A fit that stopped (early stopping, an interrupt, an error) after an epoch between two saves.
  if (trainer.epoch() != saved_epoch_) {
    save(trainer);
    saved_epoch_ = trainer.epoch();
  }
}

// ---- console ----

void EpochSummary::on_epoch_start(Trainer&, int64_t) { start_ = std::chrono::steady_clock::now(); }

void EpochSummary::on_epoch_end(Trainer& trainer, int64_t epoch, const Metrics& m) {
  namespace k = history_keys;
  // "train 84.50% (loss 0.4321)" or, without an accuracy metric, "train loss 0.4321".
  const auto part = [&m](const char* label, const char* accuracy, const char* loss) {
    std::string text = label;
    if (m.count(accuracy))
      text += str(" ", fixed(100.0 * m.at(accuracy), 2), "% (loss ", fixed(metric_or_nan(m, loss), 4), ")");
    else
      text += str(" loss ", fixed(metric_or_nan(m, loss), 4));
    return text;
  };
  std::string line = str("epoch ", epoch + 1, "/", trainer.config().max_epochs, ": ",
                         part("train", k::kTrainAccuracy, k::kTrainTaskLoss));
  if (m.count(k::kValAccuracy) || m.count(k::kValTaskLoss))
    line += ", " + part(val_label_.c_str(), k::kValAccuracy, k::kValTaskLoss);
  std::fprintf(out_, "%s, %.1f s\n", line.c_str(), seconds_since(start_));
  std::fflush(out_);
}

}  // namespace mn::train
