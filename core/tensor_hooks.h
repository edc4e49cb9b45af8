#pragma once
// The Tensor methods whose work belongs to the autograd layer, which core may not call (core links
// nothing above it): the differentiable views and copies, the in-place writes, and the calls that
// change autograd state. core/tensor.cpp forwards each of them to the TensorHooks object installed
// here; autograd/tensor_hooks.cpp implements it, and autograd/ops.h installs it from every file that
// includes it (which also makes a static link keep the implementation). Until it is installed these
// methods throw a RuntimeError that says so. Internal: users call the Tensor methods.
#include <cstdint>
#include <functional>
#include <vector>

#include "core/tensor.h"

namespace mn::detail {

class TensorHooks {
 public:
  virtual ~TensorHooks() = default;

  // ---- autograd state ----
  virtual void requires_grad_(const Tensor& t, bool on) const = 0;
  virtual void set_grad(const Tensor& t, const Tensor& grad) const = 0;
  virtual void backward(const Tensor& t, const Tensor& grad, bool retain_graph, bool create_graph) const = 0;
  virtual void retain_grad(const Tensor& t) const = 0;
  virtual void register_post_accumulate_grad_hook(const Tensor& t,
                                                  std::function<void(const Tensor&)> hook) const = 0;

  // ---- views ----
  virtual Tensor view(const Tensor& t, const Shape& shape) const = 0;
  virtual Tensor reshape(const Tensor& t, const Shape& shape) const = 0;
  virtual Tensor permute(const Tensor& t, const std::vector<int64_t>& dims) const = 0;
  virtual Tensor transpose(const Tensor& t, int64_t d0, int64_t d1) const = 0;
  virtual Tensor narrow(const Tensor& t, int64_t dim, int64_t start, int64_t length) const = 0;
  virtual Tensor slice(const Tensor& t, int64_t dim, int64_t start, int64_t end, int64_t step) const = 0;
  virtual Tensor select(const Tensor& t, int64_t dim, int64_t index) const = 0;
  virtual Tensor squeeze(const Tensor& t, int64_t dim) const = 0;
  virtual Tensor unsqueeze(const Tensor& t, int64_t dim) const = 0;
  virtual Tensor expand(const Tensor& t, const Shape& shape) const = 0;
  virtual Tensor flatten(const Tensor& t, int64_t start_dim, int64_t end_dim) const = 0;

  // ---- copies and in-place writes ----
  virtual Tensor contiguous(const Tensor& t) const = 0;
  virtual Tensor clone(const Tensor& t) const = 0;
  virtual Tensor index_select(const Tensor& t, int64_t dim, const Tensor& index) const = 0;
  virtual Tensor to_dtype(const Tensor& t, DType dtype) const = 0;
  virtual Tensor to_device(const Tensor& t, Device device) const = 0;
  virtual void copy_(Tensor& dst, const Tensor& src) const = 0;
  virtual void fill_(Tensor& dst, double value) const = 0;
};

// Installs the hooks (the object must live for the rest of the process); the last call wins.
void set_tensor_hooks(const TensorHooks* hooks);

}  // namespace mn::detail
