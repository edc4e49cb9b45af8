#pragma once
// The autograd graph: a Node is the backward of one forward operation; its next_edges point at the
// nodes that produced its inputs (Edge{node, input_nr}). Leaves end in an AccumulateGrad sink.
// Backward formulas are small lambdas (see record() in autograd/function.h).
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mn::autograd {

class Node;

struct Edge {
  std::shared_ptr<Node> node;
  uint32_t input_nr = 0;  // which output of the forward op (input slot of node's backward)
  bool valid() const { return node != nullptr; }
};

using TensorList = std::vector<Tensor>;

// What the gradient flowing along one next edge must be: the forward input's shape, dtype and device
// (the engine checks every gradient a node returns against it, so a wrong backward formula fails at
// the node that produced it instead of being broadcast on).
struct InputMeta {
  Shape shape;
  DType dtype = DType::f32;
  Device device = kCPU;
};

// What a backward lambda sees: the gradients of the forward outputs (undefined = zero) and which
// forward inputs need a gradient.
struct GradContext {
  const TensorList& grads;
  const std::vector<Edge>& edges;
  const Tensor& grad(size_t output = 0) const { return grads[output]; }
  bool needs(size_t input) const { return input < edges.size() && edges[input].valid(); }
};

class Node : public std::enable_shared_from_this<Node> {
 public:
  Node();
  virtual ~Node() = default;
  // Gradients w.r.t. the forward inputs, one per next edge (undefined where not needed).
  virtual TensorList apply(TensorList&& grads) = 0;
  virtual std::string name() const = 0;
  // Frees saved tensors after backward (unless retain_graph).
  virtual void release_saved() {}

  std::vector<Edge> next_edges;
  std::vector<InputMeta> input_meta;  // parallel to next_edges when filled (attach does); unchecked if empty
  uint32_t num_outputs = 1;  // number of forward outputs = number of incoming gradient slots
  uint64_t sequence_nr;      // creation order; later nodes run first
  // Non-leaf tensors that asked retain_grad(): output slot -> tensor.
  std::vector<std::pair<uint32_t, std::weak_ptr<TensorImpl>>> retained;
};

// Sink for a leaf: adds incoming gradients into leaf.grad, then runs the leaf's post-accumulate hooks.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(std::shared_ptr<TensorImpl> leaf) : leaf_(std::move(leaf)) {}
  TensorList apply(TensorList&& grads) override;
  std::string name() const override { return "AccumulateGrad"; }
  Tensor leaf() const { return Tensor(leaf_); }

 private:
  std::shared_ptr<TensorImpl> leaf_;
};

// A tensor's autograd state. requires_grad, grad and grad_fn are in the base (core/tensor.h), which
// core reads for the Tensor accessors.
struct AutogradMeta final : AutogradMetaBase {
  // Guards grad_accumulator's creation and the accumulation into grad, which threads running
  // forward/backward over a shared leaf may reach at the same time. The other fields change only
  // through calls that mutate the tensor (requires_grad_, set_grad, an op's output), which the
  // thread contract (README, "Threads") gives to one thread at a time.
  std::mutex mutex;
  bool retains_grad = false;
  uint32_t output_nr = 0;
  std::weak_ptr<Node> grad_accumulator;
  std::vector<std::function<void(const Tensor&)>> post_accumulate_hooks;
};

// ---- grad mode (thread-local) ----
bool grad_mode_enabled();
void set_grad_mode(bool enabled);

class NoGradGuard {
 public:
  NoGradGuard() : prev_(grad_mode_enabled()) { set_grad_mode(false); }
  ~NoGradGuard() { set_grad_mode(prev_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

class GradModeGuard {
 public:
  explicit GradModeGuard(bool enabled) : prev_(grad_mode_enabled()) { set_grad_mode(enabled); }
  ~GradModeGuard() { set_grad_mode(prev_); }
  GradModeGuard(const GradModeGuard&) = delete;
  GradModeGuard& operator=(const GradModeGuard&) = delete;

 private:
  bool prev_;
};

// ---- helpers used by ops and the engine ----
AutogradMeta* meta(const Tensor& t);            // null if none
AutogradMeta& ensure_meta(const Tensor& t);     // creates it
// The edge a gradient for t flows into: its grad_fn, or its AccumulateGrad when a leaf needing grad.
Edge gradient_edge(const Tensor& t);
std::shared_ptr<Node> grad_accumulator(const Tensor& t);

}  // namespace mn::autograd
