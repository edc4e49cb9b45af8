#pragma once
// DistributedSampler: splits one epoch's sample order over the ranks, like PyTorch's. Every rank draws
// the same permutation (data::shuffled_indices(n, seed, epoch)), so the shards are disjoint and together
// cover the data set:
//   not drop_last: the order is padded by wrapping around to a multiple of num_replicas (a few samples
//                  appear twice), so every rank gets ceil(n / num_replicas) samples;
//   drop_last:     the tail is cut to a multiple of num_replicas, so every rank gets floor(n / num_replicas).
// Rank r takes positions r, r + num_replicas, r + 2 num_replicas, ... Equal shard sizes keep the
// all-reduced mean of per-rank means equal to the mean over all the samples.
// A fit resumed from a mid-epoch checkpoint (train::TrainerState::progress) continues the epoch at
// DataLoader::batch(b): every rank skips the first b x batch_size positions of its own shard, which
// together are the first b global batches, whatever the rank count of the same global batch.
//
//   auto sampler = std::make_shared<DistributedSampler>(train.size(), world_size, rank, /*shuffle=*/true,
//                                                       /*seed=*/42);
//   data::DataLoader loader(train, {.batch_size = 32, .sampler = sampler});
//   for (epoch ...) { sampler->set_epoch(epoch); trainer.fit_epoch(loader); }
#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "nn/data/dataloader.h"

namespace mn::dist {

// A data::Sampler: give it to a DataLoader (DataLoaderOptions::sampler) to iterate this rank's shard.
class DistributedSampler : public data::Sampler {
 public:
  DistributedSampler(int64_t num_samples, int64_t num_replicas, int64_t rank, bool shuffle = true,
                     uint64_t seed = 0, bool drop_last = false);

  // Selects the shuffle of the following epoch; call it before each epoch, or every epoch has one order.
  void set_epoch(uint64_t epoch) override { epoch_ = epoch; }
  uint64_t epoch() const override { return epoch_; }

  // This rank's sample indices for the current epoch, in visiting order.
  std::vector<int64_t> indices() const override;
  // The same as an i64 tensor (for index_select).
  Tensor index_tensor() const;

  int64_t size() const override { return per_replica_; }  // samples per rank and epoch
  int64_t total_size() const { return per_replica_ * num_replicas_; }
  int64_t num_samples() const override { return num_samples_; }
  int64_t num_replicas() const { return num_replicas_; }
  int64_t rank() const { return rank_; }

 private:
  int64_t num_samples_;
  int64_t num_replicas_;
  int64_t rank_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  int64_t per_replica_;
  uint64_t epoch_ = 0;
};

}  // namespace mn::dist
