// Memory bandwidth, STREAM-style (see bandwidth_probe.h for the array size and the byte counting):
// copy c = a, scale b = s c, add c = a + b, triad a = b + s c and a read-only sum over a, with one
// thread and with all OpenMP threads. Counter GBps = STREAM bytes / the best iteration's wall time
// (STREAM's "best rate", the least disturbed by other load; 1e9 bytes/s); GBps_avg uses the mean.
//
// Then matrix-vector products over mapper-sized matrices, the memory-bound operation the reference
// library runs every step (its mapper is a dense n x L matrix): y = W z (BM_DenseGemv) and
// u = W^T g (BM_DenseGemvT, the backward) through our mm op, counted as the bytes of W, the input
// and the output; frac_read / frac_triad set that rate against this process's own read and triad
// bandwidth at the same thread count. BM_BlockOrthogonalApply applies our block-orthogonal mapper
// of the same shape (mapping/orthogonal.h: an [k-1, L] x [L, L] GEMM plus a tail GEMV, the n x L
// matrix never formed); its GBps counts the bytes it really touches (factors + z + y), and
// dense_equiv_GBps is the rate a dense GEMV would need to match its time.
//
// BM_FmaPeak is the compute counterpart, the machine's f32 multiply-add peak: each thread runs 16
// independent FMA chains on the widest vectors this build targets (AVX-512, AVX2 + FMA, else scalar
// fmaf), so the loop is bound by FMA throughput, not latency; GFLOPS = 2 flops per lane per FMA over the
// best iteration's wall time (peak_GFLOPs). mn_bench_report sets GEMM rates against it.
//   mn_bench_bandwidth --benchmark_filter=Stream
#include <benchmark/benchmark.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "autograd/node.h"
#include "autograd/ops.h"
#include "bench/bandwidth_probe.h"
#include "core/random.h"
#include "mapping/orthogonal.h"

namespace {

using namespace mn;
using namespace mn_bench;

enum Kernel { kCopy, kScale, kAdd, kTriad, kSum };
const char* const kKernelNames[] = {"copy", "scale", "add", "triad", "read_sum"};
const int kArraysTouched[] = {2, 2, 3, 3, 1};

void BM_Stream(benchmark::State& state) {
  const auto kernel = static_cast<Kernel>(state.range(0));
  const int threads = static_cast<int>(state.range(1));
  StreamArrays& s = stream_arrays();
  double sink = 0, best = 1e30;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    switch (kernel) {
      case kCopy: stream_copy(s.c.get(), s.a.get(), s.n, threads); break;
      case kScale: stream_scale(s.b.get(), s.c.get(), 3.0, s.n, threads); break;
      case kAdd: stream_add(s.c.get(), s.a.get(), s.b.get(), s.n, threads); break;
      case kTriad: stream_triad(s.a.get(), s.b.get(), s.c.get(), 3.0, s.n, threads); break;
      case kSum: sink += stream_sum(s.a.get(), s.n, threads); break;
    }
    benchmark::ClobberMemory();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  benchmark::DoNotOptimize(sink);
  const double bytes = static_cast<double>(kArraysTouched[kernel] * s.n * sizeof(double));
  state.counters["GBps"] = bytes * 1e-9 / best;
  state.counters["GBps_avg"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["array_MiB"] = static_cast<double>(s.n * sizeof(double)) / kMiB;
  state.counters["LLC_MiB"] = static_cast<double>(last_level_cache_bytes()) / kMiB;
  state.counters["threads"] = threads;
  state.SetLabel(kKernelNames[kernel]);
}

// Mapper shapes [n, L]: the dense matrix the reference library would hold.
struct MapperShape {
  const char* name;
  int64_t n, latent;
};
const MapperShape kShapes[] = {
    {"mlp_slvt_L64", 269'322, 64},   // MLP 784-256-256-10, one latent of 64 for all parameters
    {"mlp_fc1_L64", 200'960, 64},    // its first layer's group (layerwise)
    {"cnn2_fc1_L672", 102'528, 672}, // CNN2's FC 800->128 group, layerwise 4 x 672
};

// Random operands per shape, kept for the process (repetitions and thread counts reuse them).
struct Operands {
  Tensor w, z, g;
};
const Operands& operands(int64_t index) {
  static std::map<int64_t, Operands> cache;
  auto it = cache.find(index);
  if (it == cache.end()) {
    const MapperShape& shape = kShapes[index];
    Generator gen(11 + static_cast<uint64_t>(index));
    Operands o{randn({shape.n, shape.latent}, {}, &gen), randn({shape.latent}, {}, &gen), randn({shape.n}, {}, &gen)};
    it = cache.emplace(index, std::move(o)).first;
  }
  return it->second;
}

// Runs fn under `threads` OpenMP threads (the library's kernels follow omp_get_max_threads()).
template <class F>
void with_threads(int threads, F&& fn) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  fn();
  omp_set_num_threads(saved);
}

void set_bandwidth_counters(benchmark::State& state, double bytes, int threads, const MapperShape& shape) {
  const Bandwidth& bw = measured_bandwidth(threads);
  state.counters["GBps"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["bytes"] = bytes;
  state.counters["read_GBps"] = bw.read_GBps;
  state.counters["triad_GBps"] = bw.triad_GBps;
  state.counters["threads"] = threads;
  state.SetLabel(std::string(shape.name) + " n=" + std::to_string(shape.n) + " L=" + std::to_string(shape.latent));
}

// Google Benchmark turns rate counters into rates after the run; the fractions need that rate, so
// the loop is timed here as well (wall time, the same clock as UseRealTime).
template <class F>
double timed_loop(benchmark::State& state, F&& body) {
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) body();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return seconds / static_cast<double>(std::max<int64_t>(1, state.iterations()));
}

void finish_fractions(benchmark::State& state, double bytes, double seconds_per_iteration, int threads) {
  const Bandwidth& bw = measured_bandwidth(threads);
  const double rate = bytes * 1e-9 / seconds_per_iteration;
  state.counters["frac_read"] = rate / bw.read_GBps;
  state.counters["frac_triad"] = rate / bw.triad_GBps;
}

void BM_DenseGemv(benchmark::State& state) {
  const MapperShape& shape = kShapes[state.range(0)];
  const int threads = static_cast<int>(state.range(1));
  autograd::NoGradGuard no_grad;
  const Tensor& w = operands(state.range(0)).w;
  const Tensor& z = operands(state.range(0)).z;
  measured_bandwidth(threads);  // before timing: the probe allocates and touches its own arrays
  double per_iteration = 0;
  with_threads(threads, [&] {
    per_iteration = timed_loop(state, [&] { benchmark::DoNotOptimize(matmul(w, z).raw_data()); });
  });
  const double bytes = 4.0 * (static_cast<double>(shape.n) * shape.latent + shape.latent + shape.n);
  set_bandwidth_counters(state, bytes, threads, shape);
  finish_fractions(state, bytes, per_iteration, threads);
}

void BM_DenseGemvT(benchmark::State& state) {
  const MapperShape& shape = kShapes[state.range(0)];
  const int threads = static_cast<int>(state.range(1));
  autograd::NoGradGuard no_grad;
  const Tensor& w = operands(state.range(0)).w;
  const Tensor& g = operands(state.range(0)).g;
  measured_bandwidth(threads);
  double per_iteration = 0;
  with_threads(threads, [&] {
    per_iteration = timed_loop(state, [&] { benchmark::DoNotOptimize(matmul(w.t(), g).raw_data()); });
  });
  const double bytes = 4.0 * (static_cast<double>(shape.n) * shape.latent + shape.latent + shape.n);
  set_bandwidth_counters(state, bytes, threads, shape);
  finish_fractions(state, bytes, per_iteration, threads);
}

void BM_BlockOrthogonalApply(benchmark::State& state) {
  const MapperShape& shape = kShapes[state.range(0)];
  const int threads = static_cast<int>(state.range(1));
  autograd::NoGradGuard no_grad;
  static std::map<int64_t, mapping::OrthogonalMatrix> built;  // built once per shape
  if (!built.count(state.range(0)))
    built[state.range(0)] = mapping::OrthogonalMatrix::build(0, "bench", shape.n, shape.latent, true);
  const mapping::OrthogonalMatrix& w = built[state.range(0)];
  const Tensor& z = operands(state.range(0)).z;
  measured_bandwidth(threads);
  double per_iteration = 0;
  with_threads(threads, [&] {
    per_iteration = timed_loop(state, [&] { benchmark::DoNotOptimize(w.apply(z).raw_data()); });
  });
  const double bytes = static_cast<double>(w.bytes()) + 4.0 * (shape.latent + shape.n);
  set_bandwidth_counters(state, bytes, threads, shape);
  finish_fractions(state, bytes, per_iteration, threads);
  state.counters["factor_bytes"] = static_cast<double>(w.bytes());
  state.counters["dense_bytes"] = static_cast<double>(w.dense_bytes());
  state.counters["dense_equiv_GBps"] = static_cast<double>(w.dense_bytes()) * 1e-9 / per_iteration;
}

#if defined(__AVX512F__)
using FmaVec = __m512;
constexpr int kFmaLanes = 16;
inline FmaVec fma_splat(float v) { return _mm512_set1_ps(v); }
inline FmaVec fma_step(FmaVec a, FmaVec b, FmaVec c) { return _mm512_fmadd_ps(a, b, c); }
inline float fma_first(FmaVec v) { return _mm512_cvtss_f32(v); }
#elif defined(__AVX2__) && defined(__FMA__)
using FmaVec = __m256;
constexpr int kFmaLanes = 8;
inline FmaVec fma_splat(float v) { return _mm256_set1_ps(v); }
inline FmaVec fma_step(FmaVec a, FmaVec b, FmaVec c) { return _mm256_fmadd_ps(a, b, c); }
inline float fma_first(FmaVec v) { return _mm256_cvtss_f32(v); }
#else
using FmaVec = float;
constexpr int kFmaLanes = 1;
inline FmaVec fma_splat(float v) { return v; }
inline FmaVec fma_step(FmaVec a, FmaVec b, FmaVec c) { return std::fma(a, b, c); }
inline float fma_first(FmaVec v) { return v; }
#endif

void BM_FmaPeak(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  constexpr int kChains = 16;
  constexpr int64_t kSteps = 1 << 20;  // per chain and thread: 16 x 2^20 FMAs per thread per iteration
  double best = 1e30;
  float sink = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
      // x -> x * m + c with m slightly below 1 stays bounded: no overflow or denormals.
      const FmaVec m = fma_splat(0.9999999f), c = fma_splat(1e-7f);
      FmaVec acc[kChains];
      for (int k = 0; k < kChains; ++k) acc[k] = fma_splat(1.0f + static_cast<float>(k + omp_get_thread_num()));
      for (int64_t i = 0; i < kSteps; ++i)
        for (int k = 0; k < kChains; ++k) acc[k] = fma_step(acc[k], m, c);
      for (int k = 0; k < kChains; ++k) sink += fma_first(acc[k]);
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  benchmark::DoNotOptimize(sink);
  const double flops = 2.0 * kFmaLanes * kChains * static_cast<double>(kSteps) * threads;
  state.counters["peak_GFLOPs"] = flops * 1e-9 / best;
  state.counters["lanes"] = kFmaLanes;
}

void register_all() {
  const int all = max_threads();
  std::vector<int> thread_counts{1};
  if (all > 1) thread_counts.push_back(all);
  auto* stream = benchmark::RegisterBenchmark("BM_Stream", BM_Stream);
  stream->ArgNames({"kernel", "threads"})->UseRealTime()->Unit(benchmark::kMillisecond);
  for (int t : thread_counts)
    for (int k = kCopy; k <= kSum; ++k) stream->Args({k, t});
  auto* peak = benchmark::RegisterBenchmark("BM_FmaPeak", BM_FmaPeak);
  peak->ArgNames({"threads"})->UseRealTime()->Unit(benchmark::kMillisecond);
  for (int t : thread_counts) peak->Args({t});
  for (auto [name, fn] : {std::pair{"BM_DenseGemv", &BM_DenseGemv}, std::pair{"BM_DenseGemvT", &BM_DenseGemvT},
                          std::pair{"BM_BlockOrthogonalApply", &BM_BlockOrthogonalApply}}) {
    auto* b = benchmark::RegisterBenchmark(name, fn);
    b->ArgNames({"shape", "threads"})->UseRealTime()->Unit(benchmark::kMicrosecond);
    for (int t : thread_counts)
      for (int s = 0; s < static_cast<int>(std::size(kShapes)); ++s) b->Args({s, t});
  }
}

const int registered = (register_all(), 0);

}  // namespace
