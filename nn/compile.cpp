#include "nn/compile.h"

#include <sstream>

#include "autograd/node.h"
#include "core/caching_allocator.h"
#include "core/capture.h"
#include "kernels/kernels.h"
#include "nn/module.h"

namespace mn {

struct CompiledFunction::Entry {
  std::vector<uint64_t> key;
  std::string signature;                  // the inputs, for explain()
  std::unique_ptr<capture::Graph> graph;  // null: this signature runs eagerly
  std::string reason;                     // why it runs eagerly
  std::vector<Tensor> inputs;             // the graph's input tensors (copied into at every replay)
  std::vector<Tensor> outputs;            // the graph's output tensors (cloned out at every replay)
};

namespace {

std::string describe(const std::vector<Tensor>& inputs) {
  std::ostringstream os;
  os << '(';
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (i) os << ", ";
    const Tensor& t = inputs[i];
    if (!t.defined()) {
      os << "undefined";
      continue;
    }
    os << dtype_name(t.dtype()) << t.sizes() << (t.device().is_cpu() ? "" : " " + t.device().str());
  }
  os << ')';
  return os.str();
}

std::vector<Tensor> fresh_copies(const std::vector<Tensor>& outputs) {
  autograd::NoGradGuard no_grad;
  std::vector<Tensor> out;
  out.reserve(outputs.size());
  for (const Tensor& t : outputs) out.push_back(t.defined() ? t.clone() : t);
  return out;
}

}  // namespace

void guard_memory(std::vector<uint64_t>& key, const Tensor& t) {
  key.push_back(t.defined() ? reinterpret_cast<uint64_t>(t.storage()->data()) + static_cast<uint64_t>(t.storage_offset())
                            : 0);
}

CompiledFunction::CompiledFunction(Function fn, Guard guard, CompileOptions options)
    : fn_(std::move(fn)), guard_(std::move(guard)), options_(options) {
  MN_CHECK(fn_ != nullptr, ValueError, "compile: expected a function, got an empty one");
  MN_CHECK(options_.max_graphs >= 1, ValueError, "compile: max_graphs must be at least 1, got ", options_.max_graphs);
}

CompiledFunction::~CompiledFunction() = default;
CompiledFunction::CompiledFunction(CompiledFunction&&) noexcept = default;
CompiledFunction& CompiledFunction::operator=(CompiledFunction&&) noexcept = default;

std::vector<uint64_t> CompiledFunction::key_of(const std::vector<Tensor>& inputs) const {
  std::vector<uint64_t> key;
  key.reserve(8 + 8 * inputs.size());
  key.push_back(inputs.size());
  for (const Tensor& t : inputs) {
    if (!t.defined()) {
      key.push_back(~uint64_t{0});
      continue;
    }
    key.push_back(static_cast<uint64_t>(t.dim()));
    for (int64_t s : t.sizes()) key.push_back(static_cast<uint64_t>(s));
    key.push_back(static_cast<uint64_t>(t.dtype()) | static_cast<uint64_t>(t.device().type) << 8 |
                  static_cast<uint64_t>(t.device().index) << 16 | static_cast<uint64_t>(t.requires_grad()) << 32);
  }
  key.push_back(autograd::grad_mode_enabled());
  if (guard_) guard_(key);
  return key;
}

std::vector<Tensor> CompiledFunction::operator()(const std::vector<Tensor>& inputs) {
  ++stats_.calls;
  if (capture::recording()) {  // inside another compiled function's capture: its graph records ours
    ++stats_.eager;
    return fn_(inputs);
  }
  const std::vector<uint64_t> key = key_of(inputs);
  for (const auto& e : entries_) {
    if (e->key != key) continue;
    if (!e->graph) {
      ++stats_.eager;
      return fn_(inputs);
    }
    if (!e->graph->grads_match()) continue;  // gradients moved (e.g. accumulation): another graph
    for (size_t i = 0; i < inputs.size(); ++i) {
      Tensor& dst = e->inputs[i];
      if (dst.defined()) kernels::copy(dst.device(), inputs[i], dst);
    }
    e->graph->replay();
    e->graph->attach_grads();
    ++stats_.replays;
    return fresh_copies(e->outputs);
  }
  if (static_cast<int64_t>(entries_.size()) >= options_.max_graphs) {
    overflow_noted_ = true;
    ++stats_.eager;
    return fn_(inputs);
  }
  auto entry = std::make_unique<Entry>();
  entry->key = key;
  entry->signature = describe(inputs);
  std::vector<Tensor> result = capture(*entry, inputs);
  entries_.push_back(std::move(entry));
  return result;
}

std::vector<Tensor> CompiledFunction::capture(Entry& entry, const std::vector<Tensor>& inputs) {
  for (size_t i = 0; i < inputs.size(); ++i)
    if (inputs[i].defined() && inputs[i].requires_grad()) {
      entry.reason = str("input ", i, " requires grad (a replay cannot give gradients to tensors outside the graph)");
      MN_CHECK(!options_.fullgraph, RuntimeError, "compile(fullgraph): cannot capture: ", entry.reason);
      ++stats_.eager;
      return fn_(inputs);
    }

  auto graph = std::make_unique<capture::Graph>();
  std::vector<Tensor> outputs;
  {
    capture::Recording recording(*graph);
    recording.set_throw_on_break(options_.fullgraph);
    // The graph's own input tensors come from its pool; filling them is not a step (each replay
    // copies its new inputs in itself).
    for (const Tensor& in : inputs) {
      if (!in.defined()) {
        entry.inputs.push_back(in);
        continue;
      }
      Tensor t = empty(in.sizes(), TensorOptions(in.dtype()).with_device(in.device()));
      {
        capture::Pause pause;
        kernels::copy(t.device(), in, t);
      }
      entry.inputs.push_back(t);
    }
    outputs = fn_(entry.inputs);
    entry.reason = recording.break_reason();
    for (size_t i = 0; entry.reason.empty() && i < outputs.size(); ++i)
      if (outputs[i].defined() && outputs[i].requires_grad())
        entry.reason = str("output ", i,
                           " requires grad (a replay has no autograd history: call backward() inside the "
                           "function and return detached tensors, or compile under NoGradGuard)");
    MN_CHECK(entry.reason.empty() || !options_.fullgraph, RuntimeError, "compile(fullgraph): cannot capture: ",
             entry.reason);
  }
  if (!entry.reason.empty()) {
    // The call ran eagerly to its end: its outputs are the answer, history included.
    entry.inputs.clear();
    ++stats_.eager;
    return outputs;
  }
  ++stats_.captures;
  entry.graph = std::move(graph);
  entry.outputs = outputs;
  return fresh_copies(outputs);
}

std::string CompiledFunction::explain() const {
  std::ostringstream os;
  os << "compiled function: " << stats_.calls << " calls, " << stats_.captures << " captures, " << stats_.replays
     << " replays, " << stats_.eager << " eager\n";
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = *entries_[i];
    os << "  signature " << i << ' ' << e.signature << ": ";
    if (e.graph)
      os << "captured, " << e.graph->num_steps() << " kernels, pool " << describe_bytes(e.graph->reserved_bytes())
         << '\n';
    else
      os << "eager: " << e.reason << '\n';
  }
  if (overflow_noted_)
    os << "  further signatures ran eagerly: max_graphs (" << options_.max_graphs << ") reached\n";
  return os.str();
}

namespace {
// Sum of per_graph(graph) over the signatures that hold a graph.
template <class Entries, class PerGraph>
int64_t over_graphs(const Entries& entries, PerGraph per_graph) {
  int64_t n = 0;
  for (const auto& e : entries)
    if (e->graph) n += static_cast<int64_t>(per_graph(*e->graph));
  return n;
}
}  // namespace

int64_t CompiledFunction::reserved_bytes() const {
  return over_graphs(entries_, [](const capture::Graph& g) { return g.reserved_bytes(); });
}
int64_t CompiledFunction::peak_allocated_bytes() const {
  return over_graphs(entries_, [](const capture::Graph& g) { return g.peak_allocated_bytes(); });
}
int64_t CompiledFunction::num_graphs() const {
  return over_graphs(entries_, [](const capture::Graph&) { return 1; });
}
int64_t CompiledFunction::num_kernels() const {
  return over_graphs(entries_, [](const capture::Graph& g) { return g.num_steps(); });
}

void CompiledFunction::reset() {
  entries_.clear();
  overflow_noted_ = false;
}

CompiledFunction compile(CompiledFunction::Function fn, Guard guard, CompileOptions options) {
  return CompiledFunction(std::move(fn), std::move(guard), options);
}

namespace nn {

Guard module_guard(const Module& module) {
  const Module* m = &module;
  return [m](std::vector<uint64_t>& key) {
    for (const auto& [name, sub] : m->named_modules()) key.push_back(sub->is_training());
    for (const auto& [name, t] : m->named_parameters()) {
      guard_memory(key, t);
      key.push_back(t.defined() && t.requires_grad());
    }
    for (const auto& [name, t] : m->named_buffers()) guard_memory(key, t);
    for (const auto& [name, sub] : m->named_modules()) sub->append_guard_words(key);
  };
}

CompiledModule::CompiledModule(Module& module, CompileOptions options)
    : fn_([&module](const std::vector<Tensor>& in) { return std::vector<Tensor>{module.forward(in.front())}; },
          module_guard(module), options) {}

CompiledModule compile(Module& module, CompileOptions options) { return CompiledModule(module, options); }

}  // namespace nn

}  // namespace mn
