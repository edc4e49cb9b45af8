#include "mapping/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <type_traits>

#include "autograd/node.h"
#include "mapping/lrd.h"
#include "mapping/finetuning.h"
#include "nn/safetensors.h"
#include "nn/train/state_json.h"

namespace mn::mapping {

namespace {

using json = nlohmann::json;

constexpr const char* kFormat = "mapping_networks.checkpoint";
constexpr const char* kLatentPrefix = "latent/";
constexpr const char* kBufferPrefix = "buffer/";
constexpr const char* kOptimizerPrefix = "optimizer/";
constexpr const char* kLossPrefix = "loss/";
constexpr const char* kScalesKey = "scales";

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

[[noreturn]] void invalid(const std::string& path, const std::string& why) {
  throw IOError(str("not a valid mapping_networks checkpoint: ", path, " (", why, ")"));
}

// ---- JSON <-> engine values ----

json shape_json(const Shape& shape) {
  json dims = json::array();
  for (int64_t d : shape) dims.push_back(d);
  return dims;
}

using train::detail::parse_trainer_state;
using train::detail::whole_number;

// The mapper as far as the model can tell: whether it is the default one (alpha known) and each
// group's description (kind, dims, modulation), which a different factory would change.
json mapper_json(const MappingModel& model) {
  json groups = json::object();
  for (const auto& g : model.generator().groups()) groups[g.name] = g.mapper->describe();
  const bool is_default = !model.options().mapper_factory;
  return {{"default", is_default},
          {"construction", mapper_construction(parse_mapper_family(model.generator().options().mapper))},
          {"family", model.generator().options().mapper},
          {"alpha", is_default ? json(model.options().alpha) : json(nullptr)},
          {"groups", groups}};
}

// What a fine-tuning generator adds to the spec and the latents: the pretrained file (path and content
// hash, not its tensors) and the modulation's block size and strengths.
json finetuning_json(const FineTuningGenerator& ft) {
  return {{"pretrained", ft.pretrained_path()},
          {"hash", pretrained_hash_hex(ft.pretrained_hash())},
          {"block_size", ft.block_size()},
          {"alpha", ft.finetuning_options().alpha},
          {"group_alpha", ft.finetuning_options().group_alpha}};
}

// ---- reading ----

struct Loaded {
  CheckpointInfo info;
  safetensors::File file;
  json mapper;
  std::vector<std::pair<std::string, std::vector<std::string>>> groups;  // group -> parameter names
};

// LRD and pruning add-ons (metadata "add_ons", written when either is on): the LRD rank (0 unless the
// generator is an LRDGenerator) and MappingOptions::prune_fraction. Both change what the latents
// generate while the latents keep their shapes, so a checkpoint must not load across them.
json add_ons_json(const MappingModel& model) {
  const auto* lrd = dynamic_cast<const LRDGenerator*>(&model.generator());
  return {{"lrd_rank", lrd != nullptr ? lrd->rank() : int64_t{0}}, {"prune_fraction", model.options().prune_fraction}};
}

json metadata_json(const std::string& path, const safetensors::File& file, const std::string& key) {
  try {
    return json::parse(file.metadata.at(key));
  } catch (const json::exception& e) {
    invalid(path, str("metadata '", key, "' is not JSON: ", e.what()));
  }
}

Loaded read(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) throw IOError(str("checkpoint not found: ", path));
  Loaded out;
  try {
    out.file = safetensors::load(path);
  } catch (const Error& e) {
    invalid(path, e.what());
  }
  const safetensors::File& file = out.file;
  CheckpointInfo& info = out.info;

  // Version first: a newer file may have a layout this code cannot judge.
  if (!file.metadata.count("schema_version"))
    throw KeyError(str("checkpoint ", path,
                       " has no 'schema_version' in its metadata (not written by "
                       "save_checkpoint, or damaged)"));
  const json version = metadata_json(path, file, "schema_version");
  if (!version.is_number_integer() || version.get<int64_t>() < 1)
    invalid(path, str("schema_version must be a positive integer, got ", version.dump()));
  info.schema_version = version.get<int64_t>();
  if (info.schema_version > kMidEpochCheckpointSchemaVersion)
    throw ValueError(str("checkpoint ", path, " has schema_version ", info.schema_version,
                         ", newer than this library supports (", kMidEpochCheckpointSchemaVersion,
                         "); upgrade mapping_networks to read it"));

  for (const char* key : {"strategy", "seed", "latent_dims", "groups", "parameter_scaling", "spec", "mapper"})
    if (!file.metadata.count(key))
      throw KeyError(str("checkpoint ", path, " lacks the required metadata section '", key, "'"));

  // Each metadata section is decoded on its own, so a malformed one is named in the message.
  auto section = [&](const char* key, auto&& decode) {
    try {
      decode();
    } catch (const json::exception& e) {
      invalid(path, str("malformed metadata '", key, "': ", e.what()));
    } catch (const ValueError& e) {  // e.g. a shape with too many dimensions
      invalid(path, str("malformed metadata '", key, "': ", e.what()));
    }
  };
  section("package_version", [&] {
    info.package_version = file.metadata.count("package_version")
                               ? metadata_json(path, file, "package_version").get<std::string>()
                               : "";
  });
  section("strategy", [&] { info.strategy = metadata_json(path, file, "strategy").get<std::string>(); });
  section("seed", [&] { info.seed = whole_number<uint64_t>(metadata_json(path, file, "seed")); });
  section("parameter_scaling",
          [&] { info.parameter_scaling = metadata_json(path, file, "parameter_scaling").get<bool>(); });
  section("spec", [&] {
    for (const json& item : metadata_json(path, file, "spec")) {
      Shape shape;
      for (const json& d : item.at(1)) shape.push_back(whole_number<int64_t>(d));
      info.spec.emplace_back(item.at(0).get<std::string>(), shape);
    }
  });
  section("groups", [&] {
    const json dims = metadata_json(path, file, "latent_dims");
    for (const json& item : metadata_json(path, file, "groups")) {
      const std::string name = item.at(0).get<std::string>();
      out.groups.emplace_back(name, item.at(1).get<std::vector<std::string>>());
      MN_CHECK(dims.contains(name), ValueError, "group '", name, "' has no entry in 'latent_dims'");
      info.latent_dims.emplace_back(name, whole_number<int64_t>(dims.at(name)));
    }
  });
  section("mapper", [&] { out.mapper = metadata_json(path, file, "mapper"); });
  section("metadata", [&] {
    if (file.metadata.count("metadata"))
      info.metadata = metadata_json(path, file, "metadata").get<std::map<std::string, std::string>>();
  });
  if (file.metadata.count("config")) info.config = file.metadata.at("config");
  if (file.metadata.count("finetuning")) info.finetuning = file.metadata.at("finetuning");
  section("trainer_state", [&] {
    if (!file.metadata.count("trainer_state")) return;
    const json state = metadata_json(path, file, "trainer_state");
    if (state.is_null()) return;
    info.trainer_state_json = file.metadata.at("trainer_state");
    TrainerState s = parse_trainer_state(state);
    for (const auto& entry : file.tensors)
      if (starts_with(entry.name, kOptimizerPrefix))
        s.optimizer[entry.name.substr(std::string(kOptimizerPrefix).size())] = entry.tensor;
    info.trainer_state = std::move(s);
  });
  for (const auto& [group, dim] : info.latent_dims) {
    const safetensors::Entry* z = file.find(kLatentPrefix + group);
    if (z == nullptr)
      invalid(path, str("no tensor '", kLatentPrefix, group, "' for latent group '", group, "'"));
    if (z->tensor.sizes() != Shape{dim})
      invalid(path, str("tensor '", kLatentPrefix, group, "' has shape ", z->tensor.sizes(), ", expected [",
                        dim, "]"));
  }
  if (info.parameter_scaling) {
    const safetensors::Entry* s = file.find(kScalesKey);
    if (s == nullptr || s->tensor.sizes() != Shape{static_cast<int64_t>(info.spec.size())})
      invalid(path, str("parameter scaling is on but tensor '", kScalesKey, "' is missing or not of shape [",
                        info.spec.size(), "]"));
  }
  return out;
}

// ---- compatibility with the model (before anything is changed) ----

void check_spec(const std::string& path, const std::vector<std::pair<std::string, Shape>>& saved,
                const ParameterSpec& model) {
  if (saved.size() != model.size())
    throw ValueError(str("checkpoint ", path, " holds ", saved.size(), " parameter tensors but the model has ",
                         model.size(), ". The target architecture differs."));
  std::vector<std::string> problems;
  for (size_t i = 0; i < saved.size(); ++i) {
    const auto& [name, shape] = saved[i];
    const ParameterEntry& e = model[i];
    if (name != e.name)
      problems.push_back(str("name mismatch at position ", i, ": checkpoint '", name, "' ", shape, ", model '",
                             e.name, "' ", e.shape));
    else if (shape != e.shape)
      problems.push_back(str("shape mismatch for '", name, "': checkpoint ", shape, ", model ", e.shape));
  }
  if (!problems.empty())
    throw ValueError(str("checkpoint ", path, " is incompatible with this model: ", joined(problems, "; ")));
}

bool same_generation(const std::string& a, const std::string& b) {
  // Layer-wise and lazy layer-wise share groups, latents and values bit for bit.
  auto family = [](const std::string& s) { return s == "lazy_layerwise" ? std::string("layerwise") : s; };
  return family(a) == family(b);
}

// A fine-tuning checkpoint's latents only mean something on top of the same pretrained weights.
void check_finetuning(const std::string& path, const CheckpointInfo& info, const FineTuningGenerator& ft) {
  MN_CHECK(!info.finetuning.empty(), ValueError, "checkpoint ", path,
           " records no pretrained weights (metadata 'finetuning'), so it cannot be checked against the model's ",
           ft.pretrained_path());
  try {
    const json saved = json::parse(info.finetuning);
    const json mine = finetuning_json(ft);
    const std::string saved_hash = saved.at("hash").get<std::string>();
    MN_CHECK(saved_hash == mine.at("hash").get<std::string>(), ValueError, "checkpoint ", path,
             " was fine-tuned from pretrained weights ", saved.at("pretrained").get<std::string>(), " (hash ",
             saved_hash, ") but the model's pretrained weights ", ft.pretrained_path(), " have hash ",
             mine.at("hash").get<std::string>(), ": a different file, so the latents would modulate other weights");
    for (const char* key : {"block_size", "alpha", "group_alpha"})
      MN_CHECK(saved.at(key) == mine.at(key), ValueError, "checkpoint ", path, " was fine-tuned with ", key, " ",
               saved.at(key).dump(), " but the model uses ", mine.at(key).dump());
  } catch (const json::exception& e) {
    invalid(path, str("malformed 'finetuning' metadata: ", e.what()));
  }
}

void check_generator(const std::string& path, const Loaded& loaded, const MappingModel& model) {
  const CheckpointInfo& info = loaded.info;
  const ParameterGenerator& gen = model.generator();
  MN_CHECK(same_generation(info.strategy, gen.strategy()), ValueError, "checkpoint ", path,
           " was saved with strategy '", info.strategy, "' but the model uses '", gen.strategy(),
           "'; build the model with strategy '", info.strategy, "'");
  std::vector<std::string> saved_groups, model_groups;
  for (const auto& [name, dim] : info.latent_dims) saved_groups.push_back(name);
  for (const auto& g : gen.groups()) model_groups.push_back(g.name);
  MN_CHECK(saved_groups == model_groups, ValueError, "checkpoint ", path, " has latent groups [",
           joined(saved_groups), "] but the model has [", joined(model_groups), "]");
  for (size_t i = 0; i < gen.groups().size(); ++i) {
    const Group& g = gen.groups()[i];
    MN_CHECK(info.latent_dims[i].second == g.latent_dim, ValueError, "latent dimension mismatch for group '",
             g.name, "': checkpoint ", info.latent_dims[i].second, ", model ", g.latent_dim, " (checkpoint ",
             path, ")");
    std::vector<std::string> members;
    for (size_t e : g.entries) members.push_back(gen.parameter_spec()[e].name);
    MN_CHECK(loaded.groups[i].second == members, ValueError, "group '", g.name, "' holds [",
             joined(loaded.groups[i].second), "] in checkpoint ", path, " but [", joined(members),
             "] in the model");
  }
  MN_CHECK(info.seed == gen.options().seed, ValueError, "checkpoint ", path, " was saved with seed ", info.seed,
           " but the model's mappers were built from seed ", gen.options().seed,
           "; the mapper matrices are regenerated from the seed, so build the model with seed ", info.seed);
  const json current = mapper_json(model);
  try {
    // Checkpoints written before the construction was recorded used double-precision factorisations.
    // Checkpoints written before the families existed used the block family.
    const std::string saved_family = loaded.mapper.value("family", "block");
    const std::string family = current.at("family").get<std::string>();
    MN_CHECK(saved_family == family, ValueError, "checkpoint ", path, " was saved with the '", saved_family,
             "' mapper family but the model uses '", family,
             "': its latents would generate different parameters; build the model with mapper = \"", saved_family,
             "\" (mn-train --mapper ", saved_family, ")");
    const std::string construction = loaded.mapper.value("construction", "block-orthogonal/philox-householder-f64");
    const char* mine = mapper_construction(parse_mapper_family(family));
    MN_CHECK(construction == mine, ValueError, "checkpoint ", path, " was written with the mapper construction '",
             construction, "' but this library builds '", mine, "': its latents would generate different parameters");
    for (const auto& g : gen.groups()) {
      const std::string saved = loaded.mapper.at("groups").at(g.name).get<std::string>();
      const std::string mine = current.at("groups").at(g.name).get<std::string>();
      MN_CHECK(saved == mine, ValueError, "mapper mismatch for group '", g.name, "': checkpoint ", saved,
               ", model ", mine, " (checkpoint ", path, ")");
    }
    if (loaded.mapper.at("default").get<bool>() && current.at("default").get<bool>()) {
      const double saved_alpha = loaded.mapper.at("alpha").get<double>();
      MN_CHECK(saved_alpha == model.options().alpha, ValueError, "checkpoint ", path, " was saved with alpha ",
               saved_alpha, " but the model uses alpha ", model.options().alpha);
    }
  } catch (const json::exception& e) {
    invalid(path, str("malformed 'mapper' metadata: ", e.what()));
  }
  if (loaded.file.metadata.count("add_ons") || add_ons_json(model) != json{{"lrd_rank", 0}, {"prune_fraction", 0.0}}) {
    int64_t saved_rank = 0;
    double saved_prune = 0.0;
    if (loaded.file.metadata.count("add_ons")) {
      try {
        const json saved = metadata_json(path, loaded.file, "add_ons");
        saved_rank = saved.at("lrd_rank").get<int64_t>();
        saved_prune = saved.at("prune_fraction").get<double>();
      } catch (const json::exception& e) {
        invalid(path, str("malformed 'add_ons' metadata: ", e.what()));
      }
    }
    const json mine = add_ons_json(model);
    MN_CHECK(saved_rank == mine.at("lrd_rank").get<int64_t>(), ValueError, "checkpoint ", path,
             " was saved with lrd_rank ", saved_rank, " but the model uses ", mine.at("lrd_rank").get<int64_t>());
    MN_CHECK(saved_prune == mine.at("prune_fraction").get<double>(), ValueError, "checkpoint ", path,
             " was saved with prune_fraction ", saved_prune, " but the model uses ",
             mine.at("prune_fraction").get<double>());
  }
  if (const auto* ft = dynamic_cast<const FineTuningGenerator*>(&gen)) check_finetuning(path, info, *ft);
  MN_CHECK(info.parameter_scaling || !gen.scaling_initialized(), ValueError, "checkpoint ", path,
           " was saved without parameter scaling but the model scales its parameters; build it with "
           "parameter_scaling = false");
}

nn::StateDict checked_buffers(const std::string& path, const safetensors::File& file,
                              const MappingModel& model) {
  nn::StateDict saved;
  for (const auto& entry : file.tensors)
    if (starts_with(entry.name, kBufferPrefix))
      saved[entry.name.substr(std::string(kBufferPrefix).size())] = entry.tensor;
  if (saved.empty()) return saved;
  std::vector<std::string> problems;
  for (const auto& [name, t] : model.buffers()) {
    auto it = saved.find(name);
    if (it == saved.end())
      problems.push_back(str("missing buffer '", name, "'"));
    else if (it->second.sizes() != t.sizes())
      problems.push_back(str("shape mismatch for buffer '", name, "': checkpoint ", it->second.sizes(),
                             ", model ", t.sizes()));
  }
  for (const auto& [name, t] : saved)
    if (!model.buffers().count(name)) problems.push_back(str("unexpected buffer '", name, "'"));
  MN_CHECK(problems.empty(), ValueError, "checkpoint ", path,
           " is incompatible with this model's buffers: ", joined(problems, "; "));
  return saved;
}

std::string encode(const json& j) {
  try {
    return j.dump();
  } catch (const json::exception& e) {  // invalid UTF-8 in a user string
    throw ValueError(str("save_checkpoint: cannot encode metadata as JSON: ", e.what()));
  }
}

// The optimizer's own load_state_dict checks, done up front so that a mismatch leaves the model as it
// was; the message gains the file's name.
void check_optimizer_state(const std::string& path, const nn::optim::OptimizerState& state,
                           const nn::optim::Optimizer& optimizer) {
  optimizer.check_state_dict(state, str("checkpoint ", path, ": optimizer state"));
}

// The saved trainable loss coefficients, checked against the trainer's (names and shapes).
std::map<std::string, Tensor> checked_loss_parameters(const std::string& path, const safetensors::File& file,
                                                      const MappingTrainer& trainer) {
  std::map<std::string, Tensor> saved;
  for (const auto& entry : file.tensors)
    if (starts_with(entry.name, kLossPrefix))
      saved[entry.name.substr(std::string(kLossPrefix).size())] = entry.tensor;
  if (saved.empty()) return saved;  // none saved: the trainer keeps its own
  const auto current = trainer.loss().named_coefficient_parameters();
  std::vector<std::string> saved_names, current_names;
  for (const auto& [name, t] : saved) saved_names.push_back(name);
  for (const auto& [name, t] : current) current_names.push_back(name);
  std::sort(current_names.begin(), current_names.end());
  MN_CHECK(saved_names == current_names, ValueError, "checkpoint ", path,
           " holds trainable loss coefficients [", joined(saved_names), "] but the trainer's loss has [",
           joined(current_names), "]");
  for (const auto& [name, t] : current)
    MN_CHECK(saved.at(name).sizes() == t.sizes(), ValueError, "checkpoint ", path, ": loss coefficient '", name,
             "' has shape ", saved.at(name).sizes(), ", the trainer's ", t.sizes());
  return saved;
}

}  // namespace

CheckpointExtras checkpoint_extras(const MappingTrainer& trainer, std::map<std::string, std::string> metadata) {
  CheckpointExtras extras;
  extras.trainer_state = trainer.state();
  extras.optimizer_lr = trainer.learning_rate();
  extras.loss_parameters = trainer.loss().named_coefficient_parameters();
  extras.metadata = std::move(metadata);
  return extras;
}

void save_checkpoint(const std::string& path, const MappingModel& model, const CheckpointExtras& extras) {
  MN_CHECK(!path.empty(), ValueError, "save_checkpoint: path must be non-empty");
  const ParameterGenerator& gen = model.generator();
  safetensors::NamedTensors tensors;
  json latent_dims = json::object(), groups = json::array();
  for (const auto& g : gen.groups()) {
    tensors.emplace_back(kLatentPrefix + g.name, g.latent.detach());
    latent_dims[g.name] = g.latent_dim;
    json members = json::array();
    for (size_t e : g.entries) members.push_back(gen.parameter_spec()[e].name);
    groups.push_back(json::array({g.name, members}));
  }
  const std::vector<float> scales = gen.per_entry_scales();
  if (!scales.empty())
    tensors.emplace_back(kScalesKey, from_vector(scales, {static_cast<int64_t>(scales.size())}));
  for (const auto& [name, t] : model.buffers()) tensors.emplace_back(kBufferPrefix + name, t.detach());

  json spec = json::array();
  for (const auto& e : gen.parameter_spec().entries())
    spec.push_back(json::array({e.name, shape_json(e.shape)}));

  safetensors::StringMap metadata;
  metadata["format"] = encode(kFormat);
  const bool mid_epoch = extras.trainer_state && extras.trainer_state->progress;
  metadata["schema_version"] = encode(mid_epoch ? kMidEpochCheckpointSchemaVersion : kCheckpointSchemaVersion);
  metadata["package_version"] = encode(kPackageVersion);
  metadata["strategy"] = encode(gen.strategy());
  metadata["seed"] = encode(gen.options().seed);
  metadata["latent_dims"] = encode(latent_dims);
  metadata["groups"] = encode(groups);
  metadata["parameter_scaling"] = encode(!scales.empty());
  metadata["mapper"] = encode(mapper_json(model));
  const json add_ons = add_ons_json(model);
  if (add_ons.at("lrd_rank") != 0 || add_ons.at("prune_fraction") != 0.0) metadata["add_ons"] = encode(add_ons);
  metadata["spec"] = encode(spec);
  metadata["metadata"] = encode(json(extras.metadata));
  if (const auto* ft = dynamic_cast<const FineTuningGenerator*>(&gen)) metadata["finetuning"] = encode(finetuning_json(*ft));
  if (!extras.config.empty()) {
    try {
      metadata["config"] = encode(json::parse(extras.config));
    } catch (const json::exception& e) {
      throw ValueError(str("save_checkpoint: config must be JSON text: ", e.what()));
    }
  }
  if (extras.trainer_state) {
    const TrainerState& s = *extras.trainer_state;
    TrainerState state = s;
    if (extras.optimizer_lr) state.learning_rate = extras.optimizer_lr;
    metadata["trainer_state"] = encode(train::detail::trainer_state_json(state));
    for (const auto& [key, t] : s.optimizer) tensors.emplace_back(kOptimizerPrefix + key, t.detach());
  }
  for (const auto& [name, t] : extras.loss_parameters) tensors.emplace_back(kLossPrefix + name, t.detach());
  safetensors::save(path, tensors, metadata);
}

CheckpointInfo read_checkpoint(const std::string& path) { return read(path).info; }

CheckpointInfo load_checkpoint(const std::string& path, MappingModel& model, MappingTrainer* trainer) {
  MN_CHECK(trainer == nullptr || &trainer->model() == &model, ValueError,
           "load_checkpoint: the trainer must be the one training this model");
  Loaded loaded = read(path);
  // Everything is checked before the model changes.
  check_spec(path, loaded.info.spec, model.parameter_spec());
  check_generator(path, loaded, model);
  nn::StateDict buffers = checked_buffers(path, loaded.file, model);
  const std::map<std::string, Tensor> loss_parameters =
      trainer != nullptr ? checked_loss_parameters(path, loaded.file, *trainer)
                         : std::map<std::string, Tensor>{};
  if (trainer != nullptr && loaded.info.trainer_state)
    check_optimizer_state(path, loaded.info.trainer_state->optimizer, trainer->optimizer());

  ParameterGenerator& gen = model.generator();
  {
    // In place: the latents stay the same tensors, so an optimizer built over them remains valid.
    autograd::NoGradGuard no_grad;
    for (const auto& [name, z] : gen.named_latents()) {
      Tensor saved = loaded.file.at(kLatentPrefix + name);
      Tensor target = z;
      target.copy_(saved.to(z.device()));
    }
    if (trainer != nullptr && !loss_parameters.empty())
      for (const auto& [name, rho] : trainer->loss().named_coefficient_parameters()) {
        Tensor target = rho;
        target.copy_(loss_parameters.at(name).to(rho.device()));
      }
  }
  if (loaded.info.parameter_scaling) gen.set_scales(loaded.file.at(kScalesKey).to_vector<float>());
  if (!buffers.empty()) {
    for (auto& [name, t] : buffers) t = t.to(model.device());
    model.set_buffers(buffers);
  }
  if (trainer != nullptr && loaded.info.trainer_state) trainer->load_state(*loaded.info.trainer_state);
  return loaded.info;
}

void export_generated_parameters(const std::string& path, const MappingModel& model) {
  MN_CHECK(!path.empty(), ValueError, "export_generated_parameters: path must be non-empty");
  ParameterTree tree;
  {
    autograd::NoGradGuard no_grad;
    tree = model.generate_parameters();
  }
  safetensors::NamedTensors tensors;
  for (const auto& [name, t] : tree.items()) tensors.emplace_back(name, t);
  // The buffers (BatchNorm running statistics) too, so the file is the target's whole state dict, as
  // torch's load_state_dict(strict=True) wants it.
  for (const auto& [name, t] : model.buffers()) tensors.emplace_back(name, t.detach());
  safetensors::StringMap metadata{{"format", encode("mapping_networks.generated_parameters")},
                                  {"package_version", encode(kPackageVersion)},
                                  {"strategy", encode(model.strategy())},
                                  {"seed", encode(model.generator().options().seed)}};
  safetensors::save(path, tensors, metadata);
}

}  // namespace mn::mapping
