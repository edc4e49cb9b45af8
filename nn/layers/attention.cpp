// MultiheadAttention over F::scaled_dot_product_attention_with_weights, following
// torch.nn.functional.multi_head_attention_forward: project, split E into num_heads heads of
// head_dim, attend per head with scale 1/sqrt(head_dim), merge the heads, project out.
#include "nn/init.h"
#include "nn/layers.h"

namespace mn::nn {

namespace F = functional;

MultiheadAttention::MultiheadAttention(int64_t embed_dim, int64_t num_heads, double dropout, bool bias,
                                       bool batch_first)
    : Module("MultiheadAttention"),
      embed_dim(embed_dim),
      num_heads(num_heads),
      head_dim(num_heads > 0 ? embed_dim / num_heads : 0),
      dropout(dropout),
      batch_first(batch_first) {
  MN_CHECK(embed_dim > 0 && num_heads > 0, ValueError,
           "MultiheadAttention: embed_dim and num_heads must be positive, got embed_dim=", embed_dim,
           ", num_heads=", num_heads);
  MN_CHECK(embed_dim % num_heads == 0, ValueError, "MultiheadAttention: embed_dim (", embed_dim,
           ") must be divisible by num_heads (", num_heads, ")");
  MN_CHECK(dropout >= 0.0 && dropout < 1.0, ValueError, "MultiheadAttention: dropout must be in [0, 1), got ",
           dropout);
  // PyTorch's order: out_proj is built (default Linear init) before in_proj_weight is drawn.
  out_proj = std::make_shared<Linear>(embed_dim, embed_dim, bias);
  Tensor w = empty({3 * embed_dim, embed_dim});
  init::xavier_uniform_(w);
  register_parameter("in_proj_weight", w);
  if (bias) {
    register_parameter("in_proj_bias", zeros({3 * embed_dim}));
    Tensor out_bias = out_proj->param("bias");
    init::constant_(out_bias, 0.0);
  }
  register_module("out_proj", out_proj);
}

MultiheadAttention::Output MultiheadAttention::forward_attention(const Tensor& query, const Tensor& key,
                                                                 const Tensor& value, const Tensor& key_padding_mask,
                                                                 bool need_weights, const Tensor& attn_mask,
                                                                 bool average_attn_weights) {
  MN_CHECK(query.defined() && key.defined() && value.defined(), ValueError, "MultiheadAttention(", embed_dim, ", ",
           num_heads, "): query, key and value must be defined");
  // Self-attention (one tensor for all three) passes it once, so a recomputation sees the same.
  const bool self = query.impl() == key.impl() && key.impl() == value.impl();
  const bool has_padding = key_padding_mask.defined(), has_mask = attn_mask.defined();
  std::vector<Tensor> inputs{query};
  if (!self) inputs.insert(inputs.end(), {key, value});
  if (has_padding) inputs.push_back(key_padding_mask);
  if (has_mask) inputs.push_back(attn_mask);
  std::vector<Tensor> results =
      call(inputs, [this, self, has_padding, has_mask, need_weights, average_attn_weights](const std::vector<Tensor>& in) {
        size_t i = 0;
        const Tensor q = in[i++];
        const Tensor k = self ? q : in[i++];
        const Tensor v = self ? q : in[i++];
        const Tensor padding = has_padding ? in[i++] : Tensor();
        const Tensor mask = has_mask ? in[i++] : Tensor();
        Output o = attend(q, k, v, self, padding, need_weights, mask, average_attn_weights);
        return need_weights ? std::vector<Tensor>{o.output, o.weights} : std::vector<Tensor>{o.output};
      });
  return {results[0], need_weights ? results[1] : Tensor()};
}

MultiheadAttention::Output MultiheadAttention::attend(const Tensor& query, const Tensor& key, const Tensor& value,
                                                      bool self_attention, const Tensor& key_padding_mask,
                                                      bool need_weights, const Tensor& attn_mask,
                                                      bool average_attn_weights) {
  const std::string me = str("MultiheadAttention(", embed_dim, ", ", num_heads, ")");
  const bool batched = query.dim() == 3;
  MN_CHECK((query.dim() == 2 || batched) && key.dim() == query.dim() && value.dim() == query.dim(), ValueError, me,
           ": query, key and value must all be 3-D (", (batch_first ? "[N, L, E]" : "[L, N, E]"),
           ") or all 2-D (unbatched [L, E]), got shapes ", query.sizes(), ", ", key.sizes(), ", ", value.sizes());
  MN_CHECK(query.size(-1) == embed_dim && key.size(-1) == embed_dim && value.size(-1) == embed_dim, ValueError, me,
           ": query, key and value must have last dim ", embed_dim, ", got shapes ", query.sizes(), ", ", key.sizes(),
           ", ", value.sizes());
  // Everything below works on [N, T, E].
  auto batch_major = [&](const Tensor& t) {
    if (!batched) return unsqueeze(t, 0);
    return batch_first ? t : transpose(t, 0, 1);
  };
  const Tensor q_in = batch_major(query), k_in = batch_major(key), v_in = batch_major(value);
  const int64_t N = q_in.size(0), L = q_in.size(1), S = k_in.size(1);
  MN_CHECK(k_in.size(0) == N && v_in.size(0) == N && v_in.size(1) == S, ValueError, me,
           ": key and value must have the query's batch size and one sequence length, got shapes ", query.sizes(),
           ", ", key.sizes(), ", ", value.sizes());

  // In-projection: one product when the three inputs are one tensor (self-attention), else the
  // weight's query / key / value row blocks.
  const Tensor w = param("in_proj_weight");
  const Tensor b = has_parameter("in_proj_bias") ? param("in_proj_bias") : Tensor();
  Tensor q, k, v;
  if (self_attention) {
    std::vector<Tensor> qkv = chunk(F::linear(q_in, w, b), 3, -1);
    q = qkv[0], k = qkv[1], v = qkv[2];
  } else {
    auto rows = [&](const Tensor& t, int64_t block) {
      return t.defined() ? narrow(t, 0, block * embed_dim, embed_dim) : Tensor();
    };
    q = F::linear(q_in, rows(w, 0), rows(b, 0));
    k = F::linear(k_in, rows(w, 1), rows(b, 1));
    v = F::linear(v_in, rows(w, 2), rows(b, 2));
  }
  // [N, T, E] -> [N, H, T, head_dim]
  auto heads = [&](const Tensor& t, int64_t T) { return permute(reshape(t, {N, T, num_heads, head_dim}), {0, 2, 1, 3}); };

  // Both masks become additive terms broadcastable to the scores [N, H, L, S].
  Tensor mask;
  if (attn_mask.defined()) {
    const bool ok2 = attn_mask.dim() == 2 && attn_mask.sizes() == Shape{L, S};
    const bool ok3 = attn_mask.dim() == 3 && attn_mask.sizes() == Shape{N * num_heads, L, S};
    MN_CHECK(ok2 || ok3, ValueError, me, ": attn_mask must be [L, S] = [", L, ", ", S, "] or [N * num_heads, L, S] = [",
             N * num_heads, ", ", L, ", ", S, "], got shape ", attn_mask.sizes());
    mask = ok3 ? reshape(attn_mask, {N, num_heads, L, S}) : attn_mask;
  }
  if (key_padding_mask.defined()) {
    const Shape expected = batched ? Shape{N, S} : Shape{S};
    MN_CHECK(key_padding_mask.sizes() == expected, ValueError, me, ": key_padding_mask must have shape ", expected,
             ", got ", key_padding_mask.sizes());
    MN_CHECK(key_padding_mask.dtype() == DType::f32, TypeError, me,
             ": key_padding_mask must be an additive f32 mask (-inf = hide), got ",
             dtype_name(key_padding_mask.dtype()));
    const Tensor padding = reshape(key_padding_mask, {N, 1, 1, S});
    mask = mask.defined() ? add(mask, padding) : padding;
  }

  const double p = is_training() ? dropout : 0.0;
  F::AttentionOutput att =
      F::scaled_dot_product_attention_with_weights(heads(q, L), heads(k, S), heads(v, S), mask, p);
  // [N, H, L, head_dim] -> [N, L, E], projected out, back to the caller's layout.
  Tensor out = (*out_proj)(reshape(permute(att.output, {0, 2, 1, 3}), {N, L, embed_dim}));
  out = !batched ? squeeze(out, 0) : (batch_first ? out : transpose(out, 0, 1));

  Tensor weights;
  if (need_weights) {
    weights = average_attn_weights ? mean(att.weights, 1) : att.weights;
    if (!batched) weights = squeeze(weights, 0);
  }
  return {out, weights};
}

Tensor MultiheadAttention::forward(const Tensor& x) {
  return forward_attention(x, x, x, Tensor(), /*need_weights=*/false).output;
}

}  // namespace mn::nn
