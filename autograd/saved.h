#pragma once
// A tensor saved for backward. It remembers the version counter at save time and refuses to unpack
// after an in-place change. Saving an op's own output would form a cycle (output -> grad_fn ->
// saved output), so outputs are stored without their history and re-attached to the node (weakly)
// when unpacked under grad mode, which keeps double backward through saved outputs correct.
#include <memory>
#include <string>

#include "autograd/node.h"

namespace mn::autograd {

class SavedTensor {
 public:
  SavedTensor() = default;
  // Save an input (or any tensor not produced by the node that saves it).
  static SavedTensor input(const Tensor& t);
  // Save an output of the node being recorded; call after record() has attached history to it.
  static SavedTensor output(const Tensor& t);

  Tensor unpack(const char* who = "backward") const;
  bool defined() const { return data_.defined(); }
  void reset() { data_ = Tensor(); }

 private:
  Tensor data_;                // inputs: the tensor itself; outputs: a history-free alias
  uint32_t saved_version_ = 0;
  bool is_output_ = false;
  bool requires_grad_ = false;
  std::weak_ptr<Node> grad_fn_;  // outputs only
  uint32_t output_nr_ = 0;
};

}  // namespace mn::autograd
