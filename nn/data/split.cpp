#include "nn/data/split.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "core/random.h"
#include "kernels/factories.h"
#include "nn/data/dataloader.h"

namespace mn::data {

SplitIndices stratified_split(const Tensor& labels, double fraction, uint64_t seed) {
  MN_CHECK(fraction > 0.0 && fraction < 1.0, ValueError, "stratified_split: the validation fraction must be in "
           "(0, 1), got ", fraction);
  MN_CHECK(labels.defined() && labels.dim() == 1 && labels.dtype() == kInt64, ValueError,
           "stratified_split: expected int64 labels [N], got ",
           labels.defined() ? str(dtype_name(labels.dtype()), " ", labels.sizes().str()) : std::string("undefined"));
  const std::vector<int64_t> y = labels.to_vector<int64_t>();
  std::map<int64_t, std::vector<int64_t>> by_class;  // ascending sample indices per class
  for (size_t i = 0; i < y.size(); ++i) {
    MN_CHECK(y[i] >= 0, ValueError, "stratified_split: label ", y[i], " at sample ", i, " is negative");
    by_class[y[i]].push_back(static_cast<int64_t>(i));
  }
  static const uint64_t kSplitStream = stream_key("mn::data::stratified_split");
  std::vector<int64_t> train, val;
  for (const auto& [label, members] : by_class) {
    const auto n = static_cast<int64_t>(members.size());
    const auto k = static_cast<int64_t>(std::llround(fraction * static_cast<double>(n)));
    const std::vector<int64_t> order = philox_permutation(n, seed, kSplitStream + static_cast<uint64_t>(label));
    for (int64_t r = 0; r < n; ++r)
      (r < k ? val : train).push_back(members[static_cast<size_t>(order[static_cast<size_t>(r)])]);
  }
  MN_CHECK(!val.empty() && !train.empty(), ValueError, "stratified_split: a fraction of ", fraction, " of ", y.size(),
           " samples leaves ", val.empty() ? "the validation part" : "the training part",
           " empty; use more samples or another fraction");
  std::sort(train.begin(), train.end());
  std::sort(val.begin(), val.end());
  const auto as_tensor = [](const std::vector<int64_t>& v) {
    return from_vector(v, Shape{static_cast<int64_t>(v.size())});
  };
  return {as_tensor(train), as_tensor(val)};
}

}  // namespace mn::data
