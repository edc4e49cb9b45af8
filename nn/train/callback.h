#pragma once
// Callbacks: hooks a trainer calls around epochs, batches and validation, and the built-in ones that
// need nothing beyond the trainer (early stopping, log lines, a progress bar). Writers of files
// (metrics CSV/JSON, periodic checkpoints) are in nn/train/loggers.h.
#include <cstdint>
#include <iosfwd>
#include <map>
#include <memory>
#include <string>

#include "core/error.h"
#include "nn/train/history.h"
#include "nn/train/loss.h"

namespace mn {
class Progress;
}

namespace mn::train {

class Trainer;

// Hooks are no-ops by default. An exception thrown from a hook ends the fit as a RuntimeError
// "Callback 'Name' failed during <hook>: <message>" - except TrainingInterrupted, which stops the fit
// quietly (partial history returned).
class Callback {
 public:
  virtual ~Callback() = default;
  // Used in error messages and as the key of its state in checkpoints; defaults to the unqualified
  // class name.
  virtual std::string name() const;
  virtual void on_fit_start(Trainer&) {}
  virtual void on_fit_end(Trainer&) {}
  virtual void on_epoch_start(Trainer&, int64_t /*epoch*/) {}
  virtual void on_epoch_end(Trainer&, int64_t /*epoch*/, const Metrics&) {}
  virtual void on_batch_start(Trainer&, int64_t /*batch*/) {}
  virtual void on_batch_end(Trainer&, int64_t /*batch*/, const LossOutput&) {}
  virtual void on_validation_start(Trainer&) {}
  virtual void on_validation_end(Trainer&, const Metrics&) {}
  // State a resumed fit needs (e.g. EarlyStopping's best value and wait count); stored in checkpoints
  // through TrainerState::callback_states. Stateless callbacks keep the empty default.
  virtual std::map<std::string, double> state_dict() const { return {}; }
  virtual void load_state_dict(const std::map<std::string, double>&) {}
  // True for callbacks that save checkpoints from their hooks: at every hook they run after all other
  // callbacks, so a checkpoint written from on_epoch_end holds every callback's update of that epoch.
  virtual bool saves_checkpoints() const { return false; }
};

// The C++ counterpart of Ctrl-C in the reference: thrown by a callback (or raised by
// Trainer::interrupt() at the next batch boundary), it ends fit() early; the epochs completed so far
// stay in the returned history and on_fit_end still runs.
class TrainingInterrupted : public Error {
 public:
  TrainingInterrupted() : Error("training interrupted") {}
  using Error::Error;
};

// Sets should_stop when `monitor` has not improved for `patience` epochs: improvement means
// cur < best - min_delta ("min") or cur > best + min_delta ("max"). Epochs whose metrics lack the key
// are ignored. The stop takes effect at the top of the next epoch, so the triggering epoch is fully
// recorded.
class EarlyStopping : public Callback {
 public:
  explicit EarlyStopping(std::string monitor = history_keys::kValTotalLoss, int64_t patience = 10,
                         double min_delta = 0.0, std::string mode = "min");
  std::string name() const override { return "EarlyStopping"; }
  void on_epoch_end(Trainer& trainer, int64_t epoch, const Metrics& metrics) override;
  double best() const { return best_; }
  int64_t wait() const { return wait_; }
  // "wait", and "best" once a value was seen.
  std::map<std::string, double> state_dict() const override;
  void load_state_dict(const std::map<std::string, double>& state) override;

 private:
  std::string monitor_;
  int64_t patience_;
  double min_delta_;
  bool maximize_;
  double best_;
  int64_t wait_ = 0;
};

// Writes "Epoch e/E started", "  batch b: k=v, ..." every N batches, "  validation: ..." and
// "Epoch e/E: k=v, ..." lines (1-based numbers, 4 decimals).
class MetricLogger : public Callback {
 public:
  explicit MetricLogger(int64_t every_n_batches = 10);
  MetricLogger(int64_t every_n_batches, std::ostream& out);
  std::string name() const override { return "MetricLogger"; }
  void on_epoch_start(Trainer& trainer, int64_t epoch) override;
  void on_batch_end(Trainer& trainer, int64_t batch, const LossOutput& output) override;
  void on_validation_end(Trainer& trainer, const Metrics& metrics) override;
  void on_epoch_end(Trainer& trainer, int64_t epoch, const Metrics& metrics) override;

 private:
  int64_t every_n_batches_;
  std::ostream* out_;
};

// A progress line per epoch (mn::Progress) with the loss, samples per second and the ETA of the epoch
// and of the run: redrawn on a terminal; otherwise a plain line every `plain_every` batches (default:
// a tenth of the epoch) and at least every 30 s. Off a terminal the epoch's end prints nothing (pair
// it with EpochSummary for one line per epoch).
class ProgressCallback : public Callback {
 public:
  explicit ProgressCallback(int64_t plain_every = 0);
  ~ProgressCallback() override;
  std::string name() const override { return "ProgressCallback"; }
  void on_epoch_start(Trainer& trainer, int64_t epoch) override;
  void on_batch_end(Trainer& trainer, int64_t batch, const LossOutput& output) override;
  void on_epoch_end(Trainer& trainer, int64_t epoch, const Metrics& metrics) override;
  void on_fit_end(Trainer& trainer) override;  // an epoch cut short ends its line with "stopped"

 private:
  int64_t plain_every_;
  std::unique_ptr<Progress> progress_;
};

// "k=v, k=v" with 4 decimals, in key order.
std::string format_metrics(const Metrics& metrics);

}  // namespace mn::train
