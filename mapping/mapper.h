#pragma once
// Mappers turn a latent z into a group's flat parameters. All their weights are fixed (derived from
// the seed), so a mapper holds no trainable state. The default mapper of a group with n parameters
// is theta = W z + alpha ||z||^2 * 1 (additive modulation, alpha = 0.01) with W orthogonal and
// expanded by sqrt(max(n, L)); the modulated matrix W + alpha 1 z^T is never formed.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mapping/orthogonal.h"

namespace mn::mapping {

// How a layer's fixed matrix W is modulated by that layer's input v (closed forms of W' v).
struct Modulation {
  enum class Kind { None, Additive, Affine, LowRank };
  Kind kind = Kind::Additive;
  double alpha = 0.01;  // additive strength; low-rank alpha
  double scale = 0.01;  // affine s
  double shift = 0.01;  // affine t
  int64_t rank = 0;     // low-rank r

  static Modulation none() { return {Kind::None, 0.0}; }
  static Modulation additive(double alpha = 0.01);
  static Modulation affine(double scale = 0.01, double shift = 0.01);
  static Modulation low_rank(int64_t rank, double alpha = 1.0);
  std::string name() const;

  // W' v without forming W' (W given as an OrthogonalMatrix).
  Tensor apply(const OrthogonalMatrix& w, const Tensor& v) const;
  // The explicit modulated matrix W' for an explicit W [out, in] and v (tests, the literal
  // reference computation). Low-rank: v has rank * (out + in) values, W' = W + (alpha / r) A B.
  Tensor modulate(const Tensor& w, const Tensor& v) const;
  // Latent length a low-rank modulation needs for W [out, in]; ValueError when it does not fit int64.
  int64_t latent_dim_for(int64_t out, int64_t in) const;
  // colmean(W') (the mean over the rows of modulate(W, v), length in) from colmean(W) [in], v and W's
  // row count `out`, without forming W'. Closed forms (1 the ones vector, cm = colmean(W)):
  //   none      cm;
  //   additive  W' = W + alpha 1 v^T                        -> cm + alpha v;
  //   affine    W' = W diag(1 + s tanh v) + t 1 v^T         -> cm (1 + s tanh v) + t v;
  //   low-rank  W' = W + (alpha / r) A B, A [out, r], B [r, in] read from v as in modulate()
  //                                                         -> cm + (alpha / r) colmean(A) B.
  // Differentiable in v.
  Tensor column_mean(const Tensor& w_column_mean, const Tensor& v, int64_t out) const;
};

class Mapper {
 public:
  Mapper(int64_t latent_dim, int64_t output_dim);
  virtual ~Mapper() = default;
  int64_t latent_dim() const { return latent_dim_; }
  int64_t output_dim() const { return output_dim_; }
  // z [L] -> [output_dim]; validates z.
  Tensor forward(const Tensor& z) const;
  // The alignment summary W_m compared with z by AlignmentLoss: the mean over the rows of the modulated
  // weight of the layer whose input is z (Modulation::column_mean), a vector of z's length L. For a
  // single-layer mapper that is its only layer (the paper's W_m); for a deeper mapper it is the FIRST
  // layer (MLPMapper's W_1 [h_1, L], ResidualMLPMapper's input layer): the only weight whose columns
  // index the latent's coordinates, so the only one whose column mean is comparable with z (the last
  // layer's columns index the last hidden units). Differentiable in z. The base class has no layer
  // structure to read and throws NotImplementedError; mappers with a first layer override it.
  virtual Tensor modulated_column_mean(const Tensor& z) const;
  virtual size_t fixed_bytes() const = 0;
  virtual size_t dense_bytes() const = 0;  // bytes if the matrices were stored explicitly
  virtual std::vector<Tensor> buffers() const = 0;
  virtual void to(Device device) = 0;
  virtual std::string describe() const = 0;

 protected:
  virtual Tensor compute(const Tensor& z) const = 0;
  int64_t latent_dim_, output_dim_;
};

// An elementwise function of the autograd ops (gelu, relu, tanh, ...); null means the default.
using Activation = std::function<Tensor(const Tensor&)>;

// dims = (L, hidden..., out); layer i has W_i [dims[i+1], dims[i]], zero bias, modulated by its own
// input; `activation` between layers (null: exact-erf GELU), `output_activation` after the last (null:
// none); only the last layer is variance-expanded. (`activation` comes last to keep the positions of
// the earlier arguments; `matrices` after it chooses the fixed matrices' family, default block.)
class MLPMapper : public Mapper {
 public:
  MLPMapper(int64_t latent_dim, int64_t output_dim, uint64_t seed, const std::string& key,
            std::vector<int64_t> hidden_dims = {}, Modulation modulation = Modulation::additive(),
            Activation output_activation = nullptr, Activation activation = nullptr,
            MapperMatrixOptions matrices = {});
  int64_t layer_count() const { return static_cast<int64_t>(layers_.size()); }
  const OrthogonalMatrix& layer(size_t i) const { return layers_.at(i); }
  const Modulation& modulation() const { return modulation_; }
  bool has_output_activation() const { return static_cast<bool>(output_activation_); }
  Tensor modulated_column_mean(const Tensor& z) const override;
  size_t fixed_bytes() const override;
  size_t dense_bytes() const override;
  std::vector<Tensor> buffers() const override;
  void to(Device device) override;
  std::string describe() const override;

 protected:
  Tensor compute(const Tensor& z) const override;

 private:
  std::vector<OrthogonalMatrix> layers_;
  Modulation modulation_;
  Activation output_activation_, activation_;
  Tensor first_column_mean_;  // colmean of the first W [dims[1], L], fixed (the alignment summary's base)
};

// h0 = act(W_in' z); h_{k+1} = h_k + act(W_k' h_k) for k < depth; y = W_out' h_depth (act: `activation`,
// null = exact-erf GELU).
class ResidualMLPMapper : public Mapper {
 public:
  ResidualMLPMapper(int64_t latent_dim, int64_t output_dim, uint64_t seed, const std::string& key, int64_t hidden_dim,
                    int64_t depth = 2, Modulation modulation = Modulation::additive(), Activation activation = nullptr,
                    MapperMatrixOptions matrices = {});
  const OrthogonalMatrix& input_layer() const { return input_; }
  // colmean(W_in') for input z: the input layer's (see Mapper::modulated_column_mean).
  Tensor modulated_column_mean(const Tensor& z) const override;
  size_t fixed_bytes() const override;
  size_t dense_bytes() const override;
  std::vector<Tensor> buffers() const override;
  void to(Device device) override;
  std::string describe() const override;

 protected:
  Tensor compute(const Tensor& z) const override;

 private:
  OrthogonalMatrix input_, output_;
  std::vector<OrthogonalMatrix> blocks_;
  Modulation modulation_;
  Activation activation_;
  MapperFamily family_;
  Tensor input_column_mean_;  // colmean of W_in [hidden, L], fixed
};

// Builds the mapper of one group: (latent_dim, output_dim, seed, group key) -> mapper.
using MapperFactory =
    std::function<std::shared_ptr<Mapper>(int64_t latent_dim, int64_t output_dim, uint64_t seed, const std::string& key)>;

// MLPMapper(L, n) with additive modulation alpha: the paper's single fixed layer, its matrix of the
// family `matrices` names.
MapperFactory default_mapper_factory(double alpha = 0.01, MapperMatrixOptions matrices = {});

}  // namespace mn::mapping
