#pragma once
// Finite-difference gradient checks. The analytical gradient of L = sum(v * f(inputs)) for a fixed
// random weight v is compared with central differences computed in double from f32 evaluations
// (step eps). gradgradcheck does the same one level up: it differentiates u . dL/dx (built with
// create_graph) and compares with finite differences of the first-order gradient.
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mn::autograd {

struct GradcheckOptions {
  double eps = 1e-3;
  double atol = 1e-3;
  double rtol = 1e-2;
  uint64_t seed = 1234;  // for the output weights v
};

using TensorFn = std::function<Tensor(const std::vector<Tensor>&)>;

// Returns an empty string on success, otherwise a description of the worst mismatch (input index,
// element, analytical and numerical values). Inputs that require grad are checked.
std::string gradcheck(const TensorFn& fn, const std::vector<Tensor>& inputs, const GradcheckOptions& opts = {});
std::string gradgradcheck(const TensorFn& fn, const std::vector<Tensor>& inputs, const GradcheckOptions& opts = {});

}  // namespace mn::autograd
