#include "kernels/cpu/packed_gemm.h"
#include "kernels/cpu/packed_tiles.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace mn::kernels::cpu {

namespace {

#if defined(__AVX512F__)
constexpr bool kBuilt = true;
#else
constexpr bool kBuilt = false;
#endif

bool enabled_from_environment() {
  const char* v = std::getenv("MN_CPU_GEMM");
  return kBuilt && (v == nullptr || std::string(v) != "eigen");
}
std::atomic<bool> g_enabled{enabled_from_environment()};

}  // namespace

bool packed_gemm_built() { return kBuilt; }
void set_packed_gemm(bool enabled) { g_enabled.store(kBuilt && enabled, std::memory_order_relaxed); }
bool packed_gemm_enabled() { return g_enabled.load(std::memory_order_relaxed); }
bool packed_gemm_suits(int64_t m, int64_t n, int64_t k) { return kBuilt && m >= 4 && n >= 16 && k >= 1; }

#if defined(__AVX512F__)
namespace packed {
// Cache blocking, chosen on Zen 5 (48 KiB L1d, 1 MiB L2): one kKc x kNr panel of B (48 KiB at full
// kKc) is reused by every 8-row panel of A's kMc x kKc block (320 KiB, in L2); B's kKc x kNc block
// (4.7 MiB) sits in L3. K blocks of 128-256 and kMc of 160-640 measured alike within this VM's noise.
// K is cut into equal blocks of at most kKc (k_block, packed_tiles.h).
constexpr int64_t kMc = 320, kNc = 4800;

// Writes one accumulated vector to C at dst, the lanes in m: alpha * acc, plus C or beta * C per `store`.
inline void store_vector(float* dst, __m512 acc, __mmask16 m, Store store, float alpha, float beta) {
  if (alpha != 1.0f) acc = _mm512_mul_ps(acc, _mm512_set1_ps(alpha));
  if (store == Store::kAdd) acc = _mm512_add_ps(_mm512_maskz_loadu_ps(m, dst), acc);
  else if (store == Store::kScaleAdd) acc = _mm512_fmadd_ps(_mm512_set1_ps(beta), _mm512_maskz_loadu_ps(m, dst), acc);
  _mm512_mask_storeu_ps(dst, m, acc);
}

// One kc x (R rows, NV vectors) tile: acc = A_panel B_panel, then C (R x 16 NV at c, row stride ldc)
// updated per `store`; the last vector writes only the lanes in `last`.
template <int R, int NV>
void tile(int64_t kc, const float* __restrict ap, const float* __restrict bp, float* c, int64_t ldc, __mmask16 last,
          Store store, float alpha, float beta) {
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  if (store != Store::kOverwrite) {  // C arrives while the tile computes
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc + 16 * NV - 1), _MM_HINT_T0);
    }
  }
  accumulate<R, NV>(kc, ap, [bp](int64_t k, int v) { return _mm512_load_ps(bp + k * kNr + 16 * v); }, acc);
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v)
      store_vector(c + i * ldc + 16 * v, acc[i][v], v == NV - 1 ? last : static_cast<__mmask16>(0xFFFF), store, alpha,
                   beta);
}

// A tail panel one vector wide gives the tile above only 8 accumulators (one per row), too few to hide
// the multiply-add latency: there two row panels (16 rows) share each load of B. Same arithmetic per
// element as tile<8, 1>.
void tile_pair(int64_t kc, const float* __restrict ap0, const float* __restrict ap1, const float* __restrict bp, float* c,
               int64_t ldc, __mmask16 last, Store store, float alpha, float beta) {
  __m512 acc[2 * kMr];
#pragma GCC unroll 16
  for (int i = 0; i < 2 * kMr; ++i) acc[i] = _mm512_setzero_ps();
  if (store != Store::kOverwrite) {
#pragma GCC unroll 16
    for (int i = 0; i < 2 * kMr; ++i) _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc), _MM_HINT_T0);
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b = _mm512_load_ps(bp);
#pragma GCC unroll 8
    for (int i = 0; i < kMr; ++i) {
      acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(ap0[i]), b, acc[i]);
      acc[kMr + i] = _mm512_fmadd_ps(_mm512_set1_ps(ap1[i]), b, acc[kMr + i]);
    }
    ap0 += kMr;
    ap1 += kMr;
    bp += kNr;
  }
#pragma GCC unroll 16
  for (int i = 0; i < 2 * kMr; ++i) store_vector(c + i * ldc, acc[i], last, store, alpha, beta);
}

template <int R>
TileFn tile_for_vectors(int nv) {
  return nv == 1 ? &tile<R, 1> : nv == 2 ? &tile<R, 2> : &tile<R, 3>;
}
TileFn tile_for(int rows, int nv) {
  switch (rows) {
    case 1: return tile_for_vectors<1>(nv);
    case 2: return tile_for_vectors<2>(nv);
    case 3: return tile_for_vectors<3>(nv);
    case 4: return tile_for_vectors<4>(nv);
    case 5: return tile_for_vectors<5>(nv);
    case 6: return tile_for_vectors<6>(nv);
    case 7: return tile_for_vectors<7>(nv);
    default: return tile_for_vectors<8>(nv);
  }
}

__mmask16 low_lanes(int64_t n) { return n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1); }

// B's block (kc x nc; element (k, j) at b[k * rs + j * cs]) into ceil(nc / kNr) panels of kc x kNr,
// zero beyond nc.
void pack_b(const float* b, int64_t rs, int64_t cs, int64_t kc, int64_t nc, float* out) {
  const int64_t full = cs == 1 ? nc / kNr * kNr : 0;
  for (int64_t k = 0; k < kc && full > 0; ++k) {  // row-major: one pass along each row of B
    const float* src = b + k * rs;
    for (int64_t j0 = 0; j0 < full; j0 += kNr) {
      float* dst = out + j0 * kc + k * kNr;
#pragma GCC unroll 3
      for (int v = 0; v < kVectors; ++v) _mm512_store_ps(dst + 16 * v, _mm512_loadu_ps(src + j0 + 16 * v));
    }
  }
  for (int64_t j0 = full; j0 < nc; j0 += kNr) {
    const int64_t w = std::min<int64_t>(kNr, nc - j0);
    float* dst = out + j0 * kc;
    if (cs == 1) {
      for (int64_t k = 0; k < kc; ++k)
        for (int v = 0; v < kVectors; ++v)
          _mm512_store_ps(dst + k * kNr + 16 * v, _mm512_maskz_loadu_ps(low_lanes(w - 16 * v), b + k * rs + j0 + 16 * v));
    } else if (rs == 1) {  // B^T row-major: each column of B is contiguous in k
      const int64_t w8 = w / 8 * 8, k8 = kc / 8 * 8;
      for (int64_t jj = 0; jj < w8; jj += 8) {
        const float* src = b + (j0 + jj) * cs;
        for (int64_t k = 0; k < k8; k += 8) transpose8x8(src + k, cs, dst + k * kNr + jj, kNr);
        for (int64_t k = k8; k < kc; ++k)
          for (int64_t j = 0; j < 8; ++j) dst[k * kNr + jj + j] = src[j * cs + k];
      }
      for (int64_t k = 0; k < kc; ++k) {
        for (int64_t j = w8; j < w; ++j) dst[k * kNr + j] = b[k + (j0 + j) * cs];
        std::fill(dst + k * kNr + w, dst + (k + 1) * kNr, 0.0f);
      }
    } else {
      for (int64_t k = 0; k < kc; ++k) {
        for (int64_t j = 0; j < w; ++j) dst[k * kNr + j] = b[k * rs + (j0 + j) * cs];
        std::fill(dst + k * kNr + w, dst + (k + 1) * kNr, 0.0f);
      }
    }
  }
}

// A's block (mc x kc; element (i, k) at a[i * rs + k * cs]) into ceil(mc / kMr) panels of kc x kMr,
// zero beyond mc.
void pack_a(const float* a, int64_t rs, int64_t cs, int64_t mc, int64_t kc, float* out) {
  int64_t packed = 0;
  if (rs == 1 && cs != 1) {
    // Column-major A (a transposed operand): each k's rows are contiguous. Two panels at a time, so each
    // k reads 16 floats (a cache line when aligned) instead of 8 scalars per panel.
    packed = mc / kMr * kMr;
    int64_t i0 = 0;
    for (; i0 + 2 * kMr <= packed; i0 += 2 * kMr) {
      float* lo = out + i0 * kc;
      float* hi = lo + kMr * kc;
      for (int64_t k = 0; k < kc; ++k) {
        const float* src = a + i0 + k * cs;
        _mm256_storeu_ps(lo + k * kMr, _mm256_loadu_ps(src));
        _mm256_storeu_ps(hi + k * kMr, _mm256_loadu_ps(src + kMr));
      }
    }
    for (; i0 < packed; i0 += kMr)
      for (int64_t k = 0; k < kc; ++k) _mm256_storeu_ps(out + i0 * kc + k * kMr, _mm256_loadu_ps(a + i0 + k * cs));
  }
  for (int64_t i0 = packed; i0 < mc; i0 += kMr) {
    const int64_t h = std::min<int64_t>(kMr, mc - i0);
    float* dst = out + i0 * kc;
    if (h == kMr && cs == 1) {  // row-major A: 8 x 8 register transposes
      const float* src = a + i0 * rs;
      int64_t k = 0;
      for (; k + 8 <= kc; k += 8) transpose8x8(src + k, rs, dst + k * kMr, kMr);
      for (; k < kc; ++k)
        for (int i = 0; i < kMr; ++i) dst[k * kMr + i] = src[i * rs + k];
      continue;
    }
    for (int64_t k = 0; k < kc; ++k) {
      const float* src = a + i0 * rs + k * cs;
      for (int64_t i = 0; i < h; ++i) dst[k * kMr + i] = src[i * rs];
      std::fill(dst + k * kMr + h, dst + (k + 1) * kMr, 0.0f);
    }
  }
}

// Grow-only 64-byte aligned buffers, one pair per thread (OpenMP workers keep theirs between calls).
struct Workspace {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float[], Free> a, b;
  size_t a_size = 0, b_size = 0;
  static float* ensure(std::unique_ptr<float[], Free>& buf, size_t& size, size_t floats) {
    if (floats > size) {
      const size_t bytes = (floats * sizeof(float) + 63) / 64 * 64;
      buf.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
      if (!buf) throw std::bad_alloc();
      size = bytes / sizeof(float);
    }
    return buf.get();
  }
};
static thread_local Workspace t_workspace;
static thread_local bool t_b_lent = false;  // t_workspace.b holds a LentBBuffer's blocks

// K is cut into equal blocks of at most kKc, rounded up to a multiple of 8, so a K just above kKc does
// not leave a thin last block; the cut depends on K only.
int64_t k_block(int64_t k) {
  const int64_t blocks = (k + kKc - 1) / kKc;
  return ((k + blocks - 1) / blocks + 7) / 8 * 8;
}

Store store_for(int64_t pc, float beta) {
  return pc > 0 || beta == 1.0f ? Store::kAdd : beta == 0.0f ? Store::kOverwrite : Store::kScaleAdd;
}

// Rows [0, m) of C's block (columns jc .. jc + nc) += the product of A's rows and K block pc .. pc + kc
// with B's block, already packed at bp. a points at A's element (0, pc) (element (i, k) of the block at
// a[i * rs + k * cs]); ap has room for kMc x kc floats.
void multiply_rows(const float* a, int64_t rs, int64_t cs, int64_t m, const float* bp, float* c, int64_t ldc,
                   int64_t jc, int64_t nc, int64_t pc, int64_t kc, float alpha, float beta, float* ap) {
  const Store store = store_for(pc, beta);
  for (int64_t ic = 0; ic < m; ic += kMc) {
    const int64_t mc = std::min(kMc, m - ic);
    pack_a(a + ic * rs, rs, cs, mc, kc, ap);
    for (int64_t jr = 0; jr < nc; jr += kNr) {
      const int width = static_cast<int>(std::min<int64_t>(kNr, nc - jr));
      const int nv = (width + 15) / 16;
      const __mmask16 last = low_lanes(width - 16 * (nv - 1));
      const TileFn full_rows = tile_for(kMr, nv);
      int64_t ir = 0;
      if (nv == 1)
        for (; ir + 2 * kMr <= mc; ir += 2 * kMr)
          tile_pair(kc, ap + ir * kc, ap + (ir + kMr) * kc, bp + jr * kc, c + (ic + ir) * ldc + jc + jr, ldc, last, store,
                    alpha, beta);
      for (; ir < mc; ir += kMr) {
        const int rows = static_cast<int>(std::min<int64_t>(kMr, mc - ir));
        const TileFn fn = rows == kMr ? full_rows : tile_for(rows, nv);
        fn(kc, ap + ir * kc, bp + jr * kc, c + (ic + ir) * ldc + jc + jr, ldc, last, store, alpha, beta);
      }
    }
  }
}

const float* b_block(const MatrixRef& b, int64_t pc, int64_t jc) { return b.data + pc * b.row_stride + jc * b.col_stride; }

}  // namespace packed

namespace packed {
float* a_workspace(int64_t m, int64_t k) {
  const int64_t mc_max = std::min(kMc, (m + kMr - 1) / kMr * kMr);
  return Workspace::ensure(t_workspace.a, t_workspace.a_size, static_cast<size_t>(k_block(k) * mc_max));
}
}  // namespace packed

std::vector<GemmBBlock> gemm_b_blocks(int64_t k, int64_t n) {
  using namespace packed;
  std::vector<GemmBBlock> blocks;
  const int64_t kc_max = k_block(k);
  for (int64_t jc = 0; jc < n; jc += kNc)
    for (int64_t pc = 0; pc < k; pc += kc_max) blocks.push_back({jc, std::min(kNc, n - jc), pc, std::min(kc_max, k - pc)});
  return blocks;
}

int64_t GemmBBlock::floats() const { return kc * ((nc + packed::kNr - 1) / packed::kNr * packed::kNr); }

void pack_b_block(const MatrixRef& b, const GemmBBlock& blk, float* out) {
  packed::pack_b(packed::b_block(b, blk.pc, blk.jc), b.row_stride, b.col_stride, blk.kc, blk.nc, out);
}

void multiply_b_block(const float* a, int64_t rs, int64_t cs, int64_t rows, const float* b_packed, const GemmBBlock& blk,
                      float* c, int64_t ldc, float alpha, float beta) {
  if (rows == 0) return;
  packed::multiply_rows(a, rs, cs, rows, b_packed, c, ldc, blk.jc, blk.nc, blk.pc, blk.kc, alpha, beta,
                        packed::a_workspace(rows, blk.kc));
}

LentBBuffer::LentBBuffer(int64_t floats) {
  if (packed::t_b_lent) throw std::logic_error("LentBBuffer: this thread's B buffer is already lent");
  data_ = packed::Workspace::ensure(packed::t_workspace.b, packed::t_workspace.b_size, static_cast<size_t>(floats));
  packed::t_b_lent = true;
}
LentBBuffer::~LentBBuffer() { packed::t_b_lent = false; }

void packed_gemm(const MatrixRef& a, const MatrixRef& b, float* c, int64_t ldc, float alpha, float beta) {
  using namespace packed;
  const int64_t m = a.rows, n = b.cols, k = a.cols;
  if (m == 0 || n == 0) return;
  if (t_b_lent) throw std::logic_error("packed_gemm: this thread's B buffer is lent (LentBBuffer) to a shared product");
  const int64_t nc_max = std::min(kNc, (n + kNr - 1) / kNr * kNr);
  float* bp = Workspace::ensure(t_workspace.b, t_workspace.b_size, static_cast<size_t>(k_block(k) * nc_max));
  float* ap = a_workspace(m, k);
  for (const GemmBBlock& blk : gemm_b_blocks(k, n)) {
    pack_b_block(b, blk, bp);
    multiply_rows(a.data + blk.pc * a.col_stride, a.row_stride, a.col_stride, m, bp, c, ldc, blk.jc, blk.nc, blk.pc,
                  blk.kc, alpha, beta, ap);
  }
}

#else

void packed_gemm(const MatrixRef&, const MatrixRef&, float*, int64_t, float, float) {
  throw std::logic_error("packed_gemm: this build has no AVX-512 kernel (packed_gemm_built() is false)");
}
LentBBuffer::LentBBuffer(int64_t) {
  throw std::logic_error("LentBBuffer: this build has no AVX-512 kernel (packed_gemm_built() is false)");
}
LentBBuffer::~LentBBuffer() = default;
std::vector<GemmBBlock> gemm_b_blocks(int64_t, int64_t) { return {}; }
int64_t GemmBBlock::floats() const { return 0; }
void pack_b_block(const MatrixRef&, const GemmBBlock&, float*) {
  throw std::logic_error("pack_b_block: this build has no AVX-512 kernel (packed_gemm_built() is false)");
}
void multiply_b_block(const float*, int64_t, int64_t, int64_t, const float*, const GemmBBlock&, float*, int64_t, float,
                      float) {
  throw std::logic_error("multiply_b_block: this build has no AVX-512 kernel (packed_gemm_built() is false)");
}

#endif

}  // namespace mn::kernels::cpu
