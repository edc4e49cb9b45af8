#pragma once
// The loop every optimizer's step() runs (nn/optim.cpp, nn/optim_rmsprop.cpp; not installed).
#include <string>
#include <vector>

#include "autograd/node.h"
#include "core/tensor.h"

namespace mn::nn::optim::detail {

// Under no-grad: counts the step, then for each parameter with a gradient (refusing a non-contiguous
// one, named with `who`) calls update(index, parameter) and bumps the parameter's version.
template <class Update>
void update_each_parameter(const std::string& who, int64_t& steps, std::vector<Tensor>& params, Update update) {
  autograd::NoGradGuard no_grad;
  ++steps;
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor& p = params[i];
    if (!p.grad().defined()) continue;
    MN_CHECK(p.is_contiguous(), ValueError, who, ": parameter ", i, " must be contiguous");
    update(i, p);
    p.bump_version();
  }
}

}  // namespace mn::nn::optim::detail
