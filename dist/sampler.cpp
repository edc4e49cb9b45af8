#include "dist/sampler.h"

#include <numeric>

#include "core/error.h"
#include "kernels/factories.h"
#include "nn/data/dataloader.h"

namespace mn::dist {

DistributedSampler::DistributedSampler(int64_t num_samples, int64_t num_replicas, int64_t rank, bool shuffle,
                                       uint64_t seed, bool drop_last)
    : num_samples_(num_samples),
      num_replicas_(num_replicas),
      rank_(rank),
      shuffle_(shuffle),
      seed_(seed),
      drop_last_(drop_last) {
  MN_CHECK(num_samples >= 0, ValueError, "DistributedSampler: num_samples must be non-negative, got ", num_samples);
  MN_CHECK(num_replicas >= 1, ValueError, "DistributedSampler: num_replicas must be at least 1, got ",
           num_replicas);
  MN_CHECK(rank >= 0 && rank < num_replicas, ValueError, "DistributedSampler: invalid rank ", rank,
           ", rank should be in the interval [0, ", num_replicas - 1, "]");
  per_replica_ = drop_last ? num_samples / num_replicas : (num_samples + num_replicas - 1) / num_replicas;
}

std::vector<int64_t> DistributedSampler::indices() const {
  std::vector<int64_t> order;
  if (shuffle_) {
    order = data::shuffled_indices(num_samples_, seed_, epoch_);
  } else {
    order.resize(static_cast<size_t>(num_samples_));
    std::iota(order.begin(), order.end(), int64_t{0});
  }
  const auto total = static_cast<size_t>(total_size());
  if (order.size() < total) {
    // Wrap around (repeatedly, should the padding exceed the data set) to reach a multiple of the ranks.
    const size_t original = order.size();
    for (size_t i = 0; order.size() < total; ++i) order.push_back(order[i % original]);
  } else {
    order.resize(total);
  }
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(per_replica_));
  for (size_t i = static_cast<size_t>(rank_); i < total; i += static_cast<size_t>(num_replicas_))
    mine.push_back(order[i]);
  return mine;
}

Tensor DistributedSampler::index_tensor() const {
  std::vector<int64_t> mine = indices();
  return from_vector(mine, Shape{static_cast<int64_t>(mine.size())});
}

}  // namespace mn::dist
