// nn/data augmentation (RandomCrop, RandomHorizontalFlip, Compose, the DataLoader's transform hook) and
// the stratified validation split: torchvision's semantics checked element by element against a direct
// re-computation from the drawn offsets, determinism per (seed, epoch, sample), and the errors.
#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "nn/data/dataloader.h"
#include "nn/data/split.h"
#include "nn/data/transforms.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::data;

namespace {

// Images whose every value is distinct and says where it came from: v = 1 + n*1000 + c*100 + y*10 + x.
Tensor labelled_images(int64_t n, int64_t c, int64_t h, int64_t w) {
  std::vector<float> v;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t ch = 0; ch < c; ++ch)
      for (int64_t y = 0; y < h; ++y)
        for (int64_t x = 0; x < w; ++x) v.push_back(static_cast<float>(1 + i * 1000 + ch * 100 + y * 10 + x));
  return from_vector(v, Shape{n, c, h, w});
}

TransformContext context(std::vector<int64_t> samples, uint64_t seed = 7, uint64_t epoch = 0) {
  TransformContext ctx;
  ctx.seed = seed;
  ctx.epoch = epoch;
  ctx.samples = std::move(samples);
  return ctx;
}

float at(const std::vector<float>& v, const Shape& s, int64_t n, int64_t c, int64_t y, int64_t x) {
  return v[static_cast<size_t>(((n * s[1] + c) * s[2] + y) * s[3] + x)];
}

}  // namespace

TEST_CASE("transforms: RandomCrop is a padded window at one offset per sample, the same for every channel") {
  const int64_t N = 6, C = 2, H = 5, W = 7, pad = 2;
  const Tensor x = labelled_images(N, C, H, W);
  const RandomCrop crop({4, 5}, pad, -9.0);
  const Tensor y = crop(x, context({0, 1, 2, 3, 4, 5}));
  REQUIRE(y.sizes() == Shape{N, C, 4, 5});
  const std::vector<float> out = y.to_vector<float>();
  const Shape s = y.sizes();
  std::set<std::pair<int64_t, int64_t>> origins;
  for (int64_t n = 0; n < N; ++n) {
    // Find the offset consistent with the output: try every admissible origin and keep the one that
    // reproduces all of sample n (fill outside the image, the shifted image inside).
    int matches = 0;
    for (int64_t top = 0; top <= H + 2 * pad - 4; ++top)
      for (int64_t left = 0; left <= W + 2 * pad - 5; ++left) {
        bool ok = true;
        for (int64_t c = 0; c < C && ok; ++c)
          for (int64_t r = 0; r < 4 && ok; ++r)
            for (int64_t q = 0; q < 5 && ok; ++q) {
              const int64_t sy = top + r - pad, sx = left + q - pad;
              const float expect = (sy < 0 || sy >= H || sx < 0 || sx >= W)
                                       ? -9.0f
                                       : static_cast<float>(1 + n * 1000 + c * 100 + sy * 10 + sx);
              ok = at(out, s, n, c, r, q) == expect;
            }
        if (ok) {
          ++matches;
          origins.insert({top, left});
        }
      }
    CHECK(matches == 1);
  }
  CHECK(origins.size() > 1);  // the offsets differ between samples
  // Without padding and with the full size, the crop is the identity.
  const RandomCrop full(std::pair<int64_t, int64_t>{H, W});
  CHECK(full(x, context({0, 1, 2, 3, 4, 5})).to_vector<float>() == x.to_vector<float>());
  // x itself is untouched.
  CHECK(x.to_vector<float>() == labelled_images(N, C, H, W).to_vector<float>());
}

TEST_CASE("transforms: RandomHorizontalFlip mirrors W of about p of the samples, p = 0 and 1 exactly") {
  const int64_t N = 400;
  const Tensor x = labelled_images(N, 1, 2, 3);
  std::vector<int64_t> ids(N);
  for (int64_t i = 0; i < N; ++i) ids[static_cast<size_t>(i)] = i;
  const std::vector<float> in = x.to_vector<float>();
  const auto flipped_count = [&](double p) {
    const std::vector<float> out = RandomHorizontalFlip(p)(x, context(ids)).to_vector<float>();
    int64_t flipped = 0;
    for (int64_t n = 0; n < N; ++n) {
      bool same = true, mirrored = true;
      for (int64_t y = 0; y < 2; ++y)
        for (int64_t q = 0; q < 3; ++q) {
          same = same && at(out, x.sizes(), n, 0, y, q) == at(in, x.sizes(), n, 0, y, q);
          mirrored = mirrored && at(out, x.sizes(), n, 0, y, q) == at(in, x.sizes(), n, 0, y, 2 - q);
        }
      CHECK((same || mirrored));
      flipped += mirrored ? 1 : 0;
    }
    return flipped;
  };
  CHECK(flipped_count(0.0) == 0);
  CHECK(flipped_count(1.0) == N);
  const int64_t half = flipped_count(0.5);
  CHECK(half > 150);  // binomial(400, 0.5): 200 +- 10, so this cannot fail by chance
  CHECK(half < 250);
}

TEST_CASE("transforms: draws depend only on (seed, epoch, sample index), not on the batch they come in") {
  const Tensor x = labelled_images(8, 1, 6, 6);
  const Compose augment({std::make_shared<RandomCrop>(6, 2), std::make_shared<RandomHorizontalFlip>()});
  const std::vector<int64_t> ids{10, 11, 12, 13, 14, 15, 16, 17};
  const Tensor whole = augment(x, context(ids));
  // The same samples in two batches, and one sample alone ([C, H, W]), give the same images.
  const Tensor first = augment(x.narrow(0, 0, 3), context({10, 11, 12}));
  const Tensor rest = augment(x.narrow(0, 3, 5), context({13, 14, 15, 16, 17}));
  CHECK(cat({first, rest}, 0).to_vector<float>() == whole.to_vector<float>());
  CHECK(augment(x.select(0, 4), context({14})).to_vector<float>() == whole.select(0, 4).to_vector<float>());
  // Another epoch, another seed or another sample index draws differently.
  CHECK(augment(x, context(ids, 7, 1)).to_vector<float>() != whole.to_vector<float>());
  CHECK(augment(x, context(ids, 8, 0)).to_vector<float>() != whole.to_vector<float>());
  CHECK(augment(x, context({0, 1, 2, 3, 4, 5, 6, 7})).to_vector<float>() != whole.to_vector<float>());
  // Two flips in one Compose draw independently (positions 0 and 1), so they do not always cancel.
  const Tensor big = labelled_images(64, 1, 2, 3);
  std::vector<int64_t> ids64(64);
  for (int64_t i = 0; i < 64; ++i) ids64[static_cast<size_t>(i)] = i;
  const Compose twice({std::make_shared<RandomHorizontalFlip>(), std::make_shared<RandomHorizontalFlip>()});
  CHECK(twice(big, context(ids64)).to_vector<float>() != big.to_vector<float>());
  CHECK(augment.describe() == "Compose(RandomCrop(6x6, padding=2, fill=0), RandomHorizontalFlip(p=0.5))");
}

TEST_CASE("transforms: bad input names what was expected") {
  const Tensor x = labelled_images(2, 1, 4, 4);
  CHECK_THROWS_WITH_AS(RandomCrop(7, 1)(x, context({0, 1})),
                       doctest::Contains("does not fit the padded image of 6 x 6"), ValueError);
  CHECK_THROWS_WITH_AS(RandomCrop(0), doctest::Contains("positive"), ValueError);
  CHECK_THROWS_WITH_AS(RandomCrop(3, -1), doctest::Contains("padding"), ValueError);
  CHECK_THROWS_WITH_AS(RandomHorizontalFlip(1.5), doctest::Contains("[0, 1]"), ValueError);
  CHECK_THROWS_WITH_AS(RandomHorizontalFlip()(x, context({0})), doctest::Contains("names 1 samples for a batch of 2"),
                       ValueError);
  CHECK_THROWS_WITH_AS(RandomHorizontalFlip()(zeros({4, 4}), context({0})), doctest::Contains("[N, C, H, W]"),
                       ValueError);
  CHECK_THROWS_WITH_AS(RandomHorizontalFlip()(zeros({1, 1, 2, 2}, TensorOptions(kInt64)), context({0})),
                       doctest::Contains("float32"), TypeError);
  CHECK_THROWS_WITH_AS(Compose({nullptr}), doctest::Contains("transform 0 is null"), ValueError);
}

TEST_CASE("transforms: the DataLoader applies its transform per sample and epoch, reproducibly") {
  const Tensor x = labelled_images(10, 1, 4, 4);
  const Tensor labels = arange(10);
  auto flip = std::make_shared<RandomHorizontalFlip>();
  DataLoader plain(x, labels, {.batch_size = 4, .shuffle = true, .seed = 3});
  DataLoader augmented(x, labels, {.batch_size = 4, .shuffle = true, .seed = 3, .transform = flip});
  DataLoader other_batches(x, labels, {.batch_size = 3, .shuffle = true, .seed = 3, .transform = flip});
  const auto epoch_images = [](DataLoader& loader, uint64_t epoch) {
    loader.set_epoch(epoch);
    std::map<int64_t, std::vector<float>> by_label;  // image of each sample, keyed by its label
    for (const Batch& b : loader)
      for (int64_t i = 0; i < b.inputs.size(0); ++i)
        by_label[b.targets.select(0, i).to_vector<int64_t>()[0]] = b.inputs.select(0, i).to_vector<float>();
    return by_label;
  };
  const auto e0 = epoch_images(augmented, 0);
  CHECK(e0 == epoch_images(augmented, 0));      // the same epoch again (a resume)
  CHECK(e0 == epoch_images(other_batches, 0));  // another batch size
  CHECK(e0 != epoch_images(augmented, 1));      // a new draw per epoch
  CHECK(e0 != epoch_images(plain, 0));          // the transform ran
  // The targets and the order are the plain loader's.
  plain.set_epoch(2);
  augmented.set_epoch(2);
  CHECK(plain.order().to_vector<int64_t>() == augmented.order().to_vector<int64_t>());
}

TEST_CASE("split: stratified_split keeps every class's share, is fixed by the seed and disjoint") {
  std::vector<int64_t> y;
  for (int64_t i = 0; i < 300; ++i) y.push_back(i % 3 == 0 ? 2 : (i % 7 == 0 ? 0 : 1));
  const Tensor labels = from_vector(y, Shape{300});
  const SplitIndices a = stratified_split(labels, 0.2, 11);
  const SplitIndices b = stratified_split(labels, 0.2, 11);
  const SplitIndices c = stratified_split(labels, 0.2, 12);
  CHECK(a.val.to_vector<int64_t>() == b.val.to_vector<int64_t>());
  CHECK(a.val.to_vector<int64_t>() != c.val.to_vector<int64_t>());
  const std::vector<int64_t> tr = a.train.to_vector<int64_t>(), va = a.val.to_vector<int64_t>();
  CHECK(tr.size() + va.size() == 300);
  std::set<int64_t> all(tr.begin(), tr.end());
  all.insert(va.begin(), va.end());
  CHECK(all.size() == 300);
  CHECK(std::is_sorted(tr.begin(), tr.end()));
  CHECK(std::is_sorted(va.begin(), va.end()));
  std::map<int64_t, int64_t> total, held;
  for (int64_t v : y) ++total[v];
  for (int64_t i : va) ++held[y[static_cast<size_t>(i)]];
  for (const auto& [cls, n] : total) {
    INFO("class " << cls);
    CHECK(held[cls] == static_cast<int64_t>(std::llround(0.2 * static_cast<double>(n))));
  }
  CHECK_THROWS_WITH_AS(stratified_split(labels, 0.0, 1), doctest::Contains("(0, 1)"), ValueError);
  CHECK_THROWS_WITH_AS(stratified_split(labels, 1.0, 1), doctest::Contains("(0, 1)"), ValueError);
  CHECK_THROWS_WITH_AS(stratified_split(from_vector(std::vector<int64_t>{0, 1}, Shape{2}), 0.2, 1),
                       doctest::Contains("validation part empty"), ValueError);
  CHECK_THROWS_WITH_AS(stratified_split(zeros({4}), 0.5, 1), doctest::Contains("int64 labels"), ValueError);
}
