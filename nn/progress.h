#pragma once
// A progress line for long loops: redraws in place with rate and ETA on a terminal, prints a plain
// line every `plain_every` steps otherwise (logs, CI).
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

 private:
  std::string label_;
  int64_t total_, plain_every_, last_plain_ = -1;
  bool tty_;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

}  // namespace mn
