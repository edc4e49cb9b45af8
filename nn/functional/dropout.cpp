// Inverted dropout: in training mode each element is kept with probability 1 - p and scaled by
// 1 / (1 - p), so the expected output equals the input and evaluation needs no rescaling. The mask
// comes from the counter-based generator, so a seeded Generator reproduces it on every device.
#include <cmath>

#include "autograd/functions/common.h"
#include "core/random.h"
#include "nn/functional.h"

namespace mn::nn::functional {

Tensor dropout(const Tensor& x, double p, bool training, Generator* gen) {
  detail::check_defined("dropout", x, "x");
  MN_CHECK(p >= 0.0 && p <= 1.0, ValueError, "dropout: probability p must be in [0, 1], got ", p);
  if (!training || p == 0.0) return x;
  detail::check_float("dropout", x, "x");
  // Every element dropped: zeros that still carry a (zero) gradient back to x.
  if (p == 1.0) return mul(x, 0.0);
  const Tensor keep = bernoulli(x.sizes(), 1.0 - p, TensorOptions(DType::f32).with_device(x.device()), gen);
  // The mask never requires grad, so scaling it records nothing; x * mask is differentiable twice.
  return mul(x, mul(keep, 1.0 / (1.0 - p)));
}

}  // namespace mn::nn::functional
