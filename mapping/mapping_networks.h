#pragma once
// Umbrella header: one include for applications that embed mapping_networks.
//   #include "mapping/mapping_networks.h"
// Tensors and the autograd engine, nn layers/optimizers/data/safetensors, and the mapping-network
// API (specs, mappers, generators, MappingModel, losses, trainer, checkpoints, profilers, built-in
// targets). dist/ headers are available when the library was built with Gloo.
#include "core/allocator.h"
#include "core/cuda.h"  // streams, record_stream, synchronize, set_allow_tf32 (throw DeviceError without CUDA)
#include "core/parallel.h"  // get_num_threads, set_num_threads
#include "core/random.h"
#include "core/tensor.h"

#include "autograd/engine.h"
#include "autograd/gradcheck.h"
#include "autograd/node.h"  // NoGradGuard
#include "autograd/ops.h"

#include "nn/compile.h"
#include "nn/functional.h"
#include "nn/functional_call.h"
#include "nn/init.h"
#include "nn/layers.h"
#include "nn/module.h"
#include "nn/optim.h"
#include "nn/safetensors.h"

#include "mapping/checkpoint.h"
#include "mapping/generator.h"
#include "mapping/losses.h"
#include "mapping/mapper.h"
#include "mapping/mapping_model.h"
#include "mapping/orthogonal.h"
#include "mapping/parameter_spec.h"
#include "mapping/profiler.h"
#include "mapping/targets.h"
#include "mapping/trainer.h"
