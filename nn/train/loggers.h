#pragma once
// Callbacks that write files: per-epoch metrics as CSV or JSON lines, periodic checkpoints, and a
// one-line epoch summary on a stream.
//
// The metric files keep the rows of the epochs a resumed trainer already has (trainer.epoch() at
// fit start) and drop later ones, which the resumed fit redoes; the file is rewritten atomically at
// fit start and a row is appended at every epoch's end.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "nn/train/callback.h"
#include "nn/train/checkpoint.h"

namespace mn::train {

// Base of the metric files: keeps the first trainer.epoch() records on fit start, appends one per epoch.
class EpochFileLogger : public Callback {
 public:
  explicit EpochFileLogger(std::string path);
  void on_fit_start(Trainer& trainer) override;
  void on_epoch_start(Trainer& trainer, int64_t epoch) override;
  void on_epoch_end(Trainer& trainer, int64_t epoch, const Metrics& metrics) override;
  const std::string& path() const { return path_; }

 protected:
  virtual std::string header() const = 0;  // "" for none; without its newline
  virtual std::string record(int64_t epoch, double seconds, const Metrics& metrics) const = 0;  // one line

 private:
  std::string path_;
  std::chrono::steady_clock::time_point start_;
};

// Columns: epoch (1-based), seconds (the epoch's training and validation time), then one column per
// (header, metric key); a metric absent from an epoch is written as nan.
class CsvLogger : public EpochFileLogger {
 public:
  using Columns = std::vector<std::pair<std::string, std::string>>;
  // train_loss, train_accuracy, test_loss, test_accuracy, lr: the task losses and accuracies of the
  // training and validation passes (mn-train's and mn-demo's metrics.csv).
  static Columns default_columns();
  explicit CsvLogger(std::string path, Columns columns = default_columns());
  std::string name() const override { return "CsvLogger"; }

 protected:
  std::string header() const override;
  std::string record(int64_t epoch, double seconds, const Metrics& metrics) const override;

 private:
  Columns columns_;
};

// One JSON object per line: {"epoch": e, "seconds": s, <every metric>: value}; NaN and infinities null.
class JsonLogger : public EpochFileLogger {
 public:
  explicit JsonLogger(std::string path);
  std::string name() const override { return "JsonLogger"; }

 protected:
  std::string header() const override { return ""; }
  std::string record(int64_t epoch, double seconds, const Metrics& metrics) const override;
};

// Saves trainer.save_checkpoint(path) every `every_n_epochs` epochs and after the last one, and when
// the fit ends (early stopping, an interrupt, an error) after a completed epoch not saved yet. Runs
// after the other callbacks, so the checkpoint holds their state of that epoch.
// every_n_steps > 0 also saves inside epochs, after every optimizer step whose global_step() is a
// multiple of it (except on an epoch's last batch, whose epoch-end save follows, and when a callback has
// asked the fit to stop): a mid-epoch checkpoint, from which the fit continues at the next batch exactly
// as if never interrupted (TrainerState::progress).
// Under data parallel every rank must hold one (the mid-epoch saves gather the ranks' metric sums, a
// collective), and only rank 0 writes (Trainer::is_main_process).
class ModelCheckpoint : public Callback {
 public:
  explicit ModelCheckpoint(std::string path, int64_t every_n_epochs = 1, CheckpointMetadata metadata = {},
                           int64_t every_n_steps = 0);
  std::string name() const override { return "ModelCheckpoint"; }
  bool saves_checkpoints() const override { return true; }
  void on_fit_start(Trainer& trainer) override;
  void on_batch_end(Trainer& trainer, int64_t batch, const LossOutput& output) override;
  void on_epoch_end(Trainer& trainer, int64_t epoch, const Metrics& metrics) override;
  void on_fit_end(Trainer& trainer) override;
  const std::string& path() const { return path_; }
  int64_t every_n_steps() const { return every_n_steps_; }
  // Files this callback wrote (on this process) and the seconds spent writing them.
  int64_t saves() const { return saves_; }
  double save_seconds() const { return save_seconds_; }

 private:
  void save(Trainer& trainer);
  std::string path_;
  int64_t every_n_epochs_;
  CheckpointMetadata metadata_;
  int64_t every_n_steps_;
  int64_t saved_epoch_ = 0;  // trainer.epoch() at the last save (or at fit start)
  int64_t saves_ = 0;
  double save_seconds_ = 0.0;
};

// "epoch e/E: train 84.50% (loss 0.4321), test 85.12% (loss 0.4012), 3.2 s" after every epoch: accuracy
// in percent and the task loss, test values when the epoch validated, "train loss 0.4321" for a task
// without accuracy; flushed, on a C stream (stdout by default). `val_label` names the validation pass
// ("test" by default; "val" when it runs on a split of the training set).
class EpochSummary : public Callback {
 public:
  explicit EpochSummary(std::FILE* out = stdout, std::string val_label = "test")
      : out_(out), val_label_(std::move(val_label)) {}
  std::string name() const override { return "EpochSummary"; }
  void on_epoch_start(Trainer& trainer, int64_t epoch) override;
  void on_epoch_end(Trainer& trainer, int64_t epoch, const Metrics& metrics) override;

 private:
  std::FILE* out_;
  std::string val_label_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace mn::train
