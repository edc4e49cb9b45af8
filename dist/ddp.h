#pragma once
// Data-parallel training of any nn::Module (PyTorch's DistributedDataParallel):
//
//   mn::dist::setup_ddp(rank, world_size, "gloo");        // env:// reads MASTER_ADDR / MASTER_PORT
//   auto net = std::make_shared<mn::nn::Sequential>(std::vector<mn::nn::ModulePtr>{
//       std::make_shared<mn::nn::Linear>(784, 128), std::make_shared<mn::nn::ReLU>(),
//       std::make_shared<mn::nn::Linear>(128, 10)});    // or a mapping::MappingModel
//   auto ddp = mn::dist::wrap_ddp(*net);                   // broadcasts rank 0's parameters and buffers
//   mn::nn::optim::Adam opt(ddp.parameters(), {.lr = 3e-4});
//   for (const auto& batch : loader) {                     // loader: this rank's shard (DistributedSampler)
//     mn::Tensor logits = ddp.forward(batch.inputs);
//     mn::nn::functional::cross_entropy(logits, batch.targets).backward();  // grads averaged here
//     opt.step();
//     opt.zero_grad();
//   }
//   mn::dist::cleanup_ddp();
//
// What travels: the gradients of the module's parameters that require grad, summed over the ranks and
// divided by the world size. For a mapping::MappingModel those are exactly its latents
// (trainable_parameter_count floats per step); call model.run(...) as usual (the reducer's hooks sit on
// the latents, whoever runs the model), or ddp.forward(x) for the predictions alone.
//
// Construction: every rank must hold the same parameter and buffer names and shapes (compared by hash),
// then rank 0's parameters and buffers are broadcast to the others. State that is neither and that a
// module computes with (a MappingModel's fixed mappers: a function of the seed, never sent) is declared
// through nn::Module::replica_state(); with DdpOptions::check_buffers each named group's hash is compared
// across the ranks and the first one that differs is an error on every rank. dist knows nothing of
// mapping: a module above nn implements that virtual.
//
// Gradient reduction (PyTorch's Reducer, reduced to what these models need): the parameters are split
// into buckets in reverse order (grads arrive roughly last-to-first), the first bucket capped at 1 MiB and
// the others at 25 MiB. Each parameter's post-accumulate hook copies grad / world_size into its bucket
// slot; a bucket's all-reduce (sum) starts once all its grads arrived and every earlier bucket started, so
// all ranks issue the same collectives in the same order. A callback at the end of backward waits for the
// buckets and writes the averages back into .grad. The engine sums every use of a parameter before its
// AccumulateGrad runs, so two forwards (clean and perturbed) before one backward still fire each hook once.
// A parameter that got no gradient in a backward contributes its current .grad (or zeros), so the ranks
// never wait on each other for it. With gradient sync off (no_sync(), set_gradient_sync(false)) backward
// only accumulates locally; the next synchronised backward reduces the accumulated sum.
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dist/process_group.h"
#include "nn/module.h"
#include "nn/train/data_parallel.h"

namespace mn::dist {

// ---- the process-wide default group ----

// Joins the default group: rank 0 serves a TcpStore (or, with env:// under mn-run / torchrun, the launcher
// does: TORCHELASTIC_USE_AGENT_STORE, see env.h), every rank connects to it, the backend's group is
// built and a barrier makes sure every rank arrived. init_method: "env://" (MASTER_ADDR, MASTER_PORT from
// the environment) or "tcp://host:port". Backends: "gloo" (CPU tensors), "nccl" (CUDA builds), "mpi" (CPU
// tensors, builds with MPI, ranks started by mpirun: no store and no init_method, and rank and world_size must be
// MPI's; see launch_env in dist/process_group.h). The timeout bounds the rendezvous and every later collective.
void setup_ddp(int rank, int world_size, const std::string& backend = "gloo",
               const std::string& init_method = "env://", Milliseconds timeout = default_collective_timeout());
// Leaves the default group (destroys it and the store). A no-op when not initialised.
void cleanup_ddp();
bool is_initialized();
// True when this build offers a backend (Gloo, NCCL in CUDA builds, MPI when found); see available_backends().
bool is_available();

// The default group; RuntimeError "Process group is not initialized. Call setup_ddp() before wrap_ddp()."
// when setup_ddp has not run.
std::shared_ptr<ProcessGroup> default_process_group();
std::shared_ptr<Store> default_store();  // RuntimeError for "mpi", which has none
int get_rank();        // 0 when not initialised
int get_world_size();  // 1 when not initialised

// ---- the wrapper ----

struct DdpOptions {
  size_t first_bucket_bytes = size_t{1} << 20;  // 1 MiB
  size_t bucket_bytes = size_t{25} << 20;       // 25 MiB
  std::vector<int> device_ids;                  // CUDA: the model's device; CPU: must be empty
  // Compare the hashes of every module's replica_state() groups (a MappingModel's mapper buffers and
  // scales) across the ranks at construction.
  bool check_buffers = true;
};

class Reducer;

class DistributedDataParallel : public train::DataParallel {
 public:
  // The module must outlive the wrapper and keep its parameters (move it to its device before wrapping:
  // to() replaces them). Its parameters must all be on one device; those that require grad must be f32.
  DistributedDataParallel(nn::Module& module, std::shared_ptr<ProcessGroup> group, DdpOptions options = {});
  ~DistributedDataParallel() override;
  DistributedDataParallel(DistributedDataParallel&&) noexcept;
  DistributedDataParallel& operator=(DistributedDataParallel&&) noexcept;
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  nn::Module& module() { return *module_; }
  const nn::Module& module() const { return *module_; }

  // The module's forward, after checking that its parameters are still the wrapped ones.
  Tensor forward(const Tensor& input);
  Tensor operator()(const Tensor& input) { return forward(input); }
  // The reduced tensors (the module's parameters that require grad), for the optimizer.
  std::vector<Tensor> parameters() const;

  // While alive, backward passes only accumulate into .grad locally (no communication); the first
  // backward after it reduces the accumulated sum. For gradient accumulation over micro-batches; the
  // RAII form of set_gradient_sync(false).
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(std::shared_ptr<Reducer> reducer);
    ~NoSyncGuard();
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    std::shared_ptr<Reducer> reducer_;
    bool previous_;
  };
  [[nodiscard]] NoSyncGuard no_sync();

  // ---- train::DataParallel (nn/train/data_parallel.h) ----
  void set_gradient_sync(bool enabled) override;
  bool gradient_sync() const override;
  // Each metric becomes the sum over the ranks of metric x samples divided by the samples of all ranks
  // (average_metrics below, on this wrapper's group and the module's device).
  train::Metrics average_metrics(const train::Metrics& metrics, int64_t samples) override;
  int rank() const override;
  int world_size() const override;
  // Every rank's values in rank order, exact (doubles travel as their bits in an i64 all-gather).
  std::vector<std::vector<double>> all_gather(const std::vector<double>& values) override;

  // Bytes all-reduced per synchronised step: the reduced parameters only (4 bytes per value).
  size_t bytes_per_step() const;
  // Parameter names per bucket, in launch order (bucket 0 holds the last parameters).
  std::vector<std::vector<std::string>> bucket_parameter_names() const;
  // Gradient all-reduces started since construction (one per bucket per synchronised backward).
  int64_t allreduce_count() const;
  ProcessGroup& process_group() const;

 private:
  nn::Module* module_;
  Device device_;
  std::shared_ptr<Reducer> reducer_;
};

// Wraps `module` for the default group (setup_ddp first). device_ids: empty for a CPU module; for a CUDA
// module at most its own device index.
DistributedDataParallel wrap_ddp(nn::Module& module, const std::vector<int>& device_ids = {});

// A metrics reducer for data-parallel training: each metric becomes the sum over the ranks of
// metric x samples, divided by the samples of all ranks, so every rank records the means over all the
// samples of the pass, whatever each rank's share. Every rank must report the same metric names. The
// sums travel as f32 (accuracies x samples are whole numbers, exact up to 2^24 samples), on `device`
// (NCCL needs the model's GPU). group: nullptr = the default group of setup_ddp, looked up at each call;
// else a group that outlives the reducer. DistributedDataParallel::average_metrics is the same on its group.
//   trainer.set_metrics_reducer(mn::dist::average_metrics(model.device()));
std::function<train::Metrics(const train::Metrics&, int64_t)> average_metrics(Device device,
                                                                               ProcessGroup* group = nullptr);

// 64-bit hash of a tensor's dtype, shape and bytes (copied to the CPU when needed); equal values on
// every rank mean byte-identical tensors.
uint64_t tensor_hash(const Tensor& tensor, uint64_t seed = 0);

}  // namespace mn::dist
