// CPU reductions: sum / mean / max / min / prod / p-norm over any set of dims, arg max/min over one
// dim, and variance. Two layouts run without copying: reduced dims trailing a dense tensor (each
// output is one contiguous row) and reduced dims leading it (columns accumulate row by row, e.g. bias
// gradients [B, C] -> [C]); anything else is permuted into the row layout by one copy.
// Float sums accumulate in double over interleaved lanes. Long rows (and tall column blocks) are cut
// into pieces chosen from the shape alone, whose partials merge in a fixed order, so every result is
// bit-identical for any thread count.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

// GCC 12 flags Eigen's AVX-512 intrinsics as maybe-uninitialised; a known false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <Eigen/Core>

#include "kernels/cpu/dim_layout.h"

namespace mn::kernels {
namespace {

using cpu::parallel_team;

constexpr int64_t kRowChunk = 16384;       // elements per partial of one long row
constexpr int64_t kColumnTile = 256;       // columns one task accumulates at a time
constexpr int64_t kColumnRowBlock = 4096;  // rows per partial when columns are too few to share out
constexpr int kLanes = 16;                 // independent accumulators, so the adds vectorise

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------- folds: how one op accumulates ----------------
// A fold has Acc, identity(), step(acc, x), merge(a, b) and run(p, n) over a contiguous run; step and
// merge must give the same result as run up to rounding.

template <class T, class F>
double lane_sum(const T* p, int64_t n, F f) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < kLanes; ++k) acc[k] += f(p[i + k]);
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int k = 0; k < width; ++k) acc[k] += acc[k + width];
  double total = acc[0];
  for (; i < n; ++i) total += f(p[i]);
  return total;
}

// Sum of f(x): f32 in double, i64 exactly.
template <class T, class F>
struct SumFold {
  using Acc = std::conditional_t<std::is_same_v<T, float>, double, int64_t>;
  F f;
  Acc identity() const { return 0; }
  Acc step(Acc a, T x) const { return a + f(x); }
  Acc merge(Acc a, Acc b) const { return a + b; }
  Acc run(const T* p, int64_t n) const {
    if constexpr (std::is_same_v<T, float>) {
      return lane_sum(p, n, f);
    } else {
      Acc a = 0;
      for (int64_t i = 0; i < n; ++i) a += f(p[i]);
      return a;
    }
  }
};

// Max or min of x (or |x|); a NaN wins and stays. Contiguous f32 runs use Eigen's vectorised
// NaN-propagating reductions; GCC does not vectorise the NaN-aware compare on its own.
template <class T, bool kMax, bool kAbs = false>
struct ExtremeFold {
  using Acc = T;
  static bool takes(T x, T best) { return (kMax ? x > best : x < best) || x != x; }
  static T value(T x) { return kAbs && x < 0 ? -x : x; }
  Acc identity() const {
    if constexpr (std::is_same_v<T, float>)
      return kMax ? -INFINITY : INFINITY;
    else
      return kMax ? std::numeric_limits<T>::lowest() : std::numeric_limits<T>::max();
  }
  Acc step(Acc a, T x) const { return takes(value(x), a) ? value(x) : a; }
  Acc merge(Acc a, Acc b) const { return takes(b, a) ? b : a; }
  Acc run(const T* p, int64_t n) const {
    if (n == 0) return identity();
    if constexpr (std::is_same_v<T, float>) {
      const Eigen::Map<const Eigen::ArrayXf> run(p, n);
      if constexpr (kAbs)
        return extreme(run.abs());
      else
        return extreme(run);
    } else {
      Acc best = identity();
      for (int64_t i = 0; i < n; ++i) best = step(best, p[i]);
      return best;
    }
  }
  template <class E>
  static float extreme(const E& values) {
    if constexpr (kMax)
      return values.template maxCoeff<Eigen::PropagateNaN>();
    else
      return values.template minCoeff<Eigen::PropagateNaN>();
  }
};

template <class T>
struct ProdFold {
  using Acc = std::conditional_t<std::is_same_v<T, float>, double, int64_t>;
  Acc identity() const { return 1; }
  Acc step(Acc a, T x) const { return a * x; }
  Acc merge(Acc a, Acc b) const { return a * b; }
  Acc run(const T* p, int64_t n) const {
    Acc a = 1;
    for (int64_t i = 0; i < n; ++i) a *= p[i];
    return a;
  }
};

// ---------------- drivers: how the work is cut ----------------

// `rows` outputs, each folding `len` elements. run(r, begin, n) folds elements [begin, begin + n) of
// row r; finish(r, acc) stores the result.
template <class Acc, class Run, class Merge, class Finish>
void for_rows(int64_t rows, int64_t len, Run run, Merge merge, Finish finish) {
  const int team = parallel_team(rows * len);
  if (len <= kRowChunk) {
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
    for (int64_t r = 0; r < rows; ++r) finish(r, run(r, 0, len));
    return;
  }
  const int64_t chunks = ceil_div(len, kRowChunk);
  std::vector<Acc> partial(static_cast<size_t>(rows * chunks));
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
  for (int64_t task = 0; task < rows * chunks; ++task) {
    const int64_t r = task / chunks, begin = (task % chunks) * kRowChunk;
    partial[task] = run(r, begin, std::min(kRowChunk, len - begin));
  }
  for (int64_t r = 0; r < rows; ++r) {
    Acc acc = partial[r * chunks];
    for (int64_t c = 1; c < chunks; ++c) acc = merge(acc, partial[r * chunks + c]);
    finish(r, acc);
  }
}

// A dense [rows, cols] block reduced over rows. step(acc, r, c) folds element (r, c); finish(c, acc)
// stores column c. Each column is folded in row order, tiles of columns run in parallel, and tall
// narrow inputs are also cut into row blocks whose partials merge in block order.
template <class Acc, class Step, class Merge, class Finish>
void for_columns(int64_t rows, int64_t cols, Acc identity, Step step, Merge merge, Finish finish) {
  const int64_t blocks =
      (cols >= 2 * kColumnTile || rows <= kColumnRowBlock) ? 1 : ceil_div(rows, kColumnRowBlock);
  const int64_t block_rows = blocks == 1 ? rows : kColumnRowBlock;
  const int64_t tiles = ceil_div(cols, kColumnTile);
  std::vector<Acc> partial(blocks > 1 ? static_cast<size_t>(blocks * cols) : 0);
  const int team = parallel_team(rows * cols);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
  for (int64_t task = 0; task < blocks * tiles; ++task) {
    const int64_t b = task / tiles, c0 = (task % tiles) * kColumnTile;
    const int64_t width = std::min(kColumnTile, cols - c0);
    const int64_t r0 = b * block_rows, r1 = std::min(rows, r0 + block_rows);
    Acc acc[kColumnTile];
    std::fill(acc, acc + width, identity);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < width; ++j) acc[j] = step(acc[j], r, c0 + j);
    for (int64_t j = 0; j < width; ++j) {
      if (blocks == 1)
        finish(c0 + j, acc[j]);
      else
        partial[b * cols + c0 + j] = acc[j];
    }
  }
  if (blocks == 1) return;
  for (int64_t c = 0; c < cols; ++c) {
    Acc acc = partial[c];
    for (int64_t b = 1; b < blocks; ++b) acc = merge(acc, partial[b * cols + c]);
    finish(c, acc);
  }
}

// ---------------- layout of a reduction ----------------

// The input seen either as dense [outputs, len] rows or dense [len, outputs] columns.
struct ReducePlan {
  bool columns = false;
  int64_t outputs = 1, len = 1;
  Tensor src;  // dense in the chosen order (data pointer = element 0)
};

// True when dims `order` of (sizes, strides) form a dense row-major block.
bool dense_in_order(const Shape& sizes, const Shape& strides, const int* order, int n) {
  int64_t expected = 1;
  for (int i = n - 1; i >= 0; --i) {
    if (strides[order[i]] != expected) return false;
    expected *= sizes[order[i]];
  }
  return true;
}

ReducePlan plan_reduction(const Tensor& in, uint32_t mask) {
  const Shape& sizes = in.sizes();
  const Shape& strides = in.strides();
  int kept[kMaxDims], reduced[kMaxDims], nk = 0, nr = 0;
  ReducePlan plan;
  for (int d = 0; d < sizes.size(); ++d) {
    if (mask & (1u << d))
      plan.len *= sizes[d];
    else
      plan.outputs *= sizes[d];
    if (sizes[d] == 1) continue;  // a size-1 dim has no layout
    if (mask & (1u << d))
      reduced[nr++] = d;
    else
      kept[nk++] = d;
  }
  plan.src = in;
  if (in.numel() == 0) return plan;
  int order[kMaxDims];
  std::copy(kept, kept + nk, order);
  std::copy(reduced, reduced + nr, order + nk);
  if (dense_in_order(sizes, strides, order, nk + nr)) return plan;
  int column_order[kMaxDims];
  std::copy(reduced, reduced + nr, column_order);
  std::copy(kept, kept + nk, column_order + nr);
  if (dense_in_order(sizes, strides, column_order, nk + nr)) {
    plan.columns = true;
    return plan;
  }
  Shape permuted_sizes, permuted_strides;
  for (int i = 0; i < nk + nr; ++i) {
    permuted_sizes.push_back(sizes[order[i]]);
    permuted_strides.push_back(strides[order[i]]);
  }
  plan.src =
      cpu::dense(make_view(in.storage(), permuted_sizes, permuted_strides, in.storage_offset(), in.dtype()));
  return plan;
}

// Runs one fold over the plan and stores finish(acc) into out.
template <class T, class Fold, class Finish>
void run_fold(const ReducePlan& plan, const Fold& fold, Finish finish, T* out) {
  using Acc = typename Fold::Acc;
  const T* x = plan.src.numel() ? plan.src.template data<T>() : nullptr;
  const int64_t len = plan.len, outputs = plan.outputs;
  if (!plan.columns) {
    for_rows<Acc>(
        outputs, len, [&](int64_t r, int64_t begin, int64_t n) { return fold.run(x + r * len + begin, n); },
        [&](Acc a, Acc b) { return fold.merge(a, b); }, [&](int64_t r, Acc acc) { out[r] = finish(acc); });
  } else {
    for_columns<Acc>(
        len, outputs, fold.identity(),
        [&](Acc a, int64_t r, int64_t c) { return fold.step(a, x[r * outputs + c]); },
        [&](Acc a, Acc b) { return fold.merge(a, b); }, [&](int64_t c, Acc acc) { out[c] = finish(acc); });
  }
}

// Mean and the p-norms (f32 only).
void reduce_float(ReduceOp op, const ReducePlan& plan, double p, float* out) {
  using T = float;
  auto as_is = [](auto acc) { return static_cast<float>(acc); };
  const double n = static_cast<double>(plan.len);
  auto to_double = [](float x) { return static_cast<double>(x); };
  auto abs_value = [](float x) { return static_cast<double>(std::fabs(x)); };
  if (op == ReduceOp::Mean)
    return run_fold<T>(
        plan, SumFold<T, decltype(to_double)>{to_double}, [n](double s) { return float(s / n); }, out);
  // p-norms
  if (p == 2.0) {
    auto square = [](float x) { return static_cast<double>(x) * x; };
    return run_fold<T>(
        plan, SumFold<T, decltype(square)>{square}, [](double s) { return float(std::sqrt(s)); }, out);
  }
  if (p == 1.0) return run_fold<T>(plan, SumFold<T, decltype(abs_value)>{abs_value}, as_is, out);
  if (std::isinf(p)) {
    if (p > 0) return run_fold<T>(plan, ExtremeFold<T, true, true>{}, as_is, out);
    return run_fold<T>(plan, ExtremeFold<T, false, true>{}, as_is, out);
  }
  if (p == 0.0) {
    auto nonzero = [](float x) { return x != 0.0f ? 1.0 : 0.0; };
    return run_fold<T>(plan, SumFold<T, decltype(nonzero)>{nonzero}, as_is, out);
  }
  auto abs_pow = [p](float x) { return std::pow(std::fabs(static_cast<double>(x)), p); };
  return run_fold<T>(
      plan, SumFold<T, decltype(abs_pow)>{abs_pow}, [p](double s) { return float(std::pow(s, 1.0 / p)); }, out);
}

template <class T>
void reduce_typed(ReduceOp op, const ReducePlan& plan, double p, T* out) {
  auto as_is = [](auto acc) { return static_cast<T>(acc); };
  auto identity = [](T x) { return x; };
  switch (op) {
    case ReduceOp::Sum: return run_fold<T>(plan, SumFold<T, decltype(identity)>{identity}, as_is, out);
    case ReduceOp::Max: return run_fold<T>(plan, ExtremeFold<T, true>{}, as_is, out);
    case ReduceOp::Min: return run_fold<T>(plan, ExtremeFold<T, false>{}, as_is, out);
    case ReduceOp::Prod: return run_fold<T>(plan, ProdFold<T>{}, as_is, out);
    case ReduceOp::Mean:
    case ReduceOp::Norm:
      if constexpr (std::is_same_v<T, float>) return reduce_float(op, plan, p, out);
      throw TypeError(
          str("reduce: ", op == ReduceOp::Mean ? "mean" : "norm", " needs a floating-point input, got i64"));
  }
  op_unreachable("reduce", static_cast<int>(op));
}

void reduce_cpu(ReduceOp op, const Tensor& in, uint32_t dim_mask, Tensor& out, double param) {
  cpu::require_contiguous_output(out, "reduce", "out");
  const ReducePlan plan = plan_reduction(in, dim_mask);
  MN_CHECK(out.numel() == plan.outputs, ValueError, "reduce: output of shape ", out.sizes(),
           " does not match input ", in.sizes(), " reduced with dim mask ", dim_mask);
  MN_CHECK(out.dtype() == in.dtype(), TypeError, "reduce: output dtype ", out.dtype(),
           " differs from input dtype ", in.dtype());
  if (in.dtype() == DType::f32) return reduce_typed<float>(op, plan, param, out.data<float>());
  reduce_typed<int64_t>(op, plan, param, out.data<int64_t>());
}

// ---------------- arg max / arg min ----------------

template <class T, bool kMax>
void arg_reduce_typed(const Tensor& in, int dim, T* values, int64_t* indices) {
  using Fold = ExtremeFold<T, kMax>;
  const Tensor src = cpu::dense(in);
  const auto [outer, n, inner] = cpu::split_at(src.sizes(), dim);
  const T* x = src.data<T>();
  if (inner == 1) {
    const int team = parallel_team(outer * n);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
    for (int64_t o = 0; o < outer; ++o) {
      const T* row = x + o * n;
      T best = row[0];
      int64_t where = 0;
      for (int64_t k = 1; k < n; ++k)
        if (Fold::takes(row[k], best) && best == best) {
          best = row[k];
          where = k;
        }
      values[o] = best;
      indices[o] = where;
    }
    return;
  }
  const int64_t tiles = ceil_div(inner, kColumnTile);
  const int team = parallel_team(outer * n * inner);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
  for (int64_t task = 0; task < outer * tiles; ++task) {
    const int64_t o = task / tiles, i0 = (task % tiles) * kColumnTile;
    const int64_t width = std::min(kColumnTile, inner - i0);
    const T* base = x + o * n * inner + i0;
    T best[kColumnTile];
    int64_t where[kColumnTile] = {};
    std::copy(base, base + width, best);
    for (int64_t k = 1; k < n; ++k) {
      const T* row = base + k * inner;
      for (int64_t j = 0; j < width; ++j)
        if (Fold::takes(row[j], best[j]) && best[j] == best[j]) {  // first NaN stays
          best[j] = row[j];
          where[j] = k;
        }
    }
    std::copy(best, best + width, values + o * inner + i0);
    std::copy(where, where + width, indices + o * inner + i0);
  }
}

void arg_reduce_cpu(ReduceOp op, const Tensor& in, int dim, Tensor& values, Tensor& indices) {
  MN_CHECK(op == ReduceOp::Max || op == ReduceOp::Min, ValueError,
           "arg_reduce: only max and min are supported");
  MN_CHECK(dim >= 0 && dim < std::max(in.dim(), 1), IndexError, "arg_reduce: dim ", dim,
           " is out of range for shape ", in.sizes());
  MN_CHECK(in.numel() > 0 && (in.dim() == 0 || in.sizes()[dim] > 0), ValueError,
           "arg_reduce: cannot take the max/min of an empty dimension (input shape ", in.sizes(), ")");
  cpu::require_contiguous_output(values, "arg_reduce", "values");
  cpu::require_contiguous_output(indices, "arg_reduce", "indices");
  const int64_t expected = in.dim() == 0 ? 1 : in.numel() / in.sizes()[dim];
  MN_CHECK(values.numel() == expected && indices.numel() == expected && indices.dtype() == DType::i64 &&
               values.dtype() == in.dtype(),
           ValueError, "arg_reduce: outputs ", values.dtype(), values.sizes(), " and ", indices.dtype(),
           indices.sizes(), " do not fit input ", in.dtype(), in.sizes(), " reduced over dim ", dim);
  const bool is_max = op == ReduceOp::Max;
  if (in.dtype() == DType::f32) {
    if (is_max) return arg_reduce_typed<float, true>(in, dim, values.data<float>(), indices.data<int64_t>());
    return arg_reduce_typed<float, false>(in, dim, values.data<float>(), indices.data<int64_t>());
  }
  if (is_max)
    return arg_reduce_typed<int64_t, true>(in, dim, values.data<int64_t>(), indices.data<int64_t>());
  arg_reduce_typed<int64_t, false>(in, dim, values.data<int64_t>(), indices.data<int64_t>());
}

// ---------------- variance (two passes in double) ----------------

void var_cpu(const Tensor& in, uint32_t dim_mask, double correction, Tensor& out) {
  MN_CHECK(in.dtype() == DType::f32 && out.dtype() == DType::f32, TypeError,
           "var: expected f32 tensors, got input ", in.dtype(), in.sizes());
  cpu::require_contiguous_output(out, "var", "out");
  const ReducePlan plan = plan_reduction(in, dim_mask);
  MN_CHECK(out.numel() == plan.outputs, ValueError, "var: output of shape ", out.sizes(),
           " does not match input ", in.sizes(), " reduced with dim mask ", dim_mask);
  const float* x = plan.src.numel() ? plan.src.data<float>() : nullptr;
  float* y = out.data<float>();
  const int64_t len = plan.len, outputs = plan.outputs;
  const double divisor = std::max(0.0, static_cast<double>(len) - correction);
  std::vector<double> mean(static_cast<size_t>(outputs));
  auto add = [](double a, double b) { return a + b; };
  auto to_double = [](float v) { return static_cast<double>(v); };
  auto store_mean = [&](int64_t i, double s) { mean[i] = s / static_cast<double>(len); };
  auto store_var = [&](int64_t i, double m2) { y[i] = static_cast<float>(m2 / divisor); };
  if (!plan.columns) {
    for_rows<double>(
        outputs, len,
        [&](int64_t r, int64_t b, int64_t n) { return lane_sum(x + r * len + b, n, to_double); }, add,
        store_mean);
    for_rows<double>(
        outputs, len,
        [&](int64_t r, int64_t b, int64_t n) {
          const double m = mean[r];
          return lane_sum(x + r * len + b, n, [m](float v) { return (v - m) * (v - m); });
        },
        add, store_var);
  } else {
    for_columns<double>(
        len, outputs, 0.0, [&](double a, int64_t r, int64_t c) { return a + x[r * outputs + c]; }, add,
        store_mean);
    for_columns<double>(
        len, outputs, 0.0,
        [&](double a, int64_t r, int64_t c) {
          const double d = x[r * outputs + c] - mean[c];
          return a + d * d;
        },
        add, store_var);
  }
}

}  // namespace

void register_cpu_reduce() {
  reduce.set(DeviceType::CPU, reduce_cpu);
  arg_reduce.set(DeviceType::CPU, arg_reduce_cpu);
  var.set(DeviceType::CPU, var_cpu);
}

}  // namespace mn::kernels
