// CUDA gather/scatter along one dim: index_select and index_add. Twins of kernels/cpu/index.cpp.
//
// Index validation runs on the device: a check kernel records the lowest position of a bad index
// with an integer atomicMin, and the host reads back that one position (plus, when bad, the offending
// value) before any other work starts; so a bad index throws IndexError without touching memory.
// This costs one stream synchronisation per call.
//
// index_add is deterministic by default: one thread owns one (outer, inner) position and walks the
// indices in order, so repeated indices accumulate in the CPU's order. When that leaves too few threads
// (few positions, many indices: e.g. an embedding gradient [V, D] from many tokens) each (index, inner)
// element is added with atomicAdd instead: f32 results may then differ in the last bits from run to
// run when indices repeat (i64 sums stay exact).
#include <climits>

#include "kernels/cuda/compute_utils.cuh"

namespace mn::cuda {

namespace {

__global__ void check_index_kernel(const int64_t* index, int64_t stride, int64_t n, int64_t limit, bool has_allowed,
                                   int64_t allowed, unsigned long long* first_bad) {
  MN_CUDA_KERNEL_LOOP(j, n) {
    const int64_t v = index[j * stride];
    const bool ok = (v >= 0 && v < limit) || (has_allowed && v == allowed);
    if (!ok) atomicMin(first_bad, static_cast<unsigned long long>(j));
  }
}

}  // namespace

int64_t first_invalid_index(const Tensor& index, int64_t limit, bool has_allowed, int64_t allowed, int64_t* value) {
  const int64_t n = index.numel();
  if (n == 0) return -1;
  const int64_t stride = index.dim() == 0 ? 0 : index.stride(0);
  cudaStream_t stream = stream_of(index);
  Tensor flag = scratch_bytes(sizeof(unsigned long long), index.device());
  auto* first_bad = scratch_ptr<unsigned long long>(flag);
  MN_CUDA_CHECK(cudaMemsetAsync(first_bad, 0xFF, sizeof(unsigned long long), stream));
  const int64_t* p = static_cast<const int64_t*>(index.raw_data());
  check_index_kernel<<<blocks_for(n), kThreads, 0, stream>>>(p, stride, n, limit, has_allowed, allowed, first_bad);
  MN_CUDA_CHECK_LAUNCH();
  unsigned long long host = 0;
  MN_CUDA_CHECK(cudaMemcpyAsync(&host, first_bad, sizeof(host), cudaMemcpyDeviceToHost, stream));
  MN_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (host == ULLONG_MAX) return -1;
  const int64_t pos = static_cast<int64_t>(host);
  int64_t v = 0;
  MN_CUDA_CHECK(cudaMemcpyAsync(&v, p + pos * stride, sizeof(v), cudaMemcpyDeviceToHost, stream));
  MN_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (value != nullptr) *value = v;
  return pos;
}

}  // namespace mn::cuda

namespace mn::kernels {
namespace {

using cuda::kThreads;
using cuda::Strided;

// Threads below which index_add switches to atomics (when there are many more indices than that).
constexpr int64_t kMinOwnerThreads = 16384;

int64_t dim_size(const Tensor& t, int dim) { return t.dim() == 0 ? 1 : t.sizes()[dim]; }
int64_t dim_stride(const Tensor& t, int dim) { return t.dim() == 0 ? 0 : t.stride(dim); }
Strided others(const Tensor& t, int dim) { return t.dim() == 0 ? Strided{} : cuda::strided_without(t, dim); }

void check_indices(const char* op, const Tensor& index, int64_t size, int dim, const Shape& shape) {
  MN_CHECK(index.dtype() == DType::i64 && index.dim() <= 1, TypeError, op, ": expected a 1-D i64 index, got ",
           index.dtype(), index.sizes());
  MN_CHECK(index.device().is_cuda(), ValueError, op,
           ": the index must be on a CUDA device, got ", index.device().str());
  int64_t value = 0;
  const int64_t pos = cuda::first_invalid_index(index, size, false, 0, &value);
  MN_CHECK(pos < 0, IndexError, op, ": index ", value, " (at position ", pos, ") is out of range for dimension ",
           dim, " of size ", size, " (shape ", shape, ")");
}

void check_slices(const char* op, const Tensor& a, const Tensor& b, int dim, int64_t count, const char* a_name,
                  const char* b_name) {
  bool ok = a.dim() == b.dim() && dim_size(b, dim) == count;
  for (int d = 0; ok && d < a.dim(); ++d) ok = d == dim || a.sizes()[d] == b.sizes()[d];
  MN_CHECK(ok, ValueError, op, ": '", b_name, "' of shape ", b.sizes(), " does not match '", a_name, "' of shape ",
           a.sizes(), " with ", count, " indices along dimension ", dim);
  MN_CHECK(a.dtype() == b.dtype(), TypeError, op, ": '", a_name, "' is ", a.dtype(), " but '", b_name, "' is ",
           b.dtype());
}

// The divisions of an index l = (o * count + j) * inner + i over `total` elements [outer, count, inner].
struct SliceIndex {
  cuda::Divider inner, count;
  // o and i as the position o * inner + i of the other dims, and j.
  __device__ void split(int64_t l, int64_t* position, int64_t* j) const {
    int64_t t, i, o;
    inner.divmod(l, &t, &i);
    count.divmod(t, &o, j);
    *position = o * inner.divisor() + i;
  }
};

SliceIndex slice_index(int64_t count, int64_t inner, int64_t total) {
  return {cuda::Divider(inner, total), cuda::Divider(count, total)};
}

// out (contiguous [outer, count, inner]) from in, whose other dims are mapped by `rest`.
template <class T>
__global__ void gather_kernel(const T* in, Strided rest, int64_t in_dim_stride, const int64_t* idx,
                              int64_t idx_stride, SliceIndex slices, int64_t total, T* out) {
  MN_CUDA_KERNEL_LOOP(l, total) {
    int64_t p, j;
    slices.split(l, &p, &j);
    out[l] = in[rest.offset(p) + idx[j * idx_stride] * in_dim_stride];
  }
}

void index_select_cuda(const Tensor& in, int dim, const Tensor& index, Tensor& out) {
  MN_CHECK(in.device().is_cuda(), DeviceError, "index_select: expected 'input' on a CUDA device, got ", in.device());
  cuda::check_on_device("index_select", index, in.device().index, "index");
  cuda::check_on_device("index_select", out, in.device().index, "out");
  MN_CHECK(dim >= 0 && dim < std::max(in.dim(), 1), IndexError, "index_select: dim ", dim,
           " is out of range for shape ", in.sizes());
  check_indices("index_select", index, dim_size(in, dim), dim, in.sizes());
  MN_CHECK(out.is_contiguous(), ValueError, "index_select: output 'out' must be contiguous, got shape ", out.sizes(),
           " with strides ", out.strides());
  const int64_t count = index.numel();
  if (in.dim() > 0) check_slices("index_select", in, out, dim, count, "input", "out");
  MN_CHECK(out.dtype() == in.dtype(), TypeError, "index_select: 'out' is ", out.dtype(), " but 'input' is ", in.dtype());
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < in.dim(); ++d) {
    if (d < dim) outer *= in.size(d);
    if (d > dim) inner *= in.size(d);
  }
  MN_CHECK(out.numel() == outer * count * inner, ValueError, "index_select: output of shape ", out.sizes(),
           " cannot hold ", count, " slices of input ", in.sizes(), " along dimension ", dim);
  const int64_t total = out.numel();
  if (total == 0) return;
  const Strided rest = others(in, dim);
  const int64_t* idx = static_cast<const int64_t*>(index.raw_data());
  const int64_t idx_stride = index.dim() == 0 ? 0 : index.stride(0);
  cudaStream_t stream = cuda::stream_of(out);
  if (in.dtype() == DType::f32) {
    gather_kernel<float><<<cuda::blocks_for(total), kThreads, 0, stream>>>(
        static_cast<const float*>(in.raw_data()), rest, dim_stride(in, dim), idx, idx_stride,
        slice_index(count, inner, total), total, static_cast<float*>(out.raw_data()));
  } else {
    gather_kernel<int64_t><<<cuda::blocks_for(total), kThreads, 0, stream>>>(
        static_cast<const int64_t*>(in.raw_data()), rest, dim_stride(in, dim), idx, idx_stride,
        slice_index(count, inner, total), total, static_cast<int64_t*>(out.raw_data()));
  }
  MN_CUDA_CHECK_LAUNCH();
}

// Deterministic: thread per (outer, inner) position, indices in order.
template <class T>
__global__ void scatter_owner_kernel(T* out, Strided out_rest, int64_t out_dim_stride, const T* src, Strided src_rest,
                                     int64_t src_dim_stride, const int64_t* idx, int64_t idx_stride, int64_t count,
                                     int64_t positions) {
  MN_CUDA_KERNEL_LOOP(p, positions) {
    T* to = out + out_rest.offset(p);
    const T* from = src + src_rest.offset(p);
    for (int64_t j = 0; j < count; ++j) to[idx[j * idx_stride] * out_dim_stride] += from[j * src_dim_stride];
  }
}

__device__ inline void atomic_add(float* p, float v) { atomicAdd(p, v); }
__device__ inline void atomic_add(int64_t* p, int64_t v) {
  atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
}

// Atomic: thread per src element.
template <class T>
__global__ void scatter_atomic_kernel(T* out, Strided out_rest, int64_t out_dim_stride, const T* src,
                                      Strided src_rest, int64_t src_dim_stride, const int64_t* idx,
                                      int64_t idx_stride, SliceIndex slices, int64_t total) {
  MN_CUDA_KERNEL_LOOP(l, total) {
    int64_t p, j;
    slices.split(l, &p, &j);
    atomic_add(out + out_rest.offset(p) + idx[j * idx_stride] * out_dim_stride,
               src[src_rest.offset(p) + j * src_dim_stride]);
  }
}

template <class T>
void scatter_add(Tensor& out, int dim, const Tensor& index, const Tensor& src, int64_t outer, int64_t inner) {
  const int64_t count = index.numel();
  const int64_t positions = outer * inner;
  const Strided out_rest = others(out, dim), src_rest = others(src, dim);
  const int64_t* idx = static_cast<const int64_t*>(index.raw_data());
  const int64_t idx_stride = index.dim() == 0 ? 0 : index.stride(0);
  T* o = static_cast<T*>(out.raw_data());
  const T* s = static_cast<const T*>(src.raw_data());
  cudaStream_t stream = cuda::stream_of(out);
  if (positions >= kMinOwnerThreads || count <= 64) {
    scatter_owner_kernel<T><<<cuda::blocks_for(positions), kThreads, 0, stream>>>(
        o, out_rest, dim_stride(out, dim), s, src_rest, dim_stride(src, dim), idx, idx_stride, count, positions);
  } else {
    const int64_t total = positions * count;
    scatter_atomic_kernel<T><<<cuda::blocks_for(total), kThreads, 0, stream>>>(
        o, out_rest, dim_stride(out, dim), s, src_rest, dim_stride(src, dim), idx, idx_stride,
        slice_index(count, inner, total), total);
  }
  MN_CUDA_CHECK_LAUNCH();
}

void index_add_cuda(Tensor& out, int dim, const Tensor& index, const Tensor& src) {
  MN_CHECK(dim >= 0 && dim < std::max(out.dim(), 1), IndexError, "index_add: dim ", dim,
           " is out of range for shape ", out.sizes());
  check_indices("index_add", index, dim_size(out, dim), dim, out.sizes());
  const int64_t count = index.numel();
  if (out.dim() > 0) check_slices("index_add", out, src, dim, count, "out", "src");
  if (src.numel() == 0) return;
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < out.dim(); ++d) {
    if (d < dim) outer *= out.size(d);
    if (d > dim) inner *= out.size(d);
  }
  MN_CHECK(src.numel() == outer * count * inner, ValueError, "index_add: src of shape ", src.sizes(),
           " does not hold ", count, " slices of out ", out.sizes(), " along dimension ", dim);
  if (out.dtype() == DType::f32) return scatter_add<float>(out, dim, index, src, outer, inner);
  scatter_add<int64_t>(out, dim, index, src, outer, inner);
}

}  // namespace

void register_cuda_index() {
  index_select.set(DeviceType::CUDA, index_select_cuda);
  index_add.set(DeviceType::CUDA, index_add_cuda);
}

}  // namespace mn::kernels
