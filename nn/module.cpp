#include "nn/module.h"

#include <algorithm>
#include <sstream>
#include <unordered_set>

#include "autograd/node.h"
#include "nn/functional_call.h"

namespace mn::nn {

namespace {
Tensor* find_in(NamedTensors& list, const std::string& name) {
  for (auto& [n, t] : list)
    if (n == name) return &t;
  return nullptr;
}
const Tensor* find_in(const NamedTensors& list, const std::string& name) {
  for (const auto& [n, t] : list)
    if (n == name) return &t;
  return nullptr;
}
std::string qualified(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}
thread_local CallInterceptor* g_interceptor = nullptr;
}  // namespace

CallInterceptorGuard::CallInterceptorGuard(CallInterceptor* interceptor) : previous_(g_interceptor) {
  g_interceptor = interceptor;
}
CallInterceptorGuard::~CallInterceptorGuard() { g_interceptor = previous_; }

Tensor Module::operator()(const Tensor& x) {
  if (g_interceptor == nullptr) return forward(x);
  // The body captures the module, not the call's locals: an interceptor may run it again later.
  std::vector<Tensor> out = g_interceptor->intercept(
      *this, {x}, [this](const std::vector<Tensor>& in) { return std::vector<Tensor>{forward(in[0])}; });
  MN_CHECK(out.size() == 1, RuntimeError, type_name_, ": the call interceptor returned ", out.size(),
           " tensors for a single-output forward");
  return out[0];
}

std::vector<Tensor> Module::call(const std::vector<Tensor>& inputs, const ModuleBody& body) {
  if (g_interceptor == nullptr) return body(inputs);
  return g_interceptor->intercept(*this, inputs, body);
}

Tensor Module::forward(const Tensor&) {
  throw NotImplementedError(str(type_name_, " has no single-tensor forward"));
}

void Module::check_name(const std::string& kind, const std::string& name) {
  MN_CHECK(!name.empty(), ValueError, kind, " names must be non-empty");
  MN_CHECK(name.find('.') == std::string::npos, ValueError, kind, " name '", name, "' must not contain '.'");
}

Tensor Module::register_parameter(const std::string& name, Tensor value, bool requires_grad) {
  check_name("parameter", name);
  MN_CHECK(!find_in(params_, name) && !find_in(buffers_, name), ValueError, type_name_, ": '", name,
           "' is already registered");
  if (value.defined()) {
    value = value.detach();
    if (requires_grad) value.requires_grad_(true);
  }
  params_.emplace_back(name, value);
  return value;
}

Tensor Module::register_buffer(const std::string& name, Tensor value) {
  check_name("buffer", name);
  MN_CHECK(!find_in(params_, name) && !find_in(buffers_, name), ValueError, type_name_, ": '", name,
           "' is already registered");
  buffers_.emplace_back(name, value.defined() ? value.detach() : value);
  return value;
}

void Module::add_child(const std::string& name, std::shared_ptr<Module> module) {
  check_name("module", name);
  MN_CHECK(module != nullptr, ValueError, type_name_, ": module '", name, "' is null");
  for (auto& [n, m] : children_) MN_CHECK(n != name, ValueError, type_name_, ": module '", name, "' is already registered");
  children_.emplace_back(name, std::move(module));
}

Tensor Module::param(const std::string& name) const {
  if (detail::functional_call_active())
    if (Tensor* t = detail::find_override(this, name, /*mark_read=*/true)) return *t;
  if (const Tensor* t = find_in(params_, name)) return *t;
  throw KeyError(str(type_name_, " has no parameter '", name, "'"));
}

Tensor Module::buffer(const std::string& name) const {
  if (detail::functional_call_active())
    if (Tensor* t = detail::find_override(this, name)) return *t;
  if (const Tensor* t = find_in(buffers_, name)) return *t;
  throw KeyError(str(type_name_, " has no buffer '", name, "'"));
}

bool Module::has_parameter(const std::string& name) const {
  const Tensor* t = find_in(params_, name);
  return t != nullptr && t->defined();
}

void Module::set_buffer(const std::string& name, const Tensor& value) {
  if (detail::functional_call_active())
    if (Tensor* t = detail::find_override(this, name)) {
      *t = value;
      return;
    }
  Tensor* t = find_in(buffers_, name);
  MN_CHECK(t != nullptr, KeyError, type_name_, " has no buffer '", name, "'");
  *t = value;
}

std::vector<std::pair<std::string, std::shared_ptr<Module>>> Module::named_modules(const std::string& prefix) const {
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> out;
  // The root is returned without owning pointer semantics when it is not shared.
  std::shared_ptr<Module> self;
  try {
    self = std::const_pointer_cast<Module>(shared_from_this());
  } catch (const std::bad_weak_ptr&) {
    self = std::shared_ptr<Module>(const_cast<Module*>(this), [](Module*) {});
  }
  out.emplace_back(prefix, self);
  for (const auto& [name, child] : children_)
    for (auto& entry : child->named_modules(qualified(prefix, name))) out.push_back(std::move(entry));
  return out;
}

NamedTensors Module::named_parameters(bool recurse) const {
  NamedTensors out;
  std::unordered_set<const TensorImpl*> seen;  // shared parameters are listed once
  auto add = [&](std::string name, const Tensor& t) {
    if (t.defined() && seen.insert(t.impl()).second) out.emplace_back(std::move(name), t);
  };
  for (const auto& [n, t] : params_) add(n, t);
  if (recurse)
    for (const auto& [prefix, child] : children_)
      for (const auto& [n, t] : child->named_parameters(true)) add(qualified(prefix, n), t);
  return out;
}

NamedTensors Module::named_buffers(bool recurse) const {
  NamedTensors out;
  for (const auto& [n, t] : buffers_)
    if (t.defined()) out.emplace_back(n, t);
  if (recurse)
    for (const auto& [prefix, child] : children_)
      for (const auto& [n, t] : child->named_buffers(true)) out.emplace_back(qualified(prefix, n), t);
  return out;
}

std::vector<Tensor> Module::parameters(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [n, t] : named_parameters(recurse)) out.push_back(t);
  return out;
}

int64_t Module::parameter_count() const {
  int64_t n = 0;
  for (auto& [name, t] : named_parameters()) n += t.numel();
  return n;
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [n, child] : children_) child->train(on);
}

void Module::zero_grad() {
  for (auto& [n, t] : named_parameters()) t.set_grad(Tensor());
}

void Module::requires_grad_(bool on) {
  for (auto& [n, t] : named_parameters()) t.requires_grad_(on);
}

void Module::to(Device device) {
  for (auto& [n, t] : params_) {
    if (!t.defined() || t.device() == device) continue;
    const bool rg = t.requires_grad();
    t = t.detach().to(device);
    if (rg) t.requires_grad_(true);
  }
  for (auto& [n, t] : buffers_)
    if (t.defined() && t.device() != device) t = t.to(device);
  for (auto& [n, child] : children_) child->to(device);
}

StateDict Module::state_dict() const {
  StateDict out;
  for (auto& [n, t] : named_parameters()) out[n] = t.detach();
  for (auto& [n, t] : named_buffers()) out[n] = t.detach();
  return out;
}

Module::LoadResult Module::load_state_dict(const StateDict& state, bool strict) {
  std::vector<std::string> missing, mismatched, unexpected;
  std::map<std::string, Tensor> targets;
  for (auto& [n, t] : named_parameters()) targets[n] = t;
  for (auto& [n, t] : named_buffers()) targets[n] = t;
  for (auto& [n, t] : targets) {
    auto it = state.find(n);
    if (it == state.end()) {
      missing.push_back(n);
    } else if (it->second.sizes() != t.sizes()) {
      mismatched.push_back(str(n, " (expected ", t.sizes(), ", got ", it->second.sizes(), ")"));
    }
  }
  for (auto& [n, t] : state)
    if (!targets.count(n)) unexpected.push_back(n);
  if (!mismatched.empty() || (strict && (!missing.empty() || !unexpected.empty())))
    throw ValueError(str("load_state_dict for ", type_name_, ": missing=", bracket_list(missing), ", unexpected=",
                         bracket_list(unexpected), ", mismatched=", bracket_list(mismatched)));
  autograd::NoGradGuard no_grad;
  for (auto& [n, t] : targets) {
    auto it = state.find(n);
    if (it == state.end()) continue;
    Tensor dst = t.detach();
    dst.copy_(it->second.to(t.dtype()).to(t.device()));
  }
  return {std::move(missing), std::move(unexpected)};
}

}  // namespace mn::nn
