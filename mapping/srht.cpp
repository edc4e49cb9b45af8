#include "mapping/srht.h"

#include <cmath>

#include "autograd/function.h"
#include "autograd/ops.h"
#include "kernels/kernels.h"
#include "kernels/srht_math.h"

namespace mn::mapping {

std::shared_ptr<const kernels::SrhtPlan> srht_plan(uint64_t seed, uint64_t stream, int64_t rows, int64_t cols,
                                           double expansion) {
  MN_CHECK(rows > 0 && cols > 0 && rows >= cols, ValueError, "srht_plan: need rows >= cols > 0, got ", rows, "x",
           cols);
  int64_t pow2 = 1;
  while (pow2 < cols) pow2 <<= 1;
  if (rows < pow2) return nullptr;
  kernels::SrhtPlan p;
  p.rows = rows;
  p.cols = cols;
  p.pow2 = pow2;
  p.blocks = rows / pow2;
  p.tail = rows - p.blocks * pow2;
  p.seed = seed;
  p.stream = stream;
  const double P = static_cast<double>(pow2), r = static_cast<double>(p.tail);
  // Each block is sqrt(P) times an isometry (H unnormalised), and there are k of them.
  const double scale = expansion / std::sqrt(static_cast<double>(p.blocks) * P);
  p.scale = static_cast<float>(scale);
  p.tail_head = static_cast<float>(scale * std::sqrt(P / (P + r)));
  p.tail_mix = static_cast<float>(scale / std::sqrt(P));
  p.split = static_cast<float>(std::sqrt(r / (P + r)));
  return std::make_shared<const kernels::SrhtPlan>(p);
}

namespace {
// The kernels take contiguous f32 vectors and write fresh outputs; the autograd node of each direction
// calls the other direction on the incoming gradient (with differentiable ops, so double backward works).
Tensor run(const kernels::SrhtPlan& plan, const Tensor& in, bool transpose) {
  const int64_t in_n = transpose ? plan.rows : plan.cols, out_n = transpose ? plan.cols : plan.rows;
  MN_CHECK(in.defined() && in.dim() == 1 && in.size(0) == in_n, ValueError, "Expected a 1D vector with ", in_n,
           " values, got shape ", in.defined() ? in.sizes().str() : std::string("undefined"));
  MN_CHECK(in.dtype() == DType::f32, TypeError, "the srht map takes f32 vectors, got ", in.dtype());
  Tensor out = empty({out_n}, TensorOptions().with_device(in.device()));
  {
    autograd::NoGradGuard no_grad;
    const Tensor src = in.detach().contiguous();
    if (transpose)
      kernels::srht_apply_transpose(in.device(), plan, src, out);
    else
      kernels::srht_apply(in.device(), plan, src, out);
  }
  if (autograd::needs_grad({&in}))
    autograd::record(transpose ? "SrhtTransposeBackward" : "SrhtApplyBackward", {&in}, {&out},
                     [plan, transpose](const autograd::GradContext& c) -> autograd::TensorList {
                       return {transpose ? srht_forward(plan, c.grad()) : srht_transpose(plan, c.grad())};
                     });
  return out;
}
}  // namespace

Tensor srht_forward(const kernels::SrhtPlan& plan, const Tensor& z) { return run(plan, z, false); }
Tensor srht_transpose(const kernels::SrhtPlan& plan, const Tensor& u) { return run(plan, u, true); }

}  // namespace mn::mapping
