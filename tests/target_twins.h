#pragma once
// Helpers shared by the tests that compare built-in targets with their torch twins
// (tests/parity/make_targets.py writes the fixtures).
#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>

#include "nn/module.h"
#include "nn/safetensors.h"
#include "tests/test_support.h"

namespace mn::testing {

inline safetensors::File fixture(const std::string& name) {
  return safetensors::load(std::string(MN_TEST_DATA_DIR) + "/" + name + ".safetensors");
}

// "name d0,d1,..." per tensor, one per line, as make_targets.py writes the twins' listings.
inline std::string listing(const nn::NamedTensors& named) {
  std::ostringstream out;
  for (size_t i = 0; i < named.size(); ++i) {
    if (i > 0) out << "\n";
    out << named[i].first << " ";
    const Shape& s = named[i].second.sizes();
    for (size_t d = 0; d < s.size(); ++d) out << (d > 0 ? "," : "") << s[d];
  }
  return out.str();
}

// Largest |a - b| / (1 + |b|) over the elements.
inline double max_rel_diff(const Tensor& a, const Tensor& b) {
  REQUIRE(a.sizes() == b.sizes());
  const std::vector<float> x = a.to_vector<float>(), y = b.to_vector<float>();
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::abs(double(x[i]) - y[i]) / (1.0 + std::abs(y[i])));
  return worst;
}

}  // namespace mn::testing
