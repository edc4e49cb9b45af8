#pragma once
// The srht mapper family's differentiable pieces (the kernels and the math: kernels/srht_math.h).
#include <cstdint>
#include <memory>

#include "core/tensor.h"

namespace mn::kernels {
struct SrhtPlan;  // kernels/srht_math.h (internal: not installed)
}

namespace mn::mapping {

// The plan of a rows x cols map with orthonormal columns times `expansion` (W^T W = expansion^2 I), or
// null when rows < P (the power of two >= cols): the Hadamard blocks do not fit.
std::shared_ptr<const kernels::SrhtPlan> srht_plan(uint64_t seed, uint64_t stream, int64_t rows, int64_t cols,
                                           double expansion);

// W z (z [cols] -> [rows]) and W^T u (u [rows] -> [cols]); each one's gradient is the other, so both
// are differentiable any number of times (the map is linear).
Tensor srht_forward(const kernels::SrhtPlan& plan, const Tensor& z);
Tensor srht_transpose(const kernels::SrhtPlan& plan, const Tensor& u);

}  // namespace mn::mapping
