#include "core/shape.h"

#include <sstream>

namespace mn {

std::string Shape::str() const {
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < n_; ++i) os << (i ? ", " : "") << d_[i];
  os << ']';
  return os.str();
}

void Shape::throw_numel_overflow() const {
  throw ValueError(mn::str("shape ", *this, " has more elements than int64 can count"));
}

int64_t last_element(const Shape& sizes, const Shape& strides, int64_t offset) {
  int64_t last = offset;
  for (int i = 0; i < sizes.size(); ++i) {
    int64_t reach = 0;
    if (mul_overflows(sizes[i] - 1, strides[i], &reach) || add_overflows(last, reach, &last))
      throw ValueError(mn::str("a view with sizes ", sizes, ", strides ", strides, " and offset ", offset,
                               " reaches beyond the int64 range"));
  }
  return last;
}

Shape contiguous_strides(const Shape& sizes) {
  Shape strides = Shape::filled(sizes.size(), 1);
  int64_t running = 1;
  for (int i = sizes.size() - 1; i >= 0; --i) {
    strides[i] = running;
    running *= std::max<int64_t>(sizes[i], 1);
  }
  return strides;
}

Shape broadcast_shapes(const Shape& a, const Shape& b) {
  const int n = std::max(a.size(), b.size());
  Shape out = Shape::filled(n, 1);
  for (int i = 0; i < n; ++i) {
    const int ia = a.size() - n + i, ib = b.size() - n + i;
    const int64_t da = ia >= 0 ? a[ia] : 1, db = ib >= 0 ? b[ib] : 1;
    MN_CHECK(da == db || da == 1 || db == 1, ValueError, "shapes ", a, " and ", b,
             " cannot be broadcast together (dimension ", i, ": ", da, " vs ", db, ")");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

int wrap_dim(int64_t dim, int ndim) {
  const int64_t lo = ndim == 0 ? -1 : -ndim, hi = ndim == 0 ? 0 : ndim - 1;
  MN_CHECK(dim >= lo && dim <= hi, IndexError, "dimension ", dim, " is out of range for a tensor with ", ndim,
           " dimensions (expected a value in [", lo, ", ", hi, "])");
  return static_cast<int>(dim < 0 ? dim + std::max(ndim, 1) : dim);
}

}  // namespace mn
