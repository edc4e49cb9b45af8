#include "nn/reparametrize.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "autograd/node.h"
#include "autograd/ops.h"
#include "nn/compile.h"
#include "nn/functional_call.h"

namespace mn::nn {

void check_prune_fraction(double fraction) {
  MN_CHECK(std::isfinite(fraction) && fraction >= 0.0 && fraction < 1.0, ValueError,
           "prune fraction must be in [0, 1), got ", fraction);
}

std::map<std::string, Tensor> magnitude_prune_masks(const NamedTensors& tensors, double fraction, bool include_vectors) {
  check_prune_fraction(fraction);
  std::map<std::string, Tensor> masks;
  for (const auto& [name, t] : tensors) {
    if (!t.defined() || (t.dim() < 2 && !include_vectors)) continue;
    const std::vector<float> values = t.detach().to(kCPU).contiguous().to_vector<float>();
    const int64_t n = static_cast<int64_t>(values.size());
    const int64_t keep = std::min<int64_t>(n, std::llround((1.0 - fraction) * static_cast<double>(n)));
    std::vector<int64_t> order(values.size());
    std::iota(order.begin(), order.end(), int64_t{0});
    // Largest |value| first; a total order (index breaks ties, NaN ranks last) so the mask is the same
    // on every machine and thread count.
    const auto before = [&values](int64_t a, int64_t b) {
      const float x = std::fabs(values[static_cast<size_t>(a)]), y = std::fabs(values[static_cast<size_t>(b)]);
      const bool xn = std::isnan(x), yn = std::isnan(y);
      if (xn != yn) return yn;
      if (!xn && x != y) return x > y;
      return a < b;
    };
    if (keep < n) std::nth_element(order.begin(), order.begin() + keep, order.end(), before);
    std::vector<float> mask(values.size(), 0.0f);
    for (int64_t i = 0; i < keep; ++i) mask[static_cast<size_t>(order[static_cast<size_t>(i)])] = 1.0f;
    Tensor m = from_vector(mask, t.sizes());
    masks[name] = t.device().is_cpu() ? m : m.to(t.device());
  }
  return masks;
}

Reparametrized::Reparametrized(std::shared_ptr<Module> inner, ReparametrizeOptions options)
    : Module("Reparametrized"), inner_(std::move(inner)), options_(options) {
  MN_CHECK(inner_ != nullptr, ValueError, "Reparametrized: the inner module is null");
  MN_CHECK(options_.lrd_rank >= 0, ValueError, "rank must be positive (or 0 for no factorisation), got ",
           options_.lrd_rank);
  check_prune_fraction(options_.prune_fraction);
  const int64_t r = options_.lrd_rank;
  for (const auto& [name, t] : inner_->named_parameters()) {
    if (r > 0 && t.dim() == 2 && r < std::min(t.size(0), t.size(1))) {
      autograd::NoGradGuard no_grad;
      const int64_t m = t.size(0), n = t.size(1);
      // U V^T sums r products of independent factor entries: each factor's std is sqrt(s / sqrt(r)), so
      // the product's elements have the weight's own init variance s^2 (see the header).
      const double s = t.numel() > 1 ? std_dev(t.detach(), {}, 0.0).item() : 1.0;
      const double factor_std = std::sqrt((s > 1e-12 ? s : 1.0) / std::sqrt(static_cast<double>(r)));
      Factor f{name, normal({m, r}, 0.0, factor_std), normal({n, r}, 0.0, factor_std)};
      if (!t.device().is_cpu()) {
        f.u = f.u.to(t.device());
        f.v = f.v.to(t.device());
      }
      f.u.requires_grad_(t.requires_grad());
      f.v.requires_grad_(t.requires_grad());
      listed_.emplace_back(name + "_U", f.u);
      listed_.emplace_back(name + "_V", f.v);
      factors_.push_back(std::move(f));
    } else {
      listed_.emplace_back(name, t);
    }
  }
  if (options_.prune_fraction > 0) {
    masks_ = magnitude_prune_masks(listed_, options_.prune_fraction);
    autograd::NoGradGuard no_grad;
    for (auto& [name, t] : listed_) {
      auto it = masks_.find(name);
      if (it != masks_.end()) t.copy_(mul(t.detach(), it->second));
    }
  }
}

std::vector<std::string> Reparametrized::factored_names() const {
  std::vector<std::string> out;
  for (const auto& f : factors_) out.push_back(f.name);
  return out;
}

std::map<std::string, Tensor> Reparametrized::effective_parameters() const {
  std::map<std::string, Tensor> listed;
  for (const auto& [name, t] : listed_) {
    auto it = masks_.find(name);
    listed[name] = it == masks_.end() ? t : mul(t, it->second);
  }
  std::map<std::string, Tensor> out;
  for (const auto& [name, t] : inner_->named_parameters()) {
    auto it = listed.find(name);
    out[name] = it != listed.end() ? it->second : matmul(listed.at(name + "_U"), transpose(listed.at(name + "_V"), 0, 1));
  }
  return out;
}

StateDict Reparametrized::effective_state_dict() const {
  autograd::NoGradGuard no_grad;
  StateDict out;
  for (auto& [name, t] : effective_parameters()) out[name] = t.detach();
  for (auto& [name, t] : inner_->named_buffers()) out[name] = t.detach();
  return out;
}

Tensor Reparametrized::run_with(const std::function<Tensor(Module&)>& fn) {
  FunctionalCallOptions call;
  call.clone_buffers = false;  // the inner module's buffers update as in plain training
  FunctionalCallGuard guard(*inner_, effective_parameters(), call);
  return fn(*inner_);
}

Tensor Reparametrized::forward(const Tensor& x) {
  return run_with([&x](Module& m) { return m(x); });
}

NamedTensors Reparametrized::named_parameters(bool) const { return listed_; }
NamedTensors Reparametrized::named_buffers(bool) const { return inner_->named_buffers(); }

void Reparametrized::train(bool on) {
  Module::train(on);
  inner_->train(on);
}

void Reparametrized::to(Device device) {
  inner_->to(device);
  // The listed tensors of unfactored parameters are the inner module's (moved above): list them anew.
  const NamedTensors moved = inner_->named_parameters();
  std::map<std::string, Tensor> by_name(moved.begin(), moved.end());
  for (auto& f : factors_) {
    if (f.u.device() != device) f.u = f.u.detach().to(device).requires_grad_(f.u.requires_grad());
    if (f.v.device() != device) f.v = f.v.detach().to(device).requires_grad_(f.v.requires_grad());
    by_name[f.name + "_U"] = f.u;
    by_name[f.name + "_V"] = f.v;
  }
  for (auto& [name, t] : listed_) t = by_name.at(name);
  for (auto& [name, m] : masks_) m = m.to(device);
}

void Reparametrized::append_guard_words(std::vector<uint64_t>& key) const {
  module_guard(*inner_)(key);
  for (const auto& [name, t] : listed_) guard_memory(key, t);
  for (const auto& [name, m] : masks_) guard_memory(key, m);
}

int64_t Reparametrized::trainable_parameter_count() const {
  int64_t n = 0;
  for (const auto& [name, t] : listed_) {
    auto it = masks_.find(name);
    n += it == masks_.end() ? t.numel() : static_cast<int64_t>(std::llround(sum(it->second).item()));
  }
  return n;
}

}  // namespace mn::nn
