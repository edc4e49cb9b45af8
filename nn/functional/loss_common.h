#pragma once
// Helpers shared by the loss files of nn/functional (not installed).
#include "nn/functional.h"

namespace mn::nn::functional::loss_internal {

// None, Sum or Mean of the per-element losses; BatchMean (kl_div's alone) is refused naming `op`.
Tensor reduce_loss(const char* op, const Tensor& per_item, Reduction reduction);

}  // namespace mn::nn::functional::loss_internal
