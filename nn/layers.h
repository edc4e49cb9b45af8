#pragma once
// Layers: thin modules over nn::functional, with PyTorch's parameter names and default
// initialisation (so a target built here has the same distributions as in PyTorch).
#include <array>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "nn/functional.h"
#include "nn/module.h"

namespace mn::nn {

class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true);
  Tensor forward(const Tensor& x) override;
  int64_t in_features, out_features;
};

class Conv2d : public Module {
 public:
  Conv2d(int64_t in_channels, int64_t out_channels, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride = {1, 1},
         std::array<int64_t, 2> padding = {0, 0}, std::array<int64_t, 2> dilation = {1, 1}, int64_t groups = 1,
         bool bias = true);
  Conv2d(int64_t in_channels, int64_t out_channels, int64_t kernel, int64_t stride = 1, int64_t padding = 0)
      : Conv2d(in_channels, out_channels, {kernel, kernel}, {stride, stride}, {padding, padding}) {}
  Tensor forward(const Tensor& x) override;
  int64_t in_channels, out_channels;
  std::array<int64_t, 2> kernel, stride, padding, dilation;
  int64_t groups;
};

// BatchNorm over the channel dim 1 of [N, C] / [N, C, L] (1d) or [N, C, H, W] (2d).
class BatchNorm : public Module {
 public:
  BatchNorm(const char* type, int64_t num_features, double eps, double momentum, bool affine, int expected_dims_lo,
            int expected_dims_hi);
  Tensor forward(const Tensor& x) override;
  int64_t num_features;
  double eps, momentum;
  bool affine;

 private:
  int dims_lo_, dims_hi_;
};
class BatchNorm1d : public BatchNorm {
 public:
  explicit BatchNorm1d(int64_t num_features, double eps = 1e-5, double momentum = 0.1, bool affine = true)
      : BatchNorm("BatchNorm1d", num_features, eps, momentum, affine, 2, 3) {}
};
class BatchNorm2d : public BatchNorm {
 public:
  explicit BatchNorm2d(int64_t num_features, double eps = 1e-5, double momentum = 0.1, bool affine = true)
      : BatchNorm("BatchNorm2d", num_features, eps, momentum, affine, 4, 4) {}
};

class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride = {0, 0},
                     std::array<int64_t, 2> padding = {0, 0}, bool ceil_mode = false);
  explicit MaxPool2d(int64_t kernel) : MaxPool2d({kernel, kernel}) {}
  Tensor forward(const Tensor& x) override;
  std::array<int64_t, 2> kernel, stride, padding;
  bool ceil_mode;
};

class AvgPool2d : public Module {
 public:
  explicit AvgPool2d(std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride = {0, 0},
                     std::array<int64_t, 2> padding = {0, 0}, bool ceil_mode = false, bool count_include_pad = true);
  explicit AvgPool2d(int64_t kernel) : AvgPool2d({kernel, kernel}) {}
  Tensor forward(const Tensor& x) override;
  std::array<int64_t, 2> kernel, stride, padding;
  bool ceil_mode, count_include_pad;
};

// Adaptive pooling to a fixed output size (see functional::adaptive_avg_pool2d).
class AdaptiveAvgPool2d : public Module {
 public:
  explicit AdaptiveAvgPool2d(std::array<int64_t, 2> output_size);
  explicit AdaptiveAvgPool2d(int64_t output_size) : AdaptiveAvgPool2d({output_size, output_size}) {}
  Tensor forward(const Tensor& x) override;
  std::array<int64_t, 2> output_size;
};
class AdaptiveMaxPool2d : public Module {
 public:
  explicit AdaptiveMaxPool2d(std::array<int64_t, 2> output_size);
  explicit AdaptiveMaxPool2d(int64_t output_size) : AdaptiveMaxPool2d({output_size, output_size}) {}
  Tensor forward(const Tensor& x) override;
  std::array<int64_t, 2> output_size;
};

// A lookup table with parameter "weight" [num_embeddings, embedding_dim], initialised N(0, 1) with the
// padding_idx row (if any; negative counts from the end) zeroed, as PyTorch.
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim, std::optional<int64_t> padding_idx = std::nullopt);
  Tensor forward(const Tensor& indices) override;
  int64_t num_embeddings, embedding_dim;
  std::optional<int64_t> padding_idx;  // as given
};

class Flatten : public Module {
 public:
  explicit Flatten(int64_t start_dim = 1, int64_t end_dim = -1)
      : Module("Flatten"), start_dim(start_dim), end_dim(end_dim) {}
  Tensor forward(const Tensor& x) override { return flatten(x, start_dim, end_dim); }
  int64_t start_dim, end_dim;
};

class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5);
  Tensor forward(const Tensor& x) override;
  double p;
};

// Parameter-free activations.
class ReLU : public Module {
 public:
  ReLU() : Module("ReLU") {}
  Tensor forward(const Tensor& x) override { return relu(x); }
};
class GELU : public Module {
 public:
  GELU() : Module("GELU") {}
  Tensor forward(const Tensor& x) override { return gelu(x); }
};
class Tanh : public Module {
 public:
  Tanh() : Module("Tanh") {}
  Tensor forward(const Tensor& x) override { return tanh(x); }
};
class Sigmoid : public Module {
 public:
  Sigmoid() : Module("Sigmoid") {}
  Tensor forward(const Tensor& x) override { return sigmoid(x); }
};

// Children named "0", "1", ... applied in order.
class Sequential : public Module {
 public:
  Sequential() : Module("Sequential") {}
  explicit Sequential(std::vector<ModulePtr> modules);
  Sequential& push_back(ModulePtr module);
  Tensor forward(const Tensor& x) override;
  size_t size() const { return named_children().size(); }
  ModulePtr operator[](size_t i) const { return named_children().at(i).second; }
};

// Multi-layer LSTM with PyTorch's parameter names (weight_ih_l{k}, weight_hh_l{k}, bias_ih_l{k},
// bias_hh_l{k}) and gate order (input, forget, cell, output).
class LSTM : public Module {
 public:
  struct Output {
    Tensor output;  // [T, N, H] or [N, T, H] with batch_first
    Tensor h_n;     // [layers, N, H]
    Tensor c_n;     // [layers, N, H]
  };
  LSTM(int64_t input_size, int64_t hidden_size, int64_t num_layers = 1, bool bias = true, bool batch_first = false);
  // Initial state defaults to zeros.
  Output forward_with_state(const Tensor& x, const Tensor& h0 = Tensor(), const Tensor& c0 = Tensor());
  Tensor forward(const Tensor& x) override { return forward_with_state(x).output; }
  int64_t input_size, hidden_size, num_layers;
  bool bias, batch_first;
};

}  // namespace mn::nn
