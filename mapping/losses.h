#pragma once
// Losses for training mapping networks. Every loss reads a TrainingContext (what one training step
// produced) and returns a LossOutput: a scalar `total` to minimise, its named `components` (live
// scalars, gradients flow through them) and plain-number `metrics` for logging.
//
//   task terms      ClassificationLoss (cross-entropy, label smoothing; metrics task + accuracy),
//                   RegressionLoss (MSE), TaskLoss(fn) (any fn(predictions, targets));
//   regularisers    StabilityLoss   f(z) vs f(z + eps xi): the prediction should not move when the
//                                   latents are nudged (the trainer fills perturbed_predictions);
//                   SmoothnessLoss  ||d theta / d z||_F^2 / sum numel(z): the generated parameters
//                                   should vary gently with the latents. Default: the Hutchinson
//                                   estimate (Rademacher probes through a double backward);
//                                   "exact" does one backward per generated value (tiny cases only);
//                   AlignmentLoss   1 - cos(z, colmean(W')): keep each latent aligned with its
//                                   mapper's modulated column mean (the trainer fills
//                                   mapper_column_means from the clean latents);
//   composite       MappingLoss = task + l_st * stability + l_sm * smoothness + l_al * alignment.
//
// Where the port differs from the reference library on purpose:
//   * With S > 1 perturbation samples the stability loss is the mean of the per-sample losses, so its
//     scale does not depend on S (the reference sums the batch axis once S > 1).
//   * Smoothness needs gradients. With grad mode off (validation) or when no generated tensor depends
//     on a latent, it is reported ABSENT: no "smoothness" component, an undefined total and the metric
//     "smoothness_absent" = 1; MappingLoss then leaves it out of its total instead of adding 0.
//   * Trainable coefficients (lambda = softplus(rho)) are offered but off by default: since
//     d total / d lambda = term >= 0, minimising the total drives every trainable lambda toward 0,
//     i.e. the optimiser gradually switches the regularisers off. Use them knowingly.
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "mapping/parameter_spec.h"
#include "nn/train/loss.h"

namespace mn {
class Generator;
}

namespace mn::mapping {

struct ForwardResult;

// Everything a loss may read from one training step.
struct TrainingContext {
  Tensor predictions;
  Tensor targets;
  std::map<std::string, Tensor> latent_vectors;  // group name -> the model's own latent
  ParameterTree generated_parameters;            // generated from latent_vectors
  bool parameters_streamed = false;              // stream_layers: generated per layer, not kept
  // f(z + eps xi) for the same inputs: shaped like predictions, or stacked on a new dim 0 when
  // several perturbation samples were drawn.
  std::optional<Tensor> perturbed_predictions;
  // group name -> colmean(W'_g) for the clean latent (the reference's "mapper_weights", reduced to
  // the only thing alignment reads).
  std::map<std::string, Tensor> mapper_column_means;
  // Random draws made by losses (Hutchinson probes); the process-wide generator when null.
  Generator* generator = nullptr;
};

// Predictions, latents and generated parameters of a forward pass, plus the targets.
TrainingContext make_training_context(const ForwardResult& result, const Tensor& targets);

// What a loss returns and the deferral of device metrics are the generic trainer's (nn/train/loss.h).
using train::DeferredMetrics;
using train::LossOutput;

class Loss {
 public:
  virtual ~Loss() = default;
  virtual LossOutput compute(const TrainingContext& context) const = 0;
  LossOutput operator()(const TrainingContext& context) const { return compute(context); }
  virtual std::string name() const = 0;
};

// ---- task losses: component and metric "task" ----

// Mean cross-entropy of logits [N, C] against class indices [N]; metric "accuracy" = fraction of
// rows whose argmax equals the target.
class ClassificationLoss : public Loss {
 public:
  explicit ClassificationLoss(double label_smoothing = 0.0);
  LossOutput compute(const TrainingContext& context) const override;
  std::string name() const override { return "ClassificationLoss"; }
  double label_smoothing() const { return label_smoothing_; }

 private:
  double label_smoothing_;
};

// Mean squared error over all elements; predictions and targets must have the same shape.
class RegressionLoss : public Loss {
 public:
  LossOutput compute(const TrainingContext& context) const override;
  std::string name() const override { return "RegressionLoss"; }
};

// Any differentiable fn(predictions, targets) -> scalar.
class TaskLoss : public Loss {
 public:
  using Function = std::function<Tensor(const Tensor& predictions, const Tensor& targets)>;
  explicit TaskLoss(Function fn, std::string name = "TaskLoss");
  LossOutput compute(const TrainingContext& context) const override;
  std::string name() const override { return name_; }

 private:
  std::string name_;
  train::Objective objective_;  // train::task_loss: the one place a scalar loss function becomes a LossOutput
};

// ---- regularisers ----

// d = f(z) - f(z + eps xi). Per sample: mean over the batch (dim 0) of the sum of d^2 over the other
// dims (predictions with >= 2 dims), else mean(d^2); averaged over the perturbation samples.
// epsilon and num_samples tell the trainer how to perturb.
class StabilityLoss : public Loss {
 public:
  explicit StabilityLoss(double epsilon = 0.01, int64_t num_samples = 1);
  LossOutput compute(const TrainingContext& context) const override;
  std::string name() const override { return "StabilityLoss"; }
  double epsilon() const { return epsilon_; }
  int64_t num_samples() const { return num_samples_; }

 private:
  double epsilon_;
  int64_t num_samples_;
};

// ||J||_F^2 / sum_z numel(z), J = d theta / d z over all generated tensors theta and latents z.
//   "stochastic" (default, the Hutchinson estimate): with Rademacher probes v_p,
//       c_p = sum_z ||d(theta . v_p)/dz||^2, value = mean_p c_p / sum numel(z) - unbiased for the
//       exact value, one double backward per probe;
//   "exact": sum_i sum_z ||d theta_i / dz||^2 - one backward per generated value; tiny cases only.
// The result keeps its graph (create_graph), so minimising it trains the latents.
class SmoothnessLoss : public Loss {
 public:
  explicit SmoothnessLoss(std::string method = "stochastic", int64_t num_projections = 4);
  LossOutput compute(const TrainingContext& context) const override;
  std::string name() const override { return "SmoothnessLoss"; }
  const std::string& method() const { return method_; }
  int64_t num_projections() const { return num_projections_; }

 private:
  std::string method_;
  int64_t num_projections_;
};

// Mean over latents z with a column-mean summary w of 1 - cos(z, w) (w truncated or zero-padded to
// len(z), eps 1e-8). Needs a non-empty mapper_column_means.
class AlignmentLoss : public Loss {
 public:
  LossOutput compute(const TrainingContext& context) const override;
  std::string name() const override { return "AlignmentLoss"; }
};

// ---- composite ----

// How MappingLoss fills one regulariser slot: automatic (the reference defaults), none, or a
// configured instance, e.g. std::make_shared<StabilityLoss>(0.05, 2).
struct AutoTerm {};
struct NoTerm {};
inline constexpr AutoTerm auto_term{};
inline constexpr NoTerm no_term{};

template <class T>
class TermSetting {
 public:
  TermSetting(AutoTerm = {}) : automatic_(true) {}  // NOLINT: implicit on purpose
  TermSetting(NoTerm) {}                            // NOLINT
  TermSetting(std::shared_ptr<T> custom) : custom_(std::move(custom)) {}  // NOLINT; null = none
  bool is_auto() const { return automatic_; }
  const std::shared_ptr<T>& custom() const { return custom_; }  // null for none (and for auto)

 private:
  bool automatic_ = false;
  std::shared_ptr<T> custom_;
};

struct MappingLossOptions {
  // auto: StabilityLoss(0.01, 1), SmoothnessLoss("stochastic", 1), AlignmentLoss().
  TermSetting<StabilityLoss> stability = auto_term;
  TermSetting<SmoothnessLoss> smoothness = auto_term;
  TermSetting<AlignmentLoss> alignment = auto_term;
  double lambda_stability = 0.1;
  double lambda_smoothness = 0.01;
  double lambda_alignment = 0.01;
  // lambda = softplus(rho), rho trainable (see the file comment: descent drives lambda to 0).
  bool trainable_coefficients = false;
};

// total = task + sum over active terms of lambda * term. components hold the UNWEIGHTED parts
// ("task", "stability", "smoothness", "alignment"); metrics hold the parts' metrics, "total" and
// "lambda_<term>" for every configured term. Note: with default options all three regularisers are
// on (as in the reference); the trainer only uses them when handed a MappingLoss explicitly.
class MappingLoss : public Loss {
 public:
  explicit MappingLoss(std::shared_ptr<Loss> task, MappingLossOptions options = {});
  // The task alone, every regulariser off.
  static std::shared_ptr<MappingLoss> task_only(std::shared_ptr<Loss> task);

  LossOutput compute(const TrainingContext& context) const override;
  std::string name() const override { return "MappingLoss"; }

  const std::shared_ptr<Loss>& task() const { return task_; }
  const std::shared_ptr<StabilityLoss>& stability() const { return stability_; }    // null when off
  const std::shared_ptr<SmoothnessLoss>& smoothness() const { return smoothness_; }  // null when off
  const std::shared_ptr<AlignmentLoss>& alignment() const { return alignment_; }     // null when off
  // "task", then the active regularisers with their weights, e.g. "task + 0.1*stability".
  std::string describe() const;

  bool trainable_coefficients() const { return trainable_; }
  // Current weights (softplus(rho) when trainable); 0 for a term that is off.
  double lambda_stability() const { return lambda_value(Term::Stability); }
  double lambda_smoothness() const { return lambda_value(Term::Smoothness); }
  double lambda_alignment() const { return lambda_value(Term::Alignment); }
  // The trainable rho's (empty unless trainable_coefficients), for the optimizer; named
  // "raw_lambda_stability", "raw_lambda_smoothness", "raw_lambda_alignment" (active terms only).
  std::vector<Tensor> coefficient_parameters() const;
  std::vector<std::pair<std::string, Tensor>> named_coefficient_parameters() const;
  void to(Device device);

 private:
  enum class Term { Stability = 0, Smoothness = 1, Alignment = 2 };
  static const char* term_name(Term t);
  double lambda_value(Term t) const;
  Tensor weighted(Term t, const Tensor& value) const;
  void setup_coefficient(Term t, bool active, double lambda0);

  std::shared_ptr<Loss> task_;
  std::shared_ptr<StabilityLoss> stability_;
  std::shared_ptr<SmoothnessLoss> smoothness_;
  std::shared_ptr<AlignmentLoss> alignment_;
  bool trainable_;
  double fixed_lambda_[3] = {0.0, 0.0, 0.0};
  Tensor raw_lambda_[3];  // rho per term, defined when trainable and active
};

// rho with softplus(rho) = value: log(exp(value) - 1), = value above 20 (where softplus is the
// identity to float precision). ValueError for value <= 0.
double inverse_softplus(double value);

}  // namespace mn::mapping
