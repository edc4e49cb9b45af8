// CUDA copy, fill and Philox random fill.
//
// copy serves every direction that involves a CUDA tensor: device -> device on one device (a
// cudaMemcpyAsync when both sides are dense and of one dtype, else a strided conversion kernel),
// host -> device and device -> host (dense staging on the side that needs it, one cudaMemcpyAsync, then
// a stream synchronise, as PyTorch's blocking copy does: the host may reuse or read its buffer as soon
// as copy returns), and device -> device across devices (cudaMemcpyPeerAsync). src may be any strided
// or expanded view; dst any non-overlapping view; conversions between f32, i64, bf16 and f16 are
// kernels::convert_element, as on the CPU.
//
// random_fill computes the very values of the CPU fill (core/philox.h): one thread per counter block
// of four values.
#include <cmath>
#include <type_traits>

#include "core/random.h"
#include "kernels/cuda/compute_utils.cuh"
#include "kernels/kernels.h"

namespace mn::kernels {
namespace {

using cuda::blocks_for;
using cuda::kThreads;
using cuda::Strided;

// ---- device kernels ----

template <class S, class D>
__global__ void convert_dense_kernel(const S* __restrict__ src, D* __restrict__ dst, int64_t n) {
  MN_CUDA_KERNEL_LOOP(i, n)
    dst[i] = convert_element<D>(src[i]);
}

template <class S, class D>
__global__ void copy_strided_kernel(const S* src, Strided src_layout, D* dst, Strided dst_layout, int64_t n) {
  MN_CUDA_KERNEL_LOOP(i, n)
    dst[dst_layout.offset(i)] = convert_element<D>(src[src_layout.offset(i)]);
}

template <class T>
__global__ void fill_dense_kernel(T* out, T value, int64_t n) {
  MN_CUDA_KERNEL_LOOP(i, n)
    out[i] = value;
}

template <class T>
__global__ void fill_strided_kernel(T* out, Strided layout, T value, int64_t n) {
  MN_CUDA_KERNEL_LOOP(i, n)
    out[layout.offset(i)] = value;
}

// Thread b writes the values of counter block st.offset + b: elements 4b .. 4b+3 (fewer at the end).
template <class T>
__global__ void philox_kernel(T* out, int64_t n, PhiloxState st, Distribution dist, double p1, double p2) {
  const int64_t blocks = (n + 3) / 4;
  MN_CUDA_KERNEL_LOOP(b, blocks) {
    T values[4];
    const uint64_t block = st.offset + static_cast<uint64_t>(b);
    if constexpr (std::is_same_v<T, float>)
      philox_block_floats(st.seed, st.stream, block, dist, p1, p2, values);
    else
      philox_block_int64(st.seed, st.stream, block, dist, p1, p2, values);
    const int64_t base = 4 * b;
    const int64_t count = n - base < 4 ? n - base : 4;
    for (int64_t lane = 0; lane < count; ++lane) out[base + lane] = values[lane];
  }
}

// ---- launch helpers ----

template <class S, class D>
void launch_convert(const Tensor& src, Tensor& dst, bool dense, cudaStream_t stream) {
  const int64_t n = dst.numel();
  const S* s = static_cast<const S*>(src.raw_data());
  D* d = static_cast<D*>(dst.raw_data());
  if (dense) {
    convert_dense_kernel<S, D><<<blocks_for(n), kThreads, 0, stream>>>(s, d, n);
  } else {
    copy_strided_kernel<S, D><<<blocks_for(n), kThreads, 0, stream>>>(s, cuda::collapsed(src), d, cuda::collapsed(dst),
                                                                      n);
  }
  MN_CUDA_CHECK_LAUNCH();
}

// src and dst on one CUDA device; runs on that device's current stream.
void copy_on_device(const Tensor& src, Tensor& dst) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  cudaStream_t stream = cuda::stream_of(dst);
  const bool dense = src.is_contiguous() && dst.is_contiguous();
  if (dense && src.dtype() == dst.dtype()) {
    if (src.raw_data() != dst.raw_data())
      MN_CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), src.raw_data(), dst.nbytes(), cudaMemcpyDeviceToDevice, stream));
    return;
  }
  visit_dtype(src.dtype(), [&](auto src_tag) {
    visit_dtype(dst.dtype(), [&](auto dst_tag) {
      launch_convert<decltype(src_tag), decltype(dst_tag)>(src, dst, dense, stream);
    });
  });
}

// A dense tensor with src's values in `dtype` on src's device (src itself when it already is one).
Tensor dense_as(const Tensor& src, DType dtype) {
  if (src.is_contiguous() && src.dtype() == dtype) return src;
  Tensor out = empty(src.sizes(), TensorOptions(dtype).with_device(src.device()));
  if (src.device().is_cpu())
    kernels::copy(kCPU, src, out);
  else
    copy_on_device(src, out);
  return out;
}

void host_to_device(const Tensor& src, Tensor& dst) {
  const Tensor host = dense_as(src, dst.dtype());
  Tensor target = dst.is_contiguous() ? dst : empty(dst.sizes(), dst.options());
  cudaStream_t stream = cuda::stream_of(dst);
  MN_CUDA_CHECK(cudaMemcpyAsync(target.raw_data(), host.raw_data(), dst.nbytes(), cudaMemcpyHostToDevice, stream));
  MN_CUDA_CHECK(cudaStreamSynchronize(stream));  // `host` may be a temporary, and the caller reuses src
  if (!target.same(dst)) copy_on_device(target, dst);
}

void device_to_host(const Tensor& src, Tensor& dst) {
  const Tensor staged = dense_as(src, dst.dtype());
  Tensor host = dst.is_contiguous() ? dst : empty(dst.sizes(), TensorOptions(dst.dtype()));
  cudaStream_t stream = cuda::stream_of(src);
  MN_CUDA_CHECK(cudaMemcpyAsync(host.raw_data(), staged.raw_data(), dst.nbytes(), cudaMemcpyDeviceToHost, stream));
  MN_CUDA_CHECK(cudaStreamSynchronize(stream));  // the host reads the values as soon as copy returns
  if (!host.same(dst)) kernels::copy(kCPU, host, dst);
}

void device_to_device(const Tensor& src, Tensor& dst) {
  const Tensor staged = dense_as(src, dst.dtype());
  // The peer copy runs on dst's stream: everything queued on src's stream so far must be done first.
  MN_CUDA_CHECK(cudaStreamSynchronize(cuda::stream_of(src)));
  Tensor target = dst.is_contiguous() ? dst : empty(dst.sizes(), dst.options());
  cudaStream_t stream = cuda::stream_of(dst);
  MN_CUDA_CHECK(cudaMemcpyPeerAsync(target.raw_data(), dst.device().index, staged.raw_data(), src.device().index,
                                    dst.nbytes(), stream));
  // `staged` belongs to src's device and stream and may be freed when this returns.
  MN_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (!target.same(dst)) copy_on_device(target, dst);
}

// ---- kernels of the op table ----

void copy_cuda(const Tensor& src, Tensor& dst) {
  MN_CHECK(src.sizes() == dst.sizes(), ValueError, "copy: expected source and destination of one shape, got ",
           src.sizes(), " and ", dst.sizes());
  if (dst.numel() == 0) return;
  const Device from = src.device(), to = dst.device();
  if (from.is_cuda() && to.is_cuda()) {
    if (from == to) return copy_on_device(src, dst);
    return device_to_device(src, dst);
  }
  if (to.is_cuda()) return host_to_device(src, dst);
  if (from.is_cuda()) return device_to_host(src, dst);
  kernels::copy(kCPU, src, dst);
}

void fill_cuda(Tensor& out, double value) {
  cuda::check_on_device("fill", out, out.device().index, "out");
  const int64_t n = out.numel();
  if (n == 0) return;
  cudaStream_t stream = cuda::stream_of(out);
  const bool dense = out.is_contiguous();
  if (out.dtype() == DType::f32) {
    const float v = static_cast<float>(value);
    if (dense && v == 0.0f && !std::signbit(v)) {
      MN_CUDA_CHECK(cudaMemsetAsync(out.raw_data(), 0, out.nbytes(), stream));
      return;
    }
    float* p = static_cast<float*>(out.raw_data());
    if (dense)
      fill_dense_kernel<float><<<blocks_for(n), kThreads, 0, stream>>>(p, v, n);
    else
      fill_strided_kernel<float><<<blocks_for(n), kThreads, 0, stream>>>(p, cuda::collapsed(out), v, n);
  } else {
    const int64_t v = saturating_i64(value);
    if (dense && v == 0) {
      MN_CUDA_CHECK(cudaMemsetAsync(out.raw_data(), 0, out.nbytes(), stream));
      return;
    }
    int64_t* p = static_cast<int64_t*>(out.raw_data());
    if (dense)
      fill_dense_kernel<int64_t><<<blocks_for(n), kThreads, 0, stream>>>(p, v, n);
    else
      fill_strided_kernel<int64_t><<<blocks_for(n), kThreads, 0, stream>>>(p, cuda::collapsed(out), v, n);
  }
  MN_CUDA_CHECK_LAUNCH();
}

// The parameter checks of the CPU fill (core/random.cpp), so both refuse the same inputs.
constexpr double kMaxAbsNormal = 5.8;
constexpr double kInt64Limit = 9223372036854775808.0;

void random_cuda(Tensor& out, Distribution dist, double p1, double p2, const PhiloxState& state) {
  cuda::check_on_device("random_fill", out, out.device().index, "out");
  MN_CHECK(out.is_contiguous(), ValueError, "random fill expects a contiguous output");
  check_distribution_params(dist, p1, p2);
  const int64_t n = out.numel();
  if (out.dtype() == DType::i64) {
    if (dist == Distribution::Uniform) {
      MN_CHECK(p1 >= -kInt64Limit && p2 <= kInt64Limit, ValueError,
               "int64 uniform: lo and hi must lie in [-2^63, 2^63], got lo = ", p1, ", hi = ", p2);
    } else if (dist == Distribution::Normal) {
      MN_CHECK(std::fabs(p1) + kMaxAbsNormal * p2 < 0.5 * kInt64Limit, ValueError,
               "int64 normal: |mean| + 5.8 * std must be below 2^62, got mean = ", p1, ", std = ", p2);
    }
  }
  if (n == 0) return;
  cudaStream_t stream = cuda::stream_of(out);
  const unsigned grid = blocks_for((n + 3) / 4);
  if (out.dtype() == DType::f32)
    philox_kernel<<<grid, kThreads, 0, stream>>>(static_cast<float*>(out.raw_data()), n, state, dist, p1, p2);
  else
    philox_kernel<<<grid, kThreads, 0, stream>>>(static_cast<int64_t*>(out.raw_data()), n, state, dist, p1, p2);
  MN_CUDA_CHECK_LAUNCH();
}

}  // namespace

void register_cuda_copy() {
  copy.set(DeviceType::CUDA, copy_cuda, /*reduced_precision=*/true);
  fill.set(DeviceType::CUDA, fill_cuda);
  random_fill.set(DeviceType::CUDA, random_cuda);
}

}  // namespace mn::kernels
