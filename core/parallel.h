#pragma once
// How many threads the CPU kernels use (they run on OpenMP): the counterpart of PyTorch's
// torch.get_num_threads / torch.set_num_threads, for programs that should not include <omp.h>.
//
// The setting is OpenMP's per-thread one (its nthreads ICV), as in PyTorch's OpenMP build: it applies
// to ops run from the thread that set it, and other threads keep their own (OMP_NUM_THREADS or the
// number of CPUs the process may use). On a machine whose cores are not all free, fewer threads than
// cores can be several times faster (README, "Shared machines").
namespace mn {

// The number of threads an op run from the calling thread may use.
int get_num_threads();

// Sets it for the calling thread, from the next op on. n must be >= 1 (ValueError otherwise).
void set_num_threads(int n);

}  // namespace mn
