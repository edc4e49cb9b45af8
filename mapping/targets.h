#pragma once
// Built-in target architectures shared by the example programs, tests and benchmarks. Every runnable
// target classifies 1x28x28 images (Fashion-MNIST) into 10 classes; parameter names are those of a
// PyTorch nn.Sequential ("0.weight", "3.bias", ...), or of torchvision's ResNet and
// VisionTransformer for the residual and attention targets ("layer2.0.downsample.0.weight",
// "encoder.layers.encoder_layer_0.self_attention.in_proj_weight"; mapping/resnet.h, mapping/vit.h),
// so exported weights load by the same names.
//
//   cnn2   the paper's LeNet-inspired CNN (supplement Table 1), 108,618 parameters:
//          conv 1->16 3x3, ReLU, maxpool 2, conv 16->32 3x3, ReLU, maxpool 2, flatten,
//          FC 800->128, ReLU, FC 128->10 (4 layer-wise groups)
//   cnn1   the paper's AlexNet-inspired CNN, 537,994 parameters: conv 1->32, pool, conv 32->64, pool,
//          conv 64->128, conv 128->128, pool (7 -> 3, floor), FC 1152->256, FC 256->10; all convs
//          3x3 with padding 1, ReLU after every conv and FC1 (6 groups)
//   mlp    flatten, 784 -> hidden... -> 10 with ReLU between (default hidden 256, 256: 269,322
//          parameters)
//   lenet  LeNet-5 style: conv 1->6 5x5 pad 2, ReLU, maxpool 2, conv 6->16 5x5, ReLU, maxpool 2,
//          flatten (400), FC 400->120, ReLU, FC 120->84, ReLU, FC 84->10 (61,706 parameters)
//   resnet20  CIFAR ResNet-20: 3x3 stem conv 1->16 + BatchNorm + ReLU, 3 stages x 3 BasicBlocks at
//          16/32/64 channels (stride 2 entering stages 2 and 3; 1x1 conv + BatchNorm shortcuts there),
//          global average pool, FC 64->10: 272,186 parameters (43 layer-wise groups)
//   resnet18  torchvision's ResNet-18 with a 3x3 stride-1 stem (1->64) and no max pool: 4 stages x 2
//          BasicBlocks at 64/128/256/512 channels, global average pool, FC 512->10: 11,172,810
//          parameters (41 groups)
//   vit    a small Vision Transformer: 4x4 patches -> 49 tokens + class token, width 128, 4 pre-norm
//          blocks of 4-head attention and a GELU MLP (512), final LayerNorm, head on the class
//          token: 803,338 parameters (29 groups)
//
// Benchmark specs additionally know "guide": the scaling guide's memory-benchmark stack
// Conv2d(3,64,3), Conv2d(64,128,3), Linear(128,10) (76,938 parameters). It is only a parameter
// layout - the layers do not chain - so make_target() does not offer it.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mapping/parameter_spec.h"
#include "nn/module.h"

namespace mn::mapping {

struct TargetOptions {
  std::vector<int64_t> mlp_hidden{256, 256};  // hidden widths of "mlp"
};

// Names make_target() accepts, in display order: cnn1, cnn2, mlp, lenet, resnet20, resnet18, vit.
std::vector<std::string> target_names();
// A freshly initialised target (parameters drawn from the default generator, as nn layers do).
// Unknown names are a ValueError listing the choices.
std::shared_ptr<nn::Module> make_target(const std::string& name, const TargetOptions& options = {});

// Names target_spec() accepts: "guide" and every target name.
std::vector<std::string> spec_names();
// The parameter layout of a built-in target or of "guide". Builds the modules, so it draws from the
// default generator like make_target() does.
ParameterSpec target_spec(const std::string& name, const TargetOptions& options = {});

}  // namespace mn::mapping
