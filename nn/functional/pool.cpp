// max_pool2d and avg_pool2d (NCHW or unbatched CHW), with PyTorch's output-size rule.
//
// Backward passes are recorded ops too, so double backward works: average pooling is linear and its
// backward is the adjoint, so forward and backward are each other's gradient; max pooling's
// backward scatters the gradient to the recorded argmax positions, whose own gradient is a gather
// at those positions (an index_select over the flattened input).
#include "autograd/functions/common.h"
#include "nn/functional.h"
#include "nn/functional/pool_grad.h"

namespace mn::nn::functional {

using autograd::GradContext;
using autograd::SavedTensor;
using autograd::TensorList;
using kernels::Pool2dParams;

namespace {


// PyTorch's rule: floor (or ceil) of (in + 2 pad - kernel) / stride + 1, where in ceil mode the last
// window must start inside the input or the left padding.
int64_t pool_output_size(int64_t in, int64_t kernel, int64_t stride, int64_t pad, bool ceil_mode) {
  const int64_t numer = in + 2 * pad - kernel + (ceil_mode ? stride - 1 : 0);
  int64_t out = (numer >= 0 ? numer / stride : -((-numer + stride - 1) / stride)) + 1;
  if (ceil_mode && (out - 1) * stride >= in + pad) --out;
  return out;
}

Pool2dParams pool_params(const char* op, const Tensor& x, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride,
                         std::array<int64_t, 2> padding, bool ceil_mode, bool count_include_pad) {
  detail::check_defined(op, x, "x");
  detail::check_float(op, x, "x");
  MN_CHECK(x.dim() == 4, ValueError, op, ": expected x of shape [N, C, H, W] or [C, H, W], got ", x.sizes());
  if (stride[0] == 0 && stride[1] == 0) stride = kernel;
  MN_CHECK(kernel[0] > 0 && kernel[1] > 0, ValueError, op, ": kernel size must be positive, got [", kernel[0], ", ",
           kernel[1], "]");
  MN_CHECK(stride[0] > 0 && stride[1] > 0, ValueError, op, ": stride must be positive, got [", stride[0], ", ",
           stride[1], "]");
  MN_CHECK(padding[0] >= 0 && padding[1] >= 0 && 2 * padding[0] <= kernel[0] && 2 * padding[1] <= kernel[1],
           ValueError, op, ": padding must be non-negative and at most half the kernel size, got padding [",
           padding[0], ", ", padding[1], "] for kernel [", kernel[0], ", ", kernel[1], "]");
  Pool2dParams p;
  p.kernel_h = kernel[0], p.kernel_w = kernel[1];
  p.stride_h = stride[0], p.stride_w = stride[1];
  p.pad_h = padding[0], p.pad_w = padding[1];
  p.ceil_mode = ceil_mode;
  p.count_include_pad = count_include_pad;
  return p;
}

Shape pool_output_shape(const char* op, const Tensor& x, const Pool2dParams& p) {
  // Padding could make an output of an empty plane; its windows would hold no element to read.
  MN_CHECK(x.size(2) > 0 && x.size(3) > 0, ValueError, op, ": expected an input with non-empty height and width, got shape ",
           x.sizes());
  const int64_t oh = pool_output_size(x.size(2), p.kernel_h, p.stride_h, p.pad_h, p.ceil_mode);
  const int64_t ow = pool_output_size(x.size(3), p.kernel_w, p.stride_w, p.pad_w, p.ceil_mode);
  MN_CHECK(oh >= 1 && ow >= 1, ValueError, op, ": input of shape ", x.sizes(), " is too small for kernel [", p.kernel_h,
           ", ", p.kernel_w, "] with padding [", p.pad_h, ", ", p.pad_w, "] (output would be [", oh, ", ", ow, "])");
  return {x.size(0), x.size(1), oh, ow};
}

// Runs a pooling op on an unbatched [C, H, W] input as a batch of one.
template <class F>
Tensor batched(const Tensor& x, F&& pool) {
  if (x.defined() && x.dim() == 3) return squeeze(pool(unsqueeze(x, 0)), 0);
  return pool(x);
}

// ---- average pooling: forward and backward are adjoint linear maps ----

Tensor avg_pool_grad(const Tensor& g, const Pool2dParams& p, const Shape& x_shape);

Tensor avg_pool_forward(const Tensor& x, const Pool2dParams& p, const Shape& out_shape) {
  Tensor out = empty(out_shape, x.options());
  kernels::avg_pool2d_forward(x.device(), x, p, out);
  if (autograd::needs_grad({&x}))
    autograd::record("AvgPool2dBackward", {&x}, {&out}, [p, x_shape = x.sizes()](const GradContext& c) -> TensorList {
      return {avg_pool_grad(c.grad(), p, x_shape)};
    });
  return out;
}

Tensor avg_pool_grad(const Tensor& g, const Pool2dParams& p, const Shape& x_shape) {
  Tensor gx = empty(x_shape, g.options());
  kernels::avg_pool2d_backward(g.device(), g, p, gx);
  if (autograd::needs_grad({&g}))
    autograd::record("AvgPool2dGradBackward", {&g}, {&gx}, [p, g_shape = g.sizes()](const GradContext& c) -> TensorList {
      return {avg_pool_forward(c.grad(), p, g_shape)};
    });
  return gx;
}

// ---- max pooling ----

// Positions of the per-plane argmax indices in the flattened input: plane * H * W + index.
Tensor flat_positions(const Tensor& indices, const Shape& x_shape) {
  const int64_t planes = x_shape[0] * x_shape[1], plane_size = x_shape[2] * x_shape[3];
  Tensor plane_start = arange(0.0, static_cast<double>(planes * plane_size), static_cast<double>(plane_size),
                              TensorOptions(DType::i64).with_device(indices.device()));
  return add(indices, plane_start.reshape({x_shape[0], x_shape[1], 1, 1})).reshape({-1});
}

Tensor max_pool_grad(const Tensor& g, const Tensor& indices, const Shape& x_shape) {
  Tensor gx = empty(x_shape, g.options());
  kernels::max_pool2d_backward(g.device(), g, indices, gx);
  if (autograd::needs_grad({&g}))
    autograd::record("MaxPool2dGradBackward", {&g}, {&gx},
                     [saved_indices = SavedTensor::input(indices), g_shape = g.sizes(), x_shape](const GradContext& c) {
                       Tensor positions = flat_positions(saved_indices.unpack("MaxPool2dGradBackward"), x_shape);
                       return TensorList{index_select(c.grad().reshape({-1}), 0, positions).reshape(g_shape)};
                     });
  return gx;
}

Tensor max_pool_forward(const Tensor& x, const Pool2dParams& p, const Shape& out_shape) {
  Tensor out = empty(out_shape, x.options());
  Tensor indices = empty(out_shape, TensorOptions(DType::i64).with_device(x.device()));
  kernels::max_pool2d_forward(x.device(), x, p, out, indices);
  if (autograd::needs_grad({&x}))
    autograd::record("MaxPool2dBackward", {&x}, {&out},
                     [saved_indices = SavedTensor::input(indices), x_shape = x.sizes()](const GradContext& c) {
                       return TensorList{max_pool_grad(c.grad(), saved_indices.unpack("MaxPool2dBackward"), x_shape)};
                     });
  return out;
}

}  // namespace

Tensor max_pool2d_grad(const Tensor& g, const Tensor& indices, const Shape& x_shape) {
  return max_pool_grad(g, indices, x_shape);
}

Tensor max_pool2d(const Tensor& x, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride,
                  std::array<int64_t, 2> padding, bool ceil_mode) {
  return batched(x, [&](const Tensor& xb) {
    const Pool2dParams p = pool_params("max_pool2d", xb, kernel, stride, padding, ceil_mode, true);
    return max_pool_forward(xb, p, pool_output_shape("max_pool2d", xb, p));
  });
}

Tensor avg_pool2d(const Tensor& x, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride,
                  std::array<int64_t, 2> padding, bool ceil_mode, bool count_include_pad) {
  return batched(x, [&](const Tensor& xb) {
    const Pool2dParams p = pool_params("avg_pool2d", xb, kernel, stride, padding, ceil_mode, count_include_pad);
    return avg_pool_forward(xb, p, pool_output_shape("avg_pool2d", xb, p));
  });
}

}  // namespace mn::nn::functional
