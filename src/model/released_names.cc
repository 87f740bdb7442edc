#include "model/released_names.h"

#include <map>
#include <set>
#include <stdexcept>

#include <fmt/format.h>

#include "common/error.h"
#include "model/param_layout.h"

namespace keel::model::released {
namespace {

std::int64_t numel(const Shape& s) {
  std::int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

std::string shape_str(const Shape& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

// Appends rules to a NameMap; keel names are parameter names without the "model/" prefix
// except for the router biases, which are passed whole ("router/bias.<i>").
class Rules {
 public:
  explicit Rules(NameMap& m) : m_(m) {}

  // The released tensor is the whole keel tensor, maybe reshaped (conv [C, W] -> [C, 1, W]).
  void whole(std::string released, Shape shape, const std::string& param) {
    const std::string k = "model/" + param;
    m_.rules.push_back({std::move(released), std::move(shape), {{k, 0, dim0(k)}}, false});
  }
  // The released tensor is rows [row0, row0 + rows) of the keel tensor.
  void rows(std::string released, Shape shape, const std::string& param, std::int64_t row0, std::int64_t rows) {
    m_.rules.push_back({std::move(released), std::move(shape), {{"model/" + param, row0, rows}}, false});
  }
  void rule(Rule r) { m_.rules.push_back(std::move(r)); }
  std::int64_t dim0(const std::string& keel) const { return m_.keel_tensor(keel).shape.at(0); }

 private:
  NameMap& m_;
};

struct Dims {
  int L = 0;
  std::int64_t V = 0, D = 0, Dh = 0, Q = 0, KV = 0, C = 0, W0 = 0, W1 = 0, R = 0, E = 0, F = 0, classes = 0;
  int kv_heads = 0;
};

Dims dims_of(const model::ModelConfig& cfg) {
  Dims d;
  d.L = cfg.layers;
  d.V = cfg.vocab_size;
  d.D = cfg.hidden;
  d.Dh = cfg.head_dim;
  d.Q = std::int64_t(cfg.heads) * cfg.head_dim;
  d.KV = std::int64_t(cfg.kv_heads) * cfg.head_dim;
  d.C = d.Q + d.KV;
  d.W0 = cfg.cca_conv_width;
  d.W1 = cfg.cca_group_conv_width;
  d.R = cfg.router_hidden;
  d.E = cfg.experts;
  d.F = cfg.expert_hidden;
  d.classes = cfg.experts + (cfg.router_skip_expert ? 1 : 0);
  d.kv_heads = cfg.kv_heads;
  return d;
}

void require_zaya_shape(const model::ModelConfig& cfg, Names names) {
  const std::string who = fmt::format("--names {}: model '{}'", to_string(names), cfg.name);
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) throw UsageError(fmt::format("{} {}: not a ZAYA1-shaped model", who, what));
  };
  need(cfg.layers >= 1, "has no layers");
  for (int l = 0; l < cfg.layers; ++l) {
    need(model::layer_attention_kind(cfg, l) == model::AttentionKind::kCca,
         fmt::format("layer {} attention is not cca", l));
    need(model::is_moe_layer(cfg, l), fmt::format("layer {} is dense (every ZAYA1 layer is MoE)", l));
  }
  need(cfg.router_hidden > 0 && cfg.router_mlp_layers == 3, "has no 3-layer MLP router (router_hidden, router_mlp_layers)");
  need(cfg.top_k == 1, fmt::format("has top_k {} (ZAYA1 is top-1)", cfg.top_k));
  need(cfg.residual_scaling, "has no residual_scaling");
  need(cfg.shared_experts == 0, "has shared experts");
  need(!cfg.qk_norm, "has qk_norm");
  need(cfg.cca_v_dim == std::int64_t(cfg.kv_heads) * cfg.head_dim && cfg.head_dim % 2 == 0,
       "has cca_v_dim != kv_heads * head_dim (ZAYA1's value path is two halves of kv_heads * head_dim)");
  // The zaya1 branch always builds num_experts + 1 router classes; the alternating layout has
  // the skip class only with zaya_use_mod, which config.json then says.
  if (names == Names::kZaya1) need(cfg.router_skip_expert, "has no router skip class (router_skip_expert)");
}

// Branch `zaya1` (transformers-native ZayaForCausalLM): keel layer l = model.layers.l.
void zaya1_rules(const model::ModelConfig& cfg, const Dims& d, Rules& r) {
  // nn.Embedding [V, D]; the LM head is tied to it (tie_word_embeddings) unless untied below.
  r.whole("model.embed_tokens.weight", {d.V, d.D}, "embed.weight");
  for (int l = 0; l < d.L; ++l) {
    const std::string k = fmt::format("layers.{}.", l), p = fmt::format("model.layers.{}.", l);
    // Stage 0 scales the embedding only: ZayaModel.input_hidden_states_{scale,bias} [D]. The
    // merge before keel's attention stage l > 0 is the previous decoder layer's
    // post_mlp_residual_scale (ZayaResidualScaling: hidden_states_* on the mixer output,
    // residual_* on the residual stream).
    if (l == 0) {
      r.whole("model.input_hidden_states_scale", {d.D}, k + "res_scale.attn.h_scale");
      r.whole("model.input_hidden_states_bias", {d.D}, k + "res_scale.attn.h_bias");
    } else {
      const std::string q = fmt::format("model.layers.{}.post_mlp_residual_scale.", l - 1);
      r.whole(q + "hidden_states_scale", {d.D}, k + "res_scale.attn.h_scale");
      r.whole(q + "hidden_states_bias", {d.D}, k + "res_scale.attn.h_bias");
      r.whole(q + "residual_scale", {d.D}, k + "res_scale.attn.r_scale");
      r.whole(q + "residual_bias", {d.D}, k + "res_scale.attn.r_bias");
    }
    // ZayaRMSNorm before attention.
    r.whole(p + "input_layernorm.weight", {d.D}, k + "attn_norm.weight");
    // ZayaCCAProjection: separate q_proj [Q, D] and k_proj [KV, D] (no bias); keel fuses them
    // row-wise as w_qk = [q; k], the order the release concatenates them for the conv.
    const std::string a = p + "self_attn.qkv_proj.";
    r.rows(a + "q_proj.weight", {d.Q, d.D}, k + "attn.cca.w_qk", 0, d.Q);
    r.rows(a + "k_proj.weight", {d.KV, d.D}, k + "attn.cca.w_qk", d.Q, d.KV);
    // Values: v_proj_current (current token) then v_proj_delayed (previous token), KV/2 rows
    // each; keel's w_v = [current; delayed].
    r.rows(a + "v_proj_current.weight", {d.KV / 2, d.D}, k + "attn.cca.w_v", 0, d.KV / 2);
    r.rows(a + "v_proj_delayed.weight", {d.KV / 2, d.D}, k + "attn.cca.w_v", d.KV / 2, d.KV / 2);
    // Depthwise nn.Conv1d(C, C, W0, groups=C): weight [C, 1, W0] (keel squeezes the 1), bias [C].
    r.whole(a + "conv_qk_depthwise.weight", {d.C, 1, d.W0}, k + "attn.cca.conv0.weight");
    r.whole(a + "conv_qk_depthwise.bias", {d.C}, k + "attn.cca.conv0.bias");
    // Grouped nn.Conv1d(C, C, W1, groups=heads + kv_heads): weight [C, Dh, W1], bias [C].
    r.whole(a + "conv_qk_grouped.weight", {d.C, d.Dh, d.W1}, k + "attn.cca.conv1.weight");
    r.whole(a + "conv_qk_grouped.bias", {d.C}, k + "attn.cca.conv1.bias");
    // ZayaQKNorm.temp: the per-kv-head key temperature [kv_heads].
    r.whole(p + "self_attn.qk_norm.temp", {d.kv_heads}, k + "attn.cca.temp");
    r.whole(p + "self_attn.o_proj.weight", {d.D, d.Q}, k + "attn.cca.wo");
    // The merge before the MoE stage.
    const std::string s = p + "post_attention_residual_scale.";
    r.whole(s + "hidden_states_scale", {d.D}, k + "res_scale.mlp.h_scale");
    r.whole(s + "hidden_states_bias", {d.D}, k + "res_scale.mlp.h_bias");
    r.whole(s + "residual_scale", {d.D}, k + "res_scale.mlp.r_scale");
    r.whole(s + "residual_bias", {d.D}, k + "res_scale.mlp.r_bias");
    r.whole(p + "post_attention_layernorm.weight", {d.D}, k + "mlp_norm.weight");
    // ZayaRouter (mlp.gate): down_proj with bias; router_states_scale (EDA) on every layer but
    // the first; ZayaRouterMLP = norm, fc1 and fc2 (with bias), out_proj [E + 1, R] (no bias).
    const std::string g = p + "mlp.gate.";
    r.whole(g + "down_proj.weight", {d.R, d.D}, k + "moe.router.down.weight");
    r.whole(g + "down_proj.bias", {d.R}, k + "moe.router.down.bias");
    if (l > 0) r.whole(g + "router_states_scale", {d.R}, k + "moe.router.eda_scale");
    r.whole(g + "router_mlp.norm.weight", {d.R}, k + "moe.router.norm.weight");
    r.whole(g + "router_mlp.fc1.weight", {d.R, d.R}, k + "moe.router.mlp1.weight");
    r.whole(g + "router_mlp.fc1.bias", {d.R}, k + "moe.router.mlp1.bias");
    r.whole(g + "router_mlp.fc2.weight", {d.R, d.R}, k + "moe.router.mlp2.weight");
    r.whole(g + "router_mlp.fc2.bias", {d.R}, k + "moe.router.mlp2.bias");
    r.whole(g + "router_mlp.out_proj.weight", {d.classes, d.R}, k + "moe.router.out.weight");
    // balancing_biases: a persistent fp32 buffer [E + 1] (skip class last, as keel's).
    const std::string bias = fmt::format("router/bias.{}", l);
    r.rule({g + "balancing_biases", {d.classes}, {{bias, 0, d.classes}}, true});
    // ZayaExperts: gate_up_proj [E, 2F, D], per expert the gate rows (through SiLU) then the up
    // rows (chunk(2) of the output); down_proj [E, D, F].
    Rule gu{p + "mlp.experts.gate_up_proj", {d.E, 2 * d.F, d.D}, {}, false};
    for (std::int64_t e = 0; e < d.E; ++e) {
      gu.pieces.push_back({"model/" + k + "moe.w_gate", e, 1});
      gu.pieces.push_back({"model/" + k + "moe.w_up", e, 1});
    }
    r.rule(std::move(gu));
    r.whole(p + "mlp.experts.down_proj", {d.E, d.D, d.F}, k + "moe.w_down");
  }
  // The merge after the last stage is the last decoder layer's post_mlp_residual_scale.
  const std::string q = fmt::format("model.layers.{}.post_mlp_residual_scale.", d.L - 1);
  r.whole(q + "hidden_states_scale", {d.D}, "final_res_scale.h_scale");
  r.whole(q + "hidden_states_bias", {d.D}, "final_res_scale.h_bias");
  r.whole(q + "residual_scale", {d.D}, "final_res_scale.r_scale");
  r.whole(q + "residual_bias", {d.D}, "final_res_scale.r_bias");
  r.whole("model.norm.weight", {d.D}, "final_norm.weight");
  if (!cfg.tied_embeddings) r.whole("lm_head.weight", {d.V, d.D}, "lm_head.weight");
}

// The original alternating-layer layout: keel layer l = stages 2l (attention) and 2l + 1 (MoE).
void alternating_rules(const model::ModelConfig& cfg, const Dims& d, Rules& r) {
  r.whole("model.embed_tokens.weight", {d.V, d.D}, "embed.weight");
  for (int l = 0; l < d.L; ++l) {
    const std::string k = fmt::format("layers.{}.", l);
    const std::string pa = fmt::format("model.layers.{}.", 2 * l), pm = fmt::format("model.layers.{}.", 2 * l + 1);
    // Every stage's ResidualScaling (res_scale) merges before its mixer; stage 0's has only the
    // hidden_states_* pair (it scales the embedding, there is no residual yet).
    r.whole(pa + "res_scale.hidden_states_scale", {d.D}, k + "res_scale.attn.h_scale");
    r.whole(pa + "res_scale.hidden_states_bias", {d.D}, k + "res_scale.attn.h_bias");
    if (l > 0) {
      r.whole(pa + "res_scale.residual_scale", {d.D}, k + "res_scale.attn.r_scale");
      r.whole(pa + "res_scale.residual_bias", {d.D}, k + "res_scale.attn.r_bias");
    }
    r.whole(pa + "input_norm.weight", {d.D}, k + "attn_norm.weight");
    // CCA (self_attn.qkv): linear_q, linear_k, val_proj1 (current token), val_proj2 (previous
    // token), conv_qk = Sequential(depthwise Conv1d, grouped Conv1d), temp [kv_heads].
    const std::string a = pa + "self_attn.qkv.";
    r.rows(a + "linear_q.weight", {d.Q, d.D}, k + "attn.cca.w_qk", 0, d.Q);
    r.rows(a + "linear_k.weight", {d.KV, d.D}, k + "attn.cca.w_qk", d.Q, d.KV);
    r.rows(a + "val_proj1.weight", {d.KV / 2, d.D}, k + "attn.cca.w_v", 0, d.KV / 2);
    r.rows(a + "val_proj2.weight", {d.KV / 2, d.D}, k + "attn.cca.w_v", d.KV / 2, d.KV / 2);
    r.whole(a + "conv_qk.0.weight", {d.C, 1, d.W0}, k + "attn.cca.conv0.weight");
    r.whole(a + "conv_qk.0.bias", {d.C}, k + "attn.cca.conv0.bias");
    r.whole(a + "conv_qk.1.weight", {d.C, d.Dh, d.W1}, k + "attn.cca.conv1.weight");
    r.whole(a + "conv_qk.1.bias", {d.C}, k + "attn.cca.conv1.bias");
    r.whole(a + "temp", {d.kv_heads}, k + "attn.cca.temp");
    r.whole(pa + "self_attn.o_proj.weight", {d.D, d.Q}, k + "attn.cca.wo");
    // The MoE stage.
    r.whole(pm + "res_scale.hidden_states_scale", {d.D}, k + "res_scale.mlp.h_scale");
    r.whole(pm + "res_scale.hidden_states_bias", {d.D}, k + "res_scale.mlp.h_bias");
    r.whole(pm + "res_scale.residual_scale", {d.D}, k + "res_scale.mlp.r_scale");
    r.whole(pm + "res_scale.residual_bias", {d.D}, k + "res_scale.mlp.r_bias");
    r.whole(pm + "input_norm.weight", {d.D}, k + "mlp_norm.weight");
    // ZayaRouter (zaya_block.router): down_proj (bias), router_states_scale except on the
    // first MoE stage, rmsnorm_eda, router_mlp = Sequential(Linear, GELU, Linear, GELU,
    // Linear): parameters at indices 0, 2 and 4; balancing_biases fp32 buffer.
    const std::string g = pm + "zaya_block.router.";
    r.whole(g + "down_proj.weight", {d.R, d.D}, k + "moe.router.down.weight");
    r.whole(g + "down_proj.bias", {d.R}, k + "moe.router.down.bias");
    if (l > 0) r.whole(g + "router_states_scale", {d.R}, k + "moe.router.eda_scale");
    r.whole(g + "rmsnorm_eda.weight", {d.R}, k + "moe.router.norm.weight");
    r.whole(g + "router_mlp.0.weight", {d.R, d.R}, k + "moe.router.mlp1.weight");
    r.whole(g + "router_mlp.0.bias", {d.R}, k + "moe.router.mlp1.bias");
    r.whole(g + "router_mlp.2.weight", {d.R, d.R}, k + "moe.router.mlp2.weight");
    r.whole(g + "router_mlp.2.bias", {d.R}, k + "moe.router.mlp2.bias");
    r.whole(g + "router_mlp.4.weight", {d.classes, d.R}, k + "moe.router.out.weight");
    r.rule({g + "balancing_biases", {d.classes}, {{fmt::format("router/bias.{}", l), 0, d.classes}}, true});
    // SequentialMLP: one MLP per expert; linear_fc1 [2F, D] = [gate; up] (the GLU's first chunk
    // goes through SiLU), linear_fc2 [D, F]; no biases.
    for (std::int64_t e = 0; e < d.E; ++e) {
      const std::string x = fmt::format("{}zaya_block.experts.local_experts.{}.", pm, e);
      r.rule({x + "linear_fc1.weight",
              {2 * d.F, d.D},
              {{"model/" + k + "moe.w_gate", e, 1}, {"model/" + k + "moe.w_up", e, 1}},
              false});
      r.rows(x + "linear_fc2.weight", {d.D, d.F}, k + "moe.w_down", e, 1);
    }
  }
  // ZayaModel.res_scale: the merge after the last stage; final_norm.
  r.whole("model.res_scale.hidden_states_scale", {d.D}, "final_res_scale.h_scale");
  r.whole("model.res_scale.hidden_states_bias", {d.D}, "final_res_scale.h_bias");
  r.whole("model.res_scale.residual_scale", {d.D}, "final_res_scale.r_scale");
  r.whole("model.res_scale.residual_bias", {d.D}, "final_res_scale.r_bias");
  r.whole("model.final_norm.weight", {d.D}, "final_norm.weight");
  if (!cfg.tied_embeddings) r.whole("lm_head.weight", {d.V, d.D}, "lm_head.weight");
}

}  // namespace

std::int64_t row_numel(const Shape& s) { return s.empty() || s[0] == 0 ? 0 : numel(s) / s[0]; }

std::string layout_hint(const std::string& name, Names names) {
  const bool alternating = name.find("zaya_block.") != std::string::npos ||
                           name.find(".qkv.linear_") != std::string::npos || name.find(".input_norm.") != std::string::npos ||
                           name.find("model.final_norm.") == 0;
  const bool native = name.find(".qkv_proj.") != std::string::npos || name.find(".mlp.gate.") != std::string::npos ||
                      name.find(".mlp.experts.") != std::string::npos || name.find("_layernorm.") != std::string::npos ||
                      name.find("model.input_hidden_states_") == 0 || name == "model.norm.weight";
  if (names == Names::kZaya1 && alternating)
    return " (it is a name of the alternating-layer layout: use --names zaya1-alternating)";
  if (names == Names::kZaya1Alternating && native) return " (it is a name of the zaya1 branch's layout: use --names zaya1)";
  return "";
}

Names parse_names(std::string_view s) {
  if (s == "zaya1") return Names::kZaya1;
  if (s == "zaya1-alternating") return Names::kZaya1Alternating;
  throw UsageError(fmt::format("unknown --names '{}' (zaya1, zaya1-alternating)", s));
}

const char* to_string(Names n) { return n == Names::kZaya1 ? "zaya1" : "zaya1-alternating"; }

const Rule* NameMap::find(const std::string& released) const {
  for (const auto& r : rules)
    if (r.released == released) return &r;
  return nullptr;
}

const KeelTensor& NameMap::keel_tensor(const std::string& name) const {
  for (const auto& k : keel)
    if (k.name == name) return k;
  fail("ZAYA1 names: no keel tensor '{}'", name);
}

NameMap build_name_map(const model::ModelConfig& cfg, Names names) {
  require_zaya_shape(cfg, names);
  NameMap m;
  m.names = names;
  const optim::ParamLayout layout = model::param_layout(cfg);
  for (const auto& p : layout.params) m.keel.push_back({"model/" + p.name, Shape(p.shape.begin(), p.shape.end())});
  const Dims d = dims_of(cfg);
  for (int l = 0; l < d.L; ++l) m.keel.push_back({fmt::format("router/bias.{}", l), {d.classes}});
  Rules r(m);
  if (names == Names::kZaya1) zaya1_rules(cfg, d, r);
  else alternating_rules(cfg, d, r);
  if (cfg.tied_embeddings) m.dropped_on_import.push_back("lm_head.weight");
  return m;
}

void check_coverage(const NameMap& map) {
  std::map<std::string, std::vector<int>> cover;  // keel tensor -> times each row is covered
  for (const auto& k : map.keel) cover[k.name].assign(static_cast<std::size_t>(k.shape.at(0)), 0);
  std::set<std::string> seen;
  for (const auto& r : map.rules) {
    if (!seen.insert(r.released).second) fail("ZAYA1 names: released tensor '{}' is mapped twice", r.released);
    std::int64_t elems = 0;
    for (const auto& p : r.pieces) {
      auto it = cover.find(p.keel);
      if (it == cover.end()) fail("ZAYA1 names: '{}' reads '{}', which is not a keel tensor", r.released, p.keel);
      const Shape& ks = map.keel_tensor(p.keel).shape;
      if (p.row0 < 0 || p.rows < 1 || p.row0 + p.rows > ks[0])
        fail("ZAYA1 names: '{}' reads rows [{}, {}) of '{}' {}", r.released, p.row0, p.row0 + p.rows, p.keel,
             shape_str(ks));
      for (std::int64_t i = p.row0; i < p.row0 + p.rows; ++i) ++it->second[static_cast<std::size_t>(i)];
      elems += p.rows * row_numel(ks);
    }
    if (elems != numel(r.shape))
      fail("ZAYA1 names: '{}' {} has {} elements, its pieces {}", r.released, shape_str(r.shape), numel(r.shape), elems);
  }
  for (const auto& [name, rows] : cover)
    for (std::size_t i = 0; i < rows.size(); ++i)
      if (rows[i] != 1)
        fail("ZAYA1 names: row {} of keel tensor '{}' is mapped {} times (must be exactly once)", i, name, rows[i]);
}

}  // namespace keel::model::released
