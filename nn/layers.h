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
class SiLU : public Module {
 public:
  SiLU() : Module("SiLU") {}
  Tensor forward(const Tensor& x) override { return silu(x); }
};
class LogSigmoid : public Module {
 public:
  LogSigmoid() : Module("LogSigmoid") {}
  Tensor forward(const Tensor& x) override { return logsigmoid(x); }
};
// Activations with scalar settings (no parameters), PyTorch's defaults.
class LeakyReLU : public Module {
 public:
  explicit LeakyReLU(double negative_slope = 0.01) : Module("LeakyReLU"), negative_slope(negative_slope) {}
  Tensor forward(const Tensor& x) override { return leaky_relu(x, negative_slope); }
  double negative_slope;
};
class ELU : public Module {
 public:
  explicit ELU(double alpha = 1.0) : Module("ELU"), alpha(alpha) {}
  Tensor forward(const Tensor& x) override { return elu(x, alpha); }
  double alpha;
};
class Hardtanh : public Module {
 public:
  // ValueError unless min_val <= max_val.
  explicit Hardtanh(double min_val = -1.0, double max_val = 1.0);
  Tensor forward(const Tensor& x) override { return hardtanh(x, min_val, max_val); }
  double min_val, max_val;
};
class Softplus : public Module {
 public:
  explicit Softplus(double beta = 1.0, double threshold = 20.0)
      : Module("Softplus"), beta(beta), threshold(threshold) {}
  Tensor forward(const Tensor& x) override { return softplus(x, beta, threshold); }
  double beta, threshold;
};

// LayerNorm over the trailing dims `normalized_shape`; with elementwise_affine, parameters "weight"
// (ones) and "bias" (zeros) of that shape.
class LayerNorm : public Module {
 public:
  explicit LayerNorm(std::vector<int64_t> normalized_shape, double eps = 1e-5, bool elementwise_affine = true);
  explicit LayerNorm(int64_t normalized_shape, double eps = 1e-5, bool elementwise_affine = true)
      : LayerNorm(std::vector<int64_t>{normalized_shape}, eps, elementwise_affine) {}
  Tensor forward(const Tensor& x) override;
  std::vector<int64_t> normalized_shape;
  double eps;
  bool elementwise_affine;
};

// GroupNorm of x [N, num_channels, *] over num_groups groups (num_channels divisible by num_groups,
// else ValueError); with affine, parameters "weight" (ones) and "bias" (zeros) of shape [num_channels].
class GroupNorm : public Module {
 public:
  GroupNorm(int64_t num_groups, int64_t num_channels, double eps = 1e-5, bool affine = true);
  Tensor forward(const Tensor& x) override;
  int64_t num_groups, num_channels;
  double eps;
  bool affine;
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

// ---- attention and containers ----
// Multi-head attention with PyTorch's parameters: in_proj_weight [3E, E] (xavier-uniform; rows
// query, key, value), in_proj_bias [3E] (zeros), and the child Linear "out_proj" (its bias zeroed).
// Inputs are [L, N, E] (or [N, L, E] with batch_first) or unbatched [L, E]; key and value share S.
// Masks are additive f32 as in F::scaled_dot_product_attention (0 = attend, -inf = hide):
// key_padding_mask [N, S] ([S] unbatched) hides keys per batch element (PyTorch's bool mask has
// true = hide: pass where(m, scalar_tensor(-INFINITY), scalar_tensor(0.0))), attn_mask [L, S] or
// [N * num_heads, L, S]. Dropout on the attention weights in training mode only.
class MultiheadAttention : public Module {
 public:
  struct Output {
    Tensor output;   // shaped as query
    Tensor weights;  // [N, L, S] averaged over heads, [N, H, L, S] if not; undefined without need_weights
  };
  MultiheadAttention(int64_t embed_dim, int64_t num_heads, double dropout = 0.0, bool bias = true,
                     bool batch_first = false);
  Output forward_attention(const Tensor& query, const Tensor& key, const Tensor& value,
                           const Tensor& key_padding_mask = Tensor(), bool need_weights = true,
                           const Tensor& attn_mask = Tensor(), bool average_attn_weights = true);
  // Self-attention of x (query = key = value), without weights, so the layer can sit in a Sequential.
  Tensor forward(const Tensor& x) override;
  int64_t embed_dim, num_heads, head_dim;
  double dropout;
  bool batch_first;
  std::shared_ptr<Linear> out_proj;

 private:
  // forward_attention's computation; it runs through Module::call (so a streamed mapping generates
  // this module's parameters around it), with key = value = query when self_attention.
  Output attend(const Tensor& query, const Tensor& key, const Tensor& value, bool self_attention,
                const Tensor& key_padding_mask, bool need_weights, const Tensor& attn_mask, bool average_attn_weights);
};

namespace detail {
// A container's module as an M, or a TypeError naming where it sits and what it is.
template <class M>
std::shared_ptr<M> container_cast(const ModulePtr& module, const std::string& where) {
  auto typed = std::dynamic_pointer_cast<M>(module);
  MN_CHECK(typed != nullptr, TypeError, "the module at ", where, " is a ", module->type_name(),
           ", not the type asked for");
  return typed;
}
}  // namespace detail

// Holds modules under "0", "1", ... for a forward written by the owning module (libtorch's and
// PyTorch's ModuleList); it has no forward of its own.
class ModuleList : public Module {
 public:
  ModuleList() : Module("ModuleList") {}
  explicit ModuleList(std::vector<ModulePtr> modules);
  ModuleList& push_back(ModulePtr module);
  ModuleList& append(ModulePtr module) { return push_back(std::move(module)); }
  ModuleList& extend(const std::vector<ModulePtr>& modules);
  size_t size() const { return modules_.size(); }
  bool empty() const { return modules_.empty(); }
  // Negative indices count from the end, as in Python; out of range is an IndexError.
  ModulePtr operator[](int64_t index) const;
  // The module at index as an M (TypeError when it is not one).
  template <class M>
  std::shared_ptr<M> at(int64_t index) const {
    return detail::container_cast<M>((*this)[index], str("index ", index));
  }
  std::vector<ModulePtr>::const_iterator begin() const { return modules_.begin(); }
  std::vector<ModulePtr>::const_iterator end() const { return modules_.end(); }
  Tensor forward(const Tensor& x) override;  // NotImplementedError

 private:
  std::vector<ModulePtr> modules_;
};

// Modules under string keys, in insertion order (PyTorch's ModuleDict). Keys follow module names:
// non-empty, without '.'; inserting an existing key is a ValueError. No forward of its own.
class ModuleDict : public Module {
 public:
  using Item = std::pair<std::string, ModulePtr>;
  ModuleDict() : Module("ModuleDict") {}
  explicit ModuleDict(std::vector<Item> items);
  ModuleDict& insert(const std::string& key, ModulePtr module);
  // KeyError naming the known keys when key is missing.
  ModulePtr operator[](const std::string& key) const;
  template <class M>
  std::shared_ptr<M> at(const std::string& key) const {
    return detail::container_cast<M>((*this)[key], str("key '", key, "'"));
  }
  bool contains(const std::string& key) const;
  std::vector<std::string> keys() const;
  size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  std::vector<Item>::const_iterator begin() const { return items_.begin(); }
  std::vector<Item>::const_iterator end() const { return items_.end(); }
  Tensor forward(const Tensor& x) override;  // NotImplementedError

 private:
  std::vector<Item> items_;
};

}  // namespace mn::nn
