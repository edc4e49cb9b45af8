#include "mapping/orthogonal.h"

#include <omp.h>

#include <Eigen/Dense>
#include <cmath>
#include <exception>
#include <limits>
#include <new>
#include <unistd.h>

#include "autograd/function.h"
#include "autograd/ops.h"
#include "core/parallel.h"
#include "core/random.h"
#include "kernels/kernels.h"
#include "kernels/srht_math.h"
#include "mapping/srht.h"

namespace mn::mapping {

Tensor random_orthonormal_columns(int64_t rows, int64_t cols, uint64_t seed, uint64_t stream) {
  MN_CHECK(rows >= cols && cols > 0, ValueError, "random_orthonormal_columns: need rows >= cols > 0, got ", rows, "x",
           cols);
  using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Tensor out = empty({rows, cols});
  philox_fill(out.data<float>(), rows * cols, Distribution::Normal, 0.0, 1.0, PhiloxState{seed, stream, 0});
  Eigen::Map<RowMajor> draws(out.data<float>(), rows, cols);
  // Householder QR in single precision: the factors are stored as floats anyway, the orthogonality
  // error stays near 1e-6 at L = 4096, and it runs about 3x faster than double, which is what keeps
  // the L^3 cost at seconds for L = 4096. One thread: Eigen's blocking depends on the thread count,
  // and the bits must not.
  const int saved_threads = omp_get_max_threads();
  omp_set_num_threads(1);
  Eigen::HouseholderQR<Eigen::MatrixXf> qr;
  Eigen::MatrixXf q;
  try {
    qr.compute(Eigen::MatrixXf(draws));
    q = qr.householderQ() * Eigen::MatrixXf::Identity(rows, cols);
  } catch (const std::bad_alloc&) {  // Eigen's work matrices: say which matrix, as the allocator would
    omp_set_num_threads(saved_threads);
    throw MemoryError(str("out of memory factorising a ", rows, "x", cols, " random orthogonal matrix"));
  }
  omp_set_num_threads(saved_threads);
  // Make the factorisation unique: R with a positive diagonal.
  for (int64_t j = 0; j < cols; ++j)
    if (qr.matrixQR()(j, j) < 0) q.col(j) *= -1.0f;
  draws = q;
  return out;
}

const char* mapper_family_name(MapperFamily family) {
  switch (family) {
    case MapperFamily::Block: return "block";
    case MapperFamily::Dense: return "dense";
    case MapperFamily::Srht: return "srht";
  }
  return "?";
}

MapperFamily parse_mapper_family(const std::string& name) {
  for (MapperFamily f : {MapperFamily::Block, MapperFamily::Dense, MapperFamily::Srht})
    if (name == mapper_family_name(f)) return f;
  throw ValueError(str("Unknown mapper family '", name, "'; choose from: block, dense, srht"));
}

const char* mapper_construction(MapperFamily family) {
  switch (family) {
    case MapperFamily::Block: return kMapperConstruction;
    case MapperFamily::Dense: return "dense/philox-householder-f32";
    case MapperFamily::Srht: return "srht/philox-fwht-f32";
  }
  return "?";
}

// The dense family's guard, before anything is allocated.
void check_dense_size(const std::string& key, int64_t rows, int64_t cols, const MapperMatrixOptions& options) {
  int64_t elements = 0, bytes = 0;
  const bool huge = mul_overflows(rows, cols, &elements) || mul_overflows(elements, int64_t{4}, &bytes);
  int64_t cap = options.max_dense_bytes;
  const char* cap_name = "max_dense_bytes";
  if (options.allow_large) {
    cap = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGE_SIZE)) / 3;
    cap_name = "a third of the physical memory (allow_large)";
  }
  if (huge || bytes > cap)
    throw MemoryError(str("the dense mapper matrix '", key, "' (", rows, " x ", cols, ") would need ",
                          huge ? std::string("more than int64 can count") : thousands(bytes),
                          " bytes as an explicit f32 matrix, above the cap of ", thousands(cap), " bytes (",
                          cap_name, "); use the block or srht mapper family, which never store it"));
}

int64_t stored_matrix_elements(MapperFamily family, int64_t rows, int64_t cols) {
  MN_CHECK(rows > 0 && cols > 0, ValueError, "mapper matrix must have positive dimensions, got ", rows, "x", cols);
  if (family == MapperFamily::Srht) {
    const int64_t tall = std::max(rows, cols), short_side = std::min(rows, cols);
    int64_t pow2 = 1;
    while (pow2 < short_side) pow2 *= 2;
    if (tall >= pow2) return 0;
  }
  int64_t whole = 0;
  MN_CHECK(!mul_overflows(rows, cols, &whole), ValueError, "a ", rows, " x ", cols,
           " mapper matrix has more elements than int64 can count");
  const int64_t k = rows / cols;
  if (family == MapperFamily::Dense || rows < cols || k < 2) return whole;
  // block [L, L] + signs [k - 1, L] + tail [rows - (k - 1) L, L]: at most 1.5 rows * cols, so counted wide.
  const __int128 L = cols;
  const __int128 count = L * L + (k - 1) * L + (rows - (k - 1) * L) * L;
  MN_CHECK(count <= std::numeric_limits<int64_t>::max(), ValueError, "a ", rows, " x ", cols,
           " mapper matrix has more elements than int64 can count");
  return static_cast<int64_t>(count);
}

OrthogonalMatrix OrthogonalMatrix::build(uint64_t seed, const std::string& key, int64_t rows, int64_t cols,
                                         bool expand, Device device, const MapperMatrixOptions& options) {
  MN_CHECK(rows > 0 && cols > 0, ValueError, "mapper matrix '", key, "' must have positive dimensions, got ", rows,
           "x", cols);
  OrthogonalMatrix m;
  m.rows_ = rows;
  m.cols_ = cols;
  m.family_ = options.family;
  const uint64_t stream = stream_key(key);
  const double expansion = expand ? std::sqrt(static_cast<double>(std::max(rows, cols))) : 1.0;
  if (options.family == MapperFamily::Srht) {
    // W = T (orthonormal columns) or T^T (orthonormal rows) for T the Hadamard map of the taller shape.
    const bool transposed = rows < cols;
    auto plan = srht_plan(seed, stream ^ 0x5a47ULL, std::max(rows, cols), std::min(rows, cols), expansion);
    if (plan) {
      m.srht_ = std::move(plan);
      m.srht_transposed_ = transposed;
      return m;  // nothing to move: the map is regenerated on whatever device its input lives
    }
  }
  double scale = 1.0;
  if (options.family == MapperFamily::Dense) check_dense_size(key, rows, cols, options);
  if (options.family == MapperFamily::Dense && rows >= cols) {
    // The block family's tail stream: with rows < 2 cols both families give the same matrix.
    m.tail_ = random_orthonormal_columns(rows, cols, seed, stream ^ 0x7a11ULL);
    scale = expansion;
  } else if (rows < cols) {
    // Orthonormal rows: the transpose of a cols x rows matrix with orthonormal columns.
    m.tail_ = random_orthonormal_columns(cols, rows, seed, stream ^ 0x7a11ULL).t().contiguous();
    scale = expansion;
  } else {
    const int64_t k = rows / cols;
    if (k > 1) {
      Generator signs(seed, stream ^ 0x5167ULL);
      m.signs_ = rademacher({k - 1, cols}, {}, &signs);
    }
    // The two factorisations are independent and each single-threaded: run them side by side (the
    // result does not depend on which thread does which).
    std::exception_ptr failure;
    auto guarded = [&failure](auto&& fn) {
      try {
        fn();
      } catch (...) {
#pragma omp critical(mn_orthogonal_build)
        failure = std::current_exception();
      }
    };
#pragma omp parallel sections num_threads(2) if (k > 1 && cols >= 64 && get_num_threads_in_use() > 1)
    {
#pragma omp section
      guarded([&] {
        if (k > 1) m.block_ = random_orthonormal_columns(cols, cols, seed, stream ^ 0xb10cULL);
      });
#pragma omp section
      guarded([&] { m.tail_ = random_orthonormal_columns(rows - (k - 1) * cols, cols, seed, stream ^ 0x7a11ULL); });
    }
    if (failure) std::rethrow_exception(failure);
    scale = expansion / std::sqrt(static_cast<double>(k));
  }
  // The factors carry the scale, so applying W is the GEMMs alone (no extra pass over the output).
  if (scale != 1.0) {
    if (m.block_.defined()) m.block_ = mul(m.block_, scale);
    m.tail_ = mul(m.tail_, scale);
  }
  if (!device.is_cpu()) m.to(device);
  return m;
}

Tensor OrthogonalMatrix::apply(const Tensor& z) const {
  MN_CHECK(z.dim() == 1 && z.size(0) == cols_, ValueError, "Expected a 1D latent vector with ", cols_,
           " values, got shape ", z.sizes());
  if (srht_) return srht_transposed_ ? srht_transpose(*srht_, z) : srht_forward(*srht_, z);
  if (!block_.defined()) return matmul(tail_, z);
  // Row block b of Q D_b z is Q (d_b * z): all blocks at once as [k-1, L] x [L, L]^T, written with the
  // tail's GEMV straight into one output (no concatenation pass). W is fixed, so the gradient is
  // W^T g, which apply_transpose computes with differentiable ops (double backward works through it).
  const int64_t reps = signs_.size(0), repeated_rows = reps * cols_;
  Tensor y = empty({rows_}, TensorOptions().with_device(z.device()));
  {
    autograd::NoGradGuard no_grad;
    const Tensor zd = z.detach();
    Tensor repeated = y.narrow(0, 0, repeated_rows).view({reps, cols_});
    kernels::gemm(z.device(), mul(signs_, zd.unsqueeze(0)), block_.t(), repeated, 1.0, 0.0);
    Tensor tail = y.narrow(0, repeated_rows, rows_ - repeated_rows).view({rows_ - repeated_rows, 1});
    kernels::gemm(z.device(), tail_, zd.view({cols_, 1}), tail, 1.0, 0.0);
  }
  if (autograd::needs_grad({&z}))
    autograd::record("OrthogonalApplyBackward", {&z}, {&y},
                     [w = *this](const autograd::GradContext& c) -> autograd::TensorList {
                       return {w.apply_transpose(c.grad())};
                     });
  return y;
}

Tensor OrthogonalMatrix::apply_transpose(const Tensor& u) const {
  MN_CHECK(u.dim() == 1 && u.size(0) == rows_, ValueError, "Expected a vector with ", rows_, " values, got shape ",
           u.sizes());
  if (srht_) return srht_transposed_ ? srht_forward(*srht_, u) : srht_transpose(*srht_, u);
  const int64_t repeated_rows = block_.defined() ? signs_.size(0) * cols_ : 0;
  Tensor out = matmul(tail_.t(), u.narrow(0, repeated_rows, rows_ - repeated_rows));
  if (block_.defined()) {
    Tensor ub = u.narrow(0, 0, repeated_rows).reshape({signs_.size(0), cols_});
    out = add(out, sum(mul(matmul(ub, block_), signs_), {0}));
  }
  return out;
}

Tensor OrthogonalMatrix::materialize() const {
  if (srht_) {
    // Column j is W e_j (rows x cols applications of the map: for tests and small shapes).
    autograd::NoGradGuard no_grad;
    std::vector<Tensor> columns;
    for (int64_t j = 0; j < cols_; ++j) {
      Tensor e = zeros({cols_});
      e.data<float>()[j] = 1.0f;
      columns.push_back(apply(e));
    }
    return stack(columns, 1).contiguous();
  }
  Tensor dense = tail_;
  if (block_.defined()) {
    // Block b = Q D_b: Q with its columns multiplied by the signs.
    Tensor blocks = mul(block_.unsqueeze(0), signs_.unsqueeze(1)).reshape({-1, cols_});
    dense = cat({blocks, tail_}, 0);
  }
  return dense.contiguous();
}

Tensor OrthogonalMatrix::column_mean() const {
  Tensor ones_rows = ones({rows_}, TensorOptions().with_device(srht_ ? Device(kCPU) : tail_.device()));
  return div(apply_transpose(ones_rows), static_cast<double>(rows_));
}

size_t OrthogonalMatrix::bytes() const {
  size_t b = 0;
  for (const Tensor& t : factors()) b += t.nbytes();
  return b;
}

std::vector<Tensor> OrthogonalMatrix::factors() const {
  std::vector<Tensor> out;
  for (const Tensor* t : {&block_, &signs_, &tail_})
    if (t->defined()) out.push_back(*t);
  return out;
}

void OrthogonalMatrix::to(Device device) {
  for (Tensor* t : {&block_, &signs_, &tail_})
    if (t->defined()) *t = t->to(device);
}

}  // namespace mn::mapping
