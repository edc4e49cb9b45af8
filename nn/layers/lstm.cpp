// LSTM: the input projection of all time steps is one matmul per layer; the recurrence runs step by
// step with differentiable ops, so gradients reach every weight (also through functional_call).
#include <cmath>

#include "nn/init.h"
#include "nn/layers.h"

namespace mn::nn {

LSTM::LSTM(int64_t input_size, int64_t hidden_size, int64_t num_layers, bool bias, bool batch_first)
    : Module("LSTM"),
      input_size(input_size),
      hidden_size(hidden_size),
      num_layers(num_layers),
      bias(bias),
      batch_first(batch_first) {
  MN_CHECK(input_size > 0 && hidden_size > 0 && num_layers >= 1, ValueError,
           "LSTM: input_size, hidden_size must be positive and num_layers >= 1, got ", input_size, ", ", hidden_size,
           ", ", num_layers);
  const double bound = 1.0 / std::sqrt(static_cast<double>(hidden_size));
  for (int64_t k = 0; k < num_layers; ++k) {
    const int64_t in = k == 0 ? input_size : hidden_size;
    const std::string s = std::to_string(k);
    Tensor w_ih = empty({4 * hidden_size, in}), w_hh = empty({4 * hidden_size, hidden_size});
    init::uniform_(w_ih, -bound, bound);
    init::uniform_(w_hh, -bound, bound);
    register_parameter("weight_ih_l" + s, w_ih);
    register_parameter("weight_hh_l" + s, w_hh);
    if (bias) {
      Tensor b_ih = empty({4 * hidden_size}), b_hh = empty({4 * hidden_size});
      init::uniform_(b_ih, -bound, bound);
      init::uniform_(b_hh, -bound, bound);
      register_parameter("bias_ih_l" + s, b_ih);
      register_parameter("bias_hh_l" + s, b_hh);
    }
  }
}

LSTM::Output LSTM::forward_with_state(const Tensor& x_in, const Tensor& h0, const Tensor& c0) {
  MN_CHECK(x_in.dim() == 3 && x_in.size(2) == input_size, ValueError, "LSTM: expected input of shape ",
           batch_first ? "[N, T, " : "[T, N, ", input_size, "], got ", x_in.sizes());
  Tensor x = batch_first ? x_in.transpose(0, 1) : x_in;  // [T, N, in]
  const int64_t steps = x.size(0), batch = x.size(1);
  const Shape state_shape{num_layers, batch, hidden_size};
  for (const Tensor* s : {&h0, &c0})
    if (s->defined())
      MN_CHECK(s->sizes() == state_shape, ValueError, "LSTM: expected initial state of shape ", state_shape, ", got ",
               s->sizes());
  std::vector<Tensor> h_last, c_last;
  Tensor layer_input = x;
  for (int64_t k = 0; k < num_layers; ++k) {
    const std::string s = std::to_string(k);
    Tensor w_ih = param("weight_ih_l" + s), w_hh = param("weight_hh_l" + s);
    // [T, N, 4H] input projection for all steps at once.
    Tensor projected = matmul(layer_input, w_ih.t());
    if (bias) projected = add(projected, add(param("bias_ih_l" + s), param("bias_hh_l" + s)));
    Tensor h = h0.defined() ? h0.select(0, k) : zeros({batch, hidden_size}, TensorOptions().with_device(x.device()));
    Tensor c = c0.defined() ? c0.select(0, k) : zeros({batch, hidden_size}, TensorOptions().with_device(x.device()));
    Tensor w_hh_t = w_hh.t();
    std::vector<Tensor> outputs;
    outputs.reserve(static_cast<size_t>(steps));
    for (int64_t t = 0; t < steps; ++t) {
      Tensor gates = add(projected.select(0, t), matmul(h, w_hh_t));
      auto parts = chunk(gates, 4, 1);
      Tensor i = sigmoid(parts[0]), f = sigmoid(parts[1]), g = tanh(parts[2]), o = sigmoid(parts[3]);
      c = add(mul(f, c), mul(i, g));
      h = mul(o, tanh(c));
      outputs.push_back(h);
    }
    h_last.push_back(h);
    c_last.push_back(c);
    layer_input = stack(outputs, 0);
  }
  Output out;
  out.output = batch_first ? layer_input.transpose(0, 1) : layer_input;
  out.h_n = stack(h_last, 0);
  out.c_n = stack(c_last, 0);
  return out;
}

}  // namespace mn::nn
