// The gradient scaler's kernels on the CPU (math and checks in kernels/amp_math.h): the fused
// non-finite check and unscale of one gradient, and the scale update.
#include <algorithm>

#include "kernels/amp_math.h"
#include "kernels/cpu/loops.h"
#include "kernels/kernels.h"

namespace mn::kernels {
namespace {

constexpr int64_t kParallelElements = 65536;  // smaller gradients run on the calling thread

void non_finite_check_and_unscale_cpu(Tensor& grad, Tensor& found_inf, const Tensor& inv_scale) {
  check_unscale_operands(grad, found_inf, inv_scale);
  float* g = grad.data<float>();
  const float inv = *inv_scale.data<float>();
  const int64_t n = grad.numel();
  // Each element is tested and scaled independently, so the flag is an OR whatever the thread split.
  int found = 0;
  const int team = cpu::parallel_team(n, kParallelElements);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1) reduction(| : found)
  for (int64_t i = 0; i < n; ++i) found |= unscale_element(g[i], inv) ? 1 : 0;
  if (found != 0) *found_inf.data<float>() = 1.0f;
}

void amp_update_scale_cpu(Tensor& scale, Tensor& growth_tracker, const Tensor& found_inf, double growth_factor,
                          double backoff_factor, int64_t growth_interval) {
  check_update_scale_operands(scale, growth_tracker, found_inf);
  update_scale(*scale.data<float>(), *growth_tracker.data<int64_t>(), *found_inf.data<float>(), growth_factor,
               backoff_factor, growth_interval);
}

}  // namespace

void register_cpu_amp() {
  non_finite_check_and_unscale.set(DeviceType::CPU, non_finite_check_and_unscale_cpu);
  amp_update_scale.set(DeviceType::CPU, amp_update_scale_cpu);
}

}  // namespace mn::kernels
