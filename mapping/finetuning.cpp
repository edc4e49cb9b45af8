#include "mapping/finetuning.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string_view>
#include <vector>

#include "autograd/node.h"
#include "autograd/ops.h"
#include "core/random.h"
#include "nn/safetensors.h"

namespace mn::mapping {

PretrainedWeights load_pretrained(const std::string& path) {
  std::error_code ec;
  MN_CHECK(std::filesystem::is_regular_file(path, ec), IOError, "pretrained weights not found: ", path,
           " (a safetensors state dict, e.g. what mn-train --out exports)");
  std::ifstream in(path, std::ios::binary);
  MN_CHECK(in.good(), IOError, "cannot open pretrained weights ", path);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  MN_CHECK(!in.bad(), IOError, "cannot read pretrained weights ", path);
  PretrainedWeights out;
  out.path = path;
  // core's FNV-1a 64 (the stream-key hash) over the bytes: detects a different file, not an attacker.
  out.hash = stream_key(std::string_view(bytes.data(), bytes.size()));
  const safetensors::File file =
      safetensors::parse(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), path);
  for (const auto& entry : file.tensors) {
    out.tensors[entry.name] = entry.tensor;
    out.dtypes[entry.name] = entry.dtype;
  }
  return out;
}

std::string pretrained_hash_hex(uint64_t hash) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(hash));
  return buf;
}

namespace {

// Every spec parameter must be in the file with its shape and a float dtype (all problems in one
// message); the file may hold more (buffers, other heads).
const ParameterSpec& check_pretrained(const ParameterSpec& spec, const PretrainedWeights& pre,
                                      const FineTuningOptions& ft) {
  MN_CHECK(ft.block_size > 0, ValueError, "fine-tuning block size must be positive, got ", ft.block_size);
  MN_CHECK(std::isfinite(ft.alpha), ValueError, "fine-tuning alpha must be finite, got ", ft.alpha);
  for (const auto& [group, a] : ft.group_alpha)
    MN_CHECK(std::isfinite(a), ValueError, "fine-tuning alpha of group '", group, "' must be finite, got ", a);
  std::vector<std::string> missing, problems;
  for (const auto& e : spec.entries()) {
    auto it = pre.tensors.find(e.name);
    if (it == pre.tensors.end()) {
      missing.push_back(e.name);
    } else if (it->second.sizes() != e.shape) {
      problems.push_back(str("shape mismatch for '", e.name, "': file ", it->second.sizes(), ", target ", e.shape));
    } else if (it->second.dtype() != kFloat32) {
      const auto d = pre.dtypes.find(e.name);
      problems.push_back(str("'", e.name, "' is stored as ", d != pre.dtypes.end() ? d->second : "an integer dtype",
                             ", a parameter needs a float dtype (F32, F64, F16, BF16)"));
    }
  }
  if (!missing.empty()) problems.insert(problems.begin(), str("missing ", bracket_list(missing)));
  MN_CHECK(problems.empty(), ValueError, "pretrained weights ", pre.path, " do not fit the target: ",
           joined(problems, "; "));
  return spec;
}

// Each layer-wise group's mapper produces one modulation element per block of L_b parameters.
std::map<std::string, int64_t> block_output_dims(const ParameterSpec& spec, int64_t block) {
  MN_CHECK(block > 0, ValueError, "block size must be positive, got ", block);
  std::map<std::string, int64_t> dims;
  for (const auto& [group, names] : layerwise_groups(spec)) {
    int64_t n = 0;
    for (const auto& name : names) n += spec.entry(name).numel;
    dims[group] = (n + block - 1) / block;
  }
  return dims;
}

}  // namespace

FineTuningGenerator::FineTuningGenerator(ParameterSpec spec, int64_t latent_dim, const PretrainedWeights& pretrained,
                                         FineTuningOptions finetuning, GeneratorOptions options)
    : GroupedGenerator(check_pretrained(spec, pretrained, finetuning), layerwise_groups(spec),
                       [&] {
                         MN_CHECK(latent_dim > 0, ValueError, "latent_dim must be positive, got ", latent_dim);
                         std::map<std::string, int64_t> dims;
                         for (const auto& [name, params] : layerwise_groups(spec)) dims[name] = latent_dim;
                         return dims;
                       }(),
                       options, block_output_dims(spec, finetuning.block_size)),
      finetuning_(std::move(finetuning)),
      pretrained_path_(pretrained.path),
      pretrained_hash_(pretrained.hash) {
  for (const auto& [group, a] : finetuning_.group_alpha) {
    bool known = false;
    for (const auto& g : groups_) known = known || g.name == group;
    MN_CHECK(known, KeyError, "fine-tuning alpha given for unknown group '", group, "'; groups: ",
             bracket_list(group_names()));
  }
  autograd::NoGradGuard no_grad;
  const int64_t block = finetuning_.block_size;
  for (auto& g : groups_) {
    // The group's pretrained values in its flat order, padded with zeros to whole blocks, as [m, L_b]:
    // generate_group adds each block's modulation element by broadcasting.
    std::vector<Tensor> parts;
    for (size_t k = 0; k < g.entries.size(); ++k)
      parts.push_back(pretrained.tensors.at(spec_[g.entries[k]].name).reshape({-1}));
    const int64_t n = g.local_spec.total_numel();
    const int64_t m = g.mapper->output_dim();
    if (m * block > n) parts.push_back(zeros({m * block - n}));
    Tensor flat = parts.size() == 1 ? parts[0].clone() : cat(parts, 0);
    g.offset = flat.view({m, block});
    if (!options_.device.is_cpu()) g.offset = g.offset.to(options_.device);
  }
  std::set<std::string> parameters;
  for (const auto& e : spec_.entries()) parameters.insert(e.name);
  for (const auto& [name, t] : pretrained.tensors)
    if (!parameters.count(name)) extras_[name] = t;
}

double FineTuningGenerator::group_alpha(const std::string& group) const {
  auto it = finetuning_.group_alpha.find(group);
  return it != finetuning_.group_alpha.end() ? it->second : finetuning_.alpha;
}

void FineTuningGenerator::initialize_parameter_scaling(const nn::Module&) {}

void FineTuningGenerator::set_scales(const std::vector<float>&) {
  throw ValueError("a fine-tuning generator has no parameter scales: its map modulates pretrained weights");
}

Tensor FineTuningGenerator::generate_group(const Group& g, const LatentOverrides& latents) const {
  auto it = latents.find(g.name);
  const Tensor& z = it != latents.end() ? it->second : g.latent;
  const Tensor o = g.mapper->forward(z);  // [m] modulation elements
  // repeat_each(o, L_b) as a broadcast: [m, 1] against the [m, L_b] pretrained blocks, so the repeats
  // are never materialised; the one output is the (padded) parameter vector.
  Tensor theta = add(g.offset, unsqueeze(mul(o, group_alpha(g.name)), 1));
  theta = theta.view({theta.numel()});
  const int64_t n = g.local_spec.total_numel();
  return theta.numel() == n ? theta : narrow(theta, 0, 0, n);
}

}  // namespace mn::mapping
