#pragma once
// Neural-network operations (differentiable): linear, convolution, pooling, batch norm, dropout,
// activations and losses. Layers in nn/ are thin modules over these.
#include <array>
#include <string>
#include <vector>

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

// x [N,C] or [N,C,*]. Running stats (may be undefined) are updated in place in training mode.
Tensor batch_norm(const Tensor& x, Tensor running_mean, Tensor running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double momentum = 0.1, double eps = 1e-5);

// Layer norm over the trailing dims `normalized_shape` of x [*, normalized_shape]; weight and bias
// (optional) have shape normalized_shape. Group norm of x [N, C, *] over num_groups groups of C /
// num_groups channels (C divisible by num_groups); weight and bias (optional) [C]. Both use the biased
// variance, as PyTorch.
Tensor layer_norm(const Tensor& x, const std::vector<int64_t>& normalized_shape, const Tensor& weight = Tensor(),
                  const Tensor& bias = Tensor(), double eps = 1e-5);
Tensor group_norm(const Tensor& x, int64_t num_groups, const Tensor& weight = Tensor(), const Tensor& bias = Tensor(),
                  double eps = 1e-5);

// Inverted dropout: zeroes with probability p and scales survivors by 1/(1-p) in training mode.
Tensor dropout(const Tensor& x, double p = 0.5, bool training = true, Generator* gen = nullptr);

// logits [N, C] (or [C]), target [N] i64 class indices.
Tensor cross_entropy(const Tensor& logits, const Tensor& target, double label_smoothing = 0.0,
                     Reduction reduction = Reduction::Mean, int64_t ignore_index = -100);
Tensor nll_loss(const Tensor& log_probs, const Tensor& target, Reduction reduction = Reduction::Mean);
Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::Mean);

}  // namespace mn::nn::functional
