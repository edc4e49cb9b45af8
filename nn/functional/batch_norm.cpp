// batch_norm over x [N, C, *]: normalises each channel with the batch statistics (training) or the
// running statistics (eval), then applies the optional affine weight and bias.
//
// The running statistics are buffers: the forward kernel updates them in place (momentum, unbiased
// variance), which is not recorded, and their version counters are bumped like any in-place write.
// The first-order backward is the fused kernel; when the backward itself is recorded
// (create_graph), the same formulas are written with differentiable ops so double backward works.
#include <cmath>
#include <vector>

#include "autograd/autocast.h"
#include "autograd/functions/common.h"
#include "nn/functional.h"

namespace mn::nn::functional {

using autograd::GradContext;
using autograd::SavedTensor;
using autograd::TensorList;

namespace {


void check_channel_vector(const Tensor& t, const char* name, const Tensor& x) {
  if (!t.defined()) return;
  detail::check_float("batch_norm", t, name);
  detail::check_same_device("batch_norm", x, t);
  MN_CHECK(t.dim() == 1 && t.size(0) == x.size(1), ValueError, "batch_norm: expected '", name, "' of shape [",
           x.size(1), "] for input of shape ", x.sizes(), ", got ", t.sizes());
}

// Every dim except the channel dim (1).
std::vector<int64_t> reduce_dims(int ndim) {
  std::vector<int64_t> dims{0};
  for (int d = 2; d < ndim; ++d) dims.push_back(d);
  return dims;
}

// A [C] vector shaped [1, C, 1, ...] to broadcast against x.
Tensor per_channel(const Tensor& v, int ndim) {
  Shape shape = Shape::filled(ndim, 1);
  shape[1] = v.size(0);
  return reshape(v, shape);
}

// The backward written with differentiable ops (used when it is itself being recorded).
TensorList recorded_backward(const GradContext& c, const Tensor& g, const Tensor& x, const Tensor& weight,
                             const Tensor& save_mean, const Tensor& save_invstd, bool training, double eps) {
  const int nd = x.dim();
  const std::vector<int64_t> dims = reduce_dims(nd);
  Tensor mean_c, invstd_c;
  if (training) {
    // The batch statistics are functions of x here, so their dependence is differentiated too.
    mean_c = mean(x, dims, true);
    const Tensor centered = sub(x, mean_c);
    invstd_c = rsqrt(add(mean(mul(centered, centered), dims, true), eps));
  } else {
    mean_c = per_channel(save_mean, nd);
    invstd_c = per_channel(save_invstd, nd);
  }
  const Tensor x_hat = mul(sub(x, mean_c), invstd_c);
  Tensor gx, gw, gb;
  if (c.needs(0)) {
    Tensor scale = weight.defined() ? mul(invstd_c, per_channel(weight, nd)) : invstd_c;
    Tensor inner = training ? sub(sub(g, mean(g, dims, true)), mul(x_hat, mean(mul(g, x_hat), dims, true))) : g;
    gx = mul(scale, inner);
  }
  if (c.needs(1)) gw = sum(mul(g, x_hat), dims);
  if (c.needs(2)) gb = sum(g, dims);
  return {gx, gw, gb};
}

}  // namespace

Tensor batch_norm(const Tensor& x_in, Tensor running_mean, Tensor running_var, const Tensor& weight_in, const Tensor& bias_in,
                  bool training, double momentum, double eps) {
  // an f32 op under autocast (autograd/autocast.h)
  const Tensor x = amp::cast_f32(x_in), weight = amp::cast_f32(weight_in), bias = amp::cast_f32(bias_in);
  detail::check_defined("batch_norm", x, "x");
  detail::check_float("batch_norm", x, "x");
  MN_CHECK(x.dim() >= 2, ValueError, "batch_norm: expected x of shape [N, C] or [N, C, *], got ", x.sizes());
  check_channel_vector(weight, "weight", x);
  check_channel_vector(bias, "bias", x);
  check_channel_vector(running_mean, "running_mean", x);
  check_channel_vector(running_var, "running_var", x);
  MN_CHECK(running_mean.defined() == running_var.defined(), ValueError,
           "batch_norm: running_mean and running_var must both be given or both be undefined");
  MN_CHECK(training || running_mean.defined(), ValueError,
           "batch_norm: running_mean and running_var must be defined in evaluation mode");
  MN_CHECK(!training || x.numel() / x.size(1) > 1, ValueError,
           "batch_norm: expected more than 1 value per channel when training, got input of shape ", x.sizes());
  MN_CHECK(eps >= 0 && momentum >= 0 && momentum <= 1, ValueError,
           "batch_norm: expected eps >= 0 and momentum in [0, 1], got eps ", eps, " and momentum ", momentum);
  if (running_mean.defined())
    MN_CHECK(!running_mean.requires_grad() && !running_var.requires_grad(), ValueError,
             "batch_norm: running statistics are buffers and must not require grad");

  Tensor out = empty(x.sizes(), x.options());
  Tensor save_mean = empty({x.size(1)}, x.options());
  Tensor save_invstd = empty({x.size(1)}, x.options());
  kernels::batch_norm_forward(x.device(), x, weight, bias, running_mean, running_var, training, momentum, eps, out,
                              save_mean, save_invstd);
  if (training && running_mean.defined()) {
    running_mean.bump_version();
    running_var.bump_version();
  }

  if (autograd::needs_grad({&x, &weight, &bias}))
    autograd::record(
        "BatchNormBackward", {&x, &weight, &bias}, {&out},
        [sx = SavedTensor::input(x), sw = SavedTensor::input(weight), save_mean, save_invstd, training,
         eps](const GradContext& c) -> TensorList {
          const Tensor x = sx.unpack("BatchNormBackward"), weight = sw.unpack("BatchNormBackward");
          const Tensor& g = c.grad();
          if (autograd::grad_mode_enabled())
            return recorded_backward(c, g, x, weight, save_mean, save_invstd, training, eps);
          Tensor gx = c.needs(0) ? empty(x.sizes(), x.options()) : Tensor();
          Tensor gw = c.needs(1) ? empty(weight.sizes(), x.options()) : Tensor();
          Tensor gb = c.needs(2) ? empty({x.size(1)}, x.options()) : Tensor();
          kernels::batch_norm_backward(x.device(), g, x, weight, save_mean, save_invstd, training, gx, gw, gb);
          return {gx, gw, gb};
        });
  return out;
}

}  // namespace mn::nn::functional
