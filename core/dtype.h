#pragma once
// Element types. f32 is the compute type; i64 holds labels and indices; bf16 and f16 are 16-bit
// floating-point storage types for mixed precision (core/half.h): kernels without a 16-bit version
// compute them in f32 (kernels/dispatch.h). Comparisons return f32 masks (0 or 1), so no separate
// bool type is needed.
#include <cstddef>
#include <cstdint>
#include <ostream>

#include "core/half.h"

namespace mn {

enum class DType : uint8_t { f32 = 0, i64 = 1, bf16 = 2, f16 = 3 };
constexpr DType kFloat32 = DType::f32;
constexpr DType kInt64 = DType::i64;
constexpr DType kBFloat16 = DType::bf16;
constexpr DType kFloat16 = DType::f16;

inline constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::i64: return 8;
    case DType::bf16:
    case DType::f16: return 2;
  }
  return 0;
}

inline constexpr const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::i64: return "i64";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
  }
  return "invalid dtype";
}

inline std::ostream& operator<<(std::ostream& os, DType t) { return os << dtype_name(t); }

inline constexpr bool is_floating_point(DType t) { return t != DType::i64; }
// The 16-bit floating types, which kernels compute in f32.
inline constexpr bool is_reduced_precision(DType t) { return t == DType::bf16 || t == DType::f16; }

// The dtype an op on a and b computes in, PyTorch's promotion among these four: a float beats i64,
// f32 beats the 16-bit types, and bf16 with f16 meet at f32.
inline constexpr DType promote_types(DType a, DType b) {
  if (a == b) return a;
  if (a == DType::i64) return b;
  if (b == DType::i64) return a;
  return DType::f32;
}

template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<int64_t> { static constexpr DType value = DType::i64; };
template <> struct dtype_of<BFloat16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of<Half> { static constexpr DType value = DType::f16; };

// Call f with a value of the dtype's C++ type: visit_dtype(t, [&](auto tag) { using T = decltype(tag); ... })
template <class F>
decltype(auto) visit_dtype(DType t, F&& f) {
  switch (t) {
    case DType::i64: return f(int64_t{});
    case DType::bf16: return f(BFloat16{});
    case DType::f16: return f(Half{});
    case DType::f32: break;
  }
  return f(float{});
}

}  // namespace mn
