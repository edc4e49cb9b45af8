#include "core/device.h"

#ifdef MN_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "core/error.h"

namespace mn {

Device Device::parse(const std::string& text) {
  if (text == "cpu") return kCPU;
  if (text == "auto") return cuda_available() ? cuda_device(0) : kCPU;
  if (text.rfind("cuda", 0) == 0) {
    if (text.size() == 4) return cuda_device(0);
    if (text[4] == ':' && text.size() > 5) {
      int index = 0;
      for (size_t i = 5; i < text.size(); ++i) {
        MN_CHECK(text[i] >= '0' && text[i] <= '9', ValueError, "bad device '", text,
                 "': expected 'cpu', 'cuda', 'cuda:N' or 'auto'");
        index = index * 10 + (text[i] - '0');
      }
      return cuda_device(index);
    }
  }
  throw ValueError(mn::str("bad device '", text, "': expected 'cpu', 'cuda', 'cuda:N' or 'auto'"));
}

std::string Device::str() const { return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index); }

// Device discovery is core's (Device::parse("auto") and cuda_available need it): the CUDA runtime
// library is below every layer. Without a driver or device cudaGetDeviceCount returns an error, which
// means zero devices, not a failure.
int cuda_device_count() {
#ifdef MN_WITH_CUDA
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky error so later checks do not report it
      return 0;
    }
    return n;
  }();
  return count;
#else
  return 0;
#endif
}
bool cuda_available() { return cuda_device_count() > 0; }

}  // namespace mn
