#include "kernels/dispatch.h"

#include <mutex>

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

}  // namespace mn::kernels
