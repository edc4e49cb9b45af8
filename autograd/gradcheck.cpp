#include "autograd/gradcheck.h"

#include <cmath>
#include <sstream>

#include "autograd/engine.h"
#include "autograd/node.h"
#include "autograd/ops.h"
#include "core/random.h"

namespace mn::autograd {

namespace {

// Weighted sum of the output in double on the host: the scalar whose gradient we check.
double weighted_sum(const Tensor& y, const std::vector<float>& v) {
  std::vector<float> values = y.detach().to_vector<float>();
  double s = 0;
  for (size_t i = 0; i < values.size(); ++i) s += static_cast<double>(v[i]) * values[i];
  return s;
}

std::vector<float> output_weights(const TensorFn& fn, const std::vector<Tensor>& inputs, uint64_t seed) {
  NoGradGuard no_grad;
  Tensor y = fn(inputs);
  Generator gen(seed);
  return uniform(y.sizes(), 0.5, 1.5, {}, &gen).to_vector<float>();
}

// Numerical d(sum v*f)/d(input k) by central differences, perturbing each element in place.
std::vector<double> numerical_gradient(const TensorFn& fn, const std::vector<Tensor>& inputs, size_t k,
                                       const std::vector<float>& v, double eps) {
  NoGradGuard no_grad;
  Tensor x = inputs[k];
  std::vector<double> out(static_cast<size_t>(x.numel()));
  // Perturb through a contiguous host copy written back into x's own storage layout.
  std::vector<float> base = x.to_vector<float>();
  auto write = [&](const std::vector<float>& values) {
    Tensor src = from_vector(values).reshape(x.sizes());
    Tensor dst = x.detach();
    dst.copy_(src.to(x.device()));
  };
  for (size_t i = 0; i < base.size(); ++i) {
    std::vector<float> p = base;
    p[i] = static_cast<float>(base[i] + eps);
    write(p);
    const double plus = weighted_sum(fn(inputs), v);
    p[i] = static_cast<float>(base[i] - eps);
    write(p);
    const double minus = weighted_sum(fn(inputs), v);
    // Use the actually representable step so rounding of x +- eps does not bias the estimate.
    const double step = static_cast<double>(static_cast<float>(base[i] + eps)) -
                        static_cast<double>(static_cast<float>(base[i] - eps));
    out[i] = (plus - minus) / step;
  }
  write(base);
  return out;
}

std::string compare(const std::vector<float>& analytical, const std::vector<double>& numerical, size_t k,
                    const GradcheckOptions& opts, const char* what) {
  double worst = 0;
  size_t worst_i = 0;
  for (size_t i = 0; i < numerical.size(); ++i) {
    const double a = i < analytical.size() ? analytical[i] : 0.0;
    const double excess = std::abs(a - numerical[i]) - (opts.atol + opts.rtol * std::abs(numerical[i]));
    if (excess > worst || std::isnan(a) != std::isnan(numerical[i])) {
      worst = std::isnan(excess) ? 1e300 : excess;
      worst_i = i;
    }
  }
  if (worst <= 0) return "";
  std::ostringstream os;
  os << what << " mismatch for input " << k << " at element " << worst_i << ": analytical "
     << (worst_i < analytical.size() ? analytical[worst_i] : 0.0f) << ", numerical " << numerical[worst_i]
     << " (atol " << opts.atol << ", rtol " << opts.rtol << ")";
  return os.str();
}

}  // namespace

std::string gradcheck(const TensorFn& fn, const std::vector<Tensor>& inputs, const GradcheckOptions& opts) {
  const std::vector<float> v = output_weights(fn, inputs, opts.seed);
  std::vector<Tensor> checked;
  std::vector<size_t> index;
  for (size_t k = 0; k < inputs.size(); ++k)
    if (inputs[k].defined() && inputs[k].requires_grad()) {
      checked.push_back(inputs[k]);
      index.push_back(k);
    }
  if (checked.empty()) return "gradcheck: no input requires grad";
  Tensor y = fn(inputs);
  Tensor vt = from_vector(v).reshape(y.sizes()).to(y.device());
  // An output without history has a zero gradient (e.g. a second derivative that vanishes).
  std::vector<Tensor> grads(checked.size());
  if (y.requires_grad()) grads = grad({y}, checked, {vt}, false, false, /*allow_unused=*/true);
  for (size_t j = 0; j < checked.size(); ++j) {
    std::vector<float> analytical =
        grads[j].defined() ? grads[j].to_vector<float>() : std::vector<float>(checked[j].numel(), 0.0f);
    std::string err = compare(analytical, numerical_gradient(fn, inputs, index[j], v, opts.eps), index[j], opts,
                              "gradient");
    if (!err.empty()) return err;
  }
  return "";
}

std::string gradgradcheck(const TensorFn& fn, const std::vector<Tensor>& inputs, const GradcheckOptions& opts) {
  // g(x) = sum_j u_j * dL/dx_j with L = sum(v * f(x)); check dg/dx against finite differences of g.
  const std::vector<float> v = output_weights(fn, inputs, opts.seed);
  std::vector<Tensor> checked;
  for (const Tensor& t : inputs)
    if (t.defined() && t.requires_grad()) checked.push_back(t);
  if (checked.empty()) return "gradgradcheck: no input requires grad";
  std::vector<Tensor> us;
  Generator gen(opts.seed + 1);
  for (const Tensor& t : checked) us.push_back(uniform(t.sizes(), 0.5, 1.5, {}, &gen).to(t.device()));

  TensorFn first_order = [&](const std::vector<Tensor>& xs) -> Tensor {
    GradModeGuard enable(true);
    std::vector<Tensor> cs;
    for (const Tensor& t : xs)
      if (t.defined() && t.requires_grad()) cs.push_back(t);
    Tensor y = fn(xs);
    Tensor vt = from_vector(v).reshape(y.sizes()).to(y.device());
    std::vector<Tensor> g = grad({y}, cs, {vt}, true, true, true);
    Tensor total = zeros({});
    for (size_t j = 0; j < g.size(); ++j)
      if (g[j].defined()) total = add(total, sum(mul(g[j], us[j])));
    return total;
  };
  GradcheckOptions second = opts;
  return gradcheck(first_order, inputs, second);
}

}  // namespace mn::autograd
