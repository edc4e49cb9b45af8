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

}  // namespace mn::kernels::cpu::packed
#endif
