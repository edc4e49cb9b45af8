// core/cuda.h in a build without CUDA: nothing has a device, so every call that needs one throws
// DeviceError; the CUDA build defines these in kernels/cuda/runtime.cu instead.
#ifndef MN_WITH_CUDA

#include <atomic>

#include "core/cuda.h"
#include "core/error.h"
#include "core/tensor.h"

namespace mn::cuda {

namespace {

[[noreturn]] void no_cuda(const char* what) {
  throw DeviceError(str(what, ": this build has no CUDA backend (configure with MN_WITH_CUDA=ON on a machine with "
                              "the CUDA toolkit)"));
}

std::atomic<bool> tf32_allowed{false};

}  // namespace

void Stream::synchronize() const { no_cuda("cuda::Stream::synchronize"); }
bool Stream::query() const { no_cuda("cuda::Stream::query"); }
void Stream::wait(const Stream&) const { no_cuda("cuda::Stream::wait"); }

Stream default_stream(int) { no_cuda("cuda::default_stream"); }
Stream new_stream(int) { no_cuda("cuda::new_stream"); }
Stream get_current_stream(int) { no_cuda("cuda::get_current_stream"); }
void set_current_stream(const Stream&) { no_cuda("cuda::set_current_stream"); }

StreamGuard::StreamGuard(const Stream&) { no_cuda("cuda::StreamGuard"); }
StreamGuard::~StreamGuard() = default;

void record_stream(const Tensor& t, const Stream&) {
  if (t.device().is_cpu()) return;
  no_cuda("cuda::record_stream");
}

void synchronize(int) { no_cuda("cuda::synchronize"); }
MemoryInfo memory_info(int) { no_cuda("cuda::memory_info"); }

void set_allow_tf32(bool allow) { tf32_allowed.store(allow); }
bool allow_tf32() { return tf32_allowed.load(); }

}  // namespace mn::cuda

#endif  // MN_WITH_CUDA
