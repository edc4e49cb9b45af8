#pragma once
// Differentiable tensor operations. Elementwise binary ops broadcast numpy-style. Each op's forward
// kernels live in kernels/, its backward formula next to it in autograd/functions/<family>.cpp.
#include <concepts>
#include <optional>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "kernels/factories.h"

namespace mn {

// ---- elementwise binary (broadcasting) ----
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double b);
Tensor sub(const Tensor& a, double b);
Tensor mul(const Tensor& a, double b);
Tensor div(const Tensor& a, double b);
Tensor pow(const Tensor& a, double exponent);
Tensor rsub(const Tensor& a, double b);  // b - a
Tensor rdiv(const Tensor& a, double b);  // b / a

// ---- elementwise unary ----
Tensor neg(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor log1p(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor sign(const Tensor& x);  // gradient 0
Tensor relu(const Tensor& x);
Tensor gelu(const Tensor& x);  // exact (erf) form
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor softplus(const Tensor& x);  // softplus(x, 1, 20)
Tensor square(const Tensor& x);
Tensor reciprocal(const Tensor& x);
Tensor sin(const Tensor& x);
Tensor cos(const Tensor& x);
Tensor erf(const Tensor& x);
// Bounds may be omitted (std::nullopt) on either side; gradient passes where lo <= x <= hi.
Tensor clamp(const Tensor& x, std::optional<double> lo, std::optional<double> hi);
// Activations with PyTorch's formulas, gradients and NaN rules (autograd/functions/activation.cpp).
// softplus: x where x * beta > threshold, else log(1 + exp(x * beta)) / beta.
Tensor softplus(const Tensor& x, double beta, double threshold = 20.0);
Tensor silu(const Tensor& x);                                        // x * sigmoid(x)
Tensor leaky_relu(const Tensor& x, double negative_slope = 0.01);   // x > 0 ? x : slope * x
Tensor elu(const Tensor& x, double alpha = 1.0);                     // x > 0 ? x : alpha * (exp(x) - 1)
// clamp to [min_val, max_val]; gradient 0 at and beyond the bounds. ValueError when min_val > max_val.
Tensor hardtanh(const Tensor& x, double min_val = -1.0, double max_val = 1.0);
Tensor logsigmoid(const Tensor& x);                                  // log(sigmoid(x)), stable

// ---- comparisons and selection (no gradient; masks are f32 0/1) ----
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor eq(const Tensor& a, double b);
Tensor ne(const Tensor& a, double b);
Tensor lt(const Tensor& a, double b);
Tensor le(const Tensor& a, double b);
Tensor gt(const Tensor& a, double b);
Tensor ge(const Tensor& a, double b);
// cond != 0 ? a : b, broadcasting all three; differentiable in a and b.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);

// ---- reductions ----
// Dims are spelled as in PyTorch: one dim (`sum(x, 1)`), or a list (`sum(x, {0, 2})`; `{}` = all
// elements). A single dim is any integer type but bool; a floating or bool value matches no dim
// overload, so `var(x, 0.0)` cannot silently mean dim 0, nor `var(x, 1)` a correction.
template <class D>
concept DimIndex = std::integral<D> && !std::same_as<D, bool>;
template <class D>
concept NotADim = std::floating_point<D> || std::same_as<D, bool>;

Tensor sum(const Tensor& x);
Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim = false);
template <DimIndex D>
Tensor sum(const Tensor& x, D dim, bool keepdim = false) {
  return sum(x, std::vector<int64_t>{static_cast<int64_t>(dim)}, keepdim);
}
Tensor mean(const Tensor& x);
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim = false);
template <DimIndex D>
Tensor mean(const Tensor& x, D dim, bool keepdim = false) {
  return mean(x, std::vector<int64_t>{static_cast<int64_t>(dim)}, keepdim);
}
Tensor prod(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim = false);
template <DimIndex D>
Tensor prod(const Tensor& x, D dim, bool keepdim = false) {
  return prod(x, std::vector<int64_t>{static_cast<int64_t>(dim)}, keepdim);
}
Tensor max(const Tensor& x);  // all elements; refuses empty tensors
Tensor min(const Tensor& x);
// Over one dim: (values, indices i64); gradient flows to the selected elements.
std::pair<Tensor, Tensor> max(const Tensor& x, int64_t dim, bool keepdim = false);
std::pair<Tensor, Tensor> min(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor argmin(const Tensor& x, int64_t dim, bool keepdim = false);
// A floating or bool "dim" would be truncated into one silently: refused at compile time.
template <NotADim D>
std::pair<Tensor, Tensor> max(const Tensor& x, D dim, bool keepdim = false) = delete;
template <NotADim D>
std::pair<Tensor, Tensor> min(const Tensor& x, D dim, bool keepdim = false) = delete;
template <NotADim D>
Tensor argmax(const Tensor& x, D dim, bool keepdim = false) = delete;
template <NotADim D>
Tensor argmin(const Tensor& x, D dim, bool keepdim = false) = delete;
// correction: 0 = biased (population), 1 = unbiased (Bessel). (std_dev, not std: a function named
// std in namespace mn would make std:: ambiguous under `using namespace mn`.) All elements with a
// correction: var(x, {}, 0.0).
Tensor var(const Tensor& x, const std::vector<int64_t>& dims, double correction = 1.0, bool keepdim = false);
Tensor std_dev(const Tensor& x, const std::vector<int64_t>& dims, double correction = 1.0, bool keepdim = false);
template <DimIndex D>
Tensor var(const Tensor& x, D dim, double correction = 1.0, bool keepdim = false) {
  return var(x, std::vector<int64_t>{static_cast<int64_t>(dim)}, correction, keepdim);
}
template <DimIndex D>
Tensor std_dev(const Tensor& x, D dim, double correction = 1.0, bool keepdim = false) {
  return std_dev(x, std::vector<int64_t>{static_cast<int64_t>(dim)}, correction, keepdim);
}
Tensor var(const Tensor& x);  // all elements, unbiased
Tensor std_dev(const Tensor& x);
// p-norm over dims (all elements when dims is empty).
Tensor norm(const Tensor& x, double p = 2.0, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor logsumexp(const Tensor& x, int64_t dim, bool keepdim = false);
template <NotADim D>
Tensor logsumexp(const Tensor& x, D dim, bool keepdim = false) = delete;
// Sums x down to `shape` (the inverse of broadcasting); used by backward formulas.
Tensor sum_to(const Tensor& x, const Shape& shape);

// ---- indexing, scans and top-k (PyTorch's names and semantics) ----
// index (i64) has x's number of dims and index.size(d) <= x.size(d) for d != dim; the result has
// index's shape. Out-of-range index values -> IndexError. Gradient: scatter_add into zeros.
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index);
// A copy of x with src[..i..] added at x[..index[..i..]..] (index.size(d) <= src.size(d) for every d,
// <= x.size(d) for d != dim); repeated targets accumulate. Gradients: x gets the gradient unchanged,
// src gets it gathered at index (0 where src lies beyond the index's extent).
Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src);
// value where mask is non-zero (mask f32 0/1 as the comparison ops give, or i64; broadcast against
// x), x elsewhere; x's gradient is 0 where filled.
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value);
// Flat index (i64, 0-d) of the first largest / smallest element; a NaN counts as both (as PyTorch).
Tensor argmax(const Tensor& x);
Tensor argmin(const Tensor& x);
// Largest / smallest values over several dims (`{}` = all). The gradient is split evenly among the
// tied extremes of each slice (as PyTorch's amax).
Tensor amax(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor amin(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
template <DimIndex D>
Tensor amax(const Tensor& x, D dim, bool keepdim = false) {
  return amax(x, std::vector<int64_t>{static_cast<int64_t>(dim)}, keepdim);
}
template <DimIndex D>
Tensor amin(const Tensor& x, D dim, bool keepdim = false) {
  return amin(x, std::vector<int64_t>{static_cast<int64_t>(dim)}, keepdim);
}
// Inclusive running sum along dim (f32 summed in double, as PyTorch on the CPU; i64 exact).
Tensor cumsum(const Tensor& x, int64_t dim);
// The k largest (smallest when !largest) entries along dim as (values, i64 indices), largest
// (smallest) first and ties by lower position, NaN above every number; always sorted. Values are
// differentiable (the gradient goes back to the chosen positions).
std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k, int64_t dim = -1, bool largest = true, bool sorted = true);

// ---- linear algebra ----
// numpy semantics: 1-D·1-D dot, 2-D matrix product, N-D batched with broadcast batch dims.
Tensor matmul(const Tensor& a, const Tensor& b);
Tensor mm(const Tensor& a, const Tensor& b);   // [M,K] x [K,N]
Tensor bmm(const Tensor& a, const Tensor& b);  // [B,M,K] x [B,K,N]

// ---- softmax ----
Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);

// ---- shape and indexing (views are Tensor methods; these allocate) ----
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim = 0);
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim = 0);
std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim = 0);
// Views of consecutive pieces of the given sizes along dim (they must add up to its size), recorded as
// one node whose backward is a single cat of the pieces' gradients.
std::vector<Tensor> split_with_sizes(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim = 0);
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim = 0);
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);
// Differentiable view-producing free functions (the Tensor methods call these).
Tensor view(const Tensor& x, const Shape& shape);
Tensor reshape(const Tensor& x, const Shape& shape);
Tensor permute(const Tensor& x, const std::vector<int64_t>& dims);
Tensor transpose(const Tensor& x, int64_t d0, int64_t d1);
Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length);
Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step = 1);
Tensor select(const Tensor& x, int64_t dim, int64_t index);
Tensor squeeze(const Tensor& x, int64_t dim);
Tensor unsqueeze(const Tensor& x, int64_t dim);
Tensor expand(const Tensor& x, const Shape& shape);
Tensor flatten(const Tensor& x, int64_t start_dim = 0, int64_t end_dim = -1);
Tensor contiguous(const Tensor& x);
Tensor clone(const Tensor& x);
Tensor to_dtype(const Tensor& x, DType dtype);  // differentiable between float types only
Tensor to_device(const Tensor& x, Device device);

// ---- operators ----
inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator+(const Tensor& a, double b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, double b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, double b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, double b) { return div(a, b); }
inline Tensor operator+(double a, const Tensor& b) { return add(b, a); }
inline Tensor operator-(double a, const Tensor& b) { return rsub(b, a); }
inline Tensor operator*(double a, const Tensor& b) { return mul(b, a); }
inline Tensor operator/(double a, const Tensor& b) { return rdiv(b, a); }
inline Tensor operator-(const Tensor& x) { return neg(x); }

namespace detail {
// Installs the autograd layer's Tensor methods (view, backward, copy_, ...; core/tensor_hooks.h) in
// core; idempotent, returns 0.
int install_autograd_tensor_hooks();
namespace {
// One call per translation unit at static initialisation. It makes every program that includes this
// header link autograd/tensor_hooks.cpp (a static library would leave an object that nothing
// references out), and installs the methods before that unit's own static objects are built.
[[maybe_unused]] const int tensor_hooks_anchor = install_autograd_tensor_hooks();
}  // namespace
}  // namespace detail

}  // namespace mn
