// linear: y = x W^T + b, written with matmul so that it is differentiable to any order. matmul folds
// the leading dims of x into the rows of one GEMM, reads W^T as a transposed view (no copy) and
// returns W's gradient in W's own layout.
#include "autograd/autocast.h"
#include "autograd/functions/common.h"
#include "nn/functional.h"

namespace mn::nn::functional {

Tensor linear(const Tensor& x_in, const Tensor& weight_in, const Tensor& bias_in) {
  // Under autocast all three run in the lower precision, bias included (autograd/autocast.h).
  const Tensor x = amp::cast_lower(x_in), weight = amp::cast_lower(weight_in), bias = amp::cast_lower(bias_in);
  detail::check_defined("linear", x, "x");
  detail::check_defined("linear", weight, "weight");
  detail::check_dim("linear", weight, 2, "weight");
  MN_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), ValueError, "linear: input of shape ", x.sizes(),
           " does not match weight of shape ", weight.sizes(), " (expected ", weight.size(1),
           " input features in the last dimension)");
  if (bias.defined())
    MN_CHECK(bias.dim() == 1 && bias.size(0) == weight.size(0), ValueError, "linear: expected bias of shape [",
             weight.size(0), "] for weight of shape ", weight.sizes(), ", got ", bias.sizes());
  Tensor y = matmul(x, weight.t());
  return bias.defined() ? add(y, bias) : y;
}

}  // namespace mn::nn::functional
