// The calling thread's current stream per device (core/cuda.h). Core keeps it because every device
// allocation reads it (core/storage.cpp) and core calls nothing above it; the CUDA runtime
// (kernels/cuda/runtime.cu) sets it. In a build without CUDA it stays 0, the default stream.
#include <array>

#include "core/caching_allocator.h"
#include "core/cuda.h"
#include "core/error.h"

namespace mn::cuda {

namespace {
thread_local std::array<StreamId, kMaxDevicesPerType> tls_current_stream{};

size_t checked_index(int device, const char* caller) {
  MN_CHECK(device >= 0 && device < kMaxDevicesPerType, DeviceError, caller, ": bad device index ", device);
  return static_cast<size_t>(device);
}
}  // namespace

StreamId current_stream_id(int device) {
  return tls_current_stream[checked_index(device, "cuda::current_stream_id")];
}

void detail::set_current_stream_id(int device, StreamId id) {
  tls_current_stream[checked_index(device, "cuda::set_current_stream")] = id;
}

}  // namespace mn::cuda
