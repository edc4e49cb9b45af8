// layer_norm and group_norm: both normalise rows of a contiguous view of x with their own mean and
// biased variance (the row_norm kernels, RowNormLayout in kernels/kernels.h) and apply an optional
// affine weight and bias: layer norm per element of the normalised shape, group norm per channel.
//
// The first-order backward is the fused kernel (grad_x, grad_weight and grad_bias in one call, from
// the saved mean and rstd); when the backward itself is recorded (create_graph), the same formulas are
// written with differentiable ops over the [N, groups, L] view so double backward works.
#include <vector>

#include "autograd/autocast.h"
#include "autograd/functions/common.h"
#include "nn/functional.h"

namespace mn::nn::functional {

using autograd::GradContext;
using autograd::SavedTensor;
using autograd::TensorList;
using kernels::RowNormLayout;

namespace {


void check_affine(const char* op, const Tensor& t, const char* name, const Tensor& x, const Shape& expected) {
  if (!t.defined()) return;
  detail::check_float(op, t, name);
  detail::check_same_device(op, x, t);
  MN_CHECK(t.sizes() == expected, ValueError, op, ": expected ", name, " of shape ", expected, ", got ", t.sizes());
}

// A [G, L] tensor (t of shape [N, G, L] summed over N) reduced to one value per channel, shaped `shape`.
Tensor per_channel(const Tensor& t, const RowNormLayout& s, const Shape& shape) {
  if (s.inner == 1) return reshape(t, shape);
  return reshape(sum(reshape(t, {s.groups, s.row_len / s.inner, s.inner}), 2), shape);
}

// The affine vector (C entries) laid out as the [G, L] positions of a row group.
Tensor per_position(const Tensor& v, const RowNormLayout& s) {
  const int64_t per_group = s.row_len / s.inner;
  if (s.inner == 1) return reshape(v, {s.groups, s.row_len});
  return reshape(expand(reshape(v, {s.groups, per_group, 1}), {s.groups, per_group, s.inner}),
                 {s.groups, s.row_len});
}

// The backward written with differentiable ops (used when it is itself being recorded).
TensorList recorded_backward(const GradContext& c, const Tensor& g, const Tensor& x, const Tensor& weight,
                             const Shape& bias_shape, const RowNormLayout& s, double eps) {
  const Shape rows{s.rows / s.groups, s.groups, s.row_len};
  const Tensor xr = reshape(x, rows), gr = reshape(g, rows);
  const Tensor centered = sub(xr, mean(xr, 2, true));
  const Tensor rstd = rsqrt(add(mean(mul(centered, centered), 2, true), eps));
  const Tensor x_hat = mul(centered, rstd);
  Tensor gx, gw, gb;
  if (c.needs(0)) {
    const Tensor dy = weight.defined() ? mul(gr, per_position(weight, s)) : gr;
    const Tensor inner = sub(sub(dy, mean(dy, 2, true)), mul(x_hat, mean(mul(dy, x_hat), 2, true)));
    gx = reshape(mul(rstd, inner), x.sizes());
  }
  if (c.needs(1)) gw = per_channel(sum(mul(gr, x_hat), 0), s, weight.sizes());
  if (c.needs(2)) gb = per_channel(sum(gr, 0), s, bias_shape);
  return {gx, gw, gb};
}

// Runs the row_norm kernels on x with `layout` and records the backward.
Tensor row_norm(const char* node, const Tensor& x, const Tensor& weight, const Tensor& bias, const RowNormLayout& s,
                double eps) {
  Tensor out = empty(x.sizes(), x.options());
  Tensor save_mean = empty({s.rows}, x.options());
  Tensor save_rstd = empty({s.rows}, x.options());
  kernels::row_norm_forward(x.device(), x, weight, bias, s, eps, out, save_mean, save_rstd);
  const Shape bias_shape = bias.defined() ? bias.sizes() : Shape{};
  if (autograd::needs_grad({&x, &weight, &bias}))
    autograd::record(
        node, {&x, &weight, &bias}, {&out},
        [sx = SavedTensor::input(x), sw = SavedTensor::input(weight), bias_shape, save_mean, save_rstd, s, eps,
         node](const GradContext& c) -> TensorList {
          const Tensor x = sx.unpack(node), weight = sw.unpack(node);
          const Tensor& g = c.grad();
          if (autograd::grad_mode_enabled()) return recorded_backward(c, g, x, weight, bias_shape, s, eps);
          Tensor gx = c.needs(0) ? empty(x.sizes(), x.options()) : Tensor();
          Tensor gw = c.needs(1) ? empty(weight.sizes(), x.options()) : Tensor();
          Tensor gb = c.needs(2) ? empty(bias_shape, x.options()) : Tensor();
          kernels::row_norm_backward(x.device(), g, x, weight, save_mean, save_rstd, s, gx, gw, gb);
          return {gx, gw, gb};
        });
  return out;
}

void check_input(const char* op, const Tensor& x, double eps) {
  detail::check_defined(op, x, "input");
  detail::check_float(op, x, "input");
  MN_CHECK(eps >= 0, ValueError, op, ": expected eps >= 0, got ", eps);
}

}  // namespace

Tensor layer_norm(const Tensor& x_in, const std::vector<int64_t>& normalized_shape, const Tensor& weight_in,
                  const Tensor& bias_in, double eps) {
  // an f32 op under autocast (autograd/autocast.h)
  const Tensor x = amp::cast_f32(x_in), weight = amp::cast_f32(weight_in), bias = amp::cast_f32(bias_in);
  check_input("layer_norm", x, eps);
  const Shape norm_shape(normalized_shape);
  const int k = norm_shape.size();
  MN_CHECK(k >= 1, ValueError, "layer_norm: expected normalized_shape with at least 1 dim, got ", norm_shape);
  bool fits = x.dim() >= k;
  for (int d = 0; fits && d < k; ++d) fits = x.size(x.dim() - k + d) == norm_shape[d];
  MN_CHECK(fits, ValueError, "layer_norm: given normalized_shape ", norm_shape,
           ", expected input whose last dims are ", norm_shape, ", got input of shape ", x.sizes());
  MN_CHECK(norm_shape.numel() > 0, ValueError, "layer_norm: expected a non-empty normalized_shape, got ", norm_shape);
  check_affine("layer_norm", weight, "weight", x, norm_shape);
  check_affine("layer_norm", bias, "bias", x, norm_shape);
  RowNormLayout s;
  s.row_len = norm_shape.numel();
  s.rows = x.numel() / s.row_len;
  return row_norm("LayerNormBackward", x, weight, bias, s, eps);
}

Tensor group_norm(const Tensor& x_in, int64_t num_groups, const Tensor& weight_in, const Tensor& bias_in, double eps) {
  // an f32 op under autocast (autograd/autocast.h)
  const Tensor x = amp::cast_f32(x_in), weight = amp::cast_f32(weight_in), bias = amp::cast_f32(bias_in);
  check_input("group_norm", x, eps);
  MN_CHECK(x.dim() >= 2, ValueError, "group_norm: expected input of shape [N, C, *], got ", x.sizes());
  const int64_t channels = x.size(1);
  MN_CHECK(num_groups > 0, ValueError, "group_norm: expected num_groups > 0, got ", num_groups);
  MN_CHECK(channels % num_groups == 0, ValueError, "group_norm: expected the number of channels (", channels,
           ") to be divisible by num_groups (", num_groups, "), got input of shape ", x.sizes());
  check_affine("group_norm", weight, "weight", x, Shape{channels});
  check_affine("group_norm", bias, "bias", x, Shape{channels});
  RowNormLayout s;
  s.groups = num_groups;
  s.inner = 1;
  for (int d = 2; d < x.dim(); ++d) s.inner *= x.size(d);
  MN_CHECK(s.inner > 0, ValueError, "group_norm: expected non-empty spatial dims, got input of shape ", x.sizes());
  s.row_len = channels / num_groups * s.inner;
  s.rows = x.size(0) * num_groups;
  return row_norm("GroupNormBackward", x, weight, bias, s, eps);
}

}  // namespace mn::nn::functional
