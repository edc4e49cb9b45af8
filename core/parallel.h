#pragma once
// How many threads the CPU kernels use (they run on OpenMP): the counterpart of PyTorch's
// torch.get_num_threads / torch.set_num_threads, for programs that should not include <omp.h>.
//
// The setting is OpenMP's per-thread one (its nthreads ICV), as in PyTorch's OpenMP build: it applies
// to ops run from the thread that set it, and other threads keep their own (OMP_NUM_THREADS or the
// number of CPUs the process may use).
//
// Under the default policy (ThreadPolicy::Adaptive) a thread that has no thread count of its own runs
// each parallel region on the cores other processes leave free: about every 200 ms the kernels compare
// the busy time of the CPUs this process may use (/proc/stat) with the process's own CPU time, and a
// core that others keep busy is left out of the team until they leave it, and the team never exceeds
// the whole CPUs of the process's cgroup CPU limit (a container's --cpus; core/cpu_load.h). A count set
// explicitly (set_num_threads, omp_set_num_threads with a value other than the default,
// OMP_NUM_THREADS in the environment) is used as it is. Results do not depend on the team size.
namespace mn {

// The number of threads an op run from the calling thread may use (the setting: an explicit count, else
// every CPU the process may use).
int get_num_threads();

// Sets it for the calling thread, from the next op on; the count is then used whatever the load.
// n must be >= 1 (ValueError otherwise).
void set_num_threads(int n);

// How the team of a thread without an explicit count is chosen, process-wide:
//   Adaptive  the CPUs other processes leave free, within the cgroup CPU limit, at most get_num_threads()
//             (the default)
//   Static    get_num_threads(), whatever else runs (the behaviour before the adaptive policy)
// The environment variable MN_THREAD_POLICY=adaptive|static sets the initial value (ValueError on the
// first parallel op for any other value).
enum class ThreadPolicy { Adaptive, Static };
void set_thread_policy(ThreadPolicy policy);
ThreadPolicy get_thread_policy();

// The team a parallel op started now from the calling thread would get (1 inside a parallel region).
int get_num_threads_in_use();

namespace detail {
// MN_THREAD_POLICY's value (null or empty: Adaptive); ValueError for anything but adaptive / static.
ThreadPolicy parse_thread_policy(const char* value);
}  // namespace detail

}  // namespace mn
