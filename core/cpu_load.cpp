#include "core/cpu_load.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <ctime>
#include <string>

namespace mn::cpu_load {

namespace {

// Splits off the next whitespace-separated field of `line`.
std::string_view next_field(std::string_view& line) {
  size_t b = line.find_first_not_of(" \t");
  if (b == std::string_view::npos) {
    line = {};
    return {};
  }
  size_t e = line.find_first_of(" \t", b);
  if (e == std::string_view::npos) e = line.size();
  std::string_view f = line.substr(b, e - b);
  line.remove_prefix(e);
  return f;
}

uint64_t to_u64(std::string_view s) {
  uint64_t v = 0;
  std::from_chars(s.data(), s.data() + s.size(), v);
  return v;
}

int64_t clock_ns(clockid_t id) {
  timespec ts{};
  clock_gettime(id, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

// The "cpu" lines at the top of /proc/stat (the rest, interrupt counts, can be long on big machines).
bool read_cpu_lines(std::string& out) {
  out.clear();
  const int fd = ::open("/proc/stat", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
    // Done once a complete line that is not a "cpu" line has arrived.
    const size_t last_nl = out.rfind('\n');
    if (last_nl == std::string::npos) continue;
    size_t line = 0;
    bool past = false;
    while (line <= last_nl) {
      if (out.compare(line, 3, "cpu") != 0) {
        past = true;
        break;
      }
      line = out.find('\n', line) + 1;
    }
    if (past) break;
  }
  ::close(fd);
  return !out.empty();
}

std::vector<int> affinity_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

}  // namespace

CpuTimes parse_proc_stat(std::string_view text, const std::vector<int>& allowed, bool count_nice) {
  CpuTimes t;
  while (!text.empty()) {
    const size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text.remove_prefix(nl == std::string_view::npos ? text.size() : nl + 1);
    const std::string_view name = next_field(line);
    // Only per-CPU lines: "cpu" followed by digits (the first line, "cpu", is the sum of all).
    if (name.size() <= 3 || name.substr(0, 3) != "cpu") continue;
    int id = -1;
    const auto [ptr, ec] = std::from_chars(name.data() + 3, name.data() + name.size(), id);
    if (ec != std::errc() || ptr != name.data() + name.size()) continue;
    if (!allowed.empty() && !std::binary_search(allowed.begin(), allowed.end(), id)) continue;
    // user nice system idle iowait irq softirq steal [guest guest_nice: already inside user and nice]
    uint64_t f[8] = {};
    for (uint64_t& v : f) v = to_u64(next_field(line));
    const uint64_t busy = f[0] + f[2] + f[5] + f[6] + f[7] + (count_nice ? f[1] : 0);
    t.busy += busy;
    t.total += busy + f[3] + f[4] + (count_nice ? 0 : f[1]);
    ++t.cpus;
  }
  return t;
}

double other_load(const CpuTimes& before, const CpuTimes& after, double own_cpu_seconds, double wall_seconds) {
  if (after.total <= before.total || after.busy < before.busy || wall_seconds <= 0 || after.cpus <= 0) return 0;
  const double busy_share = static_cast<double>(after.busy - before.busy) / static_cast<double>(after.total - before.total);
  return std::max(0.0, busy_share * after.cpus - own_cpu_seconds / wall_seconds);
}

int taken_cores(double load, int previous, int cpus) {
  const int most = std::max(0, cpus - 1);
  // Raise to every core whose take threshold the load reaches; lower past each whose free threshold it misses.
  int taken = std::clamp(previous, 0, most);
  while (taken < most && load >= (taken + 1) - kTakeMargin) ++taken;
  while (taken > 0 && load < taken - kFreeMargin) --taken;
  return taken;
}

int team_size(int max_threads, int cpus, int taken) {
  if (cpus <= 0) return std::max(1, max_threads);
  return std::max(1, std::min(max_threads, cpus - taken));
}

void LoadMonitor::poll() {
  if (forced_.load(std::memory_order_relaxed) >= 0) return;
  const int64_t now = clock_ns(CLOCK_MONOTONIC_COARSE);
  if (now < next_ns_.load(std::memory_order_relaxed)) return;
  std::unique_lock lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock() || disabled_ || now < next_ns_.load(std::memory_order_relaxed)) return;
  sample(now);
}

void LoadMonitor::sample_now() {
  std::lock_guard lock(mutex_);
  if (!disabled_ && forced_.load(std::memory_order_relaxed) < 0) sample(clock_ns(CLOCK_MONOTONIC_COARSE));
}

void LoadMonitor::sample(int64_t now_ns) {
  next_ns_.store(now_ns + kPeriodNs, std::memory_order_relaxed);
  static thread_local std::string text;
  if (!read_cpu_lines(text)) {
    disabled_ = true;
    taken_.store(0, std::memory_order_relaxed);
    return;
  }
  std::vector<int> mask = affinity_cpus();
  const bool count_nice = getpriority(PRIO_PROCESS, 0) > 0;
  const CpuTimes now = parse_proc_stat(text, mask, count_nice);
  const int64_t wall = clock_ns(CLOCK_MONOTONIC), own = clock_ns(CLOCK_PROCESS_CPUTIME_ID);
  const int64_t gap = wall - prev_wall_ns_;
  if (have_prev_ && mask == prev_mask_ && gap > 0 && gap <= 1'000'000'000 && now.cpus == prev_.cpus) {
    const double load = other_load(prev_, now, (own - prev_own_ns_) * 1e-9, gap * 1e-9);
    taken_.store(taken_cores(load, taken_.load(std::memory_order_relaxed), now.cpus), std::memory_order_relaxed);
  } else if (mask != prev_mask_) {
    taken_.store(0, std::memory_order_relaxed);
  }
  cpus_.store(now.cpus, std::memory_order_relaxed);
  have_prev_ = true;
  prev_ = now;
  prev_mask_ = std::move(mask);
  prev_wall_ns_ = wall;
  prev_own_ns_ = own;
}

void LoadMonitor::force_taken(int taken) {
  std::lock_guard lock(mutex_);
  forced_.store(taken, std::memory_order_relaxed);
  if (taken >= 0) {
    taken_.store(taken, std::memory_order_relaxed);
    if (cpus_.load(std::memory_order_relaxed) == 0)
      cpus_.store(static_cast<int>(std::max<size_t>(1, affinity_cpus().size())), std::memory_order_relaxed);
  } else {
    taken_.store(0, std::memory_order_relaxed);
    have_prev_ = false;
    next_ns_.store(0, std::memory_order_relaxed);
  }
}

LoadMonitor& monitor() {
  static LoadMonitor m;
  return m;
}

}  // namespace mn::cpu_load
