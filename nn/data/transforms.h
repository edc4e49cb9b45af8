#pragma once
// Data augmentation for image batches, torchvision's semantics on float tensors [N, C, H, W] (or one
// sample [C, H, W]). A DataLoader applies its transform to every batch it gathers
// (DataLoaderOptions::transform), so each sample is transformed anew in every epoch:
//
//   auto augment = std::make_shared<data::Compose>(std::vector<std::shared_ptr<data::Transform>>{
//       std::make_shared<data::RandomCrop>(28, 4), std::make_shared<data::RandomHorizontalFlip>()});
//   DataLoader loader(train, {.batch_size = 128, .shuffle = true, .seed = 42, .transform = augment});
//
// Randomness: the draws for a sample are a pure function of (loader seed, epoch, the sample's index in
// the data set, the transform's kind and its position in a Compose): one Philox block per sample and
// transform, from a stream reserved for that transform. Like the loader's shuffle (shuffled_indices),
// they consume no generator state, so a resumed run (which sets the epoch again) sees the same crops
// and flips as an uninterrupted one, and the result does not depend on the batch size, the number of
// data-parallel ranks or the thread count.
//
// Cost: one output tensor per batch, no allocation per sample. The kernels run on the CPU; a batch on
// another device makes a round trip through host memory.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace mn::data {

// What a transform's draws depend on besides its own settings.
struct TransformContext {
  uint64_t seed = 0;             // the loader's seed
  uint64_t epoch = 0;            // the loader's epoch
  std::vector<int64_t> samples;  // the data-set index of each row of the batch (dim 0), in order
  uint64_t position = 0;         // the transform's position inside a Compose (0 outside one)
};

class Transform {
 public:
  virtual ~Transform() = default;
  // x: f32 [N, C, H, W] with ctx.samples.size() == N, or [C, H, W] with one sample. Returns a new
  // tensor (x itself is never written).
  virtual Tensor apply(const Tensor& x, const TransformContext& ctx) const = 0;
  virtual std::string describe() const = 0;
  Tensor operator()(const Tensor& x, const TransformContext& ctx) const { return apply(x, ctx); }
};

// torchvision.transforms.RandomCrop(size, padding, fill=fill) with padding_mode "constant": pads every
// side of H and W by `padding` with `fill`, then cuts a size_h x size_w window at a uniformly drawn
// offset (top in 0..H + 2p - size_h, left in 0..W + 2p - size_w). A window larger than the padded
// image is a ValueError (torchvision's pad_if_needed is not offered).
class RandomCrop : public Transform {
 public:
  // size = {height, width}, or one number for a square (torchvision's int or (h, w)).
  RandomCrop(std::pair<int64_t, int64_t> size, int64_t padding = 0, double fill = 0.0);
  explicit RandomCrop(int64_t size, int64_t padding = 0, double fill = 0.0) : RandomCrop({size, size}, padding, fill) {}
  Tensor apply(const Tensor& x, const TransformContext& ctx) const override;
  std::string describe() const override;

 private:
  int64_t size_h_, size_w_, padding_;
  double fill_;
};

// torchvision.transforms.RandomHorizontalFlip(p): each sample is mirrored along W with probability p.
class RandomHorizontalFlip : public Transform {
 public:
  explicit RandomHorizontalFlip(double p = 0.5);
  Tensor apply(const Tensor& x, const TransformContext& ctx) const override;
  std::string describe() const override;

 private:
  double p_;
};

// Applies its transforms in order; transform k draws with ctx.position = k, so two transforms of the
// same kind in one Compose draw independently.
class Compose : public Transform {
 public:
  explicit Compose(std::vector<std::shared_ptr<Transform>> transforms);
  Tensor apply(const Tensor& x, const TransformContext& ctx) const override;
  std::string describe() const override;
  const std::vector<std::shared_ptr<Transform>>& transforms() const { return transforms_; }

 private:
  std::vector<std::shared_ptr<Transform>> transforms_;
};

}  // namespace mn::data
