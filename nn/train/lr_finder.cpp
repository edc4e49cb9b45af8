// The learning-rate range test: the suggestion rules and Trainer::lr_find.
#include <algorithm>
#include <cmath>
#include <limits>

#include "autograd/node.h"
#include "nn/train/trainer.h"

namespace mn::train {

namespace {

size_t argmin_first(const std::vector<double>& v) {
  size_t best = 0;
  for (size_t i = 1; i < v.size(); ++i)
    if (v[i] < v[best]) best = i;
  return best;
}

std::optional<double> suggest_steep(const std::vector<double>& lrs, const std::vector<double>& s) {
  const size_t n = lrs.size();
  if (n == 0) return std::nullopt;
  if (n < 5) return lrs[0];
  const size_t minimum = argmin_first(s);
  // A minimum in the first steps says little: search the sweep except its (diverging) tail instead.
  size_t end = minimum < 3 ? std::max<size_t>(3, n - 5) : minimum;
  end = std::min(end, n - 1);
  std::vector<double> slopes;
  for (size_t i = 0; i < end; ++i) {
    const double dx = std::log10(lrs[i + 1]) - std::log10(lrs[i]);
    slopes.push_back(dx != 0.0 ? (s[i + 1] - s[i]) / dx : 0.0);
  }
  if (slopes.empty()) return lrs[0];
  std::vector<double> smoothed = slopes;
  if (slopes.size() >= 3) {  // centred 3-window mean, shortened at the ends
    for (size_t i = 0; i < slopes.size(); ++i) {
      const size_t lo = i == 0 ? 0 : i - 1, hi = std::min(slopes.size(), i + 2);
      double acc = 0.0;
      for (size_t j = lo; j < hi; ++j) acc += slopes[j];
      smoothed[i] = acc / static_cast<double>(hi - lo);
    }
  }
  return lrs[argmin_first(smoothed)];
}

std::optional<double> suggest_valley(const std::vector<double>& lrs, const std::vector<double>& s) {
  const size_t n = lrs.size();
  if (n == 0) return std::nullopt;
  if (n < 5) return lrs[0];
  // Longest strictly decreasing subsequence ending at each index (O(n^2) DP).
  std::vector<int64_t> length(n, 1);
  for (size_t i = 1; i < n; ++i)
    for (size_t j = 0; j < i; ++j)
      if (s[i] < s[j] && length[i] < length[j] + 1) length[i] = length[j] + 1;
  size_t end = 0;
  for (size_t i = 1; i < n; ++i)
    if (length[i] > length[end]) end = i;
  const int64_t run = length[end];
  const int64_t index = std::clamp<int64_t>(static_cast<int64_t>(end) - run + 2 * run / 3, 0,
                                            static_cast<int64_t>(n) - 1);
  return lrs[static_cast<size_t>(index)];
}

std::optional<double> suggest_minimum(const std::vector<double>& lrs, const std::vector<double>& s) {
  if (lrs.empty()) return std::nullopt;
  return lrs[argmin_first(s)] / 10.0;
}

}  // namespace

double LRFinderResult::suggestion(const std::string& method) const {
  MN_CHECK(lrs.size() == smoothed_losses.size(), ValueError, "LRFinderResult: ", lrs.size(), " learning rates but ",
           smoothed_losses.size(), " smoothed losses");
  std::optional<double> found;
  if (method == "steep") found = suggest_steep(lrs, smoothed_losses);
  else if (method == "valley") found = suggest_valley(lrs, smoothed_losses);
  else if (method == "minimum") found = suggest_minimum(lrs, smoothed_losses);
  else throw ValueError(str("Unknown suggestion method: '", method, "'. Choose from: 'steep', 'valley', 'minimum'"));
  MN_CHECK(found.has_value(), ValueError, "No suggested learning rate found using method '", method,
           "' (the sweep recorded no steps)");
  return *found;
}

LRFinderResult Trainer::lr_find(const LRFinderOptions& o) {
  return lr_find(o.min_lr, o.max_lr, o.num_iterations, o.divergence_threshold, o.beta);
}

LRFinderResult Trainer::lr_find(double min_lr, double max_lr, int64_t num_iterations, double divergence_threshold,
                                double beta) {
  MN_CHECK(min_lr > 0.0 && std::isfinite(min_lr) && max_lr >= min_lr && std::isfinite(max_lr), ValueError,
           "lr_find: need 0 < min_lr <= max_lr, got min_lr ", min_lr, " and max_lr ", max_lr);
  MN_CHECK(num_iterations >= 1, ValueError, "lr_find: num_iterations must be at least 1, got ", num_iterations);
  MN_CHECK(divergence_threshold > 0.0, ValueError, "lr_find: divergence_threshold must be positive, got ",
           divergence_threshold);
  MN_CHECK(beta >= 0.0 && beta < 1.0, ValueError, "lr_find: beta must be in [0, 1), got ", beta);

  // ---- snapshot ----
  const std::vector<Tensor> params = optimizer_->params();
  std::vector<Tensor> saved_values, saved_grads;
  for (const Tensor& p : params) {
    saved_values.push_back(p.detach().clone());
    saved_grads.push_back(p.grad().defined() ? p.grad().detach().clone() : Tensor());
  }
  const nn::optim::OptimizerState saved_optimizer = optimizer_->state_dict();
  const double saved_lr = optimizer_->lr();
  const nn::StateDict saved_buffers = snapshot_buffers();
  const uint64_t trainer_seed = generator_.seed(), trainer_offset = generator_.offset();
  const uint64_t global_seed = default_generator().seed(), global_offset = default_generator().offset();
  const int64_t saved_epoch = epoch_, saved_current_epoch = current_epoch_;
  const bool saved_should_stop = should_stop_, saved_callbacks_enabled = callbacks_enabled_;
  const bool saved_training = module_.is_training();
  const int64_t saved_pending = pending_batches_, saved_global_step = global_step_;
  const std::map<std::string, double> saved_scaler = scaler_ ? scaler_->state_dict() : std::map<std::string, double>{};
  const int64_t saved_skipped = skipped_steps_;

  auto restore = [&] {
    {
      autograd::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) {
        Tensor p = params[i];
        p.copy_(saved_values[i]);
        p.set_grad(saved_grads[i]);
      }
    }
    optimizer_->load_state_dict(saved_optimizer);
    optimizer_->set_lr(saved_lr);  // the state dict keeps it only as f32
    restore_buffers(saved_buffers);
    generator_.manual_seed(trainer_seed);
    generator_.set_offset(trainer_offset);
    default_generator().manual_seed(global_seed);
    default_generator().set_offset(global_offset);
    epoch_ = saved_epoch;
    current_epoch_ = saved_current_epoch;
    should_stop_ = saved_should_stop;
    callbacks_enabled_ = saved_callbacks_enabled;
    pending_batches_ = saved_pending;
    global_step_ = saved_global_step;
    if (scaler_) scaler_->load_state_dict(saved_scaler);
    skipped_steps_ = saved_skipped;
    module_.train(saved_training);
  };

  // ---- sweep: no callbacks, no accumulation ----
  LRFinderResult result;
  bool diverged = false;
  callbacks_enabled_ = false;
  try {
    module_.train();
    optimizer_->zero_grad();
    pending_batches_ = 0;
    auto it = train_loader_.begin();
    double best = std::numeric_limits<double>::infinity(), smoothed = 0.0;
    for (int64_t k = 0; k < num_iterations; ++k) {
      if (it == train_loader_.end()) it = train_loader_.begin();  // restart an exhausted loader
      MN_CHECK(it != train_loader_.end(), ValueError, "lr_find: the training loader yielded no batches");
      const data::Batch batch = *it;
      ++it;
      const double exponent = static_cast<double>(k) / static_cast<double>(std::max<int64_t>(1, num_iterations - 1));
      const double lr = min_lr * std::pow(max_lr / min_lr, exponent);
      optimizer_->set_lr(lr);
      const LossOutput out = train_step(batch, 1);
      double loss = out.total.detach().item();
      // Data parallel: every rank must take the same stop decision (a rank that stops early leaves the
      // others waiting in their next gradient all-reduce), so the sweep follows the mean over the ranks.
      if (metrics_reducer_)
        loss = metrics_reducer_({{"lr_find_loss", loss}}, batch.targets.size(0)).at("lr_find_loss");
      smoothed = k == 0 ? loss : beta * smoothed + (1.0 - beta) * loss;
      best = std::min(best, smoothed);
      result.lrs.push_back(lr);
      result.losses.push_back(loss);
      result.smoothed_losses.push_back(smoothed);
      // A non-finite loss has diverged whatever the threshold says (NaN compares false).
      if (!std::isfinite(smoothed) || (k > 0 && smoothed > divergence_threshold * best)) {
        diverged = true;
        break;
      }
    }
  } catch (...) {
    restore();
    throw;
  }
  restore();

  try {
    result.suggested_lr = result.suggestion("steep");
  } catch (const ValueError&) {
    result.suggested_lr.reset();
  }
  log(str("LR finder: ", result.lrs.size(), " steps from ", min_lr, " to ", result.lrs.back(),
          diverged ? " (stopped: loss diverged)" : "", result.suggested_lr ? str(", suggestion ",
          *result.suggested_lr) : std::string()));
  return result;
}

}  // namespace mn::train
