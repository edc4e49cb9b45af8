// The CUDA gemm kernel: cuBLAS on row-major tensors by operand swap. cuBLAS is column-major, and a
// row-major matrix read column-major is its transpose, so C = A B (row-major, M x N) is computed as
// C^T = B^T A^T (column-major, N x M): the first cuBLAS operand is our b, the second our a.
//
// Operands are read in place when one of their strides is 1 (a plain row-major matrix, or a transposed
// view, read with CUBLAS_OP_T); other views are copied to a dense buffer first (only the distinct
// matrices: one when the batch is broadcast). Batches go through cublasGemmStridedBatchedEx with a
// batch stride of 0 for a broadcast operand. TF32 is used only when cuda::set_allow_tf32(true).
// bf16 and f16 operands run natively (cuBLAS with f32 accumulation, the tensor cores' mode).
//
// Handles: one cuBLAS handle per (thread, device, stream), created on first use and bound to that
// stream for good, so a handle's workspace is only ever used in one stream's order. Handles of an
// exiting thread go to a per-device free list for other threads; none is ever destroyed (teardown
// order against the CUDA context at exit is not ours to control).
#include <cublas_v2.h>

#include <climits>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "core/caching_allocator.h"
#include "core/cuda.h"
#include "kernels/cuda/blas.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/widened.cuh"
#include "kernels/gemm_shape.h"
#include "kernels/kernels.h"

namespace mn::cuda {
namespace {

void check_cublas(cublasStatus_t status, const char* what, const char* file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  cudaGetLastError();
  throw DeviceError(str("cuBLAS error in ", what, " (", file, ":", line, "): ", cublasGetStatusName(status), ": ",
                        cublasGetStatusString(status)));
}
#define MN_CUBLAS_CHECK(expr) ::mn::cuda::check_cublas((expr), #expr, __FILE__, __LINE__)

struct HandlePool {
  std::mutex mutex;
  std::vector<cublasHandle_t> free[kMaxDevicesPerType];
};
HandlePool& handle_pool() {
  static auto* const pool = new HandlePool();  // never destroyed
  return *pool;
}

struct ThreadHandles {
  std::map<std::pair<int, cudaStream_t>, cublasHandle_t> by_stream;
  ~ThreadHandles() {
    HandlePool& pool = handle_pool();
    std::lock_guard<std::mutex> lock(pool.mutex);
    for (const auto& [key, handle] : by_stream) pool.free[key.first].push_back(handle);
  }
};
thread_local ThreadHandles thread_handles;

}  // namespace

// The handle for work on `stream` of `device` (the device is current when this returns).
cublasHandle_t cublas_handle(int device, cudaStream_t stream) {
  auto& handles = thread_handles.by_stream;
  const auto key = std::make_pair(device, stream);
  if (auto it = handles.find(key); it != handles.end()) return it->second;
  cublasHandle_t handle = nullptr;
  {
    HandlePool& pool = handle_pool();
    std::lock_guard<std::mutex> lock(pool.mutex);
    if (!pool.free[device].empty()) {
      handle = pool.free[device].back();
      pool.free[device].pop_back();
    }
  }
  if (handle == nullptr) MN_CUBLAS_CHECK(cublasCreate(&handle));  // on the current device
  // Also resets the handle's workspace to its own default one.
  MN_CUBLAS_CHECK(cublasSetStream(handle, stream));
  handles.emplace(key, handle);
  return handle;
}

}  // namespace mn::cuda

namespace mn::kernels {
namespace {

// One operand in cuBLAS terms: the column-major matrix in memory, whether cuBLAS must transpose it to
// get the transpose of our row-major matrix, its leading dimension and the batch stride.
struct BlasOperand {
  Tensor keep_alive;  // a dense copy when the view could not be read in place
  const void* data = nullptr;  // f32, bf16 or f16 elements
  int64_t rows = 0, cols = 0;  // of our (row-major) matrix
  bool transpose = false;
  int64_t ld = 1;
  int64_t batch_stride = 0;
};

// Our R x C matrix with strides (rs, cs): read column-major it is either its own transpose (cs == 1:
// CUBLAS_OP_N, ld = rs) or itself (rs == 1: CUBLAS_OP_T, ld = cs). A dimension of size 1 may have any
// stride. Returns false when neither holds.
bool blas_layout(int64_t rows, int64_t cols, int64_t rs, int64_t cs, bool& transpose, int64_t& ld) {
  const int64_t r1 = rows > 1 ? rows : 1, c1 = cols > 1 ? cols : 1;
  if ((cs == 1 || cols <= 1) && (rows <= 1 || rs >= c1)) {
    transpose = false;
    ld = rows <= 1 ? c1 : rs;
    return true;
  }
  if ((rs == 1 || rows <= 1) && (cols <= 1 || cs >= r1)) {
    transpose = true;
    ld = cols <= 1 ? r1 : cs;
    return true;
  }
  return false;
}

// t has passed check_gemm.
BlasOperand blas_operand(const Tensor& t) {
  const int d = t.dim();
  BlasOperand op;
  op.rows = t.size(d - 2);
  op.cols = t.size(d - 1);
  op.batch_stride = (d == 3 && t.size(0) != 1) ? t.stride(0) : 0;
  Tensor src = t;
  if (!blas_layout(op.rows, op.cols, t.stride(d - 2), t.stride(d - 1), op.transpose, op.ld)) {
    const bool broadcast = op.batch_stride == 0;
    const Shape sizes = broadcast ? Shape{op.rows, op.cols} : Shape{t.size(0), op.rows, op.cols};
    const Shape strides = broadcast ? Shape{t.stride(d - 2), t.stride(d - 1)} : t.strides();
    const Tensor view = make_view(t.storage(), sizes, strides, t.storage_offset(), t.dtype());
    src = empty(sizes, TensorOptions(t.dtype()).with_device(t.device()));
    copy(t.device(), view, src);  // on the current stream, ahead of the GEMM
    op.keep_alive = src;
    op.batch_stride = broadcast ? 0 : op.rows * op.cols;
    blas_layout(op.rows, op.cols, op.cols, 1, op.transpose, op.ld);
  }
  op.data = src.raw_data();
  return op;
}

__global__ void scale_kernel(float* out, float beta, int64_t n) {
  MN_CUDA_KERNEL_LOOP(i, n)
    out[i] *= beta;
}

void check_int(int64_t v, const char* what) {
  MN_CHECK(v <= INT_MAX, ValueError, "gemm: ", what, " = ", v, " exceeds what cuBLAS takes (2^31 - 1)");
}

cudaDataType_t blas_type(DType t) {
  switch (t) {
    case DType::bf16: return CUDA_R_16BF;
    case DType::f16: return CUDA_R_16F;
    case DType::f32: break;
    case DType::i64: throw TypeError("gemm: i64 operands are not supported");
  }
  return CUDA_R_32F;
}

void gemm_cuda(const Tensor& a, const Tensor& b, Tensor& out, double alpha, double beta) {
  // Registered as taking 16-bit tensors: one dtype for all three runs natively below (bf16/f16 inputs
  // and output, f32 accumulation on the tensor cores); a mix, or an empty sum on 16-bit data, runs in
  // f32 on widened copies like any other kernel (kernels/dispatch.h).
  const DType dtype = out.dtype();
  const bool uniform = a.dtype() == dtype && b.dtype() == dtype;
  if (is_reduced_precision(dtype) || is_reduced_precision(a.dtype()) || is_reduced_precision(b.dtype())) {
    if (!uniform || a.size(-1) == 0) return lowp::call_widened(gemm_cuda, a, b, out, alpha, beta);
  }
  const int device = out.device().index;
  cuda::check_on_device("gemm", out, device, "out");
  cuda::check_on_device("gemm", a, device, "a");
  cuda::check_on_device("gemm", b, device, "b");
  const auto [batch, m, k, n] = check_gemm(a, b, out);
  const BlasOperand lhs = blas_operand(a), rhs = blas_operand(b);
  if (m == 0 || n == 0 || batch == 0) return;

  cudaStream_t stream = cuda::stream_of(out);
  void* c = out.raw_data();
  const float fa = static_cast<float>(alpha), fb = static_cast<float>(beta);
  if (k == 0) {  // an empty sum: out = beta * out (never read when beta == 0)
    if (fb == 0.0f) {
      MN_CUDA_CHECK(cudaMemsetAsync(c, 0, out.nbytes(), stream));
    } else if (fb != 1.0f) {
      scale_kernel<<<cuda::blocks_for(out.numel()), cuda::kThreads, 0, stream>>>(static_cast<float*>(c), fb,
                                                                                  out.numel());
      MN_CUDA_CHECK_LAUNCH();
    }
    return;
  }
  for (int64_t v : {m, n, k, lhs.ld, rhs.ld, batch}) check_int(v, "a dimension");

  cublasHandle_t handle = cuda::cublas_handle(device, stream);
  // f32 operands use TF32 tensor cores only when allowed; 16-bit operands always accumulate in f32.
  const cublasComputeType_t compute =
      dtype == DType::f32 && cuda::allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  const cudaDataType_t type = blas_type(dtype);
  // Column-major C^T (n x m, ldc = n) = op(B) (n x k) * op(A) (k x m).
  const cublasOperation_t op_b = rhs.transpose ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_a = lhs.transpose ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int in = static_cast<int>(n), im = static_cast<int>(m), ik = static_cast<int>(k);
  if (batch == 1) {
    MN_CUBLAS_CHECK(cublasGemmEx(handle, op_b, op_a, in, im, ik, &fa, rhs.data, type, static_cast<int>(rhs.ld),
                                 lhs.data, type, static_cast<int>(lhs.ld), &fb, c, type, in, compute,
                                 CUBLAS_GEMM_DEFAULT));
    return;
  }
  MN_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      handle, op_b, op_a, in, im, ik, &fa, rhs.data, type, static_cast<int>(rhs.ld), rhs.batch_stride,
      lhs.data, type, static_cast<int>(lhs.ld), lhs.batch_stride, &fb, c, type, in, m * n,
      static_cast<int>(batch), compute, CUBLAS_GEMM_DEFAULT));
}

}  // namespace

void register_cuda_gemm() { gemm.set(DeviceType::CUDA, &gemm_cuda, /*reduced_precision=*/true); }

}  // namespace mn::kernels
