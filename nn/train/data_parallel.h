#pragma once
// How a trainer sees data-parallel training. The trainer lives in nn/ and dist/ sits above it (beside
// mapping/), so the trainer names this interface and dist::DistributedDataParallel implements it:
//
//   auto ddp = mn::dist::wrap_ddp(model);          // any nn::Module
//   trainer.set_data_parallel(&ddp);               // no_sync for accumulation, metrics over all ranks
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "nn/train/history.h"

namespace mn::train {

class DataParallel {
 public:
  virtual ~DataParallel() = default;
  // false: backward passes only accumulate into .grad locally (no communication); the first backward
  // after it is set true again reduces the accumulated sum. A trainer turns it off for the micro-batches
  // of an accumulation window except the last (PyTorch's no_sync).
  virtual void set_gradient_sync(bool enabled) = 0;
  virtual bool gradient_sync() const = 0;
  // One pass's metrics combined with the other replicas': each becomes the sum over the ranks of
  // metric x samples divided by the samples of all ranks. Every rank must pass the same names.
  virtual Metrics average_metrics(const Metrics& metrics, int64_t samples) = 0;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Every rank's `values` (each rank passes as many), in rank order and bit for bit: what a mid-epoch
  // checkpoint records of each rank's metric sums (Trainer::sync_epoch_progress). A collective.
  virtual std::vector<std::vector<double>> all_gather(const std::vector<double>& values) {
    (void)values;
    throw RuntimeError("DataParallel::all_gather: this data-parallel implementation cannot gather values across "
                       "ranks, which a mid-epoch checkpoint needs");
  }
};

}  // namespace mn::train
