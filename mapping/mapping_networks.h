#pragma once
// Umbrella header: one include for applications that embed mapping_networks.
//   #include "mapping/mapping_networks.h"
// It pulls in the public API that exists today (tensors, allocator statistics, random numbers,
// differentiable ops, the autograd engine, NoGradGuard, gradient checks and nn::functional).
// The nn layers and optimizers, the mapping generators/models/trainer and the dist headers join it
// as they land.
#include "core/allocator.h"
#include "core/random.h"
#include "core/tensor.h"

#include "autograd/engine.h"
#include "autograd/gradcheck.h"
#include "autograd/node.h"  // NoGradGuard
#include "autograd/ops.h"

#include "nn/functional.h"
