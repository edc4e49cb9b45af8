#pragma once
// LRDGenerator: layer-wise generation of low-rank factored weights (the paper's "LRD" add-on, the
// reference's LRDGenerator). Groups, latents (one of length L per group) and scales are layerwise's;
// what a group's mapper produces differs: for each 2-D weight [m, n] with rank r < min(m, n) the mapper
// output holds U (the next m*r values, row-major m x r) and V (the next n*r values, n x r), and the
// weight is W = U V^T / sqrt(r); every other tensor (biases, conv weights, 2-D weights with
// r >= min(m, n)) takes its numel values directly. So a factored [m, n] weight costs r(m + n) mapper
// outputs instead of m n; the trainable count is still L per group.
//
// The 1/sqrt(r): the mapper's outputs have (about) unit variance, so each element of U V^T, a sum of
// r products of them, has variance about r; dividing by sqrt(r) gives W unit-variance elements like
// every directly produced tensor, and the per-tensor init scale s (parameter scaling) then gives W the
// target's own init std. (The reference applies no such factor: its W starts sqrt(r) times too wide.)
//
// Linear(4, 4) at rank 2: one group "<root>", mapper output 4*2 + 4*2 + 4 = 20 values, W of rank 2.
// The groups may also be given: one group "all" is slvt + LRD (make_generator("slvt") with lrd_rank).
#include "mapping/generator.h"

namespace mn::mapping {

class LRDGenerator : public GroupedGenerator {
 public:
  // ValueError "rank must be positive, got R" unless rank > 0 (before anything is built).
  LRDGenerator(ParameterSpec spec, int64_t latent_dim, int64_t rank, GeneratorOptions options = {});
  // With other groups (an exact partition of the spec, as GroupedGenerator's): {{"all", spec.names()}} is
  // slvt + LRD (one latent of length L for the whole target; make_generator("slvt") with lrd_rank > 0).
  LRDGenerator(ParameterSpec spec, std::vector<std::pair<std::string, std::vector<std::string>>> groups,
               int64_t latent_dim, int64_t rank, GeneratorOptions options = {});
  std::string strategy() const override { return "lrd"; }
  int64_t rank() const { return rank_; }
  // Target names of the factored weights, spec order.
  std::vector<std::string> factored_names() const;
  // Mapper output length of group `index` (sum of r(m + n) over its factored weights, numel otherwise).
  int64_t group_output_dim(size_t index) const;

 protected:
  Tensor generate_group(const Group& g, const LatentOverrides& latents) const override;
  bool groups_are_mapper_outputs() const override { return false; }

 private:
  struct Piece {
    Shape shape;          // the target tensor's shape
    bool factored = false;
  };
  int64_t rank_;
  std::vector<std::vector<Piece>> layouts_;  // per group, its entries in local order
};

}  // namespace mn::mapping
