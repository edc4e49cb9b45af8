#include "mapping/fused_group.h"

#include <atomic>
#include <cstdlib>
#include <string>
#include <typeinfo>

#include "autograd/function.h"
#include "autograd/ops.h"
#include "kernels/kernels.h"

namespace mn::mapping {

namespace {
// MN_FUSED_GROUPS=0 in the environment starts the process with the composition (set_fused_generation).
bool fused_from_environment() {
  const char* v = std::getenv("MN_FUSED_GROUPS");
  return v == nullptr || std::string(v) != "0";
}
std::atomic<bool> g_fused{fused_from_environment()};

bool f32_or_undefined(const Tensor& t) { return !t.defined() || t.dtype() == DType::f32; }
}  // namespace

void set_fused_generation(bool enabled) { g_fused.store(enabled, std::memory_order_relaxed); }
bool fused_generation_enabled() { return g_fused.load(std::memory_order_relaxed); }

std::optional<FusedGroup> fused_group(const Mapper& mapper, const Tensor& scale) {
  if (typeid(mapper) != typeid(MLPMapper)) return std::nullopt;  // a subclass may compute anything
  const auto& mlp = static_cast<const MLPMapper&>(mapper);
  if (mlp.layer_count() != 1 || mlp.has_output_activation()) return std::nullopt;
  const Modulation& m = mlp.modulation();
  if (m.kind != Modulation::Kind::None && m.kind != Modulation::Kind::Additive) return std::nullopt;
  const OrthogonalMatrix& w = mlp.layer(0);
  if (w.hadamard() || !w.tail().defined()) return std::nullopt;
  FusedGroup g{w.block(), w.signs(), w.tail(), scale, m.kind == Modulation::Kind::Additive ? m.alpha : 0.0,
               w.rows(), w.cols()};
  for (const Tensor* t : {&g.block, &g.signs, &g.tail, &g.scale})
    if (!f32_or_undefined(*t) || (t->defined() && t->device() != g.tail.device())) return std::nullopt;
  return g;
}

Tensor fused_group_backward_reference(const FusedGroup& g, const Tensor& z, const Tensor& grad) {
  const Tensor u = g.scale.defined() ? mul(grad, g.scale) : grad;
  // W^T u as OrthogonalMatrix::apply_transpose computes it: T^T u_tail + sum_b (u_b Q) * s_b.
  const int64_t repeated = g.block.defined() ? g.signs.size(0) * g.cols : 0;
  Tensor out = matmul(g.tail.t(), u.narrow(0, repeated, g.rows - repeated));
  if (g.block.defined()) {
    Tensor ub = u.narrow(0, 0, repeated).reshape({g.signs.size(0), g.cols});
    out = add(out, sum(mul(matmul(ub, g.block), g.signs), {0}));
  }
  // d(alpha sum(z^2)) = 2 alpha z per unit of sum(u).
  if (g.alpha != 0) out = add(out, mul(z, mul(sum(u), 2.0 * g.alpha)));
  return out;
}

Tensor generate_fused(const std::vector<FusedGroup>& groups, const std::vector<Tensor>& latents) {
  MN_CHECK(!groups.empty() && groups.size() == latents.size(), ValueError, "generate_fused: ", groups.size(),
           " groups and ", latents.size(), " latents");
  int64_t total = 0;
  std::vector<int64_t> offsets;
  for (size_t i = 0; i < groups.size(); ++i) {
    const FusedGroup& g = groups[i];
    const Tensor& z = latents[i];
    MN_CHECK(z.defined() && z.dim() == 1 && z.size(0) == g.cols && z.dtype() == DType::f32 &&
                 z.device() == g.tail.device(),
             ValueError, "generate_fused: group ", i, " needs an f32 latent of shape [", g.cols, "] on ",
             g.tail.device(), ", got ", z.defined() ? z.sizes().str() : "undefined");
    offsets.push_back(total);
    total += g.rows;
  }
  const Device device = latents[0].device();
  Tensor flat = empty({total}, TensorOptions().with_device(device));
  {
    autograd::NoGradGuard no_grad;
    for (size_t i = 0; i < groups.size(); ++i) {
      const FusedGroup& g = groups[i];
      Tensor slice = flat.narrow(0, offsets[i], g.rows);
      kernels::mapped_group_forward(device, g.block, g.signs, g.tail, g.scale, g.alpha,
                                    latents[i].detach().contiguous(), slice);
    }
  }
  if (autograd::needs_grad(latents)) {
    std::vector<autograd::SavedTensor> saved;
    for (const Tensor& z : latents) saved.push_back(autograd::SavedTensor::input(z));
    autograd::record_list(
        "FusedGroupsBackward", latents, {&flat},
        [groups, offsets, saved = std::move(saved)](const autograd::GradContext& c) -> autograd::TensorList {
          autograd::TensorList out(groups.size());
          const Tensor& grad = c.grad();
          for (size_t i = 0; i < groups.size(); ++i) {
            if (!c.needs(i)) continue;
            const FusedGroup& g = groups[i];
            const Tensor z = saved[i].unpack("FusedGroupsBackward");
            const Tensor gi = grad.narrow(0, offsets[i], g.rows);
            if (autograd::grad_mode_enabled()) {  // create_graph: the composition's formula, differentiable
              out[i] = fused_group_backward_reference(g, z, gi);
              continue;
            }
            out[i] = empty({g.cols}, TensorOptions().with_device(z.device()));
            kernels::mapped_group_backward(z.device(), g.block, g.signs, g.tail, g.scale, g.alpha,
                                           z.detach().contiguous(), gi.contiguous(), out[i]);
          }
          return out;
        });
  }
  return flat;
}

}  // namespace mn::mapping
