// torch.optim.RMSprop over the fused rmsprop_step kernel (kernels/optim_update.h has the update rule).
#include "autograd/ops.h"
#include "core/capture.h"
#include "kernels/kernels.h"
#include "nn/optim.h"
#include "nn/optim_step.h"

namespace mn::nn::optim {

namespace {
// PyTorch's checks; options are public and may change between steps: checked at construction and at
// every step.
void check_options(const RMSpropOptions& o) {
  Optimizer::check_lr(o.lr, "RMSprop (options.lr)");
  MN_CHECK(o.eps >= 0, ValueError, "RMSprop: eps must be >= 0, got ", o.eps);
  MN_CHECK(o.alpha >= 0, ValueError, "RMSprop: alpha must be >= 0, got ", o.alpha);
  MN_CHECK(o.momentum >= 0 && o.weight_decay >= 0, ValueError, "RMSprop: momentum and weight_decay must be >= 0, got ",
           o.momentum, ", ", o.weight_decay);
}
}  // namespace

RMSprop::RMSprop(std::vector<Tensor> params, RMSpropOptions o) : Optimizer(std::move(params)), options(o) {
  check_options(o);
}

std::vector<Optimizer::StateEntry> RMSprop::state_entries() const {
  std::vector<StateEntry> entries{{"square_avg", true}, {"step", false}};
  if (options.momentum > 0) entries.push_back({"momentum_buffer", true});
  if (options.centered) entries.push_back({"grad_avg", true});
  return entries;
}

void RMSprop::step() {
  capture::unsupported("RMSprop::step() passes host-side learning rates to its kernel");
  check_options(options);
  detail::update_each_parameter("RMSprop", steps_, params_, [&](size_t i, Tensor& p) {
    Tensor g = dense_grad(p);
    Tensor& square_avg = state_tensor(state_[i], "square_avg", p);
    // Buffers start at zero, as in PyTorch (the momentum buffer too, unlike SGD's).
    Tensor buf = options.momentum > 0 ? state_tensor(state_[i], "momentum_buffer", p) : Tensor();
    Tensor grad_avg = options.centered ? state_tensor(state_[i], "grad_avg", p) : Tensor();
    advance_step(state_[i]);
    kernels::rmsprop_step(p.device(), p, g, square_avg, buf, grad_avg,
                          kernels::RmspropParams{options.lr, options.alpha, options.eps, options.weight_decay,
                                                 options.momentum, options.centered});
  });
}

}  // namespace mn::nn::optim
