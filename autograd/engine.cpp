#include "autograd/engine.h"

#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "autograd/autocast.h"
#include "autograd/function.h"
#include "autograd/ops.h"

namespace mn::autograd {

namespace {

thread_local std::vector<std::function<void()>>* g_callbacks = nullptr;

// The synthetic root: hands the seed gradients to the roots' edges.
class GraphRoot final : public Node {
 public:
  explicit GraphRoot(TensorList grads) : grads_(std::move(grads)) {}
  TensorList apply(TensorList&&) override { return grads_; }
  std::string name() const override { return "GraphRoot"; }

 private:
  TensorList grads_;
};

struct ByLaterSequence {
  bool operator()(const Node* a, const Node* b) const { return a->sequence_nr < b->sequence_nr; }
};

// Sums gradients arriving at the same input slot (differentiably under create_graph).
void accumulate_into(Tensor& slot, const Tensor& g) {
  if (!g.defined()) return;
  slot = slot.defined() ? add(slot, g) : g;
}

// A node's gradient for its input i must have that input's shape, dtype and device (recorded when the
// node was created): a wrong backward formula fails here, naming itself, instead of being broadcast
// into the gradients downstream. One difference is expected: an op that promoted a 16-bit input
// (bf16 + f32 -> f32) returns that input's gradient in the promoted dtype; it is converted to the
// input's dtype here, as PyTorch's engine does.
void conform_gradient(const Node& node, size_t i, Tensor& g) {
  if (i >= node.input_meta.size()) return;  // nodes built without attach() (GraphRoot) record none
  const InputMeta& want = node.input_meta[i];
  if (g.dtype() != want.dtype && is_floating_point(g.dtype()) && is_floating_point(want.dtype) &&
      g.sizes() == want.shape && g.device() == want.device)
    g = to_dtype(g, want.dtype);
  if (g.sizes() == want.shape && g.dtype() == want.dtype && g.device() == want.device) return;
  throw RuntimeError(str(node.name(), " returned a gradient of shape ", g.sizes(), " (", g.dtype(), " on ",
                         g.device(), ") for its input ", i, ", which has shape ", want.shape, " (", want.dtype, " on ",
                         want.device, "): the backward formula is wrong"));
}

struct RunOptions {
  bool retain_graph = false;
  bool create_graph = false;
  // grad() mode: capture instead of accumulating into leaves.
  std::unordered_map<const Node*, std::vector<std::pair<uint32_t, size_t>>>* captures = nullptr;
  std::vector<Tensor>* captured = nullptr;
};

void run(const std::vector<Edge>& roots, TensorList root_grads, const RunOptions& opt) {
  // Backward formulas compute in the dtypes the forward pass chose; an open autocast scope must not
  // recast them (autograd/autocast.h).
  amp::AutocastOff no_autocast;
  auto graph_root = std::make_shared<GraphRoot>(std::move(root_grads));
  graph_root->next_edges = roots;

  // Dependencies: number of incoming edges per node reachable from the root.
  std::unordered_map<Node*, int> deps;
  {
    std::vector<Node*> stack{graph_root.get()};
    std::unordered_set<Node*> seen{graph_root.get()};
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      for (const Edge& e : n->next_edges) {
        if (!e.valid()) continue;
        ++deps[e.node.get()];
        if (seen.insert(e.node.get()).second) stack.push_back(e.node.get());
      }
    }
  }

  // In grad() mode only nodes on a path to a captured input need to run.
  std::unordered_set<const Node*> needed;
  if (opt.captures) {
    // Post-order over the graph: a node is needed if it is captured or leads to a needed node.
    std::vector<std::pair<Node*, size_t>> stack{{graph_root.get(), 0}};
    std::unordered_set<Node*> done;
    while (!stack.empty()) {
      auto& [n, i] = stack.back();
      if (i < n->next_edges.size()) {
        Node* child = n->next_edges[i++].node.get();
        if (child && !done.count(child)) {
          done.insert(child);
          stack.push_back({child, 0});
        }
        continue;
      }
      bool need = opt.captures->count(n) > 0;
      for (const Edge& e : n->next_edges)
        if (e.valid() && needed.count(e.node.get())) need = true;
      if (need) needed.insert(n);
      stack.pop_back();
    }
  }

  std::unordered_map<Node*, TensorList> buffers;
  std::priority_queue<Node*, std::vector<Node*>, ByLaterSequence> ready;
  std::vector<std::shared_ptr<Node>> keep_alive;  // nodes stay alive while queued
  ready.push(graph_root.get());
  keep_alive.push_back(graph_root);

  GradModeGuard grad_mode(opt.create_graph);
  while (!ready.empty()) {
    Node* node = ready.top();
    ready.pop();
    TensorList grads;
    if (node != graph_root.get()) {
      auto it = buffers.find(node);
      if (it != buffers.end()) grads = std::move(it->second);
      buffers.erase(node);
      grads.resize(node->num_outputs);
    }
    for (auto& [slot, weak] : node->retained)
      if (auto impl = weak.lock(); impl && slot < grads.size() && grads[slot].defined())
        ensure_meta(Tensor(impl)).grad = opt.create_graph ? grads[slot] : grads[slot].detach();

    if (opt.captures) {
      if (auto c = opt.captures->find(node); c != opt.captures->end())
        for (auto [slot, index] : c->second)
          if (slot < grads.size() && grads[slot].defined()) {
            Tensor& dst = (*opt.captured)[index];
            dst = dst.defined() ? add(dst, grads[slot]) : grads[slot];
          }
      if (!needed.count(node) || dynamic_cast<AccumulateGrad*>(node) != nullptr) {
        // Not on a path to an input (or a leaf sink in grad() mode): release dependents' counts.
        for (const Edge& e : node->next_edges)
          if (e.valid() && --deps[e.node.get()] == 0) {
            ready.push(e.node.get());
            keep_alive.push_back(e.node);
          }
        continue;
      }
    }

    TensorList outs = node->apply(std::move(grads));
    if (!opt.retain_graph && node != graph_root.get()) node->release_saved();
    MN_CHECK(outs.size() <= node->next_edges.size() || node->next_edges.empty(), RuntimeError, node->name(),
             " returned ", outs.size(), " gradients for ", node->next_edges.size(), " inputs");
    for (size_t i = 0; i < node->next_edges.size(); ++i) {
      const Edge& e = node->next_edges[i];
      if (!e.valid()) continue;
      TensorList& buf = buffers[e.node.get()];
      if (buf.size() < e.node->num_outputs) buf.resize(e.node->num_outputs);
      if (i < outs.size() && outs[i].defined()) {
        conform_gradient(*node, i, outs[i]);
        accumulate_into(buf[e.input_nr], outs[i]);
      }
      if (--deps[e.node.get()] == 0) {
        ready.push(e.node.get());
        keep_alive.push_back(e.node);
      }
    }
  }
}

std::vector<Edge> root_edges(const std::vector<Tensor>& roots) {
  std::vector<Edge> edges;
  for (size_t i = 0; i < roots.size(); ++i) {
    MN_CHECK(roots[i].defined(), ValueError, "backward: output ", i, " is undefined");
    Edge e = gradient_edge(roots[i]);
    MN_CHECK(e.valid(), RuntimeError, "element ", i,
             " of the outputs does not require grad and has no grad_fn (was it computed under NoGradGuard, "
             "or from tensors that do not require grad?)");
    edges.push_back(e);
  }
  return edges;
}

TensorList root_gradients(const std::vector<Tensor>& roots, const std::vector<Tensor>& grad_roots) {
  MN_CHECK(grad_roots.empty() || grad_roots.size() == roots.size(), ValueError, "backward: got ", grad_roots.size(),
           " gradients for ", roots.size(), " outputs");
  TensorList grads;
  for (size_t i = 0; i < roots.size(); ++i) {
    if (!grad_roots.empty() && grad_roots[i].defined()) {
      MN_CHECK(grad_roots[i].sizes() == roots[i].sizes(), ValueError, "backward: gradient ", i, " has shape ",
               grad_roots[i].sizes(), " but the output has shape ", roots[i].sizes());
      MN_CHECK(grad_roots[i].dtype() == roots[i].dtype() && grad_roots[i].device() == roots[i].device(), ValueError,
               "backward: gradient ", i, " is ", grad_roots[i].dtype(), " on ", grad_roots[i].device(),
               " but the output is ", roots[i].dtype(), " on ", roots[i].device());
      grads.push_back(grad_roots[i]);
    } else {
      MN_CHECK(roots[i].numel() == 1, RuntimeError, "grad can be implicitly created only for outputs with one element; output ",
               i, " has shape ", roots[i].sizes(), " (pass its gradient explicitly)");
      grads.push_back(ones_like(roots[i]));
    }
  }
  return grads;
}

class CallbackScope {
 public:
  CallbackScope() : prev_(g_callbacks) { g_callbacks = &callbacks_; }
  ~CallbackScope() { g_callbacks = prev_; }
  void run_all() {
    // Callbacks may queue further callbacks; run until none remain.
    for (size_t i = 0; i < callbacks_.size(); ++i) {
      auto cb = std::move(callbacks_[i]);
      cb();
    }
    callbacks_.clear();
  }

 private:
  std::vector<std::function<void()>> callbacks_;
  std::vector<std::function<void()>>* prev_;
};

}  // namespace

void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grad_roots, bool retain_graph,
              bool create_graph) {
  std::vector<Edge> edges = root_edges(roots);
  TensorList grads = root_gradients(roots, grad_roots);
  CallbackScope scope;
  run(edges, std::move(grads), RunOptions{retain_graph || create_graph, create_graph, nullptr, nullptr});
  scope.run_all();
}

std::vector<Tensor> grad(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& grad_outputs, bool retain_graph, bool create_graph,
                         bool allow_unused) {
  std::vector<Edge> edges = root_edges(outputs);
  TensorList grads = root_gradients(outputs, grad_outputs);
  std::unordered_map<const Node*, std::vector<std::pair<uint32_t, size_t>>> captures;
  std::vector<std::shared_ptr<Node>> input_nodes;
  for (size_t i = 0; i < inputs.size(); ++i) {
    MN_CHECK(inputs[i].defined() && inputs[i].requires_grad(), ValueError, "grad: input ", i,
             " does not require grad");
    Edge e = gradient_edge(inputs[i]);
    input_nodes.push_back(e.node);
    captures[e.node.get()].push_back({e.input_nr, i});
  }
  std::vector<Tensor> captured(inputs.size());
  CallbackScope scope;
  run(edges, std::move(grads), RunOptions{retain_graph || create_graph, create_graph, &captures, &captured});
  scope.run_all();
  for (size_t i = 0; i < captured.size(); ++i) {
    MN_CHECK(captured[i].defined() || allow_unused, RuntimeError, "grad: input ", i,
             " is not reachable from the outputs (pass allow_unused=true if that is intended)");
    if (captured[i].defined() && !create_graph) captured[i] = captured[i].detach();
  }
  return captured;
}

void queue_callback(std::function<void()> callback) {
  MN_CHECK(g_callbacks != nullptr, RuntimeError, "queue_callback can only be called during a backward pass");
  g_callbacks->push_back(std::move(callback));
}

bool backward_in_progress() { return g_callbacks != nullptr; }

}  // namespace mn::autograd
