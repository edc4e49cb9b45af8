// Reductions and their backward formulas. Forward runs the reduce kernels (which always produce the
// keepdim shape, contiguous; dropping the reduced dims is then a free view). Every backward is written
// with differentiable ops, so double backward works: a gradient of the reduced shape is reshaped back
// to the keepdim shape and broadcast over the input.
#include <cmath>

#include "autograd/functions/common.h"

namespace mn {

using autograd::GradContext;
using autograd::OutputContext;
using autograd::SavedTensor;
using autograd::TensorList;
using kernels::ReduceOp;

namespace {


Tensor reduce_keepdim(ReduceOp op, const Tensor& x, uint32_t mask, double param = 0.0) {
  Tensor out = empty(detail::reduced_shape(x.sizes(), mask, true), x.options());
  kernels::reduce(x.device(), op, x, mask, out, param);
  return out;
}

// The contiguous keepdim result seen without its reduced dims (no copy, no history).
Tensor drop_reduced(const Tensor& kept, const Shape& in_shape, uint32_t mask, bool keepdim) {
  if (keepdim) return kept;
  const Shape shape = detail::reduced_shape(in_shape, mask, false);
  return detail::raw_view(kept, shape, contiguous_strides(shape), kept.storage_offset());
}

// A tensor of the reduced shape back in the keepdim shape (differentiable). Unsqueezing is always a
// view, also for 0-d tensors.
Tensor keepdim_form(const Tensor& t, const Shape& in_shape, uint32_t mask, bool keepdim) {
  if (keepdim) return t;
  Tensor out = t;
  for (int d = 0; d < in_shape.size(); ++d)
    if (mask & (1u << d)) out = unsqueeze(out, d);
  return out;
}

// A gradient of the reduced shape broadcast over the input shape (differentiable).
Tensor broadcast_grad(const Tensor& g, const Shape& in_shape, uint32_t mask, bool keepdim) {
  return expand(keepdim_form(g, in_shape, mask, keepdim), in_shape);
}

std::vector<int64_t> dims_of(uint32_t mask, int ndim) {
  std::vector<int64_t> dims;
  for (int d = 0; d < ndim; ++d)
    if (mask & (1u << d)) dims.push_back(d);
  return dims;
}

int64_t reduced_count(const Shape& shape, uint32_t mask) {
  int64_t n = 1;
  for (int d = 0; d < shape.size(); ++d)
    if (mask & (1u << d)) n *= shape[d];
  return n;
}

void check_reducible(const char* op, const Tensor& x, bool float_only) {
  detail::check_defined(op, x, "x");
  if (float_only) detail::check_float(op, x, "x");
}

// [1, .., n, .., 1] holding 0..n-1 along dim: compared with indices it selects one element per slice.
Tensor positions_along(int dim, const Shape& in_shape, Device device) {
  Shape shape = Shape::filled(in_shape.size(), 1);
  shape[dim] = in_shape[dim];
  return arange(in_shape[dim], TensorOptions(DType::i64).with_device(device)).reshape(shape);
}

}  // namespace

// ---------------- sum / mean / prod ----------------

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  check_reducible("sum", x, false);
  const uint32_t mask = detail::dim_mask(dims, x.dim());
  Tensor out = drop_reduced(reduce_keepdim(ReduceOp::Sum, x, mask), x.sizes(), mask, keepdim);
  if (autograd::needs_grad({&x}))
    autograd::record("SumBackward", {&x}, {&out},
                     [in = x.sizes(), mask, keepdim](const GradContext& c) -> TensorList {
                       return {broadcast_grad(c.grad(), in, mask, keepdim)};
                     });
  return out;
}

Tensor sum(const Tensor& x) { return sum(x, {}, false); }

Tensor mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  check_reducible("mean", x, true);
  const uint32_t mask = detail::dim_mask(dims, x.dim());
  Tensor out = drop_reduced(reduce_keepdim(ReduceOp::Mean, x, mask), x.sizes(), mask, keepdim);
  if (autograd::needs_grad({&x}))
    autograd::record("MeanBackward", {&x}, {&out},
                     [in = x.sizes(), mask, keepdim](const GradContext& c) -> TensorList {
                       const double n = static_cast<double>(reduced_count(in, mask));
                       return {div(broadcast_grad(c.grad(), in, mask, keepdim), n)};
                     });
  return out;
}

Tensor mean(const Tensor& x) { return mean(x, {}, false); }

Tensor prod(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  check_reducible("prod", x, false);
  const uint32_t mask = detail::dim_mask(dims, x.dim());
  Tensor out = drop_reduced(reduce_keepdim(ReduceOp::Prod, x, mask), x.sizes(), mask, keepdim);
  if (autograd::needs_grad({&x}))
    autograd::record(
        "ProdBackward", {&x}, {&out},
        [sx = SavedTensor::input(x), mask, keepdim](const OutputContext& c) -> TensorList {
          // d prod / d x_i = product of the others: prod / x_i where x_i != 0; where x_i is the slice's
          // only zero it is the product of the non-zero elements; with two or more zeros it is 0.
          Tensor x = sx.unpack("ProdBackward");
          const std::vector<int64_t> dims = dims_of(mask, x.dim());
          Tensor is_zero = eq(x, 0.0);
          Tensor x_safe = where(is_zero, ones({}, x.options()), x);
          Tensor product = keepdim_form(c.output(), x.sizes(), mask, keepdim);
          Tensor nonzero_product = dims.empty() ? x_safe : prod(x_safe, dims, true);
          Tensor lone_zero = eq(dims.empty() ? is_zero : sum(is_zero, dims, true), 1.0);
          Tensor zero = zeros({}, x.options());
          Tensor others = where(is_zero, where(lone_zero, nonzero_product, zero), div(product, x_safe));
          return {mul(broadcast_grad(c.grad(), x.sizes(), mask, keepdim), others)};
        },
        /*save_outputs=*/true);
  return out;
}

// ---------------- max / min ----------------

namespace {

Tensor extreme_all(const Tensor& x, bool is_max) {
  const char* name = is_max ? "max" : "min";
  check_reducible(name, x, false);
  MN_CHECK(x.numel() > 0, ValueError, name, ": cannot reduce an empty tensor of shape ", x.sizes(),
           " (there is no identity for ", name, ")");
  const uint32_t mask = detail::dim_mask({}, x.dim());
  Tensor out =
      drop_reduced(reduce_keepdim(is_max ? ReduceOp::Max : ReduceOp::Min, x, mask), x.sizes(), mask, false);
  if (autograd::needs_grad({&x}))
    autograd::record(
        is_max ? "MaxBackward" : "MinBackward", {&x}, {&out},
        [sx = SavedTensor::input(x)](const OutputContext& c) -> TensorList {
          // Ties share the gradient evenly; a NaN result is shared by the NaN elements (as PyTorch).
          Tensor x = sx.unpack();
          const Tensor y = c.output();
          Tensor winners = add(eq(x, y), mul(ne(x, x), ne(y, y)));
          return {mul(div(winners, sum(winners)), c.grad())};
        },
        /*save_outputs=*/true);
  return out;
}

std::pair<Tensor, Tensor> extreme_along(const Tensor& x, int64_t dim, bool keepdim, bool is_max) {
  const char* name = is_max ? "max" : "min";
  check_reducible(name, x, false);
  if (x.dim() == 0) {
    wrap_dim(dim, 0);
    return extreme_along(reshape(x, {1}), 0, keepdim, is_max);
  }
  const int d = wrap_dim(dim, x.dim());
  MN_CHECK(x.sizes()[d] > 0, ValueError, name, ": cannot reduce dimension ", dim, " of size 0 (input shape ",
           x.sizes(), ")");
  const uint32_t mask = 1u << d;
  const Shape kept_shape = detail::reduced_shape(x.sizes(), mask, true);
  Tensor values = empty(kept_shape, x.options());
  Tensor indices = empty(kept_shape, TensorOptions(DType::i64).with_device(x.device()));
  kernels::arg_reduce(x.device(), is_max ? ReduceOp::Max : ReduceOp::Min, x, d, values, indices);
  values = drop_reduced(values, x.sizes(), mask, keepdim);
  indices = drop_reduced(indices, x.sizes(), mask, keepdim);
  if (autograd::needs_grad({&x}))
    autograd::record(is_max ? "MaxDimBackward" : "MinDimBackward", {&x}, {&values},
                     [in = x.sizes(), si = SavedTensor::input(indices), d, mask,
                      keepdim](const GradContext& c) -> TensorList {
                       // The gradient goes to the selected element of each slice: a one-hot mask
                       // along d, built by comparing positions with the saved indices.
                       Tensor idx = keepdim_form(si.unpack(), in, mask, keepdim);
                       Tensor selected = eq(positions_along(d, in, idx.device()), idx);
                       return {mul(selected, keepdim_form(c.grad(), in, mask, keepdim))};
                     });
  return {values, indices};
}

Tensor arg_extreme(const Tensor& x, int64_t dim, bool keepdim, bool is_max) {
  autograd::NoGradGuard no_grad;
  return extreme_along(x.detach(), dim, keepdim, is_max).second;
}

}  // namespace

Tensor max(const Tensor& x) { return extreme_all(x, true); }
Tensor min(const Tensor& x) { return extreme_all(x, false); }
std::pair<Tensor, Tensor> max(const Tensor& x, int64_t dim, bool keepdim) {
  return extreme_along(x, dim, keepdim, true);
}
std::pair<Tensor, Tensor> min(const Tensor& x, int64_t dim, bool keepdim) {
  return extreme_along(x, dim, keepdim, false);
}
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim) { return arg_extreme(x, dim, keepdim, true); }
Tensor argmin(const Tensor& x, int64_t dim, bool keepdim) { return arg_extreme(x, dim, keepdim, false); }

// ---------------- var / std / norm ----------------

Tensor var(const Tensor& x, const std::vector<int64_t>& dims, double correction, bool keepdim) {
  check_reducible("var", x, true);
  MN_CHECK(correction >= 0, ValueError, "var: correction must be non-negative, got ", correction);
  const uint32_t mask = detail::dim_mask(dims, x.dim());
  Tensor kept = empty(detail::reduced_shape(x.sizes(), mask, true), x.options());
  kernels::var(x.device(), x, mask, correction, kept);
  Tensor out = drop_reduced(kept, x.sizes(), mask, keepdim);
  if (autograd::needs_grad({&x}))
    autograd::record(
        "VarBackward", {&x}, {&out},
        [sx = SavedTensor::input(x), mask, keepdim, correction](const GradContext& c) -> TensorList {
          // d var / d x_i = 2 (x_i - mean) / (n - correction)
          Tensor x = sx.unpack("VarBackward");
          const double n = static_cast<double>(reduced_count(x.sizes(), mask));
          const std::vector<int64_t> dims = dims_of(mask, x.dim());
          Tensor centered = dims.empty() ? zeros_like(x) : sub(x, mean(x, dims, true));
          Tensor g = broadcast_grad(c.grad(), x.sizes(), mask, keepdim);
          return {mul(mul(centered, g), 2.0 / std::max(0.0, n - correction))};
        });
  return out;
}

Tensor std_dev(const Tensor& x, const std::vector<int64_t>& dims, double correction, bool keepdim) {
  return sqrt(var(x, dims, correction, keepdim));
}
Tensor var(const Tensor& x) { return var(x, {}, 1.0, false); }
Tensor std_dev(const Tensor& x) { return std_dev(x, {}, 1.0, false); }

Tensor norm(const Tensor& x, double p, const std::vector<int64_t>& dims, bool keepdim) {
  check_reducible("norm", x, true);
  MN_CHECK(p >= 0 || std::isinf(p), ValueError, "norm: p must be non-negative or infinite, got ", p);
  const uint32_t mask = detail::dim_mask(dims, x.dim());
  Tensor out = drop_reduced(reduce_keepdim(ReduceOp::Norm, x, mask, p), x.sizes(), mask, keepdim);
  if (autograd::needs_grad({&x}))
    autograd::record(
        "NormBackward", {&x}, {&out},
        [sx = SavedTensor::input(x), p, mask, keepdim](const OutputContext& c) -> TensorList {
          Tensor x = sx.unpack("NormBackward");
          Tensor g = broadcast_grad(c.grad(), x.sizes(), mask, keepdim);
          if (p == 0.0) return {zeros_like(x)};
          if (p == 1.0) return {mul(g, sign(x))};
          Tensor total = keepdim_form(c.output(), x.sizes(), mask, keepdim);
          if (std::isinf(p)) {
            // Shared evenly among the elements that attain the extreme magnitude.
            Tensor winners = eq(abs(x), total);
            const std::vector<int64_t> dims = dims_of(mask, x.dim());
            Tensor count = dims.empty() ? winners : sum(winners, dims, true);
            return {mul(g, div(mul(sign(x), winners), count))};
          }
          // d ||x||_p / d x_i = sign(x_i) |x_i|^(p-1) / ||x||^(p-1), taken as 0 where the norm is 0.
          Tensor safe_total = where(eq(total, 0.0), ones({}, x.options()), total);
          if (p == 2.0) return {mul(g, div(x, safe_total))};
          return {mul(g, div(mul(sign(x), pow(abs(x), p - 1.0)), pow(safe_total, p - 1.0)))};
        },
        /*save_outputs=*/true);
  return out;
}

Tensor logsumexp(const Tensor& x, int64_t dim, bool keepdim) {
  check_reducible("logsumexp", x, true);
  const int d = wrap_dim(dim, x.dim());
  const uint32_t mask = x.dim() == 0 ? 0u : 1u << d;
  Tensor out;
  {
    autograd::NoGradGuard no_grad;
    const Tensor input = x.detach();
    // Subtract the max for stability; an infinite max (all -inf, or a +inf) is replaced by 0 so the
    // result is -inf / +inf instead of NaN.
    Tensor peak = reduce_keepdim(ReduceOp::Max, input, mask);
    peak = where(eq(abs(peak), INFINITY), zeros({}, x.options()), peak);
    Tensor kept = add(log(sum(exp(sub(input, peak)), dims_of(mask, x.dim()), true)), peak);
    out = drop_reduced(kept, x.sizes(), mask, keepdim);
  }
  if (autograd::needs_grad({&x}))
    autograd::record("LogSumExpBackward", {&x}, {&out},
                     [sx = SavedTensor::input(x), d, mask, keepdim](const GradContext& c) -> TensorList {
                       Tensor x = sx.unpack("LogSumExpBackward");
                       Tensor g = broadcast_grad(c.grad(), x.sizes(), mask, keepdim);
                       return {mul(g, softmax(x, d))};
                     });
  return out;
}

// ---------------- sum_to ----------------

Tensor sum_to(const Tensor& x, const Shape& shape) {
  if (x.sizes() == shape) return x;
  const int lead = x.dim() - shape.size();
  MN_CHECK(lead >= 0, ValueError, "sum_to: cannot sum shape ", x.sizes(), " down to the larger rank shape ",
           shape);
  std::vector<int64_t> dims;
  for (int i = 0; i < x.dim(); ++i) {
    const int64_t have = x.sizes()[i];
    if (i < lead) {
      if (have != 1) dims.push_back(i);
      continue;
    }
    const int64_t want = shape[i - lead];
    MN_CHECK(want == have || want == 1, ValueError, "sum_to: shape ", x.sizes(), " cannot be summed down to ",
             shape, " (dimension ", i, ": ", have, " vs ", want, ")");
    if (want == 1 && have != 1) dims.push_back(i);
  }
  Tensor reduced = dims.empty() ? x : sum(x, dims, true);
  return reduced.sizes() == shape ? reduced : reshape(reduced, shape);
}

}  // namespace mn
