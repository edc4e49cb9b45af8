#pragma once
// Tensor: a cheap handle (shared TensorImpl) over shared storage + sizes + strides + offset (in
// elements) + dtype + autograd metadata. Views share storage and hence the version counter.
// Differentiable operations are free functions in autograd/ops.h; the methods here that create
// views or copies, and those that change autograd state, forward to the autograd layer through
// core/tensor_hooks.h (core links nothing above it). Factories other than empty/make_view are
// declared in kernels/factories.h.
#include <atomic>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/host_device.h"
#include "core/shape.h"
#include "core/storage.h"

namespace mn {

class Tensor;
class Generator;
struct TensorOptions;
namespace capture {  // core/capture.h
class Recording;
namespace detail {
extern thread_local MN_CONSTINIT Recording* t_recording;
}
void host_access();  // host code touched a tensor's memory while recording: not replayable
}  // namespace capture
namespace autograd {
class Node;
struct AutogradMetaBase;
}  // namespace autograd

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape sizes;
  Shape strides;
  int64_t offset = 0;
  DType dtype = DType::f32;
  // Null until autograd needs it, then owned (deleted with the impl). Atomic because it is created
  // lazily: two threads reading one tensor (say a shared leaf feeding two forwards) may both ask for it.
  // The autograd layer creates it (an autograd::AutogradMeta, autograd/node.h).
  std::atomic<autograd::AutogradMetaBase*> autograd{nullptr};
  TensorImpl();
  ~TensorImpl();
  TensorImpl(const TensorImpl&) = delete;
  TensorImpl& operator=(const TensorImpl&) = delete;
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  bool same(const Tensor& other) const { return impl_ == other.impl_; }

  // ---- metadata ----
  const Shape& sizes() const { return checked()->sizes; }
  const Shape& shape() const { return checked()->sizes; }
  const Shape& strides() const { return checked()->strides; }
  int64_t size(int64_t dim) const;
  int64_t stride(int64_t dim) const;
  int dim() const { return checked()->sizes.size(); }
  int64_t numel() const { return checked()->sizes.numel(); }
  DType dtype() const { return checked()->dtype; }
  Device device() const { return checked()->storage->device(); }
  int64_t storage_offset() const { return checked()->offset; }
  const std::shared_ptr<Storage>& storage() const { return checked()->storage; }
  bool is_contiguous() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype()); }

  // Typed pointer to element 0 (offset applied); throws TypeError on a dtype mismatch. Outside a kernel
  // while a graph is being recorded, host access breaks the recording (a replay would not repeat it).
  template <class T>
  T* data() const {
    MN_CHECK(dtype() == dtype_of<T>::value, TypeError, "data<", dtype_name(dtype_of<T>::value),
             ">() called on a tensor of dtype ", dtype_name(dtype()));
    if (capture::detail::t_recording != nullptr) capture::host_access();
    return static_cast<T*>(storage()->data()) + impl_->offset;
  }
  void* raw_data() const {
    if (capture::detail::t_recording != nullptr) capture::host_access();
    return static_cast<char*>(storage()->data()) + impl_->offset * static_cast<int64_t>(dtype_size(dtype()));
  }

  // ---- version counter (shared with all views) ----
  uint32_t version() const { return checked()->storage->version(); }
  void bump_version() const { checked()->storage->bump_version(); }

  // ---- autograd ----
  bool requires_grad() const;
  Tensor& requires_grad_(bool on = true);
  bool is_leaf() const;
  const std::shared_ptr<autograd::Node>& grad_fn() const;
  Tensor grad() const;
  void set_grad(const Tensor& g) const;
  // Accumulates gradients into leaves; grad defaults to 1 for a one-element tensor.
  void backward(const Tensor& grad = Tensor(), bool retain_graph = false, bool create_graph = false) const;
  Tensor detach() const;
  // Keep .grad on a non-leaf after backward.
  void retain_grad() const;
  // Runs after this leaf's gradient has been accumulated into .grad (DDP hooks in here).
  void register_post_accumulate_grad_hook(std::function<void(const Tensor&)> hook) const;

  // ---- views (differentiable; share storage) ----
  Tensor view(const Shape& shape) const;
  Tensor reshape(const Shape& shape) const;
  Tensor permute(const std::vector<int64_t>& dims) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor t() const;  // 2-D transpose
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor select(int64_t dim, int64_t index) const;
  Tensor squeeze(int64_t dim) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor expand(const Shape& shape) const;
  Tensor flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;

  // ---- copies ----
  Tensor contiguous() const;
  Tensor clone() const;
  Tensor index_select(int64_t dim, const Tensor& index) const;
  Tensor to(DType dtype) const;
  Tensor to(Device device) const;
  // This tensor's dtype and device (requires_grad false), for making tensors like it: libtorch's
  // Tensor::options().
  TensorOptions options() const;
  // In-place; bump the version counter. Refused on tensors that need gradients
  // (use the out-of-place forms there), like PyTorch refuses them on leaves.
  Tensor& copy_(const Tensor& src);
  Tensor& fill_(double value);
  Tensor& zero_() { return fill_(0.0); }

  // ---- values ----
  double item() const;  // one-element tensors only
  template <class T>
  std::vector<T> to_vector() const;  // contiguous copy in row-major order
  std::string str() const;           // printing

 private:
  TensorImpl* checked() const {
    if (!impl_) throw ValueError("operation on an undefined tensor");
    return impl_.get();
  }
  std::shared_ptr<TensorImpl> impl_;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);

// ---- allocation (CPU unless a device is given; f32 unless a dtype is given) ----
struct TensorOptions {
  DType dtype = DType::f32;
  Device device = kCPU;
  bool requires_grad = false;
  TensorOptions() = default;
  TensorOptions(DType t) : dtype(t) {}                // NOLINT: implicit on purpose
  TensorOptions(Device d) : device(d) {}              // NOLINT
  TensorOptions& with_dtype(DType t) { dtype = t; return *this; }
  TensorOptions& with_device(Device d) { device = d; return *this; }
  TensorOptions& with_requires_grad(bool r = true) { requires_grad = r; return *this; }
};

inline TensorOptions Tensor::options() const { return TensorOptions(dtype()).with_device(device()); }

// Uninitialised memory (from the caching allocator).
Tensor empty(const Shape& shape, TensorOptions opts = {});
// A tensor over existing storage (a view, no autograd history).
Tensor make_view(const std::shared_ptr<Storage>& storage, const Shape& sizes, const Shape& strides,
                 int64_t offset, DType dtype);
Tensor empty_like(const Tensor& t);
// The other factories (zeros, ones, full, arange, randn, from_vector, ...) fill memory with kernels:
// kernels/factories.h declares them.

namespace autograd {
// The part of a tensor's autograd state that core reads (Tensor::requires_grad, grad, grad_fn,
// is_leaf) and deletes with the TensorImpl. The autograd layer derives AutogradMeta from it
// (autograd/node.h) and is the only one that creates it.
struct AutogradMetaBase {
  AutogradMetaBase() = default;
  AutogradMetaBase(const AutogradMetaBase&) = delete;
  AutogradMetaBase& operator=(const AutogradMetaBase&) = delete;
  virtual ~AutogradMetaBase() = default;
  bool requires_grad = false;
  Tensor grad;
  std::shared_ptr<Node> grad_fn;
};
}  // namespace autograd

}  // namespace mn
