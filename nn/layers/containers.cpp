// ModuleList and ModuleDict: registration and lookup only; the owning module writes the forward.
#include "nn/layers.h"

namespace mn::nn {

ModuleList::ModuleList(std::vector<ModulePtr> modules) : Module("ModuleList") { extend(modules); }

ModuleList& ModuleList::push_back(ModulePtr module) {
  add_child(std::to_string(modules_.size()), module);  // refuses a null module
  modules_.push_back(std::move(module));
  return *this;
}

ModuleList& ModuleList::extend(const std::vector<ModulePtr>& modules) {
  for (const auto& m : modules) push_back(m);
  return *this;
}

ModulePtr ModuleList::operator[](int64_t index) const {
  const auto n = static_cast<int64_t>(modules_.size());
  MN_CHECK(index >= -n && index < n, IndexError, "ModuleList: index ", index, " is out of range for ", n,
           " module", (n == 1 ? "" : "s"));
  return modules_[static_cast<size_t>(index < 0 ? index + n : index)];
}

Tensor ModuleList::forward(const Tensor&) {
  throw NotImplementedError(
      "ModuleList has no forward: it only holds modules; call them from the owning module's forward");
}

ModuleDict::ModuleDict(std::vector<Item> items) : Module("ModuleDict") {
  for (auto& [key, module] : items) insert(key, std::move(module));
}

ModuleDict& ModuleDict::insert(const std::string& key, ModulePtr module) {
  MN_CHECK(!contains(key), ValueError, "ModuleDict: key '", key, "' is already present");
  add_child(key, module);  // checks the key as a module name and refuses a null module
  items_.emplace_back(key, std::move(module));
  return *this;
}

ModulePtr ModuleDict::operator[](const std::string& key) const {
  for (const auto& [k, m] : items_)
    if (k == key) return m;
  std::string known;
  for (const auto& [k, m] : items_) known += (known.empty() ? "'" : ", '") + k + "'";
  throw KeyError(str("ModuleDict: no module under key '", key, "' (keys: ", (known.empty() ? "none" : known), ")"));
}

bool ModuleDict::contains(const std::string& key) const {
  for (const auto& [k, m] : items_)
    if (k == key) return true;
  return false;
}

std::vector<std::string> ModuleDict::keys() const {
  std::vector<std::string> out;
  out.reserve(items_.size());
  for (const auto& [k, m] : items_) out.push_back(k);
  return out;
}

Tensor ModuleDict::forward(const Tensor&) {
  throw NotImplementedError(
      "ModuleDict has no forward: it only holds modules; call them from the owning module's forward");
}

}  // namespace mn::nn
