#pragma once
// functional_call: run a module with parameters (and optionally buffers) supplied by the caller,
// without mutating the module. A scoped guard pushes a per-module override table on a thread-local
// stack; Module::param()/buffer() consult the innermost table. Gradients flow into the supplied
// tensors. Buffers are cloned per call (BatchNorm running stats of the module never change), and
// optionally written back to the caller's map afterwards.
#include <concepts>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "nn/module.h"

namespace mn::nn {

struct FunctionalCallOptions {
  bool strict = true;              // every parameter must be supplied, nothing unexpected
  bool clone_buffers = true;       // buffers not supplied are cloned for the call
  StateDict* buffers_out = nullptr;  // if set, receives the call's (possibly updated) buffers
  // With strict = false: when set, a parameter that is not supplied is blocked instead of falling
  // through to the module's own tensor (or an outer call's): Module::param() on it throws a
  // ValueError with blocked_parameter_error(its dotted name). A nested call that supplies it wins.
  std::function<std::string(const std::string&)> blocked_parameter_error;
};

namespace detail {
struct Frame;  // one guard's overrides (functional_call.cpp)
}

// RAII guard: while alive, `module` (and its descendants) read the given tensors. `tensors` maps
// dotted names (as in named_parameters / named_buffers) to values; shapes must match.
class FunctionalCallGuard {
 public:
  FunctionalCallGuard(const Module& module, const std::map<std::string, Tensor>& tensors,
                      const FunctionalCallOptions& options = {});
  ~FunctionalCallGuard();
  FunctionalCallGuard(const FunctionalCallGuard&) = delete;
  FunctionalCallGuard& operator=(const FunctionalCallGuard&) = delete;

  // Dotted names of the supplied parameters that no Module::param() call has read under this guard
  // so far (for this guard's frame, so a nested call that supplies the same module shadows it). A
  // layer that kept register_parameter's return value in a member and computes with that never asks,
  // so its forward ran on the module's own tensor instead of the supplied one.
  std::vector<std::string> unread_parameters() const;

 private:
  const Module& module_;
  FunctionalCallOptions options_;
  detail::Frame* frame_ = nullptr;  // this guard's entry on the thread's stack of overrides
};

// Runs body() under a FunctionalCallGuard and returns its result.
template <class F>
  requires std::invocable<F>
auto functional_call(const Module& module, const std::map<std::string, Tensor>& tensors, F&& body,
                     const FunctionalCallOptions& options = {}) {
  FunctionalCallGuard guard(module, tensors, options);
  return body();
}

// Convenience: module.forward(x) under the override.
Tensor functional_call(Module& module, const std::map<std::string, Tensor>& tensors, const Tensor& x,
                       const FunctionalCallOptions& options = {});

namespace detail {
// Lookup used by Module: the override for (module, local name) in the innermost frame that has one,
// or nullptr. mark_read records that a parameter was read (Module::param), see unread_parameters().
Tensor* find_override(const Module* module, const std::string& name, bool mark_read = false);
bool functional_call_active();
}  // namespace detail

}  // namespace mn::nn
