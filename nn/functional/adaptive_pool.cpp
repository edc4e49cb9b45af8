// adaptive_avg_pool2d and adaptive_max_pool2d (NCHW or unbatched CHW) with PyTorch's windows: output
// (i, j) of an OH x OW grid covers rows floor(i*H/OH) .. ceil((i+1)*H/OH) - 1 and the columns alike,
// for any output size (larger than the input too: windows then repeat pixels).
//
// Backward passes are recorded ops, so double backward works: average pooling is linear, and its
// forward and backward are each other's gradient; max pooling's backward is max_pool2d's scatter to
// the recorded argmax positions.
#include "autograd/functions/common.h"
#include "nn/functional.h"
#include "nn/functional/pool_grad.h"

namespace mn::nn::functional {

using autograd::GradContext;
using autograd::SavedTensor;
using autograd::TensorList;

namespace {


Shape adaptive_output_shape(const char* op, const Tensor& x, std::array<int64_t, 2> size) {
  detail::check_defined(op, x, "x");
  detail::check_float(op, x, "x");
  MN_CHECK(x.dim() == 3 || x.dim() == 4, ValueError, op, ": expected x of shape [N, C, H, W] or [C, H, W], got ",
           x.sizes());
  MN_CHECK(x.size(-1) > 0 && x.size(-2) > 0, ValueError, op,
           ": expected an input with non-empty height and width, got shape ", x.sizes());
  MN_CHECK(size[0] >= 0 && size[1] >= 0, ValueError, op, ": output size must be non-negative, got [", size[0], ", ",
           size[1], "]");
  Shape out = x.sizes();
  out[x.dim() - 2] = size[0];
  out[x.dim() - 1] = size[1];
  return out;
}

// Runs a pool on an unbatched [C, H, W] input as a batch of one.
template <class F>
auto batched(const Tensor& x, F&& pool) {
  return x.dim() == 3 ? pool(unsqueeze(x, 0), true) : pool(x, false);
}

Tensor adaptive_avg_grad(const Tensor& g, const Shape& x_shape);

Tensor adaptive_avg_forward(const Tensor& x, const Shape& out_shape) {
  Tensor out = empty(out_shape, x.options());
  if (out.numel() > 0) kernels::adaptive_avg_pool2d_forward(x.device(), x, out);
  if (autograd::needs_grad({&x}))
    autograd::record("AdaptiveAvgPool2dBackward", {&x}, {&out}, [x_shape = x.sizes()](const GradContext& c) {
      return TensorList{adaptive_avg_grad(c.grad(), x_shape)};
    });
  return out;
}

Tensor adaptive_avg_grad(const Tensor& g, const Shape& x_shape) {
  Tensor gx = g.numel() == 0 ? zeros(x_shape, g.options()) : empty(x_shape, g.options());
  if (g.numel() > 0) kernels::adaptive_avg_pool2d_backward(g.device(), g, gx);
  if (autograd::needs_grad({&g}))
    autograd::record("AdaptiveAvgPool2dGradBackward", {&g}, {&gx}, [g_shape = g.sizes()](const GradContext& c) {
      return TensorList{adaptive_avg_forward(c.grad(), g_shape)};
    });
  return gx;
}

std::pair<Tensor, Tensor> adaptive_max_forward(const Tensor& x, const Shape& out_shape) {
  Tensor out = empty(out_shape, x.options());
  Tensor indices = empty(out_shape, TensorOptions(DType::i64).with_device(x.device()));
  if (out.numel() > 0) kernels::adaptive_max_pool2d_forward(x.device(), x, out, indices);
  if (autograd::needs_grad({&x}))
    autograd::record("AdaptiveMaxPool2dBackward", {&x}, {&out},
                     [si = SavedTensor::input(indices), x_shape = x.sizes()](const GradContext& c) {
                       if (c.grad().numel() == 0) return TensorList{zeros(x_shape, c.grad().options())};
                       return TensorList{max_pool2d_grad(c.grad(), si.unpack("AdaptiveMaxPool2dBackward"), x_shape)};
                     });
  return {out, indices};
}

}  // namespace

Tensor adaptive_avg_pool2d(const Tensor& x, std::array<int64_t, 2> output_size) {
  const Shape out_shape = adaptive_output_shape("adaptive_avg_pool2d", x, output_size);
  return batched(x, [&](const Tensor& xb, bool unbatched) {
    Tensor out = adaptive_avg_forward(xb, unbatched ? Shape{1, out_shape[0], out_shape[1], out_shape[2]} : out_shape);
    return unbatched ? squeeze(out, 0) : out;
  });
}

std::pair<Tensor, Tensor> adaptive_max_pool2d_with_indices(const Tensor& x, std::array<int64_t, 2> output_size) {
  const Shape out_shape = adaptive_output_shape("adaptive_max_pool2d", x, output_size);
  return batched(x, [&](const Tensor& xb, bool unbatched) {
    auto [out, indices] =
        adaptive_max_forward(xb, unbatched ? Shape{1, out_shape[0], out_shape[1], out_shape[2]} : out_shape);
    if (!unbatched) return std::pair<Tensor, Tensor>{out, indices};
    return std::pair<Tensor, Tensor>{squeeze(out, 0), squeeze(indices, 0)};
  });
}

Tensor adaptive_max_pool2d(const Tensor& x, std::array<int64_t, 2> output_size) {
  return adaptive_max_pool2d_with_indices(x, output_size).first;
}

}  // namespace mn::nn::functional
