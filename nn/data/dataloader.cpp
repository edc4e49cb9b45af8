#include "nn/data/dataloader.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "core/random.h"
#include "kernels/factories.h"
#include "nn/data/fashion_mnist.h"
#include "nn/data/transforms.h"

namespace mn::data {

std::vector<int64_t> philox_permutation(int64_t n, uint64_t seed, uint64_t stream) {
  MN_CHECK(n >= 0, ValueError, "philox_permutation: n must be >= 0, got ", n);
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  // Draw k takes two lanes of counter block k / 2 as one 64-bit word. The index below it is
  // floor(word * (i + 1) / 2^64), whose bias is at most (i + 1) / 2^64 per draw: invisible for any data
  // set that fits in memory, and without rejection loops the number of draws is fixed.
  Philox4 block{};
  for (int64_t i = n - 1, k = 0; i > 0; --i, ++k) {
    if (k % 2 == 0) block = philox_block(seed, stream, static_cast<uint64_t>(k / 2));
    const int lane = static_cast<int>(k % 2) * 2;
    const uint64_t word = (uint64_t{block.x[lane]} << 32) | block.x[lane + 1];
    const auto j = static_cast<int64_t>((static_cast<unsigned __int128>(word) * static_cast<uint64_t>(i + 1)) >> 64);
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  return order;
}

std::vector<int64_t> shuffled_indices(int64_t n, uint64_t seed, uint64_t epoch) {
  MN_CHECK(n >= 0, ValueError, "shuffled_indices: n must be >= 0, got ", n);
  // One stream per epoch, offset from a name's hash so that (seed, epoch) never reuses the words that
  // Generator(seed, stream) hands to initialisers or dropout for small stream numbers.
  static const uint64_t kShuffleStream = stream_key("mn::data::shuffled_indices");
  return philox_permutation(n, seed, kShuffleStream + epoch);
}

DataLoader::DataLoader(Tensor inputs, Tensor targets, DataLoaderOptions options)
    : inputs_(std::move(inputs)), targets_(std::move(targets)), options_(options) {
  MN_CHECK(options_.batch_size > 0, ValueError, "DataLoader: batch_size must be > 0, got ", options_.batch_size);
  MN_CHECK(inputs_.defined() && targets_.defined(), ValueError,
           "DataLoader: inputs and targets must be defined tensors");
  MN_CHECK(inputs_.dim() >= 1 && targets_.dim() >= 1, ValueError,
           "DataLoader: inputs and targets need a sample dim 0, got shapes ", inputs_.sizes(), " and ",
           targets_.sizes());
  MN_CHECK(inputs_.size(0) == targets_.size(0), ValueError, "DataLoader: inputs hold ", inputs_.size(0),
           " samples (shape ", inputs_.sizes(), ") but targets hold ", targets_.size(0), " (shape ",
           targets_.sizes(), ")");
  num_samples_ = inputs_.size(0);
  if (const Sampler* sampler = options_.sampler.get()) {
    MN_CHECK(!options_.shuffle, ValueError,
             "DataLoader: shuffle must be false when a sampler is given (the sampler decides the order)");
    MN_CHECK(sampler->num_samples() == num_samples_, ValueError, "DataLoader: the sampler indexes ",
             sampler->num_samples(), " samples but the data set holds ", num_samples_);
  }
  refresh_order();
}

DataLoader::DataLoader(const Dataset& dataset, DataLoaderOptions options)
    : DataLoader(dataset.images, dataset.labels, options) {}

void DataLoader::set_epoch(uint64_t epoch) {
  if (options_.sampler)
    options_.sampler->set_epoch(epoch);
  else
    epoch_ = epoch;
}

uint64_t DataLoader::epoch() const { return options_.sampler ? options_.sampler->epoch() : epoch_; }

void DataLoader::refresh_order() const {
  const uint64_t epoch = this->epoch();
  // Only a shuffled or sampled order depends on the epoch.
  if (built_ && (epoch == built_epoch_ || (!options_.shuffle && !options_.sampler))) return;
  std::vector<int64_t> order;
  if (const Sampler* sampler = options_.sampler.get()) {
    order = sampler->indices();
    MN_CHECK(static_cast<int64_t>(order.size()) == sampler->size(), ValueError, "DataLoader: the sampler gave ",
             order.size(), " indices for an epoch of size() ", sampler->size());
    for (const int64_t i : order)
      MN_CHECK(i >= 0 && i < num_samples_, IndexError, "DataLoader: the sampler gave index ", i,
               ", outside the data set's ", num_samples_, " samples");
  } else if (options_.shuffle) {
    order = shuffled_indices(num_samples_, options_.seed, epoch);
  } else {
    order.resize(static_cast<size_t>(num_samples_));
    std::iota(order.begin(), order.end(), int64_t{0});
  }
  order_ = from_vector(order, {static_cast<int64_t>(order.size())});
  // index_select wants its index beside the data; move it once per epoch, not once per batch.
  order_inputs_ = inputs_.device() == order_.device() ? order_ : order_.to(inputs_.device());
  order_targets_ = targets_.device() == order_.device() ? order_ : order_.to(targets_.device());
  built_epoch_ = epoch;
  built_ = true;
}

const Tensor& DataLoader::order() const {
  refresh_order();
  return order_;
}

int64_t DataLoader::size() const {
  const int64_t visited = options_.sampler ? options_.sampler->size() : num_samples_;
  const int64_t batch_size = options_.batch_size;
  // Rounded up without forming visited + batch_size - 1, which overflows for a huge batch_size.
  return visited / batch_size + (!options_.drop_last && visited % batch_size != 0 ? 1 : 0);
}

Batch DataLoader::batch(int64_t i) const {
  MN_CHECK(i >= 0 && i < size(), IndexError, "DataLoader::batch: index ", i, " out of range for ", size(),
           " batches");
  refresh_order();
  const int64_t start = i * options_.batch_size;
  const int64_t length = std::min(options_.batch_size, order_.size(0) - start);
  Batch b;
  b.inputs = inputs_.index_select(0, order_inputs_.narrow(0, start, length));
  b.targets = targets_.index_select(0, order_targets_.narrow(0, start, length));
  b.index = i;
  if (options_.transform) {
    TransformContext ctx;
    ctx.seed = options_.seed;
    ctx.epoch = epoch();
    const int64_t* ids = order_.data<int64_t>() + start;
    ctx.samples.assign(ids, ids + length);
    b.inputs = options_.transform->apply(b.inputs, ctx);
  }
  return b;
}

DataLoader::iterator::iterator(const DataLoader* loader, int64_t position) : loader_(loader), position_(position) {
  if (position_ < loader_->size()) batch_ = loader_->batch(position_);
}

DataLoader::iterator& DataLoader::iterator::operator++() {
  ++position_;
  batch_ = position_ < loader_->size() ? loader_->batch(position_) : Batch{};
  return *this;
}

}  // namespace mn::data
