// AdaptiveAvgPool2d, AdaptiveMaxPool2d and Embedding.
#include "autograd/node.h"
#include "nn/init.h"
#include "nn/layers.h"

namespace mn::nn {

namespace F = functional;

AdaptiveAvgPool2d::AdaptiveAvgPool2d(std::array<int64_t, 2> size) : Module("AdaptiveAvgPool2d"), output_size(size) {
  MN_CHECK(size[0] >= 0 && size[1] >= 0, ValueError, "AdaptiveAvgPool2d: output size must be non-negative, got [",
           size[0], ", ", size[1], "]");
}
Tensor AdaptiveAvgPool2d::forward(const Tensor& x) { return F::adaptive_avg_pool2d(x, output_size); }

AdaptiveMaxPool2d::AdaptiveMaxPool2d(std::array<int64_t, 2> size) : Module("AdaptiveMaxPool2d"), output_size(size) {
  MN_CHECK(size[0] >= 0 && size[1] >= 0, ValueError, "AdaptiveMaxPool2d: output size must be non-negative, got [",
           size[0], ", ", size[1], "]");
}
Tensor AdaptiveMaxPool2d::forward(const Tensor& x) { return F::adaptive_max_pool2d(x, output_size); }

Embedding::Embedding(int64_t num, int64_t dim, std::optional<int64_t> pad)
    : Module("Embedding"), num_embeddings(num), embedding_dim(dim), padding_idx(pad) {
  MN_CHECK(num > 0 && dim > 0, ValueError, "Embedding: num_embeddings and embedding_dim must be positive, got ", num,
           " and ", dim);
  MN_CHECK(!pad || (*pad >= -num && *pad < num), ValueError, "Embedding: padding_idx ", pad.value_or(0),
           " must be within [", -num, ", ", num, ")");
  Tensor w = empty({num, dim});
  init::normal_(w, 0.0, 1.0);
  if (pad) w.narrow(0, *pad < 0 ? *pad + num : *pad, 1).fill_(0.0);
  register_parameter("weight", w);
}

Tensor Embedding::forward(const Tensor& indices) { return F::embedding(indices, param("weight"), padding_idx); }

}  // namespace mn::nn
