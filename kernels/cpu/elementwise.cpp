// CPU elementwise kernels: unary math, binary arithmetic and comparisons, where, fill, copy and the
// Philox random fill. The formulas live in kernels/scalar_math.h, shared with the CUDA twins; each op
// is picked outside the loop so the inner loop stays branch-free.
#include <cmath>
#include <cstring>

#include "kernels/cpu/loops.h"
#include "kernels/kernels.h"
#include "kernels/scalar_math.h"

namespace mn::kernels {
namespace {

using cpu::map;

// Runs `op` as a compile-time constant: math::unary / math::binary fold to the op's formula, so the
// loop body has no switch and vectorises as a hand-written lambda would.
template <UnaryOp kOp, class T>
void unary_as(const Tensor& in, Tensor& out, T a, T b) {
  if constexpr (std::is_same_v<T, float> || math::unary_takes_i64(kOp))
    map<T, T>(out, [a, b](T x) { return math::unary(kOp, x, a, b); }, in);
  else
    op_unreachable("i64 unary", static_cast<int>(kOp));  // unary_cpu refuses these first
}

template <class T>
void unary_typed(UnaryOp op, const Tensor& in, Tensor& out, T a, T b) {
  switch (op) {
    case UnaryOp::Neg: return unary_as<UnaryOp::Neg>(in, out, a, b);
    case UnaryOp::Exp: return unary_as<UnaryOp::Exp>(in, out, a, b);
    case UnaryOp::Log: return unary_as<UnaryOp::Log>(in, out, a, b);
    case UnaryOp::Log1p: return unary_as<UnaryOp::Log1p>(in, out, a, b);
    case UnaryOp::Sqrt: return unary_as<UnaryOp::Sqrt>(in, out, a, b);
    case UnaryOp::Rsqrt: return unary_as<UnaryOp::Rsqrt>(in, out, a, b);
    case UnaryOp::Abs: return unary_as<UnaryOp::Abs>(in, out, a, b);
    case UnaryOp::Sign: return unary_as<UnaryOp::Sign>(in, out, a, b);
    case UnaryOp::Relu: return unary_as<UnaryOp::Relu>(in, out, a, b);
    case UnaryOp::Gelu: return unary_as<UnaryOp::Gelu>(in, out, a, b);
    case UnaryOp::Tanh: return unary_as<UnaryOp::Tanh>(in, out, a, b);
    case UnaryOp::Sigmoid: return unary_as<UnaryOp::Sigmoid>(in, out, a, b);
    case UnaryOp::Softplus: return unary_as<UnaryOp::Softplus>(in, out, a, b);
    case UnaryOp::Square: return unary_as<UnaryOp::Square>(in, out, a, b);
    case UnaryOp::Reciprocal: return unary_as<UnaryOp::Reciprocal>(in, out, a, b);
    case UnaryOp::Sin: return unary_as<UnaryOp::Sin>(in, out, a, b);
    case UnaryOp::Cos: return unary_as<UnaryOp::Cos>(in, out, a, b);
    case UnaryOp::Erf: return unary_as<UnaryOp::Erf>(in, out, a, b);
    case UnaryOp::PowScalar:
      // The exponent is fixed for the whole loop: the exact special cases are picked here, once.
      if (a == T(2)) return unary_as<UnaryOp::Square>(in, out, a, b);
      if (a == T(0.5)) return unary_as<UnaryOp::Sqrt>(in, out, a, b);
      return unary_as<UnaryOp::PowScalar>(in, out, a, b);
    case UnaryOp::Clamp: return unary_as<UnaryOp::Clamp>(in, out, a, b);
    case UnaryOp::AddScalar: return unary_as<UnaryOp::AddScalar>(in, out, a, b);
    case UnaryOp::MulScalar: return unary_as<UnaryOp::MulScalar>(in, out, a, b);
    case UnaryOp::RDivScalar: return unary_as<UnaryOp::RDivScalar>(in, out, a, b);
    case UnaryOp::RSubScalar: return unary_as<UnaryOp::RSubScalar>(in, out, a, b);
    case UnaryOp::Silu: return unary_as<UnaryOp::Silu>(in, out, a, b);
    case UnaryOp::LeakyRelu: return unary_as<UnaryOp::LeakyRelu>(in, out, a, b);
    case UnaryOp::Elu: return unary_as<UnaryOp::Elu>(in, out, a, b);
    case UnaryOp::Hardtanh: return unary_as<UnaryOp::Hardtanh>(in, out, a, b);
    case UnaryOp::LogSigmoid: return unary_as<UnaryOp::LogSigmoid>(in, out, a, b);
  }
  op_unreachable("unary", static_cast<int>(op));
}

void unary_cpu(UnaryOp op, const Tensor& in, Tensor& out, double alpha, double beta) {
  if (in.dtype() == DType::f32)
    return unary_typed<float>(op, in, out, static_cast<float>(alpha), static_cast<float>(beta));
  if (!math::unary_takes_i64(op))
    throw TypeError(str("unary op ", static_cast<int>(op), " is not defined for dtype ", dtype_name(in.dtype())));
  unary_typed<int64_t>(op, in, out, saturating_i64(alpha), saturating_i64(beta));
}

// p and q: the scalar parameters of the ops math::binary_takes_params lists (0 for the others).
template <BinaryOp kOp, class T>
void binary_as(const Tensor& a, const Tensor& b, Tensor& out, float p, float q) {
  constexpr math::BinaryKind kind = math::binary_kind(kOp);
  if constexpr (kind == math::BinaryKind::Compare)
    map<float, T, T>(out, [](T x, T y) { return math::compare(kOp, x, y); }, a, b);
  else if constexpr (std::is_same_v<T, float>)
    map<T, T, T>(out, [p, q](T x, T y) { return math::binary(kOp, x, y, p, q); }, a, b);
  else if constexpr (kind == math::BinaryKind::Arith)
    map<T, T, T>(out, [](T x, T y) { return math::binary(kOp, x, y); }, a, b);
  else
    op_unreachable("i64 binary", static_cast<int>(kOp));  // binary_cpu refuses these first
}

template <class T>
void binary_typed(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& out, float p = 0.0f, float q = 0.0f) {
  switch (op) {
    case BinaryOp::Add: return binary_as<BinaryOp::Add, T>(a, b, out, p, q);
    case BinaryOp::Sub: return binary_as<BinaryOp::Sub, T>(a, b, out, p, q);
    case BinaryOp::Mul: return binary_as<BinaryOp::Mul, T>(a, b, out, p, q);
    case BinaryOp::Div: return binary_as<BinaryOp::Div, T>(a, b, out, p, q);
    case BinaryOp::Pow: return binary_as<BinaryOp::Pow, T>(a, b, out, p, q);
    case BinaryOp::Maximum: return binary_as<BinaryOp::Maximum, T>(a, b, out, p, q);
    case BinaryOp::Minimum: return binary_as<BinaryOp::Minimum, T>(a, b, out, p, q);
    case BinaryOp::Eq: return binary_as<BinaryOp::Eq, T>(a, b, out, p, q);
    case BinaryOp::Ne: return binary_as<BinaryOp::Ne, T>(a, b, out, p, q);
    case BinaryOp::Lt: return binary_as<BinaryOp::Lt, T>(a, b, out, p, q);
    case BinaryOp::Le: return binary_as<BinaryOp::Le, T>(a, b, out, p, q);
    case BinaryOp::Gt: return binary_as<BinaryOp::Gt, T>(a, b, out, p, q);
    case BinaryOp::Ge: return binary_as<BinaryOp::Ge, T>(a, b, out, p, q);
    case BinaryOp::ReluBackward: return binary_as<BinaryOp::ReluBackward, T>(a, b, out, p, q);
    case BinaryOp::GeluBackward: return binary_as<BinaryOp::GeluBackward, T>(a, b, out, p, q);
    case BinaryOp::TanhBackward: return binary_as<BinaryOp::TanhBackward, T>(a, b, out, p, q);
    case BinaryOp::SigmoidBackward: return binary_as<BinaryOp::SigmoidBackward, T>(a, b, out, p, q);
    case BinaryOp::SoftplusBackward: return binary_as<BinaryOp::SoftplusBackward, T>(a, b, out, p, q);
    case BinaryOp::SiluBackward: return binary_as<BinaryOp::SiluBackward, T>(a, b, out, p, q);
    case BinaryOp::LogSigmoidBackward: return binary_as<BinaryOp::LogSigmoidBackward, T>(a, b, out, p, q);
    case BinaryOp::LeakyReluBackward: return binary_as<BinaryOp::LeakyReluBackward, T>(a, b, out, p, q);
    case BinaryOp::EluBackward: return binary_as<BinaryOp::EluBackward, T>(a, b, out, p, q);
    case BinaryOp::HardtanhBackward: return binary_as<BinaryOp::HardtanhBackward, T>(a, b, out, p, q);
  }
  op_unreachable("binary", static_cast<int>(op));
}

void binary_cpu(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& out) {
  if (math::binary_takes_params(op))
    throw TypeError(str("binary op ", static_cast<int>(op), " takes scalar parameters: call binary_params"));
  if (a.dtype() == DType::f32) return binary_typed<float>(op, a, b, out);
  if (math::binary_kind(op) == math::BinaryKind::FloatArith)
    throw TypeError(str("binary op ", static_cast<int>(op), " is not defined for dtype ", dtype_name(a.dtype())));
  binary_typed<int64_t>(op, a, b, out);
}

void binary_params_cpu(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& out, double alpha, double beta) {
  if (!math::binary_takes_params(op))
    throw TypeError(str("binary op ", static_cast<int>(op), " takes no scalar parameters: call binary"));
  if (a.dtype() != DType::f32 || b.dtype() != DType::f32)
    throw TypeError(str("binary op ", static_cast<int>(op), " expects f32 operands, got ", dtype_name(a.dtype()),
                        " and ", dtype_name(b.dtype())));
  binary_typed<float>(op, a, b, out, static_cast<float>(alpha), static_cast<float>(beta));
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
  visit_dtype(dst.dtype(), [&](auto dst_tag) {
    visit_dtype(src.dtype(), [&](auto src_tag) {
      using D = decltype(dst_tag);
      using S = decltype(src_tag);
      map<D, S>(dst, [](S x) { return convert_element<D>(x); }, src);
    });
  });
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
  binary_params.set(DeviceType::CPU, binary_params_cpu);
  where.set(DeviceType::CPU, where_cpu);
  fill.set(DeviceType::CPU, fill_cpu);
  copy.set(DeviceType::CPU, copy_cpu, /*reduced_precision=*/true);
  random_fill.set(DeviceType::CPU, random_cpu);
}

}  // namespace mn::kernels
