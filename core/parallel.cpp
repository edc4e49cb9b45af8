#include "core/parallel.h"

#include <omp.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include "core/cpu_load.h"
#include "core/error.h"

namespace mn {

namespace {

// 0: not read yet, else 1 + ThreadPolicy.
std::atomic<int> g_policy{0};
thread_local bool t_explicit = false;  // set_num_threads was called on this thread

// OpenMP's process default (what a thread that never set a count has), and whether the user chose it.
struct Defaults {
  int threads;
  bool from_env;
};
const Defaults& defaults() {
  static const Defaults d = [] {
    const char* env = std::getenv("OMP_NUM_THREADS");
    return Defaults{omp_get_num_procs(), env != nullptr && *env != '\0'};
  }();
  return d;
}

}  // namespace

ThreadPolicy detail::parse_thread_policy(const char* value) {
  const std::string v = value ? value : "";
  MN_CHECK(v.empty() || v == "adaptive" || v == "static", ValueError,
           "MN_THREAD_POLICY: expected 'adaptive' or 'static', got '", v, "'");
  return v == "static" ? ThreadPolicy::Static : ThreadPolicy::Adaptive;
}

int get_num_threads() { return omp_get_max_threads(); }

void set_num_threads(int n) {
  MN_CHECK(n >= 1, ValueError, "set_num_threads: expected a thread count >= 1, got ", n);
  omp_set_num_threads(n);
  t_explicit = true;
}

void set_thread_policy(ThreadPolicy policy) { g_policy.store(1 + static_cast<int>(policy)); }

ThreadPolicy get_thread_policy() {
  int p = g_policy.load(std::memory_order_relaxed);
  if (p == 0) {
    const int read = 1 + static_cast<int>(detail::parse_thread_policy(std::getenv("MN_THREAD_POLICY")));
    g_policy.compare_exchange_strong(p, read);  // a concurrent set_thread_policy wins
    p = g_policy.load(std::memory_order_relaxed);
  }
  return static_cast<ThreadPolicy>(p - 1);
}

int get_num_threads_in_use() {
  if (omp_in_parallel()) return 1;
  const int max = omp_get_max_threads();
  if (max <= 1 || t_explicit) return max;
  const Defaults& d = defaults();
  if (d.from_env || max != d.threads || get_thread_policy() == ThreadPolicy::Static) return max;
  cpu_load::LoadMonitor& m = cpu_load::monitor();
  m.poll();
  return cpu_load::team_size(max, m.cpus(), m.taken(), m.quota());
}

}  // namespace mn
