#pragma once
// STREAM-style memory-bandwidth kernels shared by the benchmark programs (bench_bandwidth and the
// bandwidth bound in bench_train_step). Arrays are doubles, touched first by the threads that later
// use them (static schedule), and sized well beyond the last-level cache:
//   per array = 4 x LLC, at least 64 MiB, at most 1 GiB and at most MemAvailable / 8;
//   MN_BENCH_STREAM_MB overrides it (MiB per array).
// (The 1 GiB cap matters on VMs that report a whole socket's L3: the 2-core EPYC development VM
// reports 508 MiB, of which one core reaches only its CCD's 32 MiB; rates there are flat from
// 64 MiB up.)
// Bytes are counted the STREAM way: the arrays each kernel names, once per element (copy and scale
// 2 x 8 bytes, add and triad 3 x 8, the read-only sum 1 x 8), with no write-allocate traffic.
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>

namespace mn_bench {

constexpr size_t kMiB = size_t{1} << 20;

// Size of the largest data cache the OS reports (L3, else L2), in bytes; 32 MiB when unknown.
inline size_t last_level_cache_bytes() {
  for (int name : {_SC_LEVEL3_CACHE_SIZE, _SC_LEVEL2_CACHE_SIZE}) {
    const long v = sysconf(name);
    if (v > 0) return static_cast<size_t>(v);
  }
  for (int index = 3; index >= 2; --index) {
    std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size");
    size_t kib = 0;
    if (f >> kib && kib > 0) return kib * 1024;  // "32768K"
  }
  return 32 * kMiB;
}

inline size_t available_memory_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  size_t kib = 0;
  std::string unit;
  while (f >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return size_t{8} << 30;
}

inline size_t stream_array_bytes() {
  if (const char* env = std::getenv("MN_BENCH_STREAM_MB")) {
    const long mb = std::atol(env);
    if (mb > 0) return static_cast<size_t>(mb) * kMiB;
  }
  size_t bytes = std::max<size_t>(4 * last_level_cache_bytes(), 64 * kMiB);
  bytes = std::min(bytes, size_t{1} << 30);
  bytes = std::min(bytes, available_memory_bytes() / 8);
  return std::max<size_t>(bytes, 16 * kMiB);
}

struct FreeDeleter {
  void operator()(double* p) const { std::free(p); }
};
using Array = std::unique_ptr<double[], FreeDeleter>;

// n doubles, 2 MiB aligned, first-touched by all threads with the static schedule the kernels use.
inline Array make_array(size_t n, double value) {
  const size_t bytes = (n * sizeof(double) + 2 * kMiB - 1) / (2 * kMiB) * (2 * kMiB);
  auto* p = static_cast<double*>(std::aligned_alloc(2 * kMiB, bytes));
  if (p == nullptr) throw std::bad_alloc();
  const auto count = static_cast<int64_t>(n);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) p[i] = value;
  return Array(p);
}

// The five kernels over [0, n) with `threads` OpenMP threads.
inline void stream_copy(double* c, const double* a, size_t n, int threads) {
  const auto count = static_cast<int64_t>(n);
#pragma omp parallel for simd num_threads(threads) schedule(static)
  for (int64_t i = 0; i < count; ++i) c[i] = a[i];
}
inline void stream_scale(double* b, const double* c, double s, size_t n, int threads) {
  const auto count = static_cast<int64_t>(n);
#pragma omp parallel for simd num_threads(threads) schedule(static)
  for (int64_t i = 0; i < count; ++i) b[i] = s * c[i];
}
inline void stream_add(double* c, const double* a, const double* b, size_t n, int threads) {
  const auto count = static_cast<int64_t>(n);
#pragma omp parallel for simd num_threads(threads) schedule(static)
  for (int64_t i = 0; i < count; ++i) c[i] = a[i] + b[i];
}
inline void stream_triad(double* a, const double* b, const double* c, double s, size_t n, int threads) {
  const auto count = static_cast<int64_t>(n);
#pragma omp parallel for simd num_threads(threads) schedule(static)
  for (int64_t i = 0; i < count; ++i) a[i] = b[i] + s * c[i];
}
inline double stream_sum(const double* a, size_t n, int threads) {
  const auto count = static_cast<int64_t>(n);
  double s = 0;
#pragma omp parallel for simd num_threads(threads) schedule(static) reduction(+ : s)
  for (int64_t i = 0; i < count; ++i) s += a[i];
  return s;
}

// The three STREAM arrays, allocated once per process (first use) and shared by every user.
struct StreamArrays {
  size_t n;
  Array a, b, c;
};

inline StreamArrays& stream_arrays() {
  static StreamArrays s = [] {
    const size_t n = stream_array_bytes() / sizeof(double);
    return StreamArrays{n, make_array(n, 1.0), make_array(n, 2.0), make_array(n, 0.0)};
  }();
  return s;
}

// A quick probe: best of five read-only passes and three triads over the STREAM arrays, measured
// once per thread count and cached for the process. Used where a figure is set against the bandwidth (GEMV fraction, mapped-step bound).
struct Bandwidth {
  double read_GBps = 0;
  double triad_GBps = 0;
  size_t array_bytes = 0;
  int threads = 0;
};

inline const Bandwidth& measured_bandwidth(int threads) {
  static std::map<int, Bandwidth> cache;
  auto it = cache.find(threads);
  if (it != cache.end()) return it->second;
  Bandwidth bw;
  bw.threads = threads;
  StreamArrays& s = stream_arrays();
  const size_t n = s.n;
  bw.array_bytes = n * sizeof(double);
  using clock = std::chrono::steady_clock;
  auto seconds = [](clock::time_point t0) { return std::chrono::duration<double>(clock::now() - t0).count(); };
  double best_read = 1e30, best_triad = 1e30, sink = 0;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = clock::now();
    sink += stream_sum(s.a.get(), n, threads);
    best_read = std::min(best_read, seconds(t0));
  }
  for (int rep = 0; rep < 3; ++rep) {
    auto t0 = clock::now();
    stream_triad(s.a.get(), s.b.get(), s.c.get(), 3.0, n, threads);
    best_triad = std::min(best_triad, seconds(t0));
  }
  if (sink == 42.0) std::abort();  // keeps the sums alive
  bw.read_GBps = 1e-9 * static_cast<double>(n * sizeof(double)) / best_read;
  bw.triad_GBps = 1e-9 * static_cast<double>(3 * n * sizeof(double)) / best_triad;
  return cache.emplace(threads, bw).first->second;
}

inline int max_threads() { return std::max(1, omp_get_max_threads()); }

}  // namespace mn_bench
