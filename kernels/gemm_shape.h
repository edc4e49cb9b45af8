#pragma once
// Argument checks of the gemm kernel (kernels.h), shared by every backend: a and b are [M, K] / [K, N]
// or batched [B or 1, ...], out is a contiguous [M, N] or [B, M, N], all three f32 (or all one 16-bit
// dtype, which only the CUDA kernel sees: elsewhere the dispatcher widens them). Returns the problem size.
#include <cstdint>

#include "core/error.h"
#include "core/tensor.h"

namespace mn::kernels {

struct GemmShape {
  int64_t batch, m, k, n;
};

inline void check_gemm_operand(const Tensor& t, DType dtype, int64_t batch, const char* name) {
  MN_CHECK(t.dtype() == dtype, TypeError, "gemm: expected '", name, "' of dtype ", dtype, " like the output, got ",
           t.dtype());
  MN_CHECK(t.dim() == 2 || t.dim() == 3, ValueError, "gemm: expected '", name, "' to be 2-D or 3-D, got shape ",
           t.sizes());
  MN_CHECK(t.dim() == 2 || t.size(0) == batch || t.size(0) == 1, ValueError, "gemm: '", name, "' has shape ",
           t.sizes(), " but the batch size is ", batch);
}

inline GemmShape check_gemm(const Tensor& a, const Tensor& b, const Tensor& out) {
  MN_CHECK(is_floating_point(out.dtype()) && out.is_contiguous(), ValueError,
           "gemm: expected a contiguous floating-point output, got ", out.dtype(), out.sizes());
  MN_CHECK(out.dim() == 2 || out.dim() == 3, ValueError, "gemm: expected a 2-D or 3-D output, got ", out.sizes());
  const int64_t batch = out.dim() == 3 ? out.size(0) : 1;
  check_gemm_operand(a, out.dtype(), batch, "a");
  check_gemm_operand(b, out.dtype(), batch, "b");
  const int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  MN_CHECK(b.size(-2) == k && out.size(-2) == m && out.size(-1) == n, ValueError, "gemm: shapes ", a.sizes(),
           " and ", b.sizes(), " do not give output shape ", out.sizes());
  MN_CHECK(a.dim() == 2 || b.dim() == 2 || out.dim() == 3, ValueError, "gemm: batched operands ", a.sizes(), " and ",
           b.sizes(), " need a 3-D output, got ", out.sizes());
  return {batch, m, k, n};
}

}  // namespace mn::kernels
