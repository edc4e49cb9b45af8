#pragma once
// Implicit-GEMM convolution for AVX-512 builds: the packed GEMM's register tiles (packed_tiles.h) with
// B packed straight from zero-padded images instead of from a column matrix. The column matrix of
// im2col is never written: each 48-position panel of it is built in L1 for one K block, used by every
// 8-row panel of the weights, and dropped. Output positions run across samples (position q of the
// batch is position q % (OH * OW) of sample q / (OH * OW)), so a 7 x 7 output plane does not leave a
// 1-wide tail panel per sample as a GEMM per sample does.
//
// Every output starts from its bias (or zero) and adds one chain of fused multiply-adds per K block
// (packed::k_block, a function of K only), in order: the bits do not depend on the thread count or on
// which panel an output falls in, and they are those of the column matrix times the weights through
// the packed GEMM onto the bias (the column path with the packed GEMM on).
#include <cstdint>

#include "kernels/cpu/conv_columns.h"

namespace mn::kernels::cpu {

// Whether this build has implicit_conv.
bool implicit_conv_built();

// Whether the CPU convolution uses it where it applies (kernels/cpu/conv.cpp). On by default where
// built; MN_CPU_CONV=im2col in the environment starts the process with the column-matrix path, which
// reproduces runs made before it bit for bit. set_implicit_conv(true) on a build without it is ignored.
void set_implicit_conv(bool enabled);
bool implicit_conv_enabled();

// An image batch [N, C, H, W] with any strides (elements).
struct ConvSource {
  const float* data;
  int64_t stride_n, stride_c, stride_h, stride_w;
};

// out[n, o, q] = sum_r w[o, r] * col_n[r, q] (+ bias[o]) for samples n < batch, output channels
// o < out_channels and output positions q < s.out_h * s.out_w, where col_n is the column matrix (rows
// r = (c, ki, kj)) of sample n of x (`channels` channels) under the geometry s (any stride_w). w is
// row-major [out_channels, channels * kernel_h * kernel_w]; bias may be null; out is contiguous [batch,
// out_channels, out_h * out_w]. Each thread pads the samples its panels read into a small ring of
// padded planes (pad_channels) as it reaches them. Runs on up to `threads` OpenMP threads (1: the
// calling thread only).
void implicit_conv(const PaddedConv& s, int64_t batch, int64_t channels, int64_t out_channels, const ConvSource& x,
                   const float* w, const float* bias, float* out, int threads);

// The same convolution and the same bits as implicit_conv, for unit stride (s.stride_h == s.stride_w ==
// 1) and (kernel_w - 1) * dilation_w <= 17, without packing B: outputs are computed in padded
// coordinates (out_h rows of padded_w() positions, of which out_w are kept), where every K row's 16
// positions are 16 consecutive floats of a padded plane, read in place. Worth it where out_w is close
// to padded_w() (the rest of each row is computed and dropped).
void direct_conv(const PaddedConv& s, int64_t batch, int64_t channels, int64_t out_channels, const ConvSource& x,
                 const float* w, const float* bias, float* out, int threads);
// The same convolution and the same bits as implicit_conv (any stride), with the roles of the GEMM's
// operands swapped: output channels run along the vectors (W^T, packed once) and output positions along
// the tile's rows, each broadcast in place from a sample's padded planes (unpadded geometries: from x
// itself), so nothing is packed per position and no lane is spent on padding; worth it for small images
// with many output channels, where implicit_conv's panels are mostly packing.
void channel_vector_conv(const PaddedConv& s, int64_t batch, int64_t channels, int64_t out_channels,
                         const ConvSource& x, const float* w, const float* bias, float* out, int threads);

// The share of the lanes direct_conv computes for s that hold outputs (the rest are padding columns and
// the last panel's empty lanes); 0 where direct_conv cannot run s.
double direct_lane_use(const PaddedConv& s);

// grad_weight [out_channels, channels * kernel_h * kernel_w] = sum over samples n < batch and output
// positions q of grad_out[n, o, q] * col_n[r, q] (grad_out contiguous [batch, out_channels, out_h *
// out_w]; col_n as above, any stride and dilation), with the column matrix read in place from each
// sample's padded planes (unpadded geometries: from x itself, at its strides). Summed as the column path
// sums it with the packed GEMM: the batch in `chunks` chunks (chunk i: samples batch * i / chunks ..
// batch * (i + 1) / chunks), each sample's product in K blocks of packed::k_block(out_h * out_w) positions
// added onto its chunk's sum, and the chunks added in order; so the bits are that path's on any thread
// count. Chunks run on up to `threads` OpenMP threads.
void implicit_conv_weight_grad(const PaddedConv& s, int64_t batch, int64_t channels, int64_t out_channels,
                               const ConvSource& x, const float* grad_out, float* grad_weight, int64_t chunks,
                               int threads);

// The column matrix's rows (channels * kernel_h * kernel_w) below which lane_weight_grad applies.
constexpr int64_t kLaneWeightGradRows = 16;
// Whether lane_weight_grad can run s with `channels` input channels: unit stride and fewer than
// kLaneWeightGradRows column rows (1-channel 3 x 3 stems, such as CNN2's and ResNet-20's first layer).
bool lane_weight_grad_fits(const PaddedConv& s, int64_t channels);

// The weight gradient of implicit_conv_weight_grad for convolutions with few column rows, where a tile of
// output channels against those rows leaves most lanes empty: positions run along the lanes instead
// (16 consecutive columns of an output row against the same columns of each row's window in the padded
// planes), each weight summing 16 lane partials over a sample's positions. Its bits are its own, not the
// column path's (whose GEMM for fewer than 16 columns is Eigen's), and do not depend on the thread count:
// each chunk of samples (as implicit_conv_weight_grad cuts them) adds its samples' lane sums in order,
// then its 16 lanes in lane order, and the chunks are added in chunk order. Chunks run on up to `threads`
// OpenMP threads. ValueError where lane_weight_grad_fits is false.
void lane_weight_grad(const PaddedConv& s, int64_t batch, int64_t channels, int64_t out_channels, const ConvSource& x,
                      const float* grad_out, float* grad_weight, int64_t chunks, int threads);

}  // namespace mn::kernels::cpu
