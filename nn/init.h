#pragma once
// Parameter initialisers with PyTorch's default distributions, drawn from the default generator
// (mn::manual_seed) unless one is given. They fill in place under no-grad.
#include "core/random.h"
#include "core/tensor.h"

namespace mn::nn::init {

// fan_in / fan_out of a weight [out, in, *kernel].
std::pair<int64_t, int64_t> fans(const Tensor& weight);
void uniform_(Tensor& t, double lo, double hi, Generator* gen = nullptr);
void normal_(Tensor& t, double mean, double std, Generator* gen = nullptr);
void constant_(Tensor& t, double value);
// kaiming-uniform with negative slope a (leaky-relu gain): bound = sqrt(6 / ((1 + a^2) fan_in)).
void kaiming_uniform_(Tensor& t, double a = 0.0, Generator* gen = nullptr);
void xavier_uniform_(Tensor& t, double gain = 1.0, Generator* gen = nullptr);

}  // namespace mn::nn::init
