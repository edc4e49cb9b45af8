#pragma once
// The CUDA runtime as users see it: streams (the current stream per device, a scoped guard, a pool of
// side streams), cross-stream ordering, record_stream for the caching allocator, device
// synchronisation, device memory figures and the TF32 switch of the cuBLAS GEMM. The header needs no
// CUDA headers, so code that is built with or without CUDA includes it alike; without CUDA every call
// that needs a device throws DeviceError (kernels/cuda/runtime.cu has the CUDA side, core/cuda_stub.cpp
// the other one; the current stream's key is core's, core/current_stream.cpp).
//
// Streams. Every kernel of device d runs on d's *current stream*, which is per thread and per device.
// By default it is the device's legacy default stream (StreamId 0, PyTorch's default too, and what
// dist/nccl_process_group.cpp orders its NCCL stream against). Side streams come from a fixed pool per
// device (never destroyed, so a StreamId is never reused while the allocator may still remember it).
// Memory allocated while stream s is current belongs to s: it is reused only by work on s, unless
// record_stream(tensor, other) tells the allocator that `other` uses it too (then a freed block waits
// for an event on `other` before it is handed out again).
#include <cstddef>
#include <cstdint>

#include "core/allocator.h"
#include "core/device.h"

namespace mn {
class Tensor;
}

namespace mn::cuda {

// A CUDA stream of one device: a value type (device index + the cudaStream_t as an integer).
class Stream {
 public:
  Stream() = default;  // the legacy default stream of device 0
  Stream(int device, StreamId id) : device_(device), id_(id) {}

  int device_index() const { return device_; }
  Device device() const { return cuda_device(device_); }
  StreamId id() const { return id_; }            // the allocator's stream key
  void* handle() const { return reinterpret_cast<void*>(static_cast<uintptr_t>(id_)); }  // a cudaStream_t
  bool is_default() const { return id_ == 0; }

  // Blocks the host until all work queued on this stream so far has finished.
  void synchronize() const;
  // True when all work queued on this stream so far has finished (does not block).
  bool query() const;
  // Work queued on this stream from now on starts only after the work queued on `other` so far (an
  // event recorded on `other` and waited on here; the host does not block). Streams of two devices
  // may be ordered this way too.
  void wait(const Stream& other) const;

  friend bool operator==(const Stream& a, const Stream& b) { return a.device_ == b.device_ && a.id_ == b.id_; }
  friend bool operator!=(const Stream& a, const Stream& b) { return !(a == b); }

 private:
  int device_ = 0;
  StreamId id_ = 0;
};

// Number of side streams per device handed out round-robin by new_stream.
inline constexpr int kStreamPoolSize = 32;

// The legacy default stream of a device.
Stream default_stream(int device = 0);
// A side stream of the device's pool (non-blocking: no implicit ordering against the default stream;
// order it with Stream::wait). Pools are created on first use; after kStreamPoolSize calls streams
// repeat.
Stream new_stream(int device = 0);
// The calling thread's current stream of `device` (the default stream until set).
Stream get_current_stream(int device = 0);
// Makes `s` the calling thread's current stream of its device.
void set_current_stream(const Stream& s);

// Makes `s` current on its device for a scope, restoring the previous current stream of that device
// (and the previously current CUDA device) afterwards.
class StreamGuard {
 public:
  explicit StreamGuard(const Stream& s);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Stream previous_;
  int previous_device_ = -1;
};

// The allocator key of the calling thread's current stream of `device` (what Storage allocates on).
// Kept by core (core/current_stream.cpp); 0 in a build without CUDA.
StreamId current_stream_id(int device);
namespace detail {
// Makes `id` the calling thread's current stream key of `device`: what set_current_stream and
// StreamGuard in the CUDA runtime (kernels/cuda/runtime.cu) call.
void set_current_stream_id(int device, StreamId id);
}  // namespace detail

// Tells the caching allocator that `t`'s memory is used by work on `s`: when the storage is freed, the
// block is not reused until the work queued on `s` up to that moment has finished. A no-op for CPU
// tensors and for the stream the memory was allocated on.
void record_stream(const Tensor& t, const Stream& s);

// Blocks until all work on every stream of `device` has finished (cudaDeviceSynchronize).
void synchronize(int device = 0);

// The device's memory as the driver sees it (cudaMemGetInfo).
struct MemoryInfo {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
};
MemoryInfo memory_info(int device = 0);

// cuBLAS f32 GEMMs may use TF32 tensor cores (about 10 bits of mantissa in the products) when
// allowed. Off by default: products then match the CPU kernel to float rounding. Process-wide.
void set_allow_tf32(bool allow);
bool allow_tf32();

}  // namespace mn::cuda
