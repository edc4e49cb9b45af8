#pragma once
// Neural-network operations (differentiable): linear, convolution, pooling, batch norm, dropout,
// activations and losses. Layers in nn/ are thin modules over these.
#include <array>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "autograd/ops.h"

namespace mn {
class Generator;
}

namespace mn::nn::functional {

// BatchMean is PyTorch's 'batchmean' (the sum divided by the batch size input.size(0)); only kl_div
// takes it. Mean is the elementwise mean everywhere (kl_div included, as in PyTorch).
enum class Reduction { None, Mean, Sum, BatchMean };

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

// logits [N, C] (or [C]), target [N] i64 class indices; weight: f32 [C] class weights or undefined
// (no gradient flows to it; one that requires grad is refused). As in PyTorch 1.13 the per-row loss is
// (1 - s) w[t] (-log p_t) + (s / C) sum_c w[c] (-log p_c) (0 where t == ignore_index), and Mean divides
// the sum by sum over counted rows of w[t] (their count without weight; 0/0 = NaN when none counts).
Tensor cross_entropy(const Tensor& logits, const Tensor& target, double label_smoothing = 0.0,
                     Reduction reduction = Reduction::Mean, int64_t ignore_index = -100,
                     const Tensor& weight = Tensor());
// -w[t] log_probs[n, t] per row (0 where t == ignore_index); Mean divides by the counted rows' w[t].
Tensor nll_loss(const Tensor& log_probs, const Tensor& target, Reduction reduction = Reduction::Mean,
                int64_t ignore_index = -100, const Tensor& weight = Tensor());
Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::Mean);
// Elementwise losses with PyTorch's formulas; input and target of one shape, f32 (nn/functional/loss_pointwise.cpp).
// (1 - y) x + (1 + (pos_weight - 1) y) softplus(-x), times weight; weight and pos_weight (e.g. [C]
// for input [N, C]) broadcast to the input's shape.
Tensor binary_cross_entropy_with_logits(const Tensor& input, const Tensor& target, const Tensor& weight = Tensor(),
                                        const Tensor& pos_weight = Tensor(), Reduction reduction = Reduction::Mean);
// |x - y|; the gradient at x == y is 0 (sign).
Tensor l1_loss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::Mean);
// 0.5 d^2 / beta where |d| < beta, else |d| - 0.5 beta (d = x - y); beta = 0 is l1_loss, beta < 0 refused.
Tensor smooth_l1_loss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::Mean,
                      double beta = 1.0);
// input holds log-probabilities; target probabilities (log-probabilities with log_target):
// target (log target - input), 0 where target == 0 (where PyTorch's xlogy also gives the target a NaN
// gradient, the t log t term gives it 0). BatchMean: sum / input.size(0).
Tensor kl_div(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::Mean,
              bool log_target = false);

// ---- attention ----
// Scaled dot-product attention, PyTorch 2.x semantics: softmax(Q K^T * scale + mask) V with
// query [..., L, E], key [..., S, E], value [..., S, Ev] (batch dims broadcast) -> [..., L, Ev].
// scale defaults to 1 / sqrt(E). attn_mask is an f32 tensor added to the scores, broadcastable to
// [..., L, S]: 0 lets a query see a key, -inf hides it. There is no bool dtype, so PyTorch's boolean
// mask (true = take part) is spelled as the additive one: from an f32 0/1 mask m with 1 = take part,
// where(m, scalar_tensor(0.0), scalar_tensor(-INFINITY)). An i64 mask is a TypeError. is_causal hides
// key j from query i when j > i (top-left aligned as torch.tril); giving it together with attn_mask
// is a ValueError, as in PyTorch. A query row with every key hidden yields NaN, as PyTorch's math
// path does. Dropout (probability dropout_p, drawn from gen or the default generator) is applied to
// the attention weights whenever dropout_p > 0: pass 0 in evaluation, as PyTorch's caller does.
Tensor scaled_dot_product_attention(const Tensor& query, const Tensor& key, const Tensor& value,
                                    const Tensor& attn_mask = Tensor(), double dropout_p = 0.0, bool is_causal = false,
                                    std::optional<double> scale = std::nullopt, Generator* gen = nullptr);
// The same, also returning the attention weights [..., L, S] after dropout (what
// nn::MultiheadAttention reports with need_weights).
struct AttentionOutput {
  Tensor output;
  Tensor weights;
};
AttentionOutput scaled_dot_product_attention_with_weights(const Tensor& query, const Tensor& key, const Tensor& value,
                                                          const Tensor& attn_mask = Tensor(), double dropout_p = 0.0,
                                                          bool is_causal = false,
                                                          std::optional<double> scale = std::nullopt,
                                                          Generator* gen = nullptr);

}  // namespace mn::nn::functional
