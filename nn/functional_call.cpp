#include "nn/functional_call.h"

#include <set>
#include <sstream>
#include <unordered_map>

namespace mn::nn {

namespace detail {

struct Override {
  Tensor value;
  bool read = false;  // a parameter looked up through Module::param() under this frame
  std::string blocked;  // FunctionalCallOptions::blocked_parameter_error: the dotted name (else empty)
};

struct Frame {
  std::function<std::string(const std::string&)> blocked_error;
  std::unordered_map<const Module*, std::unordered_map<std::string, Override>> table;
  std::vector<std::pair<std::string, std::pair<const Module*, std::string>>> buffer_names;  // for write-out
  std::vector<std::pair<std::string, std::pair<const Module*, std::string>>> parameter_names;  // for unread_parameters
};

}  // namespace detail

namespace {
using detail::Frame;
thread_local std::vector<Frame*> g_frames;
}  // namespace

namespace detail {
Tensor* find_override(const Module* module, const std::string& name, bool mark_read) {
  for (auto it = g_frames.rbegin(); it != g_frames.rend(); ++it) {
    auto m = (*it)->table.find(module);
    if (m == (*it)->table.end()) continue;
    auto t = m->second.find(name);
    if (t == m->second.end()) continue;
    if (!t->second.blocked.empty()) {
      if (mark_read) throw ValueError((*it)->blocked_error(t->second.blocked));
      continue;  // not a parameter read (Module::buffer): the entry does not answer it
    }
    if (mark_read) t->second.read = true;
    return &t->second.value;
  }
  return nullptr;
}
bool functional_call_active() { return !g_frames.empty(); }
}  // namespace detail

FunctionalCallGuard::FunctionalCallGuard(const Module& module, const std::map<std::string, Tensor>& tensors,
                                         const FunctionalCallOptions& options)
    : module_(module), options_(options) {
  auto frame = std::make_unique<Frame>();
  frame->blocked_error = options.blocked_parameter_error;
  std::vector<std::string> missing;
  std::set<std::string> used;
  for (const auto& [prefix, m] : module.named_modules()) {
    auto& entries = frame->table[m.get()];
    for (const auto& [name, value] : m->own_parameters()) {
      if (!value.defined()) continue;
      const std::string full = prefix.empty() ? name : prefix + "." + name;
      auto it = tensors.find(full);
      if (it == tensors.end()) {
        if (options.strict) missing.push_back(full);
        else if (options.blocked_parameter_error) entries[name].blocked = full;
        continue;
      }
      const Tensor& t = it->second;
      MN_CHECK(t.defined(), ValueError, "functional_call: tensor for '", full, "' is undefined");
      MN_CHECK(t.sizes() == value.sizes(), ValueError, "functional_call: expected shape ", value.sizes(), " for '",
               full, "', got ", t.sizes());
      MN_CHECK(t.dtype() == value.dtype(), TypeError, "functional_call: expected dtype ", value.dtype(), " for '",
               full, "', got ", t.dtype());
      entries[name].value = t;
      frame->parameter_names.push_back({full, {m.get(), name}});
      used.insert(full);
    }
    for (const auto& [name, value] : m->own_buffers()) {
      if (!value.defined()) continue;
      const std::string full = prefix.empty() ? name : prefix + "." + name;
      auto it = tensors.find(full);
      if (it != tensors.end()) {
        MN_CHECK(it->second.sizes() == value.sizes(), ValueError, "functional_call: expected shape ", value.sizes(),
                 " for buffer '", full, "', got ", it->second.sizes());
        entries[name].value = it->second;
        used.insert(full);
      } else if (options.clone_buffers) {
        entries[name].value = value.detach().clone();
      }
      frame->buffer_names.push_back({full, {m.get(), name}});
    }
  }
  std::vector<std::string> unexpected;
  for (const auto& [name, t] : tensors)
    if (!used.count(name)) unexpected.push_back(name);
  if (!missing.empty() || !unexpected.empty())
    throw KeyError(str("functional_call on ", module.type_name(), ": names do not match the module's parameters; missing=",
                       bracket_list(missing), ", unexpected=", bracket_list(unexpected)));
  frame_ = frame.get();
  g_frames.push_back(frame.release());
}

std::vector<std::string> FunctionalCallGuard::unread_parameters() const {
  std::vector<std::string> unread;
  for (const auto& [full, where] : frame_->parameter_names)
    if (!frame_->table.at(where.first).at(where.second).read) unread.push_back(full);
  return unread;
}

FunctionalCallGuard::~FunctionalCallGuard() {
  std::unique_ptr<Frame> frame(g_frames.back());
  g_frames.pop_back();
  if (options_.buffers_out)
    for (auto& [full, where] : frame->buffer_names) {
      auto m = frame->table.find(where.first);
      if (m == frame->table.end()) continue;
      auto t = m->second.find(where.second);
      if (t != m->second.end()) (*options_.buffers_out)[full] = t->second.value;
    }
}

Tensor functional_call(Module& module, const std::map<std::string, Tensor>& tensors, const Tensor& x,
                       const FunctionalCallOptions& options) {
  FunctionalCallGuard guard(module, tensors, options);
  return module.forward(x);
}

}  // namespace mn::nn
