#include "nn/init.h"

#include <cmath>

#include "autograd/node.h"
#include "kernels/factories.h"

namespace mn::nn::init {

std::pair<int64_t, int64_t> fans(const Tensor& w) {
  MN_CHECK(w.dim() >= 2, ValueError, "fan in/out need a weight with at least 2 dimensions, got shape ", w.sizes());
  int64_t receptive = 1;
  for (int d = 2; d < w.dim(); ++d) receptive *= w.sizes()[d];
  return {w.sizes()[1] * receptive, w.sizes()[0] * receptive};
}

namespace {
void assign(Tensor& t, const Tensor& values) {
  autograd::NoGradGuard no_grad;
  Tensor dst = t.detach();
  dst.copy_(values);
}
}  // namespace

void uniform_(Tensor& t, double lo, double hi, Generator* gen) {
  assign(t, uniform(t.sizes(), lo, hi, t.options(), gen));
}
void normal_(Tensor& t, double mean, double std, Generator* gen) {
  assign(t, normal(t.sizes(), mean, std, t.options(), gen));
}
void constant_(Tensor& t, double value) {
  autograd::NoGradGuard no_grad;
  Tensor dst = t.detach();
  dst.fill_(value);
}
void kaiming_uniform_(Tensor& t, double a, Generator* gen) {
  const double bound = std::sqrt(6.0 / ((1.0 + a * a) * static_cast<double>(fans(t).first)));
  uniform_(t, -bound, bound, gen);
}
void xavier_uniform_(Tensor& t, double gain, Generator* gen) {
  auto [in, out] = fans(t);
  const double bound = gain * std::sqrt(6.0 / static_cast<double>(in + out));
  uniform_(t, -bound, bound, gen);
}

}  // namespace mn::nn::init
