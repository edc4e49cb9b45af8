#pragma once
// A small Vision Transformer for 1x28x28 images with torchvision's module names, so a state dict
// saved here loads into torchvision's VisionTransformer layout (and the plain-torch twin in
// tests/parity/torch_targets.py) with load_state_dict(strict=True):
//
//   conv_proj                         patch embedding: Conv2d(channels, width, patch, stride patch)
//   class_token                       [1, 1, width], prepended to the patch tokens (zeros at start)
//   encoder.pos_embedding             [1, patches + 1, width], added to every token (normal, std 0.02)
//   encoder.layers.encoder_layer_<i>  pre-norm blocks: ln_1, self_attention (MultiheadAttention,
//                                     batch first), ln_2, mlp.0 / mlp.3 (Linear, GELU, Dropout,
//                                     Linear, Dropout)
//   encoder.ln                        final LayerNorm (eps 1e-6 everywhere, as torchvision)
//   heads.head                        Linear on the class token's output
//
// Initialisation: the layers' PyTorch defaults (Linear: kaiming_uniform, MultiheadAttention:
// xavier_uniform in_proj, zero biases), not torchvision's ViT-specific re-initialisation (which
// zeroes the head: a mapped model derives its per-tensor scales from the initial values).
#include <cstdint>
#include <memory>
#include <vector>

#include "nn/layers.h"

namespace mn::mapping {

struct ViTOptions {
  int64_t image_size = 28, patch_size = 4, channels = 1;
  int64_t width = 128, depth = 4, heads = 4, mlp_dim = 512;
  int64_t num_classes = 10;
  double dropout = 0.0;            // after attention and in the MLP
  double attention_dropout = 0.0;  // on the attention weights
};

// x + attention(ln_1(x)), then x + mlp(ln_2(x)); x [N, T, width].
class EncoderBlock : public nn::Module {
 public:
  EncoderBlock(int64_t width, int64_t heads, int64_t mlp_dim, double dropout, double attention_dropout);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<nn::LayerNorm> ln_1, ln_2;
  std::shared_ptr<nn::MultiheadAttention> self_attention;
  std::shared_ptr<nn::Dropout> dropout;
  std::shared_ptr<nn::Sequential> mlp;
};

// torchvision's Encoder: adds pos_embedding [1, tokens, width] to the tokens, runs the blocks
// ("layers.encoder_layer_<i>"), ends with LayerNorm "ln"; x [N, tokens, width].
class ViTEncoder : public nn::Module {
 public:
  ViTEncoder(int64_t tokens, const ViTOptions& options);
  Tensor forward(const Tensor& x) override;
  std::vector<std::shared_ptr<EncoderBlock>> blocks;
  std::shared_ptr<nn::LayerNorm> ln;
};

// Children are called through operator() (nn/module.h), so the model streams (stream_layers).
class VisionTransformer : public nn::Module {
 public:
  explicit VisionTransformer(const ViTOptions& options = {});
  // x [N, channels, image_size, image_size] -> logits [N, num_classes].
  Tensor forward(const Tensor& x) override;
  ViTOptions options;
  std::shared_ptr<nn::Conv2d> conv_proj;
  std::shared_ptr<ViTEncoder> encoder;
  std::shared_ptr<nn::Linear> head;  // "heads.head"
};

// The built-in "vit": 4x4 patches -> 49 tokens + class token, width 128, 4 blocks of 4 heads, MLP 512,
// 803,338 parameters.
std::shared_ptr<VisionTransformer> vit(const ViTOptions& options = {});

}  // namespace mn::mapping
