#include "mapping/mapping_model.h"

#include "autograd/node.h"

#include <limits>
#include <sstream>

namespace mn::mapping {

namespace {
GeneratorOptions generator_options(const MappingOptions& o) {
  GeneratorOptions g;
  g.seed = o.seed;
  g.mapper_factory = o.mapper_factory ? o.mapper_factory : default_mapper_factory(o.alpha);
  g.device = o.device;
  g.empty_cache_on_cuda = o.empty_cache_on_cuda;
  g.max_projection_elements = o.max_projection_elements;
  g.allow_large = o.allow_large;
  return g;
}
}  // namespace

MappingModel::MappingModel(std::shared_ptr<nn::Module> target, MappingOptions options)
    : target_(std::move(target)), options_(std::move(options)) {
  MN_CHECK(options_.latent_dim > 0, ValueError, "latent_dim must be positive, got ", options_.latent_dim);
  MN_CHECK(target_ != nullptr, ValueError, "MappingModel: target module is null");
  check_target();
  generator_ = make_generator(options_.strategy, ParameterSpec::from_module(*target_), options_.latent_dim,
                              generator_options(options_), options_.groups, options_.group_latent_dims);
  if (options_.parameter_scaling) generator_->initialize_parameter_scaling(*target_);
  for (auto& [n, t] : target_->named_buffers()) buffers_[n] = t.detach().clone();
  if (!options_.device.is_cpu()) to(options_.device);
}

MappingModel::MappingModel(std::shared_ptr<nn::Module> target, std::unique_ptr<ParameterGenerator> generator,
                           MappingOptions options)
    : target_(std::move(target)), options_(std::move(options)), generator_(std::move(generator)) {
  MN_CHECK(target_ != nullptr && generator_ != nullptr, ValueError, "MappingModel: target and generator are required");
  check_target();
  const ParameterSpec spec = ParameterSpec::from_module(*target_);
  std::vector<std::pair<std::string, Shape>> shapes;
  for (const auto& e : spec.entries()) shapes.emplace_back(e.name, e.shape);
  generator_->parameter_spec().validate_names_and_shapes(shapes);
  options_.strategy = generator_->strategy();
  options_.latent_dim = generator_->groups().front().latent_dim;
  if (options_.parameter_scaling && !generator_->scaling_initialized()) generator_->initialize_parameter_scaling(*target_);
  for (auto& [n, t] : target_->named_buffers()) buffers_[n] = t.detach().clone();
  // The generator decides the device: carried buffers (and the target) go beside it.
  options_.device = generator_->device();
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

ForwardResult MappingModel::forward(const Tensor& input, const LatentOverrides& latents) {
  return forward_with([&](nn::Module& m) { return m.forward(input); }, latents);
}

ForwardResult MappingModel::forward_with(const std::function<Tensor(nn::Module&)>& run, const LatentOverrides& latents) {
  ForwardResult result;
  result.generated_parameters = generator_->generate_parameters(latents);
  std::map<std::string, Tensor> tensors = result.generated_parameters.to_map();
  // Buffers are the model's copies, cloned for this call so nothing leaks between calls unless
  // write-back is on.
  for (auto& [n, t] : buffers_) tensors[n] = t.clone();
  nn::StateDict updated;
  nn::FunctionalCallOptions call;
  call.buffers_out = options_.write_back_buffers ? &updated : nullptr;
  {
    nn::FunctionalCallGuard guard(*target_, tensors, call);
    result.predictions = run(*target_);
  }
  if (options_.write_back_buffers) {
    // In place: the buffers keep their memory, so a compiled step (nn/compile.h) records this copy
    // and repeats it at every replay (rebinding would leave replays reading the captured call's input).
    autograd::NoGradGuard no_grad;
    for (auto& [n, t] : updated) {
      Tensor dst = buffers_.at(n);
      dst.copy_(t.detach());
    }
  }
  result.latent_vectors = generator_->named_latents();
  return result;
}

double MappingModel::compression_ratio() const {
  const int64_t trainable = trainable_parameter_count();
  if (trainable == 0) return std::numeric_limits<double>::infinity();
  return static_cast<double>(target_parameter_count()) / static_cast<double>(trainable);
}

void MappingModel::zero_grad() {
  for (auto& [n, z] : generator_->named_latents()) z.set_grad(Tensor());
}

void MappingModel::to(Device device) {
  generator_->to(device);
  target_->to(device);
  for (auto& [n, t] : buffers_) t = t.to(device);
  options_.device = device;
}

Guard MappingModel::compile_guard() const {
  Guard target = nn::module_guard(*target_);
  const ParameterGenerator* generator = generator_.get();
  const nn::StateDict* buffers = &buffers_;
  return [target, generator, buffers](std::vector<uint64_t>& key) {
    target(key);
    for (const Tensor& z : generator->latents()) guard_memory(key, z);
    // What the step reads besides the latents: scales and mapper factors (replaced by set_scales / to)
    // and the carried buffers (replaced by set_buffers, e.g. lr_find's restore).
    for (const Tensor& b : generator->buffers()) guard_memory(key, b);
    for (const auto& [n, b] : *buffers) guard_memory(key, b);
  };
}

}  // namespace mn::mapping
