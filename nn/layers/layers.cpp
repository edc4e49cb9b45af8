// Linear, Conv2d, BatchNorm, pooling, Dropout and Sequential.
#include <cmath>

#include "autograd/node.h"
#include "kernels/kernels.h"
#include "nn/init.h"
#include "nn/layers.h"

namespace mn::nn {

namespace F = functional;

Linear::Linear(int64_t in, int64_t out, bool bias) : Module("Linear"), in_features(in), out_features(out) {
  MN_CHECK(in > 0 && out > 0, ValueError, "Linear: features must be positive, got in=", in, ", out=", out);
  Tensor w = empty({out, in});
  // PyTorch: kaiming_uniform(a=sqrt(5)) -> U(-1/sqrt(in), 1/sqrt(in)); bias U(-1/sqrt(in), 1/sqrt(in)).
  init::kaiming_uniform_(w, std::sqrt(5.0));
  register_parameter("weight", w);
  if (bias) {
    Tensor b = empty({out});
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    init::uniform_(b, -bound, bound);
    register_parameter("bias", b);
  }
}

Tensor Linear::forward(const Tensor& x) {
  MN_CHECK(x.dim() >= 1 && x.size(-1) == in_features, ValueError, "Linear(", in_features, ", ", out_features,
           "): expected input with last dimension ", in_features, ", got shape ", x.sizes());
  return F::linear(x, param("weight"), has_parameter("bias") ? param("bias") : Tensor());
}

Conv2d::Conv2d(int64_t in, int64_t out, std::array<int64_t, 2> k, std::array<int64_t, 2> s, std::array<int64_t, 2> p,
               std::array<int64_t, 2> d, int64_t g, bool bias)
    : Module("Conv2d"), in_channels(in), out_channels(out), kernel(k), stride(s), padding(p), dilation(d), groups(g) {
  MN_CHECK(in > 0 && out > 0 && g > 0 && in % g == 0 && out % g == 0, ValueError,
           "Conv2d: channels must be positive and divisible by groups, got in=", in, ", out=", out, ", groups=", g);
  Tensor w = empty({out, in / g, k[0], k[1]});
  init::kaiming_uniform_(w, std::sqrt(5.0));
  register_parameter("weight", w);
  if (bias) {
    Tensor b = empty({out});
    const double bound = 1.0 / std::sqrt(static_cast<double>(init::fans(w).first));
    init::uniform_(b, -bound, bound);
    register_parameter("bias", b);
  }
}

Tensor Conv2d::forward(const Tensor& x) {
  return F::conv2d(x, param("weight"), has_parameter("bias") ? param("bias") : Tensor(), stride, padding, dilation,
                   groups);
}

BatchNorm::BatchNorm(const char* type, int64_t n, double eps, double momentum, bool affine, int lo, int hi)
    : Module(type), num_features(n), eps(eps), momentum(momentum), affine(affine), dims_lo_(lo), dims_hi_(hi) {
  MN_CHECK(n > 0, ValueError, type, ": num_features must be positive, got ", n);
  if (affine) {
    register_parameter("weight", ones({n}));
    register_parameter("bias", zeros({n}));
  }
  register_buffer("running_mean", zeros({n}));
  register_buffer("running_var", ones({n}));
  register_buffer("num_batches_tracked", zeros({}, DType::i64));
}

Tensor BatchNorm::forward(const Tensor& x) {
  MN_CHECK(x.dim() >= dims_lo_ && x.dim() <= dims_hi_ && x.size(1) == num_features, ValueError, type_name(), "(",
           num_features, "): expected input with ", dims_lo_, (dims_lo_ == dims_hi_ ? "" : str("-", dims_hi_)),
           " dims and ", num_features, " channels in dim 1, got shape ", x.sizes());
  Tensor running_mean = buffer("running_mean"), running_var = buffer("running_var");
  if (is_training()) {
    // In place, like the running statistics, so a captured step (nn/compile.h) counts every replay.
    Tensor tracked = buffer("num_batches_tracked");
    kernels::unary(tracked.device(), kernels::UnaryOp::AddScalar, tracked, tracked, 1.0, 0.0);
    tracked.bump_version();
  }
  return F::batch_norm(x, running_mean, running_var, affine ? param("weight") : Tensor(),
                       affine ? param("bias") : Tensor(), is_training(), momentum, eps);
}

MaxPool2d::MaxPool2d(std::array<int64_t, 2> k, std::array<int64_t, 2> s, std::array<int64_t, 2> p, bool ceil)
    : Module("MaxPool2d"), kernel(k), stride(s[0] == 0 && s[1] == 0 ? k : s), padding(p), ceil_mode(ceil) {}
Tensor MaxPool2d::forward(const Tensor& x) { return F::max_pool2d(x, kernel, stride, padding, ceil_mode); }

AvgPool2d::AvgPool2d(std::array<int64_t, 2> k, std::array<int64_t, 2> s, std::array<int64_t, 2> p, bool ceil,
                     bool include_pad)
    : Module("AvgPool2d"),
      kernel(k),
      stride(s[0] == 0 && s[1] == 0 ? k : s),
      padding(p),
      ceil_mode(ceil),
      count_include_pad(include_pad) {}
Tensor AvgPool2d::forward(const Tensor& x) {
  return F::avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad);
}

Dropout::Dropout(double p) : Module("Dropout"), p(p) {
  MN_CHECK(p >= 0.0 && p < 1.0, ValueError, "Dropout: p must be in [0, 1), got ", p);
}
Tensor Dropout::forward(const Tensor& x) { return F::dropout(x, p, is_training()); }

Sequential::Sequential(std::vector<ModulePtr> modules) : Module("Sequential") {
  for (auto& m : modules) push_back(std::move(m));
}

Sequential& Sequential::push_back(ModulePtr module) {
  add_child(std::to_string(named_children().size()), std::move(module));
  return *this;
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor h = x;
  for (auto& [name, m] : named_children()) h = (*m)(h);
  return h;
}

}  // namespace mn::nn
