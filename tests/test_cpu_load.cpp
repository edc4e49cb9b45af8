// The adaptive default team size (core/parallel.h, core/cpu_load.h): /proc/stat parsing, the load
// others put on our CPUs, the taken-core decision with its hysteresis, and how the team follows it
// for threads without an explicit count while results stay the same bits. No timing is involved: the
// decisions are fed given samples, and the monitor is forced where the whole path is checked.
#include <omp.h>

#include <cstdlib>
#include <thread>

#include "core/cpu_load.h"
#include "core/parallel.h"
#include "nn/functional.h"
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
