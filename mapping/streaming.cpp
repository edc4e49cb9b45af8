// MappingOptions::stream_layers: generating a target's parameters module by module.
//
// plan_streaming finds, per generator group, the module that owns it: the deepest module whose
// parameters (its own and its descendants') include every parameter of the group. run_streamed runs
// the target under a functional call that carries the buffers and blocks every parameter, with a
// StreamCall installed as the thread's nn::CallInterceptor. When an owner is called (Module::operator()
// or Module::call), StreamCall runs that call inside autograd::checkpoint: generate the owner's groups
// from their latents, run the module under a functional call that supplies them (and a copy of the
// buffers of its subtree as they were when the call began), drop them. Backward runs the same again,
// with the interceptor and the buffers as they were, so nested owners stream the same way in the
// recomputation. Buffer updates of the first run go back to the enclosing call's copies (the model's
// with write_back_buffers); a recomputation's are discarded.
#include <memory>
#include <set>

#include "autograd/checkpoint.h"
#include "mapping/mapping_model.h"

namespace mn::mapping {

namespace {
std::string module_path(const std::string& parameter) {
  const auto dot = parameter.rfind('.');
  return dot == std::string::npos ? std::string() : parameter.substr(0, dot);
}
// The longest dotted prefix (whole components) that both paths start with.
std::string common_path(const std::string& a, const std::string& b) {
  size_t end = 0;
  for (size_t i = 0;; ++i) {
    const bool a_ends = i == a.size() || a[i] == '.', b_ends = i == b.size() || b[i] == '.';
    if (a_ends && b_ends) end = i;
    if (i == a.size() || i == b.size() || a[i] != b[i]) break;
  }
  return a.substr(0, end);
}
std::function<std::string(const std::string&)> blocked_message(const std::string& prefix) {
  return [prefix](const std::string& name) {
    return str("MappingModel (stream_layers): the target read parameter '", prefix, name,
               "' while the module that owns its generator group was not being called, so it has not been generated. "
               "Streaming generates a module's parameters only during its call through operator() (child(x)) or "
               "Module::call: a parent that runs child.forward(x) directly, or reads a child's parameter from outside "
               "the child's call, bypasses that. Call children through operator()");
  };
}
}  // namespace

class MappingModel::StreamCall : public nn::CallInterceptor, public std::enable_shared_from_this<StreamCall> {
 public:
  StreamCall(MappingModel& model, LatentOverrides latents, bool check_reads)
      : model_(model), latents_(std::move(latents)), check_reads_(check_reads) {}

  std::vector<Tensor> intercept(nn::Module& module, const std::vector<Tensor>& inputs,
                                const nn::ModuleBody& body) override {
    const auto it = model_.stream_owners_.find(&module);
    if (it == model_.stream_owners_.end()) return body(inputs);
    const StreamOwner* owner = &it->second;
    called_.insert(owner);
    // The subtree's buffers as this call finds them (the enclosing call's copies): both runs start here.
    auto buffers = std::make_shared<std::vector<Tensor>>();
    for (const StreamBuffer& b : owner->buffers) buffers->push_back(b.module->buffer(b.local).detach().clone());
    autograd::TensorList in = inputs;
    const size_t n_args = inputs.size();
    for (size_t gi : owner->groups) {
      const std::string& name = model_.generator_->groups()[gi].name;
      const auto o = latents_.find(name);
      in.push_back(o != latents_.end() ? o->second : model_.generator_->groups()[gi].latent);
    }
    auto first = std::make_shared<bool>(true);
    auto fn = [self = shared_from_this(), owner, &module, body, buffers, first,
               n_args](const autograd::TensorList& in) -> autograd::TensorList {
      return self->run_owner(*owner, module, body, *buffers, *first, in, n_args);
    };
    return autograd::checkpoint(fn, in);
  }

  // One run of an owner's call: in = {the call's arguments, the latents of the owner's groups}.
  autograd::TensorList run_owner(const StreamOwner& owner, nn::Module& module, const nn::ModuleBody& body,
                                 const std::vector<Tensor>& buffers, bool& first, const autograd::TensorList& in,
                                 size_t n_args) {
    nn::CallInterceptorGuard interceptor(this);  // also in the recomputation, long after run_streamed
    const auto& groups = model_.generator_->groups();
    LatentOverrides own;
    for (size_t k = 0; k < owner.groups.size(); ++k) own[groups[owner.groups[k]].name] = in[n_args + k];
    std::map<std::string, Tensor> tensors;
    for (size_t gi : owner.groups) {
      const ParameterTree part = model_.apply_prune_masks(model_.generator_->generate_group_parameters(gi, own));
      for (const auto& [name, t] : part.items()) tensors[name.substr(owner.prefix.size())] = t;
    }
    for (size_t b = 0; b < buffers.size(); ++b) tensors[owner.buffers[b].name] = buffers[b].clone();
    const bool is_first = first;
    first = false;
    nn::StateDict updated;
    nn::FunctionalCallOptions call;
    call.strict = false;  // descendants that own groups of their own are generated in their calls
    call.buffers_out = is_first ? &updated : nullptr;
    call.blocked_parameter_error = blocked_message(owner.prefix);
    autograd::TensorList out;
    {
      nn::FunctionalCallGuard guard(module, tensors, call);
      out = body(autograd::TensorList(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(n_args)));
      if (is_first && check_reads_)
        for (const std::string& name : guard.unread_parameters()) unread_.push_back(owner.prefix + name);
    }
    if (is_first) {
      // Into the enclosing call's copies, where the rest of this forward reads them.
      autograd::NoGradGuard no_grad;
      for (const StreamBuffer& b : owner.buffers) b.module->set_buffer(b.local, updated.at(b.name));
    }
    return out;
  }

  // The first forward's unread parameters: those its owners' calls did not read, and every parameter
  // of an owner that was never called.
  std::vector<std::string> unread() const {
    std::vector<std::string> out = unread_;
    const auto& groups = model_.generator_->groups();
    const auto& entries = model_.generator_->parameter_spec().entries();
    for (const auto& [m, owner] : model_.stream_owners_)
      if (!called_.count(&owner))
        for (size_t gi : owner.groups)
          for (size_t e : groups[gi].entries) out.push_back(entries[e].name);
    return out;
  }

 private:
  MappingModel& model_;
  LatentOverrides latents_;
  bool check_reads_;
  std::vector<std::string> unread_;
  std::set<const StreamOwner*> called_;
};

void MappingModel::plan_streaming() {
  const auto& groups = generator_->groups();
  const auto& entries = generator_->parameter_spec().entries();
  std::map<std::string, nn::Module*> module_at;
  for (const auto& [path, m] : target_->named_modules()) module_at.emplace(path, m.get());
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    if (groups[gi].entries.empty()) continue;
    std::string path = module_path(entries[groups[gi].entries.front()].name);
    bool root_own = path.empty();
    for (size_t e : groups[gi].entries) {
      path = common_path(path, module_path(entries[e].name));
      root_own = root_own && module_path(entries[e].name).empty();
    }
    if (path.empty()) {
      MN_CHECK(root_own, ValueError, "stream_layers: group '", groups[gi].name, "' of strategy ",
               generator_->strategy(), " generates parameters of several modules that only the target's root "
               "holds together ('", entries[groups[gi].entries.front()].name, "' ... '",
               entries[groups[gi].entries.back()].name, "'); streaming needs each group inside one module: use "
               "layerwise, lazy_layerwise or groups by module, not slvt");
      resident_groups_.push_back(gi);
      continue;
    }
    nn::Module* module = module_at.at(path);
    StreamOwner& owner = stream_owners_[module];
    if (owner.prefix.empty()) {
      owner.prefix = path + ".";
      for (const auto& [sub, m] : module->named_modules())
        for (const auto& [name, b] : m->own_buffers())
          if (b.defined()) owner.buffers.push_back({sub.empty() ? name : sub + "." + name, m.get(), name});
    }
    owner.groups.push_back(gi);
  }
  MN_CHECK(!stream_owners_.empty(), ValueError, "stream_layers: nothing to stream in this ", target_->type_name(),
           ": every generator group is the root module's own parameters (streaming generates the groups of its "
           "submodules during their calls)");
}

ForwardResult MappingModel::run_streamed(const Tensor& input, const LatentOverrides& latents) {
  generator_->check_overrides(latents);
  ForwardResult result;
  // The call's buffers (copies, as in run_with) and the resident groups; every other parameter blocked.
  std::map<std::string, Tensor> tensors;
  for (auto& [n, t] : buffers_) tensors[n] = t.clone();
  for (size_t gi : resident_groups_) {
    const ParameterTree part = apply_prune_masks(generator_->generate_group_parameters(gi, latents));
    for (const auto& [name, t] : part.items()) tensors[name] = t;
  }
  nn::StateDict updated;
  nn::FunctionalCallOptions options;
  options.strict = false;
  options.buffers_out = options_.write_back_buffers ? &updated : nullptr;
  options.blocked_parameter_error = blocked_message("");
  auto call = std::make_shared<StreamCall>(*this, latents, !parameters_read_checked_);
  {
    nn::FunctionalCallGuard guard(*target_, tensors, options);
    nn::CallInterceptorGuard interceptor(call.get());
    result.predictions = (*target_)(input);
    if (!parameters_read_checked_) {
      std::vector<std::string> unread = guard.unread_parameters();
      for (std::string& name : call->unread()) unread.push_back(std::move(name));
      check_parameters_read(unread);
    }
  }
  if (options_.write_back_buffers) keep_buffers("", updated);
  result.streamed = true;
  result.latent_vectors = generator_->named_latents();
  return result;
}

}  // namespace mn::mapping
