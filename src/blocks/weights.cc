#include "blocks/weights.h"

#include <algorithm>

#include <map>

#include "common/error.h"

namespace keel::blocks {

Tensor param_view(float* base, const optim::ParamInfo& p) {
  const auto& s = p.shape;
  float* d = base + p.offset;
  if (s.size() == 1) return Tensor(d, {s[0]});
  if (s.size() == 2) return Tensor(d, {s[0], s[1]});
  return Tensor(d, {s[0], s[1], s[2]});
}

namespace {

const std::map<std::string, Slot>& layer_slots() {
  static const std::map<std::string, Slot> m = {
      {"res_scale.attn.h_scale", Slot::kAttnHScale}, {"res_scale.attn.h_bias", Slot::kAttnHBias},
      {"res_scale.attn.r_scale", Slot::kAttnRScale}, {"res_scale.attn.r_bias", Slot::kAttnRBias},
      {"attn_norm.weight", Slot::kAttnNorm},         {"attn.wq", Slot::kWq},
      {"attn.wk", Slot::kWk},                         {"attn.wv", Slot::kWv},
      {"attn.wo", Slot::kWo},                         {"attn.cca.w_qk", Slot::kCcaWqk},
      {"attn.cca.w_v", Slot::kCcaWv},                 {"attn.cca.conv0.weight", Slot::kCcaConv0W},
      {"attn.cca.conv0.bias", Slot::kCcaConv0B},      {"attn.cca.conv1.weight", Slot::kCcaConv1W},
      {"attn.cca.conv1.bias", Slot::kCcaConv1B},      {"attn.cca.temp", Slot::kCcaTemp},
      {"attn.cca.wo", Slot::kCcaWo},                  {"res_scale.mlp.h_scale", Slot::kMlpHScale},
      {"res_scale.mlp.h_bias", Slot::kMlpHBias},      {"res_scale.mlp.r_scale", Slot::kMlpRScale},
      {"res_scale.mlp.r_bias", Slot::kMlpRBias},      {"mlp_norm.weight", Slot::kMlpNorm},
      {"mlp.w_gate", Slot::kGate},                    {"mlp.w_up", Slot::kUp},
      {"mlp.w_down", Slot::kDown},                    {"moe.router", Slot::kRouter},
      {"moe.router.down.weight", Slot::kZrDownW},     {"moe.router.down.bias", Slot::kZrDownB},
      {"moe.router.eda_scale", Slot::kZrEda},         {"moe.router.norm.weight", Slot::kZrNorm},
      {"moe.router.mlp1.weight", Slot::kZrW1},        {"moe.router.mlp1.bias", Slot::kZrB1},
      {"moe.router.mlp2.weight", Slot::kZrW2},        {"moe.router.mlp2.bias", Slot::kZrB2},
      {"moe.router.out.weight", Slot::kZrOut},        {"moe.w_gate", Slot::kExpertGate},
      {"moe.w_up", Slot::kExpertUp},                  {"moe.w_down", Slot::kExpertDown},
  };
  return m;
}

const std::map<std::string, Slot>& model_slots() {
  static const std::map<std::string, Slot> m = {
      {"embed.weight", Slot::kEmbed},
      {"final_norm.weight", Slot::kFinalNorm},
      {"lm_head.weight", Slot::kLmHead},
      {"final_res_scale.h_scale", Slot::kFinalHScale},
      {"final_res_scale.h_bias", Slot::kFinalHBias},
      {"final_res_scale.r_scale", Slot::kFinalRScale},
      {"final_res_scale.r_bias", Slot::kFinalRBias},
  };
  return m;
}

}  // namespace

ParamRole role_of(const std::string& name) {
  if (const auto it = model_slots().find(name); it != model_slots().end()) return {-1, it->second};
  if (name.starts_with("layers.")) {
    const auto dot = name.find('.', 7);
    if (dot != std::string::npos && dot > 7 && name.find_first_not_of("0123456789", 7) == dot) {
      const auto it = layer_slots().find(name.substr(dot + 1));
      if (it != layer_slots().end()) return {std::stoi(name.substr(7, dot - 7)), it->second};
    }
  }
  fail("model: unmapped parameter '{}'", name);
}

bool bf16_only(Slot s) {
  switch (s) {
    case Slot::kEmbed: case Slot::kLmHead: case Slot::kWq: case Slot::kWk: case Slot::kWv: case Slot::kWo:
    case Slot::kCcaWqk: case Slot::kCcaWv: case Slot::kCcaWo: case Slot::kGate: case Slot::kUp: case Slot::kDown:
    case Slot::kRouter: case Slot::kZrDownW: case Slot::kZrW1: case Slot::kZrW2: case Slot::kZrOut:
    case Slot::kExpertGate: case Slot::kExpertUp: case Slot::kExpertDown:
      return true;
    default:
      return false;
  }
}

Tensor* layer_slot(LayerWeights& L, Slot s) {
  switch (s) {
    case Slot::kAttnHScale: return &L.attn_scale.h_scale;
    case Slot::kAttnHBias: return &L.attn_scale.h_bias;
    case Slot::kAttnRScale: return &L.attn_scale.r_scale;
    case Slot::kAttnRBias: return &L.attn_scale.r_bias;
    case Slot::kAttnNorm: return &L.attn_norm;
    case Slot::kWq: return &L.wq;
    case Slot::kWk: return &L.wk;
    case Slot::kWv: return &L.wv;
    case Slot::kWo: return &L.wo;
    case Slot::kCcaWqk: return &L.cca.w_qk;
    case Slot::kCcaWv: return &L.cca.w_v;
    case Slot::kCcaConv0W: return &L.cca.conv0_w;
    case Slot::kCcaConv0B: return &L.cca.conv0_b;
    case Slot::kCcaConv1W: return &L.cca.conv1_w;
    case Slot::kCcaConv1B: return &L.cca.conv1_b;
    case Slot::kCcaTemp: return &L.cca.temp;
    case Slot::kCcaWo: return &L.cca.w_o;
    case Slot::kMlpHScale: return &L.mlp_scale.h_scale;
    case Slot::kMlpHBias: return &L.mlp_scale.h_bias;
    case Slot::kMlpRScale: return &L.mlp_scale.r_scale;
    case Slot::kMlpRBias: return &L.mlp_scale.r_bias;
    case Slot::kMlpNorm: return &L.mlp_norm;
    case Slot::kGate: return &L.w_gate;
    case Slot::kUp: return &L.w_up;
    case Slot::kDown: return &L.w_down;
    case Slot::kRouter: return &L.router;
    case Slot::kZrDownW: return &L.zrouter.w_down;
    case Slot::kZrDownB: return &L.zrouter.b_down;
    case Slot::kZrEda: return &L.zrouter.gamma;
    case Slot::kZrNorm: return &L.zrouter.w_norm;
    case Slot::kZrW1: return &L.zrouter.w1;
    case Slot::kZrB1: return &L.zrouter.b1;
    case Slot::kZrW2: return &L.zrouter.w2;
    case Slot::kZrB2: return &L.zrouter.b2;
    case Slot::kZrOut: return &L.zrouter.w3;
    case Slot::kExpertGate: return &L.experts.w_gate;
    case Slot::kExpertUp: return &L.experts.w_up;
    case Slot::kExpertDown: return &L.experts.w_down;
    default: return nullptr;
  }
}

WeightViews map_weights(const model::ModelConfig& cfg, const optim::ParamLayout& layout, float* base) {
  WeightViews w;
  w.layers.assign(static_cast<std::size_t>(cfg.layers), LayerWeights{});
  for (const auto& p : layout.params) {
    const Tensor t = param_view(base, p);
    const ParamRole r = role_of(p.name);
    if (r.layer >= cfg.layers) fail("model: parameter '{}' of a layer the model does not have", p.name);
    LayerWeights& L = w.layers[static_cast<std::size_t>(std::max(r.layer, 0))];
    switch (r.slot) {
      case Slot::kEmbed: w.embed = t; break;
      case Slot::kFinalNorm: w.final_norm = t; break;
      case Slot::kLmHead: w.lm_head = t; break;
      case Slot::kFinalHScale: w.final_scale.h_scale = t; break;
      case Slot::kFinalHBias: w.final_scale.h_bias = t; break;
      case Slot::kFinalRScale: w.final_scale.r_scale = t; break;
      case Slot::kFinalRBias: w.final_scale.r_bias = t; break;
      default:
        *layer_slot(L, r.slot) = t;
        L.moe = L.moe || r.slot == Slot::kRouter || r.slot == Slot::kExpertGate;
    }
  }
  if (cfg.tied_embeddings) w.lm_head = w.embed;
  return w;
}

ops::cca::Config cca_config(const model::ModelConfig& cfg, TensorSplit tp) {
  ops::cca::Config c;
  c.hidden = cfg.hidden;
  c.head_dim = cfg.head_dim;
  c.conv0_width = cfg.cca_conv_width;
  c.conv1_width = cfg.cca_group_conv_width;
  if (tp.degree > cfg.kv_heads) {
    // More ranks than kv heads (model::kv_replicated): the projections, convolutions, mixing and
    // temperatures are whole on every rank (replicated parameters) and the rank attends its own
    // query heads, which share one kv head; W_o is split by them as always.
    c.q_heads = cfg.heads;
    c.kv_heads = cfg.kv_heads;
    c.attend_q = cfg.heads / tp.degree;
    c.attend_q0 = std::int64_t(tp.rank) * c.attend_q;
    return c;
  }
  c.q_heads = cfg.heads / tp.degree;
  c.kv_heads = std::max(1, cfg.kv_heads / tp.degree);
  if (tp.degree > 1) {
    // This rank's value heads are the columns [lo, hi) of the whole [current | previous] value;
    // the previous-token half is [KV / 2, KV).
    const std::int64_t KV = std::int64_t(cfg.kv_heads) * cfg.head_dim, lo = tp.rank * c.kv_heads * c.head_dim,
                       hi = lo + c.kv_heads * c.head_dim;
    c.v_shift_begin = std::clamp(KV / 2, lo, hi) - lo;
    c.v_shift_end = hi - lo;
  }
  return c;
}

}  // namespace keel::blocks
