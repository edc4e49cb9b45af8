// CUDA runtime pieces of the backend: error checking, the per-thread current stream of each device,
// the stream pools, the public calls of core/cuda.h, and the registration of the runtime kernels
// (copy, fill and random fill in copy.cu, gemm in gemm.cu, optimizer steps in optim.cu) and of the
// CUDA caching allocator (cuda_allocator.cu).
#include <array>
#include <atomic>
#include <mutex>

#include "core/caching_allocator.h"
#include "core/cuda.h"
#include "kernels/cuda/common.cuh"
#include "kernels/kernels.h"

namespace mn::cuda {

void check(cudaError_t status, const char* what, const char* file, int line) {
  if (status == cudaSuccess) return;
  cudaGetLastError();  // a non-sticky error must not surface again at the next unrelated check
  throw DeviceError(str("CUDA error in ", what, " (", file, ":", line, "): ", cudaGetErrorName(status), ": ",
                        cudaGetErrorString(status)));
}

namespace {

void check_device_index(int device, const char* caller) {
  const int count = cuda_device_count();
  MN_CHECK(device >= 0 && device < count, DeviceError, caller, ": expected a CUDA device index in [0, ", count,
           "), got ", device, count == 0 ? " (no CUDA device is available)" : "");
}

struct StreamPool {
  std::once_flag created;
  std::array<cudaStream_t, kStreamPoolSize> streams{};
  std::atomic<unsigned> next{0};
};

StreamPool& pool_of(int device) {
  static auto* const pools = new std::array<StreamPool, kMaxDevicesPerType>();  // never destroyed
  return (*pools)[static_cast<size_t>(device)];
}

cudaStream_t as_stream(StreamId id) { return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(id)); }
StreamId as_id(cudaStream_t s) { return static_cast<StreamId>(reinterpret_cast<uintptr_t>(s)); }

void make_current_device(int device) {
  int current = -1;
  MN_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device) MN_CUDA_CHECK(cudaSetDevice(device));
}

}  // namespace

DeviceGuard::DeviceGuard(int device) {
  MN_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != device) MN_CUDA_CHECK(cudaSetDevice(device));
}

DeviceGuard::~DeviceGuard() {
  int current = -1;
  if (previous_ >= 0 && cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
  cudaGetLastError();
}

void check_on_device(const char* op, const Tensor& t, int device, const char* arg) {
  const Device d = t.device();
  MN_CHECK(d.is_cuda() && d.index == device, DeviceError, op, ": expected '", arg, "' on ", cuda_device(device),
           ", got a tensor on ", d, " (move it with .to(", cuda_device(device), ") first)");
}

cudaStream_t current_stream(int device) {
  check_device_index(device, "cuda::current_stream");
  make_current_device(device);
  return as_stream(current_stream_id(device));
}

// ---- core/cuda.h ----------------------------------------------------------------------------------

void Stream::synchronize() const {
  check_device_index(device_, "cuda::Stream::synchronize");
  DeviceGuard guard(device_);
  MN_CUDA_CHECK(cudaStreamSynchronize(as_stream(id_)));
}

bool Stream::query() const {
  check_device_index(device_, "cuda::Stream::query");
  DeviceGuard guard(device_);
  const cudaError_t status = cudaStreamQuery(as_stream(id_));
  if (status == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  MN_CUDA_CHECK(status);
  return true;
}

void Stream::wait(const Stream& other) const {
  check_device_index(device_, "cuda::Stream::wait");
  check_device_index(other.device_, "cuda::Stream::wait");
  if (other == *this) return;
  cudaEvent_t event = nullptr;
  {
    DeviceGuard guard(other.device_);  // an event is recorded on a stream of its own device
    MN_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    const cudaError_t recorded = cudaEventRecord(event, as_stream(other.id_));
    if (recorded != cudaSuccess) cudaEventDestroy(event);
    MN_CUDA_CHECK(recorded);
  }
  DeviceGuard guard(device_);
  const cudaError_t waited = cudaStreamWaitEvent(as_stream(id_), event, 0);
  cudaEventDestroy(event);  // released once the event has completed; the wait stays valid
  MN_CUDA_CHECK(waited);
}

Stream default_stream(int device) {
  check_device_index(device, "cuda::default_stream");
  return Stream(device, 0);
}

Stream new_stream(int device) {
  check_device_index(device, "cuda::new_stream");
  StreamPool& pool = pool_of(device);
  std::call_once(pool.created, [&] {
    DeviceGuard guard(device);
    for (cudaStream_t& s : pool.streams) MN_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  });
  const unsigned i = pool.next.fetch_add(1, std::memory_order_relaxed) % kStreamPoolSize;
  return Stream(device, as_id(pool.streams[i]));
}

Stream get_current_stream(int device) {
  check_device_index(device, "cuda::get_current_stream");
  return Stream(device, current_stream_id(device));
}

void set_current_stream(const Stream& s) {
  check_device_index(s.device_index(), "cuda::set_current_stream");
  detail::set_current_stream_id(s.device_index(), s.id());
}

StreamGuard::StreamGuard(const Stream& s) {
  check_device_index(s.device_index(), "cuda::StreamGuard");
  MN_CUDA_CHECK(cudaGetDevice(&previous_device_));
  previous_ = get_current_stream(s.device_index());
  set_current_stream(s);
  if (previous_device_ != s.device_index()) MN_CUDA_CHECK(cudaSetDevice(s.device_index()));
}

StreamGuard::~StreamGuard() {
  detail::set_current_stream_id(previous_.device_index(), previous_.id());
  int current = -1;
  if (previous_device_ >= 0 && cudaGetDevice(&current) == cudaSuccess && current != previous_device_)
    cudaSetDevice(previous_device_);
  cudaGetLastError();
}

void record_stream(const Tensor& t, const Stream& s) {
  if (!t.defined() || t.device().is_cpu()) return;
  MN_CHECK(t.device().index == s.device_index(), DeviceError, "cuda::record_stream: the tensor lives on ",
           t.device(), " but the stream belongs to ", s.device());
  t.storage()->record_stream(s.id());
}

void synchronize(int device) {
  check_device_index(device, "cuda::synchronize");
  DeviceGuard guard(device);
  MN_CUDA_CHECK(cudaDeviceSynchronize());
}

MemoryInfo memory_info(int device) {
  check_device_index(device, "cuda::memory_info");
  DeviceGuard guard(device);
  MemoryInfo info;
  MN_CUDA_CHECK(cudaMemGetInfo(&info.free_bytes, &info.total_bytes));
  return info;
}

namespace {
std::atomic<bool> tf32_allowed{false};
}  // namespace

void set_allow_tf32(bool allow) { tf32_allowed.store(allow, std::memory_order_relaxed); }
bool allow_tf32() { return tf32_allowed.load(std::memory_order_relaxed); }

}  // namespace mn::cuda

namespace mn::cuda {
void register_cuda_allocator();  // cuda_allocator.cu
}  // namespace mn::cuda

namespace mn::kernels {

void register_cuda_copy();   // copy.cu: copy, fill, random_fill
void register_cuda_gemm();   // gemm.cu: gemm (cuBLAS)
void register_cuda_optim();  // optim.cu: adam_step, sgd_step, adam_amsgrad_step, rmsprop_step

void register_cuda_runtime_kernels() {
  cuda::register_cuda_allocator();  // first: nothing below may allocate, but tensors soon will
  register_cuda_copy();
  register_cuda_gemm();
  register_cuda_optim();
}

}  // namespace mn::kernels
