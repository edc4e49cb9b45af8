#pragma once
// What a training run records: per-epoch metric values under explicit names.
#include <map>
#include <string>
#include <vector>

namespace mn::train {

// One pass's metrics by name (an epoch's train_* and val_* values, a validation pass, ...).
using Metrics = std::map<std::string, double>;

// The names the trainers record. "total" is what the optimizer minimises; "task" is the task term
// alone (they differ only when a loss adds regularisers, e.g. mapping::MappingLoss).
namespace history_keys {
inline constexpr const char* kTrainTaskLoss = "train_task_loss";
inline constexpr const char* kTrainTotalLoss = "train_total_loss";
inline constexpr const char* kTrainAccuracy = "train_accuracy";
inline constexpr const char* kValTaskLoss = "val_task_loss";
inline constexpr const char* kValTotalLoss = "val_total_loss";
inline constexpr const char* kValAccuracy = "val_accuracy";
inline constexpr const char* kLearningRate = "lr";
// TrainerConfig::amp "f16": the epoch's optimizer steps the gradient scaler skipped (gradients not finite).
inline constexpr const char* kTrainSkippedSteps = "train_skipped_steps";
}  // namespace history_keys

// Per-epoch metric values under explicit names (see history_keys): one value per completed epoch.
class History {
 public:
  void append(const std::string& key, double value) { values_[key].push_back(value); }
  bool contains(const std::string& key) const { return values_.count(key) > 0; }
  const std::vector<double>& at(const std::string& key) const;  // KeyError listing the keys
  const std::vector<double>& operator[](const std::string& key) const { return at(key); }
  std::vector<std::string> keys() const;
  size_t epochs() const;  // entries of train_total_loss
  // The key's value of the last recorded epoch; NaN when the key is absent or has no values.
  double last(const std::string& key) const;
  const std::map<std::string, std::vector<double>>& values() const { return values_; }
  std::map<std::string, std::vector<double>>& values() { return values_; }
  bool operator==(const History& other) const { return values_ == other.values_; }

 private:
  std::map<std::string, std::vector<double>> values_;
};

}  // namespace mn::train
