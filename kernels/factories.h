#pragma once
// Tensor factories that fill memory with kernels (CPU unless a device is given; f32 unless a dtype is
// given). empty, empty_like and make_view, which only allocate or view, are in core/tensor.h.
// Including this header also links the kernels layer's backend registration into the program (the
// anchor at the end): core asks for it before a device's first allocation (core/allocator.h).
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace mn {

Tensor zeros(const Shape& shape, TensorOptions opts = {});
Tensor ones(const Shape& shape, TensorOptions opts = {});
Tensor full(const Shape& shape, double value, TensorOptions opts = {});
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor full_like(const Tensor& t, double value);
// [start, end) with step; dtype i64 unless opts says f32.
Tensor arange(double start, double end, double step = 1.0, TensorOptions opts = DType::i64);
Tensor arange(int64_t end, TensorOptions opts = DType::i64);
// Uniform [0, 1) and standard normal, from the given generator (default: the global one).
Tensor rand(const Shape& shape, TensorOptions opts = {}, Generator* gen = nullptr);
Tensor randn(const Shape& shape, TensorOptions opts = {}, Generator* gen = nullptr);
Tensor uniform(const Shape& shape, double lo, double hi, TensorOptions opts = {}, Generator* gen = nullptr);
Tensor normal(const Shape& shape, double mean, double std, TensorOptions opts = {}, Generator* gen = nullptr);
Tensor bernoulli(const Shape& shape, double p, TensorOptions opts = {}, Generator* gen = nullptr);
Tensor rademacher(const Shape& shape, TensorOptions opts = {}, Generator* gen = nullptr);
// From host values (copied), row-major; the shape defaults to 1-D.
Tensor from_vector(const std::vector<float>& values, const Shape& shape = {}, TensorOptions opts = {});
Tensor from_vector(const std::vector<int64_t>& values, const Shape& shape = {}, TensorOptions opts = DType::i64);
Tensor scalar_tensor(double value, TensorOptions opts = {});

namespace detail {
// Hands core the kernels' backend registration (kernels/dispatch.cpp); idempotent, returns 0.
int install_kernel_backends();
namespace {
// One call per translation unit at static initialisation. It makes every program that includes this
// header link kernels/dispatch.cpp (a static library would leave an object that nothing references
// out), and installs the hook before that unit's own static objects are built.
[[maybe_unused]] const int backends_anchor = install_kernel_backends();
}  // namespace
}  // namespace detail

}  // namespace mn
