#include "mapping/targets.h"

#include <sstream>

#include "mapping/resnet.h"
#include "mapping/vit.h"
#include "nn/layers.h"

namespace mn::mapping {

namespace {

using nn::Conv2d;
using nn::Flatten;
using nn::Linear;
using nn::MaxPool2d;
using nn::ReLU;

template <class M, class... A>
nn::ModulePtr layer(A&&... args) {
  return std::make_shared<M>(std::forward<A>(args)...);
}

std::shared_ptr<nn::Sequential> cnn2() {
  return std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
      layer<Conv2d>(1, 16, 3), layer<ReLU>(), layer<MaxPool2d>(2),   // 16x13x13
      layer<Conv2d>(16, 32, 3), layer<ReLU>(), layer<MaxPool2d>(2),  // 32x5x5
      layer<Flatten>(), layer<Linear>(800, 128), layer<ReLU>(), layer<Linear>(128, 10)});
}

std::shared_ptr<nn::Sequential> cnn1() {
  return std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
      layer<Conv2d>(1, 32, 3, 1, 1), layer<ReLU>(), layer<MaxPool2d>(2),     // 32x14x14
      layer<Conv2d>(32, 64, 3, 1, 1), layer<ReLU>(), layer<MaxPool2d>(2),    // 64x7x7
      layer<Conv2d>(64, 128, 3, 1, 1), layer<ReLU>(),                        // 128x7x7
      layer<Conv2d>(128, 128, 3, 1, 1), layer<ReLU>(), layer<MaxPool2d>(2),  // 128x3x3 (floor)
      layer<Flatten>(), layer<Linear>(1152, 256), layer<ReLU>(), layer<Linear>(256, 10)});
}

std::shared_ptr<nn::Sequential> mlp(const std::vector<int64_t>& hidden) {
  MN_CHECK(!hidden.empty(), ValueError, "mlp target needs at least one hidden layer width");
  auto net = std::make_shared<nn::Sequential>();
  net->push_back(layer<Flatten>());
  int64_t width = 28 * 28;
  for (int64_t h : hidden) {
    MN_CHECK(h > 0, ValueError, "mlp hidden widths must be positive, got ", h);
    net->push_back(layer<Linear>(width, h));
    net->push_back(layer<ReLU>());
    width = h;
  }
  net->push_back(layer<Linear>(width, 10));
  return net;
}

std::shared_ptr<nn::Sequential> lenet() {
  return std::make_shared<nn::Sequential>(
      std::vector<nn::ModulePtr>{layer<Conv2d>(1, 6, 5, 1, 2), layer<ReLU>(), layer<MaxPool2d>(2),  // 6x14x14
                                 layer<Conv2d>(6, 16, 5), layer<ReLU>(), layer<MaxPool2d>(2),       // 16x5x5
                                 layer<Flatten>(), layer<Linear>(400, 120), layer<ReLU>(),
                                 layer<Linear>(120, 84), layer<ReLU>(), layer<Linear>(84, 10)});
}

}  // namespace

std::vector<std::string> target_names() { return {"cnn1", "cnn2", "mlp", "lenet", "resnet20", "resnet18", "vit"}; }

std::shared_ptr<nn::Module> make_target(const std::string& name, const TargetOptions& options) {
  if (name == "cnn1") return cnn1();
  if (name == "cnn2") return cnn2();
  if (name == "mlp") return mlp(options.mlp_hidden);
  if (name == "lenet") return lenet();
  if (name == "resnet20") return resnet20();
  if (name == "resnet18") return resnet18();
  if (name == "vit") return vit();
  throw ValueError(str("Unknown target '", name, "'; choose from: ", joined(target_names())));
}

std::vector<std::string> spec_names() {
  std::vector<std::string> names{"guide"};
  for (const auto& n : target_names()) names.push_back(n);
  return names;
}

ParameterSpec target_spec(const std::string& name, const TargetOptions& options) {
  if (name == "guide") {
    auto stack = std::make_shared<nn::Sequential>(
        std::vector<nn::ModulePtr>{layer<Conv2d>(3, 64, 3), layer<Conv2d>(64, 128, 3), layer<Linear>(128, 10)});
    return ParameterSpec::from_module(*stack);
  }
  for (const auto& n : target_names())
    if (n == name) return ParameterSpec::from_module(*make_target(name, options));
  throw ValueError(str("Unknown spec '", name, "'; choose from: ", joined(spec_names())));
}

}  // namespace mn::mapping
