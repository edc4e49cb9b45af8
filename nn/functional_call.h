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

#include "nn/module.h"

namespace mn::nn {

struct FunctionalCallOptions {
  bool strict = true;              // every parameter must be supplied, nothing unexpected
  bool clone_buffers = true;       // buffers not supplied are cloned for the call
  StateDict* buffers_out = nullptr;  // if set, receives the call's (possibly updated) buffers
};

// RAII guard: while alive, `module` (and its descendants) read the given tensors. `tensors` maps
// dotted names (as in named_parameters / named_buffers) to values; shapes must match.
class FunctionalCallGuard {
 public:
  FunctionalCallGuard(const Module& module, const std::map<std::string, Tensor>& tensors,
                      const FunctionalCallOptions& options = {});
  ~FunctionalCallGuard();
  FunctionalCallGuard(const FunctionalCallGuard&) = delete;
  FunctionalCallGuard& operator=(const FunctionalCallGuard&) = delete;

 private:
  const Module& module_;
  FunctionalCallOptions options_;
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
// Lookup used by Module: the override for (module, local name) in the innermost frame, or nullptr.
Tensor* find_override(const Module* module, const std::string& name);
bool functional_call_active();
}  // namespace detail

}  // namespace mn::nn
