#pragma once
// Small helpers shared by the unit tests.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "autograd/engine.h"
#include "autograd/gradcheck.h"
#include "autograd/node.h"
#include "autograd/ops.h"
#include "core/random.h"

namespace mn::testing {

inline Tensor tensor(const std::vector<float>& v, const Shape& shape = {}) { return from_vector(v, shape); }
inline Tensor param(const std::vector<float>& v, const Shape& shape = {}) {
  return from_vector(v, shape).requires_grad_(true);
}
// Seeded standard-normal tensor (no grad).
inline Tensor random_tensor(const Shape& shape, uint64_t seed) {
  Generator gen(seed);
  return randn(shape, {}, &gen);
}
// Seeded standard-normal leaf requiring grad.
inline Tensor random_param(const Shape& shape, uint64_t seed, double scale = 1.0) {
  Generator gen(seed);
  Tensor t = normal(shape, 0.0, scale, {}, &gen);
  return t.requires_grad_(true);
}

inline void check_close(const Tensor& t, const std::vector<float>& expected, double tol = 1e-5) {
  std::vector<float> got = t.to_vector<float>();
  REQUIRE(got.size() == expected.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("element " << i << ": got " << got[i] << ", expected " << expected[i]);
    if (std::isnan(expected[i]))  // an expected NaN is matched by a NaN
      CHECK(std::isnan(got[i]));
    else
      CHECK(std::abs(got[i] - expected[i]) <= tol * (1.0 + std::abs(expected[i])));
  }
}

// The message of the exception f throws ("" when it throws none).
template <class F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

inline bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

}  // namespace mn::testing
