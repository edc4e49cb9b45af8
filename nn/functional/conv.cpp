// conv2d (NCHW; stride, padding, dilation, groups) over the im2col + GEMM kernels.
//
// Convolution is bilinear in (x, W), and its two backward maps are the adjoints of the forward:
//   <conv(x, W), g> = <x, input_grad(g, W)> = <W, weight_grad(g, x)>.
// So each of the three is recorded as a differentiable op whose gradients are the other two, and
// double backward (and higher) works through conv2d.
#include "autograd/autocast.h"
#include "autograd/functions/common.h"
#include "nn/functional.h"

namespace mn::nn::functional {

using autograd::GradContext;
using autograd::SavedTensor;
using autograd::TensorList;
using kernels::Conv2dParams;

namespace {


Shape conv_output_shape(const Shape& x, const Shape& w, const Conv2dParams& p) {
  const int64_t numer_h = x[2] + 2 * p.pad_h - p.dilation_h * (w[2] - 1) - 1;
  const int64_t numer_w = x[3] + 2 * p.pad_w - p.dilation_w * (w[3] - 1) - 1;
  MN_CHECK(numer_h >= 0 && numer_w >= 0, ValueError, "conv2d: input of shape ", x, " (padded by [", p.pad_h, ", ",
           p.pad_w, "]) is smaller than the dilated kernel of weight shape ", w, " (dilation [", p.dilation_h, ", ",
           p.dilation_w, "])");
  return {x[0], w[0], numer_h / p.stride_h + 1, numer_w / p.stride_w + 1};
}

Tensor conv_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Conv2dParams& p);
Tensor conv_input_grad(const Tensor& g, const Tensor& w, const Shape& x_shape, const Conv2dParams& p);
Tensor conv_weight_grad(const Tensor& g, const Tensor& x, const Shape& w_shape, const Conv2dParams& p);

Tensor conv_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Conv2dParams& p) {
  Tensor out = empty(conv_output_shape(x.sizes(), w.sizes(), p), x.options());
  kernels::conv2d_forward(x.device(), x, w, b, p, out);
  if (autograd::needs_grad({&x, &w, &b})) {
    SavedTensor saved_x = w.requires_grad() ? SavedTensor::input(x) : SavedTensor();
    SavedTensor saved_w = x.requires_grad() ? SavedTensor::input(w) : SavedTensor();
    autograd::record("Conv2dBackward", {&x, &w, &b}, {&out},
                     [saved_x, saved_w, x_shape = x.sizes(), w_shape = w.sizes(), p](const GradContext& c) -> TensorList {
                       const Tensor& g = c.grad();
                       Tensor gx, gw, gb;
                       if (c.needs(0)) gx = conv_input_grad(g, saved_w.unpack("Conv2dBackward"), x_shape, p);
                       if (autograd::grad_mode_enabled()) {
                         // Recorded (create_graph): differentiable forms.
                         if (c.needs(1)) gw = conv_weight_grad(g, saved_x.unpack("Conv2dBackward"), w_shape, p);
                         if (c.needs(2)) gb = sum(g, {0, 2, 3});
                       } else if (c.needs(1) || c.needs(2)) {
                         // First order: weight and bias gradients from one kernel call.
                         if (c.needs(1)) gw = empty(w_shape, g.options());
                         if (c.needs(2)) gb = empty({w_shape[0]}, g.options());
                         const Tensor x = c.needs(1) ? saved_x.unpack("Conv2dBackward") : Tensor();
                         kernels::conv2d_backward_weight(g.device(), g, x, p, gw, gb);
                       }
                       return {gx, gw, gb};
                     });
  }
  return out;
}

Tensor conv_input_grad(const Tensor& g, const Tensor& w, const Shape& x_shape, const Conv2dParams& p) {
  Tensor gx = empty(x_shape, g.options());
  kernels::conv2d_backward_input(g.device(), g, w, p, gx);
  if (autograd::needs_grad({&g, &w})) {
    SavedTensor saved_g = w.requires_grad() ? SavedTensor::input(g) : SavedTensor();
    SavedTensor saved_w = g.requires_grad() ? SavedTensor::input(w) : SavedTensor();
    autograd::record("Conv2dInputGradBackward", {&g, &w}, {&gx},
                     [saved_g, saved_w, w_shape = w.sizes(), p](const GradContext& c) -> TensorList {
                       const Tensor& h = c.grad();
                       Tensor gg, gw;
                       if (c.needs(0)) gg = conv_forward(h, saved_w.unpack("Conv2dInputGradBackward"), Tensor(), p);
                       if (c.needs(1)) gw = conv_weight_grad(saved_g.unpack("Conv2dInputGradBackward"), h, w_shape, p);
                       return {gg, gw};
                     });
  }
  return gx;
}

Tensor conv_weight_grad(const Tensor& g, const Tensor& x, const Shape& w_shape, const Conv2dParams& p) {
  Tensor gw = empty(w_shape, g.options());
  Tensor no_bias;
  kernels::conv2d_backward_weight(g.device(), g, x, p, gw, no_bias);
  if (autograd::needs_grad({&g, &x})) {
    SavedTensor saved_g = x.requires_grad() ? SavedTensor::input(g) : SavedTensor();
    SavedTensor saved_x = g.requires_grad() ? SavedTensor::input(x) : SavedTensor();
    autograd::record("Conv2dWeightGradBackward", {&g, &x}, {&gw},
                     [saved_g, saved_x, x_shape = x.sizes(), p](const GradContext& c) -> TensorList {
                       const Tensor& k = c.grad();
                       Tensor gg, gx;
                       if (c.needs(0)) gg = conv_forward(saved_x.unpack("Conv2dWeightGradBackward"), k, Tensor(), p);
                       if (c.needs(1)) gx = conv_input_grad(saved_g.unpack("Conv2dWeightGradBackward"), k, x_shape, p);
                       return {gg, gx};
                     });
  }
  return gw;
}

void check_pair(const char* what, std::array<int64_t, 2> v, int64_t minimum) {
  MN_CHECK(v[0] >= minimum && v[1] >= minimum, ValueError, "conv2d: expected ", what, " >= ", minimum, ", got [",
           v[0], ", ", v[1], "]");
}

}  // namespace

Tensor conv2d(const Tensor& x_in, const Tensor& weight_in, const Tensor& bias_in, std::array<int64_t, 2> stride,
              std::array<int64_t, 2> padding, std::array<int64_t, 2> dilation, int64_t groups) {
  // Under autocast, input, weight and bias all run in the lower precision (autograd/autocast.h).
  const Tensor x = amp::cast_lower(x_in), weight = amp::cast_lower(weight_in), bias = amp::cast_lower(bias_in);
  detail::check_defined("conv2d", x, "x");
  detail::check_defined("conv2d", weight, "weight");
  detail::check_float("conv2d", x, "x");
  detail::check_float("conv2d", weight, "weight");
  detail::check_same_dtype("conv2d", x, weight);
  detail::check_same_device("conv2d", x, weight);
  MN_CHECK(x.dim() == 3 || x.dim() == 4, ValueError, "conv2d: expected x of shape [N, C, H, W] or [C, H, W], got ",
           x.sizes());
  // An unbatched [C, H, W] input runs as a batch of one.
  if (x.dim() == 3) return squeeze(conv2d(unsqueeze(x, 0), weight, bias, stride, padding, dilation, groups), 0);
  detail::check_dim("conv2d", weight, 4, "weight");
  check_pair("stride", stride, 1);
  check_pair("padding", padding, 0);
  check_pair("dilation", dilation, 1);
  MN_CHECK(groups >= 1, ValueError, "conv2d: expected groups >= 1, got ", groups);
  const int64_t channels = x.size(1), out_channels = weight.size(0);
  MN_CHECK(channels % groups == 0 && out_channels % groups == 0, ValueError, "conv2d: ", channels,
           " input channels (x ", x.sizes(), ") and ", out_channels, " output channels (weight ", weight.sizes(),
           ") must both be divisible by groups = ", groups);
  MN_CHECK(weight.size(1) * groups == channels, ValueError, "conv2d: weight of shape ", weight.sizes(),
           " expects ", weight.size(1) * groups, " input channels (", weight.size(1), " per group x ", groups,
           " groups), but x of shape ", x.sizes(), " has ", channels);
  if (bias.defined()) {
    detail::check_float("conv2d", bias, "bias");
    detail::check_same_dtype("conv2d", x, bias);
    detail::check_same_device("conv2d", x, bias);
    MN_CHECK(bias.dim() == 1 && bias.size(0) == out_channels, ValueError, "conv2d: expected bias of shape [",
             out_channels, "] for weight of shape ", weight.sizes(), ", got ", bias.sizes());
  }
  Conv2dParams p;
  p.stride_h = stride[0], p.stride_w = stride[1];
  p.pad_h = padding[0], p.pad_w = padding[1];
  p.dilation_h = dilation[0], p.dilation_w = dilation[1];
  p.groups = groups;
  return conv_forward(x, weight, bias, p);
}

}  // namespace mn::nn::functional
