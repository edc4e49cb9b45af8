#pragma once
// Neural-network operations (differentiable): linear, convolution, pooling, batch norm, dropout,
// activations and losses. Layers in nn/ are thin modules over these.
#include <array>
#include <optional>
#include <string>
#include <utility>

#include "autograd/ops.h"

namespace mn {
class Generator;
}

namespace mn::nn::functional {

enum class Reduction { None, Mean, Sum };

// y = x W^T + b; x [*, in], weight [out, in], bias [out] or undefined.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());

// x [N,C,H,W]; weight [O, C/groups, KH, KW]; bias [O] or undefined.
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(),
              std::array<int64_t, 2> stride = {1, 1}, std::array<int64_t, 2> padding = {0, 0},
              std::array<int64_t, 2> dilation = {1, 1}, int64_t groups = 1);

// stride defaults to the kernel size when {0, 0}.
Tensor max_pool2d(const Tensor& x, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride = {0, 0},
                  std::array<int64_t, 2> padding = {0, 0}, bool ceil_mode = false);
Tensor avg_pool2d(const Tensor& x, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride = {0, 0},
                  std::array<int64_t, 2> padding = {0, 0}, bool ceil_mode = false, bool count_include_pad = true);

// Adaptive pooling of x [N,C,H,W] or [C,H,W] to output_size (OH, OW), any size, with PyTorch's
// windows: output (i, j) covers rows floor(i*H/OH) .. ceil((i+1)*H/OH) - 1 and the columns alike.
// The _with_indices form also returns the i64 flat h*W+w argmax positions (PyTorch's return_indices).
Tensor adaptive_avg_pool2d(const Tensor& x, std::array<int64_t, 2> output_size);
Tensor adaptive_max_pool2d(const Tensor& x, std::array<int64_t, 2> output_size);
std::pair<Tensor, Tensor> adaptive_max_pool2d_with_indices(const Tensor& x, std::array<int64_t, 2> output_size);
inline Tensor adaptive_avg_pool2d(const Tensor& x, int64_t output_size) {
  return adaptive_avg_pool2d(x, {output_size, output_size});
}
inline Tensor adaptive_max_pool2d(const Tensor& x, int64_t output_size) {
  return adaptive_max_pool2d(x, {output_size, output_size});
}

// Rows of weight [num_embeddings, embedding_dim] at i64 indices of any shape: the result has shape
// indices.shape + [embedding_dim]. padding_idx (negative counts from the end, as PyTorch; none by
// default) names a row that gets no gradient. An index outside [0, num_embeddings) -> IndexError.
Tensor embedding(const Tensor& indices, const Tensor& weight, std::optional<int64_t> padding_idx = std::nullopt);

// x [N,C] or [N,C,*]. Running stats (may be undefined) are updated in place in training mode.
Tensor batch_norm(const Tensor& x, Tensor running_mean, Tensor running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double momentum = 0.1, double eps = 1e-5);

// Inverted dropout: zeroes with probability p and scales survivors by 1/(1-p) in training mode.
Tensor dropout(const Tensor& x, double p = 0.5, bool training = true, Generator* gen = nullptr);

// logits [N, C] (or [C]), target [N] i64 class indices.
Tensor cross_entropy(const Tensor& logits, const Tensor& target, double label_smoothing = 0.0,
                     Reduction reduction = Reduction::Mean, int64_t ignore_index = -100);
Tensor nll_loss(const Tensor& log_probs, const Tensor& target, Reduction reduction = Reduction::Mean);
Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::Mean);

}  // namespace mn::nn::functional
