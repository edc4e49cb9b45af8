#pragma once
// Element types. f32 is the compute type; i64 holds labels and indices. Comparisons return f32 masks
// (0 or 1), so no separate bool type is needed.
#include <cstddef>
#include <cstdint>
#include <ostream>

namespace mn {

enum class DType : uint8_t { f32 = 0, i64 = 1 };
constexpr DType kFloat32 = DType::f32;
constexpr DType kInt64 = DType::i64;

inline constexpr size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 8; }
inline constexpr const char* dtype_name(DType t) { return t == DType::f32 ? "f32" : "i64"; }
inline std::ostream& operator<<(std::ostream& os, DType t) { return os << dtype_name(t); }

template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<int64_t> { static constexpr DType value = DType::i64; };

// Call f with a typed null pointer for the dtype: MN_DISPATCH_DTYPE(t, [&](auto tag) { using T = decltype(tag); ... })
template <class F>
decltype(auto) visit_dtype(DType t, F&& f) {
  if (t == DType::f32) return f(float{});
  return f(int64_t{});
}

}  // namespace mn
