// CUDA runtime costs (built only with CUDA; without a device it prints a skip line and exits 0).
// Targets (issue 5): a caching-allocator hit (allocate + free of a cached block) <= 1 us, measured
// beside cudaMalloc + cudaFree of the same size; cuBLAS f32 GEMM 8192^3 >= 70% of the H200's fp32
// peak (about 67 TFLOP/s, so >= 47); plus the cost of empty_cache and host <-> device bandwidth
// (through Tensor::copy_, which synchronises like PyTorch's blocking copy, and raw pinned cudaMemcpy
// as the ceiling).
//   mn_bench_cuda_runtime --benchmark_filter=Gemm
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <vector>

#include "autograd/ops.h"
#include "bench/cuda_bench_main.h"
#include "core/allocator.h"
#include "core/cuda.h"
#include "core/random.h"
#include "kernels/kernels.h"

namespace {

using namespace mn;

const Device kGpu = cuda_device(0);
constexpr int64_t KiB = 1 << 10;
constexpr int64_t MiB = 1 << 20;

bool ok(cudaError_t status, benchmark::State& state, const char* what) {
  if (status == cudaSuccess) return true;
  state.SkipWithError(what);
  return false;
}

// Times run() once per iteration with CUDA events on the current stream (for UseManualTime).
void time_with_events(benchmark::State& state, const std::function<void()>& run, const char* failure) {
  cudaStream_t stream = static_cast<cudaStream_t>(cuda::get_current_stream(0).handle());
  cudaEvent_t start = nullptr, stop = nullptr;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (auto _ : state) {
    cudaEventRecord(start, stream);
    run();
    cudaEventRecord(stop, stream);
    if (!ok(cudaEventSynchronize(stop), state, failure)) break;
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    state.SetIterationTime(ms / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

// allocate + free of a block the cache already holds: host bookkeeping only.
void BM_CachingAllocatorHit(benchmark::State& state) {
  const auto bytes = static_cast<size_t>(state.range(0));
  DeviceAllocator& gpu = allocator_for(kGpu);
  gpu.free(gpu.allocate(bytes));  // warm: the segment exists
  for (auto _ : state) {
    Allocation a = gpu.allocate(bytes);
    benchmark::DoNotOptimize(a.ptr);
    gpu.free(a);
  }
}
BENCHMARK(BM_CachingAllocatorHit)->Arg(512)->Arg(64 * KiB)->Arg(MiB)->Arg(16 * MiB)->Arg(256 * MiB);

// The same sizes straight from the driver (cudaFree also synchronises the device).
void BM_CudaMallocFree(benchmark::State& state) {
  const auto bytes = static_cast<size_t>(state.range(0));
  for (auto _ : state) {
    void* p = nullptr;
    if (!ok(cudaMalloc(&p, bytes), state, "cudaMalloc failed")) break;
    benchmark::DoNotOptimize(p);
    if (!ok(cudaFree(p), state, "cudaFree failed")) break;
  }
}
BENCHMARK(BM_CudaMallocFree)->Arg(512)->Arg(64 * KiB)->Arg(MiB)->Arg(16 * MiB)->Arg(256 * MiB);

// empty_cache returning `segments` cached 32 MiB segments (the refill is not timed).
void BM_EmptyCache(benchmark::State& state) {
  const int64_t segments = state.range(0);
  empty_cache(kGpu);
  for (auto _ : state) {
    {
      std::vector<Tensor> hold;
      for (int64_t i = 0; i < segments; ++i) hold.push_back(empty({32 * MiB / 4}, kGpu));
    }  // freed: all cached
    const auto start = std::chrono::steady_clock::now();
    empty_cache(kGpu);
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    state.SetIterationTime(took.count());
  }
}
BENCHMARK(BM_EmptyCache)->Arg(0)->Arg(1)->Arg(16)->UseManualTime()->Unit(benchmark::kMicrosecond);

// C = A B through the gemm kernel (cuBLAS), timed with events on the current stream. range(1) = 1
// allows TF32.
void BM_GemmF32(benchmark::State& state) {
  const int64_t n = state.range(0);
  const bool tf32 = state.range(1) != 0;
  Generator gen(7);
  const Tensor a = randn({n, n}, kGpu, &gen), b = randn({n, n}, kGpu, &gen);
  Tensor c = empty({n, n}, kGpu);
  cuda::set_allow_tf32(tf32);
  // warm: handle, heuristics, module load, and clocks up from idle (~0.2 s of GEMMs at 8192)
  for (int i = 0; i < 10; ++i) kernels::gemm(kGpu, a, b, c, 1.0, 0.0);
  cuda::synchronize(0);
  time_with_events(state, [&] { kernels::gemm(kGpu, a, b, c, 1.0, 0.0); }, "gemm failed");
  cuda::set_allow_tf32(false);
  state.counters["TFLOPS"] = benchmark::Counter(2.0 * n * n * n / 1e12, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_GemmF32)
    ->Args({4096, 0})
    ->Args({8192, 0})
    ->Args({8192, 1})
    ->MinTime(0.5)  // ~20 timed GEMMs at 8192 f32 rather than ~5 with the check's 0.1 s
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// Kernels whose time is mostly index arithmetic rather than memory traffic, on CNN2's batch-256
// shapes, timed with events: a broadcast bias add, a permuted copy (dims 0,2,3,1 made contiguous),
// max-pool forward, conv forward (im2col + GEMM + bias), conv input gradient (GEMM + col2im), and two
// sums of the backward pass: a conv bias gradient (over dims 0, 2, 3) and a Linear bias gradient (a
// [256, 128] gradient over its batch dim, a column reduction with few outputs).
// `GBps` counts each kernel's compulsory bytes (inputs read once, outputs written once); against the
// H200's ~4.8 TB/s it shows how far from memory-bound the index math leaves them.
enum IndexedKernel : int64_t {
  kBiasAdd, kPermutedCopy, kMaxPool, kConvForward, kConvInputGrad, kConvBiasGrad, kLinearBiasGrad
};

void BM_IndexedKernel(benchmark::State& state) {
  const auto which = static_cast<IndexedKernel>(state.range(0));
  Generator gen(11);
  const Tensor x = randn({256, 16, 26, 26}, kGpu, &gen);   // conv1's output
  const Tensor x2 = randn({256, 16, 13, 13}, kGpu, &gen);  // conv2's input
  const Tensor w2 = randn({32, 16, 3, 3}, kGpu, &gen), b2 = randn({32}, kGpu, &gen);
  const Tensor bias = randn({16, 1, 1}, kGpu, &gen).expand(x.sizes());
  const Tensor go2 = randn({256, 32, 11, 11}, kGpu, &gen);
  Tensor out = empty(x.sizes(), kGpu), permuted = empty({256, 26, 26, 16}, kGpu);
  Tensor pooled = empty({256, 16, 13, 13}, kGpu);
  Tensor indices = empty({256, 16, 13, 13}, TensorOptions(DType::i64).with_device(kGpu));
  Tensor conv_out = empty({256, 32, 11, 11}, kGpu), grad_x2 = empty(x2.sizes(), kGpu);
  const Tensor fc_grad = randn({256, 128}, kGpu, &gen);  // a Linear layer's output gradient
  Tensor channel_sums = empty({1, 16, 1, 1}, kGpu), column_sums = empty({1, 128}, kGpu);
  const kernels::Pool2dParams pool;
  const kernels::Conv2dParams conv;
  double bytes = 0;
  std::function<void()> run;
  switch (which) {
    case kBiasAdd:
      run = [&] { kernels::binary(kGpu, kernels::BinaryOp::Add, x, bias, out); };
      bytes = 2.0 * x.nbytes();
      break;
    case kPermutedCopy:
      run = [&] { kernels::copy(kGpu, x.permute({0, 2, 3, 1}), permuted); };
      bytes = 2.0 * x.nbytes();
      break;
    case kMaxPool:
      run = [&] { kernels::max_pool2d_forward(kGpu, x, pool, pooled, indices); };
      bytes = static_cast<double>(x.nbytes() + pooled.nbytes() + indices.nbytes());
      break;
    case kConvForward:
      run = [&] { kernels::conv2d_forward(kGpu, x2, w2, b2, conv, conv_out); };
      bytes = static_cast<double>(x2.nbytes() + w2.nbytes() + conv_out.nbytes());
      break;
    case kConvInputGrad:
      run = [&] { kernels::conv2d_backward_input(kGpu, go2, w2, conv, grad_x2); };
      bytes = static_cast<double>(go2.nbytes() + w2.nbytes() + grad_x2.nbytes());
      break;
    case kConvBiasGrad:  // sum over batch, height and width: the kept dim is not the innermost
      run = [&] { kernels::reduce(kGpu, kernels::ReduceOp::Sum, x, 0b1101u, channel_sums, 0.0); };
      bytes = static_cast<double>(x.nbytes());
      break;
    case kLinearBiasGrad:  // sum over the batch of a [256, 128] gradient: a column reduction
      run = [&] { kernels::reduce(kGpu, kernels::ReduceOp::Sum, fc_grad, 0b1u, column_sums, 0.0); };
      bytes = static_cast<double>(fc_grad.nbytes());
      break;
  }
  for (int i = 0; i < 5; ++i) run();
  cuda::synchronize(0);
  time_with_events(state, run, "kernel failed");
  state.counters["GBps"] = benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_IndexedKernel)
    ->ArgName("kernel")
    ->DenseRange(kBiasAdd, kLinearBiasGrad)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

// Host <-> device through Tensor::copy_ (pageable host memory from the CPU allocator).
void BM_CopyHostToDevice(benchmark::State& state) {
  const int64_t bytes = state.range(0);
  const Tensor host = ones({bytes / 4});
  Tensor dev = empty({bytes / 4}, kGpu);
  for (auto _ : state) dev.copy_(host);
  state.SetBytesProcessed(state.iterations() * bytes);
}
BENCHMARK(BM_CopyHostToDevice)->Arg(MiB)->Arg(64 * MiB)->Arg(256 * MiB)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_CopyDeviceToHost(benchmark::State& state) {
  const int64_t bytes = state.range(0);
  const Tensor dev = ones({bytes / 4}, kGpu);
  Tensor host = empty({bytes / 4});
  for (auto _ : state) host.copy_(dev);
  state.SetBytesProcessed(state.iterations() * bytes);
}
BENCHMARK(BM_CopyDeviceToHost)->Arg(MiB)->Arg(64 * MiB)->Arg(256 * MiB)->UseRealTime()->Unit(benchmark::kMillisecond);

// The ceiling: cudaMemcpy from and to pinned memory. range(1): 0 = host to device, 1 = device to host.
void BM_PinnedMemcpy(benchmark::State& state) {
  const auto bytes = static_cast<size_t>(state.range(0));
  const bool to_host = state.range(1) != 0;
  void* pinned = nullptr;
  void* dev = nullptr;
  if (!ok(cudaMallocHost(&pinned, bytes), state, "cudaMallocHost failed")) return;
  if (!ok(cudaMalloc(&dev, bytes), state, "cudaMalloc failed")) {
    cudaFreeHost(pinned);
    return;
  }
  for (auto _ : state) {
    const cudaError_t status = to_host ? cudaMemcpy(pinned, dev, bytes, cudaMemcpyDeviceToHost)
                                       : cudaMemcpy(dev, pinned, bytes, cudaMemcpyHostToDevice);
    if (!ok(status, state, "cudaMemcpy failed")) break;
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  cudaFree(dev);
  cudaFreeHost(pinned);
}
BENCHMARK(BM_PinnedMemcpy)->Args({256 * MiB, 0})->Args({256 * MiB, 1})->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) { return mn_bench::run_cuda_benchmarks(argc, argv, "CUDA runtime benchmarks"); }
