#pragma once
// Strided iteration for CPU kernels: N operands of one shape (inputs may be broadcast views with
// zero strides, or permuted/sliced views). Dimensions that are contiguous for every operand are
// merged, so the common all-contiguous case becomes one flat loop the compiler vectorises; other
// layouts run an odometer over the outer dims. Large loops are split over OpenMP threads by ranges
// of the outer index, so results do not depend on the thread count (nor on the team size the adaptive
// policy picks, core/parallel.h).
#include <omp.h>

#include <array>
#include <cstdint>
#include <tuple>
#include <utility>

#include "core/parallel.h"
#include "core/tensor.h"

namespace mn::kernels::cpu {

// Loops smaller than this run on one thread (parallel start-up costs more than it saves).
constexpr int64_t kParallelGrain = 32768;

// The team for a parallel region over `work` elements: 1 (run it serially) below `grain` or inside a
// region, else the calling thread's team (core/parallel.h: its explicit count, or under the adaptive
// policy the cores other processes leave free). Every region of the CPU kernels takes its size from
// here, as num_threads(team) if (team > 1).
inline int parallel_team(int64_t work, int64_t grain = kParallelGrain) {
  if (work < grain || omp_in_parallel()) return 1;
  return get_num_threads_in_use();
}

template <int N>
struct StridedLoop {
  int ndim = 0;                     // after merging; dims ordered outer -> inner
  int64_t sizes[kMaxDims] = {};
  int64_t strides[N][kMaxDims] = {};  // in bytes
  char* base[N] = {};
  int64_t numel = 0;
  int64_t inner_size() const { return ndim ? sizes[ndim - 1] : 1; }
};

template <int N>
StridedLoop<N> make_loop(const Shape& shape, const std::array<const Tensor*, N>& ops) {
  StridedLoop<N> loop;
  loop.numel = shape.numel();
  for (int k = 0; k < N; ++k) loop.base[k] = static_cast<char*>(ops[k]->raw_data());
  // Collect dims with size > 1, then merge neighbours that are contiguous for every operand.
  for (int d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    const int n = loop.ndim;
    bool merge = n > 0;
    for (int k = 0; k < N && merge; ++k) {
      const int64_t es = static_cast<int64_t>(dtype_size(ops[k]->dtype()));
      merge = loop.strides[k][n - 1] == ops[k]->strides()[d] * es * shape[d];
    }
    if (merge) {
      loop.sizes[n - 1] *= shape[d];
      for (int k = 0; k < N; ++k)
        loop.strides[k][n - 1] = ops[k]->strides()[d] * static_cast<int64_t>(dtype_size(ops[k]->dtype()));
    } else {
      loop.sizes[n] = shape[d];
      for (int k = 0; k < N; ++k)
        loop.strides[k][n] = ops[k]->strides()[d] * static_cast<int64_t>(dtype_size(ops[k]->dtype()));
      loop.ndim = n + 1;
    }
  }
  if (loop.ndim == 0 && loop.numel == 1) {
    loop.ndim = 1;
    loop.sizes[0] = 1;
  }
  return loop;
}

// Calls inner(ptrs, n, strides) for each run of the innermost dimension; ptrs point at the run's
// first element of each operand, strides are the inner byte strides.
template <int N, class F>
void for_each_run(const StridedLoop<N>& loop, F&& inner) {
  if (loop.numel == 0) return;
  const int nd = loop.ndim;
  const int64_t n_inner = loop.inner_size();
  const int64_t n_outer = loop.numel / n_inner;
  int64_t inner_strides[N];
  for (int k = 0; k < N; ++k) inner_strides[k] = loop.strides[k][nd - 1];

  auto run_range = [&](int64_t begin, int64_t end) {
    // Odometer over outer dims [0, nd-1), started at `begin`.
    int64_t counter[kMaxDims] = {};
    int64_t rem = begin;
    for (int d = nd - 2; d >= 0; --d) {
      counter[d] = rem % loop.sizes[d];
      rem /= loop.sizes[d];
    }
    char* ptrs[N];
    for (int k = 0; k < N; ++k) {
      ptrs[k] = loop.base[k];
      for (int d = 0; d < nd - 1; ++d) ptrs[k] += counter[d] * loop.strides[k][d];
    }
    for (int64_t o = begin; o < end; ++o) {
      inner(ptrs, n_inner, inner_strides);
      for (int d = nd - 2; d >= 0; --d) {
        for (int k = 0; k < N; ++k) ptrs[k] += loop.strides[k][d];
        if (++counter[d] < loop.sizes[d]) break;
        for (int k = 0; k < N; ++k) ptrs[k] -= loop.strides[k][d] * loop.sizes[d];
        counter[d] = 0;
      }
    }
  };

  const int team = parallel_team(loop.numel);
  if (team == 1) {
    run_range(0, n_outer);
    return;
  }
  if (n_outer == 1) {
    // One long run: split it into pieces.
#pragma omp parallel num_threads(team)
    {
      const int nt = omp_get_num_threads(), t = omp_get_thread_num();
      const int64_t b = n_inner * t / nt, e = n_inner * (t + 1) / nt;
      if (e > b) {
        char* ptrs[N];
        for (int k = 0; k < N; ++k) ptrs[k] = loop.base[k] + b * inner_strides[k];
        inner(ptrs, e - b, inner_strides);
      }
    }
    return;
  }
#pragma omp parallel num_threads(team)
  {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t b = n_outer * t / nt, e = n_outer * (t + 1) / nt;
    if (e > b) run_range(b, e);
  }
}

// sum over i of f(i) for i in [0, n), in a fixed order: 16 interleaved float sums (vectorised),
// combined in double. Batch norm and the row norms use it for their statistics.
template <class F>
double ordered_sum(int64_t n, F&& f) {
  constexpr int kLanes = 16;
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += f(i + l);
  double total = 0;
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  for (; i < n; ++i) total += f(i);
  return total;
}

// out[i] = op(in[i]...) over out's shape. Operand types are given explicitly:
//   map<float, float, float>(out, [](float a, float b) { return a + b; }, a, b);
template <class Out, class... In, class Op, class... Ts>
void map(Tensor& out, Op op, const Ts&... in) {
  static_assert(sizeof...(In) == sizeof...(Ts));
  constexpr int N = 1 + sizeof...(In);
  auto loop = make_loop<N>(out.sizes(), std::array<const Tensor*, N>{&out, &in...});
  for_each_run<N>(loop, [&](char** p, int64_t n, const int64_t* s) {
    bool contiguous = s[0] == static_cast<int64_t>(sizeof(Out));
    [&]<size_t... I>(std::index_sequence<I...>) {
      ((contiguous = contiguous && s[I + 1] == static_cast<int64_t>(sizeof(In))), ...);
      Out* o = reinterpret_cast<Out*>(p[0]);
      if (contiguous) {
        [[maybe_unused]] auto ins = std::make_tuple(reinterpret_cast<const In*>(p[I + 1])...);
        for (int64_t i = 0; i < n; ++i) o[i] = op(std::get<I>(ins)[i]...);
      } else {
        for (int64_t i = 0; i < n; ++i)
          *reinterpret_cast<Out*>(p[0] + i * s[0]) = op(*reinterpret_cast<const In*>(p[I + 1] + i * s[I + 1])...);
      }
    }(std::index_sequence_for<In...>{});
  });
}

}  // namespace mn::kernels::cpu
