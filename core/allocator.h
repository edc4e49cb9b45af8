#pragma once
// Caching allocator: one algorithm (PyTorch's: 512 B rounding, small pool <= 1 MiB carved from 2 MiB
// segments, 20 MiB segments for 1-10 MiB requests, 2 MiB-rounded segments above, best fit with split
// and merge, stream-owned blocks) over a raw backend. The CPU backend is 64-byte aligned memory; a
// CUDA backend (cudaMalloc/cudaFree + events) plugs into the same algorithm. Every tensor allocation
// goes through here. MN_NO_CACHING=1 in the environment forwards straight to the raw backend (for
// sanitizer runs).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/device.h"

namespace mn {

// One counter in PyTorch's vocabulary: current value and its peak since the last reset.
struct Stat {
  int64_t current = 0;
  int64_t peak = 0;
  int64_t allocated = 0;  // cumulative increases
  int64_t freed = 0;      // cumulative decreases
  void increase(int64_t n) {
    current += n;
    allocated += n;
    if (current > peak) peak = current;
  }
  void decrease(int64_t n) {
    current -= n;
    freed += n;
  }
  void reset_peak() { peak = current; }
};

struct MemoryStats {
  Stat allocated_bytes;       // rounded sizes of blocks handed out
  Stat reserved_bytes;        // bytes obtained from the raw backend (segments)
  Stat active_bytes;          // allocated + blocks freed but waiting on other streams
  Stat requested_bytes;       // exact sizes callers asked for
  Stat inactive_split_bytes;  // free pieces of split segments (cannot be released by empty_cache)
  Stat allocation;            // number of live blocks handed out
  Stat segment;               // number of segments held
  int64_t num_alloc_retries = 0;   // raw allocation failed, cache freed, retried
  int64_t num_ooms = 0;            // gave up and threw MemoryError
  int64_t num_raw_allocs = 0;      // calls into the raw backend
  int64_t num_raw_frees = 0;
  int64_t num_sync_all_streams = 0;
};

// Opaque handle of one allocation; free with the same allocator. ptr == nullptr for 0 bytes.
struct Allocation {
  void* ptr = nullptr;
  void* block = nullptr;  // allocator-private; nullptr for zero-byte allocations
};

using StreamId = uint64_t;  // 0 = the default (CPU: the only) stream

class DeviceAllocator {
 public:
  virtual ~DeviceAllocator() = default;
  virtual Allocation allocate(size_t bytes, StreamId stream = 0) = 0;
  virtual void free(const Allocation& a) = 0;
  // A block used on another stream must not be reused until that stream's work is done.
  virtual void record_stream(const Allocation& a, StreamId stream) = 0;
  virtual MemoryStats stats() const = 0;
  virtual void reset_peak_stats() = 0;
  virtual void empty_cache() = 0;
  // Byte cap on the raw backend (0 = unlimited): makes the out-of-memory path testable on CPU.
  virtual void set_memory_cap(size_t bytes) = 0;
  virtual size_t memory_cap() const = 0;
};

// The process-wide allocator of a device (created on first use, intentionally never destroyed).
DeviceAllocator& allocator_for(Device d);

// A new allocator for `d` with the same algorithm as allocator_for(d), owned by the caller (the private
// pools of capture graphs, core/capture.h). It releases its memory when destroyed.
std::shared_ptr<DeviceAllocator> make_private_allocator(Device d);

// Public per-device API.
MemoryStats memory_stats(Device d = kCPU);
void reset_peak_memory_stats(Device d = kCPU);
void empty_cache(Device d = kCPU);
void set_memory_cap(size_t bytes, Device d = kCPU);
std::string memory_summary(Device d = kCPU);

}  // namespace mn
