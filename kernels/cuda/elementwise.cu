// CUDA elementwise kernels: unary math, binary arithmetic, comparisons and activation backwards, and
// where. Twins of kernels/cpu/elementwise.cpp: both evaluate the formulas of kernels/scalar_math.h
// (same NaN and i64 rules). Operands are
// views of the output's shape with arbitrary (possibly zero) strides: dims are collapsed on the host
// as in the CPU loop, and a dense layout shared by all operands runs as a flat index. Each op is a
// small functor with a switch on the op (uniform across threads); one grid-stride loop per launch.
#include <cmath>

#include "kernels/cuda/compute_utils.cuh"
#include "kernels/cuda/widened.cuh"
#include "kernels/scalar_math.h"

namespace mn::kernels {
namespace {

using cuda::kThreads;

// ---------------- layout of N operands over one shape ----------------

template <int N>
struct Loop {
  int ndim = 0;
  bool flat = false;  // all operands dense with unit inner stride: element i is at offset i
  cuda::Divider sizes[kMaxDims] = {};  // divides linear indices below the element count
  int64_t strides[N][kMaxDims] = {};

  __device__ void offsets(int64_t linear, int64_t* off) const {
    for (int k = 0; k < N; ++k) off[k] = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      int64_t q, i;
      sizes[d].divmod(linear, &q, &i);
      linear = q;
      for (int k = 0; k < N; ++k) off[k] += i * strides[k][d];
    }
  }
};

// ops[0] is the output; all operands have the output's shape.
template <int N>
Loop<N> make_loop(const Shape& shape, const Tensor* const (&ops)[N]) {
  // Every operand on the output's device: a host pointer in a launch would poison the context.
  static constexpr const char* kArgs[] = {"out", "first input", "second input", "third input"};
  for (int k = 0; k < N; ++k) cuda::check_on_device("elementwise kernel", *ops[k], ops[0]->device().index, kArgs[k]);
  Loop<N> loop;
  int64_t sizes[kMaxDims] = {};
  for (int d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    const int n = loop.ndim;
    bool merge = n > 0;
    for (int k = 0; k < N && merge; ++k) merge = loop.strides[k][n - 1] == ops[k]->stride(d) * shape[d];
    if (merge) {
      sizes[n - 1] *= shape[d];
      for (int k = 0; k < N; ++k) loop.strides[k][n - 1] = ops[k]->stride(d);
    } else {
      sizes[n] = shape[d];
      for (int k = 0; k < N; ++k) loop.strides[k][n] = ops[k]->stride(d);
      loop.ndim = n + 1;
    }
  }
  const int64_t numel = shape.numel();
  for (int d = 0; d < loop.ndim; ++d) loop.sizes[d] = cuda::Divider(sizes[d], numel);
  loop.flat = loop.ndim == 0;
  if (loop.ndim == 1) {
    loop.flat = true;
    for (int k = 0; k < N; ++k) loop.flat = loop.flat && loop.strides[k][0] == 1;
  }
  return loop;
}

// ---------------- kernels ----------------

template <class Out, class A, class F>
__global__ void map1_kernel(Loop<2> loop, int64_t n, Out* out, const A* a, F f) {
  MN_CUDA_KERNEL_LOOP(i, n) {
    if (loop.flat) {
      out[i] = f(a[i]);
    } else {
      int64_t off[2];
      loop.offsets(i, off);
      out[off[0]] = f(a[off[1]]);
    }
  }
}

template <class Out, class A, class B, class F>
__global__ void map2_kernel(Loop<3> loop, int64_t n, Out* out, const A* a, const B* b, F f) {
  MN_CUDA_KERNEL_LOOP(i, n) {
    if (loop.flat) {
      out[i] = f(a[i], b[i]);
    } else {
      int64_t off[3];
      loop.offsets(i, off);
      out[off[0]] = f(a[off[1]], b[off[2]]);
    }
  }
}

template <class Out, class C, class A, class B, class F>
__global__ void map3_kernel(Loop<4> loop, int64_t n, Out* out, const C* c, const A* a, const B* b, F f) {
  MN_CUDA_KERNEL_LOOP(i, n) {
    if (loop.flat) {
      out[i] = f(c[i], a[i], b[i]);
    } else {
      int64_t off[4];
      loop.offsets(i, off);
      out[off[0]] = f(c[off[1]], a[off[2]], b[off[3]]);
    }
  }
}

template <class Out, class A, class F>
void launch1(const Tensor& in, Tensor& out, F f) {
  const int64_t n = out.numel();
  if (n == 0) return;
  const Tensor* ops[2] = {&out, &in};
  const Loop<2> loop = make_loop<2>(out.sizes(), ops);
  map1_kernel<Out, A, F><<<cuda::blocks_for(n), kThreads, 0, cuda::stream_of(out)>>>(
      loop, n, static_cast<Out*>(out.raw_data()), static_cast<const A*>(in.raw_data()), f);
  MN_CUDA_CHECK_LAUNCH();
}

template <class Out, class A, class B, class F>
void launch2(const Tensor& a, const Tensor& b, Tensor& out, F f) {
  const int64_t n = out.numel();
  if (n == 0) return;
  const Tensor* ops[3] = {&out, &a, &b};
  const Loop<3> loop = make_loop<3>(out.sizes(), ops);
  map2_kernel<Out, A, B, F><<<cuda::blocks_for(n), kThreads, 0, cuda::stream_of(out)>>>(
      loop, n, static_cast<Out*>(out.raw_data()), static_cast<const A*>(a.raw_data()),
      static_cast<const B*>(b.raw_data()), f);
  MN_CUDA_CHECK_LAUNCH();
}

template <class Out, class C, class A, class B, class F>
void launch3(const Tensor& c, const Tensor& a, const Tensor& b, Tensor& out, F f) {
  const int64_t n = out.numel();
  if (n == 0) return;
  const Tensor* ops[4] = {&out, &c, &a, &b};
  const Loop<4> loop = make_loop<4>(out.sizes(), ops);
  map3_kernel<Out, C, A, B, F><<<cuda::blocks_for(n), kThreads, 0, cuda::stream_of(out)>>>(
      loop, n, static_cast<Out*>(out.raw_data()), static_cast<const C*>(c.raw_data()),
      static_cast<const A*>(a.raw_data()), static_cast<const B*>(b.raw_data()), f);
  MN_CUDA_CHECK_LAUNCH();
}

// ---------------- unary and binary: the formulas of kernels/scalar_math.h ----------------

template <class T>
struct Unary {
  UnaryOp op;
  T a, b;
  __device__ T operator()(T x) const { return math::unary(op, x, a, b); }
};

// 16-bit storage, f32 math: each operand is widened on load and the result rounded once on store, the
// bits the CPU's widened kernels give (kernels/dispatch.h) without their extra passes.
template <class S, class F>
struct Narrowing {
  F f;
  template <class... X>
  __device__ S operator()(X... x) const {
    return S(f(static_cast<float>(x)...));
  }
};

// A comparison of 16-bit operands: an f32 mask, as for every dtype.
template <class S>
struct Compare16 {
  BinaryOp op;
  __device__ float operator()(S x, S y) const { return math::compare(op, static_cast<float>(x), static_cast<float>(y)); }
};

void unary_cuda(UnaryOp op, const Tensor& in, Tensor& out, double alpha, double beta) {
  if (is_reduced_precision(in.dtype()) || is_reduced_precision(out.dtype())) {
    MN_CHECK(in.dtype() == out.dtype(), TypeError, "unary op: expected input and output of one dtype, got ",
             in.dtype(), " and ", out.dtype());
    const Unary<float> f{op, static_cast<float>(alpha), static_cast<float>(beta)};
    if (in.dtype() == DType::bf16) return launch1<BFloat16, BFloat16>(in, out, Narrowing<BFloat16, Unary<float>>{f});
    return launch1<Half, Half>(in, out, Narrowing<Half, Unary<float>>{f});
  }
  if (in.dtype() == DType::f32)
    return launch1<float, float>(in, out, Unary<float>{op, static_cast<float>(alpha), static_cast<float>(beta)});
  if (!math::unary_takes_i64(op))
    throw TypeError(str("unary op ", static_cast<int>(op), " is not defined for dtype ", dtype_name(in.dtype())));
  launch1<int64_t, int64_t>(in, out, Unary<int64_t>{op, saturating_i64(alpha), saturating_i64(beta)});
}

template <class T>
struct Compare {
  BinaryOp op;
  __device__ float operator()(T x, T y) const { return math::compare(op, x, y); }
};

template <class T>
struct Arith {
  BinaryOp op;
  __device__ T operator()(T x, T y) const { return math::binary(op, x, y); }
};

// The activation backwards with scalar parameters (math::binary_takes_params), f32 only.
struct ArithParams {
  BinaryOp op;
  float p, q;
  __device__ float operator()(float x, float y) const { return math::binary(op, x, y, p, q); }
};

void binary_cuda(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& out) {
  if (math::binary_takes_params(op))
    throw TypeError(str("binary op ", static_cast<int>(op), " takes scalar parameters: call binary_params"));
  const math::BinaryKind kind = math::binary_kind(op);
  if (lowp::is_reduced(a) || lowp::is_reduced(b) || lowp::is_reduced(out)) {
    const DType t = a.dtype();
    const bool compare = kind == math::BinaryKind::Compare;
    if (b.dtype() != t || (compare ? out.dtype() != DType::f32 : out.dtype() != t))
      return lowp::call_widened(binary_cuda, op, a, b, out);  // mixed dtypes: on f32 copies
    if (compare) {
      if (t == DType::bf16) return launch2<float, BFloat16, BFloat16>(a, b, out, Compare16<BFloat16>{op});
      return launch2<float, Half, Half>(a, b, out, Compare16<Half>{op});
    }
    if (t == DType::bf16) return launch2<BFloat16, BFloat16, BFloat16>(a, b, out, Narrowing<BFloat16, Arith<float>>{{op}});
    return launch2<Half, Half, Half>(a, b, out, Narrowing<Half, Arith<float>>{{op}});
  }
  const bool f32 = a.dtype() == DType::f32;
  if (kind == math::BinaryKind::Compare) {
    if (f32) return launch2<float, float, float>(a, b, out, Compare<float>{op});
    return launch2<float, int64_t, int64_t>(a, b, out, Compare<int64_t>{op});
  }
  if (f32) return launch2<float, float, float>(a, b, out, Arith<float>{op});
  if (kind == math::BinaryKind::FloatArith)
    throw TypeError(str("binary op ", static_cast<int>(op), " is not defined for dtype ", dtype_name(a.dtype())));
  launch2<int64_t, int64_t, int64_t>(a, b, out, Arith<int64_t>{op});
}

void binary_params_cuda(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& out, double alpha, double beta) {
  if (!math::binary_takes_params(op))
    throw TypeError(str("binary op ", static_cast<int>(op), " takes no scalar parameters: call binary"));
  if (a.dtype() != DType::f32 || b.dtype() != DType::f32)
    throw TypeError(str("binary op ", static_cast<int>(op), " expects f32 operands, got ", dtype_name(a.dtype()),
                        " and ", dtype_name(b.dtype())));
  launch2<float, float, float>(a, b, out, ArithParams{op, static_cast<float>(alpha), static_cast<float>(beta)});
}

// ---------------- where ----------------

template <class T>
struct Select {
  __device__ T operator()(float c, T x, T y) const { return c != 0 ? x : y; }
};

void where_cuda(const Tensor& cond, const Tensor& a, const Tensor& b, Tensor& out) {
  if (out.dtype() == DType::f32) return launch3<float, float, float, float>(cond, a, b, out, Select<float>{});
  launch3<int64_t, float, int64_t, int64_t>(cond, a, b, out, Select<int64_t>{});
}

}  // namespace

void register_cuda_elementwise() {
  unary.set(DeviceType::CUDA, unary_cuda, /*reduced_precision=*/true);
  binary.set(DeviceType::CUDA, binary_cuda, /*reduced_precision=*/true);
  binary_params.set(DeviceType::CUDA, binary_params_cuda);
  where.set(DeviceType::CUDA, where_cuda);
}

}  // namespace mn::kernels
