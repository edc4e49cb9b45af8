#include "nn/train/history.h"

#include <limits>

#include "core/error.h"

namespace mn::train {

const std::vector<double>& History::at(const std::string& key) const {
  auto it = values_.find(key);
  if (it == values_.end()) {
    std::string available;
    for (const auto& [k, v] : values_) available += (available.empty() ? "" : ", ") + k;
    throw KeyError(str("History has no key '", key, "'; available: ", available.empty() ? "(none)" : available));
  }
  return it->second;
}

std::vector<std::string> History::keys() const {
  std::vector<std::string> out;
  for (const auto& [k, v] : values_) out.push_back(k);
  return out;
}

size_t History::epochs() const {
  auto it = values_.find(history_keys::kTrainTotalLoss);
  return it == values_.end() ? 0 : it->second.size();
}

double History::last(const std::string& key) const {
  auto it = values_.find(key);
  return it == values_.end() || it->second.empty() ? std::numeric_limits<double>::quiet_NaN() : it->second.back();
}

}  // namespace mn::train
