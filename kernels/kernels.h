#pragma once
// Every kernel of the engine, by family. A kernel takes tensors whose shapes the op layer has already
// checked and broadcast (inputs of elementwise kernels are expanded views of the output's shape,
// possibly with zero or arbitrary strides) and writes preallocated outputs. The CPU versions live in
// kernels/cpu/<family>.cpp, the CUDA twins in kernels/cuda/<family>.cu; both must agree.
#include <cstdint>
#include <type_traits>

#include "core/random.h"
#include "core/tensor.h"
#include "kernels/dispatch.h"

namespace mn::kernels {

// A float or double converted to i64 the same way by every kernel of both backends: toward zero,
// saturating at the i64 range, NaN -> 0. A plain cast is undefined there (x86 gives INT64_MIN for
// everything out of range, the GPU's cvt saturates), and a one-sided clamp passes 2^63 as its bound.
template <class F>
MN_HOST_DEVICE inline int64_t saturating_i64(F v) {
  if (v != v) return 0;
  if (v >= F(9223372036854775808.0)) return INT64_MAX;
  if (v < F(-9223372036854775808.0)) return INT64_MIN;
  return static_cast<int64_t>(v);
}

// The element conversion of every copy on both backends, between f32, i64, bf16 and f16: 16-bit
// values pass through f32 (exact when widening, one rounding when narrowing, as PyTorch converts),
// floats become i64 through saturating_i64.
template <class D, class S>
MN_HOST_DEVICE inline D convert_element(S x) {
  if constexpr (std::is_same_v<D, S>) {
    return x;
  } else if constexpr (std::is_same_v<S, BFloat16> || std::is_same_v<S, Half>) {
    return convert_element<D>(static_cast<float>(x));
  } else if constexpr (std::is_same_v<D, BFloat16> || std::is_same_v<D, Half>) {
    return D(static_cast<float>(x));
  } else if constexpr (std::is_same_v<D, int64_t>) {
    return saturating_i64(x);
  } else {
    return static_cast<D>(x);
  }
}

// After a switch over an op enum that lists every case (no default, so -Wswitch names a missing
// one): reached only through an op value that no case lists (memory corruption or a cast from a bad
// integer): the host throws, a device kernel traps so its launch fails at the next synchronisation.
[[noreturn]] MN_HOST_DEVICE inline void op_unreachable(const char* family, int op) {
#if defined(__CUDA_ARCH__)
  (void)family;
  (void)op;
  __trap();
  __builtin_unreachable();
#else
  throw RuntimeError(str(family, " op ", op, " has no formula (corrupt op value)"));
#endif
}

// ---- elementwise ----
enum class UnaryOp : uint8_t {
  Neg, Exp, Log, Log1p, Sqrt, Rsqrt, Abs, Sign, Relu, Gelu, Tanh, Sigmoid,
  Softplus,    // x * alpha > beta ? x : log1p(exp(x * alpha)) / alpha  (alpha = beta, beta = threshold)
  Square, Reciprocal, Sin, Cos, Erf,
  PowScalar,   // x ^ alpha
  Clamp,       // min(max(x, alpha), beta)
  AddScalar,   // x + alpha
  MulScalar,   // x * alpha
  RDivScalar,  // alpha / x
  RSubScalar,  // alpha - x
  Silu,        // x * sigmoid(x)
  LeakyRelu,   // x > 0 ? x : alpha * x
  Elu,         // x > 0 ? x : alpha * (exp(x) - 1)
  Hardtanh,    // clamp(x, alpha, beta), NaN stays NaN
  LogSigmoid,  // log(sigmoid(x)) = min(x, 0) - log1p(exp(-|x|))
};
// out may alias in (in-place). Dtype of in and out are equal (f32), except Neg/Abs/Sign/AddScalar/
// MulScalar/Clamp which also take i64.
using UnaryFn = void(UnaryOp op, const Tensor& in, Tensor& out, double alpha, double beta);
inline Op<UnaryFn> unary("unary");

enum class BinaryOp : uint8_t {
  Add, Sub, Mul, Div, Pow, Maximum, Minimum,
  Eq, Ne, Lt, Le, Gt, Ge,  // out f32 0/1 (inputs f32 or i64, same dtype)
  ReluBackward,            // a = grad, b = relu(x): 0 where b <= 0, else a (a NaN b passes a)
  GeluBackward,            // a = grad, b = x:  a * gelu'(x)   (erf form)
  TanhBackward,            // a = grad, b = y:  a * (1 - y^2)
  SigmoidBackward,         // a = grad, b = y:  a * y * (1 - y)
  SoftplusBackward,        // a = grad, b = x:  x*alpha > beta ? a : a * sigmoid(x*alpha)  (binary_params)
  SiluBackward,            // a = grad, b = x:  a * s * (1 + x * (1 - s)), s = sigmoid(x)
  LogSigmoidBackward,      // a = grad, b = x:  a * sigmoid(-x)
  LeakyReluBackward,       // a = grad, b = x:  x > 0 ? a : a * alpha  (binary_params)
  EluBackward,             // a = grad, b = x:  x <= 0 ? a * alpha * exp(x) : a  (binary_params)
  HardtanhBackward,        // a = grad, b = x:  x <= alpha || x >= beta ? 0 : a  (binary_params)
};
// a and b have out's shape (expanded views); out may alias a.
using BinaryFn = void(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& out);
inline Op<BinaryFn> binary("binary");
// The binary ops that take scalar parameters (math::binary_takes_params: the activation backwards
// marked binary_params above), f32 only; `binary` refuses them (TypeError), this slot refuses the rest.
using BinaryParamsFn = void(BinaryOp op, const Tensor& a, const Tensor& b, Tensor& out, double alpha, double beta);
inline Op<BinaryParamsFn> binary_params("binary_params");

// out = cond != 0 ? a : b (all expanded to out's shape; cond f32).
using WhereFn = void(const Tensor& cond, const Tensor& a, const Tensor& b, Tensor& out);
inline Op<WhereFn> where("where");

using FillFn = void(Tensor& out, double value);
inline Op<FillFn> fill("fill");

// dst = src elementwise (same shape; src may be expanded; converts dtype with convert_element). Takes
// bf16/f16 itself on both backends: it is how every other kernel's 16-bit arguments are widened.
using CopyFn = void(const Tensor& src, Tensor& dst);
inline Op<CopyFn> copy("copy");

// Contiguous out filled from the Philox stream (see core/random.h).
using RandomFn = void(Tensor& out, Distribution dist, double p1, double p2, const PhiloxState& state);
inline Op<RandomFn> random_fill("random_fill");

// ---- reductions ----
enum class ReduceOp : uint8_t { Sum, Mean, Max, Min, Prod, Norm /* p-norm, p = param */ };
// out has in's shape with size 1 in the reduced dims (bit d of dim_mask set = reduce dim d);
// out contiguous. An empty reduction of Sum gives 0, Mean NaN; Max/Min of an empty set is refused
// by the op layer.
using ReduceFn = void(ReduceOp op, const Tensor& in, uint32_t dim_mask, Tensor& out, double param);
inline Op<ReduceFn> reduce("reduce");

// Max/Min over one dim with the index of the first extreme value (NaN counts as the extreme).
using ArgReduceFn = void(ReduceOp op, const Tensor& in, int dim, Tensor& values, Tensor& indices);
inline Op<ArgReduceFn> arg_reduce("arg_reduce");

// Variance over the masked dims with Bessel-style correction (0 = biased, 1 = unbiased).
using VarFn = void(const Tensor& in, uint32_t dim_mask, double correction, Tensor& out);
inline Op<VarFn> var("var");

// ---- indexing ----
// out = in.index_select(dim, index) (index i64 1-D; bounds checked by the kernel -> IndexError).
using IndexSelectFn = void(const Tensor& in, int dim, const Tensor& index, Tensor& out);
inline Op<IndexSelectFn> index_select("index_select");
// out.index_select(dim, index) += src  (accumulates repeated indices).
using IndexAddFn = void(Tensor& out, int dim, const Tensor& index, const Tensor& src);
inline Op<IndexAddFn> index_add("index_add");

// ---- linear algebra ----
// out = alpha * a @ b + beta * out. a: [M,K] or [B,M,K]; b: [K,N] or [B,K,N]; out: [M,N] or [B,M,N]
// contiguous. a and b may be transposed views; a batch stride of 0 broadcasts.
using GemmFn = void(const Tensor& a, const Tensor& b, Tensor& out, double alpha, double beta);
inline Op<GemmFn> gemm("gemm");
// The srht mapper family's fixed map (kernels/srht_math.h has the plan and the math): y [rows] = W z
// for z [cols], and g [cols] = W^T u for u [rows]; contiguous f32 vectors. W is regenerated from the
// plan's seed and stream, never stored.
struct SrhtPlan;
using SrhtApplyFn = void(const SrhtPlan& plan, const Tensor& z, Tensor& y);
inline Op<SrhtApplyFn> srht_apply("srht_apply");
using SrhtApplyTransposeFn = void(const SrhtPlan& plan, const Tensor& u, Tensor& g);
inline Op<SrhtApplyTransposeFn> srht_apply_transpose("srht_apply_transpose");
// One mapped group's generated values in one pass (mapping/fused_group.h): out [rows] = scale *
// (W z + alpha |z|^2) for W = [Q D_1; ...; Q D_reps; T], Q = block [L, L], D_b = diag(signs[b]) (signs
// [reps, L]), T = tail [rows - reps L, L]; block and signs undefined when W is the tail alone, scale
// [rows] undefined for 1. All contiguous f32; out may be a slice of a larger buffer. The backward is
// grad_z [L] = W^T (scale * grad) + 2 alpha z sum(scale * grad), again one pass over grad [rows].
using MappedGroupForwardFn = void(const Tensor& block, const Tensor& signs, const Tensor& tail, const Tensor& scale,
                                  double alpha, const Tensor& z, Tensor& out);
inline Op<MappedGroupForwardFn> mapped_group_forward("mapped_group_forward");
using MappedGroupBackwardFn = void(const Tensor& block, const Tensor& signs, const Tensor& tail, const Tensor& scale,
                                   double alpha, const Tensor& z, const Tensor& grad, Tensor& grad_z);
inline Op<MappedGroupBackwardFn> mapped_group_backward("mapped_group_backward");

// ---- softmax ----
using SoftmaxFn = void(const Tensor& in, int dim, bool log, Tensor& out);
inline Op<SoftmaxFn> softmax("softmax");
// grad_in from grad of the output and the output itself.
using SoftmaxBackwardFn = void(const Tensor& grad_out, const Tensor& out, int dim, bool log, Tensor& grad_in);
inline Op<SoftmaxBackwardFn> softmax_backward("softmax_backward");

// ---- losses ----
// logits [N, C] f32, target [N] i64 class indices, weight [C] f32 class weights or undefined (all 1).
// With w_t = weight[target[n]] and W = sum_c weight[c]:
//   loss[n] = (1-s) * w_t * -log p[target] + (s/C) * sum_c weight[c] * -log p_c
// (PyTorch's per-row cross entropy with weight and label smoothing; without weight the second term is
// s * mean_c(-log p_c)); 0 where target == ignore_index. lse[n] = logsumexp of row n (saved for
// backward). Out-of-range targets -> IndexError naming the value and C.
using CrossEntropyFn = void(const Tensor& logits, const Tensor& target, const Tensor& weight, double smoothing,
                            int64_t ignore_index, Tensor& loss, Tensor& lse);
inline Op<CrossEntropyFn> cross_entropy_forward("cross_entropy_forward");
// grad_logits[n, c] = grad_loss[n] * (softmax[n, c] * ((1-s) w_t + (s/C) W) - (1-s) w_t [c == target]
//                                     - (s/C) weight[c]); 0 in ignored rows.
using CrossEntropyBackwardFn = void(const Tensor& grad_loss, const Tensor& logits, const Tensor& target,
                                    const Tensor& weight, const Tensor& lse, double smoothing, int64_t ignore_index,
                                    Tensor& grad_logits);
inline Op<CrossEntropyBackwardFn> cross_entropy_backward("cross_entropy_backward");

// ---- convolution (NCHW, im2col + GEMM) ----
struct Conv2dParams {
  int64_t stride_h = 1, stride_w = 1;
  int64_t pad_h = 0, pad_w = 0;
  int64_t dilation_h = 1, dilation_w = 1;
  int64_t groups = 1;
};
// x [N,C,H,W], weight [O,C/groups,KH,KW], bias [O] or undefined; out [N,O,OH,OW].
using Conv2dFn = void(const Tensor& x, const Tensor& weight, const Tensor& bias, const Conv2dParams& p, Tensor& out);
inline Op<Conv2dFn> conv2d_forward("conv2d_forward");
using Conv2dBackwardInputFn = void(const Tensor& grad_out, const Tensor& weight, const Conv2dParams& p, Tensor& grad_x);
inline Op<Conv2dBackwardInputFn> conv2d_backward_input("conv2d_backward_input");
// grad_bias may be undefined (no bias).
using Conv2dBackwardWeightFn = void(const Tensor& grad_out, const Tensor& x, const Conv2dParams& p,
                                    Tensor& grad_weight, Tensor& grad_bias);
inline Op<Conv2dBackwardWeightFn> conv2d_backward_weight("conv2d_backward_weight");

// ---- pooling (NCHW) ----
struct Pool2dParams {
  int64_t kernel_h = 2, kernel_w = 2;
  int64_t stride_h = 2, stride_w = 2;
  int64_t pad_h = 0, pad_w = 0;
  bool ceil_mode = false;
  bool count_include_pad = true;  // avg pool only
};
// indices: flat h*W+w position of the max within each input plane (i64).
using MaxPool2dFn = void(const Tensor& x, const Pool2dParams& p, Tensor& out, Tensor& indices);
inline Op<MaxPool2dFn> max_pool2d_forward("max_pool2d_forward");
using MaxPool2dBackwardFn = void(const Tensor& grad_out, const Tensor& indices, Tensor& grad_x);
inline Op<MaxPool2dBackwardFn> max_pool2d_backward("max_pool2d_backward");
using AvgPool2dFn = void(const Tensor& x, const Pool2dParams& p, Tensor& out);
inline Op<AvgPool2dFn> avg_pool2d_forward("avg_pool2d_forward");
using AvgPool2dBackwardFn = void(const Tensor& grad_out, const Pool2dParams& p, Tensor& grad_x);
inline Op<AvgPool2dBackwardFn> avg_pool2d_backward("avg_pool2d_backward");

// ---- batch norm (x [N,C,*]) ----
// Training: normalise with batch statistics (biased variance), write save_mean/save_invstd [C], and
// update running stats in place when defined: r = (1-m) r + m * stat (running_var uses the unbiased
// variance). Eval: normalise with running stats; save_* receive them (mean, 1/sqrt(var+eps)).
using BatchNormFn = void(const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& running_mean,
                         Tensor& running_var, bool training, double momentum, double eps, Tensor& out,
                         Tensor& save_mean, Tensor& save_invstd);
inline Op<BatchNormFn> batch_norm_forward("batch_norm_forward");
// grad_weight / grad_bias may be undefined (no affine). training selects the batch-statistics formula.
using BatchNormBackwardFn = void(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                 const Tensor& save_mean, const Tensor& save_invstd, bool training,
                                 Tensor& grad_x, Tensor& grad_weight, Tensor& grad_bias);
inline Op<BatchNormBackwardFn> batch_norm_backward("batch_norm_backward");

// ---- row normalisation: layer norm and group norm (kernels/cpu/norm.cpp, kernels/cuda/norm.cu) ----
// x is contiguous, seen as R rows of L values; each row is normalised with its own mean and biased
// variance: y = (x - mean) * rstd, rstd = 1 / sqrt(var + eps). The optional affine weight/bias
// (contiguous, C entries) is indexed by channel: the rows cycle through `groups` groups of C / groups
// channels, each channel holding `inner` consecutive values of the row, so element j of row r has
// channel (r % groups) * (L / inner) + j / inner. Layer norm: groups = inner = 1, C = L. Group norm
// of x [N, C, S]: R = N * groups, L = C / groups * S, inner = S.
struct RowNormLayout {
  int64_t rows = 0, row_len = 0, groups = 1, inner = 1;
  int64_t channels() const { return groups * (row_len / inner); }
};
// mean and rstd: [R] contiguous (saved for the backward).
using RowNormFn = void(const Tensor& x, const Tensor& weight, const Tensor& bias, const RowNormLayout& layout,
                       double eps, Tensor& out, Tensor& mean, Tensor& rstd);
inline Op<RowNormFn> row_norm_forward("row_norm_forward");
// Any of grad_x, grad_weight, grad_bias may be undefined (not needed); weight may be undefined.
using RowNormBackwardFn = void(const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& mean,
                               const Tensor& rstd, const RowNormLayout& layout, Tensor& grad_x, Tensor& grad_weight,
                               Tensor& grad_bias);
inline Op<RowNormBackwardFn> row_norm_backward("row_norm_backward");
// ---- gather / scatter, scans, top-k and adaptive pooling (issue 18) ----
// index (i64) has in's number of dims, index.size(d) <= in.size(d) for d != dim; out (contiguous, index's
// shape): out[..i..] = in[..index[..i..]..] with index's value replacing the coordinate along dim.
// Every index value is checked first (-> IndexError naming the value and the size).
using GatherFn = void(const Tensor& in, int dim, const Tensor& index, Tensor& out);
inline Op<GatherFn> gather("gather");
// out[..index[..i..]..] += src[..i..] over index's positions (src.size(d) >= index.size(d) for every d;
// index.size(d) <= out.size(d) for d != dim). Repeated targets accumulate in increasing position along
// dim on both backends, so results are deterministic. f32 or i64. The CUDA kernel runs one thread per
// position outside dim (no atomics), so a scatter with few such positions (a 1-D one) is serial there.
using ScatterAddFn = void(Tensor& out, int dim, const Tensor& index, const Tensor& src);
inline Op<ScatterAddFn> scatter_add("scatter_add");
// Inclusive prefix sum along dim (from the end when reverse); out contiguous with in's shape. f32 sums
// run in double (as PyTorch's CPU kernel), i64 exactly. CUDA: one thread per line (serial along dim).
using CumsumFn = void(const Tensor& in, int dim, bool reverse, Tensor& out);
inline Op<CumsumFn> cumsum("cumsum");
// The k largest (or smallest) entries along dim, in order (largest first, or smallest first), ties by
// lower position; NaN ranks above every number (as PyTorch). values/indices contiguous, in's shape with
// k along dim. f32 or i64. CUDA: lines of at most 65,536 entries (NotImplementedError above).
using TopkFn = void(const Tensor& in, int dim, int64_t k, bool largest, Tensor& values, Tensor& indices);
inline Op<TopkFn> topk("topk");
// Adaptive pooling, x [N,C,H,W] -> out [N,C,OH,OW]: output (i, j) covers rows floor(i*H/OH) ..
// ceil((i+1)*H/OH) - 1 and the same for columns (PyTorch's windows). Max pooling writes the flat h*W+w
// argmax (first on ties, a NaN wins) and its backward is max_pool2d_backward.
using AdaptiveAvgPool2dFn = void(const Tensor& x, Tensor& out);
inline Op<AdaptiveAvgPool2dFn> adaptive_avg_pool2d_forward("adaptive_avg_pool2d_forward");
using AdaptiveAvgPool2dBackwardFn = void(const Tensor& grad_out, Tensor& grad_x);
inline Op<AdaptiveAvgPool2dBackwardFn> adaptive_avg_pool2d_backward("adaptive_avg_pool2d_backward");
using AdaptiveMaxPool2dFn = void(const Tensor& x, Tensor& out, Tensor& indices);
inline Op<AdaptiveMaxPool2dFn> adaptive_max_pool2d_forward("adaptive_max_pool2d_forward");

// Registration entry points of the backends (called once by ensure_registered).
void register_cpu_kernels();
#ifdef MN_WITH_CUDA
void register_cuda_kernels();
#endif

}  // namespace mn::kernels

namespace mn::kernels {

// ---- optimizer updates (in place on contiguous f32 tensors of one shape, which the kernels check:
// kernels/optim_update.h) ----
struct AdamParams {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;      // 1-based, for bias correction
  bool decoupled;    // AdamW: p *= 1 - lr * wd before the update; Adam: g += wd * p
};
using AdamStepFn = void(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamParams& p);
inline Op<AdamStepFn> adam_step("adam_step");

struct SgdParams {
  double lr, momentum, dampening, weight_decay;
  bool nesterov;
  bool first_step;  // momentum buffer starts as a copy of the gradient
};
// momentum_buffer may be undefined when momentum == 0.
using SgdStepFn = void(Tensor& param, const Tensor& grad, Tensor& momentum_buffer, const SgdParams& p);
inline Op<SgdStepFn> sgd_step("sgd_step");

// Adam/AdamW with amsgrad: as adam_step, then max_exp_avg_sq = maximum(max_exp_avg_sq, exp_avg_sq)
// (NaN propagates) stands for exp_avg_sq in the denominator.
using AdamAmsgradStepFn = void(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                               Tensor& max_exp_avg_sq, const AdamParams& p);
inline Op<AdamAmsgradStepFn> adam_amsgrad_step("adam_amsgrad_step");

struct RmspropParams {
  double lr, alpha, eps, weight_decay, momentum;
  bool centered;
};
// torch.optim.RMSprop. momentum_buffer is defined exactly when momentum > 0, grad_avg exactly when
// centered.
using RmspropStepFn = void(Tensor& param, const Tensor& grad, Tensor& square_avg, Tensor& momentum_buffer,
                           Tensor& grad_avg, const RmspropParams& p);
inline Op<RmspropStepFn> rmsprop_step("rmsprop_step");

void register_cpu_optim();  // kernels/cpu/optim.cpp

}  // namespace mn::kernels

namespace mn::kernels {

// ---- mixed precision: the gradient scaler's kernels (kernels/cpu/amp.cpp, kernels/cuda/amp.cu; the
// math in kernels/amp_math.h) ----
// One pass over a contiguous f32 gradient, in place: found_inf (1-element f32) is set to 1 when any
// element is infinite or NaN and left as it is otherwise (so one found_inf collects a whole model),
// and every element is multiplied by inv_scale (1-element f32; values stay as they are when it is 1).
// torch._amp_foreach_non_finite_check_and_unscale_ for one tensor; all three on one device.
using NonFiniteCheckAndUnscaleFn = void(Tensor& grad, Tensor& found_inf, const Tensor& inv_scale);
inline Op<NonFiniteCheckAndUnscaleFn> non_finite_check_and_unscale("non_finite_check_and_unscale");
// torch._amp_update_scale_ on the device, no host read: scale (1-element f32) and growth_tracker
// (1-element i64) updated in place from found_inf (1-element f32) by kernels::update_scale.
using AmpUpdateScaleFn = void(Tensor& scale, Tensor& growth_tracker, const Tensor& found_inf, double growth_factor,
                              double backoff_factor, int64_t growth_interval);
inline Op<AmpUpdateScaleFn> amp_update_scale("amp_update_scale");

}  // namespace mn::kernels
