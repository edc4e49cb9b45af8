#pragma once
// Helpers shared by the differentiable ops: argument checks with clear messages, raw (non-recording)
// views for feeding kernels, and output allocation.
#include <vector>

#include "autograd/function.h"
#include "autograd/ops.h"
#include "kernels/kernels.h"

namespace mn::detail {

// Both tensors on one device; message names the op and both devices.
void check_same_device(const char* op, const Tensor& a, const Tensor& b);
// Same dtype; message names the op and both dtypes.
void check_same_dtype(const char* op, const Tensor& a, const Tensor& b);
// The dtype of an elementwise result of a and b: two floating dtypes promote (bf16 + f32 -> f32, as
// PyTorch; the kernel widens the 16-bit operand), anything else must match (TypeError otherwise).
DType result_dtype(const char* op, const Tensor& a, const Tensor& b);
void check_defined(const char* op, const Tensor& t, const char* arg);
void check_float(const char* op, const Tensor& t, const char* arg);
void check_dim(const char* op, const Tensor& t, int expected, const char* arg);

// A view of t broadcast to shape (zero strides), without autograd history.
Tensor expand_view(const Tensor& t, const Shape& shape);
// A view with new sizes/strides/offset over t's storage, without autograd history.
Tensor raw_view(const Tensor& t, const Shape& sizes, const Shape& strides, int64_t offset);
// Contiguous version of t without recording (for kernels that need dense inputs).
Tensor raw_contiguous(const Tensor& t);

// Tensor::copy_ and Tensor::fill_ (views.cpp; reached through autograd/tensor_hooks.cpp).
void copy_into(Tensor& self, const Tensor& src);
void fill_with(Tensor& self, double value);

// Bit mask of dims to reduce (all dims when dims is empty and all_if_empty).
uint32_t dim_mask(const std::vector<int64_t>& dims, int ndim, bool all_if_empty = true);
// Shape with reduced dims set to 1 (keepdim) or removed.
Shape reduced_shape(const Shape& s, uint32_t mask, bool keepdim);

}  // namespace mn::detail
