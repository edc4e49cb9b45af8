#include "kernels/dispatch.h"

#include <mutex>

#include "core/caching_allocator.h"
#include "kernels/factories.h"
#include "kernels/kernels.h"

namespace mn::kernels {

void ensure_registered() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_cpu_kernels();
#ifdef MN_WITH_CUDA
    register_cuda_kernels();
#endif
  });
}

namespace lowp {

Tensor widen(const Tensor& t) {
  Tensor wide = empty(t.sizes(), TensorOptions(DType::f32).with_device(t.device()));
  copy(t.device(), t, wide);
  return wide;
}

void narrow_into(const Tensor& wide, Tensor& target) { copy(target.device(), wide, target); }

}  // namespace lowp

}  // namespace mn::kernels

namespace mn::detail {

// Core's allocator runs the backends' registration before a device's first allocator (the CUDA
// backend registers its allocator factory there), which it cannot call itself (core/caching_allocator.h).
int install_kernel_backends() {
  set_backend_registration(&kernels::ensure_registered);
  return 0;
}

}  // namespace mn::detail
