// The caching algorithm over a fake raw backend (fake addresses, a byte cap, call counters and
// events that fire when the test says so), plus the real CPU allocator and the device registry.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/allocator.h"
#include "core/caching_allocator.h"
#include "core/error.h"

namespace {

using namespace mn;

constexpr size_t KiB = size_t{1} << 10;
constexpr size_t MiB = size_t{1} << 20;

// Hands out addresses nobody dereferences, with gaps so that segments are never adjacent.
class FakeBackend final : public RawBackend {
 public:
  explicit FakeBackend(size_t capacity = size_t{1} << 40) : capacity_(capacity) {}

  void* raw_alloc(size_t bytes) override {
    ++alloc_calls;
    const size_t limit = cap_ != 0 && cap_ < capacity_ ? cap_ : capacity_;
    if (held + bytes > limit) {
      ++failed_allocs;
      return nullptr;
    }
    void* ptr = reinterpret_cast<void*>(next_address_);
    next_address_ += bytes + 64 * MiB;
    live[ptr] = bytes;
    held += bytes;
    last_alloc_bytes = bytes;
    return ptr;
  }
  void raw_free(void* ptr, size_t bytes) override {
    ++free_calls;
    auto it = live.find(ptr);
    if (it == live.end() || it->second != bytes) {
      ++bad_frees;
      return;
    }
    held -= bytes;
    live.erase(it);
  }
  uint64_t record_event(StreamId) override {
    ++events_recorded;
    ready[next_event_] = false;
    return next_event_++;
  }
  bool event_ready(uint64_t event) override { return ready.at(event); }
  void event_synchronize(uint64_t event) override {
    ++event_syncs;
    ready.at(event) = true;
  }
  void release_event(uint64_t event) override {
    ++events_released;
    ready.erase(event);
  }
  void set_memory_cap(size_t bytes) override { cap_ = bytes; }
  size_t memory_cap() const override { return cap_; }
  size_t total_capacity() const override { return capacity_; }
  std::string name() const override { return "fake"; }

  void fire_all_events() {
    for (auto& [event, is_ready] : ready) is_ready = true;
  }

  int alloc_calls = 0, failed_allocs = 0, free_calls = 0, bad_frees = 0;
  int events_recorded = 0, events_released = 0, event_syncs = 0;
  size_t held = 0, last_alloc_bytes = 0;
  std::map<void*, size_t> live;
  std::map<uint64_t, bool> ready;

 private:
  size_t capacity_;
  size_t cap_ = 0;
  uintptr_t next_address_ = uintptr_t{1} << 32;
  uint64_t next_event_ = 1;
};

struct Harness {
  explicit Harness(size_t capacity = size_t{1} << 40) : fake(new FakeBackend(capacity)) {}
  FakeBackend* fake;  // owned by alloc
  CachingAllocatorImpl alloc{std::unique_ptr<RawBackend>(fake)};
};

char* bytes_of(const Allocation& a) { return static_cast<char*>(a.ptr); }

}  // namespace

TEST_CASE("allocator: rounding table") {
  CHECK(round_allocation_size(1) == 512);
  CHECK(round_allocation_size(512) == 512);
  CHECK(round_allocation_size(513) == 1024);
  CHECK(round_allocation_size(MiB) == MiB);
  CHECK(uses_small_pool(MiB));
  CHECK(segment_size_for(MiB) == 2 * MiB);
  CHECK(round_allocation_size(MiB + 1) == MiB + 512);
  CHECK_FALSE(uses_small_pool(MiB + 512));
  CHECK(segment_size_for(MiB + 512) == 20 * MiB);
  CHECK(segment_size_for(round_allocation_size(10 * MiB - 513)) == 20 * MiB);
  CHECK(segment_size_for(round_allocation_size(10 * MiB)) == 10 * MiB);
  CHECK(segment_size_for(round_allocation_size(11 * MiB + 1)) == 12 * MiB);

  struct Row {
    size_t request, segment, block;
  };
  // 11 MiB+1 leaves < 1 MiB of its 12 MiB segment, too little to split: the block keeps it all.
  const Row rows[] = {{1, 2 * MiB, 512},           {MiB, 2 * MiB, MiB},
                      {MiB + 1, 20 * MiB, MiB + 512}, {10 * MiB, 10 * MiB, 10 * MiB},
                      {11 * MiB + 1, 12 * MiB, 12 * MiB}};
  for (const Row& row : rows) {
    CAPTURE(row.request);
    Harness h;
    Allocation a = h.alloc.allocate(row.request);
    CHECK(h.fake->last_alloc_bytes == row.segment);
    const MemoryStats s = h.alloc.stats();
    CHECK(s.allocated_bytes.current == static_cast<int64_t>(row.block));
    CHECK(s.requested_bytes.current == static_cast<int64_t>(row.request));
    CHECK(s.reserved_bytes.current == static_cast<int64_t>(row.segment));
    h.alloc.free(a);
  }
}

TEST_CASE("allocator: split then merge restores one block") {
  Harness h;
  Allocation a = h.alloc.allocate(1000);
  Allocation b = h.alloc.allocate(4096);
  Allocation c = h.alloc.allocate(700 * KiB);
  CHECK(bytes_of(b) == bytes_of(a) + 1024);
  CHECK(bytes_of(c) == bytes_of(b) + 4096);
  auto segments = h.alloc.snapshot();
  REQUIRE(segments.size() == 1);
  REQUIRE(segments[0].blocks.size() == 4);
  CHECK(segments[0].small_pool);
  CHECK(segments[0].size == 2 * MiB);
  CHECK_FALSE(segments[0].blocks[3].allocated);

  h.alloc.free(b);
  CHECK(h.alloc.snapshot()[0].blocks.size() == 4);  // b's neighbours are live: nothing to merge
  CHECK(h.alloc.stats().inactive_split_bytes.current ==
        static_cast<int64_t>(4096 + 2 * MiB - 1024 - 4096 - 700 * KiB));
  h.alloc.free(a);
  CHECK(h.alloc.snapshot()[0].blocks.size() == 3);
  h.alloc.free(c);
  segments = h.alloc.snapshot();
  REQUIRE(segments[0].blocks.size() == 1);
  CHECK(segments[0].blocks[0].size == 2 * MiB);
  CHECK_FALSE(segments[0].blocks[0].allocated);
  CHECK(h.alloc.stats().inactive_split_bytes.current == 0);

  Allocation whole = h.alloc.allocate(MiB);  // the merged block is whole again
  CHECK(whole.ptr == a.ptr);
  CHECK(h.fake->alloc_calls == 1);
  h.alloc.free(whole);
}

TEST_CASE("allocator: best fit picks the smallest free block that fits") {
  Harness h;
  Allocation x4k = h.alloc.allocate(4096), guard1 = h.alloc.allocate(512);
  Allocation x2k = h.alloc.allocate(2048), guard2 = h.alloc.allocate(512);
  Allocation x8k = h.alloc.allocate(8192), guard3 = h.alloc.allocate(512);
  h.alloc.free(x4k);
  h.alloc.free(x2k);
  h.alloc.free(x8k);
  // Free now: 4 KiB, 2 KiB, 8 KiB and the large tail of the segment.
  Allocation fits_2k = h.alloc.allocate(1500);
  Allocation fits_4k = h.alloc.allocate(3000);
  Allocation fits_8k = h.alloc.allocate(5000);
  CHECK(fits_2k.ptr == x2k.ptr);
  CHECK(fits_4k.ptr == x4k.ptr);
  CHECK(fits_8k.ptr == x8k.ptr);
  CHECK(h.fake->alloc_calls == 1);
  for (const Allocation& a : {fits_2k, fits_4k, fits_8k, guard1, guard2, guard3}) h.alloc.free(a);
  CHECK(h.alloc.snapshot()[0].blocks.size() == 1);
}

TEST_CASE("allocator: small and large requests use separate pools") {
  Harness h;
  Allocation big = h.alloc.allocate(2 * MiB);
  h.alloc.free(big);  // a free 20 MiB large-pool segment
  Allocation small = h.alloc.allocate(512);
  CHECK(h.fake->alloc_calls == 2);  // small requests never carve large segments
  CHECK(h.fake->last_alloc_bytes == 2 * MiB);
  h.alloc.free(small);
  Allocation big_again = h.alloc.allocate(2 * MiB);
  Allocation largest_small = h.alloc.allocate(MiB);
  CHECK(big_again.ptr == big.ptr);
  CHECK(largest_small.ptr == small.ptr);
  CHECK(h.fake->alloc_calls == 2);
  const auto segments = h.alloc.snapshot();
  REQUIRE(segments.size() == 2);
  CHECK(segments[0].small_pool != segments[1].small_pool);
  h.alloc.free(big_again);
  h.alloc.free(largest_small);
}

TEST_CASE("allocator: a freed block is reused without a new raw allocation") {
  Harness h;
  for (size_t bytes : {size_t{4096}, 64 * MiB}) {
    CAPTURE(bytes);
    Allocation first = h.alloc.allocate(bytes);
    const int raw_calls = h.fake->alloc_calls;
    h.alloc.free(first);
    Allocation second = h.alloc.allocate(bytes);
    CHECK(second.ptr == first.ptr);
    CHECK(h.fake->alloc_calls == raw_calls);
    h.alloc.free(second);
  }
  CHECK(h.alloc.stats().num_raw_allocs == 2);
}

TEST_CASE("allocator: blocks belong to their allocation stream") {
  Harness h;
  Allocation on_1 = h.alloc.allocate(4096, 1);
  h.alloc.free(on_1);
  Allocation on_2 = h.alloc.allocate(4096, 2);
  CHECK(h.fake->alloc_calls == 2);
  Allocation on_1_again = h.alloc.allocate(4096, 1);
  CHECK(on_1_again.ptr == on_1.ptr);
  CHECK(h.fake->alloc_calls == 2);
  h.alloc.free(on_2);
  h.alloc.free(on_1_again);
}

TEST_CASE("allocator: stats follow PyTorch's vocabulary") {
  Harness h;
  Allocation a = h.alloc.allocate(1000);
  MemoryStats s = h.alloc.stats();
  CHECK(s.allocated_bytes.current == 1024);
  CHECK(s.requested_bytes.current == 1000);
  CHECK(s.active_bytes.current == 1024);
  CHECK(s.reserved_bytes.current == static_cast<int64_t>(2 * MiB));
  CHECK(s.inactive_split_bytes.current == static_cast<int64_t>(2 * MiB - 1024));
  CHECK(s.allocation.current == 1);
  CHECK(s.segment.current == 1);
  CHECK(s.num_raw_allocs == 1);

  Allocation b = h.alloc.allocate(3 * MiB);  // 20 MiB segment, 17 MiB split off
  s = h.alloc.stats();
  CHECK(s.allocated_bytes.current == static_cast<int64_t>(1024 + 3 * MiB));
  CHECK(s.requested_bytes.current == static_cast<int64_t>(1000 + 3 * MiB));
  CHECK(s.reserved_bytes.current == static_cast<int64_t>(22 * MiB));
  CHECK(s.inactive_split_bytes.current == static_cast<int64_t>(2 * MiB - 1024 + 17 * MiB));
  CHECK(s.allocation.current == 2);
  CHECK(s.segment.current == 2);

  h.alloc.free(a);
  s = h.alloc.stats();
  CHECK(s.allocated_bytes.current == static_cast<int64_t>(3 * MiB));
  CHECK(s.allocated_bytes.peak == static_cast<int64_t>(1024 + 3 * MiB));
  CHECK(s.allocated_bytes.freed == 1024);
  CHECK(s.requested_bytes.current == static_cast<int64_t>(3 * MiB));
  CHECK(s.requested_bytes.peak == static_cast<int64_t>(1000 + 3 * MiB));
  CHECK(s.active_bytes.current == static_cast<int64_t>(3 * MiB));
  CHECK(s.inactive_split_bytes.current == static_cast<int64_t>(17 * MiB));  // small segment whole
  CHECK(s.allocation.current == 1);
  CHECK(s.allocation.peak == 2);
  CHECK(s.allocation.allocated == 2);

  h.alloc.free(b);
  s = h.alloc.stats();
  CHECK(s.allocated_bytes.current == 0);
  CHECK(s.requested_bytes.current == 0);
  CHECK(s.active_bytes.current == 0);
  CHECK(s.inactive_split_bytes.current == 0);
  CHECK(s.reserved_bytes.current == static_cast<int64_t>(22 * MiB));  // cached, not returned

  h.alloc.empty_cache();
  s = h.alloc.stats();
  CHECK(s.reserved_bytes.current == 0);
  CHECK(s.reserved_bytes.peak == static_cast<int64_t>(22 * MiB));
  CHECK(s.segment.current == 0);
  CHECK(s.num_raw_frees == 2);
  CHECK(h.fake->live.empty());
  CHECK(h.fake->bad_frees == 0);
}

TEST_CASE("allocator: reset_peak sets peak to current, not zero") {
  Harness h;
  Allocation a = h.alloc.allocate(4 * MiB);
  Allocation b = h.alloc.allocate(4 * MiB);
  h.alloc.free(b);
  MemoryStats s = h.alloc.stats();
  CHECK(s.allocated_bytes.peak == static_cast<int64_t>(8 * MiB));
  h.alloc.reset_peak_stats();
  s = h.alloc.stats();
  CHECK(s.allocated_bytes.peak == static_cast<int64_t>(4 * MiB));
  CHECK(s.allocated_bytes.current == static_cast<int64_t>(4 * MiB));
  CHECK(s.allocation.peak == 1);
  CHECK(s.reserved_bytes.peak == s.reserved_bytes.current);
  CHECK(s.allocated_bytes.allocated == static_cast<int64_t>(8 * MiB));  // cumulative counters stay
  h.alloc.free(a);
}

TEST_CASE("allocator: empty_cache frees unsplit segments only") {
  Harness h;
  Allocation live = h.alloc.allocate(4096);  // its 2 MiB segment stays split while it lives
  Allocation big = h.alloc.allocate(12 * MiB);  // its own 12 MiB segment
  Allocation mid = h.alloc.allocate(2 * MiB);   // a 20 MiB segment, split while mid lives
  h.alloc.free(big);
  h.alloc.free(mid);
  CHECK(h.alloc.stats().reserved_bytes.current == static_cast<int64_t>(34 * MiB));

  h.alloc.empty_cache();
  MemoryStats s = h.alloc.stats();
  CHECK(s.reserved_bytes.current == static_cast<int64_t>(2 * MiB));
  CHECK(s.segment.current == 1);
  CHECK(h.fake->free_calls == 2);
  CHECK(h.fake->held == 2 * MiB);
  const auto segments = h.alloc.snapshot();
  REQUIRE(segments.size() == 1);
  CHECK(segments[0].base == live.ptr);
  CHECK(segments[0].blocks[0].allocated);

  h.alloc.free(live);
  h.alloc.empty_cache();
  CHECK(h.alloc.stats().reserved_bytes.current == 0);
  CHECK(h.fake->live.empty());
  CHECK(h.fake->bad_frees == 0);
}

TEST_CASE("allocator: a block used on another stream waits for that stream's event") {
  Harness h;
  Allocation a = h.alloc.allocate(4096, 0);
  h.alloc.record_stream(a, 0);  // its own stream: nothing to wait for
  h.alloc.record_stream(a, 7);
  h.alloc.record_stream(a, 7);
  h.alloc.free(a);
  CHECK(h.fake->events_recorded == 1);
  MemoryStats s = h.alloc.stats();
  CHECK(s.allocated_bytes.current == 0);  // drops at free time ...
  CHECK(s.active_bytes.current == 4096);  // ... but the block is not reusable yet

  Allocation b = h.alloc.allocate(4096);
  CHECK(b.ptr != a.ptr);
  h.alloc.free(b);
  Allocation c = h.alloc.allocate(4096);
  CHECK(c.ptr != a.ptr);
  h.alloc.free(c);
  CHECK(h.alloc.snapshot()[0].blocks[0].pending_events);

  h.fake->fire_all_events();
  Allocation d = h.alloc.allocate(4096);  // events are processed first: a is back and merged
  CHECK(d.ptr == a.ptr);
  CHECK(h.fake->events_released == 1);
  CHECK(h.alloc.stats().active_bytes.current == 4096);
  h.alloc.free(d);
  CHECK(h.alloc.snapshot()[0].blocks.size() == 1);

  Allocation e = h.alloc.allocate(4096);
  h.alloc.record_stream(e, 3);
  h.alloc.free(e);
  h.alloc.empty_cache();  // synchronises the pending event, then the segment is whole again
  CHECK(h.fake->event_syncs == 1);
  CHECK(h.alloc.stats().num_sync_all_streams >= 1);
  CHECK(h.alloc.stats().reserved_bytes.current == 0);
  CHECK(h.alloc.stats().active_bytes.current == 0);
  CHECK(h.fake->ready.empty());
}

TEST_CASE("allocator: out of memory releases the cache, retries, then throws with the numbers") {
  Harness h;
  h.alloc.set_memory_cap(20 * MiB);
  CHECK(h.alloc.memory_cap() == 20 * MiB);
  Allocation big = h.alloc.allocate(2 * MiB);  // a 20 MiB segment: the whole cap
  h.alloc.free(big);

  Allocation small = h.alloc.allocate(4096);  // needs 2 MiB more: the cached segment must go
  MemoryStats s = h.alloc.stats();
  CHECK(h.fake->failed_allocs == 1);
  CHECK(s.num_alloc_retries == 1);
  CHECK(s.num_ooms == 0);
  CHECK(s.reserved_bytes.current == static_cast<int64_t>(2 * MiB));

  std::string message;
  try {
    h.alloc.allocate(19 * MiB);  // 20 MiB segment; the live 4 KiB pins the small segment
    FAIL("expected MemoryError");
  } catch (const MemoryError& e) {
    message = e.what();
  }
  s = h.alloc.stats();
  CHECK(s.num_alloc_retries == 2);
  CHECK(s.num_ooms == 1);
  CAPTURE(message);
  CHECK(message.find("fake") != std::string::npos);
  CHECK(message.find("tried to allocate 19922944 bytes") != std::string::npos);
  CHECK(message.find("memory cap 20971520 bytes") != std::string::npos);
  CHECK(message.find("allocated 4096 bytes") != std::string::npos);
  CHECK(message.find("reserved 2097152 bytes") != std::string::npos);
  CHECK(message.find("reserved but unallocated 2093056 bytes") != std::string::npos);

  h.alloc.free(small);  // still consistent: after the live block goes, the request fits
  Allocation fits = h.alloc.allocate(19 * MiB);
  CHECK(h.alloc.stats().num_alloc_retries == 3);
  CHECK(h.alloc.stats().reserved_bytes.current == static_cast<int64_t>(20 * MiB));
  h.alloc.free(fits);
  CHECK(h.fake->bad_frees == 0);
}

TEST_CASE("allocator: a zero-byte allocation is null and touches no stats") {
  Harness h;
  Allocation a = h.alloc.allocate(0);
  CHECK(a.ptr == nullptr);
  CHECK(a.block == nullptr);
  h.alloc.record_stream(a, 3);
  h.alloc.free(a);
  const MemoryStats s = h.alloc.stats();
  CHECK(s.allocation.allocated == 0);
  CHECK(s.allocated_bytes.peak == 0);
  CHECK(s.requested_bytes.peak == 0);
  CHECK(s.reserved_bytes.peak == 0);
  CHECK(h.fake->alloc_calls == 0);
}

TEST_CASE("allocator: foreign, stale and mismatched handles are rejected") {
  Harness one, other;
  Allocation a = one.alloc.allocate(64);
  CHECK_THROWS_AS(other.alloc.free(a), RuntimeError);
  CHECK_THROWS_AS(one.alloc.free(Allocation{a.ptr, nullptr}), RuntimeError);
  CHECK_THROWS_AS(one.alloc.free(Allocation{bytes_of(a) + 512, a.block}), RuntimeError);
  CHECK_THROWS_AS(one.alloc.record_stream(Allocation{a.ptr, nullptr}, 1), RuntimeError);
  one.alloc.free(a);
  CHECK_THROWS_WITH_AS(one.alloc.free(a), doctest::Contains("freed twice"), RuntimeError);
  CHECK(one.alloc.stats().allocation.current == 0);
}

TEST_CASE("allocator: pass-through mode forwards every call and keeps stats") {
  auto* fake = new FakeBackend();
  PassThroughAllocator alloc{std::unique_ptr<RawBackend>(fake)};
  Allocation a = alloc.allocate(1000);
  // The backend is asked for exactly the request (with caching off, a sanitizer must see a tensor's
  // end), while the statistics count the rounded size as the caching allocator does.
  CHECK(fake->last_alloc_bytes == 1000);
  MemoryStats s = alloc.stats();
  CHECK(s.allocated_bytes.current == 1024);
  CHECK(s.reserved_bytes.current == 1024);
  CHECK(s.requested_bytes.current == 1000);
  CHECK(s.segment.current == 1);
  alloc.free(a);
  CHECK(fake->free_calls == 1);
  CHECK(fake->bad_frees == 0);  // freed with the size it was allocated with
  CHECK(alloc.stats().reserved_bytes.current == 0);

  Allocation b = alloc.allocate(1000);
  CHECK(fake->alloc_calls == 2);
  alloc.record_stream(b, 5);
  alloc.free(b);
  CHECK(fake->event_syncs == 1);  // nothing caches the block, so free waits for stream 5

  alloc.set_memory_cap(4096);
  CHECK_THROWS_AS(alloc.allocate(8192), MemoryError);
  CHECK(alloc.stats().num_ooms == 1);
  CHECK(alloc.stats().num_alloc_retries == 0);
  CHECK(alloc.allocate(0).ptr == nullptr);
  CHECK(fake->live.empty());
}

TEST_CASE("allocator: the CPU allocator returns 64-byte aligned memory") {
  DeviceAllocator& cpu = allocator_for(kCPU);
  CHECK(&cpu == &allocator_for(kCPU));
  const int64_t allocated_before = cpu.stats().allocated_bytes.current;
  const size_t sizes[] = {1,   3,    63,     64,      65,          511,     512,
                          513, 4095, 100000, MiB,     MiB + 1,     5 * MiB + 3,
                          10 * MiB, 11 * MiB + 1, 64 * MiB};
  std::vector<Allocation> live;
  for (size_t n : sizes) {
    CAPTURE(n);
    Allocation a = cpu.allocate(n);
    REQUIRE(a.ptr != nullptr);
    CHECK(reinterpret_cast<uintptr_t>(a.ptr) % 64 == 0);
    std::memset(a.ptr, 0xAB, n);  // the whole request is usable memory
    live.push_back(a);
  }
  for (const Allocation& a : live) cpu.free(a);
  CHECK(cpu.stats().allocated_bytes.current == allocated_before);
  empty_cache();
  const std::string summary = memory_summary();
  CHECK(summary.find("reserved bytes") != std::string::npos);
  const char* no_caching = std::getenv("MN_NO_CACHING");
  const bool caching_expected = no_caching == nullptr || no_caching[0] == '\0' ||
                                std::string(no_caching) == "0";
  CHECK(caching_enabled() == caching_expected);
  CHECK((summary.find("MN_NO_CACHING") == std::string::npos) == caching_expected);
  CHECK_THROWS_AS(allocator_for(Device(DeviceType::CPU, 1)), DeviceError);
}

TEST_CASE("allocator: non-CPU devices need a registered factory") {
  // Without CUDA (or without a device) there is no cuda:0 allocator; a GPU host has one.
  if (!cuda_available())
    CHECK_THROWS_WITH_AS(allocator_for(cuda_device(0)),
                         doctest::Contains("no allocator for device cuda:0"), DeviceError);
  static CachingAllocatorImpl* fake_gpu = new CachingAllocatorImpl(std::make_unique<FakeBackend>());
  register_device_allocator_factory(DeviceType::CUDA, [](int index) -> DeviceAllocator* {
    return index == 1 ? fake_gpu : nullptr;
  });
  CHECK(&allocator_for(cuda_device(1)) == fake_gpu);
  CHECK(&allocator_for(cuda_device(1)) == fake_gpu);
  CHECK_THROWS_WITH_AS(allocator_for(cuda_device(0)), doctest::Contains("does not exist"),
                       DeviceError);
  CHECK_THROWS_AS(allocator_for(cuda_device(kMaxDevicesPerType)), DeviceError);
  CHECK_THROWS_AS(register_device_allocator_factory(DeviceType::CPU, nullptr), DeviceError);

  // Capture graphs' private pools (core/capture.h) must cache: a device whose factory passes through
  // (MN_NO_CACHING) needs a pool factory, and the CPU pool caches whatever the environment says.
  const DeviceAllocatorFactory passing = [](int index) -> DeviceAllocator* {
    return index == 1 ? new PassThroughAllocator(std::make_unique<FakeBackend>()) : nullptr;
  };
  register_device_allocator_factory(DeviceType::CUDA, passing);
  CHECK_THROWS_WITH_AS(make_private_allocator(cuda_device(1)), doctest::Contains("pass-through"), DeviceError);
  register_device_allocator_factory(DeviceType::CUDA, passing, [](int index) -> DeviceAllocator* {
    return index == 1 ? new CachingAllocatorImpl(std::make_unique<FakeBackend>()) : nullptr;
  });
  CHECK(dynamic_cast<CachingAllocatorImpl*>(make_private_allocator(cuda_device(1)).get()) != nullptr);
  const std::shared_ptr<DeviceAllocator> cpu_pool = make_private_allocator(kCPU);
  const Allocation first = cpu_pool->allocate(1 << 20);
  void* const where = first.ptr;
  cpu_pool->free(first);
  const Allocation again = cpu_pool->allocate(1 << 20);
  CHECK(again.ptr == where);
  cpu_pool->free(again);

  register_device_allocator_factory(DeviceType::CUDA, nullptr);
  CHECK_THROWS_AS(allocator_for(cuda_device(1)), DeviceError);
}

TEST_CASE("allocator: two threads allocating and freeing stay consistent") {
  CachingAllocatorImpl alloc(make_cpu_raw_backend());
  std::atomic<int> corrupted{0};
  auto worker = [&](unsigned seed) {
    const size_t sizes[] = {64, 700, 4096, 65536, MiB, MiB + MiB / 2, 3 * MiB};
    const char pattern = static_cast<char>(0x10 * seed);
    std::mt19937 rng(seed);
    std::vector<std::pair<Allocation, size_t>> live;
    auto release = [&](size_t index) {
      auto [a, n] = live[index];
      // Only this thread wrote here: another value means two live blocks overlap.
      const size_t checked = n < 65536 ? n : 65536;
      for (size_t i = 0; i < checked; ++i)
        if (bytes_of(a)[i] != pattern || bytes_of(a)[n - 1 - i] != pattern) {
          ++corrupted;
          break;
        }
      alloc.free(a);
      live[index] = live.back();
      live.pop_back();
    };
    for (int step = 0; step < 20000; ++step) {
      if (live.empty() || (live.size() < 32 && rng() % 2 == 0)) {
        const size_t n = sizes[rng() % std::size(sizes)];
        Allocation a = alloc.allocate(n);
        std::memset(a.ptr, pattern, n < 65536 ? n : 65536);
        std::memset(bytes_of(a) + n - (n < 65536 ? n : 65536), pattern, n < 65536 ? n : 65536);
        live.push_back({a, n});
      } else {
        release(rng() % live.size());
      }
    }
    while (!live.empty()) release(live.size() - 1);
  };
  std::thread first(worker, 1u), second(worker, 2u);
  first.join();
  second.join();
  CHECK(corrupted == 0);
  MemoryStats s = alloc.stats();
  CHECK(s.allocation.current == 0);
  CHECK(s.allocated_bytes.current == 0);
  CHECK(s.requested_bytes.current == 0);
  CHECK(s.active_bytes.current == 0);
  CHECK(s.inactive_split_bytes.current == 0);  // everything merged back into whole segments
  CHECK(s.allocation.allocated == s.allocation.freed);
  alloc.empty_cache();
  s = alloc.stats();
  CHECK(s.reserved_bytes.current == 0);
  CHECK(s.segment.current == 0);
  CHECK(s.num_raw_allocs == s.num_raw_frees);
}
