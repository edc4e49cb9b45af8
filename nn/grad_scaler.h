#pragma once
// mn::amp::GradScaler: dynamic loss scaling for f16 training, torch.cuda.amp.GradScaler's semantics and
// defaults. The loss is multiplied by a scale before backward so that small f16 gradients do not
// underflow; before the optimizer steps, the gradients are divided by it again and checked: a step whose
// gradients hold an infinity or a NaN is skipped and the scale is halved (backoff_factor), and after
// growth_interval clean steps in a row it is doubled (growth_factor).
//
//   amp::GradScaler scaler;                  // init_scale 65536, growth 2, backoff 0.5, interval 2000
//   for (const auto& batch : loader) {
//     optimizer.zero_grad();
//     Tensor loss = F::cross_entropy(model(batch.inputs), batch.targets);
//     scaler.scale(loss).backward();
//     scaler.unscale_(optimizer);            // optional: clipping then sees the true gradients
//     nn::optim::clip_grad_norm_(optimizer.params(), 1.0);
//     scaler.step(optimizer);                // skipped when a gradient is not finite
//     scaler.update();
//   }
//
// The scale is a 1-element f32 tensor on the loss's device (created by the first scale()), and so are
// the growth count (i64) and each step's found_inf flag: scale(), unscale_() and update() run kernels
// only, and step() reads one value per device to decide whether the optimizer steps (as PyTorch's
// step does). get_scale() and state_dict() read the scale on the host. The gradients stay f32 (latents
// and optimizer state are f32); unscale_ divides them in place, fused with the finiteness check into
// one pass per gradient (kernels::non_finite_check_and_unscale).
//
// Disabled (options.enabled = false), every method passes through: scale returns the loss, step calls
// optimizer.step() and returns true, unscale_ and update do nothing, get_scale is 1 and state_dict
// empty (load_state_dict then ignores its argument).
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "nn/optim.h"

namespace mn::amp {

struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;   // > 1
  double backoff_factor = 0.5;  // in (0, 1)
  int64_t growth_interval = 2000;  // >= 1 clean steps before the scale grows
  bool enabled = true;
};

class GradScaler {
 public:
  // Throws ValueError for options out of range (init_scale finite and positive, growth_factor finite
  // and > 1, backoff_factor in (0, 1), growth_interval >= 1); a disabled scaler takes any.
  explicit GradScaler(GradScalerOptions options = {});

  // loss * scale, differentiable in the loss; the result has the loss's shape and device.
  Tensor scale(const Tensor& loss);
  // Divides the optimizer's gradients by the scale in place and records whether any is not finite.
  // Once per optimizer between two update() calls: a second call, or one after step(), is a
  // RuntimeError (as PyTorch). Needs a scale (a scale() call before it).
  void unscale_(nn::optim::Optimizer& optimizer);
  // Unscales (unless unscale_ ran since the last update), then calls optimizer.step() unless a gradient
  // held an infinity or a NaN. Returns whether the optimizer stepped. Twice between two update() calls
  // is a RuntimeError, as is an optimizer without any gradient (no check was recorded).
  bool step(nn::optim::Optimizer& optimizer);
  // Backs the scale off when any optimizer's step found a non-finite gradient since the last update,
  // else counts a clean step and grows the scale after growth_interval of them (on the device:
  // kernels::amp_update_scale). With new_scale (finite, positive) sets the scale instead and leaves the
  // growth count alone. Then every optimizer may unscale and step again. Without new_scale, at least
  // one unscale_ or step must have run since the last update (RuntimeError otherwise).
  void update(std::optional<double> new_scale = std::nullopt);

  // The current scale (a host read), init_scale before the first scale(); 1 when disabled.
  double get_scale() const;
  // The clean steps counted towards the next growth (a host read).
  int64_t growth_tracker() const;
  bool is_enabled() const { return options_.enabled; }
  const GradScalerOptions& options() const { return options_; }
  // The scale tensor (1-element f32), undefined before the first scale() or materialize().
  const Tensor& scale_tensor() const { return scale_; }
  // Creates the scale and growth-count tensors on `device` now, with the current values, instead of at
  // the first scale(): so a step captured by mn::compile reads the one scale tensor that update()
  // rewrites in place. Nothing when they exist already or the scaler is disabled.
  void materialize(Device device);

  // PyTorch's keys: "scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker".
  // Empty when disabled.
  std::map<std::string, double> state_dict() const;
  // Restores a state_dict (checked first; the tensors keep their memory and are filled in place). An
  // empty state is a RuntimeError (saved from a disabled scaler, as PyTorch says); a disabled scaler
  // ignores the call.
  void load_state_dict(const std::map<std::string, double>& state);
  // Everything load_state_dict checks, without changing anything: exactly the five keys, scale finite
  // and positive, growth_factor finite and > 1, backoff_factor in (0, 1), growth_interval a whole number
  // >= 1 and _growth_tracker a whole number in [0, growth_interval). `source` starts each message.
  static void check_state_dict(const std::map<std::string, double>& state, const std::string& source = "GradScaler");

 private:
  enum class Stage { Ready, Unscaled, Stepped };
  struct OptimizerRecord {
    Stage stage = Stage::Ready;
    std::vector<std::pair<Device, Tensor>> found_inf;  // per device holding gradients
  };
  void require_scale(const char* who) const;
  Tensor scale_on(Device device) const;

  GradScalerOptions options_;
  // Before the tensors exist: the values they will start from (load_state_dict sets them too).
  double init_scale_;
  int64_t init_growth_tracker_ = 0;
  Tensor scale_;           // [1] f32
  Tensor growth_tracker_;  // [1] i64
  std::map<const nn::optim::Optimizer*, OptimizerRecord> records_;
};

}  // namespace mn::amp
