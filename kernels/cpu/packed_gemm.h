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
#include <vector>

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

// Products that share one B among many blocks of rows (the mapped-group kernels multiply thousands of
// rows by one L x L matrix), run block of B by block of B as packed_gemm runs them: for each block the
// caller packs it once (pack_b_block), then multiplies any blocks of rows by it (multiply_b_block).
// Every output element gets packed_gemm's sums bit for bit, however the rows are cut, so long as each
// element meets the blocks in the order gemm_b_blocks lists them.
struct GemmBBlock {
  int64_t jc = 0, nc = 0;  // B's columns jc .. jc + nc
  int64_t pc = 0, kc = 0;  // B's rows (the K range) pc .. pc + kc
  int64_t floats() const;  // the packed block's size (its buffer: 64-byte aligned)
};
std::vector<GemmBBlock> gemm_b_blocks(int64_t k, int64_t n);  // for a k x n B, in packed_gemm's order
void pack_b_block(const MatrixRef& b, const GemmBBlock& block, float* out);  // block.floats() floats at out
// Rows of C (c: their column 0, row stride ldc) get alpha * A_block * B_block over the block's columns:
// stored (the block starts the K range and beta == 0), added (a later K block, or beta == 1), or scaled
// by beta first. a points at A's element (0, block.pc): element (i, k) at a[i * rs + k * cs].
void multiply_b_block(const float* a, int64_t rs, int64_t cs, int64_t rows, const float* b_packed,
                      const GemmBBlock& block, float* c, int64_t ldc, float alpha, float beta);

// The calling thread's packing buffer for B (the one packed_gemm packs into), lent while this lives to
// hold blocks of up to `floats` floats for multiply_b_block: no memory beyond what packed_gemm keeps
// anyway. A packed_gemm call on this thread meanwhile would overwrite it, so it throws std::logic_error.
class LentBBuffer {
 public:
  explicit LentBBuffer(int64_t floats);
  ~LentBBuffer();
  LentBBuffer(const LentBBuffer&) = delete;
  LentBBuffer& operator=(const LentBBuffer&) = delete;
  float* data() const { return data_; }

 private:
  float* data_ = nullptr;
};

}  // namespace mn::kernels::cpu
