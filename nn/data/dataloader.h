#pragma once
// Mini-batches over in-memory tensors. Each batch gathers its samples along dim 0 with index_select,
// so it owns contiguous memory (changing it never touches the data set).
//
//   DataLoader loader(train, {.batch_size = 128, .shuffle = true, .seed = 42});
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     loader.set_epoch(epoch);
//     for (const Batch& b : loader) step(b.inputs, b.targets);
//   }
//
// With shuffle on, the order of an epoch is shuffled_indices(n, seed, epoch): a pure function of those
// three numbers, the same in every run, on every machine and for every thread count. Iterating does not
// advance the epoch; call set_epoch before each one (as with PyTorch's DistributedSampler), or every
// epoch sees the same order.
//
// A Sampler gives the order instead (PyTorch's `DataLoader(dataset, sampler=...)`), e.g. this rank's
// shard of a data-parallel run:
//
//   auto sampler = std::make_shared<dist::DistributedSampler>(train.size(), world_size, rank, true, 42);
//   DataLoader loader(train, {.batch_size = 32, .sampler = sampler});
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     sampler->set_epoch(epoch);  // or loader.set_epoch(epoch), which forwards it
//     trainer.fit_epoch(loader);
//   }
//
// The loader reads the sampler's indices when an iteration starts (begin(), batch(), order()),
// so an epoch set on the sampler takes effect there; copies of a loader share its sampler.
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <vector>

#include "core/tensor.h"

namespace mn::data {

struct Dataset;
class Transform;

struct Batch {
  Tensor inputs;      // inputs[order[start:start + len]]
  Tensor targets;     // targets[order[start:start + len]]
  int64_t index = 0;  // position of this batch within its epoch
};

// Which samples an epoch visits, in which order. indices() depends only on the epoch (and the
// sampler's own settings), so every call for one epoch gives the same list.
class Sampler {
 public:
  virtual ~Sampler() = default;
  virtual int64_t num_samples() const = 0;  // the size of the data set it indexes
  virtual int64_t size() const = 0;         // indices per epoch
  virtual void set_epoch(uint64_t epoch) = 0;
  virtual uint64_t epoch() const = 0;
  virtual std::vector<int64_t> indices() const = 0;  // size() values in [0, num_samples())
};

struct DataLoaderOptions {
  int64_t batch_size = 1;  // > 0
  bool shuffle = false;    // must stay false with a sampler (it decides the order)
  uint64_t seed = 0;
  bool drop_last = false;  // drop a final batch smaller than batch_size
  std::shared_ptr<Sampler> sampler;  // when set, the order of each epoch (num_samples() = the data set's)
  // Applied to every batch's inputs after gathering (nn/data/transforms.h: RandomCrop,
  // RandomHorizontalFlip, Compose, or any Transform subclass), with this loader's seed, its epoch and
  // the batch's data-set indices, so augmentation is a pure function of (seed, epoch, sample).
  std::shared_ptr<const Transform> transform;
};

// A permutation of 0..n-1 that depends only on (n, seed, epoch): a Fisher-Yates shuffle driven by
// Philox words of a stream reserved for data shuffling, so it shares no random numbers with weight
// initialisation from the same seed. Shared with the distributed sampler, which splits it over ranks.
std::vector<int64_t> shuffled_indices(int64_t n, uint64_t seed, uint64_t epoch);
// The Fisher-Yates permutation of 0..n-1 behind shuffled_indices, drawn from Philox stream `stream` of
// `seed` (other deterministic orders, e.g. stratified_split, use their own streams).
std::vector<int64_t> philox_permutation(int64_t n, uint64_t seed, uint64_t stream);

class DataLoader {
 public:
  // inputs and targets must have at least one dim and the same size in dim 0 (the sample count).
  DataLoader(Tensor inputs, Tensor targets, DataLoaderOptions options = {});
  // Images as inputs, labels as targets.
  explicit DataLoader(const Dataset& dataset, DataLoaderOptions options = {});

  // Selects the order of the following iterations (with shuffle on, or through the sampler's set_epoch).
  void set_epoch(uint64_t epoch);
  uint64_t epoch() const;

  // Batches per epoch: ceil(m / batch_size), or floor with drop_last, where m is the samples an epoch
  // visits (the data set's, or the sampler's size()).
  int64_t size() const;
  // Samples in the data set (not the ones an epoch visits with a sampler: see order()).
  int64_t num_samples() const { return num_samples_; }
  const DataLoaderOptions& options() const { return options_; }
  // The sample indices of the current epoch, in visiting order (i64 [m], CPU).
  const Tensor& order() const;

  // Batch i (0 <= i < size()) of the current epoch.
  Batch batch(int64_t i) const;

  // Input iterator over the batches of the current epoch; each increment gathers the next batch.
  // Calling set_epoch during an iteration changes the order under it, so don't.
  class iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    using pointer = const Batch*;
    using reference = const Batch&;

    iterator() = default;
    const Batch& operator*() const { return batch_; }
    const Batch* operator->() const { return &batch_; }
    iterator& operator++();
    void operator++(int) { ++*this; }
    bool operator==(const iterator& other) const { return position_ == other.position_; }

   private:
    friend class DataLoader;
    iterator(const DataLoader* loader, int64_t position);
    const DataLoader* loader_ = nullptr;
    int64_t position_ = 0;
    Batch batch_;
  };
  iterator begin() const { return iterator(this, 0); }
  iterator end() const { return iterator(this, size()); }

 private:
  // Rebuilds the order when it is not the current epoch's (the sampler's epoch may have been set
  // directly). Const: the order is a cache of (options, epoch).
  void refresh_order() const;

  Tensor inputs_;
  Tensor targets_;
  DataLoaderOptions options_;
  int64_t num_samples_ = 0;
  uint64_t epoch_ = 0;               // without a sampler; with one, the sampler keeps the epoch
  mutable bool built_ = false;
  mutable uint64_t built_epoch_ = 0;  // the epoch order_ was built for
  mutable Tensor order_;              // CPU
  mutable Tensor order_inputs_;       // order_ on the inputs' device
  mutable Tensor order_targets_;      // order_ on the targets' device
};

}  // namespace mn::data
