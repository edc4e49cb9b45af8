#include "mapping/mapping_model.h"

#include <cmath>
#include <limits>
#include <sstream>

#include "autograd/node.h"
#include "autograd/ops.h"
#include "nn/reparametrize.h"
#include "mapping/finetuning.h"

namespace mn::mapping {

namespace {
GeneratorOptions generator_options(const MappingOptions& o) {
  GeneratorOptions g;
  g.seed = o.seed;
  // The default mapper is left to the generator (built from alpha and the family below), so slvt's size
  // guard counts what that family stores; a user's factory is passed on as custom.
  g.mapper_factory = o.mapper_factory;
  g.alpha = o.alpha;
  g.device = o.device;
  g.empty_cache_on_cuda = o.empty_cache_on_cuda;
  g.max_projection_elements = o.max_projection_elements;
  g.allow_large = o.allow_large;
  g.mapper = o.mapper;
  g.max_dense_mapper_bytes = o.max_dense_mapper_bytes;
  g.lrd_rank = o.lrd_rank;
  return g;
}
}  // namespace

MappingModel::MappingModel(std::shared_ptr<nn::Module> target, MappingOptions options)
    : nn::Module("MappingModel"), target_(std::move(target)), options_(std::move(options)) {
  MN_CHECK(options_.latent_dim > 0, ValueError, "latent_dim must be positive, got ", options_.latent_dim);
  MN_CHECK(target_ != nullptr, ValueError, "MappingModel: target module is null");
  MN_CHECK(options_.lrd_rank == 0 || options_.strategy == "lrd" || options_.strategy == "slvt", ValueError,
           "lrd_rank ", options_.lrd_rank, " factors the weights of strategy 'lrd' (or 'slvt': slvt + LRD); strategy '",
           options_.strategy, "' has no rank (set it to 0)");
  check_target();
  if (options_.strategy == "finetuning") {
    MN_CHECK(options_.group_latent_dims.empty(), ValueError, "per-group latent lengths are for strategies grouped, "
             "layerwise and lazy_layerwise; strategy 'finetuning' takes one latent_dim");
    MN_CHECK(!options_.pretrained.empty(), ValueError,
             "strategy 'finetuning' needs MappingOptions::pretrained (the pretrained target's safetensors file)");
    generator_ = std::make_unique<FineTuningGenerator>(
        ParameterSpec::from_module(*target_), options_.latent_dim, load_pretrained(options_.pretrained),
        FineTuningOptions{options_.finetune_block_size, options_.finetune_alpha, options_.finetune_group_alpha},
        generator_options(options_));
  } else {
    generator_ = make_generator(options_.strategy, ParameterSpec::from_module(*target_), options_.latent_dim,
                                generator_options(options_), options_.groups, options_.group_latent_dims);
  }
  if (options_.parameter_scaling) generator_->initialize_parameter_scaling(*target_);
  finish_construction();
}

MappingModel::MappingModel(WithGenerator, std::shared_ptr<nn::Module> target,
                           std::unique_ptr<ParameterGenerator> generator, MappingOptions options)
    : nn::Module("MappingModel"), target_(std::move(target)), options_(std::move(options)),
      generator_(std::move(generator)) {
  MN_CHECK(target_ != nullptr && generator_ != nullptr, ValueError, "MappingModel: target and generator are required");
  check_target();
  const ParameterSpec spec = ParameterSpec::from_module(*target_);
  std::vector<std::pair<std::string, Shape>> shapes;
  for (const auto& e : spec.entries()) shapes.emplace_back(e.name, e.shape);
  generator_->parameter_spec().validate_names_and_shapes(shapes);
  options_.strategy = generator_->strategy();
  options_.latent_dim = generator_->groups().front().latent_dim;
  if (options_.parameter_scaling && !generator_->scaling_initialized()) generator_->initialize_parameter_scaling(*target_);
  // The generator decides the device: carried buffers (and the target) go beside it.
  options_.device = generator_->device();
  finish_construction();
}

void MappingModel::finish_construction() {
  nn::check_prune_fraction(options_.prune_fraction);
  build_prune_masks();
  for (auto& [n, t] : target_->named_buffers()) buffers_[n] = t.detach().clone();
  // Fine-tuning starts from the pretrained model's buffers (its BatchNorm statistics) where the file has them.
  if (const auto* ft = dynamic_cast<const FineTuningGenerator*>(generator_.get())) {
    autograd::NoGradGuard no_grad;
    for (auto& [n, t] : buffers_) {
      auto it = ft->pretrained_extras().find(n);
      if (it == ft->pretrained_extras().end()) continue;
      MN_CHECK(it->second.sizes() == t.sizes() && it->second.dtype() == t.dtype(), ValueError,
               "pretrained weights ", ft->pretrained_path(), ": buffer '", n, "' is ", it->second.dtype(), " ",
               it->second.sizes(), " in the file but ", t.dtype(), " ", t.sizes(), " in the target");
      t = it->second.clone();
    }
  }
  if (options_.stream_layers) plan_streaming();
  if (!options_.device.is_cpu()) to(options_.device);
}

void MappingModel::check_target() const {
  // Shared (tied) parameters would be generated twice and disagree: refuse them.
  std::map<const TensorImpl*, std::string> owner;
  std::vector<std::string> ties;
  for (const auto& [prefix, m] : target_->named_modules())
    for (const auto& [name, t] : m->own_parameters()) {
      if (!t.defined()) continue;
      const std::string full = prefix.empty() ? name : prefix + "." + name;
      auto [it, fresh] = owner.emplace(t.impl(), full);
      if (!fresh) ties.push_back(it->second + " = " + full);
    }
  if (!ties.empty()) {
    std::ostringstream os;
    for (size_t i = 0; i < ties.size(); ++i) os << (i ? ", " : "") << ties[i];
    throw ValueError("Tied/shared target parameters are not supported yet: " + os.str());
  }
}

void MappingModel::check_parameters_read(const std::vector<std::string>& unread) {
  if (!unread.empty() && !options_.allow_unused_parameters)
    throw ValueError(str(
        "MappingModel: the target's forward never read the generated parameter(s) ", bracket_list(unread),
        " through Module::param(), so it ran on the target's own frozen tensors and the latents get no gradient "
        "from them. A layer that keeps register_parameter's return value in a member and computes with it does "
        "this: read parameters through param(\"name\") in forward, not a stored Tensor member. If forward "
        "genuinely does not use them, set MappingOptions::allow_unused_parameters = true"));
  parameters_read_checked_ = true;
}

ForwardResult MappingModel::run(const Tensor& input, const LatentOverrides& latents) {
  if (options_.stream_layers) return run_streamed(input, latents);
  return run_with([&](nn::Module& m) { return m.forward(input); }, latents);
}

ForwardResult MappingModel::run_with(const std::function<Tensor(nn::Module&)>& fn, const LatentOverrides& latents) {
  MN_CHECK(!options_.stream_layers, ValueError,
           "run_with runs the target as a whole; a model with stream_layers runs through run(input)");
  ForwardResult result;
  result.generated_parameters = apply_prune_masks(generator_->generate_parameters(latents));
  std::map<std::string, Tensor> tensors = result.generated_parameters.to_map();
  // Buffers are the model's copies, cloned for this call so nothing leaks between calls unless
  // write-back is on.
  for (auto& [n, t] : buffers_) tensors[n] = t.clone();
  nn::StateDict updated;
  nn::FunctionalCallOptions call;
  call.buffers_out = options_.write_back_buffers ? &updated : nullptr;
  {
    nn::FunctionalCallGuard guard(*target_, tensors, call);
    result.predictions = fn(*target_);
    if (!parameters_read_checked_) check_parameters_read(guard.unread_parameters());
  }
  if (options_.write_back_buffers) keep_buffers("", updated);
  result.latent_vectors = generator_->named_latents();
  return result;
}

void MappingModel::keep_buffers(const std::string& prefix, const nn::StateDict& updated) {
  // In place: the buffers keep their memory, so a compiled step (nn/compile.h) records this copy and
  // repeats it at every replay (rebinding would leave replays reading the captured call's input).
  autograd::NoGradGuard no_grad;
  for (const auto& [name, t] : updated) {
    Tensor dst = buffers_.at(prefix + name);
    dst.copy_(t.detach());
  }
}

void MappingModel::set_buffers(const nn::StateDict& buffers) {
  std::vector<std::string> expected, given;
  for (const auto& [name, t] : buffers_) expected.push_back(name);
  for (const auto& [name, t] : buffers) given.push_back(name);
  MN_CHECK(given == expected, KeyError, "MappingModel::set_buffers: expected the target's buffers ",
           bracket_list(expected), ", got ", bracket_list(given));
  for (const auto& [name, t] : buffers) buffers_[name] = t.detach().clone();
}

double MappingModel::compression_ratio() const {
  const int64_t trainable = trainable_parameter_count();
  if (trainable == 0) return std::numeric_limits<double>::infinity();
  return static_cast<double>(target_parameter_count()) / static_cast<double>(trainable);
}

nn::NamedTensors MappingModel::named_parameters(bool) const {
  nn::NamedTensors out;
  for (const auto& [name, z] : generator_->named_latents()) out.emplace_back("latents." + name, z);
  return out;
}

nn::NamedTensors MappingModel::named_buffers(bool) const {
  nn::NamedTensors out;
  for (const auto& [name, t] : buffers_) out.emplace_back("buffers." + name, t);
  return out;
}

void MappingModel::train(bool on) {
  nn::Module::train(on);
  target_->train(on);
}

void MappingModel::to(Device device) {
  generator_->to(device);
  target_->to(device);
  for (auto& [n, t] : buffers_) t = t.to(device);
  for (auto& [n, m] : prune_masks_) m = m.to(device);
  options_.device = device;
}

void MappingModel::build_prune_masks() {
  prune_masks_.clear();
  if (options_.prune_fraction == 0) return;
  // Group by group, at the generator's own (initial) latents: one group's tensors alive at a time.
  autograd::NoGradGuard no_grad;
  for (size_t gi = 0; gi < generator_->groups().size(); ++gi) {
    const ParameterTree part = generator_->generate_group_parameters(gi);
    for (auto& [name, mask] : nn::magnitude_prune_masks(part.items(), options_.prune_fraction))
      prune_masks_[name] = mask;
  }
}

ParameterTree MappingModel::apply_prune_masks(ParameterTree tree) const {
  if (prune_masks_.empty()) return tree;
  std::vector<std::pair<std::string, Tensor>> items;
  for (const auto& [name, t] : tree.items()) {
    auto it = prune_masks_.find(name);
    items.emplace_back(name, it == prune_masks_.end() ? t : mul(t, it->second));
  }
  return ParameterTree(std::move(items));
}

int64_t MappingModel::unpruned_parameter_count() const {
  int64_t n = target_parameter_count();
  for (const auto& [name, m] : prune_masks_) n -= m.numel() - static_cast<int64_t>(std::llround(sum(m).item()));
  return n;
}

nn::NamedTensorGroups MappingModel::replica_state() const {
  nn::NamedTensorGroups out;
  for (const Group& g : generator_->groups()) {
    std::vector<Tensor> tensors = g.mapper->buffers();
    tensors.push_back(g.scale);  // undefined without parameter scaling: hashed as such
    // Fine-tuning: each rank read its own copy of the pretrained file.
    if (g.offset.defined()) tensors.push_back(g.offset);
    out.emplace_back(str("the mapper buffers and scales", g.offset.defined() ? " and pretrained weights" : "",
                         " of group '", g.name, "'"),
                     std::move(tensors));
  }
  return out;
}

void MappingModel::append_guard_words(std::vector<uint64_t>& key) const {
  // The target's training flags and tensors (it runs with them besides the generated parameters) and
  // what the generator reads besides the latents: scales and mapper factors (replaced by set_scales / to).
  nn::module_guard(*target_)(key);
  for (const Tensor& b : generator_->buffers()) guard_memory(key, b);
  for (const auto& [name, m] : prune_masks_) guard_memory(key, m);
}

}  // namespace mn::mapping
