#pragma once
// The shape rules of the gather and scatter_add kernels, checked on the host by both backends
// (kernels/cpu/gather.cpp, kernels/cuda/gather.cu) before any index value is read.
#include "core/error.h"
#include "core/tensor.h"

namespace mn::kernels {

// index (i64), target and other have one rank (at least 1), target and other one dtype, dim is a dim.
inline void check_gather_ranks(const char* op, const Tensor& index, int dim, const Tensor& target,
                               const char* target_name, const Tensor& other, const char* other_name) {
  MN_CHECK(index.dtype() == DType::i64, TypeError, op, ": expected an i64 index, got ", index.dtype());
  MN_CHECK(index.dim() == target.dim() && index.dim() == other.dim() && target.dim() >= 1, ValueError, op,
           ": index, ", target_name, " and ", other_name, " must have the same number of dims (at least 1), got ",
           index.sizes(), ", ", target.sizes(), " and ", other.sizes());
  MN_CHECK(dim >= 0 && dim < target.dim(), IndexError, op, ": dim ", dim, " is out of range for shape ",
           target.sizes());
  MN_CHECK(target.dtype() == other.dtype(), TypeError, op, ": '", target_name, "' is ", target.dtype(), " but '",
           other_name, "' is ", other.dtype());
}

// gather: out contiguous with index's shape; index no larger than in outside dim.
inline void check_gather_shapes(const Tensor& in, int dim, const Tensor& index, const Tensor& out) {
  check_gather_ranks("gather", index, dim, in, "input", out, "out");
  MN_CHECK(out.is_contiguous() && out.sizes() == index.sizes(), ValueError, "gather: out of shape ", out.sizes(),
           " must be contiguous and match index of shape ", index.sizes());
  for (int d = 0; d < in.dim(); ++d)
    MN_CHECK(d == dim || index.size(d) <= in.size(d), ValueError, "gather: index of shape ", index.sizes(),
             " is larger than input of shape ", in.sizes(), " in dimension ", d);
}

// scatter_add: index no larger than src anywhere, nor than out outside dim.
inline void check_scatter_shapes(const Tensor& out, int dim, const Tensor& index, const Tensor& src) {
  check_gather_ranks("scatter_add", index, dim, out, "out", src, "src");
  for (int d = 0; d < out.dim(); ++d) {
    MN_CHECK(index.size(d) <= src.size(d), ValueError, "scatter_add: index of shape ", index.sizes(),
             " is larger than src of shape ", src.sizes(), " in dimension ", d);
    MN_CHECK(d == dim || index.size(d) <= out.size(d), ValueError, "scatter_add: index of shape ", index.sizes(),
             " is larger than self of shape ", out.sizes(), " in dimension ", d);
  }
}

}  // namespace mn::kernels
