// softmax and log_softmax. First-order backward runs the fused softmax_backward kernel; when the
// backward itself is recorded (create_graph) the same formula is written with differentiable ops:
//   softmax:     dx = y * (g - sum(g * y))
//   log_softmax: dx = g - exp(y) * sum(g)
#include "autograd/autocast.h"
#include "autograd/functions/common.h"

namespace mn {

using autograd::OutputContext;
using autograd::TensorList;

namespace {

Tensor softmax_op(const Tensor& x_in, int64_t dim, bool log) {
  const Tensor x = amp::cast_f32(x_in);  // an f32 op under autocast (autograd/autocast.h)
  const char* name = log ? "log_softmax" : "softmax";
  detail::check_defined(name, x, "x");
  detail::check_float(name, x, "x");
  const int d = wrap_dim(dim, x.dim());
  Tensor out = empty(x.sizes(), x.options());
  kernels::softmax(x.device(), x, d, log, out);
  if (autograd::needs_grad({&x}))
    autograd::record(
        log ? "LogSoftmaxBackward" : "SoftmaxBackward", {&x}, {&out},
        [d, log](const OutputContext& c) -> TensorList {
          Tensor y = c.output();
          const Tensor& g = c.grad();
          if (!autograd::grad_mode_enabled()) {
            Tensor grad_in = empty(y.sizes(), y.options());
            kernels::softmax_backward(y.device(), g, y, d, log, grad_in);
            return {grad_in};
          }
          if (log) return {sub(g, mul(exp(y), sum(g, {d}, true)))};
          return {mul(y, sub(g, sum(mul(g, y), {d}, true)))};
        },
        /*save_outputs=*/true);
  return out;
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) { return softmax_op(x, dim, false); }
Tensor log_softmax(const Tensor& x, int64_t dim) { return softmax_op(x, dim, true); }

}  // namespace mn
