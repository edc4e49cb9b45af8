#include "autograd/functions/common.h"

namespace mn::detail {

void check_same_device(const char* op, const Tensor& a, const Tensor& b) {
  MN_CHECK(a.device() == b.device(), DeviceError, op, ": expected all tensors on one device, got ", a.device(),
           " and ", b.device());
}

void check_same_dtype(const char* op, const Tensor& a, const Tensor& b) {
  MN_CHECK(a.dtype() == b.dtype(), TypeError, op, ": expected tensors of one dtype, got ", a.dtype(), a.sizes(),
           " and ", b.dtype(), b.sizes());
}

DType result_dtype(const char* op, const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() && is_floating_point(a.dtype()) && is_floating_point(b.dtype()))
    return promote_types(a.dtype(), b.dtype());
  check_same_dtype(op, a, b);
  return a.dtype();
}

void check_defined(const char* op, const Tensor& t, const char* arg) {
  MN_CHECK(t.defined(), ValueError, op, ": argument '", arg, "' is an undefined tensor");
}

void check_float(const char* op, const Tensor& t, const char* arg) {
  MN_CHECK(is_floating_point(t.dtype()), TypeError, op, ": expected '", arg,
           "' of a floating-point dtype (f32, bf16 or f16), got ", t.dtype(), " with shape ", t.sizes());
}

void check_dim(const char* op, const Tensor& t, int expected, const char* arg) {
  MN_CHECK(t.dim() == expected, ValueError, op, ": expected '", arg, "' to have ", expected,
           " dimensions, got shape ", t.sizes());
}

Tensor raw_view(const Tensor& t, const Shape& sizes, const Shape& strides, int64_t offset) {
  return make_view(t.storage(), sizes, strides, offset, t.dtype());
}

Tensor expand_view(const Tensor& t, const Shape& shape) {
  if (t.sizes() == shape) return t;
  const int n = shape.size(), k = t.dim();
  MN_CHECK(n >= k, ValueError, "cannot expand shape ", t.sizes(), " to ", shape);
  Shape strides = Shape::filled(n, 0);
  for (int i = 0; i < n; ++i) {
    const int j = i - (n - k);
    if (j < 0) continue;
    const int64_t size = t.sizes()[j];
    MN_CHECK(size == shape[i] || size == 1, ValueError, "cannot expand shape ", t.sizes(), " to ", shape,
             " (dimension ", i, ": ", size, " vs ", shape[i], ")");
    strides[i] = size == shape[i] ? t.strides()[j] : 0;
  }
  return raw_view(t, shape, strides, t.storage_offset());
}

Tensor raw_contiguous(const Tensor& t) {
  if (t.is_contiguous()) return t;
  Tensor out = empty(t.sizes(), t.options());
  kernels::copy(t.device(), t, out);
  return out;
}

uint32_t dim_mask(const std::vector<int64_t>& dims, int ndim, bool all_if_empty) {
  if (dims.empty() && all_if_empty) return ndim >= 32 ? ~0u : ((1u << ndim) - 1);
  uint32_t mask = 0;
  for (int64_t d : dims) {
    const int w = wrap_dim(d, ndim);
    MN_CHECK(!(mask & (1u << w)), ValueError, "dimension ", d, " appears more than once in the reduction dims");
    mask |= 1u << w;
  }
  return mask;
}

Shape reduced_shape(const Shape& s, uint32_t mask, bool keepdim) {
  Shape out;
  for (int i = 0; i < s.size(); ++i) {
    if (mask & (1u << i)) {
      if (keepdim) out.push_back(1);
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

}  // namespace mn::detail
