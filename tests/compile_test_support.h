#pragma once
// Shared by the mn::compile tests (test_compile.cpp, test_compile_training.cpp).
#include <memory>
#include <vector>

#include "mapping/mapping_networks.h"

namespace mn::testing {

// Linear, BatchNorm, ReLU, dropout, Linear: training mode draws random numbers and updates buffers.
inline std::shared_ptr<nn::Sequential> small_net() {
  return std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
      std::make_shared<nn::Linear>(6, 8), std::make_shared<nn::BatchNorm1d>(8), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Dropout>(0.3), std::make_shared<nn::Linear>(8, 3)});
}

// Every element of the defined tensors, as f32, in order.
inline std::vector<float> flat(const std::vector<Tensor>& ts) {
  std::vector<float> out;
  for (const Tensor& t : ts) {
    if (!t.defined()) continue;
    const std::vector<float> v = t.detach().to(DType::f32).to_vector<float>();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

// Parameters and floating-point buffers.
inline std::vector<Tensor> all_state(const nn::Module& m) {
  std::vector<Tensor> out;
  for (const auto& [n, t] : m.named_parameters()) out.push_back(t);
  for (const auto& [n, t] : m.named_buffers())
    if (t.dtype() == DType::f32) out.push_back(t);
  return out;
}

}  // namespace mn::testing
