#pragma once
// Helpers shared by the loss files of nn/functional (not installed).
#include "nn/functional.h"

namespace mn::nn::functional::loss_internal {

// None, Sum or Mean of the per-element losses; BatchMean (kl_div's alone) is refused naming `op`.
Tensor reduce_loss(const char* op, const Tensor& per_item, Reduction reduction);
// The ValueError for BatchMean in every loss but kl_div, naming `op`.
void refuse_batch_mean(const char* op, Reduction reduction);

}  // namespace mn::nn::functional::loss_internal
