#pragma once
// mn::compile: the C++ counterpart of torch.compile (and of CUDA-graph capture). The first call with
// a new signature runs the function eagerly while recording every kernel it launches
// (core/capture.h); later calls with the same signature copy their inputs into the recorded input
// tensors and replay the kernels: no autograd graph, no shape checks, no allocation, no dispatch.
//
//   auto step = mn::compile([&](const std::vector<Tensor>& in) {
//     Tensor loss = F::cross_entropy(model(in[0]), in[1]);
//     loss.backward();
//     return std::vector<Tensor>{loss.detach()};
//   }, nn::module_guard(model));
//   for (const auto& b : loader) { opt.zero_grad(); Tensor loss = step({b.inputs, b.targets})[0]; opt.step(); }
//
// Signature (the guard of torch.compile): every input's shape, dtype, device and requires_grad, the
// grad mode, and the words of the optional Guard (nn::module_guard: training flags and the memory
// of every parameter and buffer, so a replaced parameter captures again). A graph is also replayed
// only while the gradients it writes are where it left them: none (the usual zero_grad()) or the same
// tensors (accumulation); otherwise another graph is captured.
//
// Outputs that require grad (a compiled model's forward under training) capture the backward too,
// AOTAutograd's way: right after the forward is recorded, autograd::grad over its history is recorded
// as a second graph, from the outputs' gradients to the gradients of every leaf the outputs reach (the
// parameters). Each call's outputs are fresh tensors with one node of their own; backward through
// them replays that graph and hands the leaves' gradients to the engine, so .grad accumulation, hooks
// and DDP behave as after an eager forward. The forward's activations live in the graph's pool and
// are rewritten by the next call of the same signature: run backward before calling again (a stale
// output's backward throws RuntimeError, as does one after the parameters changed in place).
// Double backward through a compiled output is not supported.
//
// What a replay cannot repeat breaks the capture: reading values on the host (item(), to_vector(),
// Tensor::data outside a kernel; so loss metrics are read after the call), optimizer steps (host step
// counts), empty_cache, collectives called directly, inputs that require grad. Without fullgraph the
// call finishes eagerly and the signature stays eager (explain() says why); with fullgraph it throws
// RuntimeError naming the cause. The DDP wrapper's all-reduce is captured: it is recorded as a step
// that runs the collective to completion in order. BatchNorm in training mode and dropout are
// captured: running statistics update in place and every replay draws new random numbers from the
// same generator. Outputs are fresh tensors at every call; the gradients a replay of a step function
// (one that calls backward itself) leaves on the parameters are the graph's own tensors, rewritten by
// the next replay (clone one to keep it). Not thread-safe: one caller at a time, on the thread that
// captured.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mn {

namespace capture {
class Graph;
}
namespace nn {
class Module;
}

// Appends words that identify the state a compiled function depends on besides its inputs.
using Guard = std::function<void(std::vector<uint64_t>& key)>;

// The guard word of a tensor the function reads: where its elements start (0 when undefined), which
// changes when the tensor is replaced and not when it is updated in place.
void guard_memory(std::vector<uint64_t>& key, const Tensor& t);

struct CompileOptions {
  bool fullgraph = false;   // a computation that cannot be captured throws instead of running eagerly
  int64_t max_graphs = 8;   // signatures kept; calls with further signatures run eagerly
};

class CompiledFunction {
 public:
  using Function = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

  CompiledFunction(Function fn, Guard guard = {}, CompileOptions options = {});
  ~CompiledFunction();
  CompiledFunction(CompiledFunction&&) noexcept;
  CompiledFunction& operator=(CompiledFunction&&) noexcept;

  std::vector<Tensor> operator()(const std::vector<Tensor>& inputs);

  struct Stats {
    int64_t calls = 0;
    int64_t captures = 0;  // calls that recorded a graph (and ran eagerly)
    int64_t replays = 0;
    int64_t eager = 0;     // calls run eagerly without recording (broken or too many signatures)
  };
  const Stats& stats() const { return stats_; }
  // One line per signature: captured (steps, pool bytes) or eager and why.
  std::string explain() const;
  // Bytes held by the graphs' private memory pools, and the peak allocated from them while capturing.
  int64_t reserved_bytes() const;
  int64_t peak_allocated_bytes() const;
  int64_t num_graphs() const;
  // Steps recorded (kernels, random fills, host steps), summed over the graphs.
  int64_t num_kernels() const;
  // Drops every graph (the next call captures again).
  void reset();

 private:
  struct Entry;
  Function fn_;
  Guard guard_;
  CompileOptions options_;
  std::vector<std::unique_ptr<Entry>> entries_;
  Stats stats_;
  bool overflow_noted_ = false;

  std::vector<uint64_t> key_of(const std::vector<Tensor>& inputs) const;
  std::vector<Tensor> capture(Entry& entry, const std::vector<Tensor>& inputs);
  // Fresh copies of the entry's outputs; with a captured backward, attached to a node that replays it.
  static std::vector<Tensor> outputs_of(Entry& entry);
};

CompiledFunction compile(CompiledFunction::Function fn, Guard guard = {}, CompileOptions options = {});

namespace nn {

// Training flags of every submodule, the memory of every parameter and buffer, and what each
// submodule's Module::append_guard_words adds. The module must outlive the guard.
Guard module_guard(const Module& module);

// A module's single-input forward, compiled: torch.compile(model). In inference (NoGradGuard, or no
// trainable parameter) only the forward is recorded; under grad mode with trainable parameters the
// backward is recorded too and replayed by loss.backward() (see above). Training mode, dropout and
// BatchNorm's batch statistics are part of what is replayed.
class CompiledModule {
 public:
  explicit CompiledModule(Module& module, CompileOptions options = {});
  Tensor operator()(const Tensor& x) { return fn_({x}).front(); }
  CompiledFunction& function() { return fn_; }

 private:
  CompiledFunction fn_;
};

CompiledModule compile(Module& module, CompileOptions options = {});

}  // namespace nn

}  // namespace mn
