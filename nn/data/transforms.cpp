#include "nn/data/transforms.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "core/random.h"

namespace mn::data {

namespace {

// The batch as [N, C, H, W] f32 contiguous on the CPU, and whether it was one sample [C, H, W].
struct ImageBatch {
  Tensor cpu;
  bool single = false;
  int64_t n = 0, c = 0, h = 0, w = 0;
};

ImageBatch as_image_batch(const Tensor& x, const TransformContext& ctx, const char* who) {
  MN_CHECK(x.defined() && (x.dim() == 4 || x.dim() == 3), ValueError, who,
           " expects images [N, C, H, W] or one image [C, H, W], got ",
           x.defined() ? x.sizes().str() : std::string("an undefined tensor"));
  MN_CHECK(x.dtype() == kFloat32, TypeError, who, " expects float32 images, got ", dtype_name(x.dtype()));
  ImageBatch b;
  b.single = x.dim() == 3;
  b.cpu = (b.single ? x.unsqueeze(0) : x).to(kCPU).contiguous();
  b.n = b.cpu.size(0);
  b.c = b.cpu.size(1);
  b.h = b.cpu.size(2);
  b.w = b.cpu.size(3);
  MN_CHECK(static_cast<int64_t>(ctx.samples.size()) == b.n, ValueError, who, ": the context names ",
           ctx.samples.size(), " samples for a batch of ", b.n);
  return b;
}

// Back to the caller's layout and device.
Tensor finish(const Tensor& out, const ImageBatch& b, const Tensor& x) {
  Tensor r = b.single ? out.squeeze(0) : out;
  return x.device() == r.device() ? r : r.to(x.device());
}

// The Philox block of one sample: a stream per (transform kind, Compose position, epoch), the
// sample's data-set index as the counter. The position lives in the high half of the offset and the
// epoch in the low half, so they never meet for epochs below 2^32.
Philox4 sample_draw(const char* kind, const TransformContext& ctx, int64_t sample) {
  const uint64_t stream = stream_key(kind) + (ctx.position << 32) + ctx.epoch;
  return philox_block(ctx.seed, stream, static_cast<uint64_t>(sample));
}

// floor(word * count / 2^32): an integer in [0, count) from one 32-bit word.
int64_t below(uint32_t word, int64_t count) {
  return static_cast<int64_t>((static_cast<uint64_t>(word) * static_cast<uint64_t>(count)) >> 32);
}

}  // namespace

RandomCrop::RandomCrop(std::pair<int64_t, int64_t> size, int64_t padding, double fill)
    : size_h_(size.first), size_w_(size.second), padding_(padding), fill_(fill) {
  MN_CHECK(size_h_ > 0 && size_w_ > 0, ValueError, "RandomCrop: the size must be positive, got ", size_h_, " x ",
           size_w_);
  MN_CHECK(padding >= 0, ValueError, "RandomCrop: padding must be non-negative, got ", padding);
  MN_CHECK(std::isfinite(fill), ValueError, "RandomCrop: fill must be finite, got ", fill);
}

Tensor RandomCrop::apply(const Tensor& x, const TransformContext& ctx) const {
  const ImageBatch b = as_image_batch(x, ctx, "RandomCrop");
  const int64_t ph = b.h + 2 * padding_, pw = b.w + 2 * padding_;
  MN_CHECK(size_h_ <= ph && size_w_ <= pw, ValueError, "RandomCrop: a ", size_h_, " x ", size_w_,
           " crop does not fit the padded image of ", ph, " x ", pw, " (", b.h, " x ", b.w, " plus padding ",
           padding_, ")");
  Tensor out = empty({b.n, b.c, size_h_, size_w_});
  const float* src = b.cpu.data<float>();
  float* dst = out.data<float>();
  const auto fill = static_cast<float>(fill_);
  const int64_t plane_in = b.h * b.w, plane_out = size_h_ * size_w_;
  for (int64_t i = 0; i < b.n; ++i) {
    const Philox4 r = sample_draw("mn::data::RandomCrop", ctx, ctx.samples[static_cast<size_t>(i)]);
    // Window origin in unpadded coordinates (may be negative: inside the padding).
    const int64_t top = below(r.x[0], ph - size_h_ + 1) - padding_;
    const int64_t left = below(r.x[1], pw - size_w_ + 1) - padding_;
    // Columns of the window that fall on the image: [x0, x1).
    const int64_t x0 = std::clamp<int64_t>(-left, 0, size_w_), x1 = std::clamp<int64_t>(b.w - left, x0, size_w_);
    for (int64_t ch = 0; ch < b.c; ++ch) {
      const float* plane = src + (i * b.c + ch) * plane_in;
      float* o = dst + (i * b.c + ch) * plane_out;
      for (int64_t y = 0; y < size_h_; ++y, o += size_w_) {
        const int64_t sy = top + y;
        if (sy < 0 || sy >= b.h) {
          std::fill(o, o + size_w_, fill);
          continue;
        }
        std::fill(o, o + x0, fill);
        std::copy(plane + sy * b.w + left + x0, plane + sy * b.w + left + x1, o + x0);
        std::fill(o + x1, o + size_w_, fill);
      }
    }
  }
  return finish(out, b, x);
}

std::string RandomCrop::describe() const {
  return str("RandomCrop(", size_h_, "x", size_w_, ", padding=", padding_, ", fill=", fill_, ")");
}

RandomHorizontalFlip::RandomHorizontalFlip(double p) : p_(p) {
  MN_CHECK(p >= 0.0 && p <= 1.0, ValueError, "RandomHorizontalFlip: p must be in [0, 1], got ", p);
}

Tensor RandomHorizontalFlip::apply(const Tensor& x, const TransformContext& ctx) const {
  const ImageBatch b = as_image_batch(x, ctx, "RandomHorizontalFlip");
  Tensor out = empty({b.n, b.c, b.h, b.w});
  const float* src = b.cpu.data<float>();
  float* dst = out.data<float>();
  const int64_t sample_numel = b.c * b.h * b.w;
  for (int64_t i = 0; i < b.n; ++i) {
    const Philox4 r = sample_draw("mn::data::RandomHorizontalFlip", ctx, ctx.samples[static_cast<size_t>(i)]);
    // torch.rand(1) < p, with a uniform in [0, 1) from 32 bits: p = 0 never flips, p = 1 always.
    const bool flip = static_cast<double>(r.x[0]) * 0x1p-32 < p_;
    const float* s = src + i * sample_numel;
    float* d = dst + i * sample_numel;
    if (!flip) {
      std::copy(s, s + sample_numel, d);
      continue;
    }
    for (int64_t row = 0; row < b.c * b.h; ++row) std::reverse_copy(s + row * b.w, s + (row + 1) * b.w, d + row * b.w);
  }
  return finish(out, b, x);
}

std::string RandomHorizontalFlip::describe() const { return str("RandomHorizontalFlip(p=", p_, ")"); }

Compose::Compose(std::vector<std::shared_ptr<Transform>> transforms) : transforms_(std::move(transforms)) {
  for (size_t k = 0; k < transforms_.size(); ++k)
    MN_CHECK(transforms_[k] != nullptr, ValueError, "Compose: transform ", k, " is null");
}

Tensor Compose::apply(const Tensor& x, const TransformContext& ctx) const {
  Tensor y = x;
  TransformContext inner = ctx;
  for (size_t k = 0; k < transforms_.size(); ++k) {
    inner.position = ctx.position + k;
    y = transforms_[k]->apply(y, inner);
  }
  return y;
}

std::string Compose::describe() const {
  std::ostringstream os;
  os << "Compose(";
  for (size_t k = 0; k < transforms_.size(); ++k) os << (k ? ", " : "") << transforms_[k]->describe();
  os << ")";
  return os.str();
}

}  // namespace mn::data
