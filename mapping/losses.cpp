#include "mapping/losses.h"

#include <cmath>
#include <limits>
#include <sstream>

#include "autograd/engine.h"
#include "autograd/node.h"
#include "autograd/ops.h"
#include "core/random.h"
#include "mapping/mapping_model.h"
#include "nn/functional.h"

namespace mn::mapping {

namespace F = nn::functional;

namespace {

void require_defined(const Tensor& t, const char* loss, const char* field) {
  MN_CHECK(t.defined(), ValueError, loss, " requires ", field, " in the training context, got an undefined tensor");
}

// Latents that can carry a gradient, with the count of their values (the smoothness normaliser).
std::vector<Tensor> differentiable_latents(const TrainingContext& c, int64_t& total_numel) {
  std::vector<Tensor> latents;
  total_numel = 0;
  for (const auto& [name, z] : c.latent_vectors) {
    if (!z.defined() || !z.requires_grad()) continue;
    latents.push_back(z);
    total_numel += z.numel();
  }
  return latents;
}

// sum_z ||grad_z||^2 over the gradients a grad() call returned (undefined = not reached = 0).
Tensor squared_norm_sum(const std::vector<Tensor>& grads) {
  Tensor acc;
  for (const Tensor& g : grads) {
    if (!g.defined()) continue;
    Tensor term = sum(square(g));
    acc = acc.defined() ? add(acc, term) : term;
  }
  return acc;
}

}  // namespace

TrainingContext make_training_context(const ForwardResult& result, const Tensor& targets) {
  TrainingContext c;
  c.predictions = result.predictions;
  c.targets = targets;
  for (const auto& [name, z] : result.latent_vectors) c.latent_vectors[name] = z;
  c.generated_parameters = result.generated_parameters;
  c.parameters_streamed = result.streamed;
  return c;
}

// ---- task losses ----

ClassificationLoss::ClassificationLoss(double label_smoothing) : label_smoothing_(label_smoothing) {
  MN_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, ValueError,
           "ClassificationLoss: label_smoothing must be in [0, 1], got ", label_smoothing);
}

LossOutput ClassificationLoss::compute(const TrainingContext& c) const {
  require_defined(c.predictions, "ClassificationLoss", "predictions");
  require_defined(c.targets, "ClassificationLoss", "targets");
  MN_CHECK(c.predictions.dim() == 1 || c.predictions.dim() == 2, ValueError,
           "ClassificationLoss expects logits of shape [N, C] (or [C]), got ", c.predictions.sizes());
  return train::classification_loss(c.predictions, c.targets, label_smoothing_);
}

LossOutput RegressionLoss::compute(const TrainingContext& c) const {
  require_defined(c.predictions, "RegressionLoss", "predictions");
  require_defined(c.targets, "RegressionLoss", "targets");
  // Silent broadcasting ([N, 1] against [N]) is a classic source of wrong losses: refuse it.
  MN_CHECK(c.predictions.sizes() == c.targets.sizes(), ValueError, "RegressionLoss: predictions have shape ",
           c.predictions.sizes(), " but targets have shape ", c.targets.sizes(), "; they must match");
  return train::regression_loss(c.predictions, c.targets);
}

TaskLoss::TaskLoss(Function fn, std::string name) : name_(std::move(name)) {
  MN_CHECK(static_cast<bool>(fn), ValueError, "TaskLoss needs a loss function, got an empty one");
  objective_ = train::task_loss(std::move(fn), name_);
}

LossOutput TaskLoss::compute(const TrainingContext& c) const { return objective_.compute(c.predictions, c.targets); }

// ---- stability ----

StabilityLoss::StabilityLoss(double epsilon, int64_t num_samples) : epsilon_(epsilon), num_samples_(num_samples) {
  MN_CHECK(epsilon > 0.0 && std::isfinite(epsilon), ValueError, "StabilityLoss: epsilon must be positive, got ",
           epsilon);
  MN_CHECK(num_samples >= 1, ValueError, "StabilityLoss: num_samples must be at least 1, got ", num_samples);
}

LossOutput StabilityLoss::compute(const TrainingContext& c) const {
  MN_CHECK(c.perturbed_predictions.has_value() && c.perturbed_predictions->defined(), ValueError,
           "StabilityLoss requires perturbed_predictions in the training context.");
  require_defined(c.predictions, "StabilityLoss", "predictions");
  const Tensor& clean = c.predictions;
  const Tensor& perturbed = *c.perturbed_predictions;
  const int clean_dims = clean.dim();
  const bool stacked = perturbed.dim() == clean_dims + 1;
  MN_CHECK(stacked || perturbed.dim() == clean_dims, ValueError,
           "StabilityLoss: perturbed_predictions must have the predictions' shape ", clean.sizes(),
           " or that shape with a leading sample dim, got ", perturbed.sizes());
  // The clean prediction broadcasts onto the perturbed one (over the sample dim when stacked).
  const Tensor diff = sub(clean, perturbed);
  const Tensor d2 = square(diff);
  // Sample-major layout [S?, N, rest...]: sum the rest, then average batch and samples together,
  // which is the mean over samples of the per-sample loss (the same N in every sample).
  const int batch_dim = stacked ? 1 : 0;
  Tensor value;
  if (clean_dims >= 2) {
    std::vector<int64_t> rest;
    for (int d = batch_dim + 1; d < d2.dim(); ++d) rest.push_back(d);
    value = mean(sum(d2, rest));
  } else {
    value = mean(d2);
  }
  LossOutput out;
  out.set_metric("stability", value);
  out.components["stability"] = value;
  out.total = value;
  return out;
}

// ---- smoothness ----

SmoothnessLoss::SmoothnessLoss(std::string method, int64_t num_projections)
    : method_(std::move(method)), num_projections_(num_projections) {
  MN_CHECK(method_ == "exact" || method_ == "stochastic", ValueError,
           "SmoothnessLoss: method must be 'exact' or 'stochastic', got '", method_, "'");
  MN_CHECK(num_projections >= 1, ValueError, "SmoothnessLoss: num_projections must be at least 1, got ",
           num_projections);
}

LossOutput SmoothnessLoss::compute(const TrainingContext& c) const {
  LossOutput out;
  int64_t latent_numel = 0;
  std::vector<Tensor> latents = differentiable_latents(c, latent_numel);
  MN_CHECK(!(c.parameters_streamed && autograd::grad_mode_enabled()), ValueError,
           "SmoothnessLoss differentiates the generated parameters, which a model with stream_layers does not "
           "keep; train it without the smoothness term or without stream_layers");
  std::vector<Tensor> generated;
  for (const auto& [name, theta] : c.generated_parameters.items())
    if (theta.defined() && theta.requires_grad()) generated.push_back(theta);
  if (!autograd::grad_mode_enabled() || latents.empty() || generated.empty()) {
    // Absent, not zero: a 0 folded into a total would look like a perfectly smooth mapping.
    out.metrics["smoothness_absent"] = 1.0;
    return out;
  }

  Tensor jacobian_sq;  // ||J||_F^2, exact or estimated
  if (method_ == "stochastic") {
    Tensor estimates;
    for (int64_t p = 0; p < num_projections_; ++p) {
      // theta . v over all generated tensors without concatenating them.
      Tensor projected;
      for (const Tensor& theta : generated) {
        Tensor v = rademacher(theta.sizes(), theta.options(), c.generator);
        Tensor term = sum(mul(theta, v));
        projected = projected.defined() ? add(projected, term) : term;
      }
      std::vector<Tensor> grads = autograd::grad({projected}, latents, {}, /*retain_graph=*/true,
                                                 /*create_graph=*/true, /*allow_unused=*/true);
      Tensor c_p = squared_norm_sum(grads);
      if (!c_p.defined()) continue;
      estimates = estimates.defined() ? add(estimates, c_p) : c_p;
    }
    if (estimates.defined()) jacobian_sq = div(estimates, static_cast<double>(num_projections_));
  } else {
    // One backward per generated value, seeded with a one-hot cotangent (row i of J).
    for (const Tensor& theta : generated) {
      for (int64_t i = 0; i < theta.numel(); ++i) {
        std::vector<float> basis(static_cast<size_t>(theta.numel()), 0.0f);
        basis[static_cast<size_t>(i)] = 1.0f;
        Tensor e_i = from_vector(basis, theta.sizes(), theta.options());
        std::vector<Tensor> grads = autograd::grad({theta}, latents, {e_i}, /*retain_graph=*/true,
                                                   /*create_graph=*/true, /*allow_unused=*/true);
        Tensor row = squared_norm_sum(grads);
        if (!row.defined()) continue;
        jacobian_sq = jacobian_sq.defined() ? add(jacobian_sq, row) : row;
      }
    }
  }
  if (!jacobian_sq.defined()) {  // no generated value depends on a latent
    out.metrics["smoothness_absent"] = 1.0;
    return out;
  }
  Tensor value = div(jacobian_sq, static_cast<double>(latent_numel));
  out.set_metric("smoothness", value);
  out.components["smoothness"] = value;
  out.total = value;
  return out;
}

// ---- alignment ----

LossOutput AlignmentLoss::compute(const TrainingContext& c) const {
  MN_CHECK(!c.mapper_column_means.empty(), ValueError,
           "AlignmentLoss requires mapper_column_means (the mapper_weights alignment summaries) in the training "
           "context.");
  constexpr double eps = 1e-8;
  Tensor sum_distance;
  int64_t pairs = 0;
  for (const auto& [name, z] : c.latent_vectors) {
    auto it = c.mapper_column_means.find(name);
    if (it == c.mapper_column_means.end()) continue;
    MN_CHECK(z.dim() == 1 && it->second.dim() == 1, ValueError, "AlignmentLoss: latent '", name,
             "' and its column mean must be 1-D, got ", z.sizes(), " and ", it->second.sizes());
    Tensor w = it->second;
    const int64_t L = z.size(0), n = w.size(0);
    if (n > L) w = narrow(w, 0, 0, L);
    if (n < L) w = cat({w, zeros({L - n}, w.options())});
    // cos = z.w / max(|z| |w|, eps), with one sqrt of a clamped product so a zero vector gives a
    // finite gradient.
    Tensor norm_product = sqrt(clamp(mul(sum(square(z)), sum(square(w))), eps * eps, std::nullopt));
    Tensor cosine = div(sum(mul(z, w)), norm_product);
    Tensor distance = rsub(cosine, 1.0);
    sum_distance = sum_distance.defined() ? add(sum_distance, distance) : distance;
    ++pairs;
  }
  LossOutput out;
  // No latent has a summary: a zero that still joins the graph, as in the reference.
  // On the latents' device: the zero joins a total that lives there (a CPU zero is a DeviceError on CUDA).
  const Device device = c.latent_vectors.empty() ? kCPU : c.latent_vectors.begin()->second.device();
  Tensor value = pairs == 0 ? zeros({}, TensorOptions().with_device(device).with_requires_grad(true))
                            : div(sum_distance, static_cast<double>(pairs));
  out.set_metric("alignment", value);
  out.components["alignment"] = value;
  out.total = value;
  return out;
}

// ---- composite ----

double inverse_softplus(double value) {
  MN_CHECK(value > 0.0 && std::isfinite(value), ValueError,
           "Cannot compute inverse softplus of non-positive value ", value);
  if (value > 20.0) return value;
  return std::log(std::expm1(value));
}

const char* MappingLoss::term_name(Term t) {
  switch (t) {
    case Term::Stability: return "stability";
    case Term::Smoothness: return "smoothness";
    case Term::Alignment: return "alignment";
  }
  return "?";
}

MappingLoss::MappingLoss(std::shared_ptr<Loss> task, MappingLossOptions options)
    : task_(std::move(task)), trainable_(options.trainable_coefficients) {
  MN_CHECK(task_ != nullptr, ValueError, "MappingLoss needs a task loss, got null");
  MN_CHECK(dynamic_cast<MappingLoss*>(task_.get()) == nullptr, ValueError,
           "MappingLoss: the task loss must not itself be a MappingLoss");
  stability_ = options.stability.is_auto() ? std::make_shared<StabilityLoss>(0.01, 1) : options.stability.custom();
  // Auto uses one projection (the class default is 4), as the reference does.
  smoothness_ =
      options.smoothness.is_auto() ? std::make_shared<SmoothnessLoss>("stochastic", 1) : options.smoothness.custom();
  alignment_ = options.alignment.is_auto() ? std::make_shared<AlignmentLoss>() : options.alignment.custom();
  setup_coefficient(Term::Stability, stability_ != nullptr, options.lambda_stability);
  setup_coefficient(Term::Smoothness, smoothness_ != nullptr, options.lambda_smoothness);
  setup_coefficient(Term::Alignment, alignment_ != nullptr, options.lambda_alignment);
}

std::shared_ptr<MappingLoss> MappingLoss::task_only(std::shared_ptr<Loss> task) {
  MappingLossOptions o;
  o.stability = no_term;
  o.smoothness = no_term;
  o.alignment = no_term;
  return std::make_shared<MappingLoss>(std::move(task), o);
}

void MappingLoss::setup_coefficient(Term t, bool active, double lambda0) {
  const int i = static_cast<int>(t);
  if (!active) return;
  MN_CHECK(std::isfinite(lambda0) && lambda0 >= 0.0, ValueError, "MappingLoss: lambda_", term_name(t),
           " must be a finite non-negative number, got ", lambda0);
  fixed_lambda_[i] = lambda0;
  if (trainable_) raw_lambda_[i] = scalar_tensor(inverse_softplus(lambda0)).requires_grad_(true);
}

double MappingLoss::lambda_value(Term t) const {
  const int i = static_cast<int>(t);
  if (raw_lambda_[i].defined()) {
    autograd::NoGradGuard no_grad;
    return softplus(raw_lambda_[i]).item();
  }
  return fixed_lambda_[i];
}

Tensor MappingLoss::weighted(Term t, const Tensor& value) const {
  const int i = static_cast<int>(t);
  if (raw_lambda_[i].defined()) return mul(value, softplus(raw_lambda_[i]));
  return mul(value, fixed_lambda_[i]);
}

std::vector<Tensor> MappingLoss::coefficient_parameters() const {
  std::vector<Tensor> out;
  for (const auto& [name, rho] : named_coefficient_parameters()) out.push_back(rho);
  return out;
}

std::vector<std::pair<std::string, Tensor>> MappingLoss::named_coefficient_parameters() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (Term t : {Term::Stability, Term::Smoothness, Term::Alignment}) {
    const Tensor& rho = raw_lambda_[static_cast<int>(t)];
    if (rho.defined()) out.emplace_back(std::string("raw_lambda_") + term_name(t), rho);
  }
  return out;
}

void MappingLoss::to(Device device) {
  for (Tensor& rho : raw_lambda_)
    if (rho.defined() && rho.device() != device) rho = rho.detach().to(device).requires_grad_(true);
}

std::string MappingLoss::describe() const {
  std::ostringstream os;
  os << "task";
  auto term = [&](Term t, bool active) {
    if (!active) return;
    os << " + " << (trainable_ ? "softplus(rho)=" : "") << lambda_value(t) << "*" << term_name(t);
  };
  term(Term::Stability, stability_ != nullptr);
  term(Term::Smoothness, smoothness_ != nullptr);
  term(Term::Alignment, alignment_ != nullptr);
  return os.str();
}

LossOutput MappingLoss::compute(const TrainingContext& c) const {
  LossOutput task_out = task_->compute(c);
  MN_CHECK(task_out.total.defined(), ValueError, "MappingLoss: task loss '", task_->name(),
           "' returned no total");
  LossOutput out;
  out.metrics = task_out.metrics;
  out.pending_metrics = task_out.pending_metrics;
  if (!out.has_metric("task")) out.set_metric("task", task_out.total);
  out.components["task"] = task_out.total;
  Tensor total = task_out.total;

  auto add_term = [&](Term t, const Loss* loss) {
    if (loss == nullptr) return;
    LossOutput part = loss->compute(c);
    for (const auto& [k, v] : part.metrics) out.metrics[k] = v;
    for (const auto& [k, v] : part.pending_metrics) out.pending_metrics[k] = v;
    const std::string lambda_key = std::string("lambda_") + term_name(t);
    if (const Tensor& rho = raw_lambda_[static_cast<int>(t)]; rho.defined()) {
      autograd::NoGradGuard no_grad;
      out.set_metric(lambda_key, softplus(rho));
    } else {
      out.metrics[lambda_key] = fixed_lambda_[static_cast<int>(t)];
    }
    if (!part.total.defined()) return;  // reported absent (smoothness without gradients)
    out.components[term_name(t)] = part.total;
    total = add(total, weighted(t, part.total));
  };
  add_term(Term::Stability, stability_.get());
  add_term(Term::Smoothness, smoothness_.get());
  add_term(Term::Alignment, alignment_.get());

  out.total = total;
  out.set_metric("total", total);
  return out;
}

}  // namespace mn::mapping
