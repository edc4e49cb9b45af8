#pragma once
// nn::Module: ordered parameters, buffers and child modules with dotted names in registration order
// ("features.0.weight"). Layers read their tensors through param()/buffer(), which consult the
// innermost functional_call override first, so a module can run with parameters supplied from
// outside without being modified.
//
// Listing (named_parameters, named_buffers), to() and train() are virtual and recurse through the
// children's overrides, so a module that keeps its tensors elsewhere (mapping::MappingModel: the
// generator's latents) lists them, moves them and round-trips them through state_dict()/
// load_state_dict() like any module, also when it is nested inside another one.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "autograd/ops.h"
#include "core/tensor.h"

namespace mn::nn {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;
using StateDict = std::map<std::string, Tensor>;
// Named groups of tensors (see Module::replica_state).
using NamedTensorGroups = std::vector<std::pair<std::string, std::vector<Tensor>>>;
// A module's forward as a function of its tensor arguments (see Module::call).
using ModuleBody = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

class Module;

// A per-thread hook around module calls: while a CallInterceptorGuard holds one, every
// Module::operator() and Module::call on this thread goes through intercept(), which must return what
// body(inputs) returns (it may run body inside a functional call, a checkpoint, ...). Streaming in
// mapping::MappingModel uses it to generate a module's parameters just before the module runs. Calls
// made inside body go through it again.
class CallInterceptor {
 public:
  virtual ~CallInterceptor() = default;
  virtual std::vector<Tensor> intercept(Module& module, const std::vector<Tensor>& inputs, const ModuleBody& body) = 0;
};

// Installs `interceptor` (nullptr: none) for this thread while alive; the previous one comes back after.
class CallInterceptorGuard {
 public:
  explicit CallInterceptorGuard(CallInterceptor* interceptor);
  ~CallInterceptorGuard();
  CallInterceptorGuard(const CallInterceptorGuard&) = delete;
  CallInterceptorGuard& operator=(const CallInterceptorGuard&) = delete;

 private:
  CallInterceptor* previous_;
};

class Module : public std::enable_shared_from_this<Module> {
 public:
  explicit Module(std::string type_name) : type_name_(std::move(type_name)) {}
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // The single-input forward used by Sequential and by functional_call's convenience form.
  virtual Tensor forward(const Tensor& x);
  // Calling a module: forward(x), through the thread's CallInterceptor when one is installed. A module
  // that runs children calls them this way (child(x), as in PyTorch), not through child.forward(x):
  // a direct forward() bypasses the interceptor (streamed mapping then refuses the child's parameter
  // reads, see MappingOptions::stream_layers).
  Tensor operator()(const Tensor& x);
  // The same for a forward with another signature: body(inputs) computes this module's call from its
  // tensor arguments and returns its tensor results; non-tensor arguments go in body's captures.
  // An interceptor may keep body and run it again later (recomputation in backward), so body captures
  // by value and computes the same function each time.
  std::vector<Tensor> call(const std::vector<Tensor>& inputs, const ModuleBody& body);

  const std::string& type_name() const { return type_name_; }

  // ---- registration (names are non-empty and contain no '.') ----
  Tensor register_parameter(const std::string& name, Tensor value, bool requires_grad = true);
  Tensor register_buffer(const std::string& name, Tensor value);
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> module) {
    add_child(name, module);
    return module;
  }

  // ---- access (honours functional_call overrides) ----
  Tensor param(const std::string& name) const;
  Tensor buffer(const std::string& name) const;
  bool has_parameter(const std::string& name) const;
  // Replaces a registered buffer's value (e.g. BatchNorm running stats) or, inside a
  // functional_call, the call's copy of it.
  void set_buffer(const std::string& name, const Tensor& value);

  // ---- listing, in registration order ----
  // Own tensors first, then each child's listing (its override) under "<child name>."; a tensor
  // reachable under several names (shared parameters) is listed once, under the first.
  // Overrides may list tensors that are not registered (names may then contain '.'); functional_call
  // does not see those (it replaces registered tensors only).
  virtual NamedTensors named_parameters(bool recurse = true) const;
  virtual NamedTensors named_buffers(bool recurse = true) const;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_modules(const std::string& prefix = "") const;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_children() const { return children_; }
  std::vector<Tensor> parameters(bool recurse = true) const;
  int64_t parameter_count() const;

  // ---- state ----
  virtual void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }
  void zero_grad();
  // Moves (copies) every parameter and buffer to the device, keeping requires_grad: the own tensors,
  // then each child through its override. A tensor already on the device is kept as it is.
  virtual void to(Device device);
  StateDict state_dict() const;
  // Copies the state's tensors into the module's (in place, converted to their dtype and device). A shape
  // that differs is always an error; strict (default) also refuses missing and unexpected names. The
  // error lists every problem and nothing is changed. Non-strict returns the names it skipped.
  struct LoadResult {
    std::vector<std::string> missing;     // the module's names the state lacks
    std::vector<std::string> unexpected;  // the state's names the module lacks
  };
  LoadResult load_state_dict(const StateDict& state, bool strict = true);
  // Freezes (or unfreezes) every parameter (every tensor named_parameters lists).
  void requires_grad_(bool on);

  // ---- hooks for code above nn ----
  // Tensors besides parameters and buffers that define what this module (not its children) computes
  // and that every data-parallel replica must hold bit for bit, in named groups ("the mapper buffers
  // and scales of group 'fc'"). dist::DistributedDataParallel compares a hash of each group across the
  // ranks when it wraps a module (DdpOptions::check_buffers) and names the first group that differs.
  // Default: none (parameters and buffers are broadcast from rank 0 instead).
  virtual NamedTensorGroups replica_state() const { return {}; }
  // Words nn::module_guard (nn/compile.h) appends for this module besides its training flag and the
  // memory of its parameters and buffers: state its forward reads that is neither (use guard_memory
  // from nn/compile.h). Default: none.
  virtual void append_guard_words(std::vector<uint64_t>& key) const { (void)key; }

  // Direct storage access for the functional-call machinery.
  const NamedTensors& own_parameters() const { return params_; }
  const NamedTensors& own_buffers() const { return buffers_; }

 protected:
  void add_child(const std::string& name, std::shared_ptr<Module> module);

 private:
  static void check_name(const std::string& kind, const std::string& name);
  std::string type_name_;
  NamedTensors params_;
  NamedTensors buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  bool training_ = true;
};

using ModulePtr = std::shared_ptr<Module>;

}  // namespace mn::nn
