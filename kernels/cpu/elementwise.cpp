// CPU elementwise kernels: unary math, binary arithmetic and comparisons, where, fill, copy and the
// Philox random fill. Each op picks its lambda outside the loop so the inner loop stays branch-free.
#include <cmath>
#include <cstring>

#include "kernels/cpu/loops.h"
#include "kernels/kernels.h"

namespace mn::kernels {
namespace {

using cpu::map;

constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;

inline float gelu_f(float x) { return 0.5f * x * (1.0f + std::erf(x * kInvSqrt2)); }
inline float gelu_grad_f(float x) {
  const float cdf = 0.5f * (1.0f + std::erf(x * kInvSqrt2));
  return cdf + x * kInvSqrt2Pi * std::exp(-0.5f * x * x);
}
inline float sigmoid_f(float x) {
  // Branches keep exp from overflowing for large |x|.
  if (x >= 0) return 1.0f / (1.0f + std::exp(-x));
  const float e = std::exp(x);
  return e / (1.0f + e);
}
inline float softplus_f(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

template <class T>
void unary_typed(UnaryOp op, const Tensor& in, Tensor& out, T a, T b) {
  switch (op) {
    case UnaryOp::Neg: return map<T, T>(out, [](T x) { return -x; }, in);
    case UnaryOp::Abs: return map<T, T>(out, [](T x) { return x < 0 ? -x : x; }, in);
    case UnaryOp::Sign: return map<T, T>(out, [](T x) { return static_cast<T>((x > 0) - (x < 0)); }, in);
    case UnaryOp::AddScalar: return map<T, T>(out, [a](T x) { return x + a; }, in);
    case UnaryOp::MulScalar: return map<T, T>(out, [a](T x) { return x * a; }, in);
    case UnaryOp::RSubScalar: return map<T, T>(out, [a](T x) { return a - x; }, in);
    case UnaryOp::Clamp: return map<T, T>(out, [a, b](T x) { return x < a ? a : (x > b ? b : x); }, in);
    default: break;
  }
  if constexpr (std::is_same_v<T, float>) {
    switch (op) {
      case UnaryOp::Exp: return map<T, T>(out, [](float x) { return std::exp(x); }, in);
      case UnaryOp::Log: return map<T, T>(out, [](float x) { return std::log(x); }, in);
      case UnaryOp::Log1p: return map<T, T>(out, [](float x) { return std::log1p(x); }, in);
      case UnaryOp::Sqrt: return map<T, T>(out, [](float x) { return std::sqrt(x); }, in);
      case UnaryOp::Rsqrt: return map<T, T>(out, [](float x) { return 1.0f / std::sqrt(x); }, in);
      case UnaryOp::Relu: return map<T, T>(out, [](float x) { return x > 0 ? x : 0.0f; }, in);
      case UnaryOp::Gelu: return map<T, T>(out, [](float x) { return gelu_f(x); }, in);
      case UnaryOp::Tanh: return map<T, T>(out, [](float x) { return std::tanh(x); }, in);
      case UnaryOp::Sigmoid: return map<T, T>(out, [](float x) { return sigmoid_f(x); }, in);
      case UnaryOp::Softplus: return map<T, T>(out, [](float x) { return softplus_f(x); }, in);
      case UnaryOp::Square: return map<T, T>(out, [](float x) { return x * x; }, in);
      case UnaryOp::Reciprocal: return map<T, T>(out, [](float x) { return 1.0f / x; }, in);
      case UnaryOp::Sin: return map<T, T>(out, [](float x) { return std::sin(x); }, in);
      case UnaryOp::Cos: return map<T, T>(out, [](float x) { return std::cos(x); }, in);
      case UnaryOp::Erf: return map<T, T>(out, [](float x) { return std::erf(x); }, in);
      case UnaryOp::PowScalar:
        if (a == 2.0f) return map<T, T>(out, [](float x) { return x * x; }, in);
        if (a == 0.5f) return map<T, T>(out, [](float x) { return std::sqrt(x); }, in);
        return map<T, T>(out, [a](float x) { return std::pow(x, a); }, in);
      case UnaryOp::RDivScalar: return map<T, T>(out, [a](float x) { return a / x; }, in);
      default: break;
    }
  }
  throw TypeError(str("unary op ", static_cast<int>(op), " is not defined for dtype ", dtype_name(in.dtype())));
}

void unary_cpu(UnaryOp op, const Tensor& in, Tensor& out, double alpha, double beta) {
  if (in.dtype() == DType::f32)
    unary_typed<float>(op, in, out, static_cast<float>(alpha), static_cast<float>(beta));
  else
    unary_typed<int64_t>(op, in, out, saturating_i64(alpha), saturating_i64(beta));
}

template <class T>
void compare_typed(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& out) {
  switch (op) {
    case BinaryOp::Eq: return map<float, T, T>(out, [](T x, T y) { return float(x == y); }, a, b);
    case BinaryOp::Ne: return map<float, T, T>(out, [](T x, T y) { return float(x != y); }, a, b);
    case BinaryOp::Lt: return map<float, T, T>(out, [](T x, T y) { return float(x < y); }, a, b);
    case BinaryOp::Le: return map<float, T, T>(out, [](T x, T y) { return float(x <= y); }, a, b);
    case BinaryOp::Gt: return map<float, T, T>(out, [](T x, T y) { return float(x > y); }, a, b);
    case BinaryOp::Ge: return map<float, T, T>(out, [](T x, T y) { return float(x >= y); }, a, b);
    default: break;
  }
}

template <class T>
void arith_typed(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& out) {
  switch (op) {
    case BinaryOp::Add: return map<T, T, T>(out, [](T x, T y) { return x + y; }, a, b);
    case BinaryOp::Sub: return map<T, T, T>(out, [](T x, T y) { return x - y; }, a, b);
    case BinaryOp::Mul: return map<T, T, T>(out, [](T x, T y) { return x * y; }, a, b);
    case BinaryOp::Maximum: return map<T, T, T>(out, [](T x, T y) { return x != x || x > y ? x : y; }, a, b);
    case BinaryOp::Minimum: return map<T, T, T>(out, [](T x, T y) { return x != x || x < y ? x : y; }, a, b);
    case BinaryOp::Div:
      if constexpr (std::is_same_v<T, float>) return map<T, T, T>(out, [](T x, T y) { return x / y; }, a, b);
      break;
    default: break;
  }
  if constexpr (std::is_same_v<T, float>) {
    switch (op) {
      case BinaryOp::Pow: return map<T, T, T>(out, [](float x, float y) { return std::pow(x, y); }, a, b);
      case BinaryOp::ReluBackward:
        return map<T, T, T>(out, [](float g, float x) { return x > 0 ? g : 0.0f; }, a, b);
      case BinaryOp::GeluBackward:
        return map<T, T, T>(out, [](float g, float x) { return g * gelu_grad_f(x); }, a, b);
      case BinaryOp::TanhBackward:
        return map<T, T, T>(out, [](float g, float y) { return g * (1.0f - y * y); }, a, b);
      case BinaryOp::SigmoidBackward:
        return map<T, T, T>(out, [](float g, float y) { return g * y * (1.0f - y); }, a, b);
      case BinaryOp::SoftplusBackward:
        return map<T, T, T>(out, [](float g, float x) { return g * sigmoid_f(x); }, a, b);
      default: break;
    }
  }
  throw TypeError(str("binary op ", static_cast<int>(op), " is not defined for dtype ", dtype_name(a.dtype())));
}

void binary_cpu(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& out) {
  if (op >= BinaryOp::Eq && op <= BinaryOp::Ge) {
    if (a.dtype() == DType::f32) return compare_typed<float>(op, a, b, out);
    return compare_typed<int64_t>(op, a, b, out);
  }
  if (a.dtype() == DType::f32) return arith_typed<float>(op, a, b, out);
  arith_typed<int64_t>(op, a, b, out);
}

void where_cpu(const Tensor& cond, const Tensor& a, const Tensor& b, Tensor& out) {
  if (out.dtype() == DType::f32)
    return map<float, float, float, float>(out, [](float c, float x, float y) { return c != 0 ? x : y; }, cond, a, b);
  map<int64_t, float, int64_t, int64_t>(out, [](float c, int64_t x, int64_t y) { return c != 0 ? x : y; }, cond, a, b);
}

void fill_cpu(Tensor& out, double value) {
  if (out.dtype() == DType::f32) {
    const float v = static_cast<float>(value);
    return map<float>(out, [v]() { return v; });
  }
  const int64_t v = saturating_i64(value);
  map<int64_t>(out, [v]() { return v; });
}

void copy_cpu(const Tensor& src, Tensor& dst) {
  if (src.dtype() == dst.dtype() && src.is_contiguous() && dst.is_contiguous()) {
    if (src.numel() > 0) std::memcpy(dst.raw_data(), src.raw_data(), dst.nbytes());
    return;
  }
  if (dst.dtype() == DType::f32) {
    if (src.dtype() == DType::f32) return map<float, float>(dst, [](float x) { return x; }, src);
    return map<float, int64_t>(dst, [](int64_t x) { return static_cast<float>(x); }, src);
  }
  if (src.dtype() == DType::i64) return map<int64_t, int64_t>(dst, [](int64_t x) { return x; }, src);
  map<int64_t, float>(dst, [](float x) { return saturating_i64(x); }, src);
}

void random_cpu(Tensor& out, Distribution dist, double p1, double p2, const PhiloxState& state) {
  MN_CHECK(out.is_contiguous(), ValueError, "random fill expects a contiguous output");
  if (out.dtype() == DType::f32)
    philox_fill(out.data<float>(), out.numel(), dist, p1, p2, state);
  else
    philox_fill(out.data<int64_t>(), out.numel(), dist, p1, p2, state);
}

}  // namespace

void register_cpu_elementwise() {
  unary.set(DeviceType::CPU, unary_cpu);
  binary.set(DeviceType::CPU, binary_cpu);
  where.set(DeviceType::CPU, where_cpu);
  fill.set(DeviceType::CPU, fill_cpu);
  copy.set(DeviceType::CPU, copy_cpu);
  random_fill.set(DeviceType::CPU, random_cpu);
}

}  // namespace mn::kernels
