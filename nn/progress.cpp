#include "nn/progress.h"

#include <unistd.h>

#include <cstdio>

namespace mn {

Progress::Progress(std::string label, int64_t total, int64_t plain_every)
    : label_(std::move(label)),
      total_(total),
      plain_every_(plain_every > 0 ? plain_every : std::max<int64_t>(1, total / 10)),
      tty_(isatty(STDOUT_FILENO) != 0),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_),
      last_plain_time_(start_) {}

double Progress::elapsed_seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

double Progress::eta_seconds(int64_t done) const {
  const double elapsed = elapsed_seconds();
  const double rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0.0;
  return rate > 0 ? static_cast<double>(total_ - done) / rate : 0.0;
}

void Progress::update(int64_t done, const std::string& extra) {
  const auto now = std::chrono::steady_clock::now();
  const double elapsed = elapsed_seconds();
  const double rate = elapsed > 0 ? done / elapsed : 0.0;
  const double eta = eta_seconds(done);
  if (tty_) {
    if (done < total_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    const int width = 24;
    const int filled = total_ > 0 ? static_cast<int>(width * done / total_) : width;
    std::printf("\r%s [%.*s%*s] %lld/%lld %.1f it/s eta %.0fs %s\033[K", label_.c_str(), filled,
                "========================", width - filled, "", static_cast<long long>(done),
                static_cast<long long>(total_), rate, eta, extra.c_str());
    std::fflush(stdout);
  } else if (done / plain_every_ != last_plain_ / plain_every_ || done == total_ ||
             now - last_plain_time_ >= std::chrono::seconds(30)) {
    last_plain_ = done;
    last_plain_time_ = now;
    std::printf("%s %lld/%lld (%.1f it/s, eta %.0fs) %s\n", label_.c_str(), static_cast<long long>(done),
                static_cast<long long>(total_), rate, eta, extra.c_str());
    std::fflush(stdout);
  }
}

void Progress::finish(const std::string& extra) {
  if (tty_) {
    update(total_, extra);
    std::printf("\n");
  } else {
    std::printf("%s done in %.1fs %s\n", label_.c_str(), elapsed_seconds(), extra.c_str());
  }
  std::fflush(stdout);
}

}  // namespace mn
