#pragma once
// MappingModel: a frozen target network whose parameters are generated from trainable latents.
// run() generates the parameters and runs the target through functional_call; the target's own
// tensors are never read for the computation and never modified. Only the latents train.
//
// It is an nn::Module, so it nests in a larger module, trains with any optimizer over parameters(),
// compiles with nn::compile and saves with state_dict(). As a module it lists:
//   parameters  "latents.<group name>": the generator's latents themselves (the tensors run() reads
//               and the optimizer updates), in the generator's group order. Group names keep their
//               dots ("latents.features.0"); they are listed, not registered, so Module's no-dot rule
//               for registered names does not apply.
//   buffers     "buffers.<target buffer name>": the carried buffers (buffers() below), which run()
//               reads (and updates with write_back_buffers).
// The target's own parameters and buffers are not listed (it is not a child module). load_state_dict
// copies values into these tensors in place. forward(x) is run(x).predictions; to() moves the
// generator, the target and the buffers; train()/eval() set the target's mode too; zero_grad() clears
// the latents' gradients. functional_call over a module containing a MappingModel cannot replace the
// latents (they are not registered tensors): use run()'s LatentOverrides for that.
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "mapping/generator.h"
#include "nn/compile.h"
#include "nn/functional_call.h"
#include "nn/module.h"

namespace mn::mapping {

struct MappingOptions {
  int64_t latent_dim = 256;
  // "slvt", "layerwise", "lazy_layerwise", "grouped" (with `groups`) or "lrd" (with lrd_rank).
  std::string strategy = "layerwise";
  uint64_t seed = 0;
  bool parameter_scaling = true;
  double alpha = 0.01;             // additive modulation of the default mapper
  MapperFactory mapper_factory;    // overrides the default mapper (alpha is then unused)
  std::vector<std::pair<std::string, std::vector<std::string>>> groups;  // strategy "grouped"
  // Per-group latent lengths overriding latent_dim for the groups named (strategies grouped, layerwise,
  // lazy_layerwise; the layer-wise groups are the owner modules, "0", "features.3", ...);
  // capped_latent_dims (mapping/generator.h) shares a total over them.
  std::map<std::string, int64_t> group_latent_dims;
  int64_t max_projection_elements = 100'000'000;
  bool allow_large = false;
  bool empty_cache_on_cuda = true;
  Device device = kCPU;
  // Buffers (e.g. BatchNorm running stats) are cloned per call; set to keep the updated copies in
  // the model (they then persist across calls and in checkpoints).
  bool write_back_buffers = false;
  // Streams the target module by module: the parameters of each module that owns generator groups
  // (the deepest module holding all of a group's parameters) are generated just before its call and
  // dropped after it, and generated again in backward (autograd::checkpoint over the call, which is
  // recomputed), so memory holds the running module's parameters instead of all of them, for a second
  // forward of each owner per step (nested owners: one more per level). Works for any module tree
  // whose groups are per module (layerwise, lazy_layerwise, grouped by module; not slvt, whose group
  // spans the whole target); groups of the root's own parameters are generated once for the call.
  // The target must call its children through operator() (child(x), Sequential does) or
  // Module::call: a child called through child.forward(x) runs without its parameters, and reading
  // one is a ValueError saying so. Needs run(input) (not run_with). The model must outlive the backward
  // of its outputs. ForwardResult::generated_parameters stays empty (not kept), so the smoothness loss,
  // which differentiates them, refuses such a model.
  bool stream_layers = false;
  // The first forward checks that the target read every generated parameter through Module::param()
  // (a layer that computes with a Tensor member kept from register_parameter runs on its own frozen
  // tensor and the latents get no gradient from it): an unread parameter is a ValueError naming it.
  // Set this when the target genuinely leaves some parameters unused (PyTorch DDP's
  // find_unused_parameters case); they are still generated.
  bool allow_unused_parameters = false;
  // The default mapper's fixed-matrix family: "block" (default), "dense" (the reference's explicit
  // matrix, refused above max_dense_mapper_bytes unless allow_large) or "srht" (a Hadamard map that
  // stores nothing); see mapping/orthogonal.h. Checkpoints record it.
  std::string mapper = "block";
  int64_t max_dense_mapper_bytes = int64_t{1} << 30;
  // LRD and pruning add-ons (the paper's Table 8).
  // strategy "lrd" (layer-wise groups) or "slvt" (one group, slvt + LRD): the rank of every factored 2-D
  // weight (mapping/lrd.h); 0: no factorisation (and must be 0 for the other strategies).
  int64_t lrd_rank = 0;
  // Unstructured magnitude pruning of the generated parameters, any strategy: each tensor of two or
  // more dimensions keeps its llround((1 - f) * numel) entries of largest |value| at the initial
  // latents (a fixed 0/1 mask, nn::magnitude_prune_masks); biases and other 1-D tensors are not pruned.
  // The masks are a pure function of the seed and the options (a per-tensor scale does not reorder a
  // tensor), so they are rebuilt by construction and never stored; every generated tree the model
  // hands out (run, generate_parameters, streaming, export) is masked, so masked entries are zero and
  // pass no gradient to the latents. 0 <= f < 1.
  double prune_fraction = 0.0;
  // strategy "finetuning" (mapping/finetuning.h): the pretrained target's safetensors state dict (PyTorch
  // names), to which the latents' modulation is added; its parameters become fixed generator buffers,
  // and the target's buffers found in it (BatchNorm running statistics) replace the target's initial
  // ones. finetune_block_size (L_b) parameters share one modulation element, scaled by finetune_alpha
  // (per layer-wise group in finetune_group_alpha). `alpha` stays the mapper's own modulation.
  std::string pretrained;
  int64_t finetune_block_size = 250;
  double finetune_alpha = 0.01;
  std::map<std::string, double> finetune_group_alpha;
};

struct ForwardResult {
  Tensor predictions;
  ParameterTree generated_parameters;  // empty with stream_layers (never all alive at once)
  bool streamed = false;               // stream_layers: generated module by module, not kept
  std::vector<std::pair<std::string, Tensor>> latent_vectors;  // always the model's own latents
};

class MappingModel : public nn::Module {
  struct WithGenerator {};

 public:
  explicit MappingModel(std::shared_ptr<nn::Module> target, MappingOptions options = {});
  // With an explicitly built generator (a strategy object). A template so that MappingModel(target, {})
  // means the options constructor (a braced {} cannot deduce G).
  template <class G, class = std::enable_if_t<std::is_base_of_v<ParameterGenerator, G>>>
  MappingModel(std::shared_ptr<nn::Module> target, std::unique_ptr<G> generator, MappingOptions options = {})
      : MappingModel(WithGenerator{}, std::move(target), std::unique_ptr<ParameterGenerator>(std::move(generator)),
                     std::move(options)) {}

  // Generates the parameters (or uses `latents` for the named groups) and runs the target on input.
  ForwardResult run(const Tensor& input, const LatentOverrides& latents = {});
  // For targets with several inputs or keyword-like options: fn(target) is called under the
  // functional call and returns the predictions.
  ForwardResult run_with(const std::function<Tensor(nn::Module&)>& fn, const LatentOverrides& latents = {});
  // nn::Module's single-input forward: run(x).predictions.
  Tensor forward(const Tensor& x) override { return run(x).predictions; }

  // The generated parameters (pruning masks applied, MappingOptions::prune_fraction).
  ParameterTree generate_parameters(const LatentOverrides& latents = {}) const {
    return apply_prune_masks(generator_->generate_parameters(latents));
  }
  // The fixed pruning masks by target name (empty without pruning).
  const std::map<std::string, Tensor>& prune_masks() const { return prune_masks_; }
  // Generated parameters that can be nonzero: the target's count minus the masked entries.
  int64_t unpruned_parameter_count() const;
  // The latents under their group names (parameters() lists the same tensors, named "latents.<group>").
  std::vector<std::pair<std::string, Tensor>> named_latents() const { return generator_->named_latents(); }
  std::map<std::string, Tensor> modulated_column_means(const LatentOverrides& latents = {}) const {
    return generator_->modulated_column_means(latents);
  }

  int64_t trainable_parameter_count() const { return generator_->trainable_parameter_count(); }
  int64_t target_parameter_count() const { return generator_->parameter_spec().total_numel(); }
  double compression_ratio() const;

  nn::Module& target() { return *target_; }
  const nn::Module& target() const { return *target_; }
  std::shared_ptr<nn::Module> target_ptr() const { return target_; }
  ParameterGenerator& generator() { return *generator_; }
  const ParameterGenerator& generator() const { return *generator_; }
  const ParameterSpec& parameter_spec() const { return generator_->parameter_spec(); }
  const MappingOptions& options() const { return options_; }
  std::string strategy() const { return generator_->strategy(); }

  // For mn::compile (nn/compile.h): nn::module_guard(*this), i.e. the latents' and carried buffers'
  // memory, the training flags, and (append_guard_words) the target's guard and the generator's
  // scales and mapper tensors.
  Guard compile_guard() const { return nn::module_guard(*this); }

  // ---- nn::Module ----
  nn::NamedTensors named_parameters(bool recurse = true) const override;
  nn::NamedTensors named_buffers(bool recurse = true) const override;
  void train(bool on = true) override;
  void to(Device device) override;
  // Per group, its mapper buffers and scale (and fine-tuning's pretrained weights): a function of the
  // seed, the target's initialisation and the pretrained file, never communicated, so data-parallel
  // replicas must agree on them (dist/ddp.h compares hashes).
  nn::NamedTensorGroups replica_state() const override;
  void append_guard_words(std::vector<uint64_t>& key) const override;

  Device device() const { return generator_->device(); }
  // Buffers carried across calls when write_back_buffers is on (else the target's initial ones). The
  // tensors are the model's own and are updated in place (so compiled steps carry them): clone them
  // for a snapshot. set_buffers replaces them with copies of the given values (the names must be the
  // target's buffer names).
  const nn::StateDict& buffers() const { return buffers_; }
  void set_buffers(const nn::StateDict& buffers);

 private:
  MappingModel(WithGenerator, std::shared_ptr<nn::Module> target, std::unique_ptr<ParameterGenerator> generator,
               MappingOptions options);
  void finish_construction();
  void check_target() const;
  // The first-forward check of allow_unused_parameters: throws naming `unread` unless it is empty or
  // the option allows it; once a forward has passed it, later ones skip it.
  void check_parameters_read(const std::vector<std::string>& unread);
  bool parameters_read_checked_ = false;
  // stream_layers (streaming.cpp): per module that owns generator groups, its dotted prefix, its
  // groups and the buffers of its subtree; groups of the root's own parameters are resident (generated
  // once per call, outside the checkpoints).
  struct StreamBuffer {
    std::string name;     // under the owner
    nn::Module* module;   // the module that registers it
    std::string local;    // its name there
  };
  struct StreamOwner {
    std::string prefix;  // "<dotted path>."
    std::vector<size_t> groups;
    std::vector<StreamBuffer> buffers;
  };
  class StreamCall;  // one streamed forward: the nn::CallInterceptor that generates per owner
  void plan_streaming();
  // write_back_buffers: a call's updated buffers (names under `prefix`) copied into the model's.
  void keep_buffers(const std::string& prefix, const nn::StateDict& updated);
  ForwardResult run_streamed(const Tensor& input, const LatentOverrides& latents);
  std::map<const nn::Module*, StreamOwner> stream_owners_;
  std::vector<size_t> resident_groups_;

  // Pruning (MappingOptions::prune_fraction): masks computed once from the initial generation, and
  // their application to a generated tree (or a group's part of it).
  void build_prune_masks();
  ParameterTree apply_prune_masks(ParameterTree tree) const;
  std::map<std::string, Tensor> prune_masks_;

  std::shared_ptr<nn::Module> target_;
  MappingOptions options_;
  std::unique_ptr<ParameterGenerator> generator_;
  nn::StateDict buffers_;
};

}  // namespace mn::mapping
