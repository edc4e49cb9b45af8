#pragma once
// The flat layout of a target's parameters: entry k occupies [start, stop) of one flat vector, in
// registration order. unflatten() gives zero-copy row-major views (gradients flow back into the flat
// vector); flatten() concatenates a tree in spec order whatever the tree's own order.
#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/tensor.h"

namespace mn::nn {
class Module;
}

namespace mn::mapping {

struct ParameterEntry {
  std::string name;
  Shape shape;
  int64_t numel = 0;
  int64_t start = 0;
  int64_t stop = 0;
};

// Immutable ordered name -> tensor map.
class ParameterTree {
 public:
  ParameterTree() = default;
  explicit ParameterTree(std::vector<std::pair<std::string, Tensor>> items);
  const Tensor& at(const std::string& name) const;  // KeyError naming the known names
  bool contains(const std::string& name) const { return index_.count(name) > 0; }
  size_t size() const { return items_.size(); }
  const std::vector<std::pair<std::string, Tensor>>& items() const { return items_; }
  std::vector<std::string> names() const;
  // For functional_call.
  std::map<std::string, Tensor> to_map() const;
  // A new tree with fn applied to every tensor, same names and order (e.g. detach, or move to a device).
  ParameterTree map(const std::function<Tensor(const Tensor&)>& fn) const;

 private:
  std::vector<std::pair<std::string, Tensor>> items_;
  std::unordered_map<std::string, size_t> index_;
};

class ParameterSpec {
 public:
  ParameterSpec() = default;
  // Validates: non-empty unique names, numel == prod(shape), contiguous slices from 0.
  explicit ParameterSpec(std::vector<ParameterEntry> entries);
  // named_parameters() of the module (frozen ones included, buffers excluded), registration order.
  static ParameterSpec from_module(const nn::Module& module);
  static ParameterSpec from_named_tensors(const std::vector<std::pair<std::string, Tensor>>& tensors);
  static ParameterSpec from_shapes(const std::vector<std::pair<std::string, Shape>>& shapes);

  const std::vector<ParameterEntry>& entries() const { return entries_; }
  size_t size() const { return entries_.size(); }
  const ParameterEntry& operator[](size_t i) const { return entries_[i]; }
  int64_t total_numel() const { return entries_.empty() ? 0 : entries_.back().stop; }
  std::vector<std::string> names() const;
  const ParameterEntry& entry(const std::string& name) const;  // KeyError
  bool contains(const std::string& name) const { return index_.count(name) > 0; }

  // Zero-copy views of a 1-D vector of total_numel() values, in spec order.
  ParameterTree unflatten(const Tensor& flat) const;
  // Concatenation in spec order (validates names and shapes first).
  Tensor flatten(const ParameterTree& tree) const;
  Tensor flatten(const std::map<std::string, Tensor>& tensors) const;
  // The same checks as flatten without allocating.
  void validate_tree(const ParameterTree& tree) const;
  void validate_names_and_shapes(const std::vector<std::pair<std::string, Shape>>& items) const;

 private:
  std::vector<ParameterEntry> entries_;
  std::unordered_map<std::string, size_t> index_;
};

}  // namespace mn::mapping
