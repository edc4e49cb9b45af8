#pragma once
// One pass per mapped group. The default mapper (one block- or dense-family matrix W, additive
// modulation, per-element scale) composed of ops makes several passes over a group's n generated
// values: the sign products, the GEMM, the modulation add alpha |z|^2, the scale, the concatenation of
// the groups, and as many again backward. Here one kernel per group (kernels.h: mapped_group_forward
// and mapped_group_backward) does the GEMM with the rest in its epilogue, writing each group straight
// into its slice of the generated vector, and the backward reads each group's gradient once.
//
// The values are those of the composition up to float rounding (tests/test_fused_group.cpp keeps the
// composition to compare against). First-order backward runs the fused kernel; with create_graph the
// backward is the composition's formula, written with differentiable ops, so double backward works.
#include <optional>
#include <vector>

#include "core/tensor.h"
#include "mapping/mapper.h"

namespace mn::mapping {

// What the fused kernels need of one group: W's factors (OrthogonalMatrix: block [L, L] and signs
// [reps, L], undefined without a repeated part; tail [rows - reps L, L]), the additive modulation's
// alpha (0 for none) and the per-element scale ([rows], undefined for none).
struct FusedGroup {
  Tensor block, signs, tail, scale;
  double alpha = 0;
  int64_t rows = 0, cols = 0;
};

// The fused form of `mapper` followed by a multiplication by `scale` (undefined: none), or nothing when
// the mapper is not of that shape: exactly an MLPMapper (not a subclass) with one layer of the block
// or dense family (not srht), modulation none or additive, no output activation, f32 factors.
std::optional<FusedGroup> fused_group(const Mapper& mapper, const Tensor& scale);

// The groups' generated values one after another ([sum of rows]), each group's latent in `latents`
// (f32, 1-D, on the factors' device), with one autograd node for all of them.
Tensor generate_fused(const std::vector<FusedGroup>& groups, const std::vector<Tensor>& latents);

// The gradient w.r.t. z for the gradient `grad` of one group's values, written with differentiable
// ops as the unfused composition computes it: W^T (scale grad) + 2 alpha z sum(scale grad).
Tensor fused_group_backward_reference(const FusedGroup& group, const Tensor& z, const Tensor& grad);

// On by default (off from the start when the environment has MN_FUSED_GROUPS=0). Off, the generators
// compose the mapper's ops as before, with the composition's rounding: for benchmarks that set both
// side by side (bench/bench_train_step.cpp), for tests, and to reproduce numbers of runs made before
// the fused kernels. Process-wide; read when a generator runs.
void set_fused_generation(bool enabled);
bool fused_generation_enabled();

}  // namespace mn::mapping
