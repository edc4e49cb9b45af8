#pragma once
// The backward engine: counts dependencies from the roots, then runs ready nodes in reverse creation
// order with a heap (no recursion, so deep graphs cannot overflow the stack). Gradients arriving at
// the same node input are summed before the node runs.
#include <functional>
#include <vector>

#include "autograd/node.h"

namespace mn::autograd {

// Accumulates d(roots)/d(leaves) into every leaf's .grad. grad_roots may be empty (each root then
// must have one element and gets gradient 1).
void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grad_roots = {},
              bool retain_graph = false, bool create_graph = false);

// Returns d(outputs)/d(inputs) without touching any .grad. With create_graph the results carry
// history (double backward). allow_unused: an input not reached gets an undefined tensor instead of
// an error.
std::vector<Tensor> grad(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& grad_outputs = {}, bool retain_graph = false,
                         bool create_graph = false, bool allow_unused = false);

// Queue a callback that runs once the current backward pass has finished (the DDP reducer waits on
// its all-reduces here). Only valid while a backward pass is running on this thread.
void queue_callback(std::function<void()> callback);
bool backward_in_progress();

}  // namespace mn::autograd
