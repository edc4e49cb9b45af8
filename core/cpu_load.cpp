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
#include <optional>
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

// A small text file (/proc, /sys) read whole; false when it cannot be opened or read.
bool read_small_file(const std::string& path, std::string& out) {
  out.clear();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[4096];
  bool ok = true;
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) ok = false;
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > (size_t{1} << 22)) break;  // 4 MiB: no file we read is that long
  }
  ::close(fd);
  return ok;
}

std::string_view trim(std::string_view s) {
  const size_t b = s.find_first_not_of(" \t\n");
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t\n") - b + 1);
}

// A whole decimal integer (optionally negative), or nothing.
std::optional<int64_t> to_i64(std::string_view s) {
  s = trim(s);
  int64_t v = 0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || ptr != s.data() + s.size()) return std::nullopt;
  return v;
}

// Whether the comma-separated list holds `name`.
bool lists(std::string_view list, std::string_view name) {
  while (!list.empty()) {
    const size_t c = list.find(',');
    if (list.substr(0, c) == name) return true;
    if (c == std::string_view::npos) break;
    list.remove_prefix(c + 1);
  }
  return false;
}

// Calls f(line) for each line of text.
template <class F>
void for_each_line(std::string_view text, F&& f) {
  while (!text.empty()) {
    const size_t nl = text.find('\n');
    f(text.substr(0, nl));
    if (nl == std::string_view::npos) break;
    text.remove_prefix(nl + 1);
  }
}

}  // namespace

double parse_cpu_max(std::string_view text) {
  text = trim(text);
  const size_t space = text.find(' ');
  if (space == std::string_view::npos) return 0;
  const std::optional<int64_t> quota = to_i64(text.substr(0, space)), period = to_i64(text.substr(space + 1));
  if (!quota || !period || *quota <= 0 || *period <= 0) return 0;  // "max ...": no limit
  return static_cast<double>(*quota) / static_cast<double>(*period);
}

double parse_cfs_quota(std::string_view quota_us, std::string_view period_us) {
  const std::optional<int64_t> quota = to_i64(quota_us), period = to_i64(period_us);
  if (!quota || !period || *quota <= 0 || *period <= 0) return 0;  // -1: no limit
  return static_cast<double>(*quota) / static_cast<double>(*period);
}

CgroupCpuDirs cgroup_cpu_dirs(std::string_view proc_self_cgroup, std::string_view mountinfo) {
  // Our cgroup in the v1 hierarchy that has the cpu controller ("4:cpu,cpuacct:/path"), and in v2 ("0::/path").
  std::optional<std::string> v1_path, v2_path;
  for_each_line(proc_self_cgroup, [&](std::string_view line) {
    const size_t a = line.find(':'), b = a == std::string_view::npos ? a : line.find(':', a + 1);
    if (b == std::string_view::npos) return;
    const std::string_view controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (line.substr(0, a) == "0" && controllers.empty()) v2_path = std::string(path);
    else if (lists(controllers, "cpu")) v1_path = std::string(path);
  });
  // Mounts: "id parent major:minor root mount-point options [optional...] - fstype source super-options".
  struct Mount {
    std::string root, point;
  };
  std::optional<Mount> v1_mount, v2_mount;
  for_each_line(mountinfo, [&](std::string_view line) {
    const size_t dash = line.find(" - ");
    if (dash == std::string_view::npos) return;
    std::string_view head = line.substr(0, dash), tail = line.substr(dash + 3);
    std::string_view fields[5];
    for (std::string_view& f : fields) f = next_field(head);
    const std::string_view fstype = next_field(tail);
    next_field(tail);  // source
    const std::string_view super_options = next_field(tail);
    if (fields[4].empty()) return;
    if (fstype == "cgroup" && lists(super_options, "cpu") && !v1_mount) v1_mount = Mount{std::string(fields[3]), std::string(fields[4])};
    if (fstype == "cgroup2" && !v2_mount) v2_mount = Mount{std::string(fields[3]), std::string(fields[4])};
  });
  CgroupCpuDirs out;
  const std::optional<std::string>* path = nullptr;
  const Mount* mount = nullptr;
  if (v1_path && v1_mount) {
    path = &v1_path;
    mount = &*v1_mount;
  } else if (v2_path && v2_mount) {
    path = &v2_path;
    mount = &*v2_mount;
    out.v2 = true;
  } else {
    return out;
  }
  // The cgroup's directory under the mount point: its path less the mount's root (a container sees its
  // own cgroup mounted as the root); a path outside the root (cgroup namespaces) is the mount point.
  std::string rel = **path;
  const std::string& root = mount->root;
  if (root != "/") {
    if (rel.compare(0, root.size(), root) == 0 && (rel.size() == root.size() || rel[root.size()] == '/'))
      rel = rel.substr(root.size());
    else
      rel.clear();
  }
  while (!rel.empty() && rel.back() == '/') rel.pop_back();
  if (!rel.empty() && rel.front() != '/') rel.clear();
  if (rel.find("/..") != std::string::npos) rel.clear();  // never climb above the mount point
  std::string point = mount->point;
  while (point.size() > 1 && point.back() == '/') point.pop_back();
  for (;;) {
    out.dirs.push_back(point == "/" && !rel.empty() ? rel : point + rel);
    if (rel.empty()) break;
    rel.erase(rel.rfind('/'));
  }
  return out;
}

double cgroup_cpu_limit(const std::string& root) {
  std::string cgroup, mountinfo;
  if (!read_small_file(root + "/proc/self/cgroup", cgroup) || !read_small_file(root + "/proc/self/mountinfo", mountinfo))
    return 0;
  return cgroup_cpu_limit(cgroup_cpu_dirs(cgroup, mountinfo), root);
}

double cgroup_cpu_limit(const CgroupCpuDirs& where, const std::string& root) {
  double limit = 0;
  std::string a, b;
  for (const std::string& dir : where.dirs) {
    double l = 0;
    if (where.v2) {
      if (read_small_file(root + dir + "/cpu.max", a)) l = parse_cpu_max(a);
    } else if (read_small_file(root + dir + "/cpu.cfs_quota_us", a) && read_small_file(root + dir + "/cpu.cfs_period_us", b)) {
      l = parse_cfs_quota(a, b);
    }
    if (l > 0 && (limit == 0 || l < limit)) limit = l;
  }
  return limit;
}

int quota_cpus(double limit) {
  if (!(limit > 0)) return 0;
  return static_cast<int>(std::clamp(std::floor(limit + 1e-9), 1.0, 1e6));
}

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

int team_size(int max_threads, int cpus, int taken, int quota) {
  const int cap = quota > 0 ? std::min(max_threads, quota) : max_threads;
  if (cpus <= 0) return std::max(1, cap);
  return std::max(1, std::min(cap, cpus - taken));
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
  // The cgroup limit: /proc/self/cgroup every time (the process may have been moved), the mounts only
  // when that changed (the kernel formats /proc/self/mountinfo anew at each read: most of the cost).
  static thread_local std::string cgroup_text;
  if (read_small_file("/proc/self/cgroup", cgroup_text)) {
    if (cgroup_text != cgroup_text_) {
      std::string mountinfo;
      cpu_dirs_ = read_small_file("/proc/self/mountinfo", mountinfo) ? cgroup_cpu_dirs(cgroup_text, mountinfo) : CgroupCpuDirs{};
      cgroup_text_ = cgroup_text;
    }
    quota_.store(quota_cpus(cgroup_cpu_limit(cpu_dirs_)), std::memory_order_relaxed);
  } else {
    quota_.store(0, std::memory_order_relaxed);
  }
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

void LoadMonitor::force_taken(int taken, int quota) {
  std::lock_guard lock(mutex_);
  forced_.store(taken, std::memory_order_relaxed);
  if (taken >= 0) {
    taken_.store(taken, std::memory_order_relaxed);
    quota_.store(std::max(0, quota), std::memory_order_relaxed);
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
