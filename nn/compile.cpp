#include "nn/compile.h"

#include <algorithm>
#include <sstream>
#include <unordered_set>

#include "autograd/engine.h"
#include "autograd/function.h"
#include "autograd/node.h"
#include "core/caching_allocator.h"
#include "core/capture.h"
#include "kernels/kernels.h"
#include "nn/module.h"

namespace mn {

// The backward half of a signature whose outputs require grad (AOTAutograd's counterpart): the
// forward graph's outputs with their autograd history (kept, so the activations they saved stay
// where the forward replays write them), and a second graph recorded from autograd::grad over that
// history, which reads the gradients of the outputs from `grad_buffers` and writes the gradients of
// `leaves` (the parameters the outputs depend on) into `results`. The graph touches no .grad: the
// node attached to each call's outputs hands `results` to the engine, whose AccumulateGrad (and its
// hooks: DDP's) does the rest, as for any op.
struct CompiledBackward {
  std::unique_ptr<capture::Graph> graph;
  std::vector<Tensor> outputs;       // the forward graph's differentiable outputs, history included
  std::vector<size_t> output_index;  // their positions among the function's outputs
  std::vector<Tensor> grad_buffers;  // one per differentiable output: copied into before a replay
  std::vector<Tensor> leaves;        // what the gradients are for
  std::vector<Tensor> results;       // the graph's gradients of the leaves (undefined: not reached)
  uint64_t generation = 0;           // forward runs of this signature so far
};

struct CompiledFunction::Entry {
  std::vector<uint64_t> key;
  std::string signature;                  // the inputs, for explain()
  std::unique_ptr<capture::Graph> graph;  // null: this signature runs eagerly
  std::string reason;                     // why it runs eagerly
  std::vector<Tensor> inputs;             // the graph's input tensors (copied into at every replay)
  std::vector<Tensor> outputs;            // the graph's output tensors (cloned out at every replay)
  std::shared_ptr<CompiledBackward> backward;  // set when outputs require grad
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

// The leaves a graph reaches (their AccumulateGrad sinks), in a fixed order: depth first from the
// roots, each leaf once.
std::vector<Tensor> leaves_of(const std::vector<Tensor>& roots) {
  std::vector<Tensor> leaves;
  std::unordered_set<const autograd::Node*> seen_nodes;
  std::unordered_set<const TensorImpl*> seen_leaves;
  std::vector<autograd::Node*> stack;
  for (auto it = roots.rbegin(); it != roots.rend(); ++it)
    if (it->grad_fn()) stack.push_back(it->grad_fn().get());
  while (!stack.empty()) {
    autograd::Node* node = stack.back();
    stack.pop_back();
    if (!seen_nodes.insert(node).second) continue;
    if (auto* sink = dynamic_cast<autograd::AccumulateGrad*>(node)) {
      Tensor leaf = sink->leaf();
      if (seen_leaves.insert(leaf.impl()).second) leaves.push_back(leaf);
      continue;
    }
    for (auto it = node->next_edges.rbegin(); it != node->next_edges.rend(); ++it)
      if (it->valid()) stack.push_back(it->node.get());
  }
  return leaves;
}

// The node each call's outputs get: replays the backward graph for the gradients of its own forward.
class CompiledBackwardNode final : public autograd::Node {
 public:
  CompiledBackwardNode(std::shared_ptr<CompiledBackward> state, std::vector<uint32_t> versions)
      : state_(std::move(state)), generation_(state_->generation), versions_(std::move(versions)) {}

  autograd::TensorList apply(autograd::TensorList&& grads) override {
    CompiledBackward& b = *state_;
    MN_CHECK(!autograd::grad_mode_enabled(), RuntimeError,
             "compile: backward with create_graph (double backward) through a compiled function is not "
             "supported; call the function eagerly for higher-order gradients");
    MN_CHECK(generation_ == b.generation, RuntimeError,
             "compile: this output's backward needs the activations of its forward call, which a later call of "
             "the compiled function (same signature) has overwritten; run backward before the next call");
    for (size_t j = 0; j < b.leaves.size(); ++j)
      MN_CHECK(b.leaves[j].version() == versions_[j], RuntimeError,
               "compile: a tensor the gradient computation needs (leaf ", j, " of shape ", b.leaves[j].sizes(),
               ") was modified by an in-place operation after the forward call (an optimizer step between "
               "forward and backward?)");
    for (size_t k = 0; k < b.grad_buffers.size(); ++k) {
      Tensor& buffer = b.grad_buffers[k];
      if (grads[k].defined())
        kernels::copy(buffer.device(), grads[k], buffer);
      else
        buffer.fill_(0.0);  // that output did not reach the loss
    }
    b.graph->replay();
    autograd::TensorList out(b.leaves.size());
    for (size_t j = 0; j < b.leaves.size(); ++j)
      if (b.results[j].defined()) out[j] = b.results[j].clone();  // the engine may keep what it is given
    return out;
  }
  std::string name() const override { return "CompiledFunctionBackward"; }

 private:
  std::shared_ptr<CompiledBackward> state_;
  uint64_t generation_;
  std::vector<uint32_t> versions_;  // the leaves' versions at the forward call
};

// Records the backward graph of a captured forward whose outputs require grad. Returns what broke
// the recording (empty on success); under fullgraph that throws instead.
std::string record_backward(CompiledBackward& b, const std::vector<Tensor>& outputs, bool fullgraph) {
  for (size_t i = 0; i < outputs.size(); ++i)
    if (outputs[i].defined() && outputs[i].requires_grad()) {
      b.outputs.push_back(outputs[i]);
      b.output_index.push_back(i);
    }
  b.leaves = leaves_of(b.outputs);
  b.graph = std::make_unique<capture::Graph>();
  capture::Recording recording(*b.graph);
  recording.set_throw_on_break(fullgraph);
  for (const Tensor& out : b.outputs) {
    Tensor buffer = empty(out.sizes(), out.options());
    {
      capture::Pause pause;  // not a step: each replay copies its gradients in first
      buffer.fill_(0.0);
    }
    b.grad_buffers.push_back(buffer);
  }
  // retain_graph: the forward graph's saved tensors stay alive, so their memory belongs to the
  // forward replays and this graph alone.
  b.results = autograd::grad(b.outputs, b.leaves, b.grad_buffers, /*retain_graph=*/true, /*create_graph=*/false,
                             /*allow_unused=*/true);
  return recording.break_reason();
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
    return outputs_of(*e);
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
      Tensor t = empty(in.sizes(), in.options());
      {
        capture::Pause pause;
        kernels::copy(t.device(), in, t);
      }
      entry.inputs.push_back(t);
    }
    outputs = fn_(entry.inputs);
    entry.reason = recording.break_reason();
    MN_CHECK(entry.reason.empty() || !options_.fullgraph, RuntimeError, "compile(fullgraph): cannot capture: ",
             entry.reason);
  }
  const bool differentiable =
      std::any_of(outputs.begin(), outputs.end(), [](const Tensor& t) { return t.defined() && t.requires_grad(); });
  if (entry.reason.empty() && differentiable) {
    auto backward = std::make_shared<CompiledBackward>();
    const std::string why = record_backward(*backward, outputs, options_.fullgraph);
    if (why.empty())
      entry.backward = std::move(backward);
    else
      entry.reason = str("its backward cannot be captured: ", why);
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
  return outputs_of(entry);
}

std::vector<Tensor> CompiledFunction::outputs_of(Entry& entry) {
  std::vector<Tensor> out = fresh_copies(entry.outputs);
  if (!entry.backward) return out;
  // A new forward of this signature: earlier outputs' backward can no longer run (their activations
  // are overwritten); this call's outputs get a node of their own.
  CompiledBackward& b = *entry.backward;
  ++b.generation;
  std::vector<uint32_t> versions;
  versions.reserve(b.leaves.size());
  for (const Tensor& leaf : b.leaves) versions.push_back(leaf.version());
  auto node = std::make_shared<CompiledBackwardNode>(entry.backward, std::move(versions));
  std::vector<Tensor*> differentiable;
  for (size_t i : b.output_index) differentiable.push_back(&out[i]);
  autograd::attach(node, b.leaves, differentiable);
  return out;
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
