// embedding: rows of a weight table looked up by i64 indices of any shape, with PyTorch's padding_idx
// (the padding row receives no gradient). The lookup is an index_select of the flattened indices; the
// backward is written with differentiable ops (a scatter_add of the gradient rows into zeros), so
// double backward works and repeated indices accumulate in order.
#include "autograd/functions/common.h"
#include "nn/functional.h"

namespace mn::nn::functional {

namespace {

// padding_idx as a row number (negative counts from the end, as PyTorch), or -1 for none.
int64_t padding_row(std::optional<int64_t> padding_idx, int64_t rows) {
  if (!padding_idx) return -1;
  const int64_t p = *padding_idx;
  MN_CHECK(p >= -rows && p < rows, ValueError, "embedding: padding_idx ", p, " must be within [", -rows, ", ", rows,
           ") for an embedding of ", rows, " rows");
  return p < 0 ? p + rows : p;
}

}  // namespace

Tensor embedding(const Tensor& indices, const Tensor& weight, std::optional<int64_t> padding_idx) {
  detail::check_defined("embedding", indices, "indices");
  detail::check_defined("embedding", weight, "weight");
  MN_CHECK(indices.dtype() == DType::i64, TypeError, "embedding: expected i64 indices, got ", indices.dtype());
  MN_CHECK(weight.dim() == 2, ValueError, "embedding: expected a weight of shape [num_embeddings, embedding_dim], got ",
           weight.sizes());
  detail::check_same_device("embedding", weight, indices);
  const int64_t rows = weight.size(0), width = weight.size(1);
  const int64_t pad = padding_row(padding_idx, rows);
  const Tensor flat = indices.detach().reshape({-1});
  if (flat.numel() > 0) {
    // One check naming the offending value (the largest or the smallest index).
    const int64_t hi = max(flat).to_vector<int64_t>()[0], lo = min(flat).to_vector<int64_t>()[0];
    const int64_t bad = hi >= rows ? hi : lo;
    MN_CHECK(lo >= 0 && hi < rows, IndexError, "embedding: index ", bad, " is out of range for an embedding of ", rows,
             " rows (weight shape ", weight.sizes(), ")");
  }
  Shape out_shape = Shape::filled(indices.dim() + 1, width);
  for (int d = 0; d < indices.dim(); ++d) out_shape[d] = indices.size(d);

  Tensor rows_out;
  {
    autograd::NoGradGuard no_grad;
    rows_out = index_select(weight.detach(), 0, flat);
  }
  Tensor out = rows_out.reshape(out_shape);
  if (autograd::needs_grad({&weight}))
    autograd::record("EmbeddingBackward", {&weight}, {&out},
                     [sf = autograd::SavedTensor::input(flat), pad, rows, width](
                         const autograd::GradContext& c) -> autograd::TensorList {
                       const Tensor flat = sf.unpack("EmbeddingBackward");
                       const int64_t n = flat.numel();
                       Tensor g = c.grad().reshape({n, width});
                       const Tensor column = flat.reshape({n, 1});
                       if (pad >= 0) g = masked_fill(g, eq(column, static_cast<double>(pad)), 0.0);
                       Tensor target = zeros({rows, width}, g.options());
                       return {scatter_add(target, 0, column.expand({n, width}), g)};
                     });
  return out;
}

}  // namespace mn::nn::functional
