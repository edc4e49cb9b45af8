#include "autograd/checkpoint.h"

#include <unordered_set>

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
        // What the second run starts from, for each input that requires grad. Without create_graph:
        // fresh leaves, so the nested pass ends at them. With it: aliases joined to the input's history
        // by an identity node, so the results keep history (double backward), while the nested pass
        // still differentiates with respect to each input on its own (one input's history may hold
        // another input, or one tensor may be passed twice: the outer pass adds those paths).
        TensorList run_in = in;
        std::unordered_set<const Node*> alias_nodes;
        for (size_t i = 0; i < in.size(); ++i) {
          if (!in[i].defined() || !in[i].requires_grad()) continue;
          if (!create_graph) {
            run_in[i] = in[i].detach().requires_grad_(true);
          } else {
            Tensor alias = in[i].detach();
            alias_nodes.insert(record("CheckpointInput", {&in[i]}, {&alias},
                                      [](const GradContext& g) -> TensorList { return {g.grad()}; })
                                   .get());
            run_in[i] = alias;
          }
        }

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
        if (roots.empty()) return result;

        if (!create_graph) {
          // A plain backward of the second run: gradients reach the fresh leaves and every leaf fn uses
          // without receiving it (a layer's own parameters), as they would without checkpointing.
          backward(roots, root_grads);
          for (size_t i = 0; i < in.size(); ++i)
            if (c.needs(i) && run_in[i].defined() && run_in[i].requires_grad() && !run_in[i].same(in[i]))
              result[i] = run_in[i].grad();
          return result;
        }
        // create_graph differentiates the inputs only: a leaf that fn uses without receiving it would
        // silently get nothing, so it is refused.
        {
          std::vector<const Node*> stack;
          std::unordered_set<const Node*> seen;
          for (const Tensor& r : roots)
            if (const Edge e = gradient_edge(r); e.valid()) stack.push_back(e.node.get());
          while (!stack.empty()) {
            const Node* n = stack.back();
            stack.pop_back();
            if (!seen.insert(n).second || alias_nodes.count(n)) continue;
            MN_CHECK(dynamic_cast<const AccumulateGrad*>(n) == nullptr, RuntimeError,
                     "checkpoint: with create_graph only the inputs are differentiated, but the function uses a "
                     "tensor that requires grad without receiving it; pass it in `inputs`");
            for (const Edge& e : n->next_edges)
              if (e.valid()) stack.push_back(e.node.get());
          }
        }
        std::vector<Tensor> wrt;
        std::vector<size_t> wrt_index;
        for (size_t i = 0; i < run_in.size(); ++i)
          if (c.needs(i) && run_in[i].defined() && run_in[i].requires_grad()) {
            wrt.push_back(run_in[i]);
            wrt_index.push_back(i);
          }
        if (wrt.empty()) return result;
        const TensorList grads = grad(roots, wrt, root_grads, /*retain_graph=*/true, /*create_graph=*/true,
                                      /*allow_unused=*/true);
        for (size_t j = 0; j < wrt_index.size(); ++j) result[wrt_index[j]] = grads[j];
        return result;
      });
  return outputs;
}

}  // namespace mn::autograd
