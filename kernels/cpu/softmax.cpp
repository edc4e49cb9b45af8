// CPU softmax / log-softmax along one dim with their backward, and the fused cross-entropy forward
// and backward. Inputs are seen as [outer, n, inner] around the dim: when inner == 1 every slice is one
// contiguous row; otherwise a tile of up to kTile neighbouring slices is processed together so the
// loops run along contiguous memory. The arithmetic goes through Eigen arrays for its vectorised exp.
// Max subtraction keeps exp from overflowing; each slice is computed by one thread in a fixed order,
// so results do not depend on the thread count.
#include <algorithm>
#include <cmath>

// GCC 12 flags Eigen's AVX-512 intrinsics as maybe-uninitialised; a known false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <Eigen/Core>

#include "kernels/cpu/dim_layout.h"

namespace mn::kernels {
namespace {

using cpu::parallel_team;
using Values = Eigen::Map<Eigen::ArrayXf>;
using ConstValues = Eigen::Map<const Eigen::ArrayXf>;
using TileArray = Eigen::Array<float, Eigen::Dynamic, 1, 0, 128, 1>;

constexpr int64_t kTile = 128;

// ---------------- softmax forward ----------------

void softmax_rows(const float* x, float* y, int64_t rows, int64_t n, bool log) {
  const int team = parallel_team(rows * n);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const ConstValues in(x + r * n, n);
    Values out(y + r * n, n);
    const float m = in.maxCoeff();
    out = (in - m).exp();
    const float total = out.sum();
    if (log)
      out = in - (m + std::log(total));
    else
      out *= 1.0f / total;
  }
}

void softmax_tiles(const float* x, float* y, const cpu::DimSplit& s, bool log) {
  const int64_t tiles = (s.inner + kTile - 1) / kTile;
  const int team = parallel_team(s.outer * s.n * s.inner);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
  for (int64_t task = 0; task < s.outer * tiles; ++task) {
    const int64_t o = task / tiles, i0 = (task % tiles) * kTile;
    const int64_t width = std::min(kTile, s.inner - i0);
    const int64_t base = o * s.n * s.inner + i0;
    auto in = [&](int64_t k) { return ConstValues(x + base + k * s.inner, width); };
    auto out = [&](int64_t k) { return Values(y + base + k * s.inner, width); };
    TileArray m = in(0);
    for (int64_t k = 1; k < s.n; ++k) m = m.max(in(k));
    TileArray total = TileArray::Zero(width);
    for (int64_t k = 0; k < s.n; ++k) {
      out(k) = (in(k)-m).exp();
      total += out(k);
    }
    if (log) {
      const TileArray shift = m + total.log();
      for (int64_t k = 0; k < s.n; ++k) out(k) = in(k)-shift;
    } else {
      const TileArray scale = total.inverse();
      for (int64_t k = 0; k < s.n; ++k) out(k) *= scale;
    }
  }
}

void softmax_cpu(const Tensor& in, int dim, bool log, Tensor& out) {
  MN_CHECK(in.dtype() == DType::f32 && out.dtype() == DType::f32, TypeError, "softmax: expected f32, got ",
           in.dtype(), in.sizes());
  MN_CHECK(out.sizes() == in.sizes(), ValueError, "softmax: output shape ", out.sizes(),
           " differs from input ", in.sizes());
  cpu::require_contiguous_output(out, "softmax", "out");
  if (in.numel() == 0) return;
  const Tensor x = cpu::dense(in);
  const cpu::DimSplit s = cpu::split_at(x.sizes(), dim);
  if (s.inner == 1) return softmax_rows(x.data<float>(), out.data<float>(), s.outer, s.n, log);
  softmax_tiles(x.data<float>(), out.data<float>(), s, log);
}

// ---------------- softmax backward ----------------
// softmax:     grad_in = y * (g - sum(g * y))
// log_softmax: grad_in = g - exp(y) * sum(g)

void softmax_backward_rows(const float* g, const float* y, float* gi, int64_t rows, int64_t n, bool log) {
  const int team = parallel_team(rows * n);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const ConstValues grad(g + r * n, n), out(y + r * n, n);
    Values result(gi + r * n, n);
    if (log)
      result = grad - out.exp() * grad.sum();
    else
      result = out * (grad - (grad * out).sum());
  }
}

void softmax_backward_tiles(const float* g, const float* y, float* gi, const cpu::DimSplit& s, bool log) {
  const int64_t tiles = (s.inner + kTile - 1) / kTile;
  const int team = parallel_team(s.outer * s.n * s.inner);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
  for (int64_t task = 0; task < s.outer * tiles; ++task) {
    const int64_t o = task / tiles, i0 = (task % tiles) * kTile;
    const int64_t width = std::min(kTile, s.inner - i0);
    const int64_t base = o * s.n * s.inner + i0;
    auto grad = [&](int64_t k) { return ConstValues(g + base + k * s.inner, width); };
    auto out = [&](int64_t k) { return ConstValues(y + base + k * s.inner, width); };
    TileArray total = TileArray::Zero(width);
    for (int64_t k = 0; k < s.n; ++k) {
      if (log)
        total += grad(k);
      else
        total += grad(k) * out(k);
    }
    for (int64_t k = 0; k < s.n; ++k) {
      Values result(gi + base + k * s.inner, width);
      if (log)
        result = grad(k) - out(k).exp() * total;
      else
        result = out(k) * (grad(k) - total);
    }
  }
}

void softmax_backward_cpu(const Tensor& grad_out, const Tensor& out, int dim, bool log, Tensor& grad_in) {
  MN_CHECK(grad_out.sizes() == out.sizes() && grad_in.sizes() == out.sizes(), ValueError,
           "softmax_backward: shapes differ: grad_out ", grad_out.sizes(), ", out ", out.sizes(),
           ", grad_in ", grad_in.sizes());
  cpu::require_contiguous_output(grad_in, "softmax_backward", "grad_in");
  if (out.numel() == 0) return;
  const Tensor g = cpu::dense(grad_out), y = cpu::dense(out);
  const cpu::DimSplit s = cpu::split_at(y.sizes(), dim);
  if (s.inner == 1)
    return softmax_backward_rows(g.data<float>(), y.data<float>(), grad_in.data<float>(), s.outer, s.n, log);
  softmax_backward_tiles(g.data<float>(), y.data<float>(), grad_in.data<float>(), s, log);
}

// ---------------- cross entropy ----------------

// Shapes, dtypes and target values; the class weights (undefined: all 1) must be f32 [C].
void check_cross_entropy_args(const char* op, const Tensor& logits, const Tensor& target, const Tensor& weight,
                              int64_t ignore_index) {
  MN_CHECK(logits.dtype() == DType::f32 && logits.dim() == 2, ValueError, op,
           ": expected f32 logits [N, C], got ", logits.dtype(), logits.sizes());
  const int64_t rows = logits.sizes()[0], classes = logits.sizes()[1];
  MN_CHECK(classes > 0, ValueError, op, ": logits of shape ", logits.sizes(), " have no classes");
  MN_CHECK(target.dtype() == DType::i64 && target.dim() == 1 && target.sizes()[0] == rows, ValueError, op,
           ": expected target of shape [", rows, "] (i64 class indices) for logits of shape ", logits.sizes(),
           ", got ", target.dtype(), target.sizes());
  MN_CHECK(!weight.defined() || (weight.dtype() == DType::f32 && weight.dim() == 1 && weight.sizes()[0] == classes),
           ValueError, op, ": expected f32 class weights of shape [", classes, "], got ", weight.dtype(),
           weight.sizes());
  const Tensor t = cpu::dense(target);
  const int64_t* p = t.data<int64_t>();
  for (int64_t i = 0; i < rows; ++i)
    MN_CHECK(p[i] == ignore_index || (p[i] >= 0 && p[i] < classes), IndexError, op, ": target ", p[i],
             " at position ", i, " is out of range for ", classes, " classes (logits of shape ",
             logits.sizes(), ")");
}

void cross_entropy_cpu(const Tensor& logits, const Tensor& target, const Tensor& weight, double smoothing,
                       int64_t ignore_index, Tensor& loss, Tensor& lse) {
  check_cross_entropy_args("cross_entropy", logits, target, weight, ignore_index);
  const int64_t rows = logits.sizes()[0], classes = logits.sizes()[1];
  MN_CHECK(loss.numel() == rows && lse.numel() == rows, ValueError, "cross_entropy: loss ", loss.sizes(),
           " and lse ", lse.sizes(), " must hold one value per row of logits ", logits.sizes());
  cpu::require_contiguous_output(loss, "cross_entropy", "loss");
  cpu::require_contiguous_output(lse, "cross_entropy", "lse");
  const Tensor x = cpu::dense(logits), t = cpu::dense(target);
  const Tensor w = weight.defined() ? cpu::dense(weight) : Tensor();
  const float* xp = x.numel() ? x.data<float>() : nullptr;
  const float* wp = w.defined() ? w.data<float>() : nullptr;
  const int64_t* tp = t.data<int64_t>();
  float* lp = loss.data<float>();
  float* sp = lse.data<float>();
  const double keep = 1.0 - smoothing;
  const double spread = smoothing / static_cast<double>(classes);
  const int team = parallel_team(rows * classes);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * classes;
    const ConstValues row(xr, classes);
    const float m = row.maxCoeff();
    const double sum = (row - m).exp().sum();
    const double log_sum_exp = m + std::log(sum);
    sp[r] = static_cast<float>(log_sum_exp);
    if (tp[r] == ignore_index) {
      lp[r] = 0.0f;
      continue;
    }
    // -log p_c = lse - x_c; the smoothing term averages it over all classes (weighted by class).
    if (wp == nullptr) {
      double value = keep * (log_sum_exp - xr[tp[r]]);
      if (smoothing != 0.0) value += smoothing * (log_sum_exp - row.sum() / static_cast<double>(classes));
      lp[r] = static_cast<float>(value);
      continue;
    }
    double value = keep * wp[tp[r]] * (log_sum_exp - xr[tp[r]]);
    if (smoothing != 0.0) {
      double smooth = 0.0;
      for (int64_t c = 0; c < classes; ++c) smooth += wp[c] * (log_sum_exp - xr[c]);
      value += spread * smooth;
    }
    lp[r] = static_cast<float>(value);
  }
}

void cross_entropy_backward_cpu(const Tensor& grad_loss, const Tensor& logits, const Tensor& target,
                                const Tensor& weight, const Tensor& lse, double smoothing, int64_t ignore_index,
                                Tensor& grad_logits) {
  check_cross_entropy_args("cross_entropy_backward", logits, target, weight, ignore_index);
  const int64_t rows = logits.sizes()[0], classes = logits.sizes()[1];
  MN_CHECK(grad_loss.numel() == rows && lse.numel() == rows && grad_logits.sizes() == logits.sizes(),
           ValueError, "cross_entropy_backward: grad_loss ", grad_loss.sizes(), ", lse ", lse.sizes(),
           " and grad_logits ", grad_logits.sizes(), " do not fit logits ", logits.sizes());
  cpu::require_contiguous_output(grad_logits, "cross_entropy_backward", "grad_logits");
  const Tensor x = cpu::dense(logits), t = cpu::dense(target), g = cpu::dense(grad_loss), l = cpu::dense(lse);
  const Tensor w = weight.defined() ? cpu::dense(weight) : Tensor();
  const float* xp = x.numel() ? x.data<float>() : nullptr;
  const float* wp = w.defined() ? w.data<float>() : nullptr;
  const int64_t* tp = t.data<int64_t>();
  const float* gp = g.data<float>();
  const float* lp = l.data<float>();
  float* out = grad_logits.numel() ? grad_logits.data<float>() : nullptr;
  const float keep = static_cast<float>(1.0 - smoothing);
  const float spread = static_cast<float>(smoothing / static_cast<double>(std::max<int64_t>(classes, 1)));
  double weight_total = 0.0;
  if (wp != nullptr)
    for (int64_t c = 0; c < classes; ++c) weight_total += wp[c];
  const float spread_total = static_cast<float>(spread * weight_total);
  const int team = parallel_team(rows * classes);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
  for (int64_t r = 0; r < rows; ++r) {
    float* gr = out + r * classes;
    if (tp[r] == ignore_index) {
      std::fill(gr, gr + classes, 0.0f);
      continue;
    }
    const float* xr = xp + r * classes;
    const float scale = gp[r], shift = lp[r];
    if (wp == nullptr) {
      Values(gr, classes) = scale * ((ConstValues(xr, classes) - shift).exp() - spread);
      gr[tp[r]] -= scale * keep;
      continue;
    }
    const float target_weight = keep * wp[tp[r]];
    const float coefficient = target_weight + spread_total;
    Values(gr, classes) =
        scale * ((ConstValues(xr, classes) - shift).exp() * coefficient - spread * ConstValues(wp, classes));
    gr[tp[r]] -= scale * target_weight;
  }
}

}  // namespace

void register_cpu_softmax() {
  softmax.set(DeviceType::CPU, softmax_cpu);
  softmax_backward.set(DeviceType::CPU, softmax_backward_cpu);
  cross_entropy_forward.set(DeviceType::CPU, cross_entropy_cpu);
  cross_entropy_backward.set(DeviceType::CPU, cross_entropy_backward_cpu);
}

}  // namespace mn::kernels
