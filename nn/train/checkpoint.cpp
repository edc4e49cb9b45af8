#include "nn/train/checkpoint.h"

#include <cmath>
#include <filesystem>
#include <limits>

#include "autograd/node.h"
#include "core/random.h"
#include "nn/safetensors.h"
#include "nn/train/state_json.h"
#include "nn/train/trainer.h"

namespace mn::train {

namespace {

using json = nlohmann::json;

constexpr const char* kFormat = "mn.train.checkpoint";
constexpr const char* kLegacyDirectFormat = "mn-train.direct";
constexpr int64_t kSchemaVersion = 1;
// A mid-epoch state (trainer_state.progress): a reader that does not know the position would restart the
// epoch with advanced optimizer and random state, so such files carry a version older builds refuse.
constexpr int64_t kMidEpochSchemaVersion = 2;
constexpr const char* kOptimizerPrefix = "optimizer/";

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

// One metadata value as JSON; a missing key or a value that is not JSON names the file and the key.
json metadata_value(const std::string& path, const safetensors::File& file, const char* key) {
  auto it = file.metadata.find(key);
  MN_CHECK(it != file.metadata.end(), IOError, "checkpoint ", path, " lacks the metadata key '", key, "'");
  try {
    return json::parse(it->second);
  } catch (const json::exception& e) {
    throw IOError(str("checkpoint ", path, ": metadata '", key, "' is not JSON: ", e.what()));
  }
}

// mn-train's direct checkpoints before the generic trainer: epoch, optimizer_lr and a history of
// train_loss, train_accuracy and test_accuracy.
TrainerState legacy_direct_state(const std::string& path, const safetensors::File& file) {
  const json lr = metadata_value(path, file, "optimizer_lr"), epoch = metadata_value(path, file, "epoch");
  const json history = metadata_value(path, file, "history");
  MN_CHECK(lr.is_number() && epoch.is_number_integer() && history.is_object(), IOError, "checkpoint ", path,
           ": malformed metadata (optimizer_lr ", lr.dump(), ", epoch ", epoch.dump(), ", history of type ",
           history.type_name(), ")");
  TrainerState s;
  s.epoch = detail::whole_number<int64_t>(epoch);
  MN_CHECK(s.epoch >= 0, IOError, "checkpoint ", path, ": epoch must be non-negative, got ", s.epoch);
  s.learning_rate = lr.get<double>();
  auto series = [&](const char* key) {
    MN_CHECK(history.contains(key) && history.at(key).is_array(), IOError, "checkpoint ", path,
             ": metadata 'history' lacks the list '", key, "'");
    std::vector<double> values;
    for (const json& v : history.at(key)) {
      MN_CHECK(v.is_null() || v.is_number(), IOError, "checkpoint ", path, ": history '", key,
               "' holds a non-number ", v.dump());
      values.push_back(v.is_null() ? std::numeric_limits<double>::quiet_NaN() : v.get<double>());
    }
    return values;
  };
  const std::vector<double> loss = series("train_loss"), accuracy = series("train_accuracy"),
                            test_accuracy = series("test_accuracy");
  const std::vector<double> unknown(loss.size(), std::numeric_limits<double>::quiet_NaN());
  namespace k = history_keys;
  s.history.values() = {{k::kTrainTaskLoss, loss}, {k::kTrainTotalLoss, loss},     {k::kTrainAccuracy, accuracy},
                        {k::kValAccuracy, test_accuracy}, {k::kValTaskLoss, unknown}, {k::kValTotalLoss, unknown},
                        {k::kLearningRate, unknown}};
  return s;
}

}  // namespace

void save_module_checkpoint(const std::string& path, const Trainer& trainer, const CheckpointMetadata& metadata) {
  MN_CHECK(!path.empty(), ValueError, "save_checkpoint: path must be non-empty");
  const TrainerState s = trainer.state();
  safetensors::NamedTensors tensors;
  for (const auto& [name, t] : trainer.module().state_dict()) tensors.emplace_back(name, t.detach());
  for (const auto& [key, t] : s.optimizer) tensors.emplace_back(kOptimizerPrefix + key, t.detach());
  safetensors::StringMap meta;
  try {
    meta["format"] = json(kFormat).dump();
    meta["schema_version"] = json(s.progress ? kMidEpochSchemaVersion : kSchemaVersion).dump();
    meta["trainer_state"] = detail::trainer_state_json(s).dump();
    meta["metadata"] = json(metadata.metadata).dump();
    if (!metadata.config.empty()) meta["config"] = json::parse(metadata.config).dump();
  } catch (const json::exception& e) {
    throw ValueError(str("save_checkpoint: cannot encode the metadata as JSON: ", e.what()));
  }
  safetensors::save(path, tensors, meta);
}

ModuleCheckpoint read_module_checkpoint(const std::string& path) {
  MN_CHECK(std::filesystem::exists(path), IOError, "checkpoint not found: ", path);
  const safetensors::File file = safetensors::load(path);
  ModuleCheckpoint out;
  const json format = metadata_value(path, file, "format");
  MN_CHECK(format == kFormat || format == kLegacyDirectFormat, ValueError, "checkpoint ", path,
           " is not a trainer checkpoint of a plain module (format ", format.dump(), ", expected \"", kFormat, "\")");
  out.format = format.get<std::string>();
  nn::optim::OptimizerState optimizer;
  for (const auto& e : file.tensors) {
    if (starts_with(e.name, kOptimizerPrefix))
      optimizer[e.name.substr(std::string(kOptimizerPrefix).size())] = e.tensor;
    else
      out.state[e.name] = e.tensor;
  }
  if (file.metadata.count("config")) out.metadata.config = metadata_value(path, file, "config").dump();
  if (out.format == kLegacyDirectFormat) {
    out.trainer_state = legacy_direct_state(path, file);
    out.metadata.metadata = {{"program", "mn-train"}};
  } else {
    const json version = metadata_value(path, file, "schema_version");
    MN_CHECK(version.is_number_integer() && version.get<int64_t>() <= kMidEpochSchemaVersion, ValueError, "checkpoint ",
             path, " has schema_version ", version.dump(), "; this build reads up to ", kMidEpochSchemaVersion,
             " (written by a newer version?)");
    try {
      out.trainer_state = detail::parse_trainer_state(metadata_value(path, file, "trainer_state"));
      if (file.metadata.count("metadata"))
        out.metadata.metadata = metadata_value(path, file, "metadata").get<std::map<std::string, std::string>>();
    } catch (const json::exception& e) {
      throw IOError(str("checkpoint ", path, ": malformed trainer state: ", e.what()));
    } catch (const ValueError& e) {
      throw IOError(str("checkpoint ", path, ": malformed trainer state: ", e.what()));
    }
  }
  out.trainer_state->optimizer = std::move(optimizer);
  return out;
}

void load_module_checkpoint(const std::string& path, Trainer& trainer) {
  ModuleCheckpoint saved = read_module_checkpoint(path);
  nn::Module& module = trainer.module();
  // Everything is checked before anything changes: names and shapes of the module's tensors, then the
  // optimizer state against the optimizer.
  std::map<std::string, Shape> expected;
  for (const auto& [name, t] : module.named_parameters()) expected[name] = t.sizes();
  for (const auto& [name, t] : module.named_buffers()) expected[name] = t.sizes();
  std::vector<std::string> problems;
  for (const auto& [name, shape] : expected) {
    auto it = saved.state.find(name);
    if (it == saved.state.end()) problems.push_back(str("missing '", name, "'"));
    else if (it->second.sizes() != shape)
      problems.push_back(str("'", name, "' has shape ", it->second.sizes(), ", the module's ", shape));
  }
  for (const auto& [name, t] : saved.state)
    if (!expected.count(name)) problems.push_back(str("unexpected '", name, "'"));
  if (!problems.empty()) {
    std::string joined;
    for (const std::string& p : problems) joined += (joined.empty() ? "" : "; ") + p;
    throw ValueError(str("checkpoint ", path, " does not fit the module: ", joined));
  }
  const std::vector<Tensor> params = trainer.trainable_parameters();
  const Device device = params.empty() ? kCPU : params.front().device();
  for (auto& [key, t] : saved.trainer_state->optimizer) t = t.to(device);
  trainer.optimizer().check_state_dict(saved.trainer_state->optimizer, str("checkpoint ", path, ": optimizer state"));
  {
    autograd::NoGradGuard no_grad;
    module.load_state_dict(saved.state);
  }
  if (saved.format == kLegacyDirectFormat) {
    // Not recorded in those files: the generators stay where they are.
    RngState& rng = saved.trainer_state->rng;
    rng = {trainer.generator().seed(), trainer.generator().offset(), default_generator().seed(),
           default_generator().offset()};
  }
  trainer.load_state(*saved.trainer_state);
}

}  // namespace mn::train
