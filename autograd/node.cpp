#include "autograd/node.h"

#include <atomic>

#include "autograd/engine.h"
#include "autograd/function.h"
#include "autograd/ops.h"
#include "core/capture.h"
#include "kernels/kernels.h"

namespace mn {

TensorImpl::TensorImpl() = default;
TensorImpl::~TensorImpl() { delete autograd.load(std::memory_order_acquire); }

namespace autograd {

namespace {
thread_local bool g_grad_mode = true;
std::atomic<uint64_t> g_sequence{0};
const std::shared_ptr<Node> kNoNode;
}  // namespace

bool grad_mode_enabled() { return g_grad_mode; }
void set_grad_mode(bool enabled) { g_grad_mode = enabled; }
uint64_t next_sequence_nr() { return g_sequence.fetch_add(1, std::memory_order_relaxed); }

Node::Node() : sequence_nr(next_sequence_nr()) {}

AutogradMeta* meta(const Tensor& t) { return t.impl()->autograd.load(std::memory_order_acquire); }

AutogradMeta& ensure_meta(const Tensor& t) {
  auto& slot = t.impl()->autograd;
  AutogradMeta* m = slot.load(std::memory_order_acquire);
  if (m != nullptr) return *m;
  // First use: whoever publishes first wins, the other thread frees its copy and takes the winner's.
  auto fresh = std::make_unique<AutogradMeta>();
  if (slot.compare_exchange_strong(m, fresh.get(), std::memory_order_acq_rel, std::memory_order_acquire))
    return *fresh.release();
  return *m;
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

}  // namespace autograd

// ---- Tensor's autograd methods ----
bool Tensor::requires_grad() const {
  auto* m = checked()->autograd.load(std::memory_order_acquire);
  return m != nullptr && m->requires_grad;
}

Tensor& Tensor::requires_grad_(bool on) {
  auto& m = autograd::ensure_meta(*this);
  MN_CHECK(!m.grad_fn || on, RuntimeError,
           "requires_grad_(false) on a non-leaf tensor; use detach() to get a tensor without history");
  MN_CHECK(!on || dtype() == DType::f32, TypeError, "only f32 tensors can require gradients, got ", dtype());
  m.requires_grad = on;
  return *this;
}

bool Tensor::is_leaf() const {
  auto* m = checked()->autograd.load(std::memory_order_acquire);
  return m == nullptr || !m->grad_fn;
}

const std::shared_ptr<autograd::Node>& Tensor::grad_fn() const {
  auto* m = checked()->autograd.load(std::memory_order_acquire);
  return m ? m->grad_fn : autograd::kNoNode;
}

Tensor Tensor::grad() const {
  auto* m = checked()->autograd.load(std::memory_order_acquire);
  return m ? m->grad : Tensor();
}

void Tensor::set_grad(const Tensor& g) const {
  if (g.defined()) {
    MN_CHECK(g.sizes() == sizes(), ValueError, "set_grad: gradient shape ", g.sizes(), " does not match tensor shape ",
             sizes());
    // Accumulation adds into it in place, with the tensor's device and dtype.
    MN_CHECK(g.device() == device() && g.dtype() == dtype(), ValueError, "set_grad: expected a gradient on ", device(),
             " of dtype ", dtype(), ", got ", g.device(), " ", g.dtype());
  }
  Tensor& grad = autograd::ensure_meta(*this).grad;
  const void* before = grad.defined() ? grad.storage()->data() : nullptr;
  grad = g;
  capture::grad_written(*this, before);  // a captured graph re-attaches it at replay
}

void Tensor::backward(const Tensor& grad, bool retain_graph, bool create_graph) const {
  std::vector<Tensor> grads;
  if (grad.defined()) grads.push_back(grad);
  autograd::backward({*this}, grads, retain_graph, create_graph);
}

Tensor Tensor::detach() const {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = storage();
  impl->sizes = sizes();
  impl->strides = strides();
  impl->offset = storage_offset();
  impl->dtype = dtype();
  return Tensor(std::move(impl));
}

void Tensor::retain_grad() const {
  auto& m = autograd::ensure_meta(*this);
  if (!m.grad_fn) return;  // leaves keep their gradient anyway
  if (m.retains_grad) return;
  m.retains_grad = true;
  m.grad_fn->retained.emplace_back(m.output_nr, impl_ptr());
}

void Tensor::register_post_accumulate_grad_hook(std::function<void(const Tensor&)> hook) const {
  MN_CHECK(is_leaf() && requires_grad(), RuntimeError,
           "post-accumulate-grad hooks can only be registered on leaf tensors that require grad");
  autograd::ensure_meta(*this).post_accumulate_hooks.push_back(std::move(hook));
}

}  // namespace mn
