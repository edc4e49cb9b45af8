#include "kernels/cpu/conv_implicit.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "kernels/cpu/packed_tiles.h"

namespace mn::kernels::cpu {

namespace {
bool enabled_from_environment() {
  const char* v = std::getenv("MN_CPU_CONV");
  return implicit_conv_built() && (v == nullptr || std::string(v) != "im2col");
}
std::atomic<bool> g_enabled{enabled_from_environment()};
}  // namespace

void set_implicit_conv(bool enabled) { g_enabled.store(implicit_conv_built() && enabled, std::memory_order_relaxed); }
bool implicit_conv_enabled() { return g_enabled.load(std::memory_order_relaxed); }

#if defined(__AVX512F__)

bool implicit_conv_built() { return true; }

namespace {

using packed::kMr;
using packed::kNr;
using packed::kVectors;
using packed::Store;

// Part of a vector of 16 consecutive output positions: the lanes in `mask` read padded floats
// base + index[l] (plus the K row's offset), all within 32 floats of base, so one two-source permute
// of two loads builds them. Positions of one image row are one run (every stride_w-th float); a vector
// spanning rows or samples takes one segment per run that does not fit the window of the one before.
struct Segment {
  alignas(64) int32_t index[16];
  int64_t base;
  __mmask16 mask;
};

// The segments of a panel's kVectors vectors. At most 16 per vector (one per lane).
struct PanelLayout {
  Segment segments[kVectors][16];
  int count[kVectors];
  int64_t width;  // output positions in the panel (kNr but at the batch's end)
};

struct Geometry {
  const PaddedConv& s;
  int64_t channels, out_channels, positions, total;  // positions: per sample; total: of the batch
  int64_t sample_floats;                             // one sample's padded planes
  int64_t ring;                                      // samples a thread holds padded (sample n in slot n % ring)
};

// The segments of the vector of output positions q0 .. q0 + lanes (lanes <= 16; later lanes stay
// zero); returns their count. Positions are walked with running (sample, row, column) counters.
int describe_vector(const Geometry& g, int64_t q0, int lanes, Segment* segments) {
  const PaddedConv& s = g.s;
  const int64_t pw = s.padded_w();
  const int64_t n = q0 / g.positions, rem = q0 % g.positions;
  int64_t slot = n % g.ring, oy = rem / s.out_w, ox = rem % s.out_w;
  int count = 0;
  for (int l = 0; l < lanes; ++l) {
    const int64_t offset = slot * g.sample_floats + oy * s.stride_h * pw + ox * s.stride_w;
    // Samples' positions are more than 32 floats apart, and the ring may put the next sample first.
    if (count == 0 || offset < segments[count - 1].base || offset - segments[count - 1].base >= 32) {
      Segment& seg = segments[count++];
      seg.base = offset;
      seg.mask = 0;
      std::fill(seg.index, seg.index + 16, 0);
    }
    Segment& seg = segments[count - 1];
    seg.index[l] = static_cast<int32_t>(offset - seg.base);
    seg.mask = static_cast<__mmask16>(seg.mask | (1u << l));
    if (++ox == s.out_w) {
      ox = 0;
      if (++oy == s.out_h) oy = 0, slot = slot + 1 == g.ring ? 0 : slot + 1;
    }
  }
  return count;
}

// The layout of the panel starting at output position q0.
void describe_panel(const Geometry& g, int64_t q0, PanelLayout& layout) {
  layout.width = std::min<int64_t>(kNr, g.total - q0);
  for (int v = 0; v < kVectors; ++v) {
    const int lanes = static_cast<int>(std::clamp<int64_t>(layout.width - 16 * v, 0, 16));
    layout.count[v] = describe_vector(g, q0 + 16 * v, lanes, layout.segments[v]);
  }
}

// One segment's lanes for the K row whose padded offset is `row`.
inline __m512 gather_segment(const float* padded, const Segment& seg, const __m512i index, int64_t row) {
  const float* from = padded + seg.base + row;
  return _mm512_permutex2var_ps(_mm512_loadu_ps(from), index, _mm512_loadu_ps(from + 16));
}

// The vector of a described position vector (count segments) for the K row at padded offset `row`.
inline __m512 gather_vector(const float* padded, const Segment* seg, int count, int64_t row) {
  __m512 a = _mm512_maskz_mov_ps(seg[0].mask, gather_segment(padded, seg[0], _mm512_load_si512(seg[0].index), row));
  for (int i = 1; i < count; ++i)
    a = _mm512_mask_mov_ps(a, seg[i].mask, gather_segment(padded, seg[i], _mm512_load_si512(seg[i].index), row));
  return a;
}

// The B panel (kc x kNr, 64-byte aligned) for K rows [pc, pc + kc): element (k, j) is the padded float
// at the panel's position j plus row_offset[pc + k]. Lanes past the batch's end are zero.
void pack_panel(const float* padded, const PanelLayout& layout, const int64_t* row_offset, int64_t kc, float* bp) {
  for (int v = 0; v < kVectors; ++v) {
    float* dst = bp + 16 * v;
    const Segment* seg = layout.segments[v];
    const int count = layout.count[v];
    if (count == 0) {
      for (int64_t k = 0; k < kc; ++k) _mm512_store_ps(dst + k * kNr, _mm512_setzero_ps());
    } else if (count == 1) {
      const __m512i i0 = _mm512_load_si512(seg[0].index);
      const __mmask16 m0 = seg[0].mask;
      for (int64_t k = 0; k < kc; ++k)
        _mm512_store_ps(dst + k * kNr, _mm512_maskz_mov_ps(m0, gather_segment(padded, seg[0], i0, row_offset[k])));
    } else if (count == 2) {
      const __m512i i0 = _mm512_load_si512(seg[0].index), i1 = _mm512_load_si512(seg[1].index);
      const __mmask16 m0 = seg[0].mask, m1 = seg[1].mask;
      for (int64_t k = 0; k < kc; ++k) {
        const __m512 a = _mm512_maskz_mov_ps(m0, gather_segment(padded, seg[0], i0, row_offset[k]));
        _mm512_store_ps(dst + k * kNr, _mm512_mask_mov_ps(a, m1, gather_segment(padded, seg[1], i1, row_offset[k])));
      }
    } else {
      for (int64_t k = 0; k < kc; ++k) _mm512_store_ps(dst + k * kNr, gather_vector(padded, seg, count, row_offset[k]));
    }
  }
}

// out (contiguous [batch, out_channels, positions]) = the panel's C (out_channels x kNr, row stride
// kNr) for the panel's positions q0 .. q0 + width.
void write_panel(const Geometry& g, const float* c, int64_t q0, int64_t width, float* out) {
  for (int64_t done = 0; done < width;) {
    const int64_t q = q0 + done, n = q / g.positions, p = q % g.positions;
    const int64_t run = std::min(width - done, g.positions - p);
    for (int64_t o = 0; o < g.out_channels; ++o) copy_run(out + (n * g.out_channels + o) * g.positions + p, c + o * kNr + done, run);
    done += run;
  }
}

// Each column-matrix row's offset within a sample's padded planes.
std::vector<int64_t> row_offsets(const PaddedConv& s, int64_t channels) {
  const int64_t kk = s.kernel_h * s.kernel_w;
  std::vector<int64_t> offset(static_cast<size_t>(channels * kk));
  for (int64_t r = 0; r < channels * kk; ++r) {
    const int64_t c = r / kk, ki = (r / s.kernel_w) % s.kernel_h, kj = r % s.kernel_w;
    offset[static_cast<size_t>(r)] = c * s.plane() + ki * s.dilation_h * s.padded_w() + kj * s.dilation_w;
  }
  return offset;
}

// run(t, begin, end) over [0, count) in `team` contiguous ranges, range t on OpenMP thread t (team 1: the
// calling thread alone).
template <class Run>
void split_ranges(int team, int64_t count, Run&& run) {
  if (team == 1) return run(0, 0, count);
#pragma omp parallel num_threads(team)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    run(t, count * t / nt, count * (t + 1) / nt);
  }
}

// Where output position q's window starts in its sample's padded planes.
int64_t window_offset(const PaddedConv& s, int64_t q) {
  return q / s.out_w * s.stride_h * s.padded_w() + q % s.out_w * s.stride_w;
}

// Where the column matrix's values sit for the tiles that broadcast them: output position q's window at
// pos[q] and column-matrix row r at rows[r] from a sample's base. Padded geometries read a padded copy of
// each sample (row_offsets, window_offset); unpadded ones read x itself at its own strides (`in_place`),
// the same values without the copy.
struct WindowOffsets {
  bool in_place;
  std::vector<int64_t> pos, rows;
};
WindowOffsets window_offsets(const PaddedConv& s, int64_t channels, const ConvSource& x) {
  WindowOffsets o{s.pad_h == 0 && s.pad_w == 0, std::vector<int64_t>(static_cast<size_t>(s.out_h * s.out_w)), {}};
  if (!o.in_place) {
    for (int64_t q = 0; q < s.out_h * s.out_w; ++q) o.pos[static_cast<size_t>(q)] = window_offset(s, q);
    o.rows = row_offsets(s, channels);
    return o;
  }
  for (int64_t q = 0; q < s.out_h * s.out_w; ++q)
    o.pos[static_cast<size_t>(q)] = q / s.out_w * s.stride_h * x.stride_h + q % s.out_w * s.stride_w * x.stride_w;
  const int64_t kk = s.kernel_h * s.kernel_w;
  o.rows.resize(static_cast<size_t>(channels * kk));
  for (int64_t r = 0; r < channels * kk; ++r)
    o.rows[static_cast<size_t>(r)] = r / kk * x.stride_c + (r / s.kernel_w) % s.kernel_h * s.dilation_h * x.stride_h +
                                     r % s.kernel_w * s.dilation_w * x.stride_w;
  return o;
}

// Scratch floats from the caching allocator: 64-byte aligned, and a call that comes again takes its
// cached block instead of fresh pages (std::aligned_alloc of megabytes mapped and zeroed new pages on
// every call: a resnet18 step spent a third of its time in page faults).
struct Scratch {
  Tensor tensor;
  float* get() const { return tensor.data<float>(); }
};
Scratch aligned_floats(int64_t count) { return {empty({std::max<int64_t>(count, 16)})}; }

// A tile's sums into C (R x 16 NV floats at c, row stride ldc): overwritten, or added to C as the packed
// GEMM's tile adds them (C + sum), per `store`; the last vector writes only the lanes in `last`.
template <int R, int NV>
inline void store_tile(const __m512 (&acc)[R][NV], float* c, int64_t ldc, __mmask16 last, Store store) {
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 m = v == NV - 1 ? last : static_cast<__mmask16>(0xFFFF);
      float* dst = c + i * ldc + 16 * v;
      __m512 value = acc[i][v];
      if (store == Store::kAdd) value = _mm512_add_ps(_mm512_maskz_loadu_ps(m, dst), value);
      _mm512_mask_storeu_ps(dst, m, value);
    }
}

// The direct forward's register tile: R rows of packed weights (ap: the packed GEMM's A panel, kc x kMr)
// times NV vectors of 16 consecutive padded positions read in place, K row k's at b + b_off[k] + 16 v,
// summed over the K block; then C updated per `store`. The same chains as packed::tile over a packed
// copy of those vectors.
template <int R, int NV>
void direct_tile(int64_t kc, const float* __restrict ap, const float* b, const int64_t* b_off, float* c, int64_t ldc,
                 __mmask16 last, Store store) {
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  packed::accumulate<R, NV>(kc, ap, [b, b_off](int64_t k, int v) { return _mm512_loadu_ps(b + b_off[k] + 16 * v); },
                            acc);
  store_tile<R, NV>(acc, c, ldc, last, store);
}

using DirectTileFn = void (*)(int64_t, const float*, const float*, const int64_t*, float*, int64_t, __mmask16, Store);
// direct_tile<rows, nv> for rows 1..8 and nv 1..3, at [(rows - 1) * 3 + nv - 1].
template <size_t... I>
constexpr std::array<DirectTileFn, sizeof...(I)> direct_tiles(std::index_sequence<I...>) {
  return {&direct_tile<static_cast<int>(I / 3 + 1), static_cast<int>(I % 3 + 1)>...};
}
constexpr auto kDirectTiles = direct_tiles(std::make_index_sequence<24>());
DirectTileFn direct_tile_for(int rows, int nv) { return kDirectTiles[static_cast<size_t>((rows - 1) * 3 + nv - 1)]; }

// The register tile whose rows are broadcast in place from padded planes: row i's value for K index q at
// xp[i][pos[q]], times NV vectors at gt + q * ldb (64-byte aligned), summed over q0 <= q < q1 in order; then
// C (R x 16 NV floats at c, row stride ldc) overwritten or added to per `store`, the last vector writing
// only the lanes in `last`. For the weight gradient the rows are column-matrix rows, K the output
// positions and the vectors grad_out^T; for channel_vector_conv the rows are output positions, K the
// column-matrix rows and the vectors W^T. Either way each element is the chain the packed GEMM's tile
// forms for the column path's product over the same K block (x * g and g * x round alike), so the bits
// are that path's.
template <int R, int NV>
void broadcast_tile(int64_t q0, int64_t q1, const float* const* xp, const int64_t* pos, const float* gt, int64_t ldb,
                float* c, int64_t ldc, __mmask16 last, Store store) {
  const float* p[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) p[i] = xp[i];
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t q = q0; q < q1; ++q) {
    const int64_t po = pos[q];
    __m512 b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = _mm512_load_ps(gt + q * ldb + 16 * v);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512 a = _mm512_set1_ps(p[i][po]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(a, b[v], acc[i][v]);
    }
  }
  store_tile<R, NV>(acc, c, ldc, last, store);
}

using BroadcastTileFn = void (*)(int64_t, int64_t, const float* const*, const int64_t*, const float*, int64_t, float*,
                             int64_t, __mmask16, Store);
// broadcast_tile<rows, nv> for rows 1..8 and nv 1..4, at [(rows - 1) * 4 + nv - 1].
template <size_t... I>
constexpr std::array<BroadcastTileFn, sizeof...(I)> broadcast_tiles(std::index_sequence<I...>) {
  return {&broadcast_tile<static_cast<int>(I / 4 + 1), static_cast<int>(I % 4 + 1)>...};
}
constexpr auto kBroadcastTiles = broadcast_tiles(std::make_index_sequence<32>());
BroadcastTileFn broadcast_tile_for(int rows, int nv) { return kBroadcastTiles[static_cast<size_t>((rows - 1) * 4 + nv - 1)]; }

// Every row of a product C (rows x cols floats, row stride cols) over the K range [k0, k1) through
// broadcast_tile: row i's broadcasts at base + row_base[i] + k_off[k], the vectors of K row k at b + k * ldb
// (ldb = 16 * ceil(cols / 16), zero past cols). Tiles of 6 rows x 4 vectors when the columns fill groups of
// four vectors (64, 128), else 8 x 3 and a 1- or 2-vector rest: 24 accumulators either way.
void broadcast_product(const float* base, const int64_t* row_base, int64_t rows, int64_t k0, int64_t k1,
                       const int64_t* k_off, const float* b, int64_t ldb, int64_t cols, float* c, Store store) {
  const int64_t vectors = ldb / 16;
  const int nv_main = vectors % 4 == 0 ? 4 : 3, rows_main = nv_main == 4 ? 6 : 8;
  for (int64_t r0 = 0; r0 < rows; r0 += rows_main) {
    const int rr = static_cast<int>(std::min<int64_t>(rows_main, rows - r0));
    const float* xp[8];
    for (int i = 0; i < rr; ++i) xp[i] = base + row_base[r0 + i];
    for (int64_t v0 = 0; v0 < vectors; v0 += nv_main) {
      const int nv = static_cast<int>(std::min<int64_t>(nv_main, vectors - v0));
      const __mmask16 last = packed::low_lanes(cols - 16 * (v0 + nv - 1));
      broadcast_tile_for(rr, nv)(k0, k1, xp, k_off, b + 16 * v0, ldb, c + r0 * cols + 16 * v0, cols, last, store);
    }
  }
}

// gt[q * ldb + o] = g[o * positions + q] for o < rows, q < positions; zero for rows <= o < ldb.
void transpose_rows(const float* g, int64_t rows, int64_t positions, float* gt, int64_t ldb) {
  const int64_t r8 = rows / 8 * 8, q8 = positions / 8 * 8;
  for (int64_t o = 0; o < r8; o += 8) {
    for (int64_t q = 0; q < q8; q += 8) packed::transpose8x8(g + o * positions + q, positions, gt + q * ldb + o, ldb);
    for (int64_t q = q8; q < positions; ++q)
      for (int64_t i = 0; i < 8; ++i) gt[q * ldb + o + i] = g[(o + i) * positions + q];
  }
  for (int64_t q = 0; q < positions; ++q) {
    for (int64_t o = r8; o < rows; ++o) gt[q * ldb + o] = g[o * positions + q];
    std::fill(gt + q * ldb + rows, gt + (q + 1) * ldb, 0.0f);
  }
}

// The weights [rows, k] packed once, block after block of K (packed::k_block(k)): ceil(rows / kMr) * kMr
// x kc floats per block, as the packed GEMM packs A.
Scratch pack_weights(const float* w, int64_t rows, int64_t k) {
  const int64_t kc_max = packed::k_block(k), rows_padded = (rows + kMr - 1) / kMr * kMr;
  auto ap = aligned_floats(rows_padded * k);
  for (int64_t pc = 0; pc < k; pc += kc_max)
    packed::pack_a(w + pc, k, 1, rows, std::min(kc_max, k - pc), ap.get() + pc * rows_padded);
  return ap;
}

}  // namespace

void implicit_conv(const PaddedConv& s, int64_t batch, int64_t channels, int64_t out_channels, const ConvSource& x,
                   const float* w, const float* bias, float* out, int threads) {
  const int64_t kk = s.kernel_h * s.kernel_w, k = channels * kk, positions = s.out_h * s.out_w;
  // A panel spans at most (kNr - 1) / positions + 2 samples.
  const int64_t ring = std::min<int64_t>(batch, (kNr - 1) / std::max<int64_t>(positions, 1) + 2);
  const Geometry g{s, channels, out_channels, positions, batch * positions, channels * s.plane(), ring};
  if (g.total == 0 || out_channels == 0) return;
  const std::vector<int64_t> row_offset = row_offsets(s, channels);
  const int64_t kc_max = packed::k_block(k), rows_padded = (out_channels + kMr - 1) / kMr * kMr;
  const auto ap = pack_weights(w, out_channels, k);

  const int64_t panels = (g.total + kNr - 1) / kNr;
  const int team = static_cast<int>(std::clamp<int64_t>(threads, 1, panels));
  // Per thread: a B panel, the panel's C, its layout and the ring of padded samples (each sample is padded
  // when a panel first needs it, so the padded planes stay in cache), allocated here so that nothing
  // inside the parallel region can throw.
  const int64_t ring_floats = (ring * g.sample_floats + 15) / 16 * 16;
  const int64_t per_thread = kc_max * kNr + rows_padded * kNr + ring_floats;
  auto buffers = aligned_floats(team * per_thread);
  std::vector<PanelLayout> layouts(static_cast<size_t>(team));
  std::vector<int64_t> held(static_cast<size_t>(team * ring), -1);  // the sample in each slot
  auto run = [&](int t, int64_t p_begin, int64_t p_end) {
    float* bp = buffers.get() + t * per_thread;
    float* c = bp + kc_max * kNr;
    float* padded = c + rows_padded * kNr;
    int64_t* slots = held.data() + t * ring;
    PanelLayout& layout = layouts[static_cast<size_t>(t)];
    for (int64_t p = p_begin; p < p_end; ++p) {
      const int64_t q0 = p * kNr;
      describe_panel(g, q0, layout);
      for (int64_t n = q0 / positions; n <= (q0 + layout.width - 1) / positions; ++n) {
        int64_t& slot = slots[n % ring];
        if (slot == n) continue;
        pad_channels(s, x.data + n * x.stride_n, x.stride_c, x.stride_h, x.stride_w, padded + (n % ring) * g.sample_floats,
                     0, channels);
        slot = n;
      }
      const int nv = static_cast<int>((layout.width + 15) / 16);
      const __mmask16 last = packed::low_lanes(layout.width - 16 * (nv - 1));
      if (bias != nullptr)  // the sums start from the bias, as the column path's GEMM onto it does
        for (int64_t o = 0; o < out_channels; ++o)
          for (int v = 0; v < kVectors; ++v) _mm512_store_ps(c + o * kNr + 16 * v, _mm512_set1_ps(bias[o]));
      for (int64_t pc = 0; pc < k; pc += kc_max) {
        const int64_t kc = std::min(kc_max, k - pc);
        pack_panel(padded, layout, row_offset.data() + pc, kc, bp);
        const Store store = pc == 0 && bias == nullptr ? Store::kOverwrite : Store::kAdd;
        const float* a_block = ap.get() + pc * rows_padded;
        for (int64_t ir = 0; ir < out_channels; ir += kMr) {
          const int rows = static_cast<int>(std::min<int64_t>(kMr, out_channels - ir));
          packed::tile_for(rows, nv)(kc, a_block + ir * kc, bp, c + ir * kNr, kNr, last, store, 1.0f, 0.0f);
        }
      }
      write_panel(g, c, q0, layout.width, out);
    }
  };
  split_ranges(team, panels, run);
}

double direct_lane_use(const PaddedConv& s) {
  if (s.stride_h != 1 || s.stride_w != 1 || (s.kernel_w - 1) * s.dilation_w > 17) return 0.0;
  const int64_t span = s.out_h * s.padded_w(), full = span / kNr * kNr;
  const int64_t lanes = full + (span - full + 15) / 16 * 16;
  return lanes == 0 ? 0.0 : static_cast<double>(s.out_h * s.out_w) / static_cast<double>(lanes);
}

void direct_conv(const PaddedConv& s, int64_t batch, int64_t channels, int64_t out_channels, const ConvSource& x,
                 const float* w, const float* bias, float* out, int threads) {
  const int64_t k = channels * s.kernel_h * s.kernel_w, pw = s.padded_w(), positions = s.out_h * s.out_w;
  // A sample's outputs in padded coordinates: row oy, column ox < pw at oy * pw + ox (ox >= out_w computed
  // and dropped), so that each K row's 16 positions are 16 consecutive padded floats.
  const int64_t span = s.out_h * pw, per_sample = (span + kNr - 1) / kNr, panels = batch * per_sample;
  if (panels == 0 || out_channels == 0) return;
  const std::vector<int64_t> row_offset = row_offsets(s, channels);
  const int64_t kc_max = packed::k_block(k), rows_padded = (out_channels + kMr - 1) / kMr * kMr;
  const auto ap = pack_weights(w, out_channels, k);
  const int team = static_cast<int>(std::clamp<int64_t>(threads, 1, panels));
  const int64_t sample_floats = (channels * s.plane() + 15) / 16 * 16, per_thread = rows_padded * kNr + sample_floats;
  auto buffers = aligned_floats(team * per_thread);  // per thread: the panel's C, the padded sample
  auto run = [&](int t, int64_t p_begin, int64_t p_end) {
    float* c = buffers.get() + t * per_thread;
    float* padded = c + rows_padded * kNr;
    int64_t held = -1;
    for (int64_t p = p_begin; p < p_end; ++p) {
      const int64_t n = p / per_sample, q0 = p % per_sample * kNr, width = std::min<int64_t>(kNr, span - q0);
      if (held != n) {
        pad_channels(s, x.data + n * x.stride_n, x.stride_c, x.stride_h, x.stride_w, padded, 0, channels);
        held = n;
      }
      const int nv = static_cast<int>((width + 15) / 16);
      const __mmask16 last = packed::low_lanes(width - 16 * (nv - 1));
      if (bias != nullptr)  // the sums start from the bias, as the column path's GEMM onto it does
        for (int64_t o = 0; o < out_channels; ++o)
          for (int v = 0; v < kVectors; ++v) _mm512_store_ps(c + o * kNr + 16 * v, _mm512_set1_ps(bias[o]));
      for (int64_t pc = 0; pc < k; pc += kc_max) {
        const int64_t kc = std::min(kc_max, k - pc);
        const Store store = pc == 0 && bias == nullptr ? Store::kOverwrite : Store::kAdd;
        const float* a_block = ap.get() + pc * rows_padded;
        for (int64_t ir = 0; ir < out_channels; ir += kMr) {
          const int rows = static_cast<int>(std::min<int64_t>(kMr, out_channels - ir));
          direct_tile_for(rows, nv)(kc, a_block + ir * kc, padded + q0, row_offset.data() + pc, c + ir * kNr, kNr, last,
                                    store);
        }
      }
      // The panel's real positions, one image row's run at a time.
      for (int64_t oy = q0 / pw; oy * pw < q0 + width; ++oy) {
        const int64_t lo = std::max(q0, oy * pw) - oy * pw, hi = std::min(q0 + width - oy * pw, s.out_w);
        if (hi <= lo) continue;
        for (int64_t o = 0; o < out_channels; ++o)
          copy_run(out + (n * out_channels + o) * positions + oy * s.out_w + lo, c + o * kNr + oy * pw + lo - q0, hi - lo);
      }
    }
  };
  split_ranges(team, panels, run);
}

void channel_vector_conv(const PaddedConv& s, int64_t batch, int64_t channels, int64_t out_channels,
                         const ConvSource& x, const float* w, const float* bias, float* out, int threads) {
  const int64_t k = channels * s.kernel_h * s.kernel_w, positions = s.out_h * s.out_w;
  if (batch == 0 || positions == 0 || out_channels == 0) return;
  const int64_t vectors = (out_channels + 15) / 16, ldb = 16 * vectors;
  const int64_t kc_max = packed::k_block(std::max<int64_t>(k, 1));
  const WindowOffsets offsets = window_offsets(s, channels, x);  // unpadded: broadcast from x itself
  // W^T [k, ldb], zero past out_channels: row r holds every output channel's weight r.
  auto wt = aligned_floats(std::max<int64_t>(k, 1) * ldb);
  transpose_rows(w, out_channels, k, wt.get(), ldb);
  // Samples go in groups of S with at least kGroupRows output positions in all (or the whole batch), so
  // that each block of W^T read serves that many rows; every row's broadcasts start at its sample's padded
  // planes in the group's buffer.
  constexpr int64_t kGroupRows = 96;
  const int64_t per_group = std::min(batch, (kGroupRows + positions - 1) / positions), rows = per_group * positions;
  const int64_t groups = (batch + per_group - 1) / per_group;
  const int64_t sample_floats = offsets.in_place ? 0 : (channels * s.plane() + 15) / 16 * 16;
  const int64_t sample_step = offsets.in_place ? x.stride_n : sample_floats;
  std::vector<int64_t> row_base(static_cast<size_t>(rows));
  for (int64_t i = 0; i < per_group; ++i)
    for (int64_t q = 0; q < positions; ++q)
      row_base[static_cast<size_t>(i * positions + q)] = i * sample_step + offsets.pos[static_cast<size_t>(q)];

  const int team = static_cast<int>(std::clamp<int64_t>(threads, 1, groups));
  const int64_t c_floats = (rows * out_channels + 15) / 16 * 16, per_thread = per_group * sample_floats + c_floats;
  auto buffers = aligned_floats(team * per_thread);  // per thread: the group's padded samples, outputs [row, o]
  auto run = [&](int t, int64_t g_begin, int64_t g_end) {
    float* padded = buffers.get() + t * per_thread;
    float* ct = padded + per_group * sample_floats;
    for (int64_t group = g_begin; group < g_end; ++group) {
      const int64_t n0 = group * per_group, count = std::min(per_group, batch - n0), used = count * positions;
      for (int64_t i = 0; i < count && !offsets.in_place; ++i)
        pad_channels(s, x.data + (n0 + i) * x.stride_n, x.stride_c, x.stride_h, x.stride_w, padded + i * sample_floats, 0,
                     channels);
      const float* base = offsets.in_place ? x.data + n0 * x.stride_n : padded;
      if (bias != nullptr)  // the sums start from the bias, as the column path's GEMM onto it does
        for (int64_t r = 0; r < used; ++r) std::copy(bias, bias + out_channels, ct + r * out_channels);
      for (int64_t pc = 0; pc < k; pc += kc_max) {
        const int64_t k1 = std::min(k, pc + kc_max);
        const Store store = pc == 0 && bias == nullptr ? Store::kOverwrite : Store::kAdd;
        broadcast_product(base, row_base.data(), used, pc, k1, offsets.rows.data(), wt.get(), ldb, out_channels, ct,
                          store);
      }
      for (int64_t i = 0; i < count; ++i)
        transpose_rows(ct + i * positions * out_channels, positions, out_channels,
                       out + (n0 + i) * out_channels * positions, positions);
    }
  };
  split_ranges(team, groups, run);
}

void implicit_conv_weight_grad(const PaddedConv& s, int64_t batch, int64_t channels, int64_t out_channels,
                               const ConvSource& x, const float* grad_out, float* grad_weight, int64_t chunks,
                               int threads) {
  const int64_t rows = channels * s.kernel_h * s.kernel_w, positions = s.out_h * s.out_w;
  const int64_t weight_size = rows * out_channels;
  if (weight_size == 0) return;
  chunks = std::max<int64_t>(chunks, 1);
  const int64_t vectors = (out_channels + 15) / 16, ldb = 16 * vectors;
  const int64_t kc_max = packed::k_block(std::max<int64_t>(positions, 1));
  // Unpadded geometries (1 x 1 stride-2 shortcuts, unpadded 3 x 3 and 5 x 5 layers) broadcast from x.
  const WindowOffsets offsets = window_offsets(s, channels, x);
  const bool in_place = offsets.in_place;
  const int64_t* pos = offsets.pos.data();
  const int64_t* row_offset = offsets.rows.data();

  const int team = static_cast<int>(std::clamp<int64_t>(threads, 1, chunks));
  const int64_t sample_floats = in_place ? 0 : (channels * s.plane() + 15) / 16 * 16;
  const int64_t per_thread = sample_floats + std::max<int64_t>(positions, 1) * ldb;
  // Each chunk's sum as C^T [rows, out_channels]; everything allocated here so that nothing inside the
  // parallel region can throw.
  auto partial = aligned_floats(chunks * weight_size);
  auto buffers = aligned_floats(team * per_thread);
  auto run_chunk = [&](int t, int64_t chunk) {
    float* padded = buffers.get() + t * per_thread;
    float* gt = padded + sample_floats;
    float* acc = partial.get() + chunk * weight_size;
    const int64_t n_begin = batch * chunk / chunks, n_end = batch * (chunk + 1) / chunks;
    if (n_begin == n_end || positions == 0) std::fill(acc, acc + weight_size, 0.0f);
    for (int64_t n = n_begin; n < n_end && positions > 0; ++n) {
      const float* sample = x.data + n * x.stride_n;
      if (!in_place) pad_channels(s, sample, x.stride_c, x.stride_h, x.stride_w, padded, 0, channels);
      transpose_rows(grad_out + n * out_channels * positions, out_channels, positions, gt, ldb);
      for (int64_t pc = 0; pc < positions; pc += kc_max) {
        const int64_t q1 = std::min(positions, pc + kc_max);
        const Store store = n == n_begin && pc == 0 ? Store::kOverwrite : Store::kAdd;
        broadcast_product(in_place ? sample : padded, row_offset, rows, pc, q1, pos, gt, ldb, out_channels, acc,
                          store);
      }
    }
  };
  if (team == 1) {
    for (int64_t chunk = 0; chunk < chunks; ++chunk) run_chunk(0, chunk);
  } else {
#pragma omp parallel for schedule(static) num_threads(team)
    for (int64_t chunk = 0; chunk < chunks; ++chunk) run_chunk(omp_get_thread_num(), chunk);
  }
  // The chunks' sums added in chunk order (as the column path adds them) into the first, then transposed
  // into [out_channels, rows].
  sum_in_order(partial.get(), chunks, weight_size, partial.get());
  transpose_rows(partial.get(), rows, out_channels, grad_weight, rows);
}



namespace {
// One sample's share of lane_weight_grad for output channels [o0, o0 + OT): lanes[(o * R + r) * 16 + l]
// += the sum over the positions that lane l takes (columns ox = 16 b + l of every output row) of
// grad_out[o, q] * col[r, q]. The lanes past a row's end hold no position: their multiply-adds are masked
// off, so what the next row (or anything) holds there never enters a sum.
template <int R, int OT>
void lane_sums(const PaddedConv& s, const float* padded, const int64_t* row_offset, const float* g, const float* g_end,
               int64_t o0, float* lanes) {
  const int64_t positions = s.out_h * s.out_w, pw = s.padded_w();
  __m512 acc[OT][R];
#pragma GCC unroll 2
  for (int t = 0; t < OT; ++t)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  for (int64_t oy = 0; oy < s.out_h; ++oy) {
    const float* g_row = g + o0 * positions + oy * s.out_w;
    for (int64_t ox = 0; ox < s.out_w; ox += 16) {
      const __mmask16 m = lanes_mask(s.out_w - ox);
      // Whole loads unless the last channel's 16 floats would pass the end of grad_out.
      const bool whole = g_end - (g_row + (OT - 1) * positions + ox) >= 16;
      __m512 gv[OT];
#pragma GCC unroll 2
      for (int t = 0; t < OT; ++t)
        gv[t] = whole ? _mm512_loadu_ps(g_row + t * positions + ox) : _mm512_maskz_loadu_ps(m, g_row + t * positions + ox);
      const float* x = padded + oy * pw + ox;
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_loadu_ps(x + row_offset[r]);
#pragma GCC unroll 2
        for (int t = 0; t < OT; ++t) acc[t][r] = _mm512_mask3_fmadd_ps(xv, gv[t], acc[t][r], m);
      }
    }
  }
#pragma GCC unroll 2
  for (int t = 0; t < OT; ++t)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      float* dst = lanes + ((o0 + t) * R + r) * 16;
      _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), acc[t][r]));
    }
}

template <int R>
void lane_sums_all(const PaddedConv& s, const float* padded, const int64_t* row_offset, const float* g,
                   const float* g_end, int64_t out_channels, float* lanes) {
  // Two output channels per sweep where their 2 R accumulators and R loads fit the 32 registers.
  constexpr int kPair = R <= 12 ? 2 : 1;
  int64_t o = 0;
  for (; o + kPair <= out_channels; o += kPair) lane_sums<R, kPair>(s, padded, row_offset, g, g_end, o, lanes);
  for (; o < out_channels; ++o) lane_sums<R, 1>(s, padded, row_offset, g, g_end, o, lanes);
}

using LaneSums = void (*)(const PaddedConv&, const float*, const int64_t*, const float*, const float*, int64_t, float*);

template <int... Rs>
LaneSums lane_sums_for(int64_t rows, std::integer_sequence<int, Rs...>) {
  LaneSums found = nullptr;
  ((rows == Rs + 1 ? (found = &lane_sums_all<Rs + 1>, 0) : 0), ...);
  return found;
}
}  // namespace

bool lane_weight_grad_fits(const PaddedConv& s, int64_t channels) {
  const int64_t rows = channels * s.kernel_h * s.kernel_w;
  return rows >= 1 && rows < kLaneWeightGradRows && s.stride_h == 1 && s.stride_w == 1 && s.out_w >= 1;
}

void lane_weight_grad(const PaddedConv& s, int64_t batch, int64_t channels, int64_t out_channels, const ConvSource& x,
                      const float* grad_out, float* grad_weight, int64_t chunks, int threads) {
  const int64_t rows = channels * s.kernel_h * s.kernel_w, positions = s.out_h * s.out_w;
  const int64_t weight_size = rows * out_channels;
  if (weight_size == 0) return;
  MN_CHECK(lane_weight_grad_fits(s, channels), ValueError, "lane_weight_grad: expected unit stride and fewer than ",
           kLaneWeightGradRows, " column rows, got ", rows, " rows at stride ", s.stride_h, " x ", s.stride_w);
  const LaneSums sums = lane_sums_for(rows, std::make_integer_sequence<int, kLaneWeightGradRows - 1>{});
  chunks = std::max<int64_t>(chunks, 1);
  const std::vector<int64_t> row_offset = row_offsets(s, channels);
  const int team = static_cast<int>(std::clamp<int64_t>(threads, 1, chunks));
  const int64_t sample_floats = (channels * s.plane() + 15) / 16 * 16;
  const float* g_end = grad_out + batch * out_channels * positions;
  // Per chunk its 16 lane sums of every weight; per thread a padded sample.
  auto lanes = aligned_floats(chunks * weight_size * 16);
  auto buffers = aligned_floats(team * sample_floats);
  auto run_chunk = [&](int t, int64_t chunk) {
    float* padded = buffers.get() + t * sample_floats;
    float* chunk_lanes = lanes.get() + chunk * weight_size * 16;
    std::fill(chunk_lanes, chunk_lanes + weight_size * 16, 0.0f);
    const int64_t n_begin = batch * chunk / chunks, n_end = batch * (chunk + 1) / chunks;
    for (int64_t n = n_begin; n < n_end && positions > 0; ++n) {
      pad_channels(s, x.data + n * x.stride_n, x.stride_c, x.stride_h, x.stride_w, padded, 0, channels);
      sums(s, padded, row_offset.data(), grad_out + n * out_channels * positions, g_end, out_channels, chunk_lanes);
    }
  };
  split_ranges(team, chunks, [&](int t, int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) run_chunk(t, chunk);
  });
  // Each chunk's 16 lanes added in lane order, then the chunks in chunk order.
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const float* chunk_lanes = lanes.get() + chunk * weight_size * 16;
    for (int64_t i = 0; i < weight_size; ++i) {
      float total = 0.0f;
      for (int l = 0; l < 16; ++l) total += chunk_lanes[i * 16 + l];
      grad_weight[i] = chunk == 0 ? total : grad_weight[i] + total;
    }
  }
}

#else

bool implicit_conv_built() { return false; }

double direct_lane_use(const PaddedConv&) { return 0.0; }

void implicit_conv(const PaddedConv&, int64_t, int64_t, int64_t, const ConvSource&, const float*, const float*, float*,
                   int) {
  throw std::logic_error("implicit_conv: this build has no AVX-512 kernel (implicit_conv_built() is false)");
}

void direct_conv(const PaddedConv&, int64_t, int64_t, int64_t, const ConvSource&, const float*, const float*, float*,
                 int) {
  throw std::logic_error("direct_conv: this build has no AVX-512 kernel (implicit_conv_built() is false)");
}

void channel_vector_conv(const PaddedConv&, int64_t, int64_t, int64_t, const ConvSource&, const float*, const float*,
                         float*, int) {
  throw std::logic_error("channel_vector_conv: this build has no AVX-512 kernel (implicit_conv_built() is false)");
}

void implicit_conv_weight_grad(const PaddedConv&, int64_t, int64_t, int64_t, const ConvSource&, const float*, float*,
                               int64_t, int) {
  throw std::logic_error("implicit_conv_weight_grad: this build has no AVX-512 kernel (implicit_conv_built() is false)");
}

bool lane_weight_grad_fits(const PaddedConv&, int64_t) { return false; }
void lane_weight_grad(const PaddedConv&, int64_t, int64_t, int64_t, const ConvSource&, const float*, float*, int64_t,
                      int) {
  throw std::logic_error("lane_weight_grad: this build has no AVX-512 kernel (implicit_conv_built() is false)");
}
#endif

}  // namespace mn::kernels::cpu
