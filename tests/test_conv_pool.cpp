// conv2d, max_pool2d and avg_pool2d: forward by hand and against a naive direct convolution (stride,
// padding, dilation, groups, non-contiguous input), thread-count independence, gradient checks
// (first and second order), PyTorch's ceil_mode output sizes, and errors.
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cpu/conv_implicit.h"
#include "kernels/cpu/packed_gemm.h"
#include "kernels/kernels.h"
#include "nn/functional.h"
#include "tests/test_support.h"

using namespace mn;
using autograd::gradcheck;
using autograd::gradgradcheck;
using mn::testing::check_close;
using mn::testing::random_param;
using mn::testing::random_tensor;
using mn::testing::tensor;
namespace F = mn::nn::functional;

namespace {

Tensor iota(const Shape& shape) { return arange(1.0, shape.numel() + 1.0, 1.0, DType::f32).reshape(shape); }

struct ConvCase {
  std::array<int64_t, 2> stride{1, 1}, padding{0, 0}, dilation{1, 1};
  int64_t groups = 1;
};

// Direct convolution by the definition, accumulated in double.
std::vector<float> naive_conv(const Tensor& x_in, const Tensor& w_in, const Tensor& b_in, const ConvCase& c) {
  const Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t n = x.size(0), ch = x.size(1), h = x.size(2), wd = x.size(3);
  const int64_t o = w.size(0), cg = w.size(1), kh = w.size(2), kw = w.size(3), og = o / c.groups;
  const int64_t oh = (h + 2 * c.padding[0] - c.dilation[0] * (kh - 1) - 1) / c.stride[0] + 1;
  const int64_t ow = (wd + 2 * c.padding[1] - c.dilation[1] * (kw - 1) - 1) / c.stride[1] + 1;
  std::vector<float> xv = x.to_vector<float>(), wv = w.to_vector<float>(), out(n * o * oh * ow);
  std::vector<float> bv = b_in.defined() ? b_in.to_vector<float>() : std::vector<float>(o, 0.0f);
  for (int64_t s = 0; s < n; ++s)
    for (int64_t oc = 0; oc < o; ++oc)
      for (int64_t y = 0; y < oh; ++y)
        for (int64_t xx = 0; xx < ow; ++xx) {
          double acc = bv[oc];
          const int64_t group = oc / og;
          for (int64_t ic = 0; ic < cg; ++ic)
            for (int64_t i = 0; i < kh; ++i)
              for (int64_t j = 0; j < kw; ++j) {
                const int64_t iy = y * c.stride[0] - c.padding[0] + i * c.dilation[0];
                const int64_t ix = xx * c.stride[1] - c.padding[1] + j * c.dilation[1];
                if (iy < 0 || iy >= h || ix < 0 || ix >= wd) continue;
                const int64_t xc = group * cg + ic;
                acc += double(xv[((s * ch + xc) * h + iy) * wd + ix]) * wv[((oc * cg + ic) * kh + i) * kw + j];
              }
          out[((s * o + oc) * oh + y) * ow + xx] = static_cast<float>(acc);
        }
  return out;
}

Tensor conv(const Tensor& x, const Tensor& w, const Tensor& b, const ConvCase& c) {
  return F::conv2d(x, w, b, c.stride, c.padding, c.dilation, c.groups);
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.sizes() == b.sizes() && std::memcmp(a.data<float>(), b.data<float>(), a.nbytes()) == 0;
}

// Distinct values in random order, at least 0.1 apart, so max pooling has no ties for gradcheck.
Tensor distinct_param(const Shape& shape, uint64_t seed) {
  Generator gen(seed);
  std::vector<float> keys = rand({shape.numel()}, {}, &gen).to_vector<float>();
  std::vector<int64_t> order(keys.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return keys[a] < keys[b]; });
  std::vector<float> values(keys.size());
  for (size_t rank = 0; rank < order.size(); ++rank) values[order[rank]] = 0.1f * static_cast<float>(rank) - 1.0f;
  return from_vector(values, shape).requires_grad_(true);
}

}  // namespace

TEST_CASE("conv2d: forward by hand") {
  Tensor x = iota({1, 1, 3, 3});
  Tensor diag = tensor({1, 0, 0, -1}, {1, 1, 2, 2});
  Tensor y = F::conv2d(x, diag, tensor({1}));
  CHECK(y.sizes() == Shape{1, 1, 2, 2});
  check_close(y, {-3, -3, -3, -3});  // x[i, j] - x[i+1, j+1] + 1
  // All-ones 2x2 kernel, stride 2, padding 1: each output sums the part of its window inside x.
  Tensor z = F::conv2d(x, ones({1, 1, 2, 2}), Tensor(), {2, 2}, {1, 1});
  check_close(z, {1, 5, 11, 28});
  // Two groups of one channel each, one output channel per group.
  Tensor two = F::conv2d(iota({1, 2, 1, 2}), tensor({2, 3}, {2, 1, 1, 1}), Tensor(), {1, 1}, {0, 0}, {1, 1}, 2);
  check_close(two, {2, 4, 9, 12});
}

TEST_CASE("conv2d: matches a naive direct convolution") {
  const std::vector<ConvCase> cases = {
      {},
      {{2, 1}, {1, 2}, {1, 1}, 1},
      {{1, 2}, {2, 1}, {2, 1}, 1},
      {{2, 2}, {1, 1}, {1, 2}, 2},
      {{1, 1}, {0, 0}, {1, 1}, 4},
      {{3, 2}, {2, 2}, {2, 2}, 2},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    CAPTURE(i);
    const ConvCase& c = cases[i];
    Tensor x = random_tensor({3, 4, 9, 8}, 10 + i);
    Tensor w = random_tensor({8, 4 / c.groups, 3, 2}, 20 + i);
    Tensor b = random_tensor({8}, 30 + i);
    check_close(conv(x, w, b, c), naive_conv(x, w, b, c), 1e-4);
    check_close(conv(x, w, Tensor(), c), naive_conv(x, w, Tensor(), c), 1e-4);
  }
  // 1x1 kernels read the input directly as the column matrix.
  Tensor x = random_tensor({2, 6, 5, 7}, 40), w = random_tensor({4, 3, 1, 1}, 41);
  check_close(conv(x, w, Tensor(), {{1, 1}, {0, 0}, {1, 1}, 2}), naive_conv(x, w, Tensor(), {{1, 1}, {0, 0}, {1, 1}, 2}),
              1e-4);
  // Non-contiguous input: channels-last storage seen as NCHW, and a strided slice.
  Tensor nhwc = random_tensor({2, 5, 7, 6}, 42).permute({0, 3, 1, 2});  // [2, 6, 5, 7]
  check_close(conv(nhwc, w, Tensor(), {{1, 1}, {0, 0}, {1, 1}, 2}),
              naive_conv(nhwc, w, Tensor(), {{1, 1}, {0, 0}, {1, 1}, 2}), 1e-4);
  Tensor sliced = random_tensor({2, 6, 10, 7}, 43).slice(2, 0, 10, 2);
  Tensor w3 = random_tensor({3, 6, 3, 3}, 44);
  check_close(conv(sliced, w3, Tensor(), {{1, 1}, {1, 1}, {1, 1}, 1}),
              naive_conv(sliced, w3, Tensor(), {{1, 1}, {1, 1}, {1, 1}, 1}), 1e-4);
  // Unbatched [C, H, W] input.
  Tensor single = random_tensor({4, 6, 6}, 45), w4 = random_tensor({2, 4, 3, 3}, 46);
  Tensor y = F::conv2d(single, w4);
  CHECK(y.sizes() == Shape{2, 4, 4});
  check_close(y, naive_conv(single.unsqueeze(0), w4, Tensor(), {}), 1e-4);
}

TEST_CASE("conv2d: results do not depend on the thread count") {
  const int saved = omp_get_max_threads();
  // Batch 5 spreads samples over threads; batch 2 with 3 threads splits each sample's work instead.
  // The inner dimension, 3 channels x 3 x 3 = 27, takes the forward's small-K product.
  for (int64_t batch : {5, 2}) {
    CAPTURE(batch);
    auto run = [&](int threads) {
      omp_set_num_threads(threads);
      Tensor x = random_param({batch, 6, 24, 22}, 50), w = random_param({8, 3, 3, 3}, 51), b = random_param({8}, 52);
      Tensor y = F::conv2d(x, w, b, {2, 1}, {1, 1}, {1, 2}, 2);
      sum(mul(y, y)).backward();
      return std::vector<Tensor>{y.detach(), x.grad(), w.grad(), b.grad()};
    };
    std::vector<Tensor> one = run(1), three = run(3);
    for (size_t i = 0; i < one.size(); ++i) {
      CAPTURE(i);
      CHECK(bitwise_equal(one[i], three[i]));
    }
  }
  omp_set_num_threads(saved);
}

// Column stride 1 takes the padded im2col/col2im (kernels/cpu/conv_columns.h), column stride 2 the
// padded im2col, which copy rows as whole 16-lane vectors (two-source permutes when 16 outputs span
// at most 32 padded floats, as with stride 1 here; runs otherwise, as with row stride 2 and dilation
// 2, or every other float with column stride 2): rows narrower than a vector (5), exactly one (16)
// and longer (35), a single sample whose work is split over threads inside it, and several samples
// spread over threads.
TEST_CASE("conv2d: padded column path matches the direct convolution for any row width and thread count") {
  const int saved = omp_get_max_threads();
  const ConvCase cases[] = {{{2, 1}, {1, 1}, {1, 2}, 1}, {{1, 1}, {1, 1}, {1, 1}, 1}, {{1, 2}, {1, 1}, {1, 1}, 1}};
  for (const ConvCase& c : cases)
    for (int64_t width : {5, 16, 35})
      for (int64_t batch : {1, 4}) {
        CAPTURE(c.stride[0]);
        CAPTURE(c.stride[1]);
        CAPTURE(width);
        CAPTURE(batch);
        const int64_t in_w = (width - 1) * c.stride[1] + 2 * c.dilation[1] - 1;  // 3 taps, padding 1
        auto run = [&](int threads) {
          omp_set_num_threads(threads);
          Tensor x = random_param({batch, 16, 40, in_w}, 70), w = random_param({12, 16, 3, 3}, 71);
          Tensor b = random_param({12}, 72);
          Tensor y = conv(x, w, b, c);
          sum(mul(y, y)).backward();
          return std::vector<Tensor>{y.detach(), x.grad(), w.grad(), b.grad()};
        };
        std::vector<Tensor> one = run(1), three = run(3);
        CHECK(one[0].size(3) == width);
        check_close(one[0],
                    naive_conv(random_param({batch, 16, 40, in_w}, 70), random_param({12, 16, 3, 3}, 71),
                               random_param({12}, 72), c),
                    1e-4);
        for (size_t i = 0; i < one.size(); ++i) {
          CAPTURE(i);
          CHECK(bitwise_equal(one[i], three[i]));
        }
      }
  omp_set_num_threads(saved);
  // Input gradients through the padded col2im, rows narrower and wider than a vector.
  for (int64_t width : {4, 19}) {
    CAPTURE(width);
    Tensor x = random_param({2, 2, 3, width}, 73), w = random_param({3, 2, 3, 3}, 74, 0.5);
    auto f = [](const std::vector<Tensor>& t) { return F::conv2d(t[0], t[1], Tensor(), {1, 1}, {1, 2}, {1, 2}); };
    CHECK(gradcheck(f, {x, w}) == "");
  }
}

// With an inner dimension past 32 and one group, AVX-512 builds run the forward as an implicit GEMM
// (kernels/cpu/conv_implicit.h): 48-position panels packed straight from the padded images, positions
// running across samples; with unit stride and 64 or more input channels the input gradient is the
// same kernel on the padded grad_out with flipped weights. Shapes that exercise it: panels and 16-lane
// vectors that straddle samples (7 x 7 and 5 x 9 outputs), vectors spanning several image rows in one
// 32-float window or needing several (column stride 2, 3 and dilation), two K blocks (K = 288) and K
// blocks of unequal length, a partial row panel of the weights (5 and 13 output channels), a
// non-contiguous input, padding past (KH - 1) * dilation and 64-channel inputs with padding 0, 1 and
// 2 x dilation 2 (the input gradient's own padding is then 2, 1 and 2; with 3 it keeps the column
// path), 40 samples. Each against the direct convolution, its gradients against the column path's
// (MN_CPU_CONV=im2col), bits across thread counts.
// On builds without AVX-512 both runs take the column path, and the test still checks it.
// An input and weight shape with its convolution arguments; `permuted` stores x as [N, H, W, C] and
// convolves its NCHW view.
struct ShapedCase {
  Shape x, w;
  ConvCase c;
  bool permuted = false;
};

TEST_CASE("conv2d: implicit GEMM path matches the direct convolution and the column path") {
  const ShapedCase cases[] = {
      {{3, 8, 7, 7}, {13, 8, 3, 3}, {{1, 1}, {1, 1}, {1, 1}, 1}},
      {{2, 32, 5, 9}, {5, 32, 3, 3}, {{1, 1}, {1, 1}, {1, 1}, 1}},
      {{2, 6, 15, 15}, {9, 6, 3, 3}, {{2, 2}, {1, 1}, {1, 1}, 1}},
      {{2, 6, 13, 40}, {9, 6, 3, 3}, {{1, 3}, {0, 2}, {1, 1}, 1}},
      {{3, 5, 11, 12}, {6, 5, 3, 2}, {{1, 1}, {2, 1}, {2, 2}, 1}},
      {{2, 7, 9, 9}, {8, 7, 3, 3}, {{1, 1}, {3, 3}, {1, 1}, 1}},
      {{2, 9, 8, 6}, {10, 9, 2, 3}, {{1, 1}, {1, 0}, {1, 1}, 1}, true},
      {{40, 8, 5, 5}, {6, 8, 3, 3}, {{1, 1}, {1, 1}, {1, 1}, 1}},
      {{3, 64, 7, 7}, {6, 64, 3, 3}, {{1, 1}, {1, 1}, {1, 1}, 1}},
      {{2, 64, 9, 11}, {5, 64, 3, 3}, {{1, 1}, {0, 0}, {1, 1}, 1}},
      {{2, 64, 9, 8}, {7, 64, 3, 2}, {{1, 1}, {2, 2}, {2, 2}, 1}, true},
      {{2, 64, 6, 6}, {4, 64, 3, 3}, {{1, 1}, {3, 3}, {1, 1}, 1}},
      // Weight-gradient tiles: 64 output channels (6 x 4 tiles) over 400 positions (two K blocks) and 27
      // rows; 20 (a masked second vector) at stride 2; 48 over 17 samples in 16 chunks.
      {{2, 3, 20, 20}, {64, 3, 3, 3}, {{1, 1}, {1, 1}, {1, 1}, 1}},
      {{3, 4, 9, 9}, {20, 4, 3, 3}, {{2, 2}, {1, 1}, {1, 1}, 1}},
      {{17, 5, 6, 6}, {48, 5, 3, 3}, {{1, 1}, {1, 1}, {1, 1}, 1}},
      // The forward on padded coordinates (rows of 28 outputs in 30 padded floats): 18 panels per sample,
      // two K blocks.
      {{2, 32, 28, 28}, {16, 32, 3, 3}, {{1, 1}, {1, 1}, {1, 1}, 1}},
      // Output channels along the vectors (channel_vector_conv): 64 at stride 2 (6 x 4 tiles), 40 (a
      // masked third vector); and 64 input channels, whose input gradient takes it too.
      {{3, 16, 11, 11}, {64, 16, 3, 3}, {{2, 2}, {1, 1}, {1, 1}, 1}},
      {{2, 8, 9, 9}, {40, 8, 3, 3}, {{1, 1}, {1, 1}, {1, 1}, 1}},
      {{2, 64, 7, 7}, {32, 64, 3, 3}, {{1, 1}, {1, 1}, {1, 1}, 1}},
      // Weight gradients of unpadded convolutions broadcast x in place at its own strides: 1 x 1 stride-2
      // shortcuts (one channels-last) and a dilated 3 x 3.
      {{3, 16, 9, 9}, {24, 16, 1, 1}, {{2, 2}, {0, 0}, {1, 1}, 1}},
      {{2, 16, 8, 8}, {20, 16, 1, 1}, {{2, 2}, {0, 0}, {1, 1}, 1}, true},
      {{2, 8, 11, 12}, {16, 8, 3, 3}, {{1, 1}, {0, 0}, {2, 2}, 1}, true},
  };
  const int saved = omp_get_max_threads();
  for (size_t i = 0; i < std::size(cases); ++i) {
    CAPTURE(i);
    const ShapedCase& k = cases[i];
    // The permuted case stores x as [N, H, W, C] and convolves its NCHW view.
    auto make_x = [&] { return random_param(k.permuted ? Shape{k.x[0], k.x[2], k.x[3], k.x[1]} : k.x, 90 + i); };
    auto run = [&](bool implicit, int threads) {
      kernels::cpu::set_implicit_conv(implicit);
      omp_set_num_threads(threads);
      Tensor leaf = make_x(), w = random_param(k.w, 100 + i), b = random_param({k.w[0]}, 110 + i);
      Tensor x = k.permuted ? leaf.permute({0, 3, 1, 2}) : leaf;
      Tensor y = conv(x, w, b, k.c);
      sum(mul(y, y)).backward();
      return std::vector<Tensor>{y.detach(), leaf.grad(), w.grad(), b.grad()};
    };
    const std::vector<Tensor> implicit = run(true, 1), threaded = run(true, 3), columns = run(false, 1);
    kernels::cpu::set_implicit_conv(true);
    Tensor x = k.permuted ? make_x().detach().permute({0, 3, 1, 2}) : make_x().detach();
    check_close(implicit[0], naive_conv(x, random_param(k.w, 100 + i), random_param({k.w[0]}, 110 + i), k.c), 1e-4);
    // The forward adds the same chains to the bias as the column path's packed GEMM, and the weight
    // gradient forms and adds the same chains as its per-sample products: the same bits.
    if (kernels::cpu::packed_gemm_enabled()) {
      CHECK(bitwise_equal(implicit[0], columns[0]));
      CHECK(bitwise_equal(implicit[2], columns[2]));
    }
    for (size_t t = 0; t < implicit.size(); ++t) {
      CAPTURE(t);
      CHECK(bitwise_equal(implicit[t], threaded[t]));
      check_close(implicit[t], columns[t].to_vector<float>(), 1e-3);
    }
  }
  omp_set_num_threads(saved);
  // Gradients by finite differences, the forward and the input gradient on the implicit kernel. The
  // convolution is linear in each input, so a wide step has no truncation error and keeps the f32
  // rounding of 576-term sums out of the differences.
  Tensor x = random_param({1, 64, 3, 4}, 120), w = random_param({4, 64, 3, 3}, 121, 0.2), b = random_param({4}, 122);
  autograd::GradcheckOptions wide;
  wide.eps = 0.1;
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::conv2d(t[0], t[1], t[2], {1, 1}, {1, 1}); },
                  {x, w, b}, wide) == "");
}

// Fewer than 16 column rows (1-channel stems): the weight gradient with positions along the lanes
// (lane_weight_grad). Its bits are its own but the same on any thread count, and its values the column
// path's to rounding: rows of 26 outputs (a masked second vector), 9 (one partial vector), two channels
// with dilation (12 rows: two output channels per sweep), 15 rows (one per sweep), 17 samples over
// several chunks, an odd output channel count, channels-last storage, and a single sample.
TEST_CASE("conv2d: weight gradient along the lanes for few column rows") {
  const ShapedCase cases[] = {
      {{5, 1, 28, 28}, {16, 1, 3, 3}, {{1, 1}, {0, 0}, {1, 1}, 1}},
      {{3, 1, 9, 9}, {5, 1, 3, 3}, {{1, 1}, {1, 1}, {1, 1}, 1}},
      {{2, 2, 9, 20}, {6, 2, 2, 3}, {{1, 1}, {1, 0}, {2, 1}, 1}},
      {{2, 1, 8, 19}, {3, 1, 3, 5}, {{1, 1}, {1, 2}, {1, 1}, 1}},
      {{17, 1, 6, 6}, {4, 1, 3, 3}, {{1, 1}, {1, 1}, {1, 1}, 1}},
      {{3, 1, 12, 17}, {7, 1, 3, 3}, {{1, 1}, {1, 1}, {1, 1}, 1}, true},
      {{1, 1, 40, 40}, {16, 1, 3, 3}, {{1, 1}, {1, 1}, {1, 1}, 1}},  // one sample: fewer chunks than threads
  };
  const int saved = omp_get_max_threads();
  for (size_t i = 0; i < std::size(cases); ++i) {
    CAPTURE(i);
    const ShapedCase& k = cases[i];
    auto run = [&](bool implicit, int threads) {
      kernels::cpu::set_implicit_conv(implicit);
      omp_set_num_threads(threads);
      Tensor leaf = random_tensor(k.permuted ? Shape{k.x[0], k.x[2], k.x[3], k.x[1]} : k.x, 130 + i);
      Tensor x = k.permuted ? leaf.permute({0, 3, 1, 2}) : leaf;
      Tensor w = random_param(k.w, 140 + i), b = random_param({k.w[0]}, 150 + i);
      Tensor y = conv(x, w, b, k.c);
      y.backward(random_tensor(y.sizes(), 160 + i));
      return std::vector<Tensor>{w.grad(), b.grad()};
    };
    const std::vector<Tensor> lanes = run(true, 1), threaded = run(true, 3), columns = run(false, 1);
    kernels::cpu::set_implicit_conv(true);
    for (size_t t = 0; t < lanes.size(); ++t) {
      CAPTURE(t);
      CHECK(bitwise_equal(lanes[t], threaded[t]));
      check_close(lanes[t], columns[t].to_vector<float>(), 1e-4);
    }
  }
  omp_set_num_threads(saved);
}

// Past 16 samples each of the weight gradient's partial sums covers several samples: the same
// gradient as the sum of per-sample gradients, and the same bits on any thread count.
// The stride-2 col2im (a stride-2 convolution's input gradient) adds eight sources at once into the even
// floats of a vector: each sum as the scalar loop forms it, the odd floats (a -0.0, a NaN) untouched.
TEST_CASE("conv2d: the stride-2 run add equals the scalar loop") {
  for (int64_t n = 0; n <= 40; ++n) {
    CAPTURE(n);
    std::vector<float> src(static_cast<size_t>(n)), expected(static_cast<size_t>(2 * n + 3)), dst;
    for (int64_t i = 0; i < n; ++i) src[static_cast<size_t>(i)] = 0.37f * static_cast<float>(i) - 3.1f;
    for (size_t i = 0; i < expected.size(); ++i)
      expected[i] = i % 2 == 1 ? (i % 4 == 1 ? -0.0f : std::nanf("")) : 1.0f / static_cast<float>(i + 3);
    dst = expected;
    for (int64_t i = 0; i < n; ++i) expected[static_cast<size_t>(2 * i)] += src[static_cast<size_t>(i)];
    kernels::cpu::add_run_stride2(dst.data(), src.data(), n);
    CHECK(std::memcmp(dst.data(), expected.data(), dst.size() * sizeof(float)) == 0);
  }
}

// The input gradient at column stride 2 sums each image row in registers: with one output channel every
// column-matrix value is one exact product w * g, so the column path's sums can be formed here in its
// order (rows (c, ki, kj) ascending onto +0) and compared bit for bit.
TEST_CASE("conv2d: stride-2 input gradient has the column path's bits") {
  const ShapedCase cases[] = {
      {{2, 3, 13, 13}, {1, 3, 3, 3}, {{2, 2}, {1, 1}, {1, 1}, 1}},
      {{1, 2, 9, 27}, {1, 2, 3, 3}, {{2, 2}, {2, 2}, {2, 2}, 1}},  // two vectors per image row, dilation
      {{2, 2, 7, 12}, {1, 2, 2, 4}, {{1, 2}, {0, 1}, {1, 1}, 1}},  // row stride 1, an even-width kernel
  };
  for (size_t i = 0; i < std::size(cases); ++i) {
    CAPTURE(i);
    const ShapedCase& k = cases[i];
    Tensor x = random_param(k.x, 130 + i), w = random_tensor(k.w, 140 + i);
    Tensor y = conv(x, w, Tensor(), k.c);
    Tensor go = random_tensor(y.sizes(), 150 + i);
    y.backward(go);
    const int64_t n = k.x[0], ch = k.x[1], h = k.x[2], wd = k.x[3], kh = k.w[2], kw = k.w[3];
    const int64_t oh = y.size(2), ow = y.size(3);
    const std::vector<float> wv = w.to_vector<float>(), gv = go.to_vector<float>();
    std::vector<float> expected(static_cast<size_t>(n * ch * h * wd), 0.0f);
    for (int64_t s = 0; s < n; ++s)
      for (int64_t c = 0; c < ch; ++c)
        for (int64_t ki = 0; ki < kh; ++ki)
          for (int64_t kj = 0; kj < kw; ++kj)
            for (int64_t oy = 0; oy < oh; ++oy)
              for (int64_t ox = 0; ox < ow; ++ox) {
                const int64_t iy = oy * k.c.stride[0] - k.c.padding[0] + ki * k.c.dilation[0];
                const int64_t ix = ox * k.c.stride[1] - k.c.padding[1] + kj * k.c.dilation[1];
                if (iy < 0 || iy >= h || ix < 0 || ix >= wd) continue;
                const float product = wv[static_cast<size_t>((c * kh + ki) * kw + kj)] * gv[static_cast<size_t>((s * oh + oy) * ow + ox)];
                expected[static_cast<size_t>(((s * ch + c) * h + iy) * wd + ix)] += product;
              }
    const std::vector<float> got = x.grad().to_vector<float>();
    CHECK(std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("conv2d: weight gradient summed in chunks of samples") {
  const int saved = omp_get_max_threads();
  const ConvCase c{{1, 1}, {1, 1}, {1, 1}, 1};
  Tensor x = random_tensor({40, 3, 6, 7}, 80), go = random_tensor({40, 4, 6, 7}, 81);
  auto weight_grad = [&](const Tensor& xs, const Tensor& gos) {
    Tensor w = random_param({4, 3, 3, 3}, 82);
    conv(xs, w, Tensor(), c).backward(gos);
    return w.grad();
  };
  omp_set_num_threads(1);
  Tensor one = weight_grad(x, go);
  std::vector<float> per_sample(one.numel(), 0.0f);
  for (int64_t n = 0; n < 40; ++n) {
    std::vector<float> g = weight_grad(x.slice(0, n, n + 1), go.slice(0, n, n + 1)).to_vector<float>();
    for (size_t i = 0; i < g.size(); ++i) per_sample[i] += g[i];
  }
  check_close(one, per_sample, 1e-4);
  omp_set_num_threads(3);
  CHECK(bitwise_equal(one, weight_grad(x, go)));
  omp_set_num_threads(saved);
}

TEST_CASE("conv2d: gradcheck for input, weight and bias") {
  Tensor x = random_param({2, 4, 5, 5}, 60), w = random_param({4, 2, 3, 3}, 61, 0.5), b = random_param({4}, 62);
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::conv2d(t[0], t[1], t[2], {1, 1}, {0, 0}, {1, 1}, 2); },
                  {x, w, b}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::conv2d(t[0], t[1], t[2], {1, 1}, {1, 1}); },
                  {x, random_param({3, 4, 3, 3}, 67, 0.5), random_param({3}, 68)}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::conv2d(t[0], t[1], t[2], {2, 1}, {1, 2}, {1, 2}, 2); },
                  {x, w, b}) == "");
  // Non-contiguous input through a permuted view.
  Tensor nhwc = random_param({2, 5, 5, 4}, 63);
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::conv2d(t[0].permute({0, 3, 1, 2}), t[1], t[2], {2, 2}, {1, 1}); },
                  {nhwc, random_param({3, 4, 2, 2}, 64), random_param({3}, 65)}) == "");
  // Only some inputs need gradients (the kernel then computes just those).
  Tensor w_fixed = random_tensor({3, 4, 3, 3}, 69), x_fixed = random_tensor({2, 4, 5, 5}, 70);
  CHECK(gradcheck([&](const std::vector<Tensor>& t) { return F::conv2d(t[0], w_fixed, t[1], {2, 2}, {1, 1}); },
                  {x, random_param({3}, 71)}) == "");
  CHECK(gradcheck([&](const std::vector<Tensor>& t) { return F::conv2d(x_fixed, w_fixed, t[0], {1, 1}, {1, 1}); },
                  {random_param({3}, 72)}) == "");
  // 1x1 kernel path.
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::conv2d(t[0], t[1]); },
                  {x, random_param({3, 4, 1, 1}, 66)}) == "");
}

TEST_CASE("conv2d: double backward") {
  Tensor x = random_param({1, 2, 4, 4}, 70), w = random_param({2, 1, 2, 2}, 71), b = random_param({2}, 72);
  CHECK(gradgradcheck([](const std::vector<Tensor>& t) { return F::conv2d(t[0], t[1], t[2], {2, 1}, {1, 0}, {1, 1}, 2); },
                      {x, w, b}) == "");
  CHECK(gradgradcheck([](const std::vector<Tensor>& t) { return tanh(F::conv2d(t[0], t[1], t[2], {1, 1}, {1, 1})); },
                      {x, random_param({3, 2, 3, 3}, 73, 0.5), random_param({3}, 74)}) == "");
}

TEST_CASE("conv2d: errors name the shapes") {
  Tensor x = zeros({2, 3, 8, 8});
  CHECK_THROWS_WITH_AS(F::conv2d(x, zeros({4, 2, 3, 3})), doctest::Contains("[2, 3, 8, 8]"), ValueError);
  CHECK_THROWS_WITH_AS(F::conv2d(x, zeros({4, 3, 3, 3}), Tensor(), {1, 1}, {0, 0}, {1, 1}, 2),
                       doctest::Contains("divisible by groups = 2"), ValueError);
  CHECK_THROWS_WITH_AS(F::conv2d(x, zeros({4, 3, 9, 3})), doctest::Contains("[4, 3, 9, 3]"), ValueError);
  CHECK_THROWS_WITH_AS(F::conv2d(x, zeros({4, 3, 3, 3}), zeros({5})), doctest::Contains("[5]"), ValueError);
  CHECK_THROWS_WITH_AS(F::conv2d(zeros({8, 8}), zeros({4, 3, 3, 3})), doctest::Contains("[8, 8]"), ValueError);
  CHECK_THROWS_WITH_AS(F::conv2d(x, zeros({4, 3, 3, 3}), Tensor(), {0, 1}), doctest::Contains("stride"), ValueError);
  CHECK_THROWS_WITH_AS(F::conv2d(x, zeros({4, 3, 3})), doctest::Contains("[4, 3, 3]"), ValueError);
}

TEST_CASE("pool: max_pool2d forward by hand") {
  Tensor x = iota({1, 1, 4, 4});
  check_close(F::max_pool2d(x, {2, 2}), {6, 8, 14, 16});
  // 3x3 windows, stride 2, padding 1: padding never wins.
  Tensor neg = mul(iota({1, 1, 4, 4}), -1.0);
  check_close(F::max_pool2d(neg, {3, 3}, {2, 2}, {1, 1}), {-1, -2, -5, -6});
  // Unbatched input keeps its rank.
  CHECK(F::max_pool2d(iota({2, 4, 4}), {2, 2}).sizes() == Shape{2, 2, 2});
  // The gradient goes to the argmax of each window.
  Tensor p = iota({1, 1, 4, 4}).requires_grad_(true);
  sum(F::max_pool2d(p, {2, 2})).backward();
  check_close(p.grad(), {0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 1, 0, 1});
}

TEST_CASE("pool: a NaN wins its max_pool2d window and takes the gradient, like PyTorch") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> v(16);
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(i);
  v[4] = nan;  // window (0, 0), below its maximum 5
  v[15] = nan;  // window (1, 1), where it is the last element
  Tensor x = tensor(v, {1, 1, 4, 4}).requires_grad_(true);
  Tensor y = F::max_pool2d(x, {2, 2});
  check_close(y, {nan, 7, 13, nan});
  sum(y).backward();
  check_close(x.grad(), {0, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 1});
}

// 2 x 2 windows at stride 2 take a branch-free row kernel (eight windows per step in AVX-512 builds):
// values and indices must be the general scan's - first maximum on ties, the first NaN wins - in full
// vector steps, partial ones (15 and 7 windows per row), the tensor's last row (partial loads) and, with
// ceil_mode, the windows that hang past the edge.
TEST_CASE("pool: the 2x2 max_pool2d rows give the general scan's values and indices") {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const float pool_values[] = {-inf, -1.0f, 0.0f, 0.0f, 0.0f, 1.0f, 2.0f, nan, inf};
  for (const auto& [h, w] : {std::pair<int64_t, int64_t>{28, 28}, {14, 14}, {9, 31}, {5, 30}, {2, 2}, {3, 17}}) {
    for (const bool ceil : {false, true}) {
      CAPTURE(h);
      CAPTURE(w);
      CAPTURE(ceil);
      const int64_t planes = 6, oh = ceil ? (h + 1) / 2 : h / 2, ow = ceil ? (w + 1) / 2 : w / 2;
      std::vector<float> v(static_cast<size_t>(planes * h * w));
      uint64_t state = 12345 + static_cast<uint64_t>(h * 100 + w);
      for (float& e : v) {
        state = state * 6364136223846793005ULL + 1442695040888963407ULL;
        e = pool_values[(state >> 33) % 9];
      }
      const Tensor x = tensor(v, {2, 3, h, w});
      Tensor out = empty({2, 3, oh, ow}), indices = empty({2, 3, oh, ow}, TensorOptions(DType::i64));
      kernels::Pool2dParams p;
      p.ceil_mode = ceil;
      kernels::max_pool2d_forward(kCPU, x, p, out, indices);
      const std::vector<float> got = out.to_vector<float>();
      const std::vector<int64_t> got_at = indices.to_vector<int64_t>();
      int64_t mismatches = 0;
      for (int64_t pl = 0; pl < planes; ++pl)
        for (int64_t oy = 0; oy < oh; ++oy)
          for (int64_t ox = 0; ox < ow; ++ox) {
            int64_t at = -1;
            float best = -inf;
            for (int64_t y = 2 * oy; y < std::min(2 * oy + 2, h) && !(at >= 0 && std::isnan(best)); ++y)
              for (int64_t xx = 2 * ox; xx < std::min(2 * ox + 2, w); ++xx) {
                const float e = v[static_cast<size_t>(pl * h * w + y * w + xx)];
                if (at < 0 || std::isnan(e) || e > best) {
                  at = y * w + xx;
                  best = e;
                  if (std::isnan(e)) break;
                }
              }
            const size_t o = static_cast<size_t>((pl * oh + oy) * ow + ox);
            const bool same = got_at[o] == at && (std::isnan(best) ? std::isnan(got[o]) : got[o] == best);
            mismatches += same ? 0 : 1;
          }
      CHECK(mismatches == 0);
    }
  }
}

TEST_CASE("pool: avg_pool2d forward by hand") {
  check_close(F::avg_pool2d(iota({1, 1, 4, 4}), {2, 2}), {3.5, 5.5, 11.5, 13.5});
  Tensor x = iota({1, 1, 3, 3});
  // Padding counted in the divisor (every window has 4 slots) or not.
  check_close(F::avg_pool2d(x, {2, 2}, {2, 2}, {1, 1}, false, true), {0.25, 1.25, 2.75, 7});
  check_close(F::avg_pool2d(x, {2, 2}, {2, 2}, {1, 1}, false, false), {1, 2.5, 5.5, 7});
  // ceil_mode: the last window hangs past the input; it averages only what lies inside the padded input.
  Tensor row = iota({1, 1, 1, 5});
  check_close(F::avg_pool2d(row, {1, 2}, {1, 2}, {0, 0}, true), {1.5, 3.5, 5});
}

TEST_CASE("pool: ceil_mode output sizes follow PyTorch") {
  auto width = [](int64_t in, int64_t k, int64_t s, int64_t pad, bool ceil) {
    return F::max_pool2d(zeros({1, 1, 1, in}), {1, k}, {1, s}, {0, pad}, ceil).size(3);
  };
  CHECK(width(5, 2, 2, 0, false) == 2);
  CHECK(width(5, 2, 2, 0, true) == 3);
  CHECK(width(4, 2, 2, 1, true) == 3);
  CHECK(width(4, 2, 2, 1, false) == 3);
  // The rounded-up window would start in the right padding: dropped (3, not 4).
  CHECK(width(5, 2, 2, 1, true) == 3);
  CHECK(width(6, 3, 3, 1, true) == 3);
  CHECK(width(7, 3, 2, 0, true) == 3);
  CHECK(width(8, 3, 2, 0, true) == 4);
  CHECK(F::avg_pool2d(zeros({1, 1, 5, 5}), {2, 2}, {2, 2}, {1, 1}, true).sizes() == Shape{1, 1, 3, 3});
}

TEST_CASE("pool: gradcheck") {
  Tensor x = distinct_param({2, 2, 5, 5}, 80);
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::max_pool2d(t[0], {2, 2}); }, {x}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::max_pool2d(t[0], {3, 3}, {2, 2}, {1, 1}, true); }, {x}) ==
        "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::max_pool2d(t[0].transpose(2, 3), {2, 3}, {1, 2}); },
                  {x}) == "");
  Tensor y = random_param({2, 2, 5, 5}, 81);
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::avg_pool2d(t[0], {2, 2}); }, {y}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::avg_pool2d(t[0], {3, 3}, {2, 2}, {1, 1}, true, true); },
                  {y}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::avg_pool2d(t[0], {3, 2}, {2, 2}, {1, 1}, true, false); },
                  {y}) == "");
  CHECK(gradcheck([](const std::vector<Tensor>& t) { return F::avg_pool2d(t[0].select(0, 1), {2, 2}, {1, 1}); }, {y}) ==
        "");
}

TEST_CASE("pool: double backward") {
  Tensor x = distinct_param({1, 2, 4, 4}, 90);
  CHECK(gradgradcheck([](const std::vector<Tensor>& t) { return square(F::max_pool2d(t[0], {2, 2}, {1, 1})); }, {x}) ==
        "");
  Tensor y = random_param({1, 2, 4, 4}, 91);
  CHECK(gradgradcheck([](const std::vector<Tensor>& t) { return square(F::avg_pool2d(t[0], {3, 3}, {2, 2}, {1, 1}, true)); },
                      {y}) == "");
}

TEST_CASE("pool: errors name the arguments") {
  Tensor x = zeros({1, 1, 4, 4});
  CHECK_THROWS_WITH_AS(F::max_pool2d(x, {2, 2}, {2, 2}, {2, 2}), doctest::Contains("at most half the kernel size"),
                       ValueError);
  CHECK_THROWS_WITH_AS(F::avg_pool2d(x, {5, 5}), doctest::Contains("[1, 1, 4, 4]"), ValueError);
  CHECK_THROWS_WITH_AS(F::max_pool2d(zeros({4, 4}), {2, 2}), doctest::Contains("[4, 4]"), ValueError);
  CHECK_THROWS_WITH_AS(F::max_pool2d(x, {0, 2}), doctest::Contains("kernel size must be positive"), ValueError);
  // padding would give an empty plane an output whose windows hold nothing to read
  CHECK_THROWS_WITH_AS(F::max_pool2d(zeros({1, 1, 0, 4}), {3, 3}, {1, 1}, {1, 1}), doctest::Contains("non-empty height"),
                       ValueError);
}
