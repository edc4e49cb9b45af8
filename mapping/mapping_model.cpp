#include "mapping/mapping_model.h"

#include <limits>
#include <optional>
#include <sstream>

#include "autograd/checkpoint.h"
#include "autograd/node.h"
#include "nn/layers.h"

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
    : nn::Module("MappingModel"), target_(std::move(target)), options_(std::move(options)) {
  MN_CHECK(options_.latent_dim > 0, ValueError, "latent_dim must be positive, got ", options_.latent_dim);
  MN_CHECK(target_ != nullptr, ValueError, "MappingModel: target module is null");
  check_target();
  generator_ = make_generator(options_.strategy, ParameterSpec::from_module(*target_), options_.latent_dim,
                              generator_options(options_), options_.groups, options_.group_latent_dims);
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
  for (auto& [n, t] : target_->named_buffers()) buffers_[n] = t.detach().clone();
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

void MappingModel::plan_streaming() {
  MN_CHECK(dynamic_cast<const nn::Sequential*>(target_.get()) != nullptr, ValueError,
           "stream_layers: expected an nn::Sequential target (layers that run one after another), got a ",
           target_->type_name());
  const auto& groups = generator_->groups();
  const auto& entries = generator_->parameter_spec().entries();
  std::map<std::string, size_t> layer_of;  // top-level layer name -> its position
  const auto children = target_->named_children();
  for (size_t i = 0; i < children.size(); ++i) layer_of[children[i].first] = i;
  std::vector<std::vector<size_t>> groups_of(children.size());
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    std::optional<size_t> layer;
    for (size_t e : groups[gi].entries) {
      const std::string& name = entries[e].name;
      const auto dot = name.find('.');
      const auto it = layer_of.find(dot == std::string::npos ? std::string() : name.substr(0, dot));
      MN_CHECK(it != layer_of.end() && (!layer || *layer == it->second), ValueError, "stream_layers: group '",
               groups[gi].name, "' of strategy ", generator_->strategy(), " generates '", name,
               "' beside parameters of another top-level layer (or of the root); streaming needs each group "
               "inside one layer: use layerwise, lazy_layerwise or layer-wise groups, not slvt");
      layer = it->second;
    }
    if (layer) groups_of[*layer].push_back(gi);
  }
  for (size_t i = 0; i < children.size(); ++i) {
    // A layer with generated parameters opens a segment; parameter-free layers join the open one.
    if (stream_plan_.empty() || !groups_of[i].empty()) stream_plan_.push_back({{}, groups_of[i]});
    stream_plan_.back().layers.push_back({children[i].first + ".", children[i].second});
  }
}

ForwardResult MappingModel::run(const Tensor& input, const LatentOverrides& latents) {
  if (options_.stream_layers) return run_streamed(input, latents);
  return run_with([&](nn::Module& m) { return m.forward(input); }, latents);
}

ForwardResult MappingModel::run_streamed(const Tensor& input, const LatentOverrides& latents) {
  generator_->check_overrides(latents);
  const auto& groups = generator_->groups();
  // Unread generated parameters of the first forward, over all segments (see check_parameters_read).
  auto unread = parameters_read_checked_ ? nullptr : std::make_shared<std::vector<std::string>>();
  Tensor x = input;
  for (const StreamStep& step : stream_plan_) {
    // The segment's carried buffers as they are now (per layer, local names): both runs start from them.
    auto buffers = std::make_shared<std::vector<std::map<std::string, Tensor>>>(step.layers.size());
    for (size_t l = 0; l < step.layers.size(); ++l) {
      const std::string& prefix = step.layers[l].prefix;
      for (const auto& [name, b] : buffers_)
        if (name.compare(0, prefix.size(), prefix) == 0) (*buffers)[l][name.substr(prefix.size())] = b.clone();
    }
    autograd::TensorList in{x};
    for (size_t gi : step.groups) {
      const auto it = latents.find(groups[gi].name);
      in.push_back(it != latents.end() ? it->second : groups[gi].latent);
    }
    auto first = std::make_shared<bool>(true);
    const StreamStep* s = &step;
    // in = {segment input, latents of its groups}: generate the first layer's parameters, run the
    // segment, drop them. Only the first run writes buffers back; the recomputation in backward repeats
    // the segment without effect on the model.
    auto segment = [this, s, buffers, first, unread](const autograd::TensorList& in) -> autograd::TensorList {
      const auto& gs = generator_->groups();
      LatentOverrides own;
      for (size_t k = 0; k < s->groups.size(); ++k) own[gs[s->groups[k]].name] = in[k + 1];
      std::map<std::string, Tensor> generated;
      for (size_t gi : s->groups) {
        const ParameterTree part = generator_->generate_group_parameters(gi, own);
        for (const auto& [name, t] : part.items()) generated[name.substr(s->layers.front().prefix.size())] = t;
      }
      const bool write_back = options_.write_back_buffers && *first;
      const bool check_reads = unread != nullptr && *first;
      *first = false;
      Tensor y = in[0];
      for (size_t l = 0; l < s->layers.size(); ++l) {
        std::map<std::string, Tensor> tensors = l == 0 ? std::move(generated) : std::map<std::string, Tensor>{};
        for (const auto& [name, b] : (*buffers)[l]) tensors[name] = b.clone();
        nn::StateDict updated;
        nn::FunctionalCallOptions call;
        call.buffers_out = write_back ? &updated : nullptr;
        {
          nn::FunctionalCallGuard guard(*s->layers[l].module, tensors, call);
          y = s->layers[l].module->forward(y);
          if (check_reads)
            for (const std::string& name : guard.unread_parameters()) unread->push_back(s->layers[l].prefix + name);
        }
        if (write_back) keep_buffers(s->layers[l].prefix, updated);
      }
      return {y};
    };
    x = autograd::checkpoint(segment, in)[0];
  }
  if (unread) check_parameters_read(*unread);
  ForwardResult result;
  result.predictions = x;
  result.streamed = true;
  result.latent_vectors = generator_->named_latents();
  return result;
}

ForwardResult MappingModel::run_with(const std::function<Tensor(nn::Module&)>& fn, const LatentOverrides& latents) {
  MN_CHECK(!options_.stream_layers, ValueError,
           "run_with runs the target as a whole; a model with stream_layers runs through run(input)");
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
  options_.device = device;
}

nn::NamedTensorGroups MappingModel::replica_state() const {
  nn::NamedTensorGroups out;
  for (const Group& g : generator_->groups()) {
    std::vector<Tensor> tensors = g.mapper->buffers();
    tensors.push_back(g.scale);  // undefined without parameter scaling: hashed as such
    out.emplace_back(str("the mapper buffers and scales of group '", g.name, "'"), std::move(tensors));
  }
  return out;
}

void MappingModel::append_guard_words(std::vector<uint64_t>& key) const {
  // The target's training flags and tensors (it runs with them besides the generated parameters) and
  // what the generator reads besides the latents: scales and mapper factors (replaced by set_scales / to).
  nn::module_guard(*target_)(key);
  for (const Tensor& b : generator_->buffers()) guard_memory(key, b);
}

}  // namespace mn::mapping
