#pragma once
// How many of our CPUs other processes keep busy, measured from /proc/stat, and the CPU limit of our
// cgroup: the inputs of the adaptive default team size (core/parallel.h). The parsing and the decisions are plain functions of their
// arguments so tests can feed them given samples; LoadMonitor adds the clock and the file reads.
//
// Why: libgomp's workers spin for a while at the end of every parallel region. When another process
// holds one of our cores, the worker that shares it burns its time slice spinning and reaches the
// next region late, and a step of ~50 regions then runs slower on 2 threads than on 1 (README,
// "Shared machines"). Leaving the taken cores out of the team avoids that; counting a core as taken
// needs only coarse figures (a window of ~200 ms every ~200 ms).
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace mn::cpu_load {

// Jiffies summed over a set of CPUs.
struct CpuTimes {
  uint64_t busy = 0;   // user + system + irq + softirq + steal (+ nice when counted)
  uint64_t total = 0;  // busy + idle + iowait (+ nice when not counted as busy)
  int cpus = 0;        // how many "cpuN" lines were summed
};

// Sums the "cpuN" lines of /proc/stat text over the CPUs listed in `allowed` (every CPU when empty).
// Time of niced processes counts as busy only when count_nice is set: a niced process hardly delays
// our threads unless we are niced too. Steal counts as busy (the hypervisor gave the core away).
CpuTimes parse_proc_stat(std::string_view text, const std::vector<int>& allowed, bool count_nice);

// Cores' worth of CPU time used by others between two samples of the same CPUs: the busy share of
// the window times the CPUs, less our own CPU time over the window's wall time. Never below 0.
double other_load(const CpuTimes& before, const CpuTimes& after, double own_cpu_seconds, double wall_seconds);

// How many cores count as taken after a window in which others used `load` cores, given the count
// after the previous window: the k-th core becomes taken at load >= k - kTakeMargin and is freed again
// below k - kFreeMargin, so a load near a threshold does not make the team flap. In [0, cpus - 1].
constexpr double kTakeMargin = 0.6;  // a core 40 % used by others already costs a spinning team more
constexpr double kFreeMargin = 0.8;  // than it gains; back to it once others use less than 20 %
int taken_cores(double load, int previous, int cpus);

// The team for a region: the free cores, at most max_threads and at most `quota` (0: no cap), at least 1.
int team_size(int max_threads, int cpus, int taken, int quota = 0);

// A cgroup CPU bandwidth limit (a container's --cpus, a Kubernetes CPU limit, systemd's CPUQuota): the
// whole group may run `limit` CPUs' worth of time per period, whatever its affinity mask allows. A team
// wider than that is throttled as a whole for the rest of each period, and its workers' spinning at
// the end of every region spends quota the work needs (measured: a 1-CPU quota on this 2-core VM made
// two threads' mean MLP step 1.9x one thread's). So the default team is capped at the limit's whole CPUs.
//
// Parsers, plain functions of the files' text, in CPUs (1.5: one and a half CPUs' time per period),
// 0 for no limit or text that is not a limit:
double parse_cpu_max(std::string_view text);                               // v2 cpu.max: "max 100000", "150000 100000"
double parse_cfs_quota(std::string_view quota_us, std::string_view period_us);  // v1: cpu.cfs_quota_us (-1: none)
// Where this process's cpu controller files are, from the texts of /proc/self/cgroup and
// /proc/self/mountinfo: a v1 hierarchy with the cpu controller if one is mounted, else the v2 one; its
// own cgroup's directory first, then each ancestor's up to the mount point (the limit of every one of
// them applies). Empty when neither is found.
struct CgroupCpuDirs {
  bool v2 = false;
  std::vector<std::string> dirs;
};
CgroupCpuDirs cgroup_cpu_dirs(std::string_view proc_self_cgroup, std::string_view mountinfo);
// The limit in force: the smallest along those directories, 0 when there is none or nothing can be
// read. `root` prefixes every path read ("" for the real /proc and /sys; tests give a directory that
// mimics them).
double cgroup_cpu_limit(const std::string& root = "");
// The same along directories already found (`root` as above).
double cgroup_cpu_limit(const CgroupCpuDirs& where, const std::string& root = "");
// The cap a limit puts on the team: its whole CPUs, at least 1; 0 (no cap) for no limit. Rounded down:
// with 1.5 CPUs two threads lost 17 % on the MLP step against one and gained 5 % on CNN2's.
int quota_cpus(double limit);

// The process-wide measurement: sample() reads /proc/stat (only the "cpu" lines), the affinity mask and
// the process CPU time when the last sample is older than the period, from whichever thread calls
// first; other threads meanwhile use the last decision. A first sample, or one after a gap of more than
// a second, only sets the baseline. Without a readable /proc/stat nothing is ever counted as taken.
class LoadMonitor {
 public:
  static constexpr int64_t kPeriodNs = 200'000'000;

  // Cores currently counted as taken and the CPUs of the affinity mask (0 before the first sample).
  int taken() const { return taken_.load(std::memory_order_relaxed); }
  int cpus() const { return cpus_.load(std::memory_order_relaxed); }
  // The cgroup CPU limit's cap on the team (quota_cpus; 0: none), read again at every sample (a
  // process may be moved to another cgroup, or its limit changed, at any time).
  int quota() const { return quota_.load(std::memory_order_relaxed); }
  // Takes a sample if one is due (cheap otherwise: one coarse clock read).
  void poll();
  // Takes a sample now (benchmarks time it).
  void sample_now();
  // Tests: force the taken count (>= 0) and the quota cap (0: none) and stop sampling; taken -1
  // returns to measuring.
  void force_taken(int taken, int quota = 0);

 private:
  void sample(int64_t now_ns);
  std::atomic<int64_t> next_ns_{0};
  std::atomic<int> taken_{0}, cpus_{0}, forced_{-1}, quota_{0};
  std::mutex mutex_;  // guards the previous sample below
  bool have_prev_ = false, disabled_ = false;
  CpuTimes prev_;
  std::vector<int> prev_mask_;
  std::string cgroup_text_;  // /proc/self/cgroup when cpu_dirs_ was found
  CgroupCpuDirs cpu_dirs_;
  int64_t prev_wall_ns_ = 0, prev_own_ns_ = 0;
};

LoadMonitor& monitor();

}  // namespace mn::cpu_load
