#include "nn/train/callback.h"

#include <cxxabi.h>

#include <cmath>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <limits>
#include <sstream>
#include <typeinfo>

#include "nn/progress.h"
#include "nn/train/trainer.h"

namespace mn::train {

std::string format_metrics(const Metrics& metrics) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(4);
  bool first = true;
  for (const auto& [k, v] : metrics) {
    os << (first ? "" : ", ") << k << "=" << v;
    first = false;
  }
  return os.str();
}

std::string Callback::name() const {
  const char* mangled = typeid(*this).name();
  int status = 0;
  char* demangled = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string full = status == 0 && demangled ? demangled : mangled;
  std::free(demangled);
  const size_t colon = full.rfind("::");
  return colon == std::string::npos ? full : full.substr(colon + 2);
}

// ---- EarlyStopping ----

EarlyStopping::EarlyStopping(std::string monitor, int64_t patience, double min_delta, std::string mode)
    : monitor_(std::move(monitor)), patience_(patience), min_delta_(min_delta) {
  MN_CHECK(mode == "min" || mode == "max", ValueError, "EarlyStopping: mode must be 'min' or 'max', got '", mode, "'");
  MN_CHECK(patience >= 0, ValueError, "EarlyStopping: patience must be non-negative, got ", patience);
  MN_CHECK(min_delta >= 0.0, ValueError, "EarlyStopping: min_delta must be non-negative, got ", min_delta);
  maximize_ = mode == "max";
  best_ = maximize_ ? -std::numeric_limits<double>::infinity() : std::numeric_limits<double>::infinity();
}

void EarlyStopping::on_epoch_end(Trainer& trainer, int64_t, const Metrics& metrics) {
  auto it = metrics.find(monitor_);
  if (it == metrics.end()) return;
  const double current = it->second;
  const bool improved = maximize_ ? current > best_ + min_delta_ : current < best_ - min_delta_;
  if (improved) {
    best_ = current;
    wait_ = 0;
    return;
  }
  if (++wait_ >= patience_) trainer.set_should_stop(true);
}

std::map<std::string, double> EarlyStopping::state_dict() const {
  std::map<std::string, double> state{{"wait", static_cast<double>(wait_)}};
  if (std::isfinite(best_)) state["best"] = best_;
  return state;
}

void EarlyStopping::load_state_dict(const std::map<std::string, double>& state) {
  auto wait = state.find("wait");
  MN_CHECK(wait != state.end(), KeyError, "EarlyStopping state has no 'wait'");
  MN_CHECK(wait->second >= 0 && wait->second == std::floor(wait->second), ValueError,
           "EarlyStopping state 'wait' must be a non-negative whole number, got ", wait->second);
  auto best = state.find("best");
  MN_CHECK(best == state.end() || std::isfinite(best->second), ValueError,
           "EarlyStopping state 'best' must be finite, got ", best->second);
  wait_ = static_cast<int64_t>(wait->second);
  best_ = best != state.end() ? best->second
                              : (maximize_ ? -std::numeric_limits<double>::infinity()
                                           : std::numeric_limits<double>::infinity());
}

// ---- MetricLogger ----

MetricLogger::MetricLogger(int64_t every_n_batches) : MetricLogger(every_n_batches, std::clog) {}

MetricLogger::MetricLogger(int64_t every_n_batches, std::ostream& out) : every_n_batches_(every_n_batches), out_(&out) {
  MN_CHECK(every_n_batches >= 1, ValueError, "MetricLogger: every_n_batches must be at least 1, got ",
           every_n_batches);
}

void MetricLogger::on_epoch_start(Trainer& trainer, int64_t epoch) {
  *out_ << "Epoch " << epoch + 1 << "/" << trainer.config().max_epochs << " started\n";
}

void MetricLogger::on_batch_end(Trainer&, int64_t batch, const LossOutput& output) {
  if ((batch + 1) % every_n_batches_ != 0) return;
  *out_ << "  batch " << batch + 1 << ": " << format_metrics(output.metrics) << "\n";
}

void MetricLogger::on_validation_end(Trainer&, const Metrics& metrics) {
  *out_ << "  validation: " << format_metrics(metrics) << "\n";
}

void MetricLogger::on_epoch_end(Trainer& trainer, int64_t epoch, const Metrics& metrics) {
  *out_ << "Epoch " << epoch + 1 << "/" << trainer.config().max_epochs << ": " << format_metrics(metrics) << "\n";
  out_->flush();
}

// ---- ProgressCallback ----

ProgressCallback::ProgressCallback(int64_t plain_every) : plain_every_(plain_every) {}
ProgressCallback::~ProgressCallback() = default;

void ProgressCallback::on_epoch_start(Trainer& trainer, int64_t epoch) {
  progress_ = std::make_unique<Progress>(str("epoch ", epoch + 1, "/", trainer.config().max_epochs),
                                         trainer.train_loader().size(), plain_every_);
}

void ProgressCallback::on_batch_end(Trainer& trainer, int64_t batch, const LossOutput& output) {
  if (!progress_) return;
  std::ostringstream os;
  // The trainer has read the step's metrics already (one transfer); item() would synchronise again.
  const auto total = output.metrics.find("total");
  const double loss = total != output.metrics.end() ? total->second
                      : output.total.defined()     ? output.total.detach().item()
                                                   : 0.0;
  const double elapsed = progress_->elapsed_seconds();
  const double samples = static_cast<double>((batch + 1) * trainer.train_loader().options().batch_size);
  // The run: this epoch's rest, then the epochs after it at this epoch's pace (validation not counted).
  const double epoch_seconds = elapsed + progress_->eta_seconds(batch + 1);
  const double run_eta = progress_->eta_seconds(batch + 1) +
                         static_cast<double>(trainer.config().max_epochs - trainer.current_epoch() - 1) * epoch_seconds;
  os << std::fixed << std::setprecision(4) << "loss " << loss << std::setprecision(0) << ", "
     << (elapsed > 0 ? samples / elapsed : 0.0) << " samples/s, run eta " << run_eta << "s";
  progress_->update(batch + 1, os.str());
}

void ProgressCallback::on_epoch_end(Trainer&, int64_t, const Metrics& metrics) {
  if (!progress_) return;
  if (progress_->on_terminal()) progress_->finish(format_metrics(metrics));
  progress_.reset();
}

void ProgressCallback::on_fit_end(Trainer&) {
  if (!progress_) return;
  if (progress_->on_terminal()) progress_->finish("stopped");
  progress_.reset();
}

}  // namespace mn::train
