#include "mapping/parameter_spec.h"

#include <set>
#include <sstream>

#include "autograd/ops.h"
#include "nn/module.h"

namespace mn::mapping {

namespace {
}  // namespace

ParameterTree::ParameterTree(std::vector<std::pair<std::string, Tensor>> items) : items_(std::move(items)) {
  for (size_t i = 0; i < items_.size(); ++i) {
    MN_CHECK(!items_[i].first.empty(), ValueError, "Parameter names must be non-empty strings");
    MN_CHECK(items_[i].second.defined(), TypeError, "Parameter '", items_[i].first, "' must be a defined tensor");
    MN_CHECK(index_.emplace(items_[i].first, i).second, ValueError, "ParameterTree contains duplicate name '",
             items_[i].first, "'");
  }
}

const Tensor& ParameterTree::at(const std::string& name) const {
  auto it = index_.find(name);
  MN_CHECK(it != index_.end(), KeyError, "ParameterTree has no parameter '", name, "'; known: ", bracket_list(names()));
  return items_[it->second].second;
}

std::vector<std::string> ParameterTree::names() const {
  std::vector<std::string> out;
  for (auto& [n, t] : items_) out.push_back(n);
  return out;
}

std::map<std::string, Tensor> ParameterTree::to_map() const {
  return std::map<std::string, Tensor>(items_.begin(), items_.end());
}

ParameterTree ParameterTree::map(const std::function<Tensor(const Tensor&)>& fn) const {
  MN_CHECK(static_cast<bool>(fn), ValueError, "ParameterTree::map needs a function");
  std::vector<std::pair<std::string, Tensor>> out;
  out.reserve(items_.size());
  for (const auto& [name, t] : items_) out.emplace_back(name, fn(t));
  return ParameterTree(std::move(out));  // an undefined result is refused there, naming the parameter
}

ParameterSpec::ParameterSpec(std::vector<ParameterEntry> entries) : entries_(std::move(entries)) {
  int64_t expected_start = 0;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const ParameterEntry& e = entries_[i];
    MN_CHECK(!e.name.empty(), ValueError, "Parameter names must be non-empty");
    MN_CHECK(index_.emplace(e.name, i).second, ValueError, "ParameterSpec contains duplicate names ('", e.name, "')");
    MN_CHECK(e.numel == e.shape.numel(), ValueError, "Invalid numel for parameter '", e.name, "': shape ", e.shape,
             " has ", e.shape.numel(), " elements, entry says ", e.numel);
    MN_CHECK(e.start == expected_start && e.stop == e.start + e.numel, ValueError,
             "Non-contiguous slice for parameter '", e.name, "': expected [", expected_start, ", ",
             expected_start + e.numel, "), got [", e.start, ", ", e.stop, ")");
    expected_start = e.stop;
  }
}

ParameterSpec ParameterSpec::from_shapes(const std::vector<std::pair<std::string, Shape>>& shapes) {
  std::vector<ParameterEntry> entries;
  int64_t offset = 0;
  for (const auto& [name, shape] : shapes) {
    entries.push_back({name, shape, shape.numel(), offset, offset + shape.numel()});
    offset += shape.numel();
  }
  return ParameterSpec(std::move(entries));
}

ParameterSpec ParameterSpec::from_named_tensors(const std::vector<std::pair<std::string, Tensor>>& tensors) {
  std::vector<std::pair<std::string, Shape>> shapes;
  for (const auto& [name, t] : tensors) {
    MN_CHECK(t.defined(), TypeError, "Parameter '", name, "' must be a defined tensor");
    shapes.emplace_back(name, t.sizes());
  }
  return from_shapes(shapes);
}

ParameterSpec ParameterSpec::from_module(const nn::Module& module) {
  return from_named_tensors(module.named_parameters());
}

std::vector<std::string> ParameterSpec::names() const {
  std::vector<std::string> out;
  for (const auto& e : entries_) out.push_back(e.name);
  return out;
}

const ParameterEntry& ParameterSpec::entry(const std::string& name) const {
  auto it = index_.find(name);
  MN_CHECK(it != index_.end(), KeyError, "ParameterSpec has no parameter '", name, "'; known: ", bracket_list(names()));
  return entries_[it->second];
}

ParameterTree ParameterSpec::unflatten(const Tensor& flat) const {
  MN_CHECK(flat.dim() == 1, ValueError, "Expected a 1D vector, got shape ", flat.sizes());
  MN_CHECK(flat.numel() == total_numel(), ValueError, "Expected ", total_numel(), " values, got ", flat.numel());
  std::vector<int64_t> numels;
  numels.reserve(entries_.size());
  for (const auto& e : entries_) numels.push_back(e.numel);
  // One split node rather than a slice per entry: backward then writes the flat gradient once.
  std::vector<Tensor> pieces = split_with_sizes(flat, numels, 0);
  std::vector<std::pair<std::string, Tensor>> items;
  items.reserve(entries_.size());
  for (size_t i = 0; i < entries_.size(); ++i) items.emplace_back(entries_[i].name, pieces[i].view(entries_[i].shape));
  return ParameterTree(std::move(items));
}

void ParameterSpec::validate_names_and_shapes(const std::vector<std::pair<std::string, Shape>>& items) const {
  std::set<std::string> given;
  std::vector<std::string> unexpected, missing;
  for (const auto& [name, shape] : items) {
    given.insert(name);
    if (!contains(name)) unexpected.push_back(name);
  }
  for (const auto& e : entries_)
    if (!given.count(e.name)) missing.push_back(e.name);
  MN_CHECK(missing.empty() && unexpected.empty(), ValueError, "Parameter names do not match spec; missing=",
           bracket_list(missing), ", unexpected=", bracket_list(unexpected));
  for (const auto& [name, shape] : items) {
    const ParameterEntry& e = entry(name);
    MN_CHECK(shape == e.shape, ValueError, "Expected shape ", e.shape, " for '", name, "', got ", shape);
  }
}

void ParameterSpec::validate_tree(const ParameterTree& tree) const {
  std::vector<std::pair<std::string, Shape>> items;
  for (const auto& [n, t] : tree.items()) items.emplace_back(n, t.sizes());
  validate_names_and_shapes(items);
}

Tensor ParameterSpec::flatten(const ParameterTree& tree) const {
  validate_tree(tree);
  if (entries_.empty()) return zeros({0});
  std::vector<Tensor> parts;
  for (const auto& e : entries_) parts.push_back(tree.at(e.name).reshape({-1}));
  return cat(parts, 0);
}

Tensor ParameterSpec::flatten(const std::map<std::string, Tensor>& tensors) const {
  return flatten(ParameterTree(std::vector<std::pair<std::string, Tensor>>(tensors.begin(), tensors.end())));
}

}  // namespace mn::mapping
