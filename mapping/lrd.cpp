#include "mapping/lrd.h"

#include <cmath>

#include "autograd/ops.h"

namespace mn::mapping {

namespace {

bool factored(const Shape& shape, int64_t rank) {
  return shape.size() == 2 && rank < std::min(shape[0], shape[1]);
}

int64_t output_numel(const Shape& shape, int64_t rank) {
  return factored(shape, rank) ? rank * (shape[0] + shape[1]) : shape.numel();
}

using Groups = std::vector<std::pair<std::string, std::vector<std::string>>>;

// The mapper output length of every group (checked rank first: the base builds the mappers). Names the
// spec lacks count 0 here; the base constructor then refuses them.
std::map<std::string, int64_t> lrd_output_dims(const ParameterSpec& spec, const Groups& groups, int64_t rank) {
  MN_CHECK(rank > 0, ValueError, "rank must be positive, got ", rank);
  std::map<std::string, int64_t> dims;
  for (const auto& [group, names] : groups) {
    int64_t n = 0;
    for (const auto& name : names)
      if (spec.contains(name)) n += output_numel(spec.entry(name).shape, rank);
    dims[group] = n;
  }
  return dims;
}

std::map<std::string, int64_t> same_latent_dim(const Groups& groups, int64_t latent_dim) {
  MN_CHECK(latent_dim > 0, ValueError, "latent_dim must be positive, got ", latent_dim);
  std::map<std::string, int64_t> dims;
  for (const auto& [group, names] : groups) dims[group] = latent_dim;
  return dims;
}

}  // namespace

LRDGenerator::LRDGenerator(ParameterSpec spec, int64_t latent_dim, int64_t rank, GeneratorOptions options)
    : LRDGenerator(spec, layerwise_groups(spec), latent_dim, rank, std::move(options)) {}

LRDGenerator::LRDGenerator(ParameterSpec spec, Groups groups, int64_t latent_dim, int64_t rank,
                           GeneratorOptions options)
    : GroupedGenerator(spec, groups, same_latent_dim(groups, latent_dim), std::move(options),
                       lrd_output_dims(spec, groups, rank)),
      rank_(rank) {
  for (const auto& g : groups_) {
    std::vector<Piece> pieces;
    for (const auto& e : g.local_spec.entries()) pieces.push_back({e.shape, factored(e.shape, rank_)});
    layouts_.push_back(std::move(pieces));
  }
}

std::vector<std::string> LRDGenerator::factored_names() const {
  std::vector<std::string> out;
  for (const auto& e : spec_.entries())
    if (factored(e.shape, rank_)) out.push_back(e.name);
  return out;
}

int64_t LRDGenerator::group_output_dim(size_t index) const {
  MN_CHECK(index < groups_.size(), IndexError, "group_output_dim: group ", index, " of ", groups_.size());
  return groups_[index].mapper->output_dim();
}

Tensor LRDGenerator::generate_group(const Group& g, const LatentOverrides& latents) const {
  const auto index = static_cast<size_t>(&g - groups_.data());
  MN_CHECK(index < groups_.size(), ValueError, "LRDGenerator: group '", g.name, "' is not one of its own");
  auto it = latents.find(g.name);
  const Tensor raw = g.mapper->forward(it != latents.end() ? it->second : g.latent);
  const std::vector<Piece>& pieces = layouts_[index];
  std::vector<int64_t> sizes;
  for (const Piece& p : pieces) {
    if (p.factored) {
      sizes.push_back(p.shape[0] * rank_);
      sizes.push_back(p.shape[1] * rank_);
    } else {
      sizes.push_back(p.shape.numel());
    }
  }
  const std::vector<Tensor> parts = split_with_sizes(raw, sizes, 0);
  const double inv_sqrt_rank = 1.0 / std::sqrt(static_cast<double>(rank_));
  std::vector<Tensor> flat;
  size_t k = 0;
  for (const Piece& p : pieces) {
    if (p.factored) {
      const Tensor u = parts[k].view({p.shape[0], rank_});
      const Tensor v = parts[k + 1].view({p.shape[1], rank_});
      flat.push_back(mul(matmul(u, transpose(v, 0, 1)), inv_sqrt_rank).reshape({p.shape.numel()}));
      k += 2;
    } else {
      flat.push_back(parts[k++]);
    }
  }
  Tensor theta = flat.size() == 1 ? flat[0] : cat(flat, 0);
  return g.scale.defined() ? mul(theta, g.scale) : theta;
}

}  // namespace mn::mapping
