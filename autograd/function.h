#pragma once
// Recording a differentiable op: compute the outputs with kernels, then, when an input needs a
// gradient and grad mode is on, attach one node whose backward is a small lambda.
//
//   Tensor out = ...kernel...;
//   if (autograd::needs_grad({&a, &b}))
//     autograd::record("MulBackward", {&a, &b}, {&out},
//         [sa = SavedTensor::input(a), sb = SavedTensor::input(b)](const GradContext& c) -> TensorList {
//           ...return one gradient per input (undefined where !c.needs(i))...
//         });
//
// Backward lambdas are written with differentiable ops, so with create_graph the backward pass is
// itself recorded and double backward works.
#include <initializer_list>
#include <optional>
#include <utility>

#include "autograd/node.h"
#include "autograd/saved.h"

namespace mn::autograd {

uint64_t next_sequence_nr();

// True if grad mode is on and any input requires grad.
inline bool needs_grad(std::initializer_list<const Tensor*> inputs) {
  if (!grad_mode_enabled()) return false;
  for (const Tensor* t : inputs)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}
bool needs_grad(const std::vector<Tensor>& inputs);

// Context with access to the node's saved outputs.
struct OutputContext : GradContext {
  const std::vector<SavedTensor>& saved_outputs;
  Tensor output(size_t i = 0) const { return saved_outputs[i].unpack(); }
};

template <class F>
class FnNode final : public Node {
 public:
  FnNode(const char* name, F&& fn) : name_(name), fn_(std::move(fn)) {}
  TensorList apply(TensorList&& grads) override {
    if (!fn_)
      throw RuntimeError(str("Trying to backward through ", name_,
                             " a second time (or after its saved tensors were freed); pass "
                             "retain_graph=true to the first backward if you need to backward twice"));
    OutputContext ctx{{grads, next_edges}, saved_outputs};
    return (*fn_)(ctx);
  }
  std::string name() const override { return name_; }
  void release_saved() override {
    fn_.reset();
    saved_outputs.clear();
  }
  std::vector<SavedTensor> saved_outputs;

 private:
  const char* name_;
  std::optional<F> fn_;
};

// Attaches history: a node named `name` with edges to `inputs`, becoming grad_fn of `outputs`
// (output i gets output_nr i). With save_outputs the lambda can read ctx.output(i).
void attach(const std::shared_ptr<Node>& node, std::initializer_list<const Tensor*> inputs,
            std::initializer_list<Tensor*> outputs);
void attach(const std::shared_ptr<Node>& node, const std::vector<Tensor>& inputs, std::vector<Tensor*> outputs);
void save_outputs_into(std::vector<SavedTensor>& dst, std::initializer_list<Tensor*> outputs);

template <class F>
std::shared_ptr<Node> record(const char* name, std::initializer_list<const Tensor*> inputs,
                             std::initializer_list<Tensor*> outputs, F&& backward, bool save_outputs = false) {
  auto node = std::make_shared<FnNode<std::decay_t<F>>>(name, std::forward<F>(backward));
  attach(node, inputs, outputs);
  if (save_outputs) save_outputs_into(node->saved_outputs, outputs);
  return node;
}

// Variable-length inputs (cat, stack).
template <class F>
std::shared_ptr<Node> record_list(const char* name, const std::vector<Tensor>& inputs, std::vector<Tensor*> outputs,
                                  F&& backward) {
  auto node = std::make_shared<FnNode<std::decay_t<F>>>(name, std::forward<F>(backward));
  attach(node, inputs, std::move(outputs));
  return node;
}

}  // namespace mn::autograd
