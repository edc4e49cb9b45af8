#pragma once
// Column-matrix helpers of the CPU convolution (kernels/cpu/conv.cpp): short masked runs, and
// im2col and col2im through a zero-padded copy of the image, for convolutions with column stride 1
// (im2col also 2). With the padding materialised, every (row of the column matrix, output row) pair
// is one run of OW floats, consecutive or every other one, with no bounds to test, so runs are
// copied as whole 16-lane vectors (or built by two-source permutes, ColumnGather), spilling only
// into floats of the same row that a later run overwrites. Each padded channel plane carries
// kPlaneSlack spare floats, so that whole-vector reads never leave it.
//
// col2im adds the column matrix's rows in order into a sum that starts from zero, as the direct
// col2im does, so the results are bit-identical to it.
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

namespace mn::kernels::cpu {

struct PaddedConv {
  int64_t height, width;           // of the image
  int64_t pad_h, pad_w;
  int64_t kernel_h, kernel_w;
  int64_t stride_h, stride_w;      // stride_w 1 or 2 (col2im: 1)
  int64_t dilation_h, dilation_w;
  int64_t out_h, out_w;

  static constexpr int64_t kPlaneSlack = 32;
  int64_t padded_w() const { return width + 2 * pad_w; }
  int64_t plane() const { return (height + 2 * pad_h) * padded_w() + kPlaneSlack; }
};

// Range [begin, end) of output positions o with 0 <= o * stride + offset < limit.
inline std::pair<int64_t, int64_t> valid_range(int64_t offset, int64_t stride, int64_t limit, int64_t count) {
  int64_t begin = offset >= 0 ? 0 : (-offset + stride - 1) / stride;
  int64_t end = limit - 1 - offset < 0 ? 0 : (limit - 1 - offset) / stride + 1;
  begin = std::min(begin, count);
  end = std::clamp(end, begin, count);
  return {begin, end};
}

// Image rows are short (tens of floats): a memmove/memset call or a scalar tail per run would cost
// more than the run itself, so with AVX-512 each run is a few masked 16-lane loads and stores.
#if defined(__AVX512F__)
inline __mmask16 lanes_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1);
}

// v with the lanes outside m zeroed, by an AND with m spread to a vector: the compiler folds a zero-masking
// move after a load into a masked load, which pad_channels avoids (see there).
inline __m512 keep_lanes(__mmask16 m, __m512 v) {
#if defined(__AVX512DQ__)
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_movm_epi32(m)));
#else
  return _mm512_castsi512_ps(_mm512_maskz_mov_epi32(m, _mm512_castps_si512(v)));
#endif
}
#endif

inline void copy_run(float* dst, const float* src, int64_t n) {
#if defined(__AVX512F__)
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = lanes_mask(n - i);
    _mm512_mask_storeu_ps(dst + i, mask, _mm512_maskz_loadu_ps(mask, src + i));
  }
#else
  std::copy(src, src + n, dst);
#endif
}

inline void zero_run(float* dst, int64_t n) {
#if defined(__AVX512F__)
  for (int64_t i = 0; i < n; i += 16) _mm512_mask_storeu_ps(dst + i, lanes_mask(n - i), _mm512_setzero_ps());
#else
  std::fill(dst, dst + n, 0.0f);
#endif
}

// dst[i] += src[i]
inline void add_run(float* dst, const float* src, int64_t n) {
#if defined(__AVX512F__)
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = lanes_mask(n - i);
    const __m512 sum = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, dst + i), _mm512_maskz_loadu_ps(mask, src + i));
    _mm512_mask_storeu_ps(dst + i, mask, sum);
  }
#else
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
#endif
}

// out[i] = parts[i] + parts[size + i] + ... + parts[(count - 1) * size + i] for i < size, added in that order
// (so the same bits on any thread count), a block of elements at a time so that the adds run along rows and
// the block stays in L1 across the parts. out may be parts itself. Defined in conv.cpp.
void sum_in_order(const float* parts, int64_t count, int64_t size, float* out);

// dst[2 i] += src[i] for i < n; the floats between are not touched. Defined in conv.cpp (compiled for the
// build machine's CPU, as the tests that call it are not).
void add_run_stride2(float* dst, const float* src, int64_t n);

// Channels [c_begin, c_end) of x (strides sx_c, sx_h, sx_w) into padded planes (zero borders and slack).
inline void pad_channels(const PaddedConv& s, const float* x, int64_t sx_c, int64_t sx_h, int64_t sx_w, float* padded,
                         int64_t c_begin, int64_t c_end) {
  const int64_t pw = s.padded_w();
#if defined(__AVX512F__)
  // Rows of contiguous x: each padded row is whole vectors, the image's floats put into their lanes (lanes
  // outside the row zeroed), stored unmasked in order, so a row's last vector spills zeros into the next
  // row's start before that row is written, and the last into the slack. Short masked stores at every
  // border stalled on the loads that followed them, and masked loads stalled the stores after them (a
  // third of a ResNet-20 step's padding time on this project's AMD host), so a vector whose 16 floats lie
  // between the first and the last float read (inside x's storage) is loaded whole and its lanes masked
  // in registers; only vectors at the ends of that range are masked loads.
  if (sx_w == 1 && (pw + 15) / 16 * 16 - pw <= PaddedConv::kPlaneSlack) {
    const int64_t vectors = (pw + 15) / 16, rows = s.height + 2 * s.pad_h;
    const int64_t first = c_begin * sx_c, end = (c_end - 1) * sx_c + (s.height - 1) * sx_h + s.width;
    for (int64_t c = c_begin; c < c_end; ++c) {
      float* plane = padded + c * s.plane();
      for (int64_t y = 0; y < rows; ++y) {
        float* dst = plane + y * pw;
        const int64_t iy = y - s.pad_h;
        if (iy < 0 || iy >= s.height) {
          for (int64_t v = 0; v < vectors; ++v) _mm512_storeu_ps(dst + 16 * v, _mm512_setzero_ps());
          continue;
        }
        const int64_t row = c * sx_c + iy * sx_h - s.pad_w;  // lane l of vector v: column 16 v + l - pad_w
        for (int64_t v = 0; v < vectors; ++v) {
          const int64_t lo = std::clamp<int64_t>(s.pad_w - 16 * v, 0, 16), hi = std::clamp<int64_t>(s.pad_w + s.width - 16 * v, 0, 16);
          const __mmask16 m = static_cast<__mmask16>(lanes_mask(hi) & ~lanes_mask(lo));
          const int64_t at = row + 16 * v;
          const __m512 lanes = at >= first && at + 16 <= end ? keep_lanes(m, _mm512_loadu_ps(x + at))
                                                             : _mm512_maskz_loadu_ps(m, x + at);
          _mm512_storeu_ps(dst + 16 * v, lanes);
        }
      }
      zero_run(plane + rows * pw, s.plane() - rows * pw);
    }
    return;
  }
#endif
  for (int64_t c = c_begin; c < c_end; ++c) {
    float* plane = padded + c * s.plane();
    zero_run(plane, s.pad_h * pw + s.pad_w);
    for (int64_t y = 0; y < s.height; ++y) {
      float* row = plane + (y + s.pad_h) * pw + s.pad_w;
      const float* src = x + c * sx_c + y * sx_h;
      if (sx_w == 1) copy_run(row, src, s.width);
      else
        for (int64_t i = 0; i < s.width; ++i) row[i] = src[i * sx_w];
      // right border of this row and left border of the next
      zero_run(row + s.width, 2 * s.pad_w);
    }
    float* tail = plane + (s.height + s.pad_h) * pw + s.pad_w;
    zero_run(tail, plane + s.plane() - tail);
  }
}

// Rows [row_begin, row_end) of the column matrix [C*KH*KW, OH*OW] from the padded planes. A run's
// spill stays inside its own row of the matrix (later runs of the row overwrite it), so rows can be
// filled by different threads.
inline void im2col_padded(const PaddedConv& s, const float* padded, float* col, int64_t row_begin, int64_t row_end) {
  const int64_t kk = s.kernel_h * s.kernel_w, pw = s.padded_w(), ow = s.out_w, plane = s.out_h * ow;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t c = row / kk, ki = (row / s.kernel_w) % s.kernel_h, kj = row % s.kernel_w;
    const float* src = padded + c * s.plane() + ki * s.dilation_h * pw + kj * s.dilation_w;
    float* dst = col + row * plane;
    for (int64_t done = 0; done < plane; done += ow, src += s.stride_h * pw) {
#if defined(__AVX512F__)
      // Whole vectors while they end inside the row, then the run's own lanes. Reads stay within the
      // plane and its slack.
      const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      for (int64_t i = 0; i < ow; i += 16) {
        const __m512 v = s.stride_w == 1 ? _mm512_loadu_ps(src + i)
                                         : _mm512_permutex2var_ps(_mm512_loadu_ps(src + 2 * i), even,
                                                                  _mm512_loadu_ps(src + 2 * i + 16));
        if (done + i + 16 <= plane) _mm512_storeu_ps(dst + done + i, v);
        else _mm512_mask_storeu_ps(dst + done + i, lanes_mask(ow - i), v);
      }
#else
      for (int64_t i = 0; i < ow; ++i) dst[done + i] = src[i * s.stride_w];
#endif
    }
  }
}

// im2col by 16-output vectors (AVX-512): outputs q .. q+15 of any column-matrix row read padded-plane offsets
// base + index[l] (the same for every row, up to the row's own start), and when these span at most 32
// floats the vector is two loads and one two-source permute. `usable` is false when some span is wider.
struct ColumnGather {
  std::vector<int64_t> base;             // per vector of 16 outputs
  std::vector<std::array<int32_t, 16>> index;
  bool usable = false;
};

inline ColumnGather column_gather(const PaddedConv& s) {
  ColumnGather g;
#if !defined(__AVX512F__)
  return g;
#endif
  const int64_t plane = s.out_h * s.out_w, pw = s.padded_w();
  auto offset = [&](int64_t q) { return (q / s.out_w) * s.stride_h * pw + (q % s.out_w) * s.stride_w; };
  for (int64_t q0 = 0; q0 < plane; q0 += 16) {
    g.base.push_back(offset(q0));
    std::array<int32_t, 16> index{};
    for (int64_t l = 0; l < 16; ++l) {
      const int64_t rel = q0 + l < plane ? offset(q0 + l) - offset(q0) : 0;
      if (rel >= 32) return g;
      index[l] = static_cast<int32_t>(rel);
    }
    g.index.push_back(index);
  }
  g.usable = true;
  return g;
}

#if defined(__AVX512F__)
// Rows [row_begin, row_end) of the column matrix by ColumnGather vectors (g.usable); reads stay
// within a padded plane and its slack.
inline void im2col_gather(const PaddedConv& s, const ColumnGather& g, const float* padded, float* col,
                          int64_t row_begin, int64_t row_end) {
  const int64_t kk = s.kernel_h * s.kernel_w, pw = s.padded_w(), plane = s.out_h * s.out_w;
  const int64_t vectors = static_cast<int64_t>(g.base.size());
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t c = row / kk, ki = (row / s.kernel_w) % s.kernel_h, kj = row % s.kernel_w;
    const float* src = padded + c * s.plane() + ki * s.dilation_h * pw + kj * s.dilation_w;
    float* dst = col + row * plane;
    for (int64_t j = 0; j < vectors; ++j) {
      const float* from = src + g.base[j];
      const __m512i index = _mm512_loadu_si512(g.index[j].data());
      const __m512 v = _mm512_permutex2var_ps(_mm512_loadu_ps(from), index, _mm512_loadu_ps(from + 16));
      if (16 * j + 16 <= plane) _mm512_storeu_ps(dst + 16 * j, v);
      else _mm512_mask_storeu_ps(dst + 16 * j, lanes_mask(plane - 16 * j), v);
    }
  }
}
#endif

// Padded planes of channels [c_begin, c_end) = col2im of the column matrix (accumulated from zero).
inline void col2im_padded(const PaddedConv& s, const float* col, float* padded, int64_t c_begin, int64_t c_end) {
  const int64_t kk = s.kernel_h * s.kernel_w, pw = s.padded_w(), ow = s.out_w, plane = s.out_h * ow;
  std::fill(padded + c_begin * s.plane(), padded + c_end * s.plane(), 0.0f);
  for (int64_t row = c_begin * kk; row < c_end * kk; ++row) {
    const int64_t c = row / kk, ki = (row / s.kernel_w) % s.kernel_h, kj = row % s.kernel_w;
    float* dst = padded + c * s.plane() + ki * s.dilation_h * pw + kj * s.dilation_w;
    const float* src = col + row * plane;
    for (int64_t oy = 0; oy < s.out_h; ++oy, dst += s.stride_h * pw, src += ow) {
#if defined(__AVX512F__)
      // Lanes past the run add zero: the floats they touch keep their values.
      for (int64_t i = 0; i < ow; i += 16) {
        const __m512 add = _mm512_maskz_loadu_ps(lanes_mask(ow - i), src + i);
        _mm512_storeu_ps(dst + i, _mm512_add_ps(_mm512_loadu_ps(dst + i), add));
      }
#else
      for (int64_t i = 0; i < ow; ++i) dst[i] += src[i];
#endif
    }
  }
}

#if defined(__AVX512F__)
// Whether col2im_rows handles this shape: a padded row fits in a few vectors.
inline bool col2im_rows_fits(const PaddedConv& s) {
  return s.padded_w() <= 64 && s.kernel_w * ((s.padded_w() + 15) / 16) <= 64;
}

// grad_x channels [c_begin, c_end) (contiguous [C, H, W]) = col2im of the column matrix, one image row
// at a time: the row's padded line (Chunks vectors) is summed in registers from every (ki, kj) run
// that lands on it (ki outer, kj inner: the order of the column matrix's rows, as col2im_padded adds
// them), each run loaded already shifted into place by a masked load, and the interior stored once.
// No buffer, and no store is read back.
template <int Chunks>
void col2im_rows_of(const PaddedConv& s, const float* col, float* grad_x, int64_t c_begin, int64_t c_end) {
  const int64_t kk = s.kernel_h * s.kernel_w, ow = s.out_w, plane = s.out_h * ow;
  auto span_mask = [](int64_t base, int64_t count) -> __mmask16 {  // lanes l with 0 <= base + l < count
    const int64_t lo = std::max<int64_t>(0, -base), hi = std::min<int64_t>(16, count - base);
    if (hi <= lo) return 0;
    return static_cast<__mmask16>(lanes_mask(hi) & ~lanes_mask(lo));
  };
  __mmask16 run_masks[64];  // [kj][v]: lanes of line vector v that run kj covers
  for (int64_t kj = 0; kj < s.kernel_w; ++kj)
    for (int v = 0; v < Chunks; ++v) run_masks[kj * Chunks + v] = span_mask(16 * v - kj * s.dilation_w, ow);
  // Output row feeding image row iy through kernel row ki, or -1 (no division when stride_h is 1).
  auto source_row = [&](int64_t iy, int64_t ki) -> int64_t {
    const int64_t t = iy + s.pad_h - ki * s.dilation_h;
    if (t < 0) return -1;
    if (s.stride_h == 1) return t < s.out_h ? t : -1;
    return t % s.stride_h == 0 && t / s.stride_h < s.out_h ? t / s.stride_h : -1;
  };
  for (int64_t c = c_begin; c < c_end; ++c)
    for (int64_t iy = 0; iy < s.height; ++iy) {
      __m512 line[Chunks];
      for (int v = 0; v < Chunks; ++v) line[v] = _mm512_setzero_ps();
      for (int64_t ki = 0; ki < s.kernel_h; ++ki) {
        const int64_t oy = source_row(iy, ki);
        if (oy < 0) continue;
        const float* runs = col + (c * kk + ki * s.kernel_w) * plane + oy * ow;
        for (int64_t kj = 0; kj < s.kernel_w; ++kj, runs += plane)
          for (int v = 0; v < Chunks; ++v) {
            const __mmask16 m = run_masks[kj * Chunks + v];
            if (m != 0)
              line[v] = _mm512_add_ps(line[v], _mm512_maskz_loadu_ps(m, runs + (16 * v - kj * s.dilation_w)));
          }
      }
      float* dst = grad_x + (c * s.height + iy) * s.width;
      for (int v = 0; v < Chunks; ++v) {
        const __mmask16 m = span_mask(16 * v - s.pad_w, s.width);
        if (m != 0) _mm512_mask_storeu_ps(dst + (16 * v - s.pad_w), m, line[v]);
      }
    }
}

// col2im_rows_of for this shape's line length (col2im_rows_fits).
inline void col2im_rows(const PaddedConv& s, const float* col, float* grad_x, int64_t c_begin, int64_t c_end) {
  switch ((s.padded_w() + 15) / 16) {
    case 1: return col2im_rows_of<1>(s, col, grad_x, c_begin, c_end);
    case 2: return col2im_rows_of<2>(s, col, grad_x, c_begin, c_end);
    case 3: return col2im_rows_of<3>(s, col, grad_x, c_begin, c_end);
    default: return col2im_rows_of<4>(s, col, grad_x, c_begin, c_end);
  }
}
#endif

// grad_x channels [c_begin, c_end) (contiguous [C, H, W]) = the interior of the padded planes.
inline void crop_channels(const PaddedConv& s, const float* padded, float* grad_x, int64_t c_begin, int64_t c_end) {
  const int64_t pw = s.padded_w();
  for (int64_t c = c_begin; c < c_end; ++c)
    for (int64_t y = 0; y < s.height; ++y) {
      const float* src = padded + c * s.plane() + (y + s.pad_h) * pw + s.pad_w;
      std::copy(src, src + s.width, grad_x + (c * s.height + y) * s.width);
    }
}

}  // namespace mn::kernels::cpu
