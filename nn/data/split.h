#pragma once
// A validation split carved from a labelled training set, for choosing settings without the test set.
#include <cstdint>

#include "core/tensor.h"

namespace mn::data {

// Sample indices (i64 [k], CPU, ascending) of the two parts of a split.
struct SplitIndices {
  Tensor train;
  Tensor val;
};

// Stratified by label: of the n_c samples of each class c, round(fraction * n_c) go to the validation
// part, chosen by a permutation of that class's samples drawn from (seed, c) on a Philox stream of its
// own (no generator state is used), so the split is a pure function of (labels, fraction, seed) and
// every class keeps its share. labels: integer [N] (any device), values >= 0. ValueError unless
// 0 < fraction < 1 and both parts end up non-empty.
SplitIndices stratified_split(const Tensor& labels, double fraction, uint64_t seed);

}  // namespace mn::data
