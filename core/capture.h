#pragma once
// Capture and replay of a computation: the engine half of mn::compile (nn/compile.h), our
// counterpart of torch.compile and CUDA graphs.
//
// While a Recording is active on a thread, every kernel launched through the op table
// (kernels/dispatch.h) runs as usual and is also appended to the recording's Graph, with its tensor
// arguments bound to the same memory. Replaying the graph runs exactly those kernels again, in the
// same order, on the same memory: no autograd graph is built, no shape is checked, nothing is
// allocated. What the kernels read at replay is whatever the memory holds then, so new inputs are
// copied into the graph's input tensors first.
//
// Memory: tensors created during the recording come from a private caching pool owned by the graph.
// A block freed during the recording is reused by later tensors of the same recording (replay runs in
// the same order, so that is safe) but never by anyone else while the graph lives. Tensors created
// before the recording (parameters, optimizer state) are held by the graph.
//
// What cannot be replayed breaks the recording: reading a tensor's value on the host (item,
// to_vector), releasing cached memory (empty_cache), collectives of a process group called directly
// (host work that must repeat, like the DDP all-reduce, is recorded with host_step). A broken
// recording stops recording and lets the computation finish eagerly; the caller decides whether
// that is an error (fullgraph) or a reason to stay eager. Random tensors draw a fresh Philox range
// from their generator at every replay, exactly as eager calls would. Side effects outside tensors
// (host counters, logging) happen at recording time only.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/host_device.h"
#include "core/random.h"
#include "core/tensor.h"

namespace mn {
class DeviceAllocator;
}

namespace mn::capture {

class Graph {
 public:
  Graph() = default;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  ~Graph();

  // Runs every recorded step in order. Throws what a step throws (a bounds check in an index kernel,
  // a generator destroyed since the recording).
  void replay() const;

  size_t num_steps() const { return steps_.size(); }

  // Gradients of leaves the recording wrote (AccumulateGrad, set_grad). A replay rewrites the same
  // gradient tensors, so it matches a leaf only while the leaf's gradient is what it was before the
  // recording (none, or the same memory, which is then accumulated into).
  bool grads_match() const;
  // After a replay: gives every leaf the gradient tensor the recording left it with.
  void attach_grads() const;
  // Bytes the graph's private pools hold (reserved segments), summed over devices.
  int64_t reserved_bytes() const;
  // Peak of bytes allocated from the pools during the recording.
  int64_t peak_allocated_bytes() const;

 private:
  friend class Recording;
  friend struct Access;
  struct Pool {
    Device device;
    std::shared_ptr<DeviceAllocator> allocator;
  };
  struct LeafGrad {
    std::weak_ptr<TensorImpl> leaf;
    const void* before = nullptr;  // the gradient's memory before the recording (null: none)
    Tensor after;
  };
  std::vector<std::function<void()>> steps_;
  std::vector<Pool> pools_;
  std::vector<LeafGrad> grads_;
};

// Records into `graph` on this thread for the lifetime of the object. Recordings do not nest.
class Recording {
 public:
  explicit Recording(Graph& graph);
  ~Recording();
  Recording(const Recording&) = delete;
  Recording& operator=(const Recording&) = delete;

  // Empty while recording; otherwise what broke the recording ("Tensor::item() reads ...").
  const std::string& break_reason() const { return reason_; }
  bool broken() const { return !reason_.empty(); }

  // Breaks at the first unsupported event (throws RuntimeError naming it) instead of finishing
  // eagerly.
  void set_throw_on_break(bool on) { throw_on_break_ = on; }

 private:
  friend struct Access;
  Graph& graph_;
  std::string reason_;
  bool throw_on_break_ = false;
};

// Runs `step` now and, while recording, keeps it as one of the graph's steps, with recording suspended
// while it runs (what it launches is not recorded again). Every step is made here: kernels, random
// fills, host-written bytes, and host work a replay must repeat where it stands, such as a collective
// of a process group run to completion (the DDP all-reduce). A step must only touch tensors that
// outlive the graph or that it holds itself.
void host_step(std::function<void()> step);

namespace detail {
// The recording of this thread that is still recording (null otherwise). Null inside a step that is
// being recorded, so kernels calling kernels are recorded once, as the outer call.
extern thread_local MN_CONSTINIT Recording* t_recording;

// An argument as the graph keeps it: tensors rebound to the same memory without owning the graph's
// own pool blocks (the pool keeps them), everything else by value.
Tensor hold(const Tensor& t);
template <class T, std::enable_if_t<!std::is_same_v<std::decay_t<T>, Tensor>, int> = 0>  // C++17: nvcc reads this
std::decay_t<T> hold(T&& v) {
  return std::forward<T>(v);
}

// Runs one kernel now and records it as a step.
template <class Fn, class... A>
void record_kernel(Fn* fn, A&&... args) {
  host_step([fn, held = std::make_tuple(hold(std::forward<A>(args))...)]() mutable {
    std::apply([fn](auto&... a) { fn(a...); }, held);
  });
}
}  // namespace detail

inline bool recording() { return detail::t_recording != nullptr; }

// Called where something happens that a replay would not repeat. `what` names it. Breaks the active
// recording (or throws under set_throw_on_break); does nothing when not recording.
void unsupported(const std::string& what);

// Host code wrote `t`'s bytes directly (factories from host values, under a Pause: Tensor::data breaks
// a recording otherwise): the values are restored at every replay, since the graph's pool may hand the
// memory to a later tensor of the same recording.
void host_wrote(const Tensor& t);

// The random fill of `t` from `gen` (factories): recorded so that each replay reserves a new range.
// `fill` is the kernel that writes the values of the range it is given (the kernels layer passes its
// dispatching random_fill; core calls no kernel itself).
using RandomFillFn = void (*)(Tensor& out, Distribution dist, double p1, double p2, const PhiloxState& state);
void random_fill(const Tensor& t, Distribution dist, double p1, double p2, Generator& gen, RandomFillFn fill);

// AccumulateGrad or set_grad wrote `leaf`'s gradient, whose memory was `before` (null: it had none).
void grad_written(const Tensor& leaf, const void* before);

// Suspends recording in a scope (work that must happen once, not at every replay).
class Pause {
 public:
  Pause() : saved_(detail::t_recording) { detail::t_recording = nullptr; }
  ~Pause() { detail::t_recording = saved_; }
  Pause(const Pause&) = delete;
  Pause& operator=(const Pause&) = delete;

 private:
  Recording* saved_;
};

// The private pool that serves allocations on `device` during the active recording (null when not
// recording). Storage uses it.
std::shared_ptr<DeviceAllocator> pool_for(Device device);

}  // namespace mn::capture
