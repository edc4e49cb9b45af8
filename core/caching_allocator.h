#pragma once
// The caching algorithm behind every DeviceAllocator, written once over a RawBackend (CPU: aligned
// memory; CUDA later: cudaMalloc/cudaFree + events). PyTorch's constants and semantics: requests
// rounded to 512 B, small pool (<= 1 MiB) carved from 2 MiB segments, 20 MiB segments for
// (1, 10) MiB, 2 MiB-rounded segments from 10 MiB up, best fit per stream with split and merge,
// cross-stream reuse gated on events, OOM -> release cache -> retry -> MemoryError.
// Backend authors: implement RawBackend, wrap it in CachingAllocatorImpl (or PassThroughAllocator),
// and register a factory with register_device_allocator_factory. Tests: tests/test_allocator.cpp.
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/device.h"

namespace mn {

inline constexpr size_t kMinBlockSize = 512;          // every request is a multiple of this
inline constexpr size_t kSmallSize = 1u << 20;        // requests up to here use the small pool
inline constexpr size_t kSmallBuffer = 2u << 20;      // small-pool segment size
inline constexpr size_t kMinLargeAlloc = 10u << 20;   // below this a large request gets kLargeBuffer
inline constexpr size_t kLargeBuffer = 20u << 20;     // segment for (1, 10) MiB requests
inline constexpr size_t kRoundLarge = 2u << 20;       // segments of >= 10 MiB requests round to this
inline constexpr size_t kMaxRequestBytes = size_t{1} << 60;  // larger requests fail before rounding

// Bytes a block of a `bytes` request occupies (a multiple of kMinBlockSize; 0 stays 0).
size_t round_allocation_size(size_t bytes);
// Bytes the raw backend is asked for when no cached block fits a request of `rounded` bytes.
size_t segment_size_for(size_t rounded);
inline bool uses_small_pool(size_t rounded) { return rounded <= kSmallSize; }

// "20971520 bytes (20.00 MiB)": exact for tests and scripts, readable for people.
std::string describe_bytes(int64_t bytes);

// Raw memory and stream ordering of one device. The allocator calls it with its own lock held, so a
// backend serving one allocator needs no locking of its own.
class RawBackend {
 public:
  virtual ~RawBackend() = default;
  // nullptr when the device (or the cap) has no room; other failures throw.
  virtual void* raw_alloc(size_t bytes) = 0;
  virtual void raw_free(void* ptr, size_t bytes) = 0;  // bytes: what raw_alloc was asked for
  // An event recorded on `stream` now; ready once the stream's earlier work has finished.
  virtual uint64_t record_event(StreamId stream) = 0;
  virtual bool event_ready(uint64_t event) = 0;
  virtual void event_synchronize(uint64_t event) = 0;
  virtual void release_event(uint64_t event) = 0;
  // 0 = no cap: raw_alloc fails when the bytes it holds plus the request would exceed the cap.
  virtual void set_memory_cap(size_t bytes) = 0;
  virtual size_t memory_cap() const = 0;
  virtual size_t total_capacity() const = 0;  // the device's memory, for error messages
  virtual std::string name() const = 0;       // "cpu", "cuda:0"
};

// 64-byte aligned std::aligned_alloc (sizes rounded to 64), one stream, events always ready.
std::unique_ptr<RawBackend> make_cpu_raw_backend();

// One contiguous piece of a segment. Allocation::block points at one of these.
struct CachedBlock;
struct CachedBlockOrder {  // (stream, size, address): lower_bound finds the best fit on a stream
  using is_transparent = void;
  struct Key {
    StreamId stream;
    size_t size;
  };
  bool operator()(const CachedBlock* a, const CachedBlock* b) const;
  bool operator()(const CachedBlock* a, const Key& b) const;
  bool operator()(const Key& a, const CachedBlock* b) const;
};
using BlockPool = std::set<CachedBlock*, CachedBlockOrder>;

struct CachedBlock {
  const void* owner = nullptr;  // the allocator that made it: rejects handles of other allocators
  void* ptr = nullptr;
  size_t size = 0;
  size_t requested_size = 0;
  StreamId stream = 0;
  BlockPool* pool = nullptr;
  CachedBlock* prev = nullptr;  // neighbours inside the same segment
  CachedBlock* next = nullptr;
  bool allocated = false;
  int pending_events = 0;               // freed, waiting for other streams to finish with it
  std::vector<StreamId> stream_uses;    // streams other than `stream` that used it (record_stream)
  bool is_split() const { return prev != nullptr || next != nullptr; }
};

// What tests and memory_summary can see of the cache, segment by segment in address order.
struct BlockSnapshot {
  size_t offset = 0;  // from the segment base
  size_t size = 0;
  size_t requested_size = 0;
  bool allocated = false;
  bool pending_events = false;
};
struct SegmentSnapshot {
  void* base = nullptr;
  size_t size = 0;
  StreamId stream = 0;
  bool small_pool = false;
  std::vector<BlockSnapshot> blocks;
};

class CachingAllocatorImpl final : public DeviceAllocator {
 public:
  explicit CachingAllocatorImpl(std::unique_ptr<RawBackend> backend);
  // Returns every segment to the backend; handles still alive dangle afterwards.
  ~CachingAllocatorImpl() override;
  CachingAllocatorImpl(const CachingAllocatorImpl&) = delete;
  CachingAllocatorImpl& operator=(const CachingAllocatorImpl&) = delete;

  Allocation allocate(size_t bytes, StreamId stream = 0) override;
  void free(const Allocation& a) override;
  void record_stream(const Allocation& a, StreamId stream) override;
  MemoryStats stats() const override;
  void reset_peak_stats() override;
  void empty_cache() override;
  void set_memory_cap(size_t bytes) override;
  size_t memory_cap() const override;

  std::vector<SegmentSnapshot> snapshot() const;
  RawBackend& backend() { return *backend_; }

 private:
  CachedBlock* checked_block(const Allocation& a, const char* caller) const;
  CachedBlock* take_best_fit(BlockPool& pool, StreamId stream, size_t size);
  CachedBlock* new_segment(BlockPool& pool, StreamId stream, size_t segment_bytes);
  CachedBlock* reserve_or_throw(BlockPool& pool, StreamId stream, size_t rounded, size_t requested);
  void split_off_remainder(CachedBlock* block, size_t size);
  void free_block(CachedBlock* block);
  void merge_next_into(CachedBlock* block);
  void record_use_events(CachedBlock* block);
  void process_events();
  void synchronize_events();
  void release_cached_segments();
  void release_segment(CachedBlock* head);
  void pool_insert(CachedBlock* block);
  void pool_erase(CachedBlock* block);
  CachedBlock* new_block();
  void recycle_block(CachedBlock* block);
  [[noreturn]] void throw_out_of_memory(size_t requested, size_t rounded, size_t segment_bytes,
                                        StreamId stream);

  struct PendingEvent {
    uint64_t event;
    CachedBlock* block;
  };

  mutable std::mutex mutex_;
  std::unique_ptr<RawBackend> backend_;
  BlockPool small_pool_;
  BlockPool large_pool_;
  BlockPool::node_type spare_node_;         // keeps the steady state free of set-node mallocs
  std::set<CachedBlock*> segment_heads_;    // first block of every segment; heads never move
  std::deque<CachedBlock> block_storage_;   // stable addresses; blocks are recycled, never freed
  std::vector<CachedBlock*> spare_blocks_;
  std::map<StreamId, std::deque<PendingEvent>> pending_by_stream_;  // each queue completes in order
  size_t pending_count_ = 0;
  MemoryStats stats_;
};

// MN_NO_CACHING=1: every allocation is its own raw allocation, freed at once (sanitizers see every
// use-after-free). Stats differ from the caching allocator only where caching is the point:
// allocated/requested/active/allocation count as there (sizes still rounded to 512 B);
// reserved == allocated and segment == allocation; inactive_split stays 0; empty_cache frees
// nothing; there is no retry, a failing raw allocation is an OOM at once; free waits (event
// synchronize) for streams recorded with record_stream.
class PassThroughAllocator final : public DeviceAllocator {
 public:
  explicit PassThroughAllocator(std::unique_ptr<RawBackend> backend);
  Allocation allocate(size_t bytes, StreamId stream = 0) override;
  void free(const Allocation& a) override;
  void record_stream(const Allocation& a, StreamId stream) override;
  MemoryStats stats() const override;
  void reset_peak_stats() override;
  void empty_cache() override {}
  void set_memory_cap(size_t bytes) override;
  size_t memory_cap() const override;

 private:
  struct Record;
  Record* checked_record(const Allocation& a, const char* caller) const;

  mutable std::mutex mutex_;
  std::unique_ptr<RawBackend> backend_;
  MemoryStats stats_;
};

// CUDA (or any other non-CPU device type) plugs in here. The factory is called once per device index,
// on first use, and returns an allocator that lives for the rest of the process, or nullptr when the
// device does not exist. Registering again (nullptr included) forgets allocators already created.
// pool_factory makes the private pools of capture graphs (core/capture.h, owned by the caller): they
// must keep the blocks freed into them, so it returns a caching allocator even when `factory` does
// not (MN_NO_CACHING); null means `factory` serves pools too.
using DeviceAllocatorFactory = DeviceAllocator* (*)(int index);
void register_device_allocator_factory(DeviceType type, DeviceAllocatorFactory factory,
                                       DeviceAllocatorFactory pool_factory = nullptr);
inline constexpr int kMaxDevicesPerType = 64;

// The device backends register their factories from a layer above core (kernels), which installs its
// registration here (kernels/dispatch.cpp): allocator_for runs it before a non-CPU device's first
// allocator when no factory was registered yet. Without it such a device has no allocator.
void set_backend_registration(void (*register_backends)());

// False when MN_NO_CACHING turned caching off for this device's allocator.
bool caching_enabled(Device d = kCPU);

}  // namespace mn
