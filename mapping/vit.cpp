#include "mapping/vit.h"

#include "core/error.h"
#include "nn/init.h"

namespace mn::mapping {

EncoderBlock::EncoderBlock(int64_t width, int64_t heads, int64_t mlp_dim, double dropout_p, double attention_dropout)
    : Module("EncoderBlock") {
  ln_1 = register_module("ln_1", std::make_shared<nn::LayerNorm>(width, 1e-6));
  self_attention = register_module(
      "self_attention", std::make_shared<nn::MultiheadAttention>(width, heads, attention_dropout, true, true));
  dropout = register_module("dropout", std::make_shared<nn::Dropout>(dropout_p));
  ln_2 = register_module("ln_2", std::make_shared<nn::LayerNorm>(width, 1e-6));
  mlp = register_module("mlp", std::make_shared<nn::Sequential>(std::vector<nn::ModulePtr>{
                                   std::make_shared<nn::Linear>(width, mlp_dim), std::make_shared<nn::GELU>(),
                                   std::make_shared<nn::Dropout>(dropout_p),
                                   std::make_shared<nn::Linear>(mlp_dim, width),
                                   std::make_shared<nn::Dropout>(dropout_p)}));
}

Tensor EncoderBlock::forward(const Tensor& x) {
  Tensor y = (*ln_1)(x);
  y = self_attention->forward_attention(y, y, y, Tensor(), /*need_weights=*/false).output;
  Tensor h = add(x, (*dropout)(y));
  return add(h, (*mlp)((*ln_2)(h)));
}

ViTEncoder::ViTEncoder(int64_t tokens, const ViTOptions& o) : Module("Encoder") {
  Tensor pos = empty({1, tokens, o.width});
  nn::init::normal_(pos, 0.0, 0.02);
  register_parameter("pos_embedding", pos);
  auto layers = register_module("layers", std::make_shared<nn::ModuleDict>());
  for (int64_t i = 0; i < o.depth; ++i) {
    blocks.push_back(std::make_shared<EncoderBlock>(o.width, o.heads, o.mlp_dim, o.dropout, o.attention_dropout));
    layers->insert(str("encoder_layer_", i), blocks.back());
  }
  ln = register_module("ln", std::make_shared<nn::LayerNorm>(o.width, 1e-6));
}

Tensor ViTEncoder::forward(const Tensor& x) {
  Tensor h = add(x, param("pos_embedding"));
  for (const auto& block : blocks) h = (*block)(h);
  return (*ln)(h);
}

VisionTransformer::VisionTransformer(const ViTOptions& o) : Module("VisionTransformer"), options(o) {
  MN_CHECK(o.image_size > 0 && o.patch_size > 0 && o.image_size % o.patch_size == 0, ValueError,
           "VisionTransformer: image_size must be a positive multiple of patch_size, got ", o.image_size, " and ",
           o.patch_size);
  MN_CHECK(o.channels > 0 && o.width > 0 && o.depth > 0 && o.heads > 0 && o.mlp_dim > 0 && o.num_classes > 0,
           ValueError, "VisionTransformer: channels, width, depth, heads, mlp_dim and num_classes must be positive, got ",
           o.channels, ", ", o.width, ", ", o.depth, ", ", o.heads, ", ", o.mlp_dim, ", ", o.num_classes);
  const int64_t tokens = (o.image_size / o.patch_size) * (o.image_size / o.patch_size) + 1;
  conv_proj = register_module(
      "conv_proj", std::make_shared<nn::Conv2d>(o.channels, o.width, o.patch_size, o.patch_size, 0));
  register_parameter("class_token", zeros({1, 1, o.width}));
  encoder = register_module("encoder", std::make_shared<ViTEncoder>(tokens, o));
  auto heads = register_module("heads", std::make_shared<nn::ModuleDict>());
  head = std::make_shared<nn::Linear>(o.width, o.num_classes);
  heads->insert("head", head);
}

Tensor VisionTransformer::forward(const Tensor& x) {
  const ViTOptions& o = options;
  MN_CHECK(x.dim() == 4 && x.size(1) == o.channels && x.size(2) == o.image_size && x.size(3) == o.image_size,
           ValueError, "VisionTransformer: expected input [N, ", o.channels, ", ", o.image_size, ", ", o.image_size,
           "], got ", x.shape().str());
  const int64_t n = x.size(0);
  // [N, width, h, w] -> [N, h*w, width], the class token first.
  Tensor tokens = transpose(flatten((*conv_proj)(x), 2), 1, 2);
  Tensor cls = expand(param("class_token"), Shape{n, 1, o.width});
  Tensor h = (*encoder)(cat({cls, tokens}, 1));
  return (*head)(select(h, 1, 0));
}

std::shared_ptr<VisionTransformer> vit(const ViTOptions& options) { return std::make_shared<VisionTransformer>(options); }

}  // namespace mn::mapping
