#pragma once
// The CUDA process group (built only with MN_WITH_CUDA): NCCL collectives on the group's own stream.
// Rank 0 draws the NCCL unique id and publishes it through the store; the others read it and every
// rank joins the communicator. Each collective first waits (on the GPU) for the work already queued on
// the default stream, and its tensors are recorded on the NCCL stream so the caching allocator does
// not hand their memory out again before the collective has finished.
//
// NCCL refuses two ranks on one GPU, so a multi-rank group needs one GPU per rank
// (options.device_index, usually LOCAL_RANK).
#ifdef MN_WITH_CUDA

#include <memory>

#include "dist/process_group.h"

namespace mn::dist {

class NcclProcessGroup final : public ProcessGroup {
 public:
  NcclProcessGroup(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options = {});
  ~NcclProcessGroup() override;

  std::string backend() const override { return "nccl"; }
  WorkPtr allreduce(const Tensor& tensor, ReduceOp op = ReduceOp::Sum) override;
  WorkPtr broadcast(const Tensor& tensor, int root = 0) override;
  WorkPtr allgather(const Tensor& input, const Tensor& output) override;
  // Blocks the host until every rank arrived (a one-element all-reduce, waited on).
  WorkPtr barrier() override;

  int device_index() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mn::dist

#endif  // MN_WITH_CUDA
