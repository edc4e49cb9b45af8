// Elementwise ops and their backward formulas. First-order backward uses fused kernels
// (e.g. TanhBackward); when the backward itself is being recorded (create_graph) the same formula is
// written with differentiable ops so that double backward works.
#include <cmath>
#include <limits>

#include "autograd/functions/common.h"

namespace mn {

using autograd::GradContext;
using autograd::OutputContext;
using autograd::SavedTensor;
using autograd::TensorList;
using kernels::BinaryOp;
using kernels::UnaryOp;

namespace {

Tensor binary_raw(BinaryOp op, const Tensor& a, const Tensor& b, const char* name, bool compare = false) {
  detail::check_defined(name, a, "a");
  detail::check_defined(name, b, "b");
  detail::check_same_device(name, a, b);
  const DType dtype = detail::result_dtype(name, a, b);
  const Shape shape = broadcast_shapes(a.sizes(), b.sizes());
  Tensor out = empty(shape, TensorOptions(compare ? DType::f32 : dtype).with_device(a.device()));
  kernels::binary(a.device(), op, detail::expand_view(a, shape), detail::expand_view(b, shape), out);
  return out;
}

Tensor unary_raw(UnaryOp op, const Tensor& x, double alpha = 0, double beta = 0) {
  detail::check_defined("unary op", x, "x");
  Tensor out = empty(x.sizes(), x.options());
  kernels::unary(x.device(), op, x, out, alpha, beta);
  return out;
}

// Fused first-order backward kernel, e.g. grad * (1 - y^2).
Tensor fused_backward(BinaryOp op, const Tensor& g, const Tensor& saved) {
  Tensor out = empty(saved.sizes(), saved.options());
  kernels::binary(saved.device(), op, detail::expand_view(g, saved.sizes()), saved, out);
  return out;
}

void require_float(const char* op, const Tensor& x) { detail::check_float(op, x, "input"); }

}  // namespace

// ---------------- binary ----------------

Tensor add(const Tensor& a, const Tensor& b) {
  Tensor out = binary_raw(BinaryOp::Add, a, b, "add");
  if (autograd::needs_grad({&a, &b}))
    autograd::record("AddBackward", {&a, &b}, {&out}, [sa = a.sizes(), sb = b.sizes()](const GradContext& c) -> TensorList {
      return {c.needs(0) ? sum_to(c.grad(), sa) : Tensor(), c.needs(1) ? sum_to(c.grad(), sb) : Tensor()};
    });
  return out;
}

Tensor sub(const Tensor& a, const Tensor& b) {
  Tensor out = binary_raw(BinaryOp::Sub, a, b, "sub");
  if (autograd::needs_grad({&a, &b}))
    autograd::record("SubBackward", {&a, &b}, {&out}, [sa = a.sizes(), sb = b.sizes()](const GradContext& c) -> TensorList {
      return {c.needs(0) ? sum_to(c.grad(), sa) : Tensor(), c.needs(1) ? neg(sum_to(c.grad(), sb)) : Tensor()};
    });
  return out;
}

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor out = binary_raw(BinaryOp::Mul, a, b, "mul");
  if (autograd::needs_grad({&a, &b}))
    autograd::record("MulBackward", {&a, &b}, {&out},
                     [sa = SavedTensor::input(a), sb = SavedTensor::input(b)](const GradContext& c) -> TensorList {
                       Tensor a = sa.unpack("MulBackward"), b = sb.unpack("MulBackward");
                       return {c.needs(0) ? sum_to(mul(c.grad(), b), a.sizes()) : Tensor(),
                               c.needs(1) ? sum_to(mul(c.grad(), a), b.sizes()) : Tensor()};
                     });
  return out;
}

Tensor div(const Tensor& a, const Tensor& b) {
  Tensor out = binary_raw(BinaryOp::Div, a, b, "div");
  if (autograd::needs_grad({&a, &b}))
    autograd::record("DivBackward", {&a, &b}, {&out},
                     [sa = SavedTensor::input(a), sb = SavedTensor::input(b)](const GradContext& c) -> TensorList {
                       Tensor a = sa.unpack("DivBackward"), b = sb.unpack("DivBackward");
                       Tensor ga, gb;
                       if (c.needs(0)) ga = sum_to(div(c.grad(), b), a.sizes());
                       if (c.needs(1)) gb = sum_to(neg(div(mul(c.grad(), a), mul(b, b))), b.sizes());
                       return {ga, gb};
                     });
  return out;
}

Tensor pow(const Tensor& a, const Tensor& b) {
  require_float("pow", a);
  Tensor out = binary_raw(BinaryOp::Pow, a, b, "pow");
  if (autograd::needs_grad({&a, &b}))
    autograd::record(
        "PowBackward", {&a, &b}, {&out},
        [sa = SavedTensor::input(a), sb = SavedTensor::input(b)](const OutputContext& c) -> TensorList {
          Tensor a = sa.unpack("PowBackward"), b = sb.unpack("PowBackward");
          Tensor ga, gb;
          if (c.needs(0)) ga = sum_to(mul(c.grad(), mul(b, pow(a, sub(b, 1.0)))), a.sizes());
          if (c.needs(1)) {
            // d/db a^b = a^b log a, taken as 0 where a <= 0 (log undefined; matches the limit at a = 0).
            Tensor positive = gt(a, 0.0);
            Tensor safe_log = log(where(positive, a, ones_like(a)));
            gb = sum_to(mul(c.grad(), mul(c.output(), safe_log)), b.sizes());
          }
          return {ga, gb};
        },
        /*save_outputs=*/true);
  return out;
}

namespace {
// Gradient shares of a and b for max/min, as PyTorch: 1/2 each on ties, 0 for the side that loses
// and 1 otherwise, so both sides get the whole gradient where a NaN is involved (nothing compares).
std::pair<Tensor, Tensor> winner_masks(const Tensor& a, const Tensor& b, bool is_max) {
  const Tensor a_loses = is_max ? lt(a, b) : gt(a, b), b_loses = is_max ? gt(a, b) : lt(a, b);
  const Tensor tie_half = mul(eq(a, b), 0.5);
  return {rsub(add(a_loses, tie_half), 1.0), rsub(add(b_loses, tie_half), 1.0)};
}

Tensor extremum(const Tensor& a, const Tensor& b, bool is_max) {
  Tensor out = binary_raw(is_max ? BinaryOp::Maximum : BinaryOp::Minimum, a, b, is_max ? "maximum" : "minimum");
  if (autograd::needs_grad({&a, &b}))
    autograd::record(is_max ? "MaximumBackward" : "MinimumBackward", {&a, &b}, {&out},
                     [sa = SavedTensor::input(a), sb = SavedTensor::input(b), is_max](const GradContext& c) -> TensorList {
                       Tensor a = sa.unpack(), b = sb.unpack();
                       const auto [ma, mb] = winner_masks(a, b, is_max);
                       Tensor ga, gb;
                       if (c.needs(0)) ga = sum_to(mul(c.grad(), ma), a.sizes());
                       if (c.needs(1)) gb = sum_to(mul(c.grad(), mb), b.sizes());
                       return {ga, gb};
                     });
  return out;
}
}  // namespace

Tensor maximum(const Tensor& a, const Tensor& b) { return extremum(a, b, true); }
Tensor minimum(const Tensor& a, const Tensor& b) { return extremum(a, b, false); }

// ---------------- with a scalar ----------------

namespace {
// x*alpha + beta style scalar ops share one backward: grad * scale.
Tensor scalar_affine(const Tensor& x, UnaryOp op, double value, double grad_scale, const char* name) {
  Tensor out = unary_raw(op, x, value);
  if (autograd::needs_grad({&x}))
    autograd::record(name, {&x}, {&out}, [grad_scale](const GradContext& c) -> TensorList {
      return {grad_scale == 1.0 ? c.grad() : mul(c.grad(), grad_scale)};
    });
  return out;
}
}  // namespace

Tensor add(const Tensor& a, double b) { return scalar_affine(a, UnaryOp::AddScalar, b, 1.0, "AddScalarBackward"); }
Tensor sub(const Tensor& a, double b) { return scalar_affine(a, UnaryOp::AddScalar, -b, 1.0, "SubScalarBackward"); }
Tensor mul(const Tensor& a, double b) { return scalar_affine(a, UnaryOp::MulScalar, b, b, "MulScalarBackward"); }
Tensor div(const Tensor& a, double b) {
  require_float("div", a);
  return scalar_affine(a, UnaryOp::MulScalar, 1.0 / b, 1.0 / b, "DivScalarBackward");
}
Tensor rsub(const Tensor& a, double b) { return scalar_affine(a, UnaryOp::RSubScalar, b, -1.0, "RSubScalarBackward"); }

Tensor rdiv(const Tensor& a, double b) {
  require_float("rdiv", a);
  Tensor out = unary_raw(UnaryOp::RDivScalar, a, b);
  if (autograd::needs_grad({&a}))
    autograd::record("RDivScalarBackward", {&a}, {&out}, [sa = SavedTensor::input(a), b](const GradContext& c) -> TensorList {
      Tensor a = sa.unpack();
      return {mul(c.grad(), div(rdiv(mul(a, a), 1.0), -1.0 / b))};  // -b / a^2
    });
  return out;
}

Tensor pow(const Tensor& a, double p) {
  require_float("pow", a);
  Tensor out = unary_raw(UnaryOp::PowScalar, a, p);
  if (autograd::needs_grad({&a}))
    autograd::record("PowScalarBackward", {&a}, {&out}, [sa = SavedTensor::input(a), p](const GradContext& c) -> TensorList {
      if (p == 0.0) return {zeros_like(c.grad())};
      Tensor a = sa.unpack();
      Tensor d = p == 2.0 ? mul(a, 2.0) : mul(pow(a, p - 1.0), p);
      return {mul(c.grad(), d)};
    });
  return out;
}

// ---------------- unary ----------------

Tensor neg(const Tensor& x) { return scalar_affine(x, UnaryOp::Neg, 0.0, -1.0, "NegBackward"); }

Tensor exp(const Tensor& x) {
  require_float("exp", x);
  Tensor out = unary_raw(UnaryOp::Exp, x);
  if (autograd::needs_grad({&x}))
    autograd::record("ExpBackward", {&x}, {&out},
                     [](const OutputContext& c) -> TensorList { return {mul(c.grad(), c.output())}; }, true);
  return out;
}

Tensor log(const Tensor& x) {
  require_float("log", x);
  Tensor out = unary_raw(UnaryOp::Log, x);
  if (autograd::needs_grad({&x}))
    autograd::record("LogBackward", {&x}, {&out}, [sx = SavedTensor::input(x)](const GradContext& c) -> TensorList {
      return {div(c.grad(), sx.unpack("LogBackward"))};
    });
  return out;
}

Tensor log1p(const Tensor& x) {
  require_float("log1p", x);
  Tensor out = unary_raw(UnaryOp::Log1p, x);
  if (autograd::needs_grad({&x}))
    autograd::record("Log1pBackward", {&x}, {&out}, [sx = SavedTensor::input(x)](const GradContext& c) -> TensorList {
      return {div(c.grad(), add(sx.unpack("Log1pBackward"), 1.0))};
    });
  return out;
}

Tensor sqrt(const Tensor& x) {
  require_float("sqrt", x);
  Tensor out = unary_raw(UnaryOp::Sqrt, x);
  if (autograd::needs_grad({&x}))
    autograd::record("SqrtBackward", {&x}, {&out},
                     [](const OutputContext& c) -> TensorList { return {div(mul(c.grad(), 0.5), c.output())}; }, true);
  return out;
}

Tensor rsqrt(const Tensor& x) {
  require_float("rsqrt", x);
  Tensor out = unary_raw(UnaryOp::Rsqrt, x);
  if (autograd::needs_grad({&x}))
    autograd::record("RsqrtBackward", {&x}, {&out}, [](const OutputContext& c) -> TensorList {
      Tensor y = c.output();
      return {mul(c.grad(), mul(mul(y, mul(y, y)), -0.5))};
    }, true);
  return out;
}

Tensor abs(const Tensor& x) {
  Tensor out = unary_raw(UnaryOp::Abs, x);
  if (autograd::needs_grad({&x}))
    autograd::record("AbsBackward", {&x}, {&out}, [sx = SavedTensor::input(x)](const GradContext& c) -> TensorList {
      return {mul(c.grad(), sign(sx.unpack("AbsBackward")))};
    });
  return out;
}

Tensor sign(const Tensor& x) {
  Tensor out = unary_raw(UnaryOp::Sign, x);
  if (autograd::needs_grad({&x}))
    autograd::record("SignBackward", {&x}, {&out},
                     [](const GradContext& c) -> TensorList { return {zeros_like(c.grad())}; });
  return out;
}

Tensor relu(const Tensor& x) {
  require_float("relu", x);
  Tensor out = unary_raw(UnaryOp::Relu, x);
  if (autograd::needs_grad({&x}))
    autograd::record("ReluBackward", {&x}, {&out}, [](const OutputContext& c) -> TensorList {
      Tensor y = c.output();
      // Zero only where y <= 0: a NaN output passes its gradient (PyTorch's threshold_backward).
      if (autograd::grad_mode_enabled()) return {mul(c.grad(), rsub(le(y, 0.0), 1.0))};
      return {fused_backward(BinaryOp::ReluBackward, c.grad(), y)};
    }, true);
  return out;
}

Tensor gelu(const Tensor& x) {
  require_float("gelu", x);
  Tensor out = unary_raw(UnaryOp::Gelu, x);
  if (autograd::needs_grad({&x}))
    autograd::record("GeluBackward", {&x}, {&out}, [sx = SavedTensor::input(x)](const GradContext& c) -> TensorList {
      Tensor x = sx.unpack("GeluBackward");
      if (!autograd::grad_mode_enabled()) return {fused_backward(BinaryOp::GeluBackward, c.grad(), x)};
      // gelu'(x) = Phi(x) + x phi(x)
      Tensor cdf = mul(add(erf(mul(x, M_SQRT1_2)), 1.0), 0.5);
      Tensor pdf = mul(exp(mul(mul(x, x), -0.5)), 0.3989422804014327);
      return {mul(c.grad(), add(cdf, mul(x, pdf)))};
    });
  return out;
}

Tensor tanh(const Tensor& x) {
  require_float("tanh", x);
  Tensor out = unary_raw(UnaryOp::Tanh, x);
  if (autograd::needs_grad({&x}))
    autograd::record("TanhBackward", {&x}, {&out}, [](const OutputContext& c) -> TensorList {
      Tensor y = c.output();
      if (!autograd::grad_mode_enabled()) return {fused_backward(BinaryOp::TanhBackward, c.grad(), y)};
      return {mul(c.grad(), rsub(mul(y, y), 1.0))};
    }, true);
  return out;
}

Tensor sigmoid(const Tensor& x) {
  require_float("sigmoid", x);
  Tensor out = unary_raw(UnaryOp::Sigmoid, x);
  if (autograd::needs_grad({&x}))
    autograd::record("SigmoidBackward", {&x}, {&out}, [](const OutputContext& c) -> TensorList {
      Tensor y = c.output();
      if (!autograd::grad_mode_enabled()) return {fused_backward(BinaryOp::SigmoidBackward, c.grad(), y)};
      return {mul(c.grad(), mul(y, rsub(y, 1.0)))};
    }, true);
  return out;
}

Tensor square(const Tensor& x) {
  require_float("square", x);
  Tensor out = unary_raw(UnaryOp::Square, x);
  if (autograd::needs_grad({&x}))
    autograd::record("SquareBackward", {&x}, {&out}, [sx = SavedTensor::input(x)](const GradContext& c) -> TensorList {
      return {mul(c.grad(), mul(sx.unpack("SquareBackward"), 2.0))};
    });
  return out;
}

Tensor reciprocal(const Tensor& x) {
  require_float("reciprocal", x);
  Tensor out = unary_raw(UnaryOp::Reciprocal, x);
  if (autograd::needs_grad({&x}))
    autograd::record("ReciprocalBackward", {&x}, {&out}, [](const OutputContext& c) -> TensorList {
      Tensor y = c.output();
      return {neg(mul(c.grad(), mul(y, y)))};
    }, true);
  return out;
}

Tensor sin(const Tensor& x) {
  require_float("sin", x);
  Tensor out = unary_raw(UnaryOp::Sin, x);
  if (autograd::needs_grad({&x}))
    autograd::record("SinBackward", {&x}, {&out}, [sx = SavedTensor::input(x)](const GradContext& c) -> TensorList {
      return {mul(c.grad(), cos(sx.unpack("SinBackward")))};
    });
  return out;
}

Tensor cos(const Tensor& x) {
  require_float("cos", x);
  Tensor out = unary_raw(UnaryOp::Cos, x);
  if (autograd::needs_grad({&x}))
    autograd::record("CosBackward", {&x}, {&out}, [sx = SavedTensor::input(x)](const GradContext& c) -> TensorList {
      return {neg(mul(c.grad(), sin(sx.unpack("CosBackward"))))};
    });
  return out;
}

Tensor erf(const Tensor& x) {
  require_float("erf", x);
  Tensor out = unary_raw(UnaryOp::Erf, x);
  if (autograd::needs_grad({&x}))
    autograd::record("ErfBackward", {&x}, {&out}, [sx = SavedTensor::input(x)](const GradContext& c) -> TensorList {
      Tensor x = sx.unpack("ErfBackward");
      return {mul(c.grad(), mul(exp(neg(mul(x, x))), 1.1283791670955126))};  // 2/sqrt(pi)
    });
  return out;
}

Tensor clamp(const Tensor& x, std::optional<double> lo, std::optional<double> hi) {
  const double inf = std::numeric_limits<double>::infinity();
  const double a = lo.value_or(-inf), b = hi.value_or(inf);
  MN_CHECK(!std::isnan(a) && !std::isnan(b), ValueError, "clamp: a bound is NaN (min ", a, ", max ", b, ")");
  MN_CHECK(a <= b, ValueError, "clamp: lower bound ", a, " is greater than upper bound ", b);
  Tensor out = empty(x.sizes(), x.options());
  if (x.dtype() == DType::i64)
    kernels::unary(x.device(), UnaryOp::Clamp, x, out, lo ? a : double(std::numeric_limits<int64_t>::min()),
                   hi ? b : double(std::numeric_limits<int64_t>::max()));
  else
    kernels::unary(x.device(), UnaryOp::Clamp, x, out, a, b);
  if (autograd::needs_grad({&x}))
    autograd::record("ClampBackward", {&x}, {&out}, [sx = SavedTensor::input(x), a, b](const GradContext& c) -> TensorList {
      Tensor x = sx.unpack("ClampBackward");
      return {mul(c.grad(), mul(ge(x, a), le(x, b)))};
    });
  return out;
}

// ---------------- comparisons and where ----------------

Tensor eq(const Tensor& a, const Tensor& b) { return binary_raw(BinaryOp::Eq, a, b, "eq", true); }
Tensor ne(const Tensor& a, const Tensor& b) { return binary_raw(BinaryOp::Ne, a, b, "ne", true); }
Tensor lt(const Tensor& a, const Tensor& b) { return binary_raw(BinaryOp::Lt, a, b, "lt", true); }
Tensor le(const Tensor& a, const Tensor& b) { return binary_raw(BinaryOp::Le, a, b, "le", true); }
Tensor gt(const Tensor& a, const Tensor& b) { return binary_raw(BinaryOp::Gt, a, b, "gt", true); }
Tensor ge(const Tensor& a, const Tensor& b) { return binary_raw(BinaryOp::Ge, a, b, "ge", true); }

namespace {
Tensor scalar_like(const Tensor& a, double v) {
  return full({}, v, a.options());
}
}  // namespace

Tensor eq(const Tensor& a, double b) { return eq(a, scalar_like(a, b)); }
Tensor ne(const Tensor& a, double b) { return ne(a, scalar_like(a, b)); }
Tensor lt(const Tensor& a, double b) { return lt(a, scalar_like(a, b)); }
Tensor le(const Tensor& a, double b) { return le(a, scalar_like(a, b)); }
Tensor gt(const Tensor& a, double b) { return gt(a, scalar_like(a, b)); }
Tensor ge(const Tensor& a, double b) { return ge(a, scalar_like(a, b)); }

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  detail::check_defined("where", cond, "cond");
  detail::check_float("where", cond, "cond");
  detail::check_same_device("where", cond, a);
  detail::check_same_device("where", a, b);
  const DType dtype = detail::result_dtype("where", a, b);
  const Shape shape = broadcast_shapes(cond.sizes(), broadcast_shapes(a.sizes(), b.sizes()));
  Tensor out = empty(shape, TensorOptions(dtype).with_device(a.device()));
  kernels::where(a.device(), detail::expand_view(cond, shape), detail::expand_view(a, shape),
                 detail::expand_view(b, shape), out);
  if (autograd::needs_grad({&a, &b}))
    autograd::record("WhereBackward", {&a, &b}, {&out},
                     [sc = SavedTensor::input(cond), sa = a.sizes(), sb = b.sizes()](const GradContext& c) -> TensorList {
                       Tensor cond = sc.unpack("WhereBackward");
                       Tensor zero = zeros({}, c.grad().options());
                       Tensor ga, gb;
                       if (c.needs(0)) ga = sum_to(where(cond, c.grad(), zero), sa);
                       if (c.needs(1)) gb = sum_to(where(cond, zero, c.grad()), sb);
                       return {ga, gb};
                     });
  return out;
}

}  // namespace mn
