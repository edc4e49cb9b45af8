#include "mapping/generator.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>

#include "autograd/autocast.h"
#include "autograd/node.h"
#include "autograd/ops.h"
#include "core/allocator.h"
#include "core/random.h"
#include "mapping/lrd.h"
#include "nn/module.h"

namespace mn::mapping {

namespace {

// Latent z ~ N(0, 1/L) drawn from its own Philox stream, so it depends only on (seed, group).
Tensor initial_latent(uint64_t seed, const std::string& group, int64_t latent_dim, Device device) {
  Generator gen(seed, stream_key("latent/" + group));
  Tensor z = normal({latent_dim}, 0.0, 1.0 / std::sqrt(static_cast<double>(latent_dim)), {}, &gen);
  if (!device.is_cpu()) z = z.to(device);
  return z.requires_grad_(true);
}

std::vector<std::string> group_names_of(const std::vector<std::pair<std::string, std::vector<std::string>>>& groups) {
  std::vector<std::string> names;
  for (const auto& [name, params] : groups) names.push_back(name);
  return names;
}
}  // namespace

std::vector<std::pair<std::string, std::vector<std::string>>> layerwise_groups(const ParameterSpec& spec) {
  std::vector<std::pair<std::string, std::vector<std::string>>> groups;
  std::map<std::string, size_t> index;
  for (const auto& e : spec.entries()) {
    const size_t dot = e.name.rfind('.');
    const std::string owner = dot == std::string::npos ? "<root>" : e.name.substr(0, dot);
    auto it = index.find(owner);
    if (it == index.end()) {
      index[owner] = groups.size();
      groups.push_back({owner, {e.name}});
    } else {
      groups[it->second].second.push_back(e.name);
    }
  }
  return groups;
}

std::map<std::string, int64_t> capped_latent_dims(
    const ParameterSpec& spec, const std::vector<std::pair<std::string, std::vector<std::string>>>& groups,
    int64_t total) {
  MN_CHECK(!groups.empty(), ValueError, "capped_latent_dims: no groups to share ", total, " latent values");
  std::vector<std::pair<int64_t, size_t>> sizes;  // (n_g, group index)
  int64_t all = 0;
  for (size_t i = 0; i < groups.size(); ++i) {
    int64_t n = 0;
    for (const auto& name : groups[i].second) n += spec.entry(name).numel;
    sizes.emplace_back(n, i);
    all += n;
  }
  const int64_t count = static_cast<int64_t>(groups.size());
  MN_CHECK(total >= count && total <= all, ValueError, "a latent budget of ", total, " for ", count,
           " groups must be at least one value per group and at most their ", all,
           " parameters (a latent longer than its group's values cannot be used)");
  std::stable_sort(sizes.begin(), sizes.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::map<std::string, int64_t> dims;
  int64_t remaining = total;
  for (size_t k = 0; k < sizes.size(); ++k) {
    const int64_t left = count - static_cast<int64_t>(k);
    const int64_t share = k + 1 == sizes.size() ? remaining : remaining / left;
    const int64_t dim = std::min(sizes[k].first, share);
    dims[groups[sizes[k].second].first] = dim;
    remaining -= dim;
  }
  return dims;
}

std::vector<float> parameter_scales(const ParameterSpec& spec, const nn::Module& target) {
  std::map<std::string, Tensor> values;
  for (auto& [n, t] : target.named_parameters()) values[n] = t;
  auto population_std = [](const Tensor& t) -> double {
    if (t.numel() <= 1) return 0.0;
    autograd::NoGradGuard no_grad;
    return std_dev(t.detach(), {}, 0.0).item();
  };
  std::vector<float> scales;
  for (const auto& e : spec.entries()) {
    double s = 1.0;
    auto it = values.find(e.name);
    if (it != values.end() && e.numel > 1) {
      const double own = population_std(it->second);
      if (own > 1e-5) {
        s = own;
      } else {
        // A bias (also a root-level "bias") borrows its sibling weight's spread.
        const bool is_bias = e.name == "bias" || (e.name.size() > 5 && e.name.compare(e.name.size() - 5, 5, ".bias") == 0);
        if (is_bias) {
          auto w = values.find(e.name.substr(0, e.name.size() - 4) + "weight");
          if (w != values.end()) {
            const double ws = population_std(w->second);
            if (ws > 1e-5) s = ws;
          }
        }
      }
    }
    scales.push_back(static_cast<float>(s));
  }
  return scales;
}

MapperMatrixOptions mapper_matrix_options(const std::string& mapper, int64_t max_dense_mapper_bytes,
                                          bool allow_large) {
  MN_CHECK(max_dense_mapper_bytes >= 0, ValueError, "max_dense_mapper_bytes must be non-negative, got ",
           max_dense_mapper_bytes);
  return {parse_mapper_family(mapper), max_dense_mapper_bytes, allow_large};
}

// ---------------- ParameterGenerator ----------------

ParameterGenerator::ParameterGenerator(ParameterSpec spec,
                                       std::vector<std::pair<std::string, std::vector<std::string>>> groups,
                                       std::map<std::string, int64_t> latent_dims, GeneratorOptions options,
                                       const std::map<std::string, int64_t>& output_dims)
    : spec_(std::move(spec)), options_(std::move(options)) {
  const MapperMatrixOptions matrices =
      mapper_matrix_options(options_.mapper, options_.max_dense_mapper_bytes, options_.allow_large);
  if (!options_.mapper_factory) options_.mapper_factory = default_mapper_factory(options_.alpha, matrices);
  MN_CHECK(!groups.empty(), ValueError, "At least one parameter group is required");
  // Exact partition of the spec.
  std::set<std::string> seen_groups, covered;
  std::vector<std::string> unexpected;
  for (const auto& [gname, names] : groups) {
    MN_CHECK(seen_groups.insert(gname).second, ValueError, "Parameter groups contain duplicate names ('", gname, "')");
    for (const auto& n : names) {
      MN_CHECK(covered.insert(n).second, ValueError, "Parameter groups contain duplicate names ('", n,
               "' appears twice)");
      if (!spec_.contains(n)) unexpected.push_back(n);
    }
  }
  std::vector<std::string> missing;
  for (const auto& e : spec_.entries())
    if (!covered.count(e.name)) missing.push_back(e.name);
  MN_CHECK(missing.empty() && unexpected.empty(), ValueError, "Groups must cover the spec exactly; missing=",
           bracket_list(missing), ", unexpected=", bracket_list(unexpected));
  for (const auto& [gname, names] : groups) {
    auto it = latent_dims.find(gname);
    MN_CHECK(it != latent_dims.end(), KeyError, "no latent dimension given for group '", gname, "'");
    MN_CHECK(it->second > 0, ValueError, "latent_dim must be positive, got ", it->second, " for group '", gname, "'");
  }
  for (const auto& [gname, dim] : latent_dims)
    MN_CHECK(seen_groups.count(gname), KeyError, "a latent dimension is given for '", gname,
             "', which is not a parameter group; the groups are ", bracket_list(group_names_of(groups)));

  // The dense family refuses an oversized group before any group's QR runs: the default mapper's one
  // [n_g, L_g] matrix per group is checked for every group first.
  if (matrices.family == MapperFamily::Dense)
    for (const auto& [gname, names] : groups) {
      int64_t n = 0;
      for (const auto& name : names) n += spec_.entry(name).numel;
      check_dense_size("mapper/" + gname + "/weight_0", n, latent_dims.at(gname), matrices);
    }
  size_t position = 0;
  groups_in_spec_order_ = true;
  for (const auto& [gname, names] : groups) {
    Group g;
    g.name = gname;
    g.latent_dim = latent_dims.at(gname);
    std::vector<std::pair<std::string, Shape>> shapes;
    for (const auto& n : names) {
      const size_t idx = static_cast<size_t>(&spec_.entry(n) - &spec_.entries()[0]);
      if (idx != position++) groups_in_spec_order_ = false;
      g.entries.push_back(idx);
      shapes.emplace_back(n, spec_.entry(n).shape);
    }
    g.local_spec = ParameterSpec::from_shapes(shapes);
    const auto out = output_dims.find(gname);
    const int64_t out_dim = out != output_dims.end() ? out->second : g.local_spec.total_numel();
    g.mapper = options_.mapper_factory(g.latent_dim, out_dim, options_.seed, "mapper/" + gname);
    MN_CHECK(g.mapper->latent_dim() == g.latent_dim && g.mapper->output_dim() == out_dim, ValueError,
             "Mapper dimensions do not match the layer generator: mapper maps ", g.mapper->latent_dim(), " -> ",
             g.mapper->output_dim(), ", group '", gname, "' needs ", g.latent_dim, " -> ", out_dim);
    if (!options_.device.is_cpu()) g.mapper->to(options_.device);
    g.latent = initial_latent(options_.seed, gname, g.latent_dim, options_.device);
    groups_.push_back(std::move(g));
  }
}

std::vector<std::string> ParameterGenerator::group_names() const {
  std::vector<std::string> out;
  for (const auto& g : groups_) out.push_back(g.name);
  return out;
}

std::vector<std::pair<std::string, Tensor>> ParameterGenerator::named_latents() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& g : groups_) out.emplace_back(g.name, g.latent);
  return out;
}

std::vector<Tensor> ParameterGenerator::latents() const {
  std::vector<Tensor> out;
  for (const auto& g : groups_) out.push_back(g.latent);
  return out;
}

void ParameterGenerator::set_scales(const std::vector<float>& per_entry) {
  MN_CHECK(per_entry.size() == spec_.size(), ValueError, "expected ", spec_.size(), " per-tensor scales, got ",
           per_entry.size());
  for (auto& g : groups_) {
    Tensor s = empty({g.local_spec.total_numel()});
    float* p = s.data<float>();
    for (size_t k = 0; k < g.entries.size(); ++k) {
      const auto& e = g.local_spec[k];
      std::fill(p + e.start, p + e.stop, per_entry[g.entries[k]]);
    }
    g.scale = options_.device.is_cpu() ? s : s.to(options_.device);
  }
  scaling_ = true;
}

void ParameterGenerator::initialize_parameter_scaling(const nn::Module& target) {
  set_scales(parameter_scales(spec_, target));
}

std::vector<float> ParameterGenerator::per_entry_scales() const {
  if (!scaling_) return {};
  std::vector<float> out(spec_.size(), 1.0f);
  for (const auto& g : groups_) {
    std::vector<float> s = g.scale.to_vector<float>();
    for (size_t k = 0; k < g.entries.size(); ++k) out[g.entries[k]] = s[static_cast<size_t>(g.local_spec[k].start)];
  }
  return out;
}

void ParameterGenerator::check_overrides(const LatentOverrides& latents) const {
  for (const auto& [name, z] : latents) {
    const Group* g = nullptr;
    for (const auto& candidate : groups_)
      if (candidate.name == name) g = &candidate;
    MN_CHECK(g != nullptr, KeyError, "latent override for unknown group '", name, "'; groups: ", bracket_list(group_names()));
    MN_CHECK(z.defined() && z.dim() == 1 && z.size(0) == g->latent_dim, ValueError, "latent override for group '", name,
             "' must have shape [", g->latent_dim, "], got ", z.defined() ? z.sizes().str() : "undefined");
  }
}

ParameterTree ParameterGenerator::generate_group_parameters(size_t index, const LatentOverrides& latents) const {
  MN_CHECK(index < groups_.size(), IndexError, "generate_group_parameters: group ", index, " of ", groups_.size());
  check_overrides(latents);
  return groups_[index].local_spec.unflatten(generate_group_f32(groups_[index], latents));
}

Tensor ParameterGenerator::generate_group_f32(const Group& g, const LatentOverrides& latents) const {
  amp::AutocastOff f32;
  return generate_group(g, latents);
}

Tensor ParameterGenerator::generate_group(const Group& g, const LatentOverrides& latents) const {
  auto it = latents.find(g.name);
  const Tensor& z = it != latents.end() ? it->second : g.latent;
  if (const auto fused = fused_form(g, z)) return generate_fused({*fused}, {z});
  Tensor theta = g.mapper->forward(z);
  return g.scale.defined() ? mul(theta, g.scale) : theta;
}

std::optional<FusedGroup> ParameterGenerator::fused_form(const Group& g, const Tensor& z) const {
  if (!fused_generation_enabled()) return std::nullopt;
  std::optional<FusedGroup> f = fused_group(*g.mapper, g.scale);
  if (!f || !z.defined() || z.dtype() != DType::f32 || z.dim() != 1 || z.size(0) != f->cols ||
      z.device() != f->tail.device() || f->rows != g.local_spec.total_numel())
    return std::nullopt;
  return f;
}

std::map<std::string, Tensor> ParameterGenerator::modulated_column_means(const LatentOverrides& latents) const {
  check_overrides(latents);
  std::map<std::string, Tensor> out;
  for (const auto& g : groups_) {
    auto it = latents.find(g.name);
    out[g.name] = g.mapper->modulated_column_mean(it != latents.end() ? it->second : g.latent);
  }
  return out;
}

int64_t ParameterGenerator::trainable_parameter_count() const {
  int64_t n = 0;
  for (const auto& g : groups_) n += g.latent_dim;
  return n;
}

size_t ParameterGenerator::fixed_bytes() const {
  size_t b = 0;
  for (const auto& g : groups_)
    b += g.mapper->fixed_bytes() + (g.scale.defined() ? g.scale.nbytes() : 0) +
         (g.offset.defined() ? g.offset.nbytes() : 0);
  return b;
}

size_t ParameterGenerator::fixed_projection_bytes() const {
  size_t b = 0;
  for (const auto& g : groups_) b += g.mapper->dense_bytes();
  return b;
}

std::vector<Tensor> ParameterGenerator::buffers() const {
  std::vector<Tensor> out;
  for (const auto& g : groups_) {
    for (const Tensor& t : g.mapper->buffers()) out.push_back(t);
    if (g.scale.defined()) out.push_back(g.scale);
    if (g.offset.defined()) out.push_back(g.offset);
  }
  return out;
}

void ParameterGenerator::to(Device device) {
  for (auto& g : groups_) {
    g.mapper->to(device);
    if (g.scale.defined()) g.scale = g.scale.to(device);
    if (g.offset.defined()) g.offset = g.offset.to(device);
    // Only a real move makes new leaves: to() on the current device keeps the latents (and so the
    // optimizers, DDP hooks and compiled graphs that hold them) as they are.
    if (g.latent.device() != device) g.latent = g.latent.detach().to(device).requires_grad_(true);
  }
  options_.device = device;
}

// ---------------- strategies ----------------

namespace {
std::vector<std::pair<std::string, std::vector<std::string>>> single_group(const ParameterSpec& spec) {
  return {{"all", spec.names()}};
}
}  // namespace

namespace {
// The guard on slvt's one N x L mapper matrix, checked before anything is allocated. The reference
// guards L * N because it stores that matrix; here it guards what the chosen family stores (the block
// family an L x L block and a tail, srht nothing, dense L * N), so a large latent over a block or srht
// map is not refused for a matrix that is never built. A custom mapper_factory stores what it likes, so
// it keeps the reference's L * N count. Layerwise and grouped generation are not guarded (as in the
// reference); the dense family's own cap (max_dense_mapper_bytes) covers every group.
const ParameterSpec& check_projection(const ParameterSpec& spec, int64_t latent_dim, const GeneratorOptions& options) {
  MN_CHECK(latent_dim > 0, ValueError, "latent_dim must be positive, got ", latent_dim);
  int64_t projection = 0, bytes = 0;
  const bool overflow = mul_overflows(latent_dim, spec.total_numel(), &projection);
  MN_CHECK(!overflow, ValueError, "fixed projection of latent_dim ", latent_dim, " x ", spec.total_numel(),
           " parameters has more elements than int64 can count; use a smaller latent_dim");
  const bool custom = static_cast<bool>(options.mapper_factory);
  const int64_t stored =
      custom ? projection
             : stored_matrix_elements(parse_mapper_family(options.mapper), spec.total_numel(), latent_dim);
  if (stored > options.max_projection_elements && !options.allow_large) {
    const bool huge = mul_overflows(stored, 4, &bytes);
    const std::string what =
        custom ? std::string("the fixed projection (a custom mapper_factory)")
               : str("the slvt mapper's fixed matrix (the '", options.mapper, "' family, ", thousands(projection),
                     " elements as a dense L x N matrix)");
    throw MemoryError(str(what, " would store ", thousands(stored), " elements (",
                          huge ? std::string("more than int64 can count in") : thousands(bytes),
                          " bytes), more than max_projection_elements = ", thousands(options.max_projection_elements),
                          "; use layerwise/grouped generation, the srht mapper family (which stores nothing), or "
                          "set allow_large=true explicitly"));
  }
  return spec;
}
}  // namespace

SingleVectorGenerator::SingleVectorGenerator(ParameterSpec spec, int64_t latent_dim, GeneratorOptions options)
    : ParameterGenerator(check_projection(spec, latent_dim, options), single_group(spec), {{"all", latent_dim}},
                         options) {}  // a copy: the guard reads options, and argument order is unspecified

ParameterTree SingleVectorGenerator::generate_parameters(const LatentOverrides& latents) const {
  check_overrides(latents);
  ParameterTree tree = spec_.unflatten(generate_group_f32(groups_[0], latents));
  spec_.validate_tree(tree);
  return tree;
}

GroupedGenerator::GroupedGenerator(ParameterSpec spec,
                                   std::vector<std::pair<std::string, std::vector<std::string>>> groups,
                                   std::map<std::string, int64_t> latent_dims, GeneratorOptions options)
    : ParameterGenerator(std::move(spec), std::move(groups), std::move(latent_dims), std::move(options)) {}

GroupedGenerator::GroupedGenerator(ParameterSpec spec,
                                   std::vector<std::pair<std::string, std::vector<std::string>>> groups,
                                   std::map<std::string, int64_t> latent_dims, GeneratorOptions options,
                                   const std::map<std::string, int64_t>& output_dims)
    : ParameterGenerator(std::move(spec), std::move(groups), std::move(latent_dims), std::move(options),
                         output_dims) {}

namespace {
// `dims` with latent_dim for every group it does not name (names that are no group stay, for the
// constructor's KeyError).
std::map<std::string, int64_t> with_default_dim(
    const std::vector<std::pair<std::string, std::vector<std::string>>>& groups, std::map<std::string, int64_t> dims,
    int64_t latent_dim) {
  MN_CHECK(latent_dim > 0, ValueError, "latent_dim must be positive, got ", latent_dim);
  for (const auto& [name, params] : groups) dims.try_emplace(name, latent_dim);
  return dims;
}
}  // namespace

GroupedGenerator::GroupedGenerator(ParameterSpec spec,
                                   std::vector<std::pair<std::string, std::vector<std::string>>> groups,
                                   int64_t latent_dim, GeneratorOptions options)
    : GroupedGenerator(std::move(spec), groups, with_default_dim(groups, {}, latent_dim), std::move(options)) {}

ParameterTree GroupedGenerator::generate_parameters(const LatentOverrides& latents) const {
  check_overrides(latents);
  // All groups' outputs, concatenated into one flat vector (the spec's own layout when the groups
  // follow spec order), then cut into views.
  // The fused kernels write every group into its slice of one vector (no concatenation) when all
  // groups have a fused form; otherwise each group is made on its own and the results concatenated.
  Tensor flat;
  if (groups_are_mapper_outputs()) {
    std::vector<FusedGroup> fused;
    std::vector<Tensor> zs;
    for (const auto& g : groups_) {
      auto it = latents.find(g.name);
      zs.push_back(it != latents.end() ? it->second : g.latent);
      std::optional<FusedGroup> f = fused_form(g, zs.back());
      if (!f) break;
      fused.push_back(std::move(*f));
    }
    if (fused.size() == groups_.size()) flat = generate_fused(fused, zs);
  }
  if (!flat.defined()) {
    std::vector<Tensor> flats;
    for (const auto& g : groups_) flats.push_back(generate_group_f32(g, latents));
    flat = flats.size() == 1 ? flats[0] : cat(flats, 0);
  }
  // One split node over the concatenation: its backward writes the flat gradient once. (A narrow per
  // parameter would build a zero-padded gradient of all N values for each parameter and add them up.)
  std::vector<int64_t> numels;
  for (const auto& g : groups_)
    for (const auto& e : g.local_spec.entries()) numels.push_back(e.numel);
  const std::vector<Tensor> pieces = split_with_sizes(flat, numels, 0);
  std::vector<std::pair<std::string, Tensor>> items;
  size_t i = 0;
  for (const auto& g : groups_)
    for (const auto& e : g.local_spec.entries()) items.emplace_back(e.name, pieces[i++].view(e.shape));
  ParameterTree tree(std::move(items));
  spec_.validate_tree(tree);
  return tree;
}

LayerwiseGenerator::LayerwiseGenerator(ParameterSpec spec, int64_t latent_dim, GeneratorOptions options,
                                       const std::map<std::string, int64_t>& latent_dims)
    : GroupedGenerator(spec, layerwise_groups(spec), with_default_dim(layerwise_groups(spec), latent_dims, latent_dim),
                       std::move(options)) {}

LazyLayerwiseGenerator::LazyLayerwiseGenerator(ParameterSpec spec, int64_t latent_dim, GeneratorOptions options,
                                               const std::map<std::string, int64_t>& latent_dims)
    : LayerwiseGenerator(std::move(spec), latent_dim, std::move(options), latent_dims) {}

ParameterTree LazyLayerwiseGenerator::generate_parameters(const LatentOverrides& latents) const {
  check_overrides(latents);
  std::vector<std::pair<std::string, Tensor>> items;
  for (const auto& g : groups_) {
    const ParameterTree part = g.local_spec.unflatten(generate_group_f32(g, latents));  // one split node
    items.insert(items.end(), part.items().begin(), part.items().end());
    // Returns freed temporaries to the device between groups; synchronises, so it is optional.
    if (options_.empty_cache_on_cuda && options_.device.is_cuda()) empty_cache(options_.device);
  }
  ParameterTree tree(std::move(items));
  spec_.validate_tree(tree);
  return tree;
}

std::unique_ptr<ParameterGenerator> make_generator(
    const std::string& strategy, const ParameterSpec& spec, int64_t latent_dim, GeneratorOptions options,
    const std::vector<std::pair<std::string, std::vector<std::string>>>& groups,
    const std::map<std::string, int64_t>& group_latent_dims) {
  MN_CHECK(latent_dim > 0, ValueError, "latent_dim must be positive, got ", latent_dim);
  MN_CHECK(group_latent_dims.empty() || strategy == "grouped" || strategy == "layerwise" ||
               strategy == "lazy_layerwise",
           ValueError, "per-group latent lengths are for strategies grouped, layerwise and lazy_layerwise; strategy '",
           strategy, "' takes one latent_dim");
  // slvt + LRD: one group "all" whose map produces the factors (mapping/lrd.h).
  if ((strategy == "slvt" || strategy == "single_vector") && options.lrd_rank > 0) {
    const int64_t rank = options.lrd_rank;
    return std::make_unique<LRDGenerator>(spec, single_group(spec), latent_dim, rank, std::move(options));
  }
  if (strategy == "slvt" || strategy == "single_vector")
    return std::make_unique<SingleVectorGenerator>(spec, latent_dim, std::move(options));
  if (strategy == "layerwise")
    return std::make_unique<LayerwiseGenerator>(spec, latent_dim, std::move(options), group_latent_dims);
  if (strategy == "lazy_layerwise")
    return std::make_unique<LazyLayerwiseGenerator>(spec, latent_dim, std::move(options), group_latent_dims);
  if (strategy == "grouped") {
    MN_CHECK(!groups.empty(), ValueError, "strategy 'grouped' needs a group map (group name -> parameter names)");
    return std::make_unique<GroupedGenerator>(spec, groups, with_default_dim(groups, group_latent_dims, latent_dim),
                                              std::move(options));
  }

  if (strategy == "lrd") {
    const int64_t rank = options.lrd_rank;
    return std::make_unique<LRDGenerator>(spec, latent_dim, rank, std::move(options));
  }
  MN_CHECK(strategy != "finetuning", ValueError,
           "strategy 'finetuning' adds the latents' modulation to pretrained weights, which make_generator cannot "
           "take: build a FineTuningGenerator (mapping/finetuning.h), or a MappingModel with "
           "MappingOptions::pretrained set");
  throw ValueError(str("Unknown strategy '", strategy,
                       "'; choose from: finetuning (pretrained weights needed), grouped, layerwise, lazy_layerwise, "
                       "lrd, slvt"));
}

}  // namespace mn::mapping
