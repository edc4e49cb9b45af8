// The CUDA raw backend under the shared caching algorithm (core/caching_allocator.h): segments from
// cudaMalloc/cudaFree on one device, stream order through CUDA events (recycled through a free
// list), the optional byte cap, and the factory that gives every device its allocator.
//
// Stream ids are cudaStream_t values (0: the legacy default stream). The algorithm calls the backend
// with its own lock held, so nothing here locks. A failed cudaMalloc (cudaErrorMemoryAllocation) is
// not sticky: the error is cleared and nullptr returned, and the algorithm frees its cache, retries
// and finally throws MemoryError with the numbers; any other CUDA error throws DeviceError at once.
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "core/caching_allocator.h"
#include "core/cuda.h"
#include "kernels/cuda/common.cuh"

namespace mn::cuda {

namespace {

cudaEvent_t as_event(uint64_t e) { return reinterpret_cast<cudaEvent_t>(static_cast<uintptr_t>(e)); }
uint64_t as_handle(cudaEvent_t e) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(e)); }

class CudaRawBackend final : public RawBackend {
 public:
  explicit CudaRawBackend(int device) : device_(device) {
    DeviceGuard guard(device_);
    size_t free_bytes = 0;
    MN_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_));
  }
  // Capture pools (make_cuda_pool_allocator) are destroyed with their graph: their events go too.
  // The caching allocator has handed every pending event back through release_event by now.
  ~CudaRawBackend() override {
    for (cudaEvent_t event : spare_events_) cudaEventDestroy(event);
    cudaGetLastError();
  }

  void* raw_alloc(size_t bytes) override {
    if (cap_ != 0 && held_ + bytes > cap_) return nullptr;
    DeviceGuard guard(device_);
    void* ptr = nullptr;
    const cudaError_t status = cudaMalloc(&ptr, bytes);
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear it: the caller frees its cache and retries
      return nullptr;
    }
    MN_CUDA_CHECK(status);
    held_ += bytes;
    return ptr;
  }

  // cudaFree synchronises the device first, so work still queued on any stream that reads the
  // segment finishes before the memory goes back.
  void raw_free(void* ptr, size_t bytes) override {
    DeviceGuard guard(device_);
    MN_CUDA_CHECK(cudaFree(ptr));
    held_ -= bytes;
  }

  uint64_t record_event(StreamId stream) override {
    DeviceGuard guard(device_);
    cudaEvent_t event = nullptr;
    if (spare_events_.empty()) {
      MN_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    } else {
      event = spare_events_.back();
      spare_events_.pop_back();
    }
    const cudaError_t status = cudaEventRecord(event, reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream)));
    if (status != cudaSuccess) {
      spare_events_.push_back(event);
      MN_CUDA_CHECK(status);
    }
    return as_handle(event);
  }

  bool event_ready(uint64_t event) override {
    const cudaError_t status = cudaEventQuery(as_event(event));
    if (status == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    MN_CUDA_CHECK(status);
    return true;
  }

  void event_synchronize(uint64_t event) override { MN_CUDA_CHECK(cudaEventSynchronize(as_event(event))); }

  // Events are reused rather than destroyed: record_event runs on every cross-stream free.
  void release_event(uint64_t event) override { spare_events_.push_back(as_event(event)); }

  void set_memory_cap(size_t bytes) override { cap_ = bytes; }
  size_t memory_cap() const override { return cap_; }
  size_t total_capacity() const override { return total_; }
  std::string name() const override { return str("cuda:", device_); }

 private:
  int device_;
  size_t total_ = 0;
  size_t held_ = 0;
  size_t cap_ = 0;
  std::vector<cudaEvent_t> spare_events_;
};

bool caching_disabled_by_environment() {
  const char* value = std::getenv("MN_NO_CACHING");
  return value != nullptr && value[0] != '\0' && std::strcmp(value, "0") != 0;
}

// Called once per device index by allocator_for (under the registry lock); the allocator lives for
// the rest of the process.
DeviceAllocator* make_cuda_allocator(int index) {
  if (index < 0 || index >= cuda_device_count()) return nullptr;
  auto backend = std::make_unique<CudaRawBackend>(index);
  if (caching_disabled_by_environment()) return new PassThroughAllocator(std::move(backend));
  return new CachingAllocatorImpl(std::move(backend));
}

// The private pools of capture graphs always cache (see make_private_allocator).
DeviceAllocator* make_cuda_pool_allocator(int index) {
  if (index < 0 || index >= cuda_device_count()) return nullptr;
  return new CachingAllocatorImpl(std::make_unique<CudaRawBackend>(index));
}

}  // namespace

void register_cuda_allocator() {
  register_device_allocator_factory(DeviceType::CUDA, &make_cuda_allocator, &make_cuda_pool_allocator);
}

}  // namespace mn::cuda
