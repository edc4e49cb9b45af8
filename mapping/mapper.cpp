#include "mapping/mapper.h"

#include <sstream>

#include "autograd/ops.h"

namespace mn::mapping {

Modulation Modulation::additive(double alpha) {
  MN_CHECK(alpha >= 0, ValueError, "alpha must be non-negative, got ", alpha);
  return {Kind::Additive, alpha};
}

Modulation Modulation::affine(double scale, double shift) {
  MN_CHECK(scale >= 0 && shift >= 0, ValueError, "scale and shift must be non-negative, got ", scale, ", ", shift);
  Modulation m;
  m.kind = Kind::Affine;
  m.scale = scale;
  m.shift = shift;
  return m;
}

Modulation Modulation::low_rank(int64_t rank, double alpha) {
  MN_CHECK(rank > 0, ValueError, "rank must be positive, got ", rank);
  MN_CHECK(alpha >= 0, ValueError, "alpha must be non-negative, got ", alpha);
  Modulation m;
  m.kind = Kind::LowRank;
  m.rank = rank;
  m.alpha = alpha;
  return m;
}

std::string Modulation::name() const {
  switch (kind) {
    case Kind::None: return "none";
    case Kind::Additive: return "additive";
    case Kind::Affine: return "affine";
    case Kind::LowRank: return "low_rank";
  }
  return "?";
}

Tensor Modulation::apply(const OrthogonalMatrix& w, const Tensor& v) const {
  switch (kind) {
    case Kind::None: return w.apply(v);
    case Kind::Additive:
      // (W + alpha 1 v^T) v = W v + alpha ||v||^2 1
      return alpha == 0 ? w.apply(v) : add(w.apply(v), mul(sum(mul(v, v)), alpha));
    case Kind::Affine: {
      // (W diag(1 + s tanh v) + t 1 v^T) v = W (v (1 + s tanh v)) + t ||v||^2 1
      Tensor gated = mul(v, add(mul(tanh(v), scale), 1.0));
      return add(w.apply(gated), mul(sum(mul(v, v)), shift));
    }
    case Kind::LowRank: break;
  }
  throw ValueError("Low-rank modulation cannot run inside a mapper layer: it needs rank * (out + in) latent values, "
                   "but a layer's input has only 'in' values");
}

int64_t Modulation::latent_dim_for(int64_t out, int64_t in) const {
  int64_t width = 0, n = 0;
  MN_CHECK(!add_overflows(out, in, &width) && !mul_overflows(rank, width, &n), ValueError, "low-rank modulation of rank ",
           rank, " for a [", out, ", ", in, "] matrix needs more latent values than int64 can count");
  return n;
}

Tensor Modulation::modulate(const Tensor& w, const Tensor& v) const {
  MN_CHECK(w.dim() == 2 && v.dim() == 1, ValueError, name(), " modulation expects a matrix and a 1D latent vector, got ",
           w.sizes(), " and ", v.sizes());
  const int64_t out = w.size(0), in = w.size(1);
  switch (kind) {
    case Kind::None: return w;
    case Kind::Additive:
      MN_CHECK(v.size(0) == in, ValueError, "Latent length ", v.size(0), " does not match weight input width ", in);
      return add(w, mul(v.unsqueeze(0), alpha));
    case Kind::Affine:
      MN_CHECK(v.size(0) == in, ValueError, "Latent length ", v.size(0), " does not match weight input width ", in);
      return add(mul(w, add(mul(tanh(v), scale), 1.0).unsqueeze(0)), mul(v.unsqueeze(0), shift));
    case Kind::LowRank: {
      MN_CHECK(v.size(0) == latent_dim_for(out, in), ValueError, "Expected a 1D latent vector with ",
               latent_dim_for(out, in), " values, got ", v.size(0));
      Tensor a = v.narrow(0, 0, out * rank).reshape({out, rank});
      Tensor b = v.narrow(0, out * rank, rank * in).reshape({rank, in});
      return add(w, mul(matmul(a, b), alpha / static_cast<double>(rank)));
    }
  }
  return w;
}

Tensor Modulation::column_mean(const Tensor& w_column_mean, const Tensor& v, int64_t out) const {
  MN_CHECK(w_column_mean.dim() == 1 && v.dim() == 1, ValueError, name(),
           " modulation: column_mean expects 1D colmean(W) and latent, got ", w_column_mean.sizes(), " and ",
           v.sizes());
  MN_CHECK(out > 0, ValueError, "column_mean: W must have at least one row, got ", out);
  const int64_t in = w_column_mean.size(0);
  if (kind == Kind::None) return w_column_mean;
  if (kind == Kind::LowRank) {
    MN_CHECK(v.size(0) == latent_dim_for(out, in), ValueError, "Expected a 1D latent vector with ",
             latent_dim_for(out, in), " values, got ", v.size(0));
    // 1^T W' / out = cm + (alpha / r) (1^T A / out) B.
    Tensor a_mean = mean(v.narrow(0, 0, out * rank).reshape({out, rank}), {0});
    Tensor b = v.narrow(0, out * rank, rank * in).reshape({rank, in});
    return add(w_column_mean, mul(matmul(a_mean.unsqueeze(0), b).reshape({in}), alpha / static_cast<double>(rank)));
  }
  MN_CHECK(v.size(0) == in, ValueError, "Latent length ", v.size(0), " does not match weight input width ", in);
  if (kind == Kind::Additive) return add(w_column_mean, mul(v, alpha));
  // Affine: every row of W is scaled by the same (1 + s tanh v), so the mean is too.
  return add(mul(w_column_mean, add(mul(tanh(v), scale), 1.0)), mul(v, shift));
}

Mapper::Mapper(int64_t latent_dim, int64_t output_dim) : latent_dim_(latent_dim), output_dim_(output_dim) {
  MN_CHECK(latent_dim > 0 && output_dim > 0, ValueError, "latent_dim and output_dim must be positive, got ", latent_dim,
           " and ", output_dim);
}

Tensor Mapper::forward(const Tensor& z) const {
  MN_CHECK(z.defined() && z.dim() == 1 && z.size(0) == latent_dim_, ValueError, "Expected a 1D latent vector with ",
           latent_dim_, " values, got shape ", z.defined() ? z.sizes().str() : std::string("undefined"));
  Tensor y = compute(z);
  MN_CHECK(y.dim() == 1 && y.size(0) == output_dim_, RuntimeError, "Mapper returned shape ", y.sizes(), "; expected (",
           output_dim_, ",)");
  return y;
}

Tensor Mapper::modulated_column_mean(const Tensor&) const {
  throw NotImplementedError(describe() + " has no alignment summary: a custom mapper must override "
                            "modulated_column_mean (MLPMapper and ResidualMLPMapper define it by their first layer)");
}

namespace {
// The mappers' default hidden activation: exact-erf GELU.
Activation or_gelu(Activation activation) {
  return activation ? std::move(activation) : Activation([](const Tensor& x) { return gelu(x); });
}
}  // namespace

MLPMapper::MLPMapper(int64_t latent_dim, int64_t output_dim, uint64_t seed, const std::string& key,
                     std::vector<int64_t> hidden_dims, Modulation modulation, Activation output_activation,
                     Activation activation, MapperMatrixOptions matrices)
    : Mapper(latent_dim, output_dim),
      modulation_(modulation),
      output_activation_(std::move(output_activation)),
      activation_(or_gelu(std::move(activation))) {
  // Rejected here rather than at the first forward (the reference fails late).
  MN_CHECK(modulation.kind != Modulation::Kind::LowRank, ValueError,
           "Low-rank modulation cannot be used inside MLPMapper: each layer's input has 'in' values but low-rank "
           "modulation needs rank * (out + in)");
  std::vector<int64_t> dims{latent_dim};
  for (int64_t h : hidden_dims) {
    MN_CHECK(h > 0, ValueError, "All mapper dimensions must be positive, got hidden dimension ", h);
    dims.push_back(h);
  }
  dims.push_back(output_dim);
  for (size_t i = 0; i + 1 < dims.size(); ++i)
    layers_.push_back(OrthogonalMatrix::build(seed, key + "/weight_" + std::to_string(i), dims[i + 1], dims[i],
                                              /*expand=*/i + 2 == dims.size(), kCPU, matrices));
  first_column_mean_ = layers_.front().column_mean();
}

Tensor MLPMapper::compute(const Tensor& z) const {
  Tensor v = z;
  for (size_t i = 0; i < layers_.size(); ++i) {
    v = modulation_.apply(layers_[i], v);
    if (i + 1 < layers_.size()) v = activation_(v);
  }
  return output_activation_ ? output_activation_(v) : v;
}

Tensor MLPMapper::modulated_column_mean(const Tensor& z) const {
  return modulation_.column_mean(first_column_mean_, z, layers_.front().rows());
}

size_t MLPMapper::fixed_bytes() const {
  size_t b = 0;
  for (const auto& l : layers_) b += l.bytes();
  return b;
}

size_t MLPMapper::dense_bytes() const {
  size_t b = 0;
  for (const auto& l : layers_) b += l.dense_bytes();
  return b;
}

std::vector<Tensor> MLPMapper::buffers() const {
  std::vector<Tensor> out;
  for (const auto& l : layers_)
    for (const Tensor& t : l.factors()) out.push_back(t);
  return out;
}

void MLPMapper::to(Device device) {
  for (auto& l : layers_) l.to(device);
  first_column_mean_ = first_column_mean_.to(device);
}

std::string MLPMapper::describe() const {
  std::ostringstream os;
  os << "MLPMapper(" << latent_dim_;
  for (size_t i = 0; i + 1 < layers_.size(); ++i) os << " -> " << layers_[i].rows();
  os << " -> " << output_dim_ << ", " << modulation_.name();
  // Block (the default, and all there was before the families) is not named, so older checkpoints'
  // descriptions still match.
  if (layers_.front().family() != MapperFamily::Block) os << ", " << mapper_family_name(layers_.front().family());
  os << ")";
  return os.str();
}

ResidualMLPMapper::ResidualMLPMapper(int64_t latent_dim, int64_t output_dim, uint64_t seed, const std::string& key,
                                     int64_t hidden_dim, int64_t depth, Modulation modulation, Activation activation,
                                     MapperMatrixOptions matrices)
    : Mapper(latent_dim, output_dim),
      modulation_(modulation),
      activation_(or_gelu(std::move(activation))),
      family_(matrices.family) {
  MN_CHECK(hidden_dim > 0 && depth > 0, ValueError, "hidden_dim and depth must be positive, got ", hidden_dim, " and ",
           depth);
  MN_CHECK(modulation.kind != Modulation::Kind::LowRank, ValueError,
           "Low-rank modulation cannot be used inside ResidualMLPMapper");
  input_ = OrthogonalMatrix::build(seed, key + "/input_weight", hidden_dim, latent_dim, false, kCPU, matrices);
  for (int64_t k = 0; k < depth; ++k)
    blocks_.push_back(OrthogonalMatrix::build(seed, key + "/block_weight_" + std::to_string(k), hidden_dim, hidden_dim,
                                              false, kCPU, matrices));
  output_ = OrthogonalMatrix::build(seed, key + "/output_weight", output_dim, hidden_dim, true, kCPU, matrices);
  input_column_mean_ = input_.column_mean();
}

Tensor ResidualMLPMapper::modulated_column_mean(const Tensor& z) const {
  return modulation_.column_mean(input_column_mean_, z, input_.rows());
}

Tensor ResidualMLPMapper::compute(const Tensor& z) const {
  Tensor h = activation_(modulation_.apply(input_, z));
  for (const auto& block : blocks_) h = add(h, activation_(modulation_.apply(block, h)));
  return modulation_.apply(output_, h);
}

size_t ResidualMLPMapper::fixed_bytes() const {
  size_t b = input_.bytes() + output_.bytes();
  for (const auto& l : blocks_) b += l.bytes();
  return b;
}

size_t ResidualMLPMapper::dense_bytes() const {
  size_t b = input_.dense_bytes() + output_.dense_bytes();
  for (const auto& l : blocks_) b += l.dense_bytes();
  return b;
}

std::vector<Tensor> ResidualMLPMapper::buffers() const {
  std::vector<Tensor> out;
  for (const OrthogonalMatrix* m : {&input_, &output_})
    for (const Tensor& t : m->factors()) out.push_back(t);
  for (const auto& l : blocks_)
    for (const Tensor& t : l.factors()) out.push_back(t);
  return out;
}

void ResidualMLPMapper::to(Device device) {
  input_.to(device);
  output_.to(device);
  input_column_mean_ = input_column_mean_.to(device);
  for (auto& l : blocks_) l.to(device);
}

std::string ResidualMLPMapper::describe() const {
  return str("ResidualMLPMapper(", latent_dim_, " -> ", input_.rows(), " x ", blocks_.size(), " -> ", output_dim_, ", ",
             modulation_.name(), family_ == MapperFamily::Block ? "" : str(", ", mapper_family_name(family_)), ")");
}

MapperFactory default_mapper_factory(double alpha, MapperMatrixOptions matrices) {
  return [alpha, matrices](int64_t latent_dim, int64_t output_dim, uint64_t seed, const std::string& key) {
    return std::make_shared<MLPMapper>(latent_dim, output_dim, seed, key, std::vector<int64_t>{},
                                       Modulation::additive(alpha), nullptr, nullptr, matrices);
  };
}

}  // namespace mn::mapping
