#pragma once
// Strided single-precision matrix products, shared by the gemm, conv and mapped-group kernels: the
// packed AVX-512 kernel (packed_gemm.h) where the build has it and the shape suits it, Eigen's GEMM
// otherwise. Neither threads by itself: each serial call runs on one thread, and the work is split
// into blocks of the output by us. Eigen's own OpenMP GEMM picks its K blocking from the thread
// count, so its results would change in the last bits with OMP_NUM_THREADS; ours do not.
#include <cstdint>

namespace mn::kernels::cpu {

// A read-only matrix view: element (i, j) at data[i * row_stride + j * col_stride].
struct MatrixRef {
  const float* data = nullptr;
  int64_t rows = 0, cols = 0;
  int64_t row_stride = 0, col_stride = 0;
};

// Whether Eigen can read m in place (one of its strides is 1 and the other leaves no overlap);
// otherwise the caller copies it to a dense buffer first.
bool eigen_mappable(const MatrixRef& m);

// c = alpha * a @ b + beta * c on the calling thread. c is row-major with leading dimension ldc;
// with beta == 0 it is never read (it may hold garbage). a and b must be eigen_mappable.
void gemm_serial(const MatrixRef& a, const MatrixRef& b, float* c, int64_t ldc, float alpha, float beta);

// The same product split over OpenMP threads when it is large enough. Each output element is
// computed by one serial call whose blocking depends only on K, so results do not depend on the
// thread count. Runs serially when already inside a parallel region.
void gemm_parallel(const MatrixRef& a, const MatrixRef& b, float* c, int64_t ldc, float alpha, float beta);

}  // namespace mn::kernels::cpu
