#pragma once
// Recomputation in backward ("checkpointing"): checkpoint(fn, inputs) runs fn without recording the
// operations inside it, so none of fn's intermediates (nor tensors fn creates, such as generated
// weights) stay alive until backward; only the inputs and the outputs do. The backward pass runs fn
// again on the same inputs, this time recording, and differentiates that second run. It costs one
// more forward of fn; it saves everything fn would otherwise keep for backward.
//
//   TensorList out = autograd::checkpoint([&](const TensorList& in) { return TensorList{layer(in[0])}; }, {x});
//
// fn must compute the same function of its inputs both times: module settings, buffers it reads and
// the default generator's draws (dropout) are replayed as they were (the default generator is set
// back to its position at the first call for the second and restored afterwards; other generators
// are not). Tensors fn uses without receiving them (a layer's own parameters) get their gradients in
// a first-order backward, as without checkpointing. Double backward works for the inputs: with
// create_graph the second run is recorded on top of their history; a tensor that requires grad and
// is not an input is then refused (pass it in `inputs`). Inside a captured step (mn::compile) random
// draws in fn cannot be replayed, so they end the capture.
#include <functional>

#include "autograd/node.h"

namespace mn::autograd {

using CheckpointFn = std::function<TensorList(const TensorList&)>;

// Without grad mode, or when no input requires grad, this is just fn(inputs).
TensorList checkpoint(const CheckpointFn& fn, const TensorList& inputs);

}  // namespace mn::autograd
