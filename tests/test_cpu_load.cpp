// The adaptive default team size (core/parallel.h, core/cpu_load.h): /proc/stat parsing, the load
// others put on our CPUs, the taken-core decision with its hysteresis, and how the team follows it
// for threads without an explicit count while results stay the same bits. No timing is involved: the
// decisions are fed given samples, and the monitor is forced where the whole path is checked.
#include <omp.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "core/cpu_load.h"
#include "core/parallel.h"
#include "nn/functional.h"
#include "tests/temp_dir.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::cpu_load;

namespace {

// Two /proc/stat snapshots of a 2-CPU machine 200 ms apart (USER_HZ 100: 20 jiffies per CPU), taken
// while a busy loop held cpu0 and our process ran one thread on cpu1.
//   fields: user nice system idle iowait irq softirq steal guest guest_nice
const char* kBefore =
    "cpu  2000 40 300 5000 20 0 10 5 0 0\n"
    "cpu0 1000 20 150 2500 10 0 5 3 0 0\n"
    "cpu1 1000 20 150 2500 10 0 5 2 0 0\n"
    "intr 123456 0 0 0\n"
    "ctxt 999\n";
const char* kAfter =
    "cpu  2038 40 301 5001 20 0 10 5 0 0\n"
    "cpu0 1020 20 150 2500 10 0 5 3 0 0\n"   // +20 user: the busy loop, the whole window
    "cpu1 1018 20 151 2501 10 0 5 2 0 0\n"   // +18 user +1 system: us, +1 idle
    "intr 123999 0 0 0\n";

}  // namespace

TEST_CASE("cpu_load: parse_proc_stat sums the per-CPU lines of the allowed CPUs") {
  const CpuTimes all = parse_proc_stat(kBefore, {}, false);
  CHECK(all.cpus == 2);
  // busy = user + system + irq + softirq + steal; total adds idle, iowait and (not counted) nice
  CHECK(all.busy == (1000 + 150 + 0 + 5 + 3) + (1000 + 150 + 0 + 5 + 2));
  CHECK(all.total == all.busy + 2500 + 10 + 20 + 2500 + 10 + 20);
  const CpuTimes one = parse_proc_stat(kBefore, {1}, false);
  CHECK(one.cpus == 1);
  CHECK(one.busy == 1000 + 150 + 5 + 2);
  // Niced time is busy only when we are niced ourselves; the total does not change.
  const CpuTimes nice = parse_proc_stat(kBefore, {1}, true);
  CHECK(nice.busy == one.busy + 20);
  CHECK(nice.total == one.total);
  // CPUs not in the mask, the aggregate line, other lines and garbage are skipped.
  CHECK(parse_proc_stat(kBefore, {5, 7}, false).cpus == 0);
  CHECK(parse_proc_stat("cpuX 1 2 3\ncpu 5 5 5 5\nbogus\n", {}, false).cpus == 0);
  CHECK(parse_proc_stat("", {}, false).cpus == 0);
}

TEST_CASE("cpu_load: other_load is the busy share less our own CPU time") {
  const CpuTimes a = parse_proc_stat(kBefore, {0, 1}, false), b = parse_proc_stat(kAfter, {0, 1}, false);
  // 39 busy of 40 jiffies on 2 CPUs = 1.95 cores; we used 0.19 s of CPU in 0.2 s = 0.95 core.
  const double load = other_load(a, b, 0.19, 0.2);
  CHECK(load == doctest::Approx(39.0 / 40.0 * 2 - 0.95));
  // Everything busy was ours: no other load, never negative.
  CHECK(other_load(a, b, 0.4, 0.2) == 0.0);
  // No time passed, or counters went backwards: nothing measured.
  CHECK(other_load(a, a, 0.0, 0.2) == 0.0);
  CHECK(other_load(b, a, 0.0, 0.2) == 0.0);
  CHECK(other_load(a, b, 0.0, 0.0) == 0.0);
}

TEST_CASE("cpu_load: a core is taken from 0.4 of it used by others and freed below 0.2") {
  CHECK(taken_cores(0.0, 0, 2) == 0);
  CHECK(taken_cores(0.39, 0, 2) == 0);
  CHECK(taken_cores(0.4, 0, 2) == 1);
  CHECK(taken_cores(1.0, 0, 2) == 1);
  CHECK(taken_cores(1.9, 0, 2) == 1);  // at least one core stays ours
  // Hysteresis: between the two thresholds the previous count stays.
  CHECK(taken_cores(0.3, 1, 2) == 1);
  CHECK(taken_cores(0.3, 0, 2) == 0);
  CHECK(taken_cores(0.19, 1, 2) == 0);
  // Several cores at once, both ways.
  CHECK(taken_cores(3.5, 0, 16) == 4);
  CHECK(taken_cores(3.3, 4, 16) == 4);
  CHECK(taken_cores(1.1, 4, 16) == 1);
  CHECK(taken_cores(1.3, 2, 16) == 2);  // inside the second core's band
  CHECK(taken_cores(1.3, 0, 16) == 1);
  CHECK(taken_cores(0.0, 4, 16) == 0);
  CHECK(taken_cores(5.0, 0, 1) == 0);
  CHECK(taken_cores(0.0, 7, 2) == 0);  // a previous count from another mask is clamped
}

TEST_CASE("cpu_load: the team is the free cores within the thread count") {
  CHECK(team_size(2, 2, 0) == 2);
  CHECK(team_size(2, 2, 1) == 1);
  CHECK(team_size(16, 16, 4) == 12);
  CHECK(team_size(4, 16, 2) == 4);
  CHECK(team_size(2, 0, 0) == 2);  // nothing sampled yet
  CHECK(team_size(1, 2, 1) == 1);
  // The samples above, end to end: the busy loop on cpu0 takes one of two cores.
  const double load = other_load(parse_proc_stat(kBefore, {}, false), parse_proc_stat(kAfter, {}, false), 0.19, 0.2);
  CHECK(team_size(2, 2, taken_cores(load, 0, 2)) == 1);
}

TEST_CASE("cpu_load: cgroup CPU limits: cpu.max, cfs quota, and the cap they put on the team") {
  CHECK(parse_cpu_max("max 100000\n") == 0);
  CHECK(parse_cpu_max("150000 100000\n") == doctest::Approx(1.5));
  CHECK(parse_cpu_max("50000 100000") == doctest::Approx(0.5));
  CHECK(parse_cpu_max("") == 0);
  CHECK(parse_cpu_max("garbage") == 0);
  CHECK(parse_cpu_max("100000 0") == 0);
  CHECK(parse_cfs_quota("-1\n", "100000\n") == 0);
  CHECK(parse_cfs_quota("200000\n", "100000\n") == doctest::Approx(2.0));
  CHECK(parse_cfs_quota("x", "100000") == 0);
  CHECK(quota_cpus(0) == 0);
  CHECK(quota_cpus(0.5) == 1);  // at least one thread
  CHECK(quota_cpus(1.0) == 1);
  CHECK(quota_cpus(1.5) == 1);  // whole CPUs: a wider team is throttled
  CHECK(quota_cpus(2.0) == 2);
  CHECK(quota_cpus(15.99) == 15);
  CHECK(team_size(2, 2, 0, 1) == 1);
  CHECK(team_size(16, 16, 2, 4) == 4);
  CHECK(team_size(16, 16, 14, 4) == 2);  // the taken cores still count
  CHECK(team_size(2, 0, 0, 1) == 1);     // before the first load sample
  CHECK(team_size(2, 2, 0, 0) == 2);
}

TEST_CASE("cpu_load: the cgroup directories of the cpu controller, v1 and v2, and the limit along them") {
  // v1 (this development VM's layout): the cpu hierarchy mounted at /sys/fs/cgroup/cpu, our cgroup /a/b.
  const char* v1_cgroup = "4:memory:/x\n1:cpu,cpuacct:/a/b\n0::/\n";
  const char* v1_mounts =
      "30 25 0:26 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n"
      "31 25 0:27 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:9 - cgroup cgroup rw,cpu,cpuacct\n"
      "32 25 0:28 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n";
  CgroupCpuDirs d = cgroup_cpu_dirs(v1_cgroup, v1_mounts);
  CHECK_FALSE(d.v2);
  CHECK(d.dirs == std::vector<std::string>{"/sys/fs/cgroup/cpu,cpuacct/a/b", "/sys/fs/cgroup/cpu,cpuacct/a",
                                           "/sys/fs/cgroup/cpu,cpuacct"});
  // cpuacct alone is not cpu.
  d = cgroup_cpu_dirs("2:cpuacct:/a\n", "31 25 0:27 / /sys/fs/cgroup/cpuacct rw - cgroup cgroup rw,cpuacct\n");
  CHECK(d.dirs.empty());
  // v2 only; a container whose own cgroup is mounted as the root ("/docker/c1" seen as /sys/fs/cgroup).
  d = cgroup_cpu_dirs("0::/docker/c1/job\n", "40 30 0:30 /docker/c1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
  CHECK(d.v2);
  CHECK(d.dirs == std::vector<std::string>{"/sys/fs/cgroup/job", "/sys/fs/cgroup"});
  // A path outside the mount's root (cgroup namespace) reads the mount point only; ".." never climbs.
  d = cgroup_cpu_dirs("0::/other\n", "40 30 0:30 /docker/c1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
  CHECK(d.dirs == std::vector<std::string>{"/sys/fs/cgroup"});
  d = cgroup_cpu_dirs("0::/../../etc\n", "40 30 0:30 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
  CHECK(d.dirs == std::vector<std::string>{"/sys/fs/cgroup"});
  CHECK(cgroup_cpu_dirs("", "").dirs.empty());
  CHECK(cgroup_cpu_dirs("garbage", "garbage - more").dirs.empty());

  // The whole read through a directory that mimics /proc and /sys: the smallest limit along the path.
  testing::TempDir root("mn_cgroup");
  auto put = [&](const std::string& rel, const std::string& text) {
    std::filesystem::create_directories(std::filesystem::path(root / rel).parent_path());
    std::ofstream(root / rel) << text;
  };
  put("proc/self/cgroup", "0::/svc/job\n");
  put("proc/self/mountinfo", "40 30 0:30 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
  CHECK(cgroup_cpu_limit(root.path().string()) == 0);  // no cpu.max anywhere: no limit
  put("sys/fs/cgroup/svc/job/cpu.max", "max 100000\n");
  put("sys/fs/cgroup/svc/cpu.max", "250000 100000\n");
  CHECK(cgroup_cpu_limit(root.path().string()) == doctest::Approx(2.5));  // the parent's applies
  put("sys/fs/cgroup/svc/job/cpu.max", "100000 100000\n");
  CHECK(cgroup_cpu_limit(root.path().string()) == doctest::Approx(1.0));
  // v1 files.
  put("proc/self/cgroup", "3:cpu:/k\n");
  put("proc/self/mountinfo", "31 25 0:27 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n");
  put("sys/fs/cgroup/cpu/k/cpu.cfs_quota_us", "-1\n");
  put("sys/fs/cgroup/cpu/k/cpu.cfs_period_us", "100000\n");
  put("sys/fs/cgroup/cpu/cpu.cfs_quota_us", "50000\n");
  put("sys/fs/cgroup/cpu/cpu.cfs_period_us", "100000\n");
  CHECK(cgroup_cpu_limit(root.path().string()) == doctest::Approx(0.5));
  CHECK(quota_cpus(cgroup_cpu_limit(root.path().string())) == 1);
  CHECK(cgroup_cpu_limit((root.path() / "missing").string()) == 0);  // nothing readable
}

TEST_CASE("cpu_load: MN_THREAD_POLICY values") {
  CHECK(detail::parse_thread_policy(nullptr) == ThreadPolicy::Adaptive);
  CHECK(detail::parse_thread_policy("") == ThreadPolicy::Adaptive);
  CHECK(detail::parse_thread_policy("adaptive") == ThreadPolicy::Adaptive);
  CHECK(detail::parse_thread_policy("static") == ThreadPolicy::Static);
  CHECK_THROWS_AS(detail::parse_thread_policy("dynamic"), ValueError);
  CHECK_THROWS_WITH(detail::parse_thread_policy("Static"),
                    doctest::Contains("expected 'adaptive' or 'static', got 'Static'"));
}

TEST_CASE("cpu_load: threads without a count follow the taken cores; explicit counts and static do not") {
  const ThreadPolicy policy = get_thread_policy();
  const int cpus = omp_get_num_procs();
  const char* env = std::getenv("OMP_NUM_THREADS");
  const bool env_count = env != nullptr && *env != '\0';
  // Run on fresh threads: they carry no count of their own (the doctest thread may have one).
  auto in_use = [] {
    int n = 0;
    std::thread([&] { n = get_num_threads_in_use(); }).join();
    return n;
  };
  const int fresh_count = [] {  // what a thread that never set a count has
    int n = 0;
    std::thread([&] { n = get_num_threads(); }).join();
    return n;
  }();
  auto with_count = [](int count) {
    int n = 0;
    std::thread([&] {
      set_num_threads(count);
      n = get_num_threads_in_use();
    }).join();
    return n;
  };
  const Tensor a = testing::random_tensor({64, 3, 28, 28}, 11), w = testing::random_tensor({8, 3, 5, 5}, 12);
  auto result = [&] {
    std::vector<float> v;
    std::thread([&] { v = sum(nn::functional::conv2d(a, w, Tensor(), {1, 1}, {2, 2}), {0}).to_vector<float>(); }).join();
    return v;
  };

  set_thread_policy(ThreadPolicy::Adaptive);
  monitor().force_taken(1);
  const int fresh = in_use();
  if (env_count) {
    CHECK(fresh == fresh_count);  // OMP_NUM_THREADS is a count the user chose
  } else {
    CHECK(fresh == std::max(1, cpus - 1));
  }
  CHECK(with_count(cpus + 1) == cpus + 1);  // an explicit count is used whatever the load
  const std::vector<float> shrunk = result();

  set_thread_policy(ThreadPolicy::Static);
  CHECK(in_use() == (env_count ? fresh_count : cpus));
  const std::vector<float> full = result();
  CHECK(shrunk == full);  // the bits do not depend on the team

  set_thread_policy(ThreadPolicy::Adaptive);
  monitor().force_taken(0);
  CHECK(in_use() == (env_count ? fresh_count : cpus));
  // A cgroup quota of one CPU caps the default team; explicit counts keep theirs.
  monitor().force_taken(0, 1);
  CHECK(in_use() == (env_count ? fresh_count : 1));
  CHECK(with_count(cpus + 1) == cpus + 1);
  monitor().force_taken(-1);
  set_thread_policy(policy);
  // Inside a parallel region the kernels run on the calling thread.
  int inside = 0;
#pragma omp parallel num_threads(2)
  {
#pragma omp single
    inside = get_num_threads_in_use();
  }
  CHECK(inside == 1);
}
