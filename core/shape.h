#pragma once
// Shape: a small fixed-capacity list of int64 (sizes or strides), so that creating a tensor
// allocates nothing for its metadata. At most kMaxDims dimensions.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <string>
#include <vector>

#include "core/error.h"

namespace mn {

constexpr int kMaxDims = 8;

// Size arithmetic on values that can come from user input (shapes, strides, offsets, counts): true when
// the exact result does not fit int64, like the compiler builtins they wrap (*out is then unspecified).
inline bool mul_overflows(int64_t a, int64_t b, int64_t* out) { return __builtin_mul_overflow(a, b, out); }
inline bool add_overflows(int64_t a, int64_t b, int64_t* out) { return __builtin_add_overflow(a, b, out); }

class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> v) { assign(v.begin(), v.end()); }
  explicit Shape(const std::vector<int64_t>& v) { assign(v.begin(), v.end()); }
  template <class It>
  Shape(It b, It e) { assign(b, e); }

  static Shape filled(int n, int64_t value) {
    Shape s;
    s.resize(n, value);
    return s;
  }

  int size() const { return n_; }
  bool empty() const { return n_ == 0; }
  int64_t operator[](int i) const { return d_[i]; }
  int64_t& operator[](int i) { return d_[i]; }
  const int64_t* begin() const { return d_; }
  const int64_t* end() const { return d_ + n_; }
  int64_t* begin() { return d_; }
  int64_t* end() { return d_ + n_; }
  const int64_t* data() const { return d_; }
  int64_t back() const { return d_[n_ - 1]; }

  void push_back(int64_t v) {
    MN_CHECK(n_ < kMaxDims, ValueError, "tensors have at most ", kMaxDims, " dimensions");
    d_[n_++] = v;
  }
  void insert(int pos, int64_t v) {
    MN_CHECK(n_ < kMaxDims, ValueError, "tensors have at most ", kMaxDims, " dimensions");
    for (int i = n_; i > pos; --i) d_[i] = d_[i - 1];
    d_[pos] = v;
    ++n_;
  }
  void erase(int pos) {
    for (int i = pos; i + 1 < n_; ++i) d_[i] = d_[i + 1];
    --n_;
  }
  void resize(int n, int64_t fill = 0) {
    MN_CHECK(n >= 0 && n <= kMaxDims, ValueError, "tensors have at most ", kMaxDims, " dimensions, got ", n);
    for (int i = n_; i < n; ++i) d_[i] = fill;
    n_ = n;
  }

  // The product of the sizes; ValueError naming the shape when it does not fit int64. A zero size does
  // not excuse an overflowing product of the others: contiguous strides multiply those too.
  int64_t numel() const {
    int64_t p = 1;
    bool has_zero = false;
    for (int i = 0; i < n_; ++i) {
      if (d_[i] == 0) has_zero = true;
      else if (mul_overflows(p, d_[i], &p)) throw_numel_overflow();
    }
    return has_zero ? 0 : p;
  }
  std::vector<int64_t> vec() const { return std::vector<int64_t>(begin(), end()); }
  std::string str() const;

  friend bool operator==(const Shape& a, const Shape& b) {
    return a.n_ == b.n_ && std::equal(a.begin(), a.end(), b.begin());
  }
  friend bool operator!=(const Shape& a, const Shape& b) { return !(a == b); }

 private:
  [[noreturn]] void throw_numel_overflow() const;
  template <class It>
  void assign(It b, It e) {
    n_ = 0;
    for (; b != e; ++b) push_back(static_cast<int64_t>(*b));
  }
  int64_t d_[kMaxDims] = {};
  int n_ = 0;
};

inline std::ostream& operator<<(std::ostream& os, const Shape& s) { return os << s.str(); }

// Row-major (C-contiguous) strides for sizes.
Shape contiguous_strides(const Shape& sizes);
// Broadcast two shapes numpy-style; throws ValueError naming both shapes when incompatible.
Shape broadcast_shapes(const Shape& a, const Shape& b);
// The highest element offset reached by a view with these sizes, (non-negative) strides and offset, for a
// view with at least one element; ValueError naming the view when the arithmetic overflows int64.
int64_t last_element(const Shape& sizes, const Shape& strides, int64_t offset);
// Normalises a possibly negative dim into [0, ndim); throws IndexError naming dim and ndim.
int wrap_dim(int64_t dim, int ndim);

}  // namespace mn
