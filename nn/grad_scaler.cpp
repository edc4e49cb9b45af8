#include "nn/grad_scaler.h"

#include <algorithm>
#include <cmath>

#include "autograd/node.h"
#include "autograd/ops.h"
#include "kernels/kernels.h"

namespace mn::amp {

namespace {

constexpr const char* kScale = "scale";
constexpr const char* kGrowthFactor = "growth_factor";
constexpr const char* kBackoffFactor = "backoff_factor";
constexpr const char* kGrowthInterval = "growth_interval";
constexpr const char* kGrowthTracker = "_growth_tracker";

// The ranges both the constructor and check_state_dict enforce; `what` starts the message and names the
// value ("GradScaler: init_scale", "<source>: 'scale'").
void check_scale_value(double scale, const std::string& what) {
  MN_CHECK(std::isfinite(scale) && scale > 0.0, ValueError, what, " must be a finite positive number, got ", scale);
}
void check_factors(double growth, double backoff, const std::string& growth_what, const std::string& backoff_what) {
  MN_CHECK(std::isfinite(growth) && growth > 1.0, ValueError, growth_what, " must be a finite number > 1, got ", growth);
  MN_CHECK(backoff > 0.0 && backoff < 1.0, ValueError, backoff_what, " must be in (0, 1), got ", backoff);
}

bool whole(double v) { return std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 9007199254740992.0; }

}  // namespace

GradScaler::GradScaler(GradScalerOptions options) : options_(options), init_scale_(options.init_scale) {
  if (!options_.enabled) return;
  check_scale_value(options_.init_scale, "GradScaler: init_scale");
  check_factors(options_.growth_factor, options_.backoff_factor, "GradScaler: growth_factor",
                "GradScaler: backoff_factor");
  MN_CHECK(options_.growth_interval >= 1, ValueError, "GradScaler: growth_interval must be at least 1, got ",
           options_.growth_interval);
}

void GradScaler::materialize(Device device) {
  if (!options_.enabled || scale_.defined()) return;
  scale_ = full({1}, init_scale_, TensorOptions(device));
  growth_tracker_ = full({1}, static_cast<double>(init_growth_tracker_), TensorOptions(device).with_dtype(DType::i64));
}

void GradScaler::require_scale(const char* who) const {
  MN_CHECK(scale_.defined(), RuntimeError, "GradScaler: ", who, "() needs the scale, which the first scale(loss) ",
           "creates: call scaler.scale(loss) and backward on it earlier in the iteration");
}

Tensor GradScaler::scale_on(Device device) const { return scale_.device() == device ? scale_ : scale_.to(device); }

Tensor GradScaler::scale(const Tensor& loss) {
  if (!options_.enabled) return loss;
  MN_CHECK(loss.defined(), ValueError, "GradScaler: scale() got an undefined tensor");
  materialize(loss.device());
  // A 0-d view of the [1] scale: the product keeps the loss's shape.
  return mul(loss, scale_on(loss.device()).reshape(Shape{}));
}

void GradScaler::unscale_(nn::optim::Optimizer& optimizer) {
  if (!options_.enabled) return;
  require_scale("unscale_");
  OptimizerRecord& record = records_[&optimizer];
  MN_CHECK(record.stage != Stage::Unscaled, RuntimeError,
           "GradScaler: unscale_() has already been called on this optimizer since the last update()");
  MN_CHECK(record.stage != Stage::Stepped, RuntimeError,
           "GradScaler: unscale_() is being called after step(); call update() first");
  autograd::NoGradGuard no_grad;
  // PyTorch's 1 / scale in double rounded to float: the f32 reciprocal is that same correctly rounded value.
  const Tensor inv_scale = reciprocal(scale_);
  std::vector<std::pair<Device, Tensor>> found;       // per device
  std::vector<std::pair<Device, Tensor>> inv_scales;  // per device
  const std::vector<Tensor>& params = optimizer.params();
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor grad = params[i].grad();
    if (!grad.defined()) continue;
    MN_CHECK(grad.dtype() == DType::f32, TypeError, "GradScaler: unscale_ expects f32 gradients (parameters and ",
             "optimizer state stay f32), got ", grad.dtype(), " for parameter ", i);
    if (!grad.is_contiguous()) {  // the kernel works in place on dense memory
      grad = grad.contiguous();
      params[i].set_grad(grad);
    }
    const Device device = grad.device();
    auto f = std::find_if(found.begin(), found.end(), [&](const auto& e) { return e.first == device; });
    if (f == found.end()) {
      f = found.insert(found.end(), {device, zeros({1}, TensorOptions(device))});
      inv_scales.emplace_back(device, device == inv_scale.device() ? inv_scale : inv_scale.to(device));
    }
    const Tensor& inv = inv_scales[static_cast<size_t>(f - found.begin())].second;
    kernels::non_finite_check_and_unscale(device, grad, f->second, inv);
  }
  record.found_inf = std::move(found);
  record.stage = Stage::Unscaled;
}

bool GradScaler::step(nn::optim::Optimizer& optimizer) {
  if (!options_.enabled) {
    optimizer.step();
    return true;
  }
  require_scale("step");
  OptimizerRecord& record = records_[&optimizer];
  MN_CHECK(record.stage != Stage::Stepped, RuntimeError, "GradScaler: step() has already been called since the last ",
           "update()");
  if (record.stage == Stage::Ready) unscale_(optimizer);
  MN_CHECK(!record.found_inf.empty(), RuntimeError, "GradScaler: no inf checks were recorded for this optimizer ",
           "(none of its ", optimizer.params().size(), " parameters has a gradient)");
  // The one host read of the step: whether any device saw an infinity or a NaN.
  double found = 0.0;
  for (const auto& [device, flag] : record.found_inf) found += flag.item();
  const bool apply = found == 0.0;
  if (apply) optimizer.step();
  record.stage = Stage::Stepped;
  return apply;
}

void GradScaler::update(std::optional<double> new_scale) {
  if (!options_.enabled) return;
  require_scale("update");
  autograd::NoGradGuard no_grad;
  if (new_scale) {
    check_scale_value(*new_scale, "GradScaler: update(new_scale)");
    scale_.fill_(*new_scale);
  } else {
    Tensor combined;
    for (const auto& [optimizer, record] : records_)
      for (const auto& [device, flag] : record.found_inf) {
        const Tensor here = device == scale_.device() ? flag : flag.to(scale_.device());
        combined = combined.defined() ? add(combined, here) : here;
      }
    MN_CHECK(combined.defined(), RuntimeError, "GradScaler: no inf checks were recorded prior to update(): call "
             "step() (or unscale_()) for the optimizer first");
    kernels::amp_update_scale(scale_.device(), scale_, growth_tracker_, combined, options_.growth_factor,
                              options_.backoff_factor, options_.growth_interval);
  }
  records_.clear();
}

double GradScaler::get_scale() const {
  if (!options_.enabled) return 1.0;
  return scale_.defined() ? scale_.item() : init_scale_;
}

int64_t GradScaler::growth_tracker() const {
  if (!options_.enabled) return 0;
  return growth_tracker_.defined() ? static_cast<int64_t>(growth_tracker_.item()) : init_growth_tracker_;
}

std::map<std::string, double> GradScaler::state_dict() const {
  if (!options_.enabled) return {};
  return {{kScale, get_scale()},
          {kGrowthFactor, options_.growth_factor},
          {kBackoffFactor, options_.backoff_factor},
          {kGrowthInterval, static_cast<double>(options_.growth_interval)},
          {kGrowthTracker, static_cast<double>(growth_tracker())}};
}

void GradScaler::check_state_dict(const std::map<std::string, double>& state, const std::string& source) {
  for (const char* key : {kScale, kGrowthFactor, kBackoffFactor, kGrowthInterval, kGrowthTracker})
    MN_CHECK(state.count(key) != 0, ValueError, source, ": missing '", key, "' (expected scale, growth_factor, ",
             "backoff_factor, growth_interval and _growth_tracker)");
  for (const auto& [key, value] : state)
    MN_CHECK(key == kScale || key == kGrowthFactor || key == kBackoffFactor || key == kGrowthInterval ||
                 key == kGrowthTracker,
             ValueError, source, ": unexpected key '", key, "' (expected scale, growth_factor, backoff_factor, ",
             "growth_interval and _growth_tracker)");
  check_scale_value(state.at(kScale), str(source, ": 'scale'"));
  check_factors(state.at(kGrowthFactor), state.at(kBackoffFactor), str(source, ": 'growth_factor'"),
                str(source, ": 'backoff_factor'"));
  const double interval = state.at(kGrowthInterval), tracker = state.at(kGrowthTracker);
  MN_CHECK(whole(interval) && interval >= 1.0, ValueError, source, ": 'growth_interval' must be a whole number >= 1, ",
           "got ", interval);
  MN_CHECK(whole(tracker) && tracker >= 0.0 && tracker < interval, ValueError, source, ": '_growth_tracker' must be ",
           "a whole number in [0, growth_interval = ", interval, "), got ", tracker);
}

void GradScaler::load_state_dict(const std::map<std::string, double>& state) {
  if (!options_.enabled) return;
  MN_CHECK(!state.empty(), RuntimeError, "GradScaler: the state dict is empty, possibly because it was saved from a ",
           "disabled GradScaler");
  check_state_dict(state);
  options_.growth_factor = state.at(kGrowthFactor);
  options_.backoff_factor = state.at(kBackoffFactor);
  options_.growth_interval = static_cast<int64_t>(state.at(kGrowthInterval));
  init_scale_ = state.at(kScale);
  init_growth_tracker_ = static_cast<int64_t>(state.at(kGrowthTracker));
  if (scale_.defined()) {  // in place: a captured step keeps reading these tensors
    autograd::NoGradGuard no_grad;
    scale_.fill_(init_scale_);
    growth_tracker_.fill_(static_cast<double>(init_growth_tracker_));
  }
}

}  // namespace mn::amp
