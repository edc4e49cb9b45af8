#include "nn/data/fashion_mnist.h"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <set>

#include "autograd/ops.h"
#include "nn/data/idx.h"

namespace mn::data {
namespace {

constexpr int64_t kNumClasses = 10;

// The .gz name the package ships, or the same file unpacked; missing both is reported against the .gz
// name with a hint on where the data comes from.
std::string find_idx_file(const std::string& root, const std::string& stem, const std::string& what) {
  const std::filesystem::path gz = std::filesystem::path(root) / (stem + ".gz");
  const std::filesystem::path plain = std::filesystem::path(root) / stem;
  std::error_code ec;
  if (std::filesystem::exists(gz, ec)) return gz.string();
  if (std::filesystem::exists(plain, ec)) return plain.string();
  throw IOError(str("Fashion-MNIST ", what, " not found: ", gz.string(), " (nor ", plain.string(),
                    "); install the Debian package dataset-fashion-mnist or set MN_FASHION_MNIST_DIR"));
}

}  // namespace

std::string default_fashion_mnist_root() {
  const char* env = std::getenv("MN_FASHION_MNIST_DIR");
  if (env != nullptr && env[0] != '\0') return env;
  return "/usr/share/datasets/fashion-mnist";
}

Dataset load_fashion_mnist(const std::string& split, const std::string& root) {
  MN_CHECK(split == "train" || split == "test", ValueError,
           "load_fashion_mnist: split must be \"train\" or \"test\", got \"", split, "\"");
  const std::string prefix = split == "train" ? "train" : "t10k";
  const std::string images_path = find_idx_file(root, prefix + "-images-idx3-ubyte", split + " images");
  const std::string labels_path = find_idx_file(root, prefix + "-labels-idx1-ubyte", split + " labels");

  Dataset ds;
  ds.images = read_idx_images(images_path);
  ds.labels = read_idx_labels(labels_path);
  const int64_t n_images = ds.images.size(0);
  const int64_t n_labels = ds.labels.size(0);
  if (n_images != n_labels)
    throw IOError(str("Fashion-MNIST ", split, " split: ", images_path, " holds ", n_images, " images but ",
                      labels_path, " holds ", n_labels, " labels"));
  const int64_t* labels = ds.labels.data<int64_t>();
  for (int64_t i = 0; i < n_labels; ++i)
    if (labels[i] < 0 || labels[i] >= kNumClasses)
      throw IOError(str("IDX file ", labels_path, ": label ", i, " (byte offset ", 8 + i, ") is ", labels[i],
                        ", expected a class in 0..", kNumClasses - 1));
  return ds;
}

std::vector<std::string> fashion_mnist_classes() {
  return {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"};
}

Dataset Dataset::head(int64_t n) const {
  if (n <= 0 || n >= size()) return *this;
  return {images.narrow(0, 0, n).contiguous(), labels.narrow(0, 0, n).contiguous()};
}

Dataset Dataset::select(const Tensor& indices) const {
  MN_CHECK(indices.defined() && indices.dtype() == DType::i64 && indices.dim() == 1, ValueError,
           "Dataset::select: indices must be a 1-d i64 tensor, got ",
           indices.defined() ? str(dtype_name(indices.dtype()), " ", indices.sizes()) : std::string("none"));
  return {index_select(images, 0, indices.to(images.device())), index_select(labels, 0, indices.to(labels.device()))};
}

Dataset Dataset::to(Device device) const {
  return {images.device() == device ? images : images.to(device), labels.device() == device ? labels : labels.to(device)};
}

Dataset select_classes(const Dataset& ds, const std::vector<int64_t>& classes) {
  MN_CHECK(!classes.empty(), ValueError, "select_classes: the class list is empty");
  std::set<int64_t> wanted(classes.begin(), classes.end());
  MN_CHECK(wanted.size() == classes.size(), ValueError, "select_classes: the class list repeats a class");
  const std::vector<int64_t> labels = ds.labels.to(kCPU).to_vector<int64_t>();
  std::vector<int64_t> keep;
  for (size_t i = 0; i < labels.size(); ++i)
    if (wanted.count(labels[i])) keep.push_back(static_cast<int64_t>(i));
  return ds.select(from_vector(keep, Shape{static_cast<int64_t>(keep.size())}));
}

Tensor normalize(const Tensor& images, double mean, double stddev) {
  MN_CHECK(std::isfinite(mean), ValueError, "normalize: mean must be finite, got ", mean);
  MN_CHECK(std::isfinite(stddev) && stddev > 0.0, ValueError, "normalize: stddev must be positive and finite, got ",
           stddev);
  return div(sub(images, mean), stddev);
}

}  // namespace mn::data
