#pragma once
// Storage: one allocation from a device's caching allocator, shared by a tensor and all its views.
// The version counter lives here so that every view of the same memory sees in-place changes.
#include <atomic>
#include <cstddef>
#include <memory>

#include "core/allocator.h"
#include "core/device.h"

namespace mn {

class Storage {
 public:
  // Memory from the device's allocator, or from the active capture's private pool (core/capture.h).
  Storage(size_t nbytes, Device device);
  // Memory owned by someone else (a capture graph's pool), never freed through this object.
  struct Borrowed {};
  Storage(Borrowed, void* ptr, size_t nbytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return alloc_.ptr; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  const Allocation& allocation() const { return alloc_; }
  // The allocator this memory goes back to (null for borrowed memory).
  const DeviceAllocator* allocator() const { return allocator_; }
  // Tells the owning allocator that `stream` uses this memory too (core/cuda.h record_stream).
  void record_stream(StreamId stream) {
    if (allocator_ != nullptr) allocator_->record_stream(alloc_, stream);
  }

  uint32_t version() const { return version_.load(std::memory_order_relaxed); }
  void bump_version() { version_.fetch_add(1, std::memory_order_relaxed); }

 private:
  Allocation alloc_;
  size_t nbytes_;
  Device device_;
  DeviceAllocator* allocator_;
  std::shared_ptr<DeviceAllocator> pool_;  // keeps a capture pool alive while its memory is in use
  std::atomic<uint32_t> version_{0};
};

}  // namespace mn
