#pragma once
// A packed single-precision GEMM for AVX-512 builds (Goto / BLIS structure): B is copied in blocks of
// kKc x kNc into panels of kNr columns, A in blocks of kMc x kKc into panels of kMr rows, and an
// 8 x 48 register tile (24 accumulators) runs over each pair of panels; tails take narrower
// instantiations of the same tile, so no padded row or 16-column vector is computed in vain.
//
// Every output element is one chain of fused multiply-adds over k within each kKc block, and the
// blocks are added to it in order: the bits depend on K and the blocking constants only, never on how
// the output is split over threads. gemm_serial (eigen_gemm.h) takes this path when it is enabled
// and the shape suits it (packed_gemm_suits); otherwise Eigen's.
#include <cstdint>

#include "kernels/cpu/eigen_gemm.h"

namespace mn::kernels::cpu {

// Whether this build has the packed kernel (compiled for AVX-512).
bool packed_gemm_built();

// Whether gemm_serial uses it. On by default where built; MN_CPU_GEMM=eigen in the environment starts
// the process with Eigen's kernel everywhere, which reproduces runs made before the packed kernel
// (issue 22) bit for bit. set_packed_gemm(true) on a build without it is ignored.
void set_packed_gemm(bool enabled);
bool packed_gemm_enabled();

// Products the packed kernel takes: both output dimensions large enough to fill its tiles. Narrower
// ones (matrix-vector products, a handful of rows or columns) stay with Eigen, whose GEMV paths suit
// them. A function of the shape only, so a given product always runs the same code.
bool packed_gemm_suits(int64_t m, int64_t n, int64_t k);

// c = alpha * a @ b + beta * c on the calling thread; c row-major with leading dimension ldc, never
// read when beta == 0. a and b may have any strides. Only on builds where packed_gemm_built().
// Each thread that calls it keeps its packing buffers, grown to the largest blocks it has used (at most
// 5.2 MB), for its lifetime, outside the caching allocator (as Eigen's per-call buffers are).
void packed_gemm(const MatrixRef& a, const MatrixRef& b, float* c, int64_t ldc, float alpha, float beta);

}  // namespace mn::kernels::cpu
