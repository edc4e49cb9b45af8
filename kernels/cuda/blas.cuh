#pragma once
// cuBLAS access for CUDA kernels that need more than the gemm op (kernels/cuda/gemm.cu). Prefer calling
// kernels::gemm through the op table: it handles row-major operands, transposed views, batches and the
// TF32 switch (cuda::allow_tf32()).
#include <cublas_v2.h>
#include <cuda_runtime.h>

namespace mn::cuda {

// The calling thread's cuBLAS handle for work on `stream` of `device`, bound to that stream (created on
// first use, cached per thread, device and stream, never destroyed). `device` must be current
// (current_stream(device) makes it so).
cublasHandle_t cublas_handle(int device, cudaStream_t stream);

}  // namespace mn::cuda
