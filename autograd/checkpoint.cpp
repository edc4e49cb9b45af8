#include "autograd/checkpoint.h"

#include "autograd/engine.h"
#include "autograd/function.h"
#include "core/capture.h"
#include "core/random.h"

namespace mn::autograd {

namespace {

// The default generator at a point in time; set back for the recomputation, then restored.
struct GeneratorPosition {
  uint64_t seed = 0, offset = 0;
  static GeneratorPosition now() {
    const Generator& g = default_generator();
    return {g.seed(), g.offset()};
  }
  void apply() const {
    Generator& g = default_generator();
    g.manual_seed(seed);
    g.set_offset(offset);
  }
  bool operator!=(const GeneratorPosition& o) const { return seed != o.seed || offset != o.offset; }
};

}  // namespace

TensorList checkpoint(const CheckpointFn& fn, const TensorList& inputs) {
  if (!needs_grad(inputs)) return fn(inputs);

  const GeneratorPosition start = GeneratorPosition::now();
  TensorList outputs;
  {
    NoGradGuard no_grad;
    outputs = fn(inputs);
  }
  if (GeneratorPosition::now() != start)
    capture::unsupported("random numbers drawn inside autograd::checkpoint (a replay would draw new ones for the "
                         "recomputation in backward)");

  // History goes on the f32 outputs; an output that is one of the inputs gets its own tensor first.
  std::vector<Tensor*> attached;
  std::vector<size_t> attached_index;
  for (size_t i = 0; i < outputs.size(); ++i) {
    Tensor& out = outputs[i];
    if (!out.defined() || out.dtype() != DType::f32) continue;
    for (const Tensor& in : inputs)
      if (in.defined() && in.impl() == out.impl()) {
        out = out.clone();
        break;
      }
    attached.push_back(&out);
    attached_index.push_back(i);
  }
  if (attached.empty()) return outputs;

  std::vector<SavedTensor> saved;
  saved.reserve(inputs.size());
  for (const Tensor& in : inputs) saved.push_back(in.defined() ? SavedTensor::input(in) : SavedTensor());
  std::vector<Shape> shapes;
  for (size_t i : attached_index) shapes.push_back(outputs[i].sizes());

  record_list(
      "CheckpointBackward", inputs, attached,
      [fn, saved = std::move(saved), start, attached_index, shapes](const GradContext& c) -> TensorList {
        const bool create_graph = grad_mode_enabled();
        TensorList in(saved.size());
        for (size_t i = 0; i < saved.size(); ++i)
          if (saved[i].defined()) in[i] = saved[i].unpack("CheckpointBackward");
        // Without create_graph the second run starts from fresh leaves, so the nested pass below ends at
        // them; with it the run is recorded on the inputs' own history (double backward).
        TensorList run_in = in;
        if (!create_graph)
          for (Tensor& t : run_in)
            if (t.defined() && t.requires_grad()) t = t.detach().requires_grad_(true);

        TensorList outs;
        const GeneratorPosition now = GeneratorPosition::now();
        start.apply();
        try {
          GradModeGuard recording(true);
          outs = fn(run_in);
        } catch (...) {
          now.apply();
          throw;
        }
        now.apply();

        std::vector<Tensor> roots, root_grads;
        for (size_t k = 0; k < attached_index.size(); ++k) {
          const size_t i = attached_index[k];
          MN_CHECK(i < outs.size() && outs[i].defined() && outs[i].sizes() == shapes[k], RuntimeError,
                   "checkpoint: the recomputation in backward returned ",
                   i < outs.size() && outs[i].defined() ? str("shape ", outs[i].sizes()) : std::string("no tensor"),
                   " for output ", i, " where the first run returned shape ", shapes[k],
                   "; the function must compute the same thing both times");
          if (!c.grad(k).defined() || !outs[i].requires_grad()) continue;
          roots.push_back(outs[i]);
          root_grads.push_back(c.grad(k));
        }
        TensorList result(in.size());
        std::vector<Tensor> wrt;
        std::vector<size_t> wrt_index;
        for (size_t i = 0; i < run_in.size(); ++i)
          if (c.needs(i) && run_in[i].defined() && run_in[i].requires_grad()) {
            wrt.push_back(run_in[i]);
            wrt_index.push_back(i);
          }
        if (roots.empty() || wrt.empty()) return result;
        const TensorList grads = grad(roots, wrt, root_grads, /*retain_graph=*/create_graph, create_graph,
                                      /*allow_unused=*/true);
        for (size_t j = 0; j < wrt_index.size(); ++j) result[wrt_index[j]] = grads[j];
        return result;
      });
  return outputs;
}

}  // namespace mn::autograd
