// The autograd layer's side of core/tensor_hooks.h: the Tensor methods core forwards up to here (the
// differentiable views and copies, copy_/fill_, and the calls that change autograd state).
#include "core/tensor_hooks.h"

#include "autograd/engine.h"
#include "autograd/functions/common.h"
#include "autograd/node.h"
#include "autograd/ops.h"
#include "core/capture.h"

namespace mn {

namespace {

class AutogradTensorHooks final : public detail::TensorHooks {
 public:
  void requires_grad_(const Tensor& t, bool on) const override {
    auto& m = autograd::ensure_meta(t);
    MN_CHECK(!m.grad_fn || on, RuntimeError,
             "requires_grad_(false) on a non-leaf tensor; use detach() to get a tensor without history");
    MN_CHECK(!on || is_floating_point(t.dtype()), TypeError, "only floating-point tensors (f32, bf16, f16) can require gradients, got ", t.dtype());
    m.requires_grad = on;
  }

  void set_grad(const Tensor& t, const Tensor& g) const override {
    if (g.defined()) {
      MN_CHECK(g.sizes() == t.sizes(), ValueError, "set_grad: gradient shape ", g.sizes(),
               " does not match tensor shape ", t.sizes());
      // Accumulation adds into it in place, with the tensor's device and dtype.
      MN_CHECK(g.device() == t.device() && g.dtype() == t.dtype(), ValueError, "set_grad: expected a gradient on ",
               t.device(), " of dtype ", t.dtype(), ", got ", g.device(), " ", g.dtype());
    }
    Tensor& grad = autograd::ensure_meta(t).grad;
    const void* before = grad.defined() ? grad.storage()->data() : nullptr;
    grad = g;
    capture::grad_written(t, before);  // a captured graph re-attaches it at replay
  }

  void backward(const Tensor& t, const Tensor& grad, bool retain_graph, bool create_graph) const override {
    std::vector<Tensor> grads;
    if (grad.defined()) grads.push_back(grad);
    autograd::backward({t}, grads, retain_graph, create_graph);
  }

  void retain_grad(const Tensor& t) const override {
    auto& m = autograd::ensure_meta(t);
    if (!m.grad_fn) return;  // leaves keep their gradient anyway
    if (m.retains_grad) return;
    m.retains_grad = true;
    m.grad_fn->retained.emplace_back(m.output_nr, t.impl_ptr());
  }

  void register_post_accumulate_grad_hook(const Tensor& t, std::function<void(const Tensor&)> hook) const override {
    MN_CHECK(t.is_leaf() && t.requires_grad(), RuntimeError,
             "post-accumulate-grad hooks can only be registered on leaf tensors that require grad");
    autograd::ensure_meta(t).post_accumulate_hooks.push_back(std::move(hook));
  }

  Tensor view(const Tensor& t, const Shape& shape) const override { return mn::view(t, shape); }
  Tensor reshape(const Tensor& t, const Shape& shape) const override { return mn::reshape(t, shape); }
  Tensor permute(const Tensor& t, const std::vector<int64_t>& dims) const override { return mn::permute(t, dims); }
  Tensor transpose(const Tensor& t, int64_t d0, int64_t d1) const override { return mn::transpose(t, d0, d1); }
  Tensor narrow(const Tensor& t, int64_t dim, int64_t start, int64_t length) const override {
    return mn::narrow(t, dim, start, length);
  }
  Tensor slice(const Tensor& t, int64_t dim, int64_t start, int64_t end, int64_t step) const override {
    return mn::slice(t, dim, start, end, step);
  }
  Tensor select(const Tensor& t, int64_t dim, int64_t index) const override { return mn::select(t, dim, index); }
  Tensor squeeze(const Tensor& t, int64_t dim) const override { return mn::squeeze(t, dim); }
  Tensor unsqueeze(const Tensor& t, int64_t dim) const override { return mn::unsqueeze(t, dim); }
  Tensor expand(const Tensor& t, const Shape& shape) const override { return mn::expand(t, shape); }
  Tensor flatten(const Tensor& t, int64_t start_dim, int64_t end_dim) const override {
    return mn::flatten(t, start_dim, end_dim);
  }

  Tensor contiguous(const Tensor& t) const override { return mn::contiguous(t); }
  Tensor clone(const Tensor& t) const override { return mn::clone(t); }
  Tensor index_select(const Tensor& t, int64_t dim, const Tensor& index) const override {
    return mn::index_select(t, dim, index);
  }
  Tensor to_dtype(const Tensor& t, DType dtype) const override { return mn::to_dtype(t, dtype); }
  Tensor to_device(const Tensor& t, Device device) const override { return mn::to_device(t, device); }
  void copy_(Tensor& dst, const Tensor& src) const override { detail::copy_into(dst, src); }
  void fill_(Tensor& dst, double value) const override { detail::fill_with(dst, value); }
};

}  // namespace

int detail::install_autograd_tensor_hooks() {
  static const auto* const hooks = new AutogradTensorHooks();  // never destroyed: tensors outlive statics
  detail::set_tensor_hooks(hooks);
  return 0;
}

}  // namespace mn
