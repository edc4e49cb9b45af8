#include "autograd/saved.h"

namespace mn::autograd {

SavedTensor SavedTensor::input(const Tensor& t) {
  SavedTensor s;
  if (!t.defined()) return s;
  s.data_ = t;
  s.saved_version_ = t.version();
  return s;
}

SavedTensor SavedTensor::output(const Tensor& t) {
  SavedTensor s;
  if (!t.defined()) return s;
  s.data_ = t.detach();
  s.saved_version_ = t.version();
  s.is_output_ = true;
  if (auto* m = meta(t)) {
    s.requires_grad_ = m->requires_grad;
    s.grad_fn_ = m->grad_fn;
    s.output_nr_ = m->output_nr;
  }
  return s;
}

Tensor SavedTensor::unpack(const char* who) const {
  if (!data_.defined()) return Tensor();
  const uint32_t now = data_.version();
  MN_CHECK(now == saved_version_, RuntimeError,
           "one of the tensors needed for gradient computation has been modified by an in-place operation: ",
           dtype_name(data_.dtype()), data_.sizes(), " saved by ", who, " is at version ", now, "; expected version ",
           saved_version_, " instead");
  if (!is_output_ || !requires_grad_ || !grad_mode_enabled()) return data_;
  // Re-attach the output to its node so that double backward differentiates through it.
  auto node = grad_fn_.lock();
  if (!node) return data_;
  Tensor t = data_.detach();
  AutogradMeta& m = ensure_meta(t);
  m.requires_grad = true;
  m.grad_fn = node;
  m.output_nr = output_nr_;
  return t;
}

}  // namespace mn::autograd
