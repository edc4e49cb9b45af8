#pragma once
// Convolution pieces outside the GEMM: the product of a weight matrix with a short inner dimension
// (a first layer reading one image channel through a 3x3 kernel has 9), where packing both operands
// for Eigen costs more than the multiply-adds, and the bias gradient's channel sums.
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

namespace mn::kernels::cpu {

// Inner dimensions up to this take small_k_product.
constexpr int64_t kSmallK = 32;

#if defined(__AVX512F__)
// out[o, q] = bias[o] + sum_k w[o, k] * col[k, q] for rows o, o + 1 (Rows 2) or o: one chain of fused
// multiply-adds per output in k order from zero, then the bias added (none when bias is null), the
// order in which Eigen's GEMM kernel forms a sum over this short k onto an output holding the bias,
// so the results keep the bits of the GEMM path. w is [rows, k] row-major, col [k, n] row-major, out
// [rows, n] with leading dimension ldo. Two rows x 64 columns per step share the column loads.
template <int Rows>
void small_k_rows(const float* w, int64_t k, const float* col, int64_t n, const float* bias, float* out, int64_t ldo,
                  int64_t o) {
  for (int64_t q = 0; q < n; q += 64) {
    __mmask16 mask[4];
    for (int v = 0; v < 4; ++v) {
      const int64_t left = n - q - 16 * v;
      mask[v] = left >= 16 ? static_cast<__mmask16>(0xFFFF)
                           : static_cast<__mmask16>(left <= 0 ? 0 : (1u << left) - 1);
    }
    __m512 acc[Rows][4];
    for (int r = 0; r < Rows; ++r)
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; ++kk) {
      const float* c = col + kk * n + q;
      __m512 cv[4];
      for (int v = 0; v < 4; ++v) cv[v] = _mm512_maskz_loadu_ps(mask[v], c + 16 * v);
      for (int r = 0; r < Rows; ++r) {
        const __m512 wv = _mm512_set1_ps(w[(o + r) * k + kk]);
        for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(wv, cv[v], acc[r][v]);
      }
    }
    for (int r = 0; r < Rows; ++r) {
      const __m512 b = _mm512_set1_ps(bias != nullptr ? bias[o + r] : 0.0f);
      for (int v = 0; v < 4; ++v)
        _mm512_mask_storeu_ps(out + (o + r) * ldo + q + 16 * v, mask[v],
                              bias != nullptr ? _mm512_add_ps(acc[r][v], b) : acc[r][v]);
    }
  }
}

// small_k_rows over rows [row_begin, row_end) in pairs (results do not depend on the pairing).
inline void small_k_product(const float* w, int64_t k, const float* col, int64_t n, const float* bias, float* out,
                            int64_t ldo, int64_t row_begin, int64_t row_end) {
  int64_t o = row_begin;
  for (; o + 2 <= row_end; o += 2) small_k_rows<2>(w, k, col, n, bias, out, ldo, o);
  if (o < row_end) small_k_rows<1>(w, k, col, n, bias, out, ldo, o);
}
#endif

// sum over samples n and pixels of go[n, o, :] (go contiguous [batch, channels, plane]): per plane,
// 16 float lanes over its whole vectors, then the lanes and the tail added one by one in double, in
// a fixed order (the order the bias gradient has always used, so trained weights keep their bits).
inline float channel_sum(const float* go, int64_t batch, int64_t channels, int64_t plane, int64_t o) {
  constexpr int kLanes = 16;
  double total = 0;
  for (int64_t n = 0; n < batch; ++n) {
    const float* row = go + (n * channels + o) * plane;
    float lanes[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= plane; i += kLanes)
      for (int l = 0; l < kLanes; ++l) lanes[l] += row[i + l];
    for (int l = 0; l < kLanes; ++l) total += lanes[l];
    for (; i < plane; ++i) total += row[i];
  }
  return static_cast<float>(total);
}

}  // namespace mn::kernels::cpu
