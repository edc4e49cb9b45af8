#pragma once
// Collectives over a fixed set of ranks. Every call returns at once with a Work; the collective runs in
// the background (Gloo: one worker thread per group, so collectives run in the order they were issued,
// the same order on every rank; NCCL: the group's own CUDA stream). Tensors are contiguous and
// changed in place; they stay alive until the Work completes.
//
//   auto pg = make_process_group("gloo", store, rank, world_size);
//   pg->allreduce(grads, ReduceOp::Avg)->wait();
//
// A collective that fails (a peer exited, the timeout passed) makes wait() throw mn::RuntimeError;
// after that the group is broken and every later collective fails at once with the first error, so no
// rank waits for a partner that is gone.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "dist/env.h"
#include "dist/store.h"

namespace mn::dist {

enum class ReduceOp { Sum, Avg };
const char* reduce_op_name(ReduceOp op);

class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the collective finished (NCCL: until the calling stream is ordered after it);
  // rethrows its failure as mn::RuntimeError.
  virtual void wait() = 0;
  // True once finished, successfully or not (does not block and does not throw).
  virtual bool is_completed() = 0;
};
using WorkPtr = std::shared_ptr<Work>;

// Default collective timeout: MN_DIST_TIMEOUT_S from the environment, else 300 s.
Milliseconds default_collective_timeout();

struct ProcessGroupOptions {
  Milliseconds timeout = default_collective_timeout();  // per collective, and for the rendezvous
  // Address Gloo binds its own connections to: empty = 127.0.0.1 when MASTER_ADDR is a loopback
  // address (single machine), else this machine's hostname.
  std::string gloo_hostname;
  std::string master_addr = "127.0.0.1";
  int device_index = 0;  // NCCL: the CUDA device of this rank (usually LOCAL_RANK)
};

class ProcessGroup {
 public:
  ProcessGroup(int rank, int size) : rank_(rank), size_(size) {}
  virtual ~ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  virtual std::string backend() const = 0;

  // In place on every rank. Sum: f32 or i64; Avg: f32 only.
  virtual WorkPtr allreduce(const Tensor& tensor, ReduceOp op = ReduceOp::Sum) = 0;
  // Every rank receives root's values in `tensor`.
  virtual WorkPtr broadcast(const Tensor& tensor, int root = 0) = 0;
  // output (size() * input.numel() elements, same dtype) receives rank r's input at offset r * numel.
  virtual WorkPtr allgather(const Tensor& input, const Tensor& output) = 0;
  virtual WorkPtr barrier() = 0;

 private:
  int rank_;
  int size_;
};

// Backends this build offers: "gloo" when built with Gloo, "nccl" when built with CUDA and NCCL, "mpi" when built
// with MPI (MN_WITH_MPI; ranks started by mpirun, see dist/mpi_process_group.h).
std::vector<std::string> available_backends();
bool is_backend_available(const std::string& backend);
// Throws RuntimeError for a backend this build cannot offer ("backend 'mpi' is not available in this
// build (built without MPI: ...)") and ValueError for names that are no backend at all.
void check_backend(const std::string& backend);

// Connects `size` ranks through `store` (every rank calls it with the same backend and store). "mpi" needs no
// store (pass nullptr): MPI connects the ranks mpirun started, and rank and size must be MPI's.
std::shared_ptr<ProcessGroup> make_process_group(const std::string& backend, std::shared_ptr<Store> store, int rank,
                                                 int size, ProcessGroupOptions options = {});

// Checks shared by the backends: defined, contiguous, an f32 or i64 tensor.
void check_collective_tensor(const Tensor& tensor, const char* collective, const std::string& backend);
// The same for an allgather's input and output, and output.numel() == group_size * input.numel().
void check_allgather_tensors(const Tensor& input, const Tensor& output, int group_size, const std::string& backend);

// This process's rank, world size and local rank as its launcher gave them: for "mpi" from_mpi_env() (no
// MASTER_ADDR / MASTER_PORT; when the variables do not give rank and size, MPI is initialised and asked),
// for the other backends from_env(). Errors as theirs; a build without MPI refuses "mpi" (check_backend).
EnvConfig launch_env(const std::string& backend);

}  // namespace mn::dist
