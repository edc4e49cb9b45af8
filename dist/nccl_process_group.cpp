// NCCL process group; compiles to nothing without MN_WITH_CUDA (see nccl_process_group.h).
#include "dist/nccl_process_group.h"

#ifdef MN_WITH_CUDA

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "core/allocator.h"
#include "core/capture.h"
#include "core/cuda.h"
#include "core/error.h"

namespace mn::dist {

namespace {

void cuda_check(cudaError_t status, const char* what) {
  MN_CHECK(status == cudaSuccess, RuntimeError, "CUDA ", what, " failed: ", cudaGetErrorString(status));
}

void nccl_check(ncclResult_t status, const char* what) {
  MN_CHECK(status == ncclSuccess, RuntimeError, "NCCL ", what, " failed: ", ncclGetErrorString(status),
           " (NCCL_DEBUG=INFO in the environment shows why)");
}

ncclDataType_t nccl_type(DType dtype) { return dtype == DType::f32 ? ncclFloat32 : ncclInt64; }

std::string seconds_text(Milliseconds ms) { return str(static_cast<double>(ms.count()) / 1000.0, " s"); }

// The stream the library's kernels on `device` run on: the calling thread's current stream (core/cuda.h;
// the legacy default stream unless a StreamGuard or set_current_stream changed it).
cudaStream_t compute_stream(int device) {
  return static_cast<cudaStream_t>(cuda::get_current_stream(device).handle());
}

// cudaErrorNotReady is an answer, not a failure, but the runtime also leaves it in the thread's
// last-error slot, where the next MN_CUDA_CHECK_LAUNCH (cudaGetLastError) would report it.
cudaError_t query_event(cudaEvent_t event) {
  const cudaError_t status = cudaEventQuery(event);
  if (status == cudaErrorNotReady) cudaGetLastError();
  return status;
}

// The communicator, shared by the group and its Work objects. ncclCommAbort frees the communicator:
// after it nobody may touch `comm` again, and every later collective fails with the first error.
struct CommState {
  std::mutex mutex;
  ncclComm_t comm = nullptr;
  std::string error;     // set once: why the communicator is gone (aborted, or the group destroyed)
  bool aborted = false;  // by a failure: collectives still in flight ended early

  void abort(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!error.empty()) return;
    error = reason;
    aborted = true;
    if (comm != nullptr) ncclCommAbort(comm);  // unblocks the stream
    comm = nullptr;
  }
  // ncclSuccess, or the asynchronous error of a communicator that is still alive.
  ncclResult_t async_error() {
    std::lock_guard<std::mutex> lock(mutex);
    ncclResult_t result = ncclSuccess;
    if (comm != nullptr) ncclCommGetAsyncError(comm, &result);
    return result == ncclInProgress ? ncclSuccess : result;
  }
  // Empty unless an abort may have cut collectives short.
  std::string abort_reason() {
    std::lock_guard<std::mutex> lock(mutex);
    return aborted ? error : std::string();
  }
  // Enqueues a collective, collective(comm) -> ncclResult_t, while no abort can free the communicator;
  // a RuntimeError once it is gone.
  template <class F>
  ncclResult_t enqueue(const char* what, F&& collective) {
    std::lock_guard<std::mutex> lock(mutex);
    MN_CHECK(error.empty(), RuntimeError, "NCCL ", what, " on a broken process group (", error, ")");
    return collective(comm);
  }
};

// Sets the group's device for the scope of one call and restores the caller's.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) cuda_check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<CommState> comm, int device, cudaEvent_t done, Milliseconds timeout, std::string what,
           std::vector<Tensor> keep_alive)
      : comm_(std::move(comm)),
        device_(device),
        done_(done),
        timeout_(timeout),
        what_(std::move(what)),
        keep_alive_(std::move(keep_alive)) {}
  ~NcclWork() override {
    if (done_) cudaEventDestroy(done_);
  }

  bool is_completed() override { return done_ == nullptr || query_event(done_) != cudaErrorNotReady; }

  void wait() override {
    if (done_ == nullptr) return;
    DeviceGuard guard(device_);
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (true) {
      const cudaError_t state = query_event(done_);
      if (state == cudaSuccess) break;
      MN_CHECK(state == cudaErrorNotReady, RuntimeError, "NCCL ", what_, " failed: ", cudaGetErrorString(state));
      const ncclResult_t async_error = comm_->async_error();
      if (async_error != ncclSuccess) {
        const std::string reason =
            str("NCCL ", what_, " failed: ", ncclGetErrorString(async_error), "; a peer rank may have exited");
        comm_->abort(reason);  // unblocks the stream; the group is unusable afterwards
        throw RuntimeError(reason);
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        const std::string reason = str("NCCL ", what_, " did not finish within ", seconds_text(timeout_),
                                       "; a peer rank may have exited or stopped calling collectives");
        comm_->abort(reason);
        throw RuntimeError(reason);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    // An abort (another Work's failure) also completes the stream: the result may be partial.
    const std::string aborted = comm_->abort_reason();
    MN_CHECK(aborted.empty(), RuntimeError, "NCCL ", what_, " cannot be trusted: the process group was aborted (",
             aborted, ")");
    // Later work on the compute stream must see the result (already true after the host wait, but it
    // keeps the ordering explicit should the host wait become a stream wait).
    cuda_check(cudaStreamWaitEvent(compute_stream(device_), done_, 0), "cudaStreamWaitEvent");
    keep_alive_.clear();
  }

 private:
  std::shared_ptr<CommState> comm_;
  int device_;
  cudaEvent_t done_;
  Milliseconds timeout_;
  std::string what_;
  std::vector<Tensor> keep_alive_;
};

}  // namespace

struct NcclProcessGroup::Impl {
  ProcessGroupOptions options;
  int device = 0;
  std::shared_ptr<CommState> comm = std::make_shared<CommState>();
  cudaStream_t stream = nullptr;
  float* barrier_buffer = nullptr;

  // Orders the NCCL stream after everything queued so far on the compute stream.
  void wait_for_compute_stream() {
    cudaEvent_t ready = nullptr;
    cuda_check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
    cuda_check(cudaEventRecord(ready, compute_stream(device)), "cudaEventRecord");
    cuda_check(cudaStreamWaitEvent(stream, ready, 0), "cudaStreamWaitEvent");
    cudaEventDestroy(ready);  // safe: destruction is deferred until the event completes
  }

  // The memory must not be reused until the NCCL stream is done with it.
  void record_on_stream(const Tensor& t) {
    t.storage()->record_stream(reinterpret_cast<StreamId>(stream));
  }

  WorkPtr finish(std::string what, std::vector<Tensor> tensors) {
    for (const Tensor& t : tensors) record_on_stream(t);
    cudaEvent_t done = nullptr;
    cuda_check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
    cuda_check(cudaEventRecord(done, stream), "cudaEventRecord");
    return std::make_shared<NcclWork>(comm, device, done, options.timeout, std::move(what), std::move(tensors));
  }

  WorkPtr completed() {
    return std::make_shared<NcclWork>(comm, device, nullptr, options.timeout, "", std::vector<Tensor>{});
  }
};

NcclProcessGroup::NcclProcessGroup(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options)
    : ProcessGroup(rank, size), impl_(std::make_unique<Impl>()) {
  MN_CHECK(store != nullptr, ValueError, "NcclProcessGroup needs a store, got null");
  MN_CHECK(size >= 1, ValueError, "process group size must be at least 1, got ", size);
  MN_CHECK(rank >= 0 && rank < size, ValueError, "rank must be in [0, ", size - 1, "], got ", rank);
  impl_->options = std::move(options);
  impl_->device = impl_->options.device_index;
  const int devices = cuda_device_count();
  MN_CHECK(impl_->device >= 0 && impl_->device < devices, DeviceError, "the nccl backend needs CUDA device ",
           impl_->device, " for rank ", rank, " but ", devices, " device(s) are visible");

  // The unique id travels through the store under a per-group key (the rank's count of NCCL groups made
  // over this store, equal on all ranks), so several groups never collide.
  const std::string key = str("nccl/", store->add(str("nccl/groups_created_by_rank_", rank), 1), "/unique_id");
  ncclUniqueId id;
  if (rank == 0) {
    nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    store->set(key,
               Bytes(reinterpret_cast<const uint8_t*>(&id), reinterpret_cast<const uint8_t*>(&id) + sizeof(id)));
  } else {
    Bytes value = store->get(key);
    MN_CHECK(value.size() == sizeof(id), RuntimeError, "store key '", key, "' holds ", value.size(),
             " bytes; an NCCL unique id has ", sizeof(id), " (are all ranks running the same build?)");
    std::memcpy(&id, value.data(), sizeof(id));
  }

  DeviceGuard guard(impl_->device);
  nccl_check(ncclCommInitRank(&impl_->comm->comm, size, id, rank), "ncclCommInitRank");
  cuda_check(cudaStreamCreateWithFlags(&impl_->stream, cudaStreamNonBlocking), "cudaStreamCreate");
  cuda_check(cudaMalloc(reinterpret_cast<void**>(&impl_->barrier_buffer), sizeof(float)), "cudaMalloc");
}

NcclProcessGroup::~NcclProcessGroup() {
  if (!impl_) return;
  DeviceGuard guard(impl_->device);
  CommState& state = *impl_->comm;
  // A collective that can never finish (a peer died, nobody waited) must not hang the destructor.
  const auto deadline = std::chrono::steady_clock::now() + impl_->options.timeout;
  while (impl_->stream && cudaStreamQuery(impl_->stream) == cudaErrorNotReady) {
    cudaGetLastError();
    if (state.async_error() != ncclSuccess || std::chrono::steady_clock::now() >= deadline) {
      state.abort("the process group was destroyed with a collective that could not finish");
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  if (impl_->stream) cudaStreamSynchronize(impl_->stream);
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    if (state.comm) ncclCommDestroy(state.comm);  // not after ncclCommAbort: that freed it already
    state.comm = nullptr;
    if (state.error.empty()) state.error = "the process group was destroyed";
  }
  // The stream is not destroyed: tensors recorded on it (record_stream) may outlive the group, and the
  // caching allocator records an event on it when they are freed (core/cuda.h: stream ids are never
  // reused while the allocator may remember them).
  if (impl_->barrier_buffer) cudaFree(impl_->barrier_buffer);
}

int NcclProcessGroup::device_index() const { return impl_->device; }

WorkPtr NcclProcessGroup::allreduce(const Tensor& tensor, ReduceOp op) {
  check_collective_tensor(tensor, "allreduce", backend());
  MN_CHECK(tensor.device().index == impl_->device, DeviceError, "allreduce got a tensor on ", tensor.device(),
           " but this rank's NCCL group runs on cuda:", impl_->device);
  MN_CHECK(op != ReduceOp::Avg || tensor.dtype() == DType::f32, TypeError,
           "allreduce with ReduceOp::Avg needs an f32 tensor, got ", dtype_name(tensor.dtype()));
  if (tensor.numel() == 0) return impl_->completed();
  DeviceGuard guard(impl_->device);
  tensor.bump_version();
  impl_->wait_for_compute_stream();
  void* data = tensor.raw_data();
  nccl_check(impl_->comm->enqueue("allreduce",
                                   [&](ncclComm_t comm) {
                                     return ncclAllReduce(data, data, static_cast<size_t>(tensor.numel()),
                                                          nccl_type(tensor.dtype()),
                                                          op == ReduceOp::Sum ? ncclSum : ncclAvg, comm, impl_->stream);
                                   }),
             "ncclAllReduce");
  return impl_->finish(str("allreduce of ", tensor.numel(), " elements on rank ", rank(), " of ", size()),
                       {tensor});
}

WorkPtr NcclProcessGroup::broadcast(const Tensor& tensor, int root) {
  check_collective_tensor(tensor, "broadcast", backend());
  MN_CHECK(tensor.device().index == impl_->device, DeviceError, "broadcast got a tensor on ", tensor.device(),
           " but this rank's NCCL group runs on cuda:", impl_->device);
  MN_CHECK(root >= 0 && root < size(), ValueError, "broadcast root must be in [0, ", size() - 1, "], got ", root);
  if (tensor.numel() == 0) return impl_->completed();
  DeviceGuard guard(impl_->device);
  tensor.bump_version();
  impl_->wait_for_compute_stream();
  void* data = tensor.raw_data();
  nccl_check(impl_->comm->enqueue("broadcast",
                                   [&](ncclComm_t comm) {
                                     return ncclBroadcast(data, data, static_cast<size_t>(tensor.numel()),
                                                          nccl_type(tensor.dtype()), root, comm, impl_->stream);
                                   }),
             "ncclBroadcast");
  return impl_->finish(str("broadcast of ", tensor.numel(), " elements from rank ", root), {tensor});
}

WorkPtr NcclProcessGroup::allgather(const Tensor& input, const Tensor& output) {
  check_collective_tensor(input, "allgather (input)", backend());
  check_collective_tensor(output, "allgather (output)", backend());
  MN_CHECK(input.device().index == impl_->device && output.device().index == impl_->device, DeviceError,
           "allgather tensors must be on cuda:", impl_->device, ", got ", input.device(), " and ", output.device());
  MN_CHECK(output.dtype() == input.dtype(), TypeError, "allgather output must have the input's dtype ",
           dtype_name(input.dtype()), ", got ", dtype_name(output.dtype()));
  MN_CHECK(output.numel() == input.numel() * size(), ValueError,
           "allgather output must hold size() * input.numel() = ", input.numel() * size(), " elements, got ",
           output.numel());
  if (input.numel() == 0) return impl_->completed();
  DeviceGuard guard(impl_->device);
  output.bump_version();
  impl_->wait_for_compute_stream();
  nccl_check(impl_->comm->enqueue("allgather",
                                   [&](ncclComm_t comm) {
                                     return ncclAllGather(input.raw_data(), output.raw_data(),
                                                          static_cast<size_t>(input.numel()), nccl_type(input.dtype()),
                                                          comm, impl_->stream);
                                   }),
             "ncclAllGather");
  return impl_->finish(str("allgather of ", input.numel(), " elements on rank ", rank(), " of ", size()),
                       {input, output});
}

WorkPtr NcclProcessGroup::barrier() {
  capture::unsupported(str("a ", backend(), " barrier of a process group"));
  DeviceGuard guard(impl_->device);
  impl_->wait_for_compute_stream();
  nccl_check(impl_->comm->enqueue("barrier",
                                   [&](ncclComm_t comm) {
                                     return ncclAllReduce(impl_->barrier_buffer, impl_->barrier_buffer, 1,
                                                          ncclFloat32, ncclSum, comm, impl_->stream);
                                   }),
             "ncclAllReduce (barrier)");
  WorkPtr work = impl_->finish(str("barrier on rank ", rank(), " of ", size()), {});
  work->wait();
  return work;
}

}  // namespace mn::dist

#endif  // MN_WITH_CUDA
