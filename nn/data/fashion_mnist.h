#pragma once
// Fashion-MNIST (Zalando): 28x28 grey-scale images of clothing in 10 classes, 60 000 for training and
// 10 000 for testing, stored as gzip'd IDX files (Debian package dataset-fashion-mnist).
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mn::data {

// An in-memory labelled data set: images f32 [N, 1, rows, cols] in [0, 1], labels i64 [N].
struct Dataset {
  Tensor images;
  Tensor labels;
  int64_t size() const { return labels.defined() ? labels.size(0) : 0; }
  // The first n samples (contiguous copies); all of them when n <= 0 or n >= size().
  Dataset head(int64_t n) const;
  // The samples at `indices` (i64, any device), in that order, on this set's device.
  Dataset select(const Tensor& indices) const;
  // Images and labels on `device` (the same tensors when they are there already).
  Dataset to(Device device) const;
};

// Per-pixel statistics of the training split (after scaling to [0, 1]).
constexpr double kFashionMnistMean = 0.2860;
constexpr double kFashionMnistStd = 0.3530;

// $MN_FASHION_MNIST_DIR when set and non-empty, else /usr/share/datasets/fashion-mnist.
std::string default_fashion_mnist_root();

// split: "train" (60 000 samples) or "test" (10 000); anything else is a ValueError. Reads
// <root>/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz, or the same names without .gz. Throws IOError
// when a file is missing or broken, when the two files disagree on the number of samples, or when a
// label is outside 0..9.
Dataset load_fashion_mnist(const std::string& split, const std::string& root = default_fashion_mnist_root());

// Class names, indexed by label.
std::vector<std::string> fashion_mnist_classes();

// (images - mean) / stddev, a new tensor; the defaults are the training split's statistics.
Tensor normalize(const Tensor& images, double mean = kFashionMnistMean, double stddev = kFashionMnistStd);

// The samples whose label is one of `classes`, in their original order, labels unchanged (a model
// trained on them keeps all its outputs). ValueError for an empty list or a duplicate.
Dataset select_classes(const Dataset& ds, const std::vector<int64_t>& classes);

}  // namespace mn::data
