#pragma once
// A progress line for long loops: redraws in place with rate and ETA on a terminal; otherwise (logs,
// pipes, CI) prints a plain line every `plain_every` steps (default: every tenth of the total) and at
// least every 30 seconds, so a long step never leaves a log silent.
#include <chrono>
#include <cstdint>
#include <string>

namespace mn {

class Progress {
 public:
  Progress(std::string label, int64_t total, int64_t plain_every = 0);
  // Advance to `done` steps; `extra` is appended (e.g. "loss 0.31").
  void update(int64_t done, const std::string& extra = "");
  void finish(const std::string& extra = "");
  double elapsed_seconds() const;
  bool on_terminal() const { return tty_; }
  // Seconds left at the current rate (0 before the first step).
  double eta_seconds(int64_t done) const;

 private:
  std::string label_;
  int64_t total_, plain_every_, last_plain_ = -1;
  bool tty_;
  std::chrono::steady_clock::time_point start_, last_draw_, last_plain_time_;
};

}  // namespace mn
