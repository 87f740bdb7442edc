#include "blocks/cuda/weights.h"

#include "blocks/weights.h"
#include "common/error.h"

namespace keel::blocks::cuda {
ModelWeights device_weights(const model::ModelConfig& cfg, const optim::ParamLayout& layout, const F32At& f32,
                            const Bf16At& b16) {
  ModelWeights w;
  w.layers.assign(static_cast<std::size_t>(cfg.layers), LayerWeights{});
  int moe = 0;
  for (int l = 0; l < cfg.layers; ++l) {
    LayerWeights& L = w.layers[static_cast<std::size_t>(l)];
    L.cca = model::layer_attention_kind(cfg, l) == model::AttentionKind::kCca;
    L.linear = model::layer_attention_kind(cfg, l) == model::AttentionKind::kLinear;
    L.moe = model::is_moe_layer(cfg, l) ? moe++ : -1;
  }
  for (const auto& p : layout.params) {
    const ParamRole r = role_of(p.name);
    if (r.layer >= cfg.layers) fail("model: parameter '{}' of a layer the model does not have", p.name);
    LayerWeights& L = w.layers[static_cast<std::size_t>(std::max(r.layer, 0))];
    switch (r.slot) {
      case Slot::kEmbed: w.embed = b16(p); break;
      case Slot::kFinalNorm: w.final_norm = f32(p); break;
      case Slot::kLmHead: w.lm_head = b16(p); break;
      case Slot::kFinalHScale: w.final_scale.h_scale = f32(p); break;
      case Slot::kFinalHBias: w.final_scale.h_bias = f32(p); break;
      case Slot::kFinalRScale: w.final_scale.r_scale = f32(p); break;
      case Slot::kFinalRBias: w.final_scale.r_bias = f32(p); break;
      case Slot::kAttnHScale: L.attn_scale.h_scale = f32(p); break;
      case Slot::kAttnHBias: L.attn_scale.h_bias = f32(p); break;
      case Slot::kAttnRScale: L.attn_scale.r_scale = f32(p); break;
      case Slot::kAttnRBias: L.attn_scale.r_bias = f32(p); break;
      case Slot::kAttnNorm: L.attn_norm = f32(p); break;
      case Slot::kWq: L.wq = b16(p); break;
      case Slot::kWk: L.wk = b16(p); break;
      case Slot::kWv: L.wv = b16(p); break;
      case Slot::kWo: L.wo = b16(p); break;
      case Slot::kCcaWqk: L.cca_w.w_qk = b16(p); break;
      case Slot::kCcaWv: L.cca_w.w_v = b16(p); break;
      case Slot::kCcaConv0W: L.cca_w.conv0_w = f32(p); break;
      case Slot::kCcaConv0B: L.cca_w.conv0_b = f32(p); break;
      case Slot::kCcaConv1W: L.cca_w.conv1_w = f32(p); break;
      case Slot::kCcaConv1B: L.cca_w.conv1_b = f32(p); break;
      case Slot::kCcaTemp: L.cca_w.temp = f32(p); break;
      case Slot::kCcaWo: L.cca_w.w_o = b16(p); break;
      case Slot::kMlpHScale: L.mlp_scale.h_scale = f32(p); break;
      case Slot::kMlpHBias: L.mlp_scale.h_bias = f32(p); break;
      case Slot::kMlpRScale: L.mlp_scale.r_scale = f32(p); break;
      case Slot::kMlpRBias: L.mlp_scale.r_bias = f32(p); break;
      case Slot::kMlpNorm: L.mlp_norm = f32(p); break;
      case Slot::kGate: L.w_gate = b16(p); break;
      case Slot::kUp: L.w_up = b16(p); break;
      case Slot::kDown: L.w_down = b16(p); break;
      case Slot::kRouter: L.router = b16(p); break;
      case Slot::kZrDownW: L.zrouter.w_down = b16(p); break;
      case Slot::kZrDownB: L.zrouter.b_down = f32(p); break;
      case Slot::kZrEda: L.zrouter.gamma = f32(p); break;
      case Slot::kZrNorm: L.zrouter.w_norm = f32(p); break;
      case Slot::kZrW1: L.zrouter.w1 = b16(p); break;
      case Slot::kZrB1: L.zrouter.b1 = f32(p); break;
      case Slot::kZrW2: L.zrouter.w2 = b16(p); break;
      case Slot::kZrB2: L.zrouter.b2 = f32(p); break;
      case Slot::kZrOut: L.zrouter.w3 = b16(p); break;
      case Slot::kExpertGate: L.experts.w_gate = b16(p); break;
      case Slot::kExpertUp: L.experts.w_up = b16(p); break;
      case Slot::kExpertDown: L.experts.w_down = b16(p); break;
    }
  }
  if (cfg.tied_embeddings) w.lm_head = w.embed;
  return w;
}

ModelGrads device_grads(const model::ModelConfig& cfg, const optim::ParamLayout& layout, float* grads) {
  return device_grads(cfg, layout, [grads](const optim::ParamInfo& p) { return grads + p.offset; });
}

ModelGrads device_grads(const model::ModelConfig& cfg, const optim::ParamLayout& layout, const GradAt& grad_at) {
  ModelGrads g;
  g.layers.assign(static_cast<std::size_t>(cfg.layers), LayerGrads{});
  for (const auto& p : layout.params) {
    const ParamRole r = role_of(p.name);
    if (r.layer >= cfg.layers) fail("model: parameter '{}' of a layer the model does not have", p.name);
    LayerGrads& L = g.layers[static_cast<std::size_t>(std::max(r.layer, 0))];
    float* at = grad_at(p);
    switch (r.slot) {
      case Slot::kEmbed: g.embed = at; break;
      case Slot::kFinalNorm: g.final_norm = at; break;
      case Slot::kLmHead: g.lm_head = at; break;
      case Slot::kFinalHScale: g.final_scale.h_scale = at; break;
      case Slot::kFinalHBias: g.final_scale.h_bias = at; break;
      case Slot::kFinalRScale: g.final_scale.r_scale = at; break;
      case Slot::kFinalRBias: g.final_scale.r_bias = at; break;
      case Slot::kAttnHScale: L.attn_scale.h_scale = at; break;
      case Slot::kAttnHBias: L.attn_scale.h_bias = at; break;
      case Slot::kAttnRScale: L.attn_scale.r_scale = at; break;
      case Slot::kAttnRBias: L.attn_scale.r_bias = at; break;
      case Slot::kAttnNorm: L.attn_norm = at; break;
      case Slot::kWq: L.wq = at; break;
      case Slot::kWk: L.wk = at; break;
      case Slot::kWv: L.wv = at; break;
      case Slot::kWo: L.wo = at; break;
      case Slot::kCcaWqk: L.cca.w_qk = at; break;
      case Slot::kCcaWv: L.cca.w_v = at; break;
      case Slot::kCcaConv0W: L.cca.conv0_w = at; break;
      case Slot::kCcaConv0B: L.cca.conv0_b = at; break;
      case Slot::kCcaConv1W: L.cca.conv1_w = at; break;
      case Slot::kCcaConv1B: L.cca.conv1_b = at; break;
      case Slot::kCcaTemp: L.cca.temp = at; break;
      case Slot::kCcaWo: L.cca.w_o = at; break;
      case Slot::kMlpHScale: L.mlp_scale.h_scale = at; break;
      case Slot::kMlpHBias: L.mlp_scale.h_bias = at; break;
      case Slot::kMlpRScale: L.mlp_scale.r_scale = at; break;
      case Slot::kMlpRBias: L.mlp_scale.r_bias = at; break;
      case Slot::kMlpNorm: L.mlp_norm = at; break;
      case Slot::kGate: L.w_gate = at; break;
      case Slot::kUp: L.w_up = at; break;
      case Slot::kDown: L.w_down = at; break;
      case Slot::kRouter: L.router = at; break;
      case Slot::kZrDownW: L.zrouter.w_down = at; break;
      case Slot::kZrDownB: L.zrouter.b_down = at; break;
      case Slot::kZrEda: L.zrouter.gamma = at; break;
      case Slot::kZrNorm: L.zrouter.w_norm = at; break;
      case Slot::kZrW1: L.zrouter.w1 = at; break;
      case Slot::kZrB1: L.zrouter.b1 = at; break;
      case Slot::kZrW2: L.zrouter.w2 = at; break;
      case Slot::kZrB2: L.zrouter.b2 = at; break;
      case Slot::kZrOut: L.zrouter.w3 = at; break;
      case Slot::kExpertGate: L.experts.w_gate = at; break;
      case Slot::kExpertUp: L.experts.w_up = at; break;
      case Slot::kExpertDown: L.experts.w_down = at; break;
    }
  }
  if (cfg.tied_embeddings) g.lm_head = g.embed;
  return g;
}

}  // namespace keel::blocks::cuda
