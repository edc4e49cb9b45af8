#pragma once
// Umbrella header: the whole public API in one include, for applications that embed mapping_networks.
//   #include "mapping/mapping_networks.h"
// Tensors, the caching allocator, RNG and threads; the autograd engine and recomputation
// (autograd::checkpoint); nn modules, layers, functional ops, optimizers, mn::compile, safetensors,
// data loading (DataLoader, Fashion-MNIST) and Progress; the trainer of any module (train::Trainer,
// callbacks, file loggers, checkpoints, Ctrl-C); the mapping-network API (specs, mappers,
// generators, MappingModel, losses, trainer, checkpoints, profilers, built-in targets); and data
// parallel training (dist: stores, process groups, the DDP wrapper, DistributedSampler).
// dist/ is built in every configuration; only its backends depend on the build: the "gloo" process
// group needs Gloo and "nccl" needs CUDA and NCCL (dist::available_backends() lists what this build
// has; make_process_group and setup_ddp refuse the others with an error naming them).
// tests/umbrella/umbrella_api.cpp compiles every documented entry point through this include alone.
#include "core/allocator.h"
#include "core/cuda.h"  // streams, record_stream, synchronize, set_allow_tf32 (throw DeviceError without CUDA)
#include "core/parallel.h"  // get_num_threads, set_num_threads
#include "core/random.h"
#include "core/tensor.h"

#include "autograd/autocast.h"    // mn::autocast, mixed precision
#include "autograd/checkpoint.h"  // recomputation in backward
#include "autograd/engine.h"
#include "autograd/gradcheck.h"
#include "autograd/node.h"  // NoGradGuard
#include "autograd/ops.h"

#include "nn/compile.h"
#include "nn/data/dataloader.h"
#include "nn/data/fashion_mnist.h"  // Dataset, load_fashion_mnist, normalize
#include "nn/data/idx.h"            // the IDX (MNIST) file readers
#include "nn/data/split.h"          // stratified_split (a validation split)
#include "nn/data/transforms.h"     // RandomCrop, RandomHorizontalFlip, Compose
#include "nn/functional.h"
#include "nn/functional_call.h"
#include "nn/grad_scaler.h"  // amp::GradScaler (loss scaling for f16 training)
#include "nn/init.h"
#include "nn/layers.h"
#include "nn/module.h"
#include "nn/optim.h"
#include "nn/progress.h"  // mn::Progress
#include "nn/reparametrize.h"  // low-rank factors and magnitude pruning for direct training
#include "nn/safetensors.h"
#include "nn/serialize.h"  // nn::save / nn::load of a module's weights
#include "nn/train/checkpoint.h"  // save/read/load_module_checkpoint
#include "nn/train/interrupt.h"   // StopOnSigint
#include "nn/train/loggers.h"     // CsvLogger, JsonLogger, ModelCheckpoint, EpochSummary
#include "nn/train/trainer.h"     // train::Trainer, callbacks, history, objectives, TrainerConfig

#include "mapping/checkpoint.h"
#include "mapping/finetuning.h"  // FineTuningGenerator, load_pretrained
#include "mapping/generator.h"
#include "mapping/losses.h"
#include "mapping/lrd.h"
#include "mapping/mapper.h"
#include "mapping/mapping_model.h"
#include "mapping/orthogonal.h"
#include "mapping/parameter_spec.h"
#include "mapping/profiler.h"
#include "mapping/resnet.h"  // BasicBlock, ResNet, resnet20, resnet18
#include "mapping/vit.h"     // VisionTransformer, EncoderBlock, vit
#include "mapping/targets.h"
#include "mapping/trainer.h"

#include "dist/ddp.h"  // setup_ddp, wrap_ddp, average_metrics, cleanup_ddp
#include "dist/env.h"
#include "dist/process_group.h"
#include "dist/sampler.h"
#include "dist/store.h"
