#include "autograd/node.h"

#include <atomic>

#include "autograd/function.h"
#include "autograd/ops.h"
#include "core/capture.h"
#include "kernels/kernels.h"

namespace mn::autograd {

namespace {
thread_local bool g_grad_mode = true;
std::atomic<uint64_t> g_sequence{0};
}  // namespace

bool grad_mode_enabled() { return g_grad_mode; }
void set_grad_mode(bool enabled) { g_grad_mode = enabled; }
uint64_t next_sequence_nr() { return g_sequence.fetch_add(1, std::memory_order_relaxed); }

Node::Node() : sequence_nr(next_sequence_nr()) {}

// Every AutogradMetaBase is an AutogradMeta: ensure_meta is the only place that creates one.
AutogradMeta* meta(const Tensor& t) {
  return static_cast<AutogradMeta*>(t.impl()->autograd.load(std::memory_order_acquire));
}

AutogradMeta& ensure_meta(const Tensor& t) {
  auto& slot = t.impl()->autograd;
  AutogradMetaBase* m = slot.load(std::memory_order_acquire);
  if (m != nullptr) return static_cast<AutogradMeta&>(*m);
  // First use: whoever publishes first wins, the other thread frees its copy and takes the winner's.
  auto fresh = std::make_unique<AutogradMeta>();
  if (slot.compare_exchange_strong(m, fresh.get(), std::memory_order_acq_rel, std::memory_order_acquire))
    return *fresh.release();
  return static_cast<AutogradMeta&>(*m);
}

std::shared_ptr<Node> grad_accumulator(const Tensor& t) {
  AutogradMeta& m = ensure_meta(t);
  // One sink per leaf, so gradients from every graph that uses it meet in one place.
  std::lock_guard<std::mutex> lock(m.mutex);
  if (auto acc = m.grad_accumulator.lock()) return acc;
  auto acc = std::make_shared<AccumulateGrad>(t.impl_ptr());
  m.grad_accumulator = acc;
  return acc;
}

Edge gradient_edge(const Tensor& t) {
  AutogradMeta* m = meta(t);
  if (m == nullptr) return {};
  if (m->grad_fn) return {m->grad_fn, m->output_nr};
  if (m->requires_grad) return {grad_accumulator(t), 0};
  return {};
}

bool needs_grad(const std::vector<Tensor>& inputs) {
  if (!grad_mode_enabled()) return false;
  for (const Tensor& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

namespace {
void set_history(Tensor* out, const std::shared_ptr<Node>& node, uint32_t output_nr) {
  AutogradMeta& m = ensure_meta(*out);
  m.requires_grad = true;
  m.grad_fn = node;
  m.output_nr = output_nr;
}

void add_next_edge(Node& node, const Tensor& in) {
  node.next_edges.push_back(in.defined() ? gradient_edge(in) : Edge{});
  node.input_meta.push_back(in.defined() ? InputMeta{in.sizes(), in.dtype(), in.device()} : InputMeta{});
}
}  // namespace

void attach(const std::shared_ptr<Node>& node, std::initializer_list<const Tensor*> inputs,
            std::initializer_list<Tensor*> outputs) {
  node->next_edges.reserve(inputs.size());
  node->input_meta.reserve(inputs.size());
  for (const Tensor* in : inputs) add_next_edge(*node, *in);
  node->num_outputs = static_cast<uint32_t>(outputs.size());
  uint32_t nr = 0;
  for (Tensor* out : outputs) set_history(out, node, nr++);
}

void attach(const std::shared_ptr<Node>& node, const std::vector<Tensor>& inputs, std::vector<Tensor*> outputs) {
  node->next_edges.reserve(inputs.size());
  node->input_meta.reserve(inputs.size());
  for (const Tensor& in : inputs) add_next_edge(*node, in);
  node->num_outputs = static_cast<uint32_t>(outputs.size());
  uint32_t nr = 0;
  for (Tensor* out : outputs) set_history(out, node, nr++);
}

void save_outputs_into(std::vector<SavedTensor>& dst, std::initializer_list<Tensor*> outputs) {
  for (Tensor* out : outputs) dst.push_back(SavedTensor::output(*out));
}

TensorList AccumulateGrad::apply(TensorList&& grads) {
  Tensor g = std::move(grads[0]);
  if (!g.defined()) return {};
  Tensor leaf(leaf_);
  AutogradMeta& m = ensure_meta(leaf);
  MN_CHECK(g.sizes() == leaf.sizes(), RuntimeError, "gradient of shape ", g.sizes(),
           " does not match the leaf's shape ", leaf.sizes(), " (a backward formula returned a wrong shape)");
  {
    // Backward passes on several threads may reach one leaf's sink together (a shared parameter); the
    // sum is the same whichever comes first, up to float rounding order. Hooks run outside the lock.
    std::lock_guard<std::mutex> lock(m.mutex);
    const void* before = m.grad.defined() ? m.grad.storage()->data() : nullptr;
    if (grad_mode_enabled()) {
      // create_graph: keep the history so the gradient itself can be differentiated.
      m.grad = m.grad.defined() ? add(m.grad, g) : g;
    } else if (!m.grad.defined()) {
      // Steal the incoming buffer when nothing else refers to it; otherwise copy, because later
      // accumulation happens in place.
      const bool sole_owner = g.impl_ptr().use_count() == 1 && g.storage().use_count() == 1 && !g.requires_grad() &&
                              g.is_contiguous() && g.storage_offset() == 0;
      m.grad = sole_owner ? g : g.detach().clone();
    } else {
      Tensor acc = m.grad;
      if (acc.requires_grad()) acc = acc.detach();
      kernels::binary(acc.device(), kernels::BinaryOp::Add, acc, g, acc);
    }
    capture::grad_written(leaf, before);  // a captured graph re-attaches this gradient at replay
  }
  for (auto& hook : m.post_accumulate_hooks) hook(leaf);
  return {};
}

}  // namespace mn::autograd
