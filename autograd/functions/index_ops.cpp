// Indexing and scanning ops with PyTorch's names: gather / scatter_add / masked_fill, full-tensor
// argmax / argmin, amax / amin over several dims, cumsum and topk. Every backward is written with
// differentiable ops (gather and scatter_add are each other's gradient, cumsum's is a cumsum from the
// end), so double backward works.
#include "autograd/functions/common.h"

namespace mn {

using autograd::GradContext;
using autograd::OutputContext;
using autograd::SavedTensor;
using autograd::TensorList;

namespace {


void check_index(const char* op, const Tensor& x, const Tensor& index) {
  detail::check_defined(op, x, "input");
  detail::check_defined(op, index, "index");
  MN_CHECK(index.dtype() == DType::i64, TypeError, op, ": expected an i64 index, got ", index.dtype());
  detail::check_same_device(op, x, index);
  MN_CHECK(index.dim() == x.dim(), ValueError, op, ": index of shape ", index.sizes(),
           " must have as many dims as the input of shape ", x.sizes());
}

// t grown to `shape` (every dim at least t's) by zeros after its end in each dim; differentiable.
Tensor pad_end_to(Tensor t, const Shape& shape) {
  for (int d = 0; d < t.dim(); ++d) {
    if (t.size(d) == shape[d]) continue;
    Shape part = t.sizes();
    part[d] = shape[d] - t.size(d);
    t = cat({t, zeros(part, t.options())}, d);
  }
  return t;
}

Tensor scatter_add_impl(const Tensor& x, int d, const Tensor& index, const Tensor& src);

Tensor gather_impl(const Tensor& x, int d, const Tensor& index) {
  Tensor out = empty(index.sizes(), x.options());
  kernels::gather(x.device(), x, d, index, out);
  if (autograd::needs_grad({&x}))
    autograd::record("GatherBackward", {&x}, {&out},
                     [in = x.sizes(), d, si = SavedTensor::input(index)](const GradContext& c) -> TensorList {
                       return {scatter_add_impl(zeros(in, c.grad().options()), d, si.unpack(), c.grad())};
                     });
  return out;
}

Tensor scatter_add_impl(const Tensor& x, int d, const Tensor& index, const Tensor& src) {
  Tensor out = empty(x.sizes(), x.options());
  kernels::copy(x.device(), x, out);
  kernels::scatter_add(x.device(), out, d, index, src);
  if (autograd::needs_grad({&x, &src}))
    autograd::record("ScatterAddBackward", {&x, &src}, {&out},
                     [d, si = SavedTensor::input(index), src_shape = src.sizes()](const GradContext& c) -> TensorList {
                       // src entries beyond the index's extent were not added: their gradient is 0.
                       Tensor g_src;
                       if (c.needs(1)) g_src = pad_end_to(gather_impl(c.grad(), d, si.unpack()), src_shape);
                       return {c.needs(0) ? c.grad() : Tensor(), g_src};
                     });
  return out;
}

// 0-d input and index act as one-element vectors (as in PyTorch).
template <class F>
Tensor along_vectors(const Tensor& x, const Tensor& index, F&& f) {
  if (x.dim() == 0) return reshape(f(reshape(x, {1}), reshape(index, {1})), {});
  return f(x, index);
}

}  // namespace

Tensor gather(const Tensor& x, int64_t dim, const Tensor& index) {
  check_index("gather", x, index);
  const int d = wrap_dim(dim, std::max(x.dim(), 1));
  return along_vectors(x, index, [&](const Tensor& xv, const Tensor& iv) { return gather_impl(xv, d, iv); });
}

Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) {
  check_index("scatter_add", x, index);
  detail::check_defined("scatter_add", src, "src");
  detail::check_same_device("scatter_add", x, src);
  detail::check_same_dtype("scatter_add", x, src);
  MN_CHECK(src.dim() == x.dim(), ValueError, "scatter_add: src of shape ", src.sizes(),
           " must have as many dims as the input of shape ", x.sizes());
  const int d = wrap_dim(dim, std::max(x.dim(), 1));
  if (x.dim() == 0) return reshape(scatter_add_impl(reshape(x, {1}), 0, reshape(index, {1}), reshape(src, {1})), {});
  return scatter_add_impl(x, d, index, src);
}

Tensor masked_fill(const Tensor& x, const Tensor& mask, double value) {
  detail::check_defined("masked_fill", x, "input");
  detail::check_defined("masked_fill", mask, "mask");
  detail::check_same_device("masked_fill", x, mask);
  // Comparison ops give f32 0/1 masks; an i64 mask selects where it is non-zero.
  const Tensor cond = mask.dtype() == DType::i64 ? ne(mask, 0.0) : mask;
  return where(cond, full({}, value, x.options()), x);
}

// ---------------- argmax / argmin over all elements ----------------

Tensor argmax(const Tensor& x) {
  detail::check_defined("argmax", x, "input");
  MN_CHECK(x.numel() > 0, ValueError, "argmax: cannot take the argmax of an empty tensor of shape ", x.sizes());
  return argmax(x.detach().reshape({-1}), 0, false);
}

Tensor argmin(const Tensor& x) {
  detail::check_defined("argmin", x, "input");
  MN_CHECK(x.numel() > 0, ValueError, "argmin: cannot take the argmin of an empty tensor of shape ", x.sizes());
  return argmin(x.detach().reshape({-1}), 0, false);
}

// ---------------- amax / amin ----------------

namespace {

Tensor extreme_over(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim, bool is_max) {
  const char* name = is_max ? "amax" : "amin";
  detail::check_defined(name, x, "input");
  const uint32_t mask = detail::dim_mask(dims, x.dim());
  for (int d = 0; d < x.dim(); ++d)
    MN_CHECK(!(mask & (1u << d)) || x.size(d) > 0, ValueError, name, ": cannot reduce dimension ", d,
             " of size 0 (input shape ", x.sizes(), "; there is no identity for ", name, ")");
  Tensor kept = empty(detail::reduced_shape(x.sizes(), mask, true), x.options());
  kernels::reduce(x.device(), is_max ? kernels::ReduceOp::Max : kernels::ReduceOp::Min, x, mask, kept, 0.0);
  const Shape out_shape = detail::reduced_shape(x.sizes(), mask, keepdim);
  Tensor out = keepdim ? kept : detail::raw_view(kept, out_shape, contiguous_strides(out_shape), kept.storage_offset());
  if (autograd::needs_grad({&x}))
    autograd::record(
        is_max ? "AmaxBackward" : "AminBackward", {&x}, {&out},
        [sx = SavedTensor::input(x), mask, kept_shape = kept.sizes()](const OutputContext& c) -> TensorList {
          // The gradient is split evenly among the tied extremes of each slice, as PyTorch: g / count
          // * winners (a NaN result has no winner, so its slice gets NaN, as in PyTorch).
          const Tensor x = sx.unpack();
          std::vector<int64_t> reduce_dims;
          for (int d = 0; d < x.dim(); ++d)
            if (mask & (1u << d)) reduce_dims.push_back(d);
          const Tensor winners = eq(x, reshape(c.output(), kept_shape));
          const Tensor count = reduce_dims.empty() ? winners : sum(winners, reduce_dims, true);
          return {mul(div(reshape(c.grad(), kept_shape), count), winners)};
        },
        /*save_outputs=*/true);
  return out;
}

}  // namespace

Tensor amax(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return extreme_over(x, dims, keepdim, true);
}
Tensor amin(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return extreme_over(x, dims, keepdim, false);
}

// ---------------- cumsum ----------------

namespace {

Tensor cumsum_impl(const Tensor& x, int d, bool reverse) {
  Tensor out = empty(x.sizes(), x.options());
  kernels::cumsum(x.device(), x, d, reverse, out);
  if (autograd::needs_grad({&x}))
    autograd::record(reverse ? "ReverseCumsumBackward" : "CumsumBackward", {&x}, {&out},
                     [d, reverse](const GradContext& c) -> TensorList {
                       // out_i = sum_{j <= i} x_j, so dx_j = sum_{i >= j} g_i: the sum from the other end.
                       return {cumsum_impl(c.grad(), d, !reverse)};
                     });
  return out;
}

}  // namespace

Tensor cumsum(const Tensor& x, int64_t dim) {
  detail::check_defined("cumsum", x, "input");
  return cumsum_impl(x, wrap_dim(dim, std::max(x.dim(), 1)), false);
}

// ---------------- topk ----------------

std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k, int64_t dim, bool largest, bool sorted) {
  (void)sorted;  // the entries always come in order, which also satisfies sorted == false
  detail::check_defined("topk", x, "input");
  const int d = wrap_dim(dim, std::max(x.dim(), 1));
  const int64_t n = x.dim() == 0 ? 1 : x.size(d);
  MN_CHECK(k >= 0 && k <= n, IndexError, "topk: k = ", k, " is out of range for dimension ", dim, " of size ", n,
           " (input shape ", x.sizes(), ")");
  Shape shape = x.sizes();
  if (x.dim() > 0) shape[d] = k;
  Tensor values = empty(shape, x.options());
  Tensor indices = empty(shape, TensorOptions(DType::i64).with_device(x.device()));
  kernels::topk(x.device(), x, d, k, largest, values, indices);
  if (autograd::needs_grad({&x}))
    autograd::record("TopkBackward", {&x}, {&values},
                     [in = x.sizes(), d, si = SavedTensor::input(indices)](const GradContext& c) -> TensorList {
                       return {scatter_add(zeros(in, c.grad().options()), d, si.unpack(), c.grad())};
                     });
  return {values, indices};
}

}  // namespace mn
