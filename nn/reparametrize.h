#pragma once
// Training a module through a reparametrisation of its weights: low-rank factors (LRD) and fixed
// magnitude-pruning masks, the paper's Table 8 add-ons for direct training.
//
//   auto net = mapping::make_target("cnn2");
//   auto lrd = std::make_shared<nn::Reparametrized>(net, nn::ReparametrizeOptions{.lrd_rank = 32});
//   lrd->trainable_parameter_count();  // 35,914: FC1's 800x128 weight is U [128,32] V^T [32,800]
//   train::Trainer trainer(*lrd, ...);  // trains U, V and every other tensor
//   safetensors::save(path, lrd->effective_state_dict());  // the target's names, W = U V^T
//
// Reparametrized wraps a module (it is not a child: the listing below replaces its names):
//   parameters  the inner module's parameters under their own names, except that a 2-D parameter
//               [m, n] with lrd_rank r < min(m, n) is replaced by two trainable factors
//               "<name>_U" [m, r] and "<name>_V" [n, r] (so "7.weight_U", "7.weight_V"); the inner
//               module's own tensor for it is no longer read. The factors start as N(0, sqrt(s/sqrt(r)))
//               with s the population std of the weight as initialised, so U V^T has elements of
//               variance r * (s / sqrt(r))^2 = s^2, the layer's own init spread. Other tensors
//               (biases, conv weights, 2-D weights with r >= min(m, n)) train as they are.
//   buffers     the inner module's buffers (updated in place by its forward, e.g. BatchNorm stats).
// forward(x) runs the inner module under a functional call with the effective tensors.
//
// Pruning (prune_fraction f in [0, 1)): every listed parameter with two or more dimensions (weights,
// the U and V factors) gets a fixed 0/1 mask keeping its llround((1 - f) * numel) entries of largest
// |value| at construction (ties: the lower flat index wins); tensors of one dimension or none (biases,
// norm weights) are never pruned. The forward multiplies each tensor by its mask, so masked entries
// contribute zero and get zero gradient; they are also zeroed in place at construction. The masks are
// a pure function of the initial values (so of the seed that initialised them): they are recomputed by
// construction, never stored, and a checkpoint loaded afterwards does not change them.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "nn/module.h"

namespace mn::nn {

// The 0/1 masks (f32, each tensor's shape and device) that magnitude pruning keeps for `tensors`: for
// every tensor of dim >= 2 (or every tensor with include_vectors), llround((1 - fraction) * numel)
// entries of largest |value|, ties to the lower flat index. Tensors without a mask are absent from the
// result. ValueError unless 0 <= fraction < 1.
std::map<std::string, Tensor> magnitude_prune_masks(const NamedTensors& tensors, double fraction,
                                                    bool include_vectors = false);
// ValueError "prune fraction must be in [0, 1), got F" unless 0 <= fraction < 1 (and finite).
void check_prune_fraction(double fraction);

struct ReparametrizeOptions {
  int64_t lrd_rank = 0;       // 0: no factorisation; else the rank r of every factored 2-D weight
  double prune_fraction = 0;  // 0: no pruning; else the fraction of each weight tensor masked to zero
};

class Reparametrized : public Module {
 public:
  // ValueError for a negative rank or a fraction outside [0, 1); inner must not be null.
  Reparametrized(std::shared_ptr<Module> inner, ReparametrizeOptions options);

  Tensor forward(const Tensor& x) override;
  // Runs fn(inner) with the effective tensors (for inner modules with other call signatures).
  Tensor run_with(const std::function<Tensor(Module&)>& fn);

  NamedTensors named_parameters(bool recurse = true) const override;
  NamedTensors named_buffers(bool recurse = true) const override;
  void train(bool on = true) override;
  void to(Device device) override;
  void append_guard_words(std::vector<uint64_t>& key) const override;

  // The inner module's parameters as the forward sees them, under the inner module's names (W = U V^T,
  // masks applied), with gradient to the trainable tensors; plus, in effective_state_dict (detached),
  // the buffers: what load_state_dict of a plain inner module takes.
  std::map<std::string, Tensor> effective_parameters() const;
  StateDict effective_state_dict() const;
  // Trainable entries: every listed parameter's numel, minus the entries its mask removes.
  int64_t trainable_parameter_count() const;
  const std::map<std::string, Tensor>& masks() const { return masks_; }
  const ReparametrizeOptions& options() const { return options_; }
  Module& inner() { return *inner_; }
  // The factored parameters' names in the inner module ("7.weight"), in listing order.
  std::vector<std::string> factored_names() const;

 private:
  struct Factor {
    std::string name;  // the inner parameter it replaces
    Tensor u, v;       // [m, r], [n, r]
  };
  std::shared_ptr<Module> inner_;
  ReparametrizeOptions options_;
  NamedTensors listed_;                 // what named_parameters() returns, inner order
  std::vector<Factor> factors_;
  std::map<std::string, Tensor> masks_;  // listed name -> 0/1 mask
};

}  // namespace mn::nn
