#pragma once
// Generators own the trainable latents (one per group) and the fixed mappers, and turn them into the
// target's parameters. Groups:
//   slvt            one group "all" (every parameter, spec order), one latent of length L;
//   layerwise       one group per parameter-owning module (text before the last '.', "<root>" for
//                   top-level parameters), in order of first appearance; the groups' outputs are
//                   concatenated into the flat parameter vector, then cut into views;
//   lazy_layerwise  the same groups, latents and values, bit for bit, but each group's output is cut
//                   into views directly (no concatenated copy), so less memory is alive at once, and
//                   on CUDA the cache can be emptied after each group;
//   grouped         user-given groups (name -> parameter names, an exact partition of the spec) with
//                   one latent size for all or one per group.
// Each group computes theta_g = s_g * mapper_g(z_g), s_g the per-tensor init scale of the target
// (population std; a bias falls back to its weight's std; 1 when < 1e-5 or for one-element tensors).
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "mapping/fused_group.h"
#include "mapping/mapper.h"
#include "mapping/parameter_spec.h"

namespace mn::nn {
class Module;
}

namespace mn::mapping {

using LatentOverrides = std::map<std::string, Tensor>;

struct Group {
  std::string name;
  std::vector<size_t> entries;  // indices into the global spec, in this group's order
  ParameterSpec local_spec;     // the group's own flat layout (from offset 0)
  int64_t latent_dim = 0;
  Tensor latent;                // trainable leaf, N(0, 1/L)
  std::shared_ptr<Mapper> mapper;
  Tensor scale;                 // [n] per-element init scale, undefined until scaling is initialised
  // Fixed values the group's output is added to (fine-tuning: the pretrained parameters, padded to whole
  // blocks); undefined for the other generators. Moved by to(), listed by buffers() and fixed_bytes().
  Tensor offset;
};

struct GeneratorOptions {
  uint64_t seed = 0;
  // Builds each group's mapper. Default (empty): default_mapper_factory(alpha, the family below); a
  // factory given here counts as custom, and slvt's size guard then counts the full L x N matrix.
  MapperFactory mapper_factory;
  double alpha = 0.01;  // the default mapper's modulation (unused with a mapper_factory)
  Device device = kCPU;
  bool empty_cache_on_cuda = true;  // lazy_layerwise only
  int64_t max_projection_elements = 100'000'000;  // slvt only: guard on L * N (the reference's)
  bool allow_large = false;
  // The default mapper's fixed-matrix family: "block", "dense" or "srht" (mapping/orthogonal.h), and
  // the dense family's cap on one explicit matrix, in bytes (allow_large raises it). Checked even when
  // mapper_factory is given (then the factory decides the matrices, and this names them; with "dense"
  // every group's [n_g, L_g] matrix is checked against the cap before any mapper is built).
  std::string mapper = "block";
  int64_t max_dense_mapper_bytes = int64_t{1} << 30;
  // strategy "lrd" (make_generator): the rank of the factored 2-D weights (mapping/lrd.h); 0 elsewhere.
  int64_t lrd_rank = 0;
};

// The matrix options GeneratorOptions' mapper fields describe (ValueError for an unknown family).
MapperMatrixOptions mapper_matrix_options(const std::string& mapper, int64_t max_dense_mapper_bytes, bool allow_large);

class ParameterGenerator {
 public:
  virtual ~ParameterGenerator() = default;
  // Generated parameters with the target's names; `latents` replaces the named groups' latents
  // (unknown names are an error; missing names use the generator's own latents).
  virtual ParameterTree generate_parameters(const LatentOverrides& latents = {}) const = 0;
  virtual std::string strategy() const = 0;
  // The parameters of group `index` alone (target names; views of one generated vector), for callers
  // that generate layer by layer (MappingOptions::stream_layers).
  ParameterTree generate_group_parameters(size_t index, const LatentOverrides& latents = {}) const;
  // KeyError for an override naming no group, ValueError for one of the wrong shape.
  void check_overrides(const LatentOverrides& latents) const;

  const ParameterSpec& parameter_spec() const { return spec_; }
  const std::vector<Group>& groups() const { return groups_; }
  std::vector<std::string> group_names() const;
  std::vector<std::pair<std::string, Tensor>> named_latents() const;
  std::vector<Tensor> latents() const;
  // Sets the per-tensor scales from the target's current parameter values.
  virtual void initialize_parameter_scaling(const nn::Module& target);
  virtual void set_scales(const std::vector<float>& per_entry_scales);  // one per spec entry (checkpoints)
  std::vector<float> per_entry_scales() const;                   // empty if scaling is off
  bool scaling_initialized() const { return scaling_; }
  // Alignment summaries colmean(W'_g) per group (the first mapper layer's: Mapper::modulated_column_mean).
  std::map<std::string, Tensor> modulated_column_means(const LatentOverrides& latents = {}) const;
  int64_t trainable_parameter_count() const;
  // Bytes of the fixed mapper factors as stored, and as explicit matrices (sum_g L_g n_g * 4).
  size_t fixed_bytes() const;
  size_t fixed_projection_bytes() const;
  std::vector<Tensor> buffers() const;
  void to(Device device);
  Device device() const { return options_.device; }
  const GeneratorOptions& options() const { return options_; }

 protected:
  // output_dims: the mapper output length of the named groups when it is not the group's parameter
  // count (lrd maps to factors, finetuning to one value per block); a group not named maps to its n_g
  // values.
  ParameterGenerator(ParameterSpec spec, std::vector<std::pair<std::string, std::vector<std::string>>> groups,
                     std::map<std::string, int64_t> latent_dims, GeneratorOptions options,
                     const std::map<std::string, int64_t>& output_dims = {});
  // theta_g for one group (scaled): the group's n_g values in its local_spec layout. Virtual so that a
  // generator whose mapper output is not theta_g itself (lrd, finetuning) turns it into theta_g here,
  // and every caller (generate_parameters, generate_group_parameters, streaming) sees the same values.
  virtual Tensor generate_group(const Group& g, const LatentOverrides& latents) const;
  // What every caller uses: generate_group with autocast off, so the generated parameters are f32
  // (an autocast scope casts them where the target's ops use them; autograd/autocast.h).
  Tensor generate_group_f32(const Group& g, const LatentOverrides& latents) const;
  // Whether generate_group is the base's (the mapper's output times the scale): only then may
  // generate_parameters make all groups at once with the fused kernels (mapping/fused_group.h).
  virtual bool groups_are_mapper_outputs() const { return true; }
  // The group's fused form for latent z when the fused kernels can make it (fused_group), else nothing.
  std::optional<FusedGroup> fused_form(const Group& g, const Tensor& z) const;

  ParameterSpec spec_;
  std::vector<Group> groups_;
  GeneratorOptions options_;
  bool scaling_ = false;
  // spec order == group order, so the concatenated group outputs are the spec's flat vector
  bool groups_in_spec_order_ = false;
};

class SingleVectorGenerator : public ParameterGenerator {
 public:
  SingleVectorGenerator(ParameterSpec spec, int64_t latent_dim, GeneratorOptions options = {});
  ParameterTree generate_parameters(const LatentOverrides& latents = {}) const override;
  std::string strategy() const override { return "slvt"; }
};

class GroupedGenerator : public ParameterGenerator {
 public:
  GroupedGenerator(ParameterSpec spec, std::vector<std::pair<std::string, std::vector<std::string>>> groups,
                   std::map<std::string, int64_t> latent_dims, GeneratorOptions options = {});
  GroupedGenerator(ParameterSpec spec, std::vector<std::pair<std::string, std::vector<std::string>>> groups,
                   int64_t latent_dim, GeneratorOptions options = {});
  ParameterTree generate_parameters(const LatentOverrides& latents = {}) const override;
  std::string strategy() const override { return "grouped"; }

 protected:
  // For subclasses whose mappers produce output_dims values instead of n_g (lrd, finetuning).
  GroupedGenerator(ParameterSpec spec, std::vector<std::pair<std::string, std::vector<std::string>>> groups,
                   std::map<std::string, int64_t> latent_dims, GeneratorOptions options,
                   const std::map<std::string, int64_t>& output_dims);
};

// One latent per owner module (layerwise_groups). `latent_dims` gives some groups their own length
// (latent_dim is the others'); a name that is not a group is a KeyError listing the groups.
class LayerwiseGenerator : public GroupedGenerator {
 public:
  LayerwiseGenerator(ParameterSpec spec, int64_t latent_dim, GeneratorOptions options = {},
                     const std::map<std::string, int64_t>& latent_dims = {});
  std::string strategy() const override { return "layerwise"; }
};

class LazyLayerwiseGenerator : public LayerwiseGenerator {
 public:
  LazyLayerwiseGenerator(ParameterSpec spec, int64_t latent_dim, GeneratorOptions options = {},
                         const std::map<std::string, int64_t>& latent_dims = {});
  ParameterTree generate_parameters(const LatentOverrides& latents = {}) const override;
  std::string strategy() const override { return "lazy_layerwise"; }
};

// Owner-module groups of a spec: {"0": [0.weight, 0.bias], "<root>": [...]}, first-appearance order.
std::vector<std::pair<std::string, std::vector<std::string>>> layerwise_groups(const ParameterSpec& spec);

// Splits a budget of `total` latent values over `groups` by water-filling: every group gets the same
// share, except that no group gets more than its parameter count n_g (a latent longer than the values
// it generates adds trainable numbers that W z cannot use: rank(W) <= n_g), and what a capped group
// leaves goes to the others. Integer shares: groups are served from the smallest n_g up (ties in
// group order), each taking min(n_g, remaining / groups left), so the larger groups absorb the
// rounding. ValueError unless groups.size() <= total <= sum of n_g. Example: CNN2's layer groups
// (160, 4,640, 102,528 and 1,290 values) with 2,688 get 160, 843, 843 and 842.
std::map<std::string, int64_t> capped_latent_dims(
    const ParameterSpec& spec, const std::vector<std::pair<std::string, std::vector<std::string>>>& groups,
    int64_t total);

// Builds a generator by strategy name: "slvt", "layerwise", "lazy_layerwise", "grouped" (which needs
// `groups`) or "lrd" (LRDGenerator with options.lrd_rank, mapping/lrd.h); `group_latent_dims` gives
// named groups of "grouped", "layerwise" and "lazy_layerwise" their own latent length (latent_dim is
// the rest's; a ValueError for the other strategies); "slvt" with lrd_rank > 0 is an
// LRDGenerator over one group "all" (slvt + LRD). Unknown names are a ValueError listing the choices;
// "finetuning" needs pretrained weights, which this signature cannot take (a ValueError pointing to
// FineTuningGenerator and MappingOptions::pretrained).
std::unique_ptr<ParameterGenerator> make_generator(
    const std::string& strategy, const ParameterSpec& spec, int64_t latent_dim, GeneratorOptions options = {},
    const std::vector<std::pair<std::string, std::vector<std::string>>>& groups = {},
    const std::map<std::string, int64_t>& group_latent_dims = {});

// Population std of each target tensor with the reference's fallbacks (see the file comment).
std::vector<float> parameter_scales(const ParameterSpec& spec, const nn::Module& target);

}  // namespace mn::mapping
