#pragma once
// The gradient scaler's kernels (kernels/cpu/amp.cpp, kernels/cuda/amp.cu), written once for both
// backends: the operand checks each kernel runs before it touches memory, the non-finite test with the
// unscale of one element, and the scale update (torch._amp_update_scale_'s rule).
#include "core/host_device.h"
#include "kernels/kernels.h"

namespace mn::kernels {

// A 1-element f32 tensor on `device` (found_inf, inv_scale, scale).
inline void check_amp_scalar(const char* op, const Tensor& t, const char* name, Device device,
                             DType dtype = DType::f32) {
  MN_CHECK(t.defined(), ValueError, op, ": '", name, "' is an undefined tensor");
  MN_CHECK(t.device() == device, DeviceError, op, ": expected '", name, "' on ", device, ", got a tensor on ",
           t.device());
  MN_CHECK(t.dtype() == dtype, TypeError, op, ": expected '", name, "' to be ", dtype, ", got ", t.dtype());
  MN_CHECK(t.numel() == 1, ValueError, op, ": expected '", name, "' to hold one element, got shape ", t.sizes());
}

// grad: a contiguous f32 tensor (any shape, empty too); found_inf and inv_scale on its device.
inline void check_unscale_operands(const Tensor& grad, const Tensor& found_inf, const Tensor& inv_scale) {
  const char* op = "non_finite_check_and_unscale";
  MN_CHECK(grad.defined(), ValueError, op, ": 'grad' is an undefined tensor");
  MN_CHECK(grad.dtype() == DType::f32, TypeError, op, ": expected 'grad' to be f32, got ", grad.dtype());
  MN_CHECK(grad.is_contiguous(), ValueError, op, ": expected 'grad' to be contiguous, got shape ", grad.sizes(),
           " with strides ", grad.strides());
  check_amp_scalar(op, found_inf, "found_inf", grad.device());
  check_amp_scalar(op, inv_scale, "inv_scale", grad.device());
}

inline void check_update_scale_operands(const Tensor& scale, const Tensor& growth_tracker, const Tensor& found_inf) {
  const char* op = "amp_update_scale";
  MN_CHECK(scale.defined(), ValueError, op, ": 'scale' is an undefined tensor");
  check_amp_scalar(op, scale, "scale", scale.device());
  check_amp_scalar(op, growth_tracker, "growth_tracker", scale.device(), DType::i64);
  check_amp_scalar(op, found_inf, "found_inf", scale.device());
}

// Neither infinite nor NaN (every comparison with NaN is false); the same code on host and device.
MN_HOST_DEVICE inline bool finite_float(float v) { return v <= 3.40282347e38f && v >= -3.40282347e38f; }

// One gradient element: true when it is infinite or NaN; the element becomes g * inv (left as it is
// when inv is 1, as PyTorch's kernel does).
MN_HOST_DEVICE inline bool unscale_element(float& g, float inv) {
  const float v = g;
  g = inv == 1.0f ? v : v * inv;
  return !finite_float(v);
}

// torch._amp_update_scale_: a non-zero found_inf multiplies the scale by backoff (in double, rounded
// to float) and restarts the growth count; otherwise the count advances, and on reaching the interval
// the scale is multiplied by growth (kept only when the product is finite in float) and the count
// restarts.
MN_HOST_DEVICE inline void update_scale(float& scale, int64_t& growth_tracker, float found_inf, double growth_factor,
                                        double backoff_factor, int64_t growth_interval) {
  if (found_inf != 0.0f) {
    scale = static_cast<float>(static_cast<double>(scale) * backoff_factor);
    growth_tracker = 0;
    return;
  }
  const int64_t successful = growth_tracker + 1;
  if (successful == growth_interval) {
    const float grown = static_cast<float>(static_cast<double>(scale) * growth_factor);
    if (finite_float(grown)) scale = grown;
    growth_tracker = 0;
  } else {
    growth_tracker = successful;
  }
}

}  // namespace mn::kernels
