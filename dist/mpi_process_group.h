#pragma once
// The MPI process group (built only with MN_WITH_MPI, i.e. when CMake found MPI, e.g. Debian's Open MPI):
// collectives of the MPI library on a duplicate of MPI_COMM_WORLD, for programs started by mpirun.
//
//   mpirun -np 2 mn-train --backend mpi ...      (rank and size come from MPI; no MASTER_ADDR, no store)
//
// Each collective is issued at once as a nonblocking MPI call (MPI_Iallreduce, MPI_Ibcast, MPI_Iallgather,
// MPI_Ibarrier) in the calling thread, so every rank issues them in its program order, as MPI requires;
// the Work's wait() drives MPI's progress (MPI_Testall) until it completes. Open MPI moves a nonblocking
// collective only inside MPI calls, so one issued early progresses while later ones are issued or waited.
// wait() gives up after the group's timeout (ProcessGroupOptions::timeout) of waiting: the collective is
// then failed, the group broken (every later collective fails at once with the first error) and, since a
// started collective cannot be cancelled, its tensors are kept alive for good.
//
// MPI is initialised on first use (MPI_Init_thread asking for MPI_THREAD_SERIALIZED: this group makes its
// MPI calls under one process-wide mutex, from whichever thread issues or waits) and finalised at exit
// when we initialised it and every group was destroyed cleanly. A group still alive at exit, or one that
// failed, means a rank is leaving in the middle of the job: MPI_Finalize would wait for peers that may
// never come, so it is skipped and mpirun stops the other ranks. A program that initialised MPI itself
// must have asked for MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE, and finalises it itself.
// Errors are returned, not fatal (MPI_ERRORS_RETURN on the group's communicator): a failing MPI call
// raises mn::RuntimeError with MPI_Error_string's text.
#ifdef MN_WITH_MPI

#include <memory>

#include "dist/process_group.h"

namespace mn::dist {

// This process's place in MPI_COMM_WORLD; initialises MPI first when nobody has.
struct MpiWorld {
  int rank = 0;
  int size = 1;
};
MpiWorld mpi_world();

class MpiProcessGroup final : public ProcessGroup {
 public:
  // rank and size must be this process's in MPI_COMM_WORLD (ValueError naming both otherwise).
  MpiProcessGroup(int rank, int size, ProcessGroupOptions options = {});
  ~MpiProcessGroup() override;

  std::string backend() const override { return "mpi"; }
  WorkPtr allreduce(const Tensor& tensor, ReduceOp op = ReduceOp::Sum) override;
  WorkPtr broadcast(const Tensor& tensor, int root = 0) override;
  WorkPtr allgather(const Tensor& input, const Tensor& output) override;
  WorkPtr barrier() override;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;  // shared with the group's Works
};

}  // namespace mn::dist

#endif  // MN_WITH_MPI
