#pragma once
// Ctrl-C for training programs: the first SIGINT stops the fit before the next batch (the epoch in
// progress is dropped; completed epochs stay in the history and in checkpoints written by
// ModelCheckpoint, whose on_fit_end runs); a second one has the default effect (the process ends).
//
//   auto sigint = std::make_shared<train::StopOnSigint>();
//   trainer.add_callback(sigint);
//   trainer.fit();
//   if (sigint->interrupted()) return 130;
//
// The handler is installed at fit start and the previous action restored at fit end. A process that
// started with SIGINT ignored (a background job of a non-interactive shell, ranks under some
// launchers) keeps ignoring it. The handler only stores to a lock-free atomic flag.
#include <csignal>

#include "nn/train/callback.h"

namespace mn::train {

class StopOnSigint : public Callback {
 public:
  StopOnSigint() = default;
  ~StopOnSigint() override;
  StopOnSigint(const StopOnSigint&) = delete;
  StopOnSigint& operator=(const StopOnSigint&) = delete;
  std::string name() const override { return "StopOnSigint"; }
  void on_fit_start(Trainer& trainer) override;
  void on_batch_start(Trainer& trainer, int64_t batch) override;
  void on_fit_end(Trainer& trainer) override;
  // Whether a SIGINT arrived while the handler was installed (the fit then stopped early).
  bool interrupted() const;

 private:
  void restore();
  struct sigaction previous_ {};
  bool installed_ = false;
};

}  // namespace mn::train
