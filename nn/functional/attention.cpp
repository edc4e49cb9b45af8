// Scaled dot-product attention composed of differentiable ops (matmul, add, softmax, dropout), so it
// runs and differentiates on every backend those ops support. The scale is applied to the query
// ([..., L, E]) before the product rather than to the [..., L, S] scores, so the only tensors of the
// scores' size are the product itself, the masked copy when there is a mask (the product is freed once
// it is added: add's backward keeps neither input), the softmax weights (kept for softmax's backward)
// and, with dropout, the dropped weights.
#include <cmath>
#include <limits>
#include <vector>

#include "autograd/functions/common.h"
#include "core/random.h"
#include "nn/functional.h"

namespace mn::nn::functional {

namespace {

constexpr const char* kOp = "scaled_dot_product_attention";

// Additive causal mask [L, S]: 0 where j <= i, -inf where key j lies after query i.
Tensor causal_mask(int64_t L, int64_t S, Device device) {
  std::vector<float> values(static_cast<size_t>(L * S), 0.0f);
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = i + 1; j < S; ++j) values[static_cast<size_t>(i * S + j)] = -std::numeric_limits<float>::infinity();
  return from_vector(values, {L, S}, TensorOptions(DType::f32).with_device(device));
}

void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, double dropout_p,
                  bool is_causal) {
  detail::check_defined(kOp, q, "query");
  detail::check_defined(kOp, k, "key");
  detail::check_defined(kOp, v, "value");
  detail::check_float(kOp, q, "query");
  detail::check_float(kOp, k, "key");
  detail::check_float(kOp, v, "value");
  detail::check_same_device(kOp, q, k);
  detail::check_same_device(kOp, q, v);
  MN_CHECK(q.dim() >= 2 && k.dim() >= 2 && v.dim() >= 2, ValueError, kOp,
           ": query, key and value need at least 2 dims ([..., L, E], [..., S, E], [..., S, Ev]), got shapes ",
           q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  MN_CHECK(q.size(-1) == k.size(-1), ValueError, kOp, ": query and key must share the last dim E, got query ",
           q.sizes(), " and key ", k.sizes());
  MN_CHECK(k.size(-2) == v.size(-2), ValueError, kOp,
           ": key and value must have the same sequence length S (dim -2), got key ", k.sizes(), " and value ",
           v.sizes());
  MN_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, ValueError, kOp, ": dropout_p must be in [0, 1], got ", dropout_p);
  if (!mask.defined()) return;
  MN_CHECK(!is_causal, ValueError, kOp,
           ": attn_mask and is_causal are mutually exclusive (fold the causal mask into attn_mask)");
  MN_CHECK(mask.dtype() == DType::f32, TypeError, kOp,
           ": attn_mask must be an additive f32 mask (0 = attend, -inf = hide), got ", dtype_name(mask.dtype()),
           "; build one from a 0/1 mask m with where(m, scalar_tensor(0.0), scalar_tensor(-INFINITY))");
  detail::check_same_device(kOp, q, mask);
  const int64_t L = q.size(-2), S = k.size(-2);
  const bool fits = mask.dim() >= 1 && (mask.size(-1) == S || mask.size(-1) == 1) &&
                    (mask.dim() < 2 || mask.size(-2) == L || mask.size(-2) == 1);
  MN_CHECK(fits, ValueError, kOp, ": attn_mask must broadcast to the scores [..., L=", L, ", S=", S, "], got shape ",
           mask.sizes());
}

}  // namespace

AttentionOutput scaled_dot_product_attention_with_weights(const Tensor& query, const Tensor& key, const Tensor& value,
                                                          const Tensor& attn_mask, double dropout_p, bool is_causal,
                                                          std::optional<double> scale, Generator* gen) {
  check_inputs(query, key, value, attn_mask, dropout_p, is_causal);
  const double s = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(query.size(-1)));
  Tensor scores = matmul(mul(query, s), transpose(key, -2, -1));
  if (attn_mask.defined()) scores = add(scores, attn_mask);
  if (is_causal) scores = add(scores, causal_mask(query.size(-2), key.size(-2), query.device()));
  // A row of -inf only has no maximum to subtract: softmax gives NaN there, as PyTorch's does.
  Tensor weights = softmax(scores, -1);
  if (dropout_p > 0.0) weights = dropout(weights, dropout_p, /*training=*/true, gen);
  return {matmul(weights, value), weights};
}

Tensor scaled_dot_product_attention(const Tensor& query, const Tensor& key, const Tensor& value, const Tensor& attn_mask,
                                    double dropout_p, bool is_causal, std::optional<double> scale, Generator* gen) {
  return scaled_dot_product_attention_with_weights(query, key, value, attn_mask, dropout_p, is_causal, scale, gen)
      .output;
}

}  // namespace mn::nn::functional
