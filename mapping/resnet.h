#pragma once
// Residual targets: the BasicBlock of He et al. (2016) and a ResNet built from it, with torchvision's
// module names, so a state dict saved here loads into torchvision's layout (and the plain-torch twin
// in tests/parity/make_targets.py) with load_state_dict(strict=True):
//
//   conv1, bn1                     the stem: 3x3 conv, stride 1, padding 1, no bias (no max pool:
//                                  the inputs are 28x28), BatchNorm, ReLU
//   layer<k>.<i>.conv1/bn1/conv2/bn2   block i of stage k; the first block of every stage after the
//                                  first has stride 2
//   layer<k>.0.downsample.0/.1     where a block changes the shape: 1x1 conv (stride 2, no bias) and
//                                  BatchNorm on the shortcut (torchvision's "option B")
//   fc                             Linear after the global average pool (mean over H and W)
//
// BatchNorm buffers are running_mean, running_var and num_batches_tracked, as in torch. Every layer
// keeps PyTorch's default initialisation (Conv2d and Linear: kaiming_uniform(a = sqrt(5)) weights,
// uniform(+-1/sqrt(fan_in)) bias; BatchNorm: weight 1, bias 0), not torchvision's kaiming_normal
// re-initialisation of the convolutions.
#include <cstdint>
#include <memory>
#include <vector>

#include "nn/layers.h"

namespace mn::mapping {

// out = relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)), shortcut the identity or downsample.
class BasicBlock : public nn::Module {
 public:
  BasicBlock(int64_t in_planes, int64_t planes, int64_t stride);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<nn::Conv2d> conv1, conv2;
  std::shared_ptr<nn::BatchNorm2d> bn1, bn2;
  std::shared_ptr<nn::Sequential> downsample;  // null where the block keeps the shape
};

class ResNet : public nn::Module {
 public:
  // One stage per entry of `widths` ("layer1", "layer2", ...), each with blocks_per_stage[k] blocks;
  // the stem maps in_channels to widths[0].
  ResNet(int64_t in_channels, const std::vector<int64_t>& widths, const std::vector<int64_t>& blocks_per_stage,
         int64_t num_classes);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<nn::Conv2d> conv1;
  std::shared_ptr<nn::BatchNorm2d> bn1;
  std::vector<std::shared_ptr<nn::Sequential>> layers;
  std::shared_ptr<nn::Linear> fc;
};

// CIFAR ResNet-20 for 1x28x28 inputs: 3 stages x 3 blocks at 16/32/64 channels, 272,186 parameters.
std::shared_ptr<ResNet> resnet20(int64_t in_channels = 1, int64_t num_classes = 10);
// ResNet-18 with a 3x3 stem: 4 stages x 2 blocks at 64/128/256/512 channels, 11,172,810 parameters
// for 1 input channel and 10 classes.
std::shared_ptr<ResNet> resnet18(int64_t in_channels = 1, int64_t num_classes = 10);

}  // namespace mn::mapping
