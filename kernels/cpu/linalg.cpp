// CPU matrix products: the batched gemm kernel and the strided helpers it shares with conv (the packed
// kernel of packed_gemm.h, or Eigen's). Operands are read in place whenever Eigen can map them
// (row-major views, and transposed views as column-major maps); only views with no unit stride are
// copied.
#include <omp.h>

// GCC 12 flags Eigen's AVX-512 transposes (`__m512 __Y = __Y;` in the intrinsics header) as
// maybe-uninitialised; a known false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <Eigen/Core>
#include <algorithm>

#include "core/parallel.h"
#include "kernels/cpu/eigen_gemm.h"
#include "kernels/cpu/packed_gemm.h"
#include "kernels/gemm_shape.h"
#include "kernels/kernels.h"

namespace mn::kernels {
namespace cpu {
namespace {

using RowMajorMap = Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>,
                               Eigen::Unaligned, Eigen::OuterStride<>>;
using ColMajorMap = Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>,
                               Eigen::Unaligned, Eigen::OuterStride<>>;
using OutputMap = Eigen::Map<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>,
                             Eigen::Unaligned, Eigen::OuterStride<>>;

// Below this many multiply-adds per thread, starting a parallel region costs more than it saves.
constexpr int64_t kMinWorkPerThread = int64_t{1} << 16;
// Output blocks handed to threads start at multiples of Eigen's register block sizes, so every element
// runs through the same micro-kernel path as in the unsplit product. Eigen computes a row-major
// C = A B as C^T = B^T A^T: our columns are its rows, blocked by mr (48 floats with AVX-512, 24 with
// AVX2), and our rows are its columns, blocked by nr (4; 16 leaves room).
constexpr int64_t kRowAlign = 16;
constexpr int64_t kColAlign = 48;

// Eigen's OuterStride<> treats 0 as "use the default"; callers only pass strides >= 1.
bool row_major_ok(const MatrixRef& m) {
  return (m.col_stride == 1 || m.cols <= 1) && (m.rows <= 1 || m.row_stride >= std::max<int64_t>(m.cols, 1));
}
bool col_major_ok(const MatrixRef& m) {
  return (m.row_stride == 1 || m.rows <= 1) && (m.cols <= 1 || m.col_stride >= std::max<int64_t>(m.rows, 1));
}
RowMajorMap as_row_major(const MatrixRef& m) {
  const int64_t outer = m.rows <= 1 ? std::max<int64_t>(m.cols, 1) : m.row_stride;
  return RowMajorMap(m.data, m.rows, m.cols, Eigen::OuterStride<>(outer));
}
ColMajorMap as_col_major(const MatrixRef& m) {
  const int64_t outer = m.cols <= 1 ? std::max<int64_t>(m.rows, 1) : m.col_stride;
  return ColMajorMap(m.data, m.rows, m.cols, Eigen::OuterStride<>(outer));
}

template <class A, class B>
void eigen_product(const A& a, const B& b, OutputMap& c, float alpha, float beta) {
  if (beta == 0.0f) {
    if (alpha == 1.0f) c.noalias() = a * b;
    else c.noalias() = (alpha * a) * b;
    return;
  }
  if (beta != 1.0f) c *= beta;
  if (alpha == 1.0f) c.noalias() += a * b;
  else c.noalias() += (alpha * a) * b;
}

// Eigen starts its own threads for a large product unless it runs inside an active parallel region;
// outside one we lower this thread's OpenMP thread count for the duration of the call.
class EigenSingleThread {
 public:
  EigenSingleThread() : saved_(omp_in_parallel() ? 0 : omp_get_max_threads()) {
    if (saved_ > 1) omp_set_num_threads(1);
  }
  ~EigenSingleThread() {
    if (saved_ > 1) omp_set_num_threads(saved_);
  }
  EigenSingleThread(const EigenSingleThread&) = delete;
  EigenSingleThread& operator=(const EigenSingleThread&) = delete;

 private:
  int saved_;
};

// [begin, end) of part p of n items split into `parts` blocks starting at multiples of `align`; the
// last block takes the remainder.
std::pair<int64_t, int64_t> block_range(int64_t n, int64_t align, int parts, int p) {
  auto edge = [&](int q) { return q >= parts ? n : (n * q / parts) / align * align; };
  return {edge(p), edge(p + 1)};
}

}  // namespace

bool eigen_mappable(const MatrixRef& m) {
  return m.rows == 0 || m.cols == 0 || row_major_ok(m) || col_major_ok(m);
}

void gemm_serial(const MatrixRef& a, const MatrixRef& b, float* c, int64_t ldc, float alpha, float beta) {
  const int64_t m = a.rows, n = b.cols;
  if (m == 0 || n == 0) return;
  OutputMap out(c, m, n, Eigen::OuterStride<>(std::max<int64_t>(ldc, 1)));
  if (a.cols == 0) {  // empty sum
    if (beta == 0.0f) out.setZero();
    else if (beta != 1.0f) out *= beta;
    return;
  }
  if (packed_gemm_enabled() && packed_gemm_suits(m, n, a.cols)) return packed_gemm(a, b, c, ldc, alpha, beta);
  EigenSingleThread single;
  const bool a_rows = row_major_ok(a), b_rows = row_major_ok(b);
  if (a_rows && b_rows) eigen_product(as_row_major(a), as_row_major(b), out, alpha, beta);
  else if (a_rows) eigen_product(as_row_major(a), as_col_major(b), out, alpha, beta);
  else if (b_rows) eigen_product(as_col_major(a), as_row_major(b), out, alpha, beta);
  else eigen_product(as_col_major(a), as_col_major(b), out, alpha, beta);
}

void gemm_parallel(const MatrixRef& a, const MatrixRef& b, float* c, int64_t ldc, float alpha, float beta) {
  const int64_t m = a.rows, n = b.cols, k = a.cols;
  const int threads = get_num_threads_in_use();
  int parts = static_cast<int>(std::min<int64_t>(threads, m * n * k / kMinWorkPerThread));
  if (parts <= 1) return gemm_serial(a, b, c, ldc, alpha, beta);
  // Rows split in finer, better balanced blocks; columns when there are too few rows.
  const bool split_rows = m / kRowAlign >= parts || m / kRowAlign >= n / kColAlign;
  const int64_t length = split_rows ? m : n, align = split_rows ? kRowAlign : kColAlign;
  parts = static_cast<int>(std::min<int64_t>(parts, length / align));
  if (parts <= 1) return gemm_serial(a, b, c, ldc, alpha, beta);
#pragma omp parallel for num_threads(parts) schedule(static, 1)
  for (int p = 0; p < parts; ++p) {
    const auto [begin, end] = block_range(length, align, parts, p);
    if (end <= begin) continue;
    MatrixRef a_part = a, b_part = b;
    if (split_rows) {
      a_part.data = a.data + begin * a.row_stride;
      a_part.rows = end - begin;
      gemm_serial(a_part, b_part, c + begin * ldc, ldc, alpha, beta);
    } else {
      b_part.data = b.data + begin * b.col_stride;
      b_part.cols = end - begin;
      gemm_serial(a_part, b_part, c + begin, ldc, alpha, beta);
    }
  }
}

}  // namespace cpu

namespace {

using cpu::MatrixRef;

// One gemm operand: a 2-D matrix or a 3-D batch of them (batch stride 0 = the same matrix for all).
struct BatchOperand {
  Tensor keep_alive;  // a dense copy when the view was not mappable
  const float* base = nullptr;
  int64_t batch_stride = 0;
  MatrixRef matrix;  // matrix 0
  MatrixRef at(int64_t i) const {
    MatrixRef r = matrix;
    r.data = base + i * batch_stride;
    return r;
  }
};

// t has passed check_gemm.
BatchOperand batch_operand(const Tensor& t) {
  const int d = t.dim();
  Tensor src = t;
  int64_t batch_stride = (d == 3 && t.size(0) != 1) ? t.stride(0) : 0;
  MatrixRef ref{nullptr, t.size(d - 2), t.size(d - 1), t.stride(d - 2), t.stride(d - 1)};
  BatchOperand op;
  if (!cpu::eigen_mappable(ref)) {
    // Copy only the distinct matrices: one when the batch is broadcast.
    Shape sizes = batch_stride == 0 ? Shape{ref.rows, ref.cols} : Shape{t.size(0), ref.rows, ref.cols};
    Shape strides = batch_stride == 0 ? Shape{ref.row_stride, ref.col_stride} : t.strides();
    Tensor view = make_view(t.storage(), sizes, strides, t.storage_offset(), t.dtype());
    src = empty(sizes, TensorOptions(DType::f32));
    copy(kCPU, view, src);
    op.keep_alive = src;
    batch_stride = batch_stride == 0 ? 0 : ref.rows * ref.cols;
    ref.row_stride = ref.cols;
    ref.col_stride = 1;
  }
  op.base = src.data<float>();
  op.batch_stride = batch_stride;
  ref.data = op.base;
  op.matrix = ref;
  return op;
}

void gemm_cpu(const Tensor& a, const Tensor& b, Tensor& out, double alpha, double beta) {
  const auto [batch, m, k, n] = check_gemm(a, b, out);
  const BatchOperand lhs = batch_operand(a), rhs = batch_operand(b);
  float* c = out.data<float>();
  const float fa = static_cast<float>(alpha), fb = static_cast<float>(beta);
  const int64_t work = m * n * k;
  const int threads = get_num_threads_in_use();
  if (batch == 1) return cpu::gemm_parallel(lhs.at(0), rhs.at(0), c, n, fa, fb);

  // Whole matrices per thread when the batch balances over the threads or the matrices are small;
  // otherwise each product is split over the threads.
  const bool batch_parallel = threads > 1 && batch * work >= 2 * cpu::kMinWorkPerThread &&
                              (batch % threads == 0 || batch >= 4 * threads || work < (int64_t{1} << 21));
  if (batch_parallel) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < batch; ++i) cpu::gemm_serial(lhs.at(i), rhs.at(i), c + i * m * n, n, fa, fb);
    return;
  }
  for (int64_t i = 0; i < batch; ++i) cpu::gemm_parallel(lhs.at(i), rhs.at(i), c + i * m * n, n, fa, fb);
}

}  // namespace

void register_cpu_linalg() { gemm.set(DeviceType::CPU, &gemm_cpu); }

}  // namespace mn::kernels
