#pragma once
// The learning-rate range test's result and its suggestion rules (Trainer::lr_find runs the sweep).
#include <optional>
#include <string>
#include <vector>

namespace mn::train {

struct LRFinderResult {
  std::vector<double> lrs;
  std::vector<double> losses;
  std::vector<double> smoothed_losses;
  std::optional<double> suggested_lr;  // the "steep" suggestion, when one exists
  // "steep": steepest descent of the smoothed loss against log10(lr) before its minimum;
  // "valley": 2/3 into the longest strictly decreasing run; "minimum": lr at the minimum / 10.
  double suggestion(const std::string& method = "steep") const;
};

}  // namespace mn::train
