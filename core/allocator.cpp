// The process-wide allocators behind core/allocator.h: the CPU one (caching, or pass-through when
// MN_NO_CACHING is set), and a registry that non-CPU backends (CUDA) fill with a factory. Allocators
// are created on first use and never destroyed, so tensors freed during static destruction still
// find theirs.
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "core/allocator.h"
#include "core/caching_allocator.h"
#include "core/capture.h"
#include "core/error.h"

namespace mn {

namespace {

constexpr size_t kCpuAlignment = 64;  // one cache line; what AVX-512 loads want
constexpr size_t kHugePage = size_t{2} << 20;

size_t alignment_for(size_t bytes) { return bytes >= kHugePage ? kHugePage : kCpuAlignment; }

class CpuRawBackend final : public RawBackend {
 public:
  void* raw_alloc(size_t bytes) override {
    const size_t align = alignment_for(bytes);
    const size_t size = (bytes + align - 1) / align * align;
    if (cap_ != 0 && held_ + size > cap_) return nullptr;
    // Exactly `bytes` (posix_memalign, unlike aligned_alloc, takes any size): with caching off each
    // tensor is its own allocation, and a sanitizer's red zone must start right after it.
    void* ptr = nullptr;
    if (posix_memalign(&ptr, align, bytes) != 0) return nullptr;
    held_ += size;
    // Large segments on transparent huge pages: first touch of fresh memory costs one fault per
    // 2 MiB instead of per 4 KiB (the Fashion-MNIST load measured ~2x faster).
    if (align == kHugePage) madvise(ptr, bytes, MADV_HUGEPAGE);
    return ptr;
  }
  void raw_free(void* ptr, size_t bytes) override {
    std::free(ptr);
    const size_t align = alignment_for(bytes);
    held_ -= (bytes + align - 1) / align * align;
  }
  // The CPU runs one stream in program order: any earlier use has finished by the time of a free.
  uint64_t record_event(StreamId) override { return 0; }
  bool event_ready(uint64_t) override { return true; }
  void event_synchronize(uint64_t) override {}
  void release_event(uint64_t) override {}
  void set_memory_cap(size_t bytes) override { cap_ = bytes; }
  size_t memory_cap() const override { return cap_; }
  size_t total_capacity() const override {
    const long pages = sysconf(_SC_PHYS_PAGES);
    const long page_size = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page_size > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page_size) : 0;
  }
  std::string name() const override { return "cpu"; }

 private:
  size_t held_ = 0;
  size_t cap_ = 0;
};

// Any value but empty or "0" turns caching off.
bool caching_disabled_by_environment() {
  const char* value = std::getenv("MN_NO_CACHING");
  return value != nullptr && value[0] != '\0' && std::strcmp(value, "0") != 0;
}

DeviceAllocator& cpu_allocator() {
  static DeviceAllocator* const allocator = []() -> DeviceAllocator* {
    if (caching_disabled_by_environment()) return new PassThroughAllocator(make_cpu_raw_backend());
    return new CachingAllocatorImpl(make_cpu_raw_backend());
  }();
  return *allocator;
}

// Device::str lives elsewhere; the allocator names devices itself so it links on its own.
std::string device_name(Device d) {
  if (d.is_cpu()) return d.index == 0 ? std::string("cpu") : str("cpu:", d.index);
  return str("cuda:", d.index);
}

struct DeviceRegistry {
  std::mutex mutex;  // guards factory and creation; lookups of created allocators take no lock
  DeviceAllocatorFactory factory = nullptr;
  DeviceAllocatorFactory pool_factory = nullptr;
  std::atomic<bool> ever_registered{false};  // false: the backends have not had their turn yet
  std::array<std::atomic<DeviceAllocator*>, kMaxDevicesPerType> created{};
  // Allocators made before a later registration replaced the factory. Like those in `created` they
  // are never freed (storages they handed out return their blocks to them); kept here so that they
  // stay reachable.
  std::vector<DeviceAllocator*> replaced;
};

DeviceRegistry& registry_for(DeviceType type) {
  static auto* const registries = new std::array<DeviceRegistry, kNumDeviceTypes>();
  return (*registries)[static_cast<size_t>(type)];
}

void check_registrable(Device d) {
  const auto type = static_cast<int>(d.type);
  MN_CHECK(type >= 0 && type < kNumDeviceTypes, DeviceError, "allocator: expected a device type below ",
           kNumDeviceTypes, ", got ", type);
  MN_CHECK(d.index >= 0 && d.index < kMaxDevicesPerType, DeviceError, "allocator: expected a device ",
           "index in [0, ", kMaxDevicesPerType, "), got ", device_name(d));
}

// What set_backend_registration installed (the kernels layer: kernels/dispatch.cpp); null until then.
std::atomic<void (*)()> g_backend_registration{nullptr};

std::string stat_row(const char* label, const Stat& stat, bool bytes) {
  auto cell = [bytes](int64_t v) {
    if (!bytes) return str(v);
    std::string text = describe_bytes(v);  // "N bytes (1.50 MiB)": the table shows the readable part
    const size_t open = text.find('(');
    return text.substr(open + 1, text.size() - open - 2);
  };
  char line[160];
  std::snprintf(line, sizeof line, "%-22s %14s %14s %14s %14s\n", label, cell(stat.current).c_str(),
                cell(stat.peak).c_str(), cell(stat.allocated).c_str(), cell(stat.freed).c_str());
  return line;
}

}  // namespace

std::unique_ptr<RawBackend> make_cpu_raw_backend() { return std::make_unique<CpuRawBackend>(); }

void register_device_allocator_factory(DeviceType type, DeviceAllocatorFactory factory,
                                       DeviceAllocatorFactory pool_factory) {
  MN_CHECK(type != DeviceType::CPU, DeviceError,
           "register_device_allocator_factory: expected a non-CPU device type, got cpu (the CPU "
           "allocator is built in)");
  check_registrable(Device(type, 0));
  DeviceRegistry& registry = registry_for(type);
  std::lock_guard<std::mutex> lock(registry.mutex);
  registry.factory = factory;
  registry.pool_factory = pool_factory;
  registry.ever_registered.store(true, std::memory_order_release);
  for (auto& slot : registry.created) {
    if (DeviceAllocator* old = slot.exchange(nullptr, std::memory_order_acq_rel)) registry.replaced.push_back(old);
  }
}

void set_backend_registration(void (*register_backends)()) {
  g_backend_registration.store(register_backends, std::memory_order_release);
}

DeviceAllocator& allocator_for(Device d) {
  if (d.is_cpu()) {
    MN_CHECK(d.index == 0, DeviceError, "allocator_for: expected cpu device index 0, got ",
             device_name(d));
    return cpu_allocator();
  }
  check_registrable(d);
  DeviceRegistry& registry = registry_for(d.type);
  auto& slot = registry.created[static_cast<size_t>(d.index)];
  if (DeviceAllocator* allocator = slot.load(std::memory_order_acquire)) return *allocator;
  // The CUDA backend registers its factory with the kernels; the first use of a device (a tensor
  // factory, memory_stats, ...) may come before any kernel ran. A factory registered by hand first
  // (tests) is left alone. Not under the registry lock: registration takes it.
  if (!registry.ever_registered.load(std::memory_order_acquire)) {
    if (auto* register_backends = g_backend_registration.load(std::memory_order_acquire)) register_backends();
  }
  std::lock_guard<std::mutex> lock(registry.mutex);
  if (DeviceAllocator* allocator = slot.load(std::memory_order_acquire)) return *allocator;
  MN_CHECK(registry.factory != nullptr, DeviceError, "no allocator for device ", device_name(d),
           ": built without CUDA or no device");
  DeviceAllocator* allocator = registry.factory(d.index);
  MN_CHECK(allocator != nullptr, DeviceError, "no allocator for device ", device_name(d),
           ": the device does not exist");
  slot.store(allocator, std::memory_order_release);
  return *allocator;
}

// Always a caching allocator, MN_NO_CACHING or not: a capture graph replays into blocks that were freed
// during its recording, so its pool must never hand them back.
std::shared_ptr<DeviceAllocator> make_private_allocator(Device d) {
  if (d.is_cpu()) {
    MN_CHECK(d.index == 0, DeviceError, "make_private_allocator: expected cpu device index 0, got ", device_name(d));
    return std::make_shared<CachingAllocatorImpl>(make_cpu_raw_backend());
  }
  allocator_for(d);  // registers the backend and checks that the device exists
  DeviceRegistry& registry = registry_for(d.type);
  std::lock_guard<std::mutex> lock(registry.mutex);
  const DeviceAllocatorFactory factory = registry.pool_factory ? registry.pool_factory : registry.factory;
  MN_CHECK(factory != nullptr, DeviceError, "no allocator for device ", device_name(d));
  std::shared_ptr<DeviceAllocator> pool(factory(d.index));
  MN_CHECK(pool != nullptr, DeviceError, "no allocator for device ", device_name(d));
  MN_CHECK(dynamic_cast<PassThroughAllocator*>(pool.get()) == nullptr, DeviceError, "the allocator factory of ",
           device_name(d), " made a pass-through allocator for a capture pool, which must cache its blocks");
  return pool;
}

bool caching_enabled(Device d) {
  return dynamic_cast<PassThroughAllocator*>(&allocator_for(d)) == nullptr;
}

MemoryStats memory_stats(Device d) { return allocator_for(d).stats(); }
void reset_peak_memory_stats(Device d) { allocator_for(d).reset_peak_stats(); }
void empty_cache(Device d) {
  // Releasing memory is a device synchronisation on CUDA and not part of any recorded computation.
  capture::unsupported("empty_cache() releases cached memory");
  allocator_for(d).empty_cache();
}
void set_memory_cap(size_t bytes, Device d) { allocator_for(d).set_memory_cap(bytes); }

std::string memory_summary(Device d) {
  DeviceAllocator& allocator = allocator_for(d);
  const MemoryStats s = allocator.stats();
  const size_t cap = allocator.memory_cap();
  char header[160];
  std::snprintf(header, sizeof header, "%-22s %14s %14s %14s %14s\n", "", "current", "peak",
                "allocated", "freed");
  std::string text = str("memory summary of ", device_name(d), " (",
                         caching_enabled(d) ? "caching allocator" : "caching off: MN_NO_CACHING",
                         ", cap ", cap ? describe_bytes(static_cast<int64_t>(cap)) : "none", ")\n");
  text += header;
  text += stat_row("allocated bytes", s.allocated_bytes, true);
  text += stat_row("reserved bytes", s.reserved_bytes, true);
  text += stat_row("active bytes", s.active_bytes, true);
  text += stat_row("requested bytes", s.requested_bytes, true);
  text += stat_row("inactive split bytes", s.inactive_split_bytes, true);
  text += stat_row("allocations", s.allocation, false);
  text += stat_row("segments", s.segment, false);
  text += str("alloc retries ", s.num_alloc_retries, ", OOMs ", s.num_ooms, ", raw allocs ",
              s.num_raw_allocs, ", raw frees ", s.num_raw_frees, ", sync all streams ",
              s.num_sync_all_streams, "\n");
  return text;
}

}  // namespace mn
