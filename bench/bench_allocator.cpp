// Caching allocator costs. Targets: a cached small hit (alloc + free) <= 100 ns; a cached 64 MiB
// alloc + free >= 10x faster than malloc + free of 64 MiB (glibc serves that with mmap/munmap
// every time, since it is above the largest dynamic mmap threshold of 32 MiB). Nothing here
// touches the memory: this measures bookkeeping, not page faults.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdlib>
#include <vector>

#include "core/allocator.h"
#include "core/caching_allocator.h"

namespace {

using namespace mn;

constexpr size_t MiB = size_t{1} << 20;

// The process-wide CPU allocator, as Storage uses it (MN_NO_CACHING=1 measures the pass-through).
void BM_CachedSmallHit(benchmark::State& state) {
  const auto bytes = static_cast<size_t>(state.range(0));
  allocator_for(kCPU).free(allocator_for(kCPU).allocate(bytes));  // warm: the segment exists
  for (auto _ : state) {
    DeviceAllocator& cpu = allocator_for(kCPU);
    Allocation a = cpu.allocate(bytes);
    benchmark::DoNotOptimize(a.ptr);
    cpu.free(a);
  }
}
BENCHMARK(BM_CachedSmallHit)->ArgName("bytes")->Arg(64)->Arg(4096);

void BM_Cached64MiB(benchmark::State& state) {
  DeviceAllocator& cpu = allocator_for(kCPU);
  cpu.free(cpu.allocate(64 * MiB));
  for (auto _ : state) {
    Allocation a = cpu.allocate(64 * MiB);
    benchmark::DoNotOptimize(a.ptr);
    cpu.free(a);
  }
}
BENCHMARK(BM_Cached64MiB);

void BM_Malloc64MiB(benchmark::State& state) {
  for (auto _ : state) {
    void* p = std::malloc(64 * MiB);
    benchmark::DoNotOptimize(p);
    std::free(p);
  }
}
BENCHMARK(BM_Malloc64MiB);

// Sixteen live blocks of mixed sizes carved from one 2 MiB segment, then freed out of order: every
// allocation splits and every free merges. Reported per allocation + free.
void BM_SplitPath(benchmark::State& state) {
  CachingAllocatorImpl alloc(make_cpu_raw_backend());
  const size_t sizes[] = {512,  3000, 700,  40000, 1500, 9000, 512,   64000,
                          2048, 600,  5000, 30000, 800,  100,  12000, 4096};
  constexpr int kCount = static_cast<int>(std::size(sizes));
  Allocation live[kCount];
  alloc.free(alloc.allocate(512));
  for (auto _ : state) {
    for (int i = 0; i < kCount; ++i) live[i] = alloc.allocate(sizes[i]);
    for (int i = 0; i < kCount; i += 2) alloc.free(live[i]);
    for (int i = 1; i < kCount; i += 2) alloc.free(live[i]);
  }
  state.SetItemsProcessed(state.iterations() * kCount);
}
BENCHMARK(BM_SplitPath);

// empty_cache alone (manual time) with `segments` cached whole segments of 12 MiB to return.
void BM_EmptyCache(benchmark::State& state) {
  CachingAllocatorImpl alloc(make_cpu_raw_backend());
  const auto segments = static_cast<size_t>(state.range(0));
  std::vector<Allocation> live(segments);
  for (auto _ : state) {
    for (auto& a : live) a = alloc.allocate(12 * MiB);
    for (auto& a : live) alloc.free(a);
    const auto start = std::chrono::steady_clock::now();
    alloc.empty_cache();
    const auto stop = std::chrono::steady_clock::now();
    state.SetIterationTime(std::chrono::duration<double>(stop - start).count());
  }
}
BENCHMARK(BM_EmptyCache)->ArgName("segments")->Arg(0)->Arg(1)->Arg(16)->UseManualTime();

}  // namespace
