#pragma once
// Internal to nn/functional: the gradient of a max pool, shared by max_pool2d (pool.cpp) and
// adaptive_max_pool2d (adaptive_pool.cpp), whose backward passes are the same scatter.
#include "core/tensor.h"

namespace mn::nn::functional {

// g scattered into zeros of x_shape [N,C,H,W] at the per-plane flat argmax positions `indices`
// (recorded, so double backward works: its gradient gathers at the same positions).
Tensor max_pool2d_grad(const Tensor& g, const Tensor& indices, const Shape& x_shape);

}  // namespace mn::nn::functional
