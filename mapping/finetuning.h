#pragma once
// Fine-tuning a pretrained target through latents (the reference's FineTuningGenerator). The groups are
// the layer-wise ones; group g's mapper produces m_g = ceil(n_g / L_b) modulation elements o_g, and
//   theta_g = theta_g^pre + alpha_g * repeat_each(o_g, L_b)[:n_g]
// where repeat_each repeats every element L_b times in a row. The blocks follow the group's flat
// layout (weight, then bias), so one block may straddle both. Only the latents train; the pretrained
// values are fixed buffers of the generator (Group::offset, moved by to()).
//
// The pretrained weights come from a safetensors state dict with PyTorch names: what mn-train --out
// writes (export_generated_parameters / nn::save) or what torch's safetensors save_file writes. Every
// parameter of the spec must be in it with its shape and a float dtype; other entries (BatchNorm
// running statistics, ...) are allowed, and MappingModel takes the target's buffers from them.
// Checkpoints record the file's path and content hash (FNV-1a 64 of its bytes), never its tensors.
#include <cstdint>
#include <map>
#include <string>

#include "mapping/generator.h"

namespace mn::mapping {

struct PretrainedWeights {
  std::string path;
  uint64_t hash = 0;                             // FNV-1a 64 of the file's bytes (pretrained_hash_hex)
  std::map<std::string, Tensor> tensors;         // every tensor of the file (f32, or i64 for integer dtypes)
  std::map<std::string, std::string> dtypes;     // each tensor's dtype as stored ("F32", "I64", ...)
};

// Reads a safetensors file and hashes its bytes. IOError for a missing or broken file.
PretrainedWeights load_pretrained(const std::string& path);
// The hash as 16 lowercase hex digits (what checkpoints record).
std::string pretrained_hash_hex(uint64_t hash);

struct FineTuningOptions {
  int64_t block_size = 250;                   // L_b: parameters sharing one modulation element
  double alpha = 0.01;                        // alpha_ft: strength of the modulation
  std::map<std::string, double> group_alpha;  // per layer-wise group (e.g. "features.0"); others: alpha
};

class FineTuningGenerator : public GroupedGenerator {
 public:
  // ValueError for block_size <= 0 or a non-finite alpha; KeyError for a group_alpha naming no group;
  // ValueError listing every spec parameter that the file lacks or holds with another shape or an
  // integer dtype.
  FineTuningGenerator(ParameterSpec spec, int64_t latent_dim, const PretrainedWeights& pretrained,
                      FineTuningOptions finetuning = {}, GeneratorOptions options = {});
  std::string strategy() const override { return "finetuning"; }

  // No parameter scaling: the map produces modulation elements added to pretrained weights, not the
  // weights themselves, so the target's init spread has nothing to scale (the reference skips it too).
  // A no-op here, so MappingOptions::parameter_scaling (on by default) is simply not applied.
  void initialize_parameter_scaling(const nn::Module& target) override;
  // ValueError: a fine-tuning generator has no scales to restore.
  void set_scales(const std::vector<float>& per_entry_scales) override;

  int64_t block_size() const { return finetuning_.block_size; }
  const FineTuningOptions& finetuning_options() const { return finetuning_; }
  double group_alpha(const std::string& group) const;
  const std::string& pretrained_path() const { return pretrained_path_; }
  uint64_t pretrained_hash() const { return pretrained_hash_; }
  // The file's entries that are not parameters of the spec (e.g. BatchNorm running statistics).
  const std::map<std::string, Tensor>& pretrained_extras() const { return extras_; }

 protected:
  Tensor generate_group(const Group& g, const LatentOverrides& latents) const override;
  bool groups_are_mapper_outputs() const override { return false; }

 private:
  FineTuningOptions finetuning_;
  std::string pretrained_path_;
  uint64_t pretrained_hash_ = 0;
  std::map<std::string, Tensor> extras_;
};

}  // namespace mn::mapping
