// Tensor factories (kernels/factories.h): constant fills, ranges and Philox random fills over memory
// from core's empty().
#include <cmath>
#include <string>
#include <vector>

#include "kernels/factories.h"
#include "kernels/kernels.h"

namespace mn {

Tensor full(const Shape& shape, double value, TensorOptions opts) {
  const bool rg = opts.requires_grad;
  opts.requires_grad = false;
  Tensor t = empty(shape, opts);
  kernels::fill(t.device(), t, value);
  if (rg) t.requires_grad_(true);
  return t;
}
Tensor zeros(const Shape& shape, TensorOptions opts) { return full(shape, 0.0, opts); }
Tensor ones(const Shape& shape, TensorOptions opts) { return full(shape, 1.0, opts); }
Tensor zeros_like(const Tensor& t) { return zeros(t.sizes(), t.options()); }
Tensor ones_like(const Tensor& t) { return ones(t.sizes(), t.options()); }
Tensor full_like(const Tensor& t, double value) {
  return full(t.sizes(), value, t.options());
}
Tensor scalar_tensor(double value, TensorOptions opts) { return full({}, value, opts); }

Tensor arange(double start, double end, double step, TensorOptions opts) {
  MN_CHECK(step != 0, ValueError, "arange: step must be non-zero");
  MN_CHECK((end - start) / step >= 0 || start == end, ValueError, "arange: range [", start, ", ", end,
           ") is empty or reversed for step ", step);
  const int64_t n = std::max<int64_t>(0, static_cast<int64_t>(std::ceil((end - start) / step)));
  auto values = [&](auto zero) {
    std::vector<decltype(zero)> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<decltype(zero)>(start + i * step);
    return v;
  };
  if (is_floating_point(opts.dtype)) return from_vector(values(0.0f), Shape{n}, opts);
  return from_vector(values(int64_t{0}), Shape{n}, opts);
}
Tensor arange(int64_t end, TensorOptions opts) { return arange(0.0, static_cast<double>(end), 1.0, opts); }

namespace {
void fill_random(Tensor& out, Distribution dist, double p1, double p2, const PhiloxState& state) {
  kernels::random_fill(out.device(), out, dist, p1, p2, state);
}

Tensor random_tensor(const Shape& shape, Distribution dist, double p1, double p2, TensorOptions opts, Generator* gen) {
  check_distribution_params(dist, p1, p2);
  const bool rg = opts.requires_grad;
  opts.requires_grad = false;
  Tensor t = empty(shape, opts);
  Generator& g = gen ? *gen : default_generator();
  capture::random_fill(t, dist, p1, p2, g, fill_random);  // a fresh range at every replay of a captured graph
  if (rg) t.requires_grad_(true);
  return t;
}
}  // namespace

Tensor rand(const Shape& shape, TensorOptions opts, Generator* gen) {
  return random_tensor(shape, Distribution::Uniform, 0.0, 1.0, opts, gen);
}
Tensor randn(const Shape& shape, TensorOptions opts, Generator* gen) {
  return random_tensor(shape, Distribution::Normal, 0.0, 1.0, opts, gen);
}
Tensor uniform(const Shape& shape, double lo, double hi, TensorOptions opts, Generator* gen) {
  return random_tensor(shape, Distribution::Uniform, lo, hi, opts, gen);
}
Tensor normal(const Shape& shape, double mean, double std, TensorOptions opts, Generator* gen) {
  return random_tensor(shape, Distribution::Normal, mean, std, opts, gen);
}
Tensor bernoulli(const Shape& shape, double p, TensorOptions opts, Generator* gen) {
  return random_tensor(shape, Distribution::Bernoulli, p, 0.0, opts, gen);
}
Tensor rademacher(const Shape& shape, TensorOptions opts, Generator* gen) {
  return random_tensor(shape, Distribution::Rademacher, 0.0, 0.0, opts, gen);
}

namespace {
template <class T>
Tensor from_values(const std::vector<T>& values, const Shape& shape, TensorOptions opts) {
  Shape s = shape.empty() && values.size() != 1 ? Shape{static_cast<int64_t>(values.size())} : shape;
  if (shape.empty() && values.size() == 1) s = Shape{1};
  MN_CHECK(s.numel() == static_cast<int64_t>(values.size()), ValueError, "from_vector: ", values.size(),
           " values do not fill shape ", s);
  const bool rg = opts.requires_grad;
  Tensor host = empty(s, TensorOptions(dtype_of<T>::value));
  {
    capture::Pause pause;  // a host write, kept by host_wrote below
    std::copy(values.begin(), values.end(), host.data<T>());
  }
  capture::host_wrote(host);
  Tensor t = host;
  if (opts.dtype != dtype_of<T>::value) t = t.to(opts.dtype);
  if (!opts.device.is_cpu()) t = t.to(opts.device);
  if (rg) t.requires_grad_(true);
  return t;
}
}  // namespace

Tensor from_vector(const std::vector<float>& values, const Shape& shape, TensorOptions opts) {
  return from_values(values, shape, opts);
}
Tensor from_vector(const std::vector<int64_t>& values, const Shape& shape, TensorOptions opts) {
  return from_values(values, shape, opts);
}

}  // namespace mn
