#pragma once
// The per-element formulas of the elementwise kernels, written once for both backends: the CPU
// kernels (kernels/cpu/elementwise.cpp) and their CUDA twins (kernels/cuda/elementwise.cu) evaluate
// every unary, binary and comparison op through the functions below, so the two cannot drift apart.
//
// The CPU passes the op as a compile-time constant (one lambda per op, chosen outside the loop), so
// the switch folds away and the loop body is the bare formula; the GPU passes it at run time (uniform
// across a launch). The switches list every op and have no default: a new op without a formula is a
// -Wswitch warning, and an op value outside the enum ends in op_unreachable (kernels.h), never in a
// silent 0.
//
// NaN follows PyTorch: relu, clamp, maximum/minimum and abs return a NaN input as NaN; relu's
// backward passes the gradient where its output is NaN (threshold_backward: 0 only where y <= 0);
// sign(NaN) is 0.
#include <math.h>

#include <cstdint>

#include "core/host_device.h"
#include "kernels/kernels.h"

#if defined(__CUDACC__)
#define MN_SCALAR_INLINE __forceinline__
#else
#define MN_SCALAR_INLINE inline __attribute__((always_inline))
#endif

namespace mn::kernels::math {

// ---------------- activations ----------------

constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;

MN_HOST_DEVICE MN_SCALAR_INLINE float relu(float x) { return x <= 0.0f ? 0.0f : x; }
MN_HOST_DEVICE MN_SCALAR_INLINE float relu_backward(float g, float y) { return y <= 0.0f ? 0.0f : g; }
MN_HOST_DEVICE MN_SCALAR_INLINE float gelu(float x) { return 0.5f * x * (1.0f + erff(x * kInvSqrt2)); }
MN_HOST_DEVICE MN_SCALAR_INLINE float gelu_grad(float x) {
  const float cdf = 0.5f * (1.0f + erff(x * kInvSqrt2));
  return cdf + x * kInvSqrt2Pi * expf(-0.5f * x * x);
}
MN_HOST_DEVICE MN_SCALAR_INLINE float sigmoid(float x) {
  // Two branches keep exp from overflowing for large |x|.
  if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
  const float e = expf(x);
  return e / (1.0f + e);
}
// PyTorch's softplus: linear above the threshold (on x * beta), log1p(exp(x * beta)) / beta below.
MN_HOST_DEVICE MN_SCALAR_INLINE float softplus(float x, float beta, float threshold) {
  const float z = x * beta;
  return z > threshold ? x : log1pf(expf(z)) / beta;
}
MN_HOST_DEVICE MN_SCALAR_INLINE float softplus_backward(float g, float x, float beta, float threshold) {
  const float z = x * beta;
  return z > threshold ? g : g * sigmoid(z);  // sigmoid(z) = e^z / (e^z + 1) without the overflow
}
MN_HOST_DEVICE MN_SCALAR_INLINE float silu(float x) { return x * sigmoid(x); }
MN_HOST_DEVICE MN_SCALAR_INLINE float silu_backward(float g, float x) {
  const float s = sigmoid(x);
  return g * s * (1.0f + x * (1.0f - s));
}
// x > 0 false for NaN: NaN * slope stays NaN; the gradient there is g * slope (as PyTorch).
MN_HOST_DEVICE MN_SCALAR_INLINE float leaky_relu(float x, float slope) { return x > 0.0f ? x : x * slope; }
MN_HOST_DEVICE MN_SCALAR_INLINE float leaky_relu_backward(float g, float x, float slope) {
  return x > 0.0f ? g : g * slope;
}
MN_HOST_DEVICE MN_SCALAR_INLINE float elu(float x, float alpha) { return x <= 0.0f ? alpha * expm1f(x) : x; }
MN_HOST_DEVICE MN_SCALAR_INLINE float elu_backward(float g, float x, float alpha) {
  return x <= 0.0f ? g * alpha * expf(x) : g;
}
// Zero gradient at and beyond the bounds, g elsewhere (a NaN x passes g, as PyTorch's hardtanh_backward).
MN_HOST_DEVICE MN_SCALAR_INLINE float hardtanh_backward(float g, float x, float lo, float hi) {
  return x <= lo || x >= hi ? 0.0f : g;
}
// log(sigmoid(x)) without overflow or cancellation for large |x|.
MN_HOST_DEVICE MN_SCALAR_INLINE float log_sigmoid(float x) { return fminf(x, 0.0f) - log1pf(expf(-fabsf(x))); }

// ---------------- NaN-aware selections (T = float or int64_t) ----------------

template <class T>
MN_HOST_DEVICE MN_SCALAR_INLINE T clamp(T x, T lo, T hi) {
  return x < lo ? lo : (x > hi ? hi : x);  // NaN compares false both times and stays
}
template <class T>
MN_HOST_DEVICE MN_SCALAR_INLINE T maximum(T x, T y) {
  return x != x || x > y ? x : y;  // a NaN on either side wins
}
template <class T>
MN_HOST_DEVICE MN_SCALAR_INLINE T minimum(T x, T y) {
  return x != x || x < y ? x : y;
}

// ---------------- ops by kind ----------------

// Unary ops an i64 tensor takes (the rest need a float).
MN_HOST_DEVICE constexpr bool unary_takes_i64(UnaryOp op) {
  switch (op) {
    case UnaryOp::Neg:
    case UnaryOp::Abs:
    case UnaryOp::Sign:
    case UnaryOp::AddScalar:
    case UnaryOp::MulScalar:
    case UnaryOp::RSubScalar:
    case UnaryOp::Clamp: return true;
    case UnaryOp::Exp:
    case UnaryOp::Log:
    case UnaryOp::Log1p:
    case UnaryOp::Sqrt:
    case UnaryOp::Rsqrt:
    case UnaryOp::Relu:
    case UnaryOp::Gelu:
    case UnaryOp::Tanh:
    case UnaryOp::Sigmoid:
    case UnaryOp::Softplus:
    case UnaryOp::Square:
    case UnaryOp::Reciprocal:
    case UnaryOp::Sin:
    case UnaryOp::Cos:
    case UnaryOp::Erf:
    case UnaryOp::PowScalar:
    case UnaryOp::RDivScalar:
    case UnaryOp::Silu:
    case UnaryOp::LeakyRelu:
    case UnaryOp::Elu:
    case UnaryOp::Hardtanh:
    case UnaryOp::LogSigmoid: return false;
  }
  return false;
}

// Binary ops that read the scalar parameters alpha and beta (the binary_params kernel slot).
MN_HOST_DEVICE constexpr bool binary_takes_params(BinaryOp op) {
  return op == BinaryOp::SoftplusBackward || op == BinaryOp::LeakyReluBackward || op == BinaryOp::EluBackward ||
         op == BinaryOp::HardtanhBackward;
}

enum class BinaryKind { Arith, FloatArith, Compare };

// Compare: f32 0/1 output from two f32 or two i64 inputs. Arith: any dtype. FloatArith: f32 only.
MN_HOST_DEVICE constexpr BinaryKind binary_kind(BinaryOp op) {
  switch (op) {
    case BinaryOp::Add:
    case BinaryOp::Sub:
    case BinaryOp::Mul:
    case BinaryOp::Maximum:
    case BinaryOp::Minimum: return BinaryKind::Arith;
    case BinaryOp::Div:
    case BinaryOp::Pow:
    case BinaryOp::ReluBackward:
    case BinaryOp::GeluBackward:
    case BinaryOp::TanhBackward:
    case BinaryOp::SigmoidBackward:
    case BinaryOp::SoftplusBackward:
    case BinaryOp::SiluBackward:
    case BinaryOp::LogSigmoidBackward:
    case BinaryOp::LeakyReluBackward:
    case BinaryOp::EluBackward:
    case BinaryOp::HardtanhBackward: return BinaryKind::FloatArith;
    case BinaryOp::Eq:
    case BinaryOp::Ne:
    case BinaryOp::Lt:
    case BinaryOp::Le:
    case BinaryOp::Gt:
    case BinaryOp::Ge: return BinaryKind::Compare;
  }
  return BinaryKind::FloatArith;
}

// ---------------- the formulas ----------------

// Unary op on a float (alpha a, beta b as in kernels.h).
MN_HOST_DEVICE MN_SCALAR_INLINE float unary(UnaryOp op, float x, float a, float b) {
  switch (op) {
    case UnaryOp::Neg: return -x;
    case UnaryOp::Exp: return expf(x);
    case UnaryOp::Log: return logf(x);
    case UnaryOp::Log1p: return log1pf(x);
    case UnaryOp::Sqrt: return sqrtf(x);
    case UnaryOp::Rsqrt: return 1.0f / sqrtf(x);
    case UnaryOp::Abs: return fabsf(x);
    case UnaryOp::Sign: return static_cast<float>((x > 0.0f) - (x < 0.0f));
    case UnaryOp::Relu: return relu(x);
    case UnaryOp::Gelu: return gelu(x);
    case UnaryOp::Tanh: return tanhf(x);
    case UnaryOp::Sigmoid: return sigmoid(x);
    case UnaryOp::Softplus: return softplus(x, a, b);
    case UnaryOp::Square: return x * x;
    case UnaryOp::Reciprocal: return 1.0f / x;
    case UnaryOp::Sin: return sinf(x);
    case UnaryOp::Cos: return cosf(x);
    case UnaryOp::Erf: return erff(x);
    case UnaryOp::PowScalar:
      // The common exponents exactly (powf need not be exact for them on every device).
      if (a == 2.0f) return x * x;
      if (a == 0.5f) return sqrtf(x);
      return powf(x, a);
    case UnaryOp::Clamp: return clamp(x, a, b);
    case UnaryOp::AddScalar: return x + a;
    case UnaryOp::MulScalar: return x * a;
    case UnaryOp::RDivScalar: return a / x;
    case UnaryOp::RSubScalar: return a - x;
    case UnaryOp::Silu: return silu(x);
    case UnaryOp::LeakyRelu: return leaky_relu(x, a);
    case UnaryOp::Elu: return elu(x, a);
    case UnaryOp::Hardtanh: return clamp(x, a, b);
    case UnaryOp::LogSigmoid: return log_sigmoid(x);
  }
  op_unreachable("unary", static_cast<int>(op));
}

// Unary op on an i64; only the ops unary_takes_i64 accepts (callers check before launching).
MN_HOST_DEVICE MN_SCALAR_INLINE int64_t unary(UnaryOp op, int64_t x, int64_t a, int64_t b) {
  switch (op) {
    case UnaryOp::Neg: return -x;
    case UnaryOp::Abs: return x < 0 ? -x : x;
    case UnaryOp::Sign: return static_cast<int64_t>((x > 0) - (x < 0));
    case UnaryOp::AddScalar: return x + a;
    case UnaryOp::MulScalar: return x * a;
    case UnaryOp::RSubScalar: return a - x;
    case UnaryOp::Clamp: return clamp(x, a, b);
    case UnaryOp::Exp:
    case UnaryOp::Log:
    case UnaryOp::Log1p:
    case UnaryOp::Sqrt:
    case UnaryOp::Rsqrt:
    case UnaryOp::Relu:
    case UnaryOp::Gelu:
    case UnaryOp::Tanh:
    case UnaryOp::Sigmoid:
    case UnaryOp::Softplus:
    case UnaryOp::Square:
    case UnaryOp::Reciprocal:
    case UnaryOp::Sin:
    case UnaryOp::Cos:
    case UnaryOp::Erf:
    case UnaryOp::PowScalar:
    case UnaryOp::RDivScalar:
    case UnaryOp::Silu:
    case UnaryOp::LeakyRelu:
    case UnaryOp::Elu:
    case UnaryOp::Hardtanh:
    case UnaryOp::LogSigmoid: break;  // float only
  }
  op_unreachable("i64 unary", static_cast<int>(op));
}

// Comparison ops (binary_kind Compare) on two floats or two i64.
template <class T>
MN_HOST_DEVICE MN_SCALAR_INLINE float compare(BinaryOp op, T x, T y) {
  switch (op) {
    case BinaryOp::Eq: return static_cast<float>(x == y);
    case BinaryOp::Ne: return static_cast<float>(x != y);
    case BinaryOp::Lt: return static_cast<float>(x < y);
    case BinaryOp::Le: return static_cast<float>(x <= y);
    case BinaryOp::Gt: return static_cast<float>(x > y);
    case BinaryOp::Ge: return static_cast<float>(x >= y);
    case BinaryOp::Add:
    case BinaryOp::Sub:
    case BinaryOp::Mul:
    case BinaryOp::Div:
    case BinaryOp::Pow:
    case BinaryOp::Maximum:
    case BinaryOp::Minimum:
    case BinaryOp::ReluBackward:
    case BinaryOp::GeluBackward:
    case BinaryOp::TanhBackward:
    case BinaryOp::SigmoidBackward:
    case BinaryOp::SoftplusBackward:
    case BinaryOp::SiluBackward:
    case BinaryOp::LogSigmoidBackward:
    case BinaryOp::LeakyReluBackward:
    case BinaryOp::EluBackward:
    case BinaryOp::HardtanhBackward: break;  // not comparisons
  }
  op_unreachable("compare", static_cast<int>(op));
}

// Arithmetic ops on two floats: x is the first operand (or the gradient of a backward), y the second
// (or the backward's saved input or output); p and q are the scalar parameters of the ops
// binary_takes_params lists (alpha and beta in kernels.h).
MN_HOST_DEVICE MN_SCALAR_INLINE float binary(BinaryOp op, float x, float y, float p = 0.0f, float q = 0.0f) {
  switch (op) {
    case BinaryOp::Add: return x + y;
    case BinaryOp::Sub: return x - y;
    case BinaryOp::Mul: return x * y;
    case BinaryOp::Div: return x / y;
    case BinaryOp::Pow: return powf(x, y);
    case BinaryOp::Maximum: return maximum(x, y);
    case BinaryOp::Minimum: return minimum(x, y);
    case BinaryOp::ReluBackward: return relu_backward(x, y);
    case BinaryOp::GeluBackward: return x * gelu_grad(y);
    case BinaryOp::TanhBackward: return x * (1.0f - y * y);
    case BinaryOp::SigmoidBackward: return x * y * (1.0f - y);
    case BinaryOp::SoftplusBackward: return softplus_backward(x, y, p, q);
    case BinaryOp::SiluBackward: return silu_backward(x, y);
    case BinaryOp::LogSigmoidBackward: return x * sigmoid(-y);
    case BinaryOp::LeakyReluBackward: return leaky_relu_backward(x, y, p);
    case BinaryOp::EluBackward: return elu_backward(x, y, p);
    case BinaryOp::HardtanhBackward: return hardtanh_backward(x, y, p, q);
    case BinaryOp::Eq:
    case BinaryOp::Ne:
    case BinaryOp::Lt:
    case BinaryOp::Le:
    case BinaryOp::Gt:
    case BinaryOp::Ge: break;  // compare() has them
  }
  op_unreachable("binary", static_cast<int>(op));
}

// Arithmetic ops on two i64 (binary_kind Arith only).
MN_HOST_DEVICE MN_SCALAR_INLINE int64_t binary(BinaryOp op, int64_t x, int64_t y) {
  switch (op) {
    case BinaryOp::Add: return x + y;
    case BinaryOp::Sub: return x - y;
    case BinaryOp::Mul: return x * y;
    case BinaryOp::Maximum: return maximum(x, y);
    case BinaryOp::Minimum: return minimum(x, y);
    case BinaryOp::Div:
    case BinaryOp::Pow:
    case BinaryOp::ReluBackward:
    case BinaryOp::GeluBackward:
    case BinaryOp::TanhBackward:
    case BinaryOp::SigmoidBackward:
    case BinaryOp::SoftplusBackward:
    case BinaryOp::SiluBackward:
    case BinaryOp::LogSigmoidBackward:
    case BinaryOp::LeakyReluBackward:
    case BinaryOp::EluBackward:
    case BinaryOp::HardtanhBackward:
    case BinaryOp::Eq:
    case BinaryOp::Ne:
    case BinaryOp::Lt:
    case BinaryOp::Le:
    case BinaryOp::Gt:
    case BinaryOp::Ge: break;  // float only, or compare()
  }
  op_unreachable("i64 binary", static_cast<int>(op));
}

}  // namespace mn::kernels::math

#undef MN_SCALAR_INLINE
