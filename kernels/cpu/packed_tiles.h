#pragma once
// The register tiles and packing of the packed GEMM (packed_gemm.cpp), for kernels that feed them
// operands packed their own way: the implicit-GEMM convolution (conv_implicit.cpp) packs B straight
// from the image instead of from a column matrix. AVX-512 builds only.
#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>

namespace mn::kernels::cpu::packed {

constexpr int kMr = 8;              // rows of the register tile (broadcast from packed A)
constexpr int kVectors = 3;         // 16-float vectors across the tile
constexpr int kNr = 16 * kVectors;  // its columns (read from packed B)
constexpr int64_t kKc = 256;        // K blocks hold at most this many (k_block)

// How a tile meets C: overwrite (first K block, beta 0), add (later blocks, or beta 1), or scale C
// by beta first (first block, other beta).
enum class Store { kOverwrite, kAdd, kScaleAdd };

// One kc x (rows, nv vectors) tile: acc = A panel (kc x kMr, rows used) times B panel (kc x kNr, 64-byte
// aligned), then C (row stride ldc) updated per `store`; the last vector writes only the lanes in `last`.
using TileFn = void (*)(int64_t kc, const float* ap, const float* bp, float* c, int64_t ldc, __mmask16 last,
                        Store store, float alpha, float beta);
TileFn tile_for(int rows, int nv);

// Two row panels (16 rows) over a one-vector B panel: the same arithmetic per element as tile_for(8, 1).
void tile_pair(int64_t kc, const float* ap0, const float* ap1, const float* bp, float* c, int64_t ldc, __mmask16 last,
               Store store, float alpha, float beta);

// The lanes below n (all for n >= 16).
__mmask16 low_lanes(int64_t n);

// A's block (mc x kc; element (i, k) at a[i * rs + k * cs]) into ceil(mc / kMr) panels of kc x kMr,
// zero beyond mc.
void pack_a(const float* a, int64_t rs, int64_t cs, int64_t mc, int64_t kc, float* out);

// The K block length for a product with inner dimension k: equal blocks of at most kKc, a multiple of 8
// (the last may be shorter). A function of k only, so each output's sum has the same bits wherever it
// is computed.
int64_t k_block(int64_t k);

// The inner loop of every register tile: acc[i][v] += A[k][i] * B_k[v] over k < kc, one chain per
// element in k order, where A is a packed A panel (kc x kMr floats) and B_k's NV vectors come from
// load_b(k, v) (a packed B panel, or floats read in place).
template <int R, int NV, class LoadB>
inline void accumulate(int64_t kc, const float* __restrict ap, LoadB load_b, __m512 (&acc)[R][NV]) {
  for (int64_t k = 0; k < kc; ++k) {
    __m512 b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = load_b(k, v);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512 a = _mm512_set1_ps(ap[i]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(a, b[v], acc[i][v]);
    }
    ap += kMr;
  }
}

// dst[k * ds + i] = src[i * rs + k] for i, k < 8.
inline void transpose8x8(const float* src, int64_t rs, float* dst, int64_t ds) {
  const __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + rs), r2 = _mm256_loadu_ps(src + 2 * rs),
               r3 = _mm256_loadu_ps(src + 3 * rs), r4 = _mm256_loadu_ps(src + 4 * rs), r5 = _mm256_loadu_ps(src + 5 * rs),
               r6 = _mm256_loadu_ps(src + 6 * rs), r7 = _mm256_loadu_ps(src + 7 * rs);
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
               t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
               t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
               u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
               u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
               u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(dst + 0 * ds, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(dst + 1 * ds, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(dst + 2 * ds, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(dst + 3 * ds, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(dst + 4 * ds, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(dst + 5 * ds, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(dst + 6 * ds, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(dst + 7 * ds, _mm256_permute2f128_ps(u3, u7, 0x31));
}

}  // namespace mn::kernels::cpu::packed
#endif
