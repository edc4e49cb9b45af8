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

#include "mapping/mapping_model.h"
#include "mapping/targets.h"
#include "nn/functional.h"

namespace mn::testing {

// One layerwise training step of the built-in `target` (latent 8, BatchNorm statistics written
// back), plain or streamed (MappingOptions::stream_layers): its predictions, then each latent's
// gradient, then the carried buffers (i64 counters as floats), as flat vectors, for a bit-for-bit
// comparison.
inline std::vector<std::vector<float>> mapped_step_values(const std::string& target, bool stream) {
  manual_seed(1);
  mapping::MappingOptions o{.latent_dim = 8, .strategy = "layerwise", .seed = 3};
  o.write_back_buffers = true;
  o.stream_layers = stream;
  mapping::MappingModel model(mapping::make_target(target), o);
  const Tensor x = random_tensor({2, 1, 28, 28}, 5);
  const Tensor labels = from_vector(std::vector<int64_t>{3, 7}, Shape{2});
  const Tensor out = model.run(x).predictions;
  nn::functional::cross_entropy(out, labels).backward();
  std::vector<std::vector<float>> values{out.to_vector<float>()};
  for (const auto& [name, z] : model.named_latents()) values.push_back(z.grad().to_vector<float>());
  for (const auto& [name, b] : model.buffers()) {
    if (b.dtype() == DType::f32) {
      values.push_back(b.to_vector<float>());
    } else {  // num_batches_tracked (i64)
      std::vector<float> counts;
      for (int64_t c : b.to_vector<int64_t>()) counts.push_back(static_cast<float>(c));
      values.push_back(counts);
    }
  }
  return values;
}

}  // namespace mn::testing
