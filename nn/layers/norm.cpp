// LayerNorm, GroupNorm and the Hardtanh check: modules over nn/functional/norm.cpp and the activations.
#include <cmath>

#include "nn/layers.h"

namespace mn::nn {

namespace F = functional;

LayerNorm::LayerNorm(std::vector<int64_t> shape, double eps, bool elementwise_affine)
    : Module("LayerNorm"), normalized_shape(std::move(shape)), eps(eps), elementwise_affine(elementwise_affine) {
  const Shape s(normalized_shape);
  bool positive = s.size() >= 1;
  for (int d = 0; d < s.size(); ++d) positive = positive && s[d] > 0;
  MN_CHECK(positive, ValueError, "LayerNorm: expected a normalized_shape of positive sizes, got ", s);
  if (elementwise_affine) {
    register_parameter("weight", ones(s));
    register_parameter("bias", zeros(s));
  }
}

Tensor LayerNorm::forward(const Tensor& x) {
  if (!elementwise_affine) return F::layer_norm(x, normalized_shape, Tensor(), Tensor(), eps);
  return F::layer_norm(x, normalized_shape, param("weight"), param("bias"), eps);
}

GroupNorm::GroupNorm(int64_t groups, int64_t channels, double eps, bool affine)
    : Module("GroupNorm"), num_groups(groups), num_channels(channels), eps(eps), affine(affine) {
  MN_CHECK(groups > 0 && channels > 0, ValueError, "GroupNorm: expected num_groups > 0 and num_channels > 0, got ",
           groups, " and ", channels);
  MN_CHECK(channels % groups == 0, ValueError, "GroupNorm: num_channels (", channels,
           ") must be divisible by num_groups (", groups, ")");
  if (affine) {
    register_parameter("weight", ones({channels}));
    register_parameter("bias", zeros({channels}));
  }
}

Tensor GroupNorm::forward(const Tensor& x) {
  MN_CHECK(x.dim() >= 2 && x.size(1) == num_channels, ValueError, "GroupNorm(", num_groups, ", ", num_channels,
           "): expected input of shape [N, ", num_channels, ", *], got ", x.sizes());
  if (!affine) return F::group_norm(x, num_groups, Tensor(), Tensor(), eps);
  return F::group_norm(x, num_groups, param("weight"), param("bias"), eps);
}

Hardtanh::Hardtanh(double lo, double hi) : Module("Hardtanh"), min_val(lo), max_val(hi) {
  MN_CHECK(!std::isnan(lo) && !std::isnan(hi) && lo <= hi, ValueError,
           "Hardtanh: expected min_val <= max_val, got min_val ", lo, " and max_val ", hi);
}

}  // namespace mn::nn
