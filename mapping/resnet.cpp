#include "mapping/resnet.h"

#include "core/error.h"

namespace mn::mapping {

namespace {

std::shared_ptr<nn::Conv2d> conv_no_bias(int64_t in, int64_t out, int64_t kernel, int64_t stride) {
  const int64_t pad = kernel / 2;
  return std::make_shared<nn::Conv2d>(in, out, std::array<int64_t, 2>{kernel, kernel},
                                      std::array<int64_t, 2>{stride, stride}, std::array<int64_t, 2>{pad, pad},
                                      std::array<int64_t, 2>{1, 1}, 1, /*bias=*/false);
}

}  // namespace

BasicBlock::BasicBlock(int64_t in_planes, int64_t planes, int64_t stride) : Module("BasicBlock") {
  MN_CHECK(in_planes > 0 && planes > 0 && stride > 0, ValueError,
           "BasicBlock: in_planes, planes and stride must be positive, got ", in_planes, ", ", planes, ", ", stride);
  // Registration order is torchvision's, so the state dict lists the same names in the same order.
  conv1 = register_module("conv1", conv_no_bias(in_planes, planes, 3, stride));
  bn1 = register_module("bn1", std::make_shared<nn::BatchNorm2d>(planes));
  conv2 = register_module("conv2", conv_no_bias(planes, planes, 3, 1));
  bn2 = register_module("bn2", std::make_shared<nn::BatchNorm2d>(planes));
  if (stride != 1 || in_planes != planes) {
    downsample = register_module(
        "downsample", std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
                          conv_no_bias(in_planes, planes, 1, stride), std::make_shared<nn::BatchNorm2d>(planes)}));
  }
}

// Children are called through operator(), so a streamed mapping sees each call (nn/module.h).
Tensor BasicBlock::forward(const Tensor& x) {
  Tensor out = relu((*bn1)((*conv1)(x)));
  out = (*bn2)((*conv2)(out));
  return relu(add(out, downsample ? (*downsample)(x) : x));
}

ResNet::ResNet(int64_t in_channels, const std::vector<int64_t>& widths, const std::vector<int64_t>& blocks_per_stage,
               int64_t num_classes)
    : Module("ResNet") {
  MN_CHECK(!widths.empty() && widths.size() == blocks_per_stage.size(), ValueError,
           "ResNet: expected one block count per stage width, got ", widths.size(), " widths and ",
           blocks_per_stage.size(), " block counts");
  MN_CHECK(in_channels > 0 && num_classes > 0, ValueError, "ResNet: in_channels and num_classes must be positive, got ",
           in_channels, " and ", num_classes);
  conv1 = register_module("conv1", conv_no_bias(in_channels, widths[0], 3, 1));
  bn1 = register_module("bn1", std::make_shared<nn::BatchNorm2d>(widths[0]));
  int64_t planes = widths[0];
  for (size_t k = 0; k < widths.size(); ++k) {
    MN_CHECK(blocks_per_stage[k] > 0, ValueError, "ResNet: stage ", k + 1, " needs at least one block, got ",
             blocks_per_stage[k]);
    auto stage = std::make_shared<nn::Sequential>();
    for (int64_t i = 0; i < blocks_per_stage[k]; ++i) {
      const int64_t stride = (k > 0 && i == 0) ? 2 : 1;
      stage->push_back(std::make_shared<BasicBlock>(planes, widths[k], stride));
      planes = widths[k];
    }
    layers.push_back(register_module(str("layer", k + 1), stage));
  }
  fc = register_module("fc", std::make_shared<nn::Linear>(planes, num_classes));
}

Tensor ResNet::forward(const Tensor& x) {
  Tensor h = relu((*bn1)((*conv1)(x)));
  for (const auto& stage : layers) h = (*stage)(h);
  // Global average pool: [N, C, H, W] -> [N, C].
  return (*fc)(mean(h, std::vector<int64_t>{2, 3}));
}

std::shared_ptr<ResNet> resnet20(int64_t in_channels, int64_t num_classes) {
  return std::make_shared<ResNet>(in_channels, std::vector<int64_t>{16, 32, 64}, std::vector<int64_t>{3, 3, 3},
                                  num_classes);
}

std::shared_ptr<ResNet> resnet18(int64_t in_channels, int64_t num_classes) {
  return std::make_shared<ResNet>(in_channels, std::vector<int64_t>{64, 128, 256, 512},
                                  std::vector<int64_t>{2, 2, 2, 2}, num_classes);
}

}  // namespace mn::mapping
