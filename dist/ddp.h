#pragma once
// Data-parallel training of a MappingModel, as in the scaling guide:
//
//   mn::dist::setup_ddp(rank, world_size, "gloo");        // env:// reads MASTER_ADDR / MASTER_PORT
//   auto ddp = mn::dist::wrap_ddp(model);                  // broadcasts latents, checks mapper buffers
//   nn::Adam opt(ddp.parameters(), {.lr = 3e-4});
//   for (batch ...) {
//     auto result = ddp.forward(batch.inputs);
//     nn::cross_entropy(result.predictions, batch.targets).backward();  // latent grads averaged here
//     opt.step(); opt.zero_grad();
//   }
//   mn::dist::cleanup_ddp();
//
// Only the latents travel (trainable_parameter_count floats per step); the mapper buffers are a pure
// function of the seed, so construction only compares a hash of them across ranks.
//
// Gradient reduction (PyTorch's Reducer, reduced to what a mapping model needs): the latents are split
// into buckets in reverse order (grads arrive roughly last-to-first), the first bucket capped at 1 MiB and
// the others at 25 MiB. Each latent's post-accumulate hook copies grad / world_size into its bucket slot;
// a bucket's all-reduce (sum) starts once all its grads arrived and every earlier bucket started, so all
// ranks issue the same collectives in the same order. A callback at the end of backward waits for the
// buckets and writes the averages back into .grad. The engine sums every use of a latent before its
// AccumulateGrad runs, so two forwards (clean and perturbed) before one backward still fire each hook once.
// A latent that got no gradient in a backward contributes its current .grad (or zeros), so the ranks
// never wait on each other for it.
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dist/process_group.h"
#include "mapping/mapping_model.h"
#include "mapping/trainer.h"

namespace mn::dist {

// ---- the process-wide default group ----

// Joins the default group: rank 0 serves a TcpStore, every rank connects to it, the backend's group is
// built and a barrier makes sure every rank arrived. init_method: "env://" (MASTER_ADDR, MASTER_PORT from
// the environment) or "tcp://host:port". Backends: "gloo" (CPU tensors), "nccl" (CUDA builds). The
// timeout bounds the rendezvous and every later collective.
void setup_ddp(int rank, int world_size, const std::string& backend = "gloo",
               const std::string& init_method = "env://", Milliseconds timeout = default_collective_timeout());
// Leaves the default group (destroys it and the store). A no-op when not initialised.
void cleanup_ddp();
bool is_initialized();
// True when this build offers a backend (Gloo, or NCCL in CUDA builds); see available_backends().
bool is_available();

// The default group; RuntimeError "Process group is not initialized. Call setup_ddp() before wrap_ddp()."
// when setup_ddp has not run.
std::shared_ptr<ProcessGroup> default_process_group();
std::shared_ptr<Store> default_store();
int get_rank();        // 0 when not initialised
int get_world_size();  // 1 when not initialised

// ---- the wrapper ----

struct DdpOptions {
  size_t first_bucket_bytes = size_t{1} << 20;  // 1 MiB
  size_t bucket_bytes = size_t{25} << 20;       // 25 MiB
  std::vector<int> device_ids;                  // CUDA: the model's device; CPU: must be empty
  bool check_buffers = true;                    // compare mapper-buffer hashes across ranks at construction
};

class Reducer;

class DistributedDataParallel {
 public:
  // The model must outlive the wrapper and keep its latents (move it to its device before wrapping).
  DistributedDataParallel(mapping::MappingModel& model, std::shared_ptr<ProcessGroup> group,
                          DdpOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(DistributedDataParallel&&) noexcept;
  DistributedDataParallel& operator=(DistributedDataParallel&&) noexcept;
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  mapping::MappingModel& module() { return *model_; }
  const mapping::MappingModel& module() const { return *model_; }

  mapping::ForwardResult forward(const Tensor& input, const mapping::LatentOverrides& latents = {});
  mapping::ForwardResult operator()(const Tensor& input, const mapping::LatentOverrides& latents = {}) {
    return forward(input, latents);
  }
  mapping::ForwardResult forward_with(const std::function<Tensor(nn::Module&)>& run,
                                      const mapping::LatentOverrides& latents = {});
  // The trainable tensors (the model's latents), for the optimizer.
  std::vector<Tensor> parameters() const { return model_->parameters(); }

  // While alive, backward passes only accumulate into .grad locally (no communication); the first
  // backward after it reduces the accumulated sum. For gradient accumulation over micro-batches.
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

  // Bytes all-reduced per synchronised step: the latents only (4 bytes per latent value).
  size_t bytes_per_step() const;
  // Latent names per bucket, in launch order (bucket 0 holds the last latents).
  std::vector<std::vector<std::string>> bucket_latent_names() const;
  ProcessGroup& process_group() const;

 private:
  mapping::MappingModel* model_;
  std::shared_ptr<Reducer> reducer_;
};

// Wraps `model` for the default group (setup_ddp first). device_ids: empty for a CPU model; for a CUDA
// model at most the model's own device index.
DistributedDataParallel wrap_ddp(mapping::MappingModel& model, const std::vector<int>& device_ids = {});

// A MappingTrainer metrics reducer for data-parallel training (trainer.set_metrics_reducer): each
// metric becomes the sum over the ranks of metric x samples, divided by the samples of all ranks, so
// every rank records the means over all the samples of the pass, whatever each rank's share. Every rank
// must report the same metric names. The sums travel as f32 (accuracies x samples are whole numbers,
// exact up to 2^24 samples), on `device` (NCCL needs the model's GPU). group: nullptr = the default
// group of setup_ddp, looked up at each call; else a group that outlives the reducer.
//   trainer.set_metrics_reducer(mn::dist::average_metrics(model.device()));
mapping::MappingTrainer::MetricsReducer average_metrics(Device device, ProcessGroup* group = nullptr);

// 64-bit hash of a tensor's dtype, shape and bytes (copied to the CPU when needed); equal values on
// every rank mean byte-identical tensors.
uint64_t tensor_hash(const Tensor& tensor, uint64_t seed = 0);

}  // namespace mn::dist
