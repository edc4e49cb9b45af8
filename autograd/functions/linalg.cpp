// Matrix products: mm and bmm run the gemm kernel; matmul reduces every numpy-style case to them
// with views (1-D operands gain and then lose a unit dim, batch dims broadcast with expand and
// flatten into one). Backward formulas are products with transposed views, so they are recorded
// under create_graph and double backward works.
#include "autograd/autocast.h"
#include "autograd/functions/common.h"

namespace mn {

using autograd::GradContext;
using autograd::SavedTensor;
using autograd::TensorList;

namespace {

void check_operands(const char* op, const Tensor& a, const Tensor& b) {
  detail::check_defined(op, a, "a");
  detail::check_defined(op, b, "b");
  detail::check_same_device(op, a, b);
  detail::check_float(op, a, "a");
  detail::check_float(op, b, "b");
  detail::check_same_dtype(op, a, b);
}

void check_inner(const char* op, const Tensor& a, const Tensor& b, int64_t ka, int64_t kb) {
  MN_CHECK(ka == kb, ValueError, op, ": shapes ", a.sizes(), " and ", b.sizes(), " cannot be multiplied (", ka,
           " != ", kb, ")");
}

// A matrix (last two dims) laid out column-major: a transposed view such as W.t().
bool transposed_layout(const Tensor& t) {
  const int d = t.dim();
  return t.stride(d - 2) == 1 && t.stride(d - 1) != 1 && t.size(d - 1) > 1;
}

Tensor swap_last(const Tensor& t) { return transpose(t, -2, -1); }

Tensor product(const Tensor& lhs, const Tensor& rhs) { return lhs.dim() == 3 ? bmm(lhs, rhs) : mm(lhs, rhs); }

// lhs @ rhs computed as (rhs^T lhs^T)^T when the operand it is the gradient of was a transposed view,
// so that the gradient of a leaf used as W.t() arrives contiguous in W's own layout.
Tensor product_in_layout(bool transposed, const Tensor& lhs, const Tensor& rhs) {
  return transposed ? swap_last(product(swap_last(rhs), swap_last(lhs))) : product(lhs, rhs);
}

// out = a @ b through the gemm kernel, with the backward dA = G B^T, dB = A^T G.
Tensor matrix_product(const char* backward_name, const Tensor& a, const Tensor& b, const Shape& out_shape) {
  Tensor out = empty(out_shape, a.options());
  kernels::gemm(a.device(), a, b, out, 1.0, 0.0);
  if (autograd::needs_grad({&a, &b})) {
    // Each operand is only needed for the other one's gradient.
    SavedTensor saved_a = b.requires_grad() ? SavedTensor::input(a) : SavedTensor();
    SavedTensor saved_b = a.requires_grad() ? SavedTensor::input(b) : SavedTensor();
    autograd::record(backward_name, {&a, &b}, {&out},
                     [saved_a, saved_b, backward_name, a_transposed = transposed_layout(a),
                      b_transposed = transposed_layout(b)](const GradContext& c) -> TensorList {
                       const Tensor& g = c.grad();
                       Tensor ga, gb;
                       if (c.needs(0))
                         ga = product_in_layout(a_transposed, g, swap_last(saved_b.unpack(backward_name)));
                       if (c.needs(1))
                         gb = product_in_layout(b_transposed, swap_last(saved_a.unpack(backward_name)), g);
                       return {ga, gb};
                     });
  }
  return out;
}

}  // namespace

Tensor mm(const Tensor& a_in, const Tensor& b_in) {
  const Tensor a = amp::cast_lower(a_in), b = amp::cast_lower(b_in);  // autograd/autocast.h
  check_operands("mm", a, b);
  detail::check_dim("mm", a, 2, "a");
  detail::check_dim("mm", b, 2, "b");
  check_inner("mm", a, b, a.size(1), b.size(0));
  return matrix_product("MmBackward", a, b, {a.size(0), b.size(1)});
}

Tensor bmm(const Tensor& a_in, const Tensor& b_in) {
  const Tensor a = amp::cast_lower(a_in), b = amp::cast_lower(b_in);
  check_operands("bmm", a, b);
  detail::check_dim("bmm", a, 3, "a");
  detail::check_dim("bmm", b, 3, "b");
  MN_CHECK(a.size(0) == b.size(0), ValueError, "bmm: batch sizes of shapes ", a.sizes(), " and ", b.sizes(),
           " differ (", a.size(0), " != ", b.size(0), ")");
  check_inner("bmm", a, b, a.size(2), b.size(1));
  return matrix_product("BmmBackward", a, b, {a.size(0), a.size(1), b.size(2)});
}

Tensor matmul(const Tensor& a_in, const Tensor& b_in) {
  const Tensor a = amp::cast_lower(a_in), b = amp::cast_lower(b_in);
  check_operands("matmul", a, b);
  MN_CHECK(a.dim() >= 1 && b.dim() >= 1, ValueError, "matmul: both arguments need at least 1 dimension, got shapes ",
           a.sizes(), " and ", b.sizes());
  const int64_t ka = a.size(-1), kb = b.dim() == 1 ? b.size(0) : b.size(-2);
  check_inner("matmul", a, b, ka, kb);

  if (a.dim() <= 2 && b.dim() <= 2) {
    if (a.dim() == 2 && b.dim() == 2) return mm(a, b);
    if (a.dim() == 2) return squeeze(mm(a, unsqueeze(b, 1)), 1);
    if (b.dim() == 2) return squeeze(mm(unsqueeze(a, 0), b), 0);
    return squeeze(squeeze(mm(unsqueeze(a, 0), unsqueeze(b, 1)), 1), 0);  // dot product, 0-D
  }

  // At least one operand is batched. Vectors become [1, K] / [K, 1] matrices, dropped again at the end.
  const Tensor lhs = a.dim() == 1 ? unsqueeze(a, 0) : a;
  const Tensor rhs = b.dim() == 1 ? unsqueeze(b, 1) : b;
  const int64_t m = lhs.size(-2), n = rhs.size(-1), k = ka;
  Tensor out;
  if (rhs.dim() == 2) {
    // [.., M, K] @ [K, N]: the batch folds into the rows of one big product.
    Shape out_shape(lhs.sizes().begin(), lhs.sizes().end() - 1);
    out_shape.push_back(n);
    out = reshape(mm(reshape(lhs, {-1, k}), rhs), out_shape);
  } else {
    const Shape batch_a(lhs.sizes().begin(), lhs.sizes().end() - 2);
    const Shape batch_b(rhs.sizes().begin(), rhs.sizes().end() - 2);
    Shape batch;
    try {
      batch = broadcast_shapes(batch_a, batch_b);
    } catch (const ValueError&) {
      throw ValueError(str("matmul: batch dimensions ", batch_a, " and ", batch_b, " of shapes ", a.sizes(), " and ",
                           b.sizes(), " cannot be broadcast"));
    }
    const int64_t count = batch.numel();
    Shape lhs_shape = batch, rhs_shape = batch, out_shape = batch;
    lhs_shape.push_back(m), lhs_shape.push_back(k);
    rhs_shape.push_back(k), rhs_shape.push_back(n);
    out_shape.push_back(m), out_shape.push_back(n);
    // A broadcast operand stays a zero-stride view; the gemm kernel reads it without copying.
    const Tensor lhs3 = reshape(expand(lhs, lhs_shape), {count, m, k});
    const Tensor rhs3 = reshape(expand(rhs, rhs_shape), {count, k, n});
    out = reshape(bmm(lhs3, rhs3), out_shape);
  }
  if (a.dim() == 1) out = squeeze(out, -2);
  if (b.dim() == 1) out = squeeze(out, -1);
  return out;
}

}  // namespace mn
