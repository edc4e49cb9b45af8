// CPU 2-D convolution (NCHW) by im2col + GEMM, with stride, padding, dilation and groups.
//   forward:          out[n, g]  = W_g [Og, Cg*KH*KW] @ col(x[n, g]) [Cg*KH*KW, OH*OW]   (+ bias)
//   backward input:   grad_x[n, g] = col2im(W_g^T @ grad_out[n, g])
//   backward weight:  grad_W_g = sum_n grad_out[n, g] @ col(x[n, g])^T
// Work is split over the batch (one sample per thread at a time, with a per-thread column buffer);
// a batch smaller than the thread count splits each product instead. The weight gradient sums the
// batch in fixed chunks reduced in order, so no result depends on the thread count.
// With column stride 1 (or 2) im2col reads a zero-padded copy of the image, and with stride 1 col2im
// sums image rows in registers (conv_columns.h); a column matrix of at most kSmallK rows skips the
// forward GEMM (conv_small.h). On AVX-512 builds with one group and a longer column, the forward never
// writes the column matrix (implicit GEMM, conv_implicit.h), nor does the input gradient at unit stride
// with 64 or more input channels (the forward kernel on grad_out with flipped weights). Which path runs
// depends on the shapes (and the MN_CPU_CONV / MN_CPU_GEMM switches) only.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "kernels/cpu/conv_columns.h"
#include "kernels/cpu/conv_implicit.h"
#include "kernels/cpu/conv_small.h"
#include "kernels/cpu/eigen_gemm.h"
#include "kernels/cpu/packed_gemm.h"
#include "kernels/cpu/loops.h"
#include "kernels/kernels.h"

namespace mn::kernels {
namespace {

using cpu::add_run;
using cpu::copy_run;
using cpu::MatrixRef;
using cpu::valid_range;
using cpu::zero_run;

// The weight gradient is accumulated in at most this many partial sums over the batch.
constexpr int64_t kWeightGradChunks = 16;
// The input gradient takes the implicit GEMM from this many input channels (implicit_input_grad).
constexpr int64_t kImplicitInputChannels = 64;
// ... and, where its rows are wide (wide_input_grad), from this many.
constexpr int64_t kDirectInputChannels = 16;
// From this many output channels implicit_family takes channel_vector_conv.
constexpr int64_t kChannelVectorOutputs = 32;
// The stride-2 column path's input gradient takes several samples per product below this many output
// positions (backward_input_batched).
constexpr int64_t kBatchedColumns = 192;
// Passes with fewer multiply-adds than this run on one thread.
constexpr int64_t kParallelWork = int64_t{1} << 16;

struct ConvGeometry {
  int64_t batch, channels, height, width;  // x
  int64_t out_channels, kernel_h, kernel_w;
  int64_t out_h, out_w;
  int64_t groups, group_in, group_out;  // channels per group of x and of out
  // x strides (elements), so that im2col reads any view
  int64_t sx_n, sx_c, sx_h, sx_w;
  Conv2dParams p;

  int64_t col_rows() const { return group_in * kernel_h * kernel_w; }
  int64_t out_plane() const { return out_h * out_w; }
  int64_t col_size() const { return col_rows() * out_plane(); }
  // A 1x1 kernel with unit stride and no padding reads x itself as the column matrix.
  bool pointwise() const {
    return kernel_h == 1 && kernel_w == 1 && p.stride_h == 1 && p.stride_w == 1 && p.pad_h == 0 && p.pad_w == 0 &&
           sx_w == 1 && sx_h == width;
  }
  // Column stride 1, or 2 with a kernel wider than a point (a 1x1 kernel at stride 2 reads a quarter
  // of the image, not worth a padded copy of all of it): im2col goes through a zero-padded copy of the
  // image (conv_columns.h), and with stride 1 col2im too.
  bool padded() const {
    return (p.stride_w == 1 || (p.stride_w == 2 && kernel_h * kernel_w > 1)) && !pointwise();
  }
  bool padded_col2im() const { return padded() && p.stride_w == 1; }
  // Column stride 2 with image rows of at most 32 floats, output rows of at most 16 and kernels at most
  // 8 wide: col2im sums each image row in registers (col2im_stride2_rows).
  bool stride2_col2im() const {
#if defined(__AVX512F__)
    return p.stride_w == 2 && !pointwise() && width <= 32 && out_w <= 16 && kernel_w <= 8;
#else
    return false;
#endif
  }
  // The forward by implicit GEMM (conv_implicit.h): one group, an inner dimension past the small-K
  // product's, AVX-512 builds with it and the packed GEMM on (MN_CPU_CONV=im2col or MN_CPU_GEMM=eigen
  // keep the column matrix).
  bool implicit() const {
    return groups == 1 && !pointwise() && col_rows() > cpu::kSmallK && cpu::implicit_conv_enabled() &&
           cpu::packed_gemm_enabled();
  }
  // The input gradient as the forward convolution of grad_out, padded by (KH - 1) * dilation - pad, with
  // the weights flipped and their channel axes swapped: unit stride, padding at most that, and at least
  // kImplicitInputChannels input channels (its output channels: the rows sharing each packed panel).
  // With fewer, packing the panels costs more than the column path's GEMM W^T . grad_out and col2im
  // (cnn2.conv2 and cnn1.conv2, 16 and 32 channels: 5-12 % slower forward + backward; at 64 and 128
  // channels, resnet20.s3 and cnn1.conv4, 10-15 % faster; issue 22).
  bool implicit_input_grad() const { return flipped_input_grad_fits() && channels >= kImplicitInputChannels; }
  // What any input gradient through the flipped convolution needs: one group, unit stride, padding at most
  // (KH - 1) * dilation, an inner dimension past the small-K product's, and the kernels switched on.
  bool flipped_input_grad_fits() const {
    return groups == 1 && p.stride_h == 1 && p.stride_w == 1 && p.pad_h <= (kernel_h - 1) * p.dilation_h &&
           p.pad_w <= (kernel_w - 1) * p.dilation_w && out_channels * kernel_h * kernel_w > cpu::kSmallK &&
           !pointwise() && cpu::implicit_conv_enabled() && cpu::packed_gemm_enabled();
  }
  // The weight gradient with the column matrix read in place (implicit_conv_weight_grad): the same bits as
  // the column path wherever that path runs the packed GEMM, so the choice needs no threshold for them.
  bool implicit_weight_grad() const {
    return weight_grad_kernels() && cpu::packed_gemm_suits(out_channels, col_rows(), out_plane());
  }
  // Fewer column rows than the packed GEMM takes (there the column path runs Eigen's GEMM): the weight
  // gradient with positions along the lanes (lane_weight_grad).
  bool lane_weight_grad() const {
    return weight_grad_kernels() && !cpu::packed_gemm_suits(out_channels, col_rows(), out_plane()) &&
           cpu::lane_weight_grad_fits(padded_conv(), channels);
  }
  // What both weight-gradient kernels need: one group, not pointwise (there the column matrix is the image
  // itself), and the kernels switched on.
  bool weight_grad_kernels() const {
    return groups == 1 && !pointwise() && cpu::implicit_conv_enabled() && cpu::packed_gemm_enabled();
  }
  // The same flipped convolution also from kDirectInputChannels input channels where direct_conv would use
  // at least 85 % of its lanes: forward + backward, one thread, with direct_conv against the column path's
  // input gradient, resnet20.s1 (92 %), s2 and cnn1.conv2 (88 %) 0.90x, cnn2.conv2 (81 %) 1.06x.
  bool wide_input_grad() const {
    return flipped_input_grad_fits() && channels >= kDirectInputChannels &&
           cpu::direct_lane_use(flipped_conv()) >= 0.85;
  }
  // That convolution's geometry: grad_out's planes padded, the image's size as its output.
  cpu::PaddedConv flipped_conv() const {
    return {out_h,   out_w,   (kernel_h - 1) * p.dilation_h - p.pad_h, (kernel_w - 1) * p.dilation_w - p.pad_w,
            kernel_h, kernel_w, 1, 1, p.dilation_h, p.dilation_w, height, width};
  }
  cpu::PaddedConv padded_conv() const {
    return {height,     width,        p.pad_h,      p.pad_w, kernel_h, kernel_w,
            p.stride_h, p.stride_w,   p.dilation_h, p.dilation_w, out_h, out_w};
  }
  // Scratch floats per worker: the column matrix, then on the padded path the padded channels.
  int64_t scratch_size() const {
    if (pointwise()) return 0;
    return col_size() + (padded() ? group_in * padded_conv().plane() : 0);
  }
};

ConvGeometry geometry(const Tensor& x, const Shape& weight_shape, const Shape& out_shape, const Conv2dParams& p) {
  MN_CHECK(x.dim() == 4 && weight_shape.size() == 4 && out_shape.size() == 4, ValueError,
           "conv2d kernel: expected 4-D x, weight and output, got ", x.sizes(), ", ", weight_shape, ", ", out_shape);
  ConvGeometry g;
  g.batch = x.size(0), g.channels = x.size(1), g.height = x.size(2), g.width = x.size(3);
  g.out_channels = weight_shape[0], g.kernel_h = weight_shape[2], g.kernel_w = weight_shape[3];
  g.out_h = out_shape[2], g.out_w = out_shape[3];
  g.groups = p.groups;
  g.group_in = g.channels / p.groups;
  g.group_out = g.out_channels / p.groups;
  g.sx_n = x.stride(0), g.sx_c = x.stride(1), g.sx_h = x.stride(2), g.sx_w = x.stride(3);
  g.p = p;
  MN_CHECK(g.group_in == weight_shape[1] && g.group_in * p.groups == g.channels &&
               g.group_out * p.groups == g.out_channels && out_shape[0] == g.batch && out_shape[1] == g.out_channels,
           ValueError, "conv2d kernel: inconsistent shapes x ", x.sizes(), ", weight ", weight_shape, ", output ",
           out_shape, " for groups ", p.groups);
  return g;
}

Tensor dense(const Tensor& t) {
  if (t.is_contiguous()) return t;
  Tensor out = empty(t.sizes(), TensorOptions(t.dtype()));
  copy(kCPU, t, out);
  return out;
}

// col [Cg*KH*KW, OH*OW] from the channels of one group of one sample (x points at its channel 0).
void im2col(const ConvGeometry& g, const float* x, float* col, int64_t row_begin, int64_t row_end) {
  const Conv2dParams& p = g.p;
  const int64_t ow_count = g.out_w;
  const bool unit_stride = p.stride_w == 1 && g.sx_w == 1;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t c = row / (g.kernel_h * g.kernel_w);
    const int64_t ki = (row / g.kernel_w) % g.kernel_h, kj = row % g.kernel_w;
    const int64_t x_offset = kj * p.dilation_w - p.pad_w;
    const auto [ox_begin, ox_end] = valid_range(x_offset, p.stride_w, g.width, ow_count);
    float* dst = col + row * g.out_plane();
    for (int64_t oy = 0; oy < g.out_h; ++oy, dst += ow_count) {
      const int64_t iy = oy * p.stride_h - p.pad_h + ki * p.dilation_h;
      if (iy < 0 || iy >= g.height) {
        zero_run(dst, ow_count);
        continue;
      }
      const float* src = x + c * g.sx_c + iy * g.sx_h;
      zero_run(dst, ox_begin);
      if (unit_stride)
        copy_run(dst + ox_begin, src + (ox_begin + x_offset), ox_end - ox_begin);
      else
        for (int64_t ox = ox_begin; ox < ox_end; ++ox) dst[ox] = src[(ox * p.stride_w + x_offset) * g.sx_w];
      zero_run(dst + ox_end, ow_count - ox_end);
    }
  }
}

// grad_x (contiguous [Cg, H, W] of one group of one sample) += col2im(col), for channels
// [c_begin, c_end): channels never share input pixels, so ranges of them can run in parallel.
void col2im_add(const ConvGeometry& g, const float* col, float* grad_x, int64_t c_begin, int64_t c_end) {
  const Conv2dParams& p = g.p;
  const int64_t kk = g.kernel_h * g.kernel_w;
  for (int64_t row = c_begin * kk; row < c_end * kk; ++row) {
    const int64_t c = row / kk;
    const int64_t ki = (row / g.kernel_w) % g.kernel_h, kj = row % g.kernel_w;
    const int64_t x_offset = kj * p.dilation_w - p.pad_w;
    const auto [ox_begin, ox_end] = valid_range(x_offset, p.stride_w, g.width, g.out_w);
    const float* src = col + row * g.out_plane();
    for (int64_t oy = 0; oy < g.out_h; ++oy, src += g.out_w) {
      const int64_t iy = oy * p.stride_h - p.pad_h + ki * p.dilation_h;
      if (iy < 0 || iy >= g.height) continue;
      float* dst = grad_x + (c * g.height + iy) * g.width + (ox_begin * p.stride_w + x_offset);
      const float* run = src + ox_begin;
      const int64_t count = ox_end - ox_begin;
      if (p.stride_w == 1)
        add_run(dst, run, count);
      else if (p.stride_w == 2)
        cpu::add_run_stride2(dst, run, count);
      else
        for (int64_t i = 0; i < count; ++i) dst[i * p.stride_w] += run[i];
    }
  }
}

#if defined(__AVX512F__)
// grad_x (contiguous [Cg, H, W] of one group of one sample) = col2im(col) for channels [c_begin, c_end),
// col's rows col_stride floats apart, column stride 2 (stride2_col2im()): each image row (one or two
// vectors) starts at +0 and takes the column-matrix runs that land on it, for ki and then kj in ascending
// order, each run spread to its lanes by a permute and added under a mask; so every float is the sum
// col2im_add forms on a zero-filled grad_x, with the same bits.
void col2im_stride2_rows(const ConvGeometry& g, const float* col, int64_t col_stride, float* grad_x, int64_t c_begin,
                         int64_t c_end) {
  const Conv2dParams& p = g.p;
  const int64_t plane = col_stride, halves = (g.width + 15) / 16;
  // Per kj and half h: lane l (image column 16 h + l) takes output column (16 h + l + pad_w - kj dil_w) / 2
  // where that is a whole column in range.
  __m512i index[8][2];
  __mmask16 mask[8][2];
  for (int64_t kj = 0; kj < g.kernel_w; ++kj)
    for (int64_t h = 0; h < halves; ++h) {
      alignas(64) int32_t idx[16] = {};
      uint32_t m = 0;
      for (int64_t l = 0; l < 16; ++l) {
        const int64_t ix = 16 * h + l, t = ix + p.pad_w - kj * p.dilation_w;
        if (ix < g.width && t >= 0 && t % 2 == 0 && t / 2 < g.out_w) {
          idx[l] = static_cast<int32_t>(t / 2);
          m |= 1u << l;
        }
      }
      index[kj][h] = _mm512_load_si512(idx);
      mask[kj][h] = static_cast<__mmask16>(m);
    }
  const __mmask16 run_lanes = cpu::lanes_mask(g.out_w);
  for (int64_t c = c_begin; c < c_end; ++c)
    for (int64_t iy = 0; iy < g.height; ++iy) {
      __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t ki = 0; ki < g.kernel_h; ++ki) {
        const int64_t ty = iy + p.pad_h - ki * p.dilation_h;
        if (ty < 0 || ty % p.stride_h != 0 || ty / p.stride_h >= g.out_h) continue;
        const float* row = col + ((c * g.kernel_h + ki) * g.kernel_w) * plane + ty / p.stride_h * g.out_w;
        for (int64_t kj = 0; kj < g.kernel_w; ++kj, row += plane) {
          const __m512 run = _mm512_maskz_loadu_ps(run_lanes, row);
          for (int64_t h = 0; h < halves; ++h)
            acc[h] = _mm512_mask_add_ps(acc[h], mask[kj][h], acc[h], _mm512_permutex2var_ps(run, index[kj][h], run));
        }
      }
      float* dst = grad_x + (c * g.height + iy) * g.width;
      for (int64_t h = 0; h < halves; ++h) _mm512_mask_storeu_ps(dst + 16 * h, cpu::lanes_mask(g.width - 16 * h), acc[h]);
    }
}
#endif

// Whether a pass over the batch is worth threads, and if so whether to spread whole samples over them
// (enough samples) or to parallelise inside each sample.
struct BatchSplit {
  int threads = 1;
  bool across_samples = false, inside_samples = false;
};

BatchSplit batch_split(const ConvGeometry& g, int64_t units) {
  BatchSplit s;
  s.threads = get_num_threads_in_use();
  const int64_t sample_work = g.out_channels * g.col_rows() * g.out_plane();
  const bool worth = s.threads > 1 && g.batch * sample_work >= kParallelWork;
  s.across_samples = worth && units >= s.threads;
  s.inside_samples = worth && !s.across_samples;
  return s;
}

// Runs body(sample, scratch buffer, parallel_inside) for every sample; the scratch (g.scratch_size()
// floats) holds the column matrix first.
template <class Body>
void for_each_sample(const ConvGeometry& g, Body&& body) {
  const BatchSplit split = batch_split(g, g.batch);
  const int64_t col_size = g.scratch_size();
  const int workers = split.across_samples ? split.threads : 1;
  Tensor scratch = empty({std::max<int64_t>(workers * col_size, 1)});
  float* base = scratch.data<float>();
  if (!split.across_samples) {
    for (int64_t n = 0; n < g.batch; ++n) body(n, base, split.inside_samples);
    return;
  }
#pragma omp parallel num_threads(workers)
  {
    float* col = base + omp_get_thread_num() * col_size;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < g.batch; ++n) body(n, col, false);
  }
}

// Threads for an implicit_conv of this many multiply-adds.
int implicit_team(int64_t work) { return work >= kParallelWork ? cpu::parallel_team(work, kParallelWork) : 1; }

// Runs body(i) for i in [0, count), on the team when parallel.
template <class Body>
void for_range(int64_t count, bool parallel, Body&& body) {
  if (!parallel) {
    for (int64_t i = 0; i < count; ++i) body(i);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(get_num_threads_in_use())
  for (int64_t i = 0; i < count; ++i) body(i);
}

void gemm(const MatrixRef& a, const MatrixRef& b, float* c, int64_t ldc, float beta, bool parallel) {
  if (parallel) cpu::gemm_parallel(a, b, c, ldc, 1.0f, beta);
  else cpu::gemm_serial(a, b, c, ldc, 1.0f, beta);
}

// col (the start of a scratch buffer of g.scratch_size() floats) = im2col of one group of one sample;
// gather: column_gather(g.padded_conv()) on the padded path.
void fill_im2col(const ConvGeometry& g, const float* x_group, float* col, bool parallel,
                 [[maybe_unused]] const cpu::ColumnGather& gather) {
  const int64_t rows = g.col_rows();
  if (!g.padded()) {
    if (!parallel) return im2col(g, x_group, col, 0, rows);
#pragma omp parallel for schedule(static) num_threads(get_num_threads_in_use())
    for (int64_t r = 0; r < rows; ++r) im2col(g, x_group, col, r, r + 1);
    return;
  }
  const cpu::PaddedConv s = g.padded_conv();
  float* padded = col + g.col_size();
  auto fill_rows = [&](int64_t r_begin, int64_t r_end) {
#if defined(__AVX512F__)
    if (gather.usable) return cpu::im2col_gather(s, gather, padded, col, r_begin, r_end);
#endif
    cpu::im2col_padded(s, padded, col, r_begin, r_end);
  };
  if (!parallel) {
    cpu::pad_channels(s, x_group, g.sx_c, g.sx_h, g.sx_w, padded, 0, g.group_in);
    return fill_rows(0, rows);
  }
#pragma omp parallel num_threads(get_num_threads_in_use())
  {
#pragma omp for schedule(static)
    for (int64_t c = 0; c < g.group_in; ++c) cpu::pad_channels(s, x_group, g.sx_c, g.sx_h, g.sx_w, padded, c, c + 1);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) fill_rows(r, r + 1);
  }
}

// grad_x of one group of one sample (contiguous [Cg, H, W]) += col2im(col) on the direct path; with
// column stride 1 grad_x = col2im(col), in registers (col2im_rows) or through the padded planes after
// col in the scratch buffer.
void col2im(const ConvGeometry& g, const float* col, float* gx_group, bool parallel) {
  const cpu::PaddedConv s = g.padded_conv();
  float* padded = const_cast<float*>(col) + g.col_size();
  auto channels = [&](int64_t c_begin, int64_t c_end) {
#if defined(__AVX512F__)
    if (g.stride2_col2im()) return col2im_stride2_rows(g, col, g.out_plane(), gx_group, c_begin, c_end);
#endif
    if (!g.padded_col2im()) return col2im_add(g, col, gx_group, c_begin, c_end);
#if defined(__AVX512F__)
    if (cpu::col2im_rows_fits(s)) return cpu::col2im_rows(s, col, gx_group, c_begin, c_end);
#endif
    cpu::col2im_padded(s, col, padded, c_begin, c_end);
    cpu::crop_channels(s, padded, gx_group, c_begin, c_end);
  };
  if (!parallel) return channels(0, g.group_in);
#pragma omp parallel for schedule(static) num_threads(get_num_threads_in_use())
  for (int64_t c = 0; c < g.group_in; ++c) channels(c, c + 1);
}

MatrixRef group_weight(const ConvGeometry& g, const float* w, int64_t group) {
  const int64_t k = g.col_rows();
  return {w + group * g.group_out * k, g.group_out, k, k, 1};
}

// The convolution s of `source`'s padded planes through the kernel of conv_implicit.h that suits its shape.
// They all form the same sums, so the choice never changes a bit. Forward alone, one thread, each against
// implicit_conv: channel_vector_conv from 32 output channels (two or more vectors of them) on resnet20.s3
// 0.83x, s3.down 0.70x, s2.down 0.66x, cnn1.conv3 / conv4 0.91x, and against direct_conv on s2 0.88x,
// cnn1.conv2 0.89x, cnn2.conv2 0.82x; with 16 (resnet20.s1) it was 1.11x direct_conv's time. direct_conv
// where at least 80 % of its lanes hold outputs (direct_lane_use): resnet20.s1 (92 %) 0.72x implicit_conv,
// 77 % (a 7 x 7 image) 1.15-1.24x.
void implicit_family(const cpu::PaddedConv& s, int64_t batch, int64_t channels, int64_t out_channels,
                     const cpu::ConvSource& source, const float* w, const float* bias, float* out, int threads) {
  if (out_channels >= kChannelVectorOutputs)
    return cpu::channel_vector_conv(s, batch, channels, out_channels, source, w, bias, out, threads);
  if (cpu::direct_lane_use(s) >= 0.8)
    return cpu::direct_conv(s, batch, channels, out_channels, source, w, bias, out, threads);
  cpu::implicit_conv(s, batch, channels, out_channels, source, w, bias, out, threads);
}

void conv2d_forward_cpu(const Tensor& x, const Tensor& weight, const Tensor& bias, const Conv2dParams& p, Tensor& out) {
  const ConvGeometry g = geometry(x, weight.sizes(), out.sizes(), p);
  const Tensor w = dense(weight);
  const Tensor b = bias.defined() ? dense(bias) : Tensor();
  const float* xp = x.data<float>();
  const float* wp = w.data<float>();
  const float* bp = b.defined() ? b.data<float>() : nullptr;
  float* op = out.data<float>();
  const int64_t plane = g.out_plane();
  if (g.implicit()) {
    implicit_family(g.padded_conv(), g.batch, g.channels, g.out_channels, {xp, g.sx_n, g.sx_c, g.sx_h, g.sx_w}, wp, bp, op,
                    implicit_team(g.batch * plane * g.out_channels * g.col_rows()));
    return;
  }
  const cpu::ColumnGather gather = g.padded() ? cpu::column_gather(g.padded_conv()) : cpu::ColumnGather{};
  // A short inner dimension takes small_k_product instead of the GEMM (AVX-512 builds).
  [[maybe_unused]] const bool small_k = !g.pointwise() && g.col_rows() <= cpu::kSmallK;
  for_each_sample(g, [&](int64_t n, float* col, bool parallel) {
    for (int64_t group = 0; group < g.groups; ++group) {
      const float* x_group = xp + n * g.sx_n + group * g.group_in * g.sx_c;
      MatrixRef cols{col, g.col_rows(), plane, plane, 1};
      if (g.pointwise()) cols = {x_group, g.group_in, plane, g.sx_c, 1};
      else fill_im2col(g, x_group, col, parallel, gather);
      float* out_group = op + (n * g.out_channels + group * g.group_out) * plane;
#if defined(__AVX512F__)
      if (small_k) {  // bias fused, no GEMM
        const float* w_group = wp + group * g.group_out * g.col_rows();
        const float* b_group = bp != nullptr ? bp + group * g.group_out : nullptr;
        const int64_t pairs = (g.group_out + 1) / 2;
        for_range(pairs, parallel, [&](int64_t i) {
          cpu::small_k_product(w_group, g.col_rows(), col, plane, b_group, out_group, plane, 2 * i,
                               std::min(2 * i + 2, g.group_out));
        });
        continue;
      }
#endif
      if (bp != nullptr)
        for (int64_t o = 0; o < g.group_out; ++o)
          std::fill(out_group + o * plane, out_group + (o + 1) * plane, bp[group * g.group_out + o]);
      gemm(group_weight(g, wp, group), cols, out_group, plane, bp != nullptr ? 1.0f : 0.0f, parallel);
    }
  });
}

#if defined(__AVX512F__)
// The column-path input gradient at column stride 2 for small outputs: W^T . grad_out for S samples side
// by side in one product (S * out_plane() >= kBatchedColumns columns, instead of out_plane(): resnet20.s3's
// 49 columns left three of four vectors of the last panel empty, and W^T was packed once per sample),
// then col2im per sample from the block's columns. Every column-matrix value is the same chain over the
// output channels, so the bits are the per-sample path's.
void backward_input_batched(const ConvGeometry& g, const float* wp, const float* gp, float* gx) {
  const int64_t plane = g.out_plane(), image = g.height * g.width, k = g.col_rows();
  const int64_t per_block = std::min(g.batch, (kBatchedColumns + plane - 1) / plane), width = per_block * plane;
  const int64_t blocks = (g.batch + per_block - 1) / per_block;
  const MatrixRef w_t{wp, k, g.out_channels, 1, k};  // W^T
  const BatchSplit split = batch_split(g, blocks);
  const int workers = split.across_samples ? split.threads : 1;
  const int64_t scratch = g.out_channels * width + k * width;  // grad_out of the block, its columns
  Tensor buffer = empty({std::max<int64_t>(1, workers * scratch)});
  auto run_block = [&](int64_t b, float* go_block, bool parallel) {
    float* col = go_block + g.out_channels * width;
    const int64_t n0 = b * per_block, count = std::min(per_block, g.batch - n0);
    for (int64_t o = 0; o < g.out_channels; ++o)
      for (int64_t i = 0; i < count; ++i)
        copy_run(go_block + o * width + i * plane, gp + ((n0 + i) * g.out_channels + o) * plane, plane);
    const MatrixRef go{go_block, g.out_channels, count * plane, width, 1};
    gemm(w_t, go, col, width, 0.0f, parallel);
    for (int64_t i = 0; i < count; ++i) {
      float* gx_sample = gx + (n0 + i) * g.channels * image;
      if (!parallel) {
        col2im_stride2_rows(g, col + i * plane, width, gx_sample, 0, g.channels);
        continue;
      }
#pragma omp parallel for schedule(static) num_threads(get_num_threads_in_use())
      for (int64_t c = 0; c < g.channels; ++c) col2im_stride2_rows(g, col + i * plane, width, gx_sample, c, c + 1);
    }
  };
  float* base = buffer.data<float>();
  if (!split.across_samples) {
    for (int64_t b = 0; b < blocks; ++b) run_block(b, base, split.inside_samples);
    return;
  }
#pragma omp parallel num_threads(workers)
  {
    float* own = base + omp_get_thread_num() * scratch;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) run_block(b, own, false);
  }
}
#endif

void conv2d_backward_input_cpu(const Tensor& grad_out, const Tensor& weight, const Conv2dParams& p, Tensor& grad_x) {
  MN_CHECK(grad_x.is_contiguous(), ValueError, "conv2d backward: grad_x must be contiguous");
  const ConvGeometry g = geometry(grad_x, weight.sizes(), grad_out.sizes(), p);
  const Tensor w = dense(weight), go = dense(grad_out);
  const float* wp = w.data<float>();
  const float* gp = go.data<float>();
  float* gx = grad_x.data<float>();
  const int64_t plane = g.out_plane(), image = g.height * g.width, k = g.col_rows();
  if (g.wide_input_grad() || g.implicit_input_grad()) {
    // W'[c, (o, ki, kj)] = W[o, c, KH - 1 - ki, KW - 1 - kj]
    const int64_t kk = g.kernel_h * g.kernel_w;
    Tensor flipped = empty({g.channels * g.out_channels * kk});
    float* fp = flipped.data<float>();
    for (int64_t c = 0; c < g.channels; ++c)
      for (int64_t o = 0; o < g.out_channels; ++o)
        for (int64_t t = 0; t < kk; ++t) fp[(c * g.out_channels + o) * kk + t] = wp[(o * g.channels + c) * kk + kk - 1 - t];
    implicit_family(g.flipped_conv(), g.batch, g.out_channels, g.channels, {gp, g.out_channels * plane, plane, g.out_w, 1}, fp,
                    nullptr, gx, implicit_team(g.batch * image * g.channels * g.out_channels * kk));
    return;
  }
#if defined(__AVX512F__)
  // With the packed GEMM, whose sums do not depend on the product's width (Eigen's blocking does).
  if (g.stride2_col2im() && g.groups == 1 && plane < kBatchedColumns && cpu::packed_gemm_enabled() &&
      cpu::implicit_conv_enabled())
    return backward_input_batched(g, wp, gp, gx);
#endif
  for_each_sample(g, [&](int64_t n, float* col, bool parallel) {
    float* gx_sample = gx + n * g.channels * image;
    if (!g.pointwise() && !g.padded_col2im() && !g.stride2_col2im())
      std::fill(gx_sample, gx_sample + g.channels * image, 0.0f);
    for (int64_t group = 0; group < g.groups; ++group) {
      const MatrixRef w_t{wp + group * g.group_out * k, k, g.group_out, 1, k};  // W_g^T
      const MatrixRef go_group{gp + (n * g.out_channels + group * g.group_out) * plane, g.group_out, plane, plane, 1};
      float* gx_group = gx_sample + group * g.group_in * image;
      if (g.pointwise()) {
        gemm(w_t, go_group, gx_group, image, 0.0f, parallel);
        continue;
      }
      gemm(w_t, go_group, col, plane, 0.0f, parallel);
      col2im(g, col, gx_group, parallel);
    }
  });
}

// grad_bias[o] = sum over samples and pixels of grad_out[n, o] (channel_sum), channels over threads.
void bias_grad(const Tensor& grad_out, Tensor& grad_bias) {
  const int64_t batch = grad_out.size(0), channels = grad_out.size(1), plane = grad_out.size(2) * grad_out.size(3);
  MN_CHECK(grad_bias.is_contiguous() && grad_bias.numel() == channels, ValueError,
           "conv2d backward: grad_bias must be a contiguous [", channels, "], got ", grad_bias.sizes());
  const float* gp = grad_out.data<float>();
  float* gb = grad_bias.data<float>();
  const int team = cpu::parallel_team(batch * channels * plane, kParallelWork);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1 && channels > 1)
  for (int64_t o = 0; o < channels; ++o) gb[o] = cpu::channel_sum(gp, batch, channels, plane, o);
}

// x may be undefined when only grad_bias is wanted (grad_weight undefined).
void conv2d_backward_weight_cpu(const Tensor& grad_out, const Tensor& x, const Conv2dParams& p, Tensor& grad_weight,
                                Tensor& grad_bias) {
  const Tensor go = dense(grad_out);
  if (grad_bias.defined()) bias_grad(go, grad_bias);
  if (!grad_weight.defined()) return;
  MN_CHECK(grad_weight.is_contiguous(), ValueError, "conv2d backward: grad_weight must be contiguous");
  const ConvGeometry g = geometry(x, grad_weight.sizes(), grad_out.sizes(), p);
  const float* gp = go.data<float>();
  const int64_t plane = g.out_plane();
  const cpu::ColumnGather gather = g.padded() ? cpu::column_gather(g.padded_conv()) : cpu::ColumnGather{};

  const int64_t k = g.col_rows(), weight_size = g.out_channels * k;
  const int64_t chunks = std::max<int64_t>(1, std::min(g.batch, kWeightGradChunks));
  const BatchSplit split = batch_split(g, chunks);
  const int workers = split.across_samples ? split.threads : 1;
  if (g.lane_weight_grad()) {  // its chunks are its only parallel units: fewer samples than threads, fewer threads
    cpu::lane_weight_grad(g.padded_conv(), g.batch, g.channels, g.out_channels,
                          {x.data<float>(), g.sx_n, g.sx_c, g.sx_h, g.sx_w}, gp, grad_weight.data<float>(), chunks,
                          split.across_samples || split.inside_samples ? split.threads : 1);
    return;
  }
  if (g.implicit_weight_grad() && !split.inside_samples) {  // inside_samples: fewer chunks than threads
    cpu::implicit_conv_weight_grad(g.padded_conv(), g.batch, g.channels, g.out_channels,
                                   {x.data<float>(), g.sx_n, g.sx_c, g.sx_h, g.sx_w}, gp, grad_weight.data<float>(),
                                   chunks, workers);
    return;
  }
  // One partial weight gradient per chunk of samples, and one column buffer per worker.
  Tensor partial = empty({chunks * weight_size + workers * std::max<int64_t>(1, g.scratch_size())});
  float* partial_base = partial.data<float>();
  float* col_base = partial_base + chunks * weight_size;
  const float* xp = x.data<float>();

  auto run_chunk = [&](int64_t chunk, float* col, bool parallel) {
    float* acc = partial_base + chunk * weight_size;
    const int64_t n_begin = g.batch * chunk / chunks, n_end = g.batch * (chunk + 1) / chunks;
    if (n_begin == n_end) std::fill(acc, acc + weight_size, 0.0f);  // empty batch
    for (int64_t n = n_begin; n < n_end; ++n) {
      for (int64_t group = 0; group < g.groups; ++group) {
        const float* x_group = xp + n * g.sx_n + group * g.group_in * g.sx_c;
        MatrixRef cols_t{col, plane, k, 1, plane};  // col^T
        if (g.pointwise()) cols_t = {x_group, plane, g.group_in, 1, g.sx_c};
        else fill_im2col(g, x_group, col, parallel, gather);
        const MatrixRef go_group{gp + (n * g.out_channels + group * g.group_out) * plane, g.group_out, plane, plane, 1};
        gemm(go_group, cols_t, acc + group * g.group_out * k, k, n == n_begin ? 0.0f : 1.0f, parallel);
      }
    }
  };
  if (split.across_samples) {
    const int64_t col_size = std::max<int64_t>(1, g.scratch_size());
#pragma omp parallel num_threads(workers)
    {
      float* col = col_base + omp_get_thread_num() * col_size;
#pragma omp for schedule(static)
      for (int64_t chunk = 0; chunk < chunks; ++chunk) run_chunk(chunk, col, false);
    }
  } else {
    for (int64_t chunk = 0; chunk < chunks; ++chunk) run_chunk(chunk, col_base, split.inside_samples);
  }
  cpu::sum_in_order(partial_base, chunks, weight_size, grad_weight.data<float>());
}

}  // namespace

namespace cpu {

void sum_in_order(const float* parts, int64_t count, int64_t size, float* out) {
  constexpr int64_t kBlock = 2048;
  const int64_t blocks = (size + kBlock - 1) / kBlock;
  const int team = parallel_team(count * size);
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1 && blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock, end = std::min(size, begin + kBlock);
    if (out != parts) std::copy(parts + begin, parts + end, out + begin);
    for (int64_t part = 1; part < count; ++part) {
      const float* from = parts + part * size;
      for (int64_t i = begin; i < end; ++i) out[i] += from[i];
    }
  }
}

void add_run_stride2(float* dst, const float* src, int64_t n) {
#if defined(__AVX512F__)
  // Eight sources spread to the even lanes of a vector (one permute); only those lanes are loaded, added
  // and stored.
  const __m512i spread = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t m = std::min<int64_t>(8, n - i);
    const __m512 loaded = _mm512_maskz_loadu_ps(lanes_mask(m), src + i);
    const __m512 v = _mm512_permutex2var_ps(loaded, spread, loaded);
    const __mmask16 even = static_cast<__mmask16>(0x5555 & lanes_mask(2 * m - 1));
    float* d = dst + 2 * i;
    _mm512_mask_storeu_ps(d, even, _mm512_add_ps(_mm512_maskz_loadu_ps(even, d), v));
  }
#else
  for (int64_t i = 0; i < n; ++i) dst[2 * i] += src[i];
#endif
}

}  // namespace cpu

void register_cpu_conv() {
  conv2d_forward.set(DeviceType::CPU, &conv2d_forward_cpu);
  conv2d_backward_input.set(DeviceType::CPU, &conv2d_backward_input_cpu);
  conv2d_backward_weight.set(DeviceType::CPU, &conv2d_backward_weight_cpu);
}

}  // namespace mn::kernels
