// The caching algorithm (see core/caching_allocator.h) and the pass-through allocator of
// MN_NO_CACHING. Invariants the code leans on:
//  * a block is in exactly one of: its pool (free), the caller's hands (allocated), an event queue
//    (freed, waiting on other streams);
//  * merging keeps the lower block, so a segment's first block (its head) is the same object for the
//    segment's whole life and segment_heads_ never needs updating after a merge;
//  * every statistic changes at the same point PyTorch changes it (allocated at free time, active
//    when the block is reusable again).
#include "core/caching_allocator.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iterator>

#include "core/error.h"

namespace mn {

namespace {

void adjust(Stat& stat, int64_t delta) {
  if (delta > 0) stat.increase(delta);
  if (delta < 0) stat.decrease(-delta);
}

size_t round_up(size_t value, size_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// Allocation::block of both allocators starts with the owning allocator's address; reading it as
// bytes works whichever allocator made the handle.
const void* owner_of(const void* block) {
  const void* owner = nullptr;
  std::memcpy(&owner, block, sizeof owner);
  return owner;
}

std::string out_of_memory_message(const RawBackend& backend, const MemoryStats& stats,
                                  size_t requested, size_t rounded, size_t segment_bytes,
                                  StreamId stream) {
  const int64_t allocated = stats.allocated_bytes.current;
  const int64_t reserved = stats.reserved_bytes.current;
  const size_t cap = backend.memory_cap();
  return str("out of memory on ", backend.name(), ": tried to allocate ",
             describe_bytes(static_cast<int64_t>(requested)), " (block ",
             describe_bytes(static_cast<int64_t>(rounded)), ", new segment ",
             describe_bytes(static_cast<int64_t>(segment_bytes)), ") on stream ", stream,
             "; device capacity ", describe_bytes(static_cast<int64_t>(backend.total_capacity())),
             ", memory cap ", cap ? describe_bytes(static_cast<int64_t>(cap)) : std::string("none"),
             "; allocated ", describe_bytes(allocated), ", reserved ", describe_bytes(reserved),
             ", reserved but unallocated ", describe_bytes(reserved - allocated),
             ". Free tensors, use smaller batches, or raise the cap (set_memory_cap).");
}

}  // namespace

size_t round_allocation_size(size_t bytes) { return round_up(bytes, kMinBlockSize); }

size_t segment_size_for(size_t rounded) {
  if (uses_small_pool(rounded)) return kSmallBuffer;
  if (rounded < kMinLargeAlloc) return kLargeBuffer;
  return round_up(rounded, kRoundLarge);
}

std::string describe_bytes(int64_t bytes) {
  static const char* const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double scaled = static_cast<double>(bytes < 0 ? -bytes : bytes);
  int unit = 0;
  while (scaled >= 1024.0 && unit < 4) {
    scaled /= 1024.0;
    ++unit;
  }
  char readable[48];
  if (unit == 0) {
    std::snprintf(readable, sizeof readable, "%lld B", static_cast<long long>(bytes));
  } else {
    std::snprintf(readable, sizeof readable, "%s%.2f %s", bytes < 0 ? "-" : "", scaled, units[unit]);
  }
  return str(bytes, " bytes (", readable, ")");
}

bool CachedBlockOrder::operator()(const CachedBlock* a, const CachedBlock* b) const {
  if (a->stream != b->stream) return a->stream < b->stream;
  if (a->size != b->size) return a->size < b->size;
  return reinterpret_cast<uintptr_t>(a->ptr) < reinterpret_cast<uintptr_t>(b->ptr);
}
// A Key sorts before every block of its stream and size (as if its address were lowest).
bool CachedBlockOrder::operator()(const CachedBlock* a, const Key& b) const {
  if (a->stream != b.stream) return a->stream < b.stream;
  return a->size < b.size;
}
bool CachedBlockOrder::operator()(const Key& a, const CachedBlock* b) const {
  if (a.stream != b->stream) return a.stream < b->stream;
  return a.size <= b->size;
}

// ---- CachingAllocatorImpl ----------------------------------------------------------------------

CachingAllocatorImpl::CachingAllocatorImpl(std::unique_ptr<RawBackend> backend)
    : backend_(std::move(backend)) {
  MN_CHECK(backend_ != nullptr, ValueError, "CachingAllocatorImpl: expected a raw backend, got null");
}

CachingAllocatorImpl::~CachingAllocatorImpl() {
  for (auto& [stream, queue] : pending_by_stream_)
    for (const PendingEvent& pending : queue) backend_->release_event(pending.event);
  for (CachedBlock* head : segment_heads_) {
    size_t segment_bytes = 0;
    for (CachedBlock* b = head; b != nullptr; b = b->next) segment_bytes += b->size;
    try {  // a destructor must not throw: cudaFree fails after a sticky error or at process exit
      backend_->raw_free(head->ptr, segment_bytes);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "warning: %s allocator: releasing a segment failed: %s\n", backend_->name().c_str(),
                   e.what());
    }
  }
}

Allocation CachingAllocatorImpl::allocate(size_t bytes, StreamId stream) {
  if (bytes == 0) return {};
  std::lock_guard<std::mutex> lock(mutex_);
  if (bytes > kMaxRequestBytes) {
    ++stats_.num_ooms;
    throw MemoryError(out_of_memory_message(*backend_, stats_, bytes, bytes, bytes, stream));
  }
  process_events();
  const size_t rounded = round_allocation_size(bytes);
  BlockPool& pool = uses_small_pool(rounded) ? small_pool_ : large_pool_;
  CachedBlock* block = take_best_fit(pool, stream, rounded);
  if (block == nullptr) block = reserve_or_throw(pool, stream, rounded, bytes);

  // A free piece of a split segment counted as inactive_split; it stops counting once handed out,
  // and a remainder split off now starts counting.
  int64_t inactive_split_delta = block->is_split() ? -static_cast<int64_t>(block->size) : 0;
  const size_t remaining = block->size - rounded;
  const bool split = &pool == &small_pool_ ? remaining >= kMinBlockSize : remaining > kSmallSize;
  if (split) {
    split_off_remainder(block, rounded);
    inactive_split_delta += static_cast<int64_t>(remaining);
  }
  block->allocated = true;
  block->requested_size = bytes;
  const auto size = static_cast<int64_t>(block->size);
  stats_.allocation.increase(1);
  stats_.allocated_bytes.increase(size);
  stats_.active_bytes.increase(size);
  stats_.requested_bytes.increase(static_cast<int64_t>(bytes));
  adjust(stats_.inactive_split_bytes, inactive_split_delta);
  return {block->ptr, block};
}

void CachingAllocatorImpl::free(const Allocation& a) {
  if (a.ptr == nullptr && a.block == nullptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  CachedBlock* block = checked_block(a, "free");
  block->allocated = false;
  stats_.allocation.decrease(1);
  stats_.allocated_bytes.decrease(static_cast<int64_t>(block->size));
  stats_.requested_bytes.decrease(static_cast<int64_t>(block->requested_size));
  if (block->stream_uses.empty()) {
    free_block(block);
  } else {
    record_use_events(block);
  }
}

void CachingAllocatorImpl::record_stream(const Allocation& a, StreamId stream) {
  if (a.ptr == nullptr && a.block == nullptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  CachedBlock* block = checked_block(a, "record_stream");
  if (stream == block->stream) return;  // the allocation stream is ordered already
  auto& uses = block->stream_uses;
  if (std::find(uses.begin(), uses.end(), stream) == uses.end()) uses.push_back(stream);
}

MemoryStats CachingAllocatorImpl::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void CachingAllocatorImpl::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (Stat* stat : {&stats_.allocated_bytes, &stats_.reserved_bytes, &stats_.active_bytes,
                     &stats_.requested_bytes, &stats_.inactive_split_bytes, &stats_.allocation,
                     &stats_.segment})
    stat->reset_peak();
}

void CachingAllocatorImpl::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  release_cached_segments();
}

void CachingAllocatorImpl::set_memory_cap(size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  backend_->set_memory_cap(bytes);
}

size_t CachingAllocatorImpl::memory_cap() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return backend_->memory_cap();
}

std::vector<SegmentSnapshot> CachingAllocatorImpl::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<SegmentSnapshot> segments;
  for (const CachedBlock* head : segment_heads_) {
    SegmentSnapshot segment;
    segment.base = head->ptr;
    segment.stream = head->stream;
    segment.small_pool = head->pool == &small_pool_;
    for (const CachedBlock* b = head; b != nullptr; b = b->next) {
      segment.blocks.push_back({segment.size, b->size, b->allocated ? b->requested_size : 0,
                                b->allocated, b->pending_events > 0});
      segment.size += b->size;
    }
    segments.push_back(std::move(segment));
  }
  std::sort(segments.begin(), segments.end(), [](const auto& x, const auto& y) {
    return reinterpret_cast<uintptr_t>(x.base) < reinterpret_cast<uintptr_t>(y.base);
  });
  return segments;
}

// Reading the block is only safe for handles some allocator made (the free path must not search a
// table); what it does catch: handles of other allocators, double frees, ptr/block mismatches.
CachedBlock* CachingAllocatorImpl::checked_block(const Allocation& a, const char* caller) const {
  MN_CHECK(a.block != nullptr, RuntimeError, caller, ": expected an Allocation made by the ",
           backend_->name(), " caching allocator, got ptr=", a.ptr, " with a null block");
  MN_CHECK(owner_of(a.block) == this, RuntimeError, caller, ": the Allocation {ptr=", a.ptr,
           "} was made by another allocator, not the ", backend_->name(), " caching allocator");
  auto* block = static_cast<CachedBlock*>(a.block);
  MN_CHECK(block->allocated && block->ptr == a.ptr, RuntimeError, caller, ": expected a live ",
           "allocation, got ptr=", a.ptr, " whose block is ",
           block->allocated ? "live at another address" : "not allocated (freed twice?)");
  return block;
}

CachedBlock* CachingAllocatorImpl::take_best_fit(BlockPool& pool, StreamId stream, size_t size) {
  auto it = pool.lower_bound(CachedBlockOrder::Key{stream, size});
  if (it == pool.end() || (*it)->stream != stream) return nullptr;
  CachedBlock* block = *it;
  auto node = pool.extract(it);
  if (spare_node_.empty()) spare_node_ = std::move(node);
  return block;
}

CachedBlock* CachingAllocatorImpl::new_segment(BlockPool& pool, StreamId stream,
                                               size_t segment_bytes) {
  void* ptr = backend_->raw_alloc(segment_bytes);
  if (ptr == nullptr) return nullptr;
  CachedBlock* block = new_block();
  block->ptr = ptr;
  block->size = segment_bytes;
  block->stream = stream;
  block->pool = &pool;
  segment_heads_.insert(block);
  stats_.segment.increase(1);
  stats_.reserved_bytes.increase(static_cast<int64_t>(segment_bytes));
  ++stats_.num_raw_allocs;
  return block;
}

// Nothing cached fits: ask the backend; when it refuses, release the cache (which also completes
// pending events, so a waiting block may now fit) and try once more before giving up.
CachedBlock* CachingAllocatorImpl::reserve_or_throw(BlockPool& pool, StreamId stream,
                                                    size_t rounded, size_t requested) {
  const size_t segment_bytes = segment_size_for(rounded);
  if (CachedBlock* block = new_segment(pool, stream, segment_bytes)) return block;
  release_cached_segments();
  ++stats_.num_alloc_retries;
  if (CachedBlock* block = take_best_fit(pool, stream, rounded)) return block;
  if (CachedBlock* block = new_segment(pool, stream, segment_bytes)) return block;
  ++stats_.num_ooms;
  throw MemoryError(
      out_of_memory_message(*backend_, stats_, requested, rounded, segment_bytes, stream));
}

void CachingAllocatorImpl::split_off_remainder(CachedBlock* block, size_t size) {
  CachedBlock* rest = new_block();
  rest->ptr = static_cast<char*>(block->ptr) + size;
  rest->size = block->size - size;
  rest->stream = block->stream;
  rest->pool = block->pool;
  rest->prev = block;
  rest->next = block->next;
  if (rest->next != nullptr) rest->next->prev = rest;
  block->next = rest;
  block->size = size;
  pool_insert(rest);
}

// The block becomes reusable: merge it with free neighbours and put the result back in its pool.
void CachingAllocatorImpl::free_block(CachedBlock* block) {
  stats_.active_bytes.decrease(static_cast<int64_t>(block->size));
  auto is_free = [](const CachedBlock* b) {
    return b != nullptr && !b->allocated && b->pending_events == 0;
  };
  int64_t inactive_split_delta = 0;
  if (is_free(block->prev)) {
    CachedBlock* prev = block->prev;
    inactive_split_delta -= static_cast<int64_t>(prev->size);
    pool_erase(prev);
    merge_next_into(prev);
    block = prev;
  }
  if (is_free(block->next)) {
    inactive_split_delta -= static_cast<int64_t>(block->next->size);
    pool_erase(block->next);
    merge_next_into(block);
  }
  if (block->is_split()) inactive_split_delta += static_cast<int64_t>(block->size);
  pool_insert(block);
  adjust(stats_.inactive_split_bytes, inactive_split_delta);
}

void CachingAllocatorImpl::merge_next_into(CachedBlock* block) {
  CachedBlock* next = block->next;
  block->size += next->size;
  block->next = next->next;
  if (block->next != nullptr) block->next->prev = block;
  recycle_block(next);
}

void CachingAllocatorImpl::record_use_events(CachedBlock* block) {
  for (StreamId stream : block->stream_uses) {
    pending_by_stream_[stream].push_back({backend_->record_event(stream), block});
    ++block->pending_events;
    ++pending_count_;
  }
  block->stream_uses.clear();
}

void CachingAllocatorImpl::process_events() {
  if (pending_count_ == 0) return;
  for (auto it = pending_by_stream_.begin(); it != pending_by_stream_.end();) {
    auto& queue = it->second;
    while (!queue.empty() && backend_->event_ready(queue.front().event)) {
      const PendingEvent done = queue.front();
      queue.pop_front();
      backend_->release_event(done.event);
      --pending_count_;
      if (--done.block->pending_events == 0) free_block(done.block);
    }
    it = queue.empty() ? pending_by_stream_.erase(it) : std::next(it);
  }
}

void CachingAllocatorImpl::synchronize_events() {
  ++stats_.num_sync_all_streams;
  for (auto& [stream, queue] : pending_by_stream_) {
    for (const PendingEvent& pending : queue) {
      backend_->event_synchronize(pending.event);
      backend_->release_event(pending.event);
      --pending_count_;
      if (--pending.block->pending_events == 0) free_block(pending.block);
    }
  }
  pending_by_stream_.clear();
}

// Only whole cached segments go back: a split segment has live pieces (or had, and will merge back
// into one block once they are freed).
void CachingAllocatorImpl::release_cached_segments() {
  synchronize_events();
  for (BlockPool* pool : {&small_pool_, &large_pool_}) {
    for (auto it = pool->begin(); it != pool->end();) {
      CachedBlock* block = *it;
      if (block->is_split()) {
        ++it;
        continue;
      }
      it = pool->erase(it);
      release_segment(block);
    }
  }
}

void CachingAllocatorImpl::release_segment(CachedBlock* head) {
  backend_->raw_free(head->ptr, head->size);
  segment_heads_.erase(head);
  stats_.segment.decrease(1);
  stats_.reserved_bytes.decrease(static_cast<int64_t>(head->size));
  ++stats_.num_raw_frees;
  recycle_block(head);
}

// Pool nodes are recycled through spare_node_: a cached alloc+free splits and merges without
// touching malloc.
void CachingAllocatorImpl::pool_insert(CachedBlock* block) {
  if (spare_node_.empty()) {
    block->pool->insert(block);
    return;
  }
  spare_node_.value() = block;
  block->pool->insert(std::move(spare_node_));
}

void CachingAllocatorImpl::pool_erase(CachedBlock* block) {
  auto node = block->pool->extract(block);
  if (spare_node_.empty()) spare_node_ = std::move(node);
}

CachedBlock* CachingAllocatorImpl::new_block() {
  if (spare_blocks_.empty()) {
    CachedBlock& block = block_storage_.emplace_back();
    block.owner = this;
    return &block;
  }
  CachedBlock* block = spare_blocks_.back();
  spare_blocks_.pop_back();
  block->size = block->requested_size = 0;
  block->stream = 0;
  block->pool = nullptr;
  block->prev = block->next = nullptr;
  block->pending_events = 0;
  block->stream_uses.clear();
  return block;
}

void CachingAllocatorImpl::recycle_block(CachedBlock* block) {
  block->allocated = false;  // a stale handle to it now fails checked_block
  block->ptr = nullptr;
  spare_blocks_.push_back(block);
}

// ---- PassThroughAllocator ----------------------------------------------------------------------

struct PassThroughAllocator::Record {
  const void* owner;  // first, like CachedBlock::owner
  void* ptr;
  size_t size;
  size_t requested_size;
  std::vector<StreamId> stream_uses;
};

PassThroughAllocator::PassThroughAllocator(std::unique_ptr<RawBackend> backend)
    : backend_(std::move(backend)) {
  MN_CHECK(backend_ != nullptr, ValueError, "PassThroughAllocator: expected a raw backend, got null");
}

Allocation PassThroughAllocator::allocate(size_t bytes, StreamId stream) {
  if (bytes == 0) return {};
  std::lock_guard<std::mutex> lock(mutex_);
  // Statistics count the rounded size, as the caching allocator would; the memory itself is exactly
  // `bytes`, so a sanitizer (the reason to turn caching off) reports an access one byte past a tensor.
  const size_t rounded = bytes > kMaxRequestBytes ? bytes : round_allocation_size(bytes);
  void* ptr = bytes > kMaxRequestBytes ? nullptr : backend_->raw_alloc(bytes);
  if (ptr == nullptr) {
    ++stats_.num_ooms;
    throw MemoryError(out_of_memory_message(*backend_, stats_, bytes, rounded, rounded, stream));
  }
  auto* record = new Record{this, ptr, rounded, bytes, {}};
  const auto size = static_cast<int64_t>(rounded);
  stats_.allocation.increase(1);
  stats_.segment.increase(1);
  stats_.allocated_bytes.increase(size);
  stats_.reserved_bytes.increase(size);
  stats_.active_bytes.increase(size);
  stats_.requested_bytes.increase(static_cast<int64_t>(bytes));
  ++stats_.num_raw_allocs;
  return {ptr, record};
}

void PassThroughAllocator::free(const Allocation& a) {
  if (a.ptr == nullptr && a.block == nullptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  Record* record = checked_record(a, "free");
  for (StreamId stream : record->stream_uses) {  // nothing caches the memory: wait for users now
    const uint64_t event = backend_->record_event(stream);
    backend_->event_synchronize(event);
    backend_->release_event(event);
  }
  backend_->raw_free(record->ptr, record->requested_size);
  const auto size = static_cast<int64_t>(record->size);
  stats_.allocation.decrease(1);
  stats_.segment.decrease(1);
  stats_.allocated_bytes.decrease(size);
  stats_.reserved_bytes.decrease(size);
  stats_.active_bytes.decrease(size);
  stats_.requested_bytes.decrease(static_cast<int64_t>(record->requested_size));
  ++stats_.num_raw_frees;
  delete record;
}

void PassThroughAllocator::record_stream(const Allocation& a, StreamId stream) {
  if (a.ptr == nullptr && a.block == nullptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto& uses = checked_record(a, "record_stream")->stream_uses;
  if (std::find(uses.begin(), uses.end(), stream) == uses.end()) uses.push_back(stream);
}

MemoryStats PassThroughAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void PassThroughAllocator::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (Stat* stat : {&stats_.allocated_bytes, &stats_.reserved_bytes, &stats_.active_bytes,
                     &stats_.requested_bytes, &stats_.inactive_split_bytes, &stats_.allocation,
                     &stats_.segment})
    stat->reset_peak();
}

void PassThroughAllocator::set_memory_cap(size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  backend_->set_memory_cap(bytes);
}

size_t PassThroughAllocator::memory_cap() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return backend_->memory_cap();
}

PassThroughAllocator::Record* PassThroughAllocator::checked_record(const Allocation& a,
                                                                   const char* caller) const {
  MN_CHECK(a.block != nullptr, RuntimeError, caller, ": expected an Allocation made by the ",
           backend_->name(), " pass-through allocator, got ptr=", a.ptr, " with a null block");
  MN_CHECK(owner_of(a.block) == this, RuntimeError, caller, ": the Allocation {ptr=", a.ptr,
           "} was made by another allocator, not the ", backend_->name(), " pass-through allocator");
  auto* record = static_cast<Record*>(a.block);
  MN_CHECK(record->ptr == a.ptr, RuntimeError, caller, ": expected ptr=", record->ptr,
           " for this handle, got ptr=", a.ptr);
  return record;
}

}  // namespace mn
