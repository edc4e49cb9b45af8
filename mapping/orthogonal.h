#pragma once
// Fixed mapper matrices. W (rows x cols) has orthonormal columns (rows >= cols) or orthonormal rows
// (rows < cols), optionally expanded by sqrt(max(rows, cols)) so that ||W||_F^2 = rows * cols, and is
// a pure function of (seed, key, rows, cols): every rank and device rebuilds the same matrix, and a
// checkpoint needs only the seed.
//
// Construction (rows >= cols = L): rows are cut into k = floor(rows / L) blocks. Blocks 1..k-1 are
// Q * D_b, with Q one L x L random orthogonal matrix and D_b a random +-1 diagonal (column signs);
// the last block (L + rows mod L rows) is a fresh random matrix with orthonormal columns. Every block
// has orthonormal columns, so W0^T W0 = k I and W = W0 / sqrt(k) (times the expansion). Random
// orthogonal factors come from Householder QR (in float, single-threaded, so the bits do not depend
// on the thread count) of Philox normal draws, with column signs fixed by sign(diag R).
// Cost: two QRs of about L x L (O(L^3), run side by side) plus O(rows * L) sign draws instead of the
// O(rows * L^2) QR of a full Gaussian: rows = 1e7, L = 4096 builds in 6.3-7.0 s on 2 cores. Storage is about 2 L^2 + (k-1) L floats instead of
// rows * L, and W z is a GEMM ([k-1, L] x [L, L]) plus one small GEMV, not a memory-bound GEMV over
// rows * L floats. materialize() gives the same matrix explicitly.
//
// That is the "block" family, the default. Two more families build the same kind of W (orthonormal
// columns or rows, the same expansion), chosen by MapperMatrixOptions::family:
//   dense  the reference's construction: the orthonormal columns of one rows x cols Gaussian (QR),
//          stored explicitly: rows * cols floats, so it is refused above max_dense_bytes (MemoryError
//          stating the bytes). When rows < 2 cols it is the block family's matrix, bit for bit.
//   srht   a subsampled randomised Hadamard map (kernels/srht_math.h): sign flips, fast Walsh-Hadamard
//          transforms and permutations regenerated from Philox where they are applied, so it stores
//          nothing, and W z costs O(rows log P) with P the power of two >= cols (no L x L block). It
//          needs rows >= P (orthonormal columns) or cols >= the power of two >= rows (orthonormal
//          rows, W = T^T); a matrix between (e.g. rows = 800, cols = 672) falls back to the block
//          family's construction, which there is one dense rows x cols tail.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mn::kernels {
struct SrhtPlan;  // kernels/srht_math.h (internal: not installed)
}

namespace mn::mapping {

// Names the construction below. Checkpoints record it: latents saved under another construction
// would generate different parameters, so loading them is refused. Bump it whenever the bits change.
inline constexpr const char* kMapperConstruction = "block-orthogonal/philox-householder-f32";

enum class MapperFamily { Block, Dense, Srht };
// "block", "dense", "srht"; parse_mapper_family refuses anything else (ValueError listing the choices).
const char* mapper_family_name(MapperFamily family);
MapperFamily parse_mapper_family(const std::string& name);
// The construction name checkpoints record for a family (kMapperConstruction for block).
const char* mapper_construction(MapperFamily family);

struct MapperMatrixOptions {
  MapperFamily family = MapperFamily::Block;
  // dense only: the largest explicit matrix (rows * cols * 4 bytes) it builds. allow_large raises the
  // cap to a third of the physical memory (the draws, the QR's copy and Q are alive together).
  int64_t max_dense_bytes = int64_t{1} << 30;
  bool allow_large = false;
};

// The dense family's cap: MemoryError stating the bytes a rows x cols explicit matrix would need and
// the cap (build() calls it; generators call it for every group first, so nothing is built in vain).
void check_dense_size(const std::string& key, int64_t rows, int64_t cols, const MapperMatrixOptions& options);

// The elements a family's rows x cols matrix stores once built (what build() allocates, known before it):
// block  an L x L block, k - 1 rows of signs and a tail of L + rows mod L rows (L = cols, k = rows / L;
//        the whole matrix when k < 2 or rows < cols);
// dense  rows x cols;
// srht   0 where the Hadamard blocks fit (see above), else the block family's count.
// ValueError when the count does not fit int64.
int64_t stored_matrix_elements(MapperFamily family, int64_t rows, int64_t cols);

class OrthogonalMatrix {
 public:
  OrthogonalMatrix() = default;
  static OrthogonalMatrix build(uint64_t seed, const std::string& key, int64_t rows, int64_t cols, bool expand,
                                Device device = kCPU, const MapperMatrixOptions& options = {});

  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  MapperFamily family() const { return family_; }
  // srht: whether the Hadamard map is used (false where the shape made it fall back to a block matrix).
  bool hadamard() const { return srht_ != nullptr; }
  // W z for z [cols] -> [rows]; differentiable in z (also twice).
  Tensor apply(const Tensor& z) const;
  // W^T u for u [rows] -> [cols]; differentiable in u.
  Tensor apply_transpose(const Tensor& u) const;
  // The explicit rows x cols matrix (for tests and the literal-reference benchmark).
  Tensor materialize() const;
  // Mean over rows of W (length cols): the alignment summary, fixed, so computed once.
  Tensor column_mean() const;
  // Bytes held by the factors.
  size_t bytes() const;
  // Bytes the explicit matrix would take (rows * cols * 4).
  size_t dense_bytes() const { return static_cast<size_t>(rows_) * static_cast<size_t>(cols_) * 4; }
  std::vector<Tensor> factors() const;
  // The factors one by one, as the fused group kernels read them (mapping/fused_group.h): block and
  // signs are undefined without a repeated part; all three are undefined for the srht family.
  const Tensor& block() const { return block_; }
  const Tensor& signs() const { return signs_; }
  const Tensor& tail() const { return tail_; }
  void to(Device device);

 private:
  int64_t rows_ = 0, cols_ = 0;
  MapperFamily family_ = MapperFamily::Block;
  // srht: the Hadamard plan (no factors); transposed when W has orthonormal rows (W = T^T).
  std::shared_ptr<const kernels::SrhtPlan> srht_;
  bool srht_transposed_ = false;
  // The factors hold the scale (expansion / sqrt(k)): W = [block_ D_1; ...; block_ D_{k-1}; tail_].
  Tensor block_;  // [L, L] shared orthogonal block of the repeated part (undefined if none)
  Tensor signs_;  // [k-1, L] +-1 column signs of the repeated blocks
  Tensor tail_;   // [rows - (k-1) L, L] with orthonormal columns, or [rows, cols] with orthonormal rows
};

// A random matrix with orthonormal columns (rows >= cols) from a Philox normal stream, QR in double.
Tensor random_orthonormal_columns(int64_t rows, int64_t cols, uint64_t seed, uint64_t stream);

}  // namespace mn::mapping
