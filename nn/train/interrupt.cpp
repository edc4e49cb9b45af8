#include "nn/train/interrupt.h"

#include <atomic>

namespace mn::train {

namespace {

// Set by the handler (a lock-free atomic store is all it does); read at batch boundaries.
std::atomic<bool> g_sigint{false};
static_assert(std::atomic<bool>::is_always_lock_free);

extern "C" void on_sigint(int) { g_sigint.store(true); }

}  // namespace

StopOnSigint::~StopOnSigint() { restore(); }

void StopOnSigint::on_fit_start(Trainer&) {
  if (installed_) return;
  g_sigint.store(false);
  struct sigaction current {};
  if (sigaction(SIGINT, nullptr, &current) != 0 || current.sa_handler == SIG_IGN) return;
  struct sigaction action {};
  action.sa_handler = on_sigint;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESETHAND;  // a second SIGINT has the default effect
  installed_ = sigaction(SIGINT, &action, &previous_) == 0;
}

void StopOnSigint::on_batch_start(Trainer&, int64_t) {
  if (installed_ && g_sigint.load()) throw TrainingInterrupted("interrupted by SIGINT");
}

void StopOnSigint::on_fit_end(Trainer&) { restore(); }

bool StopOnSigint::interrupted() const { return g_sigint.load(); }

void StopOnSigint::restore() {
  if (!installed_) return;
  sigaction(SIGINT, &previous_, nullptr);
  installed_ = false;
}

}  // namespace mn::train
