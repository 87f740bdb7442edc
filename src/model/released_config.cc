#include "model/released_config.h"

#include <cstdint>
#include <optional>
#include <set>
#include <vector>

#include <fmt/format.h>

#include "common/error.h"

namespace keel::model::released {
namespace {

using json = nlohmann::json;

// Keys that change nothing keel computes from imported weights: provenance, token ids (keel
// takes the tokenizer's), inference switches, initialization, and the fork's precision and
// kernel-fusion flags.
const std::set<std::string> kHarmless = {
    "_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "initializer_range", "pad_token_id", "bos_token_id", "eos_token_id", "output_router_logits",
    "output_attentions", "output_hidden_states", "return_dict", "_attn_implementation", "tokenizer_class",
    "zaya_high_prec", "residual_in_fp32", "fused_add_norm", "apply_rope_fusion", "bias_activation_fusion",
    "activation_func_fp8_input_store"};

// The keys of one config.json, each read at most once; finish() refuses any key nobody read.
class Keys {
 public:
  Keys(const json& j, std::string what) : j_(j), what_(std::move(what)) {
    if (!j.is_object()) throw UsageError(fmt::format("{}: not a JSON object of config keys", what_));
  }

  [[noreturn]] void bad(const std::string& key, const std::string& why) const {
    throw UsageError(fmt::format("{}: '{}' {}", what_, key, why));
  }
  [[noreturn]] void bad_value(const std::string& key, const json& v, const std::string& why) const {
    bad(key, fmt::format("is {}: {}", v.dump(), why));
  }

  // The value of `key`; nullptr when it is absent or null.
  const json* get(const std::string& key) {
    used_.insert(key);
    const auto it = j_.find(key);
    return it == j_.end() || it->is_null() ? nullptr : &*it;
  }
  std::int64_t integer(const std::string& key, std::optional<std::int64_t> fallback) {
    const json* v = get(key);
    if (!v) return required(key, fallback);
    if (!v->is_number_integer()) bad_value(key, *v, "must be an integer");
    return v->get<std::int64_t>();
  }
  int i32(const std::string& key, std::optional<std::int64_t> fallback) {
    const std::int64_t x = integer(key, fallback);
    if (x < 0 || x > INT32_MAX) bad(key, fmt::format("is {}: out of range", x));
    return static_cast<int>(x);
  }
  double number(const std::string& key, std::optional<double> fallback) {
    const json* v = get(key);
    if (!v) return required(key, fallback);
    if (!v->is_number()) bad_value(key, *v, "must be a number");
    return v->get<double>();
  }
  std::optional<std::int64_t> maybe_integer(const std::string& key) {
    return get(key) ? std::optional(integer(key, 0)) : std::nullopt;
  }
  bool boolean(const std::string& key, bool fallback) {
    const json* v = get(key);
    if (!v) return fallback;
    if (!v->is_boolean()) bad_value(key, *v, "must be true or false");
    return v->get<bool>();
  }
  // `key`, when given, must be `want`: the one value keel's ZAYA1 has.
  void require(const std::string& key, const json& want, const char* why) {
    if (const json* v = get(key); v && *v != want) bad_value(key, *v, why);
  }
  // `key`, when given, must equal `want`, the value `source` gave.
  template <typename T>
  void agree(const std::string& key, T want, const std::string& source) {
    const json* v = get(key);
    if (v && (!v->is_number() || v->get<double>() != static_cast<double>(want)))
      bad_value(key, *v, fmt::format("{} says {}", source, want));
  }
  [[noreturn]] void missing(const std::string& keys) const { throw UsageError(fmt::format("{}: no {}", what_, keys)); }
  void finish() const {
    for (const auto& [key, value] : j_.items())
      if (!used_.count(key) && !kHarmless.count(key))
        bad(key, "is not a key keel knows to leave the computation alone: keel cannot tell what it changes");
  }

 private:
  template <typename T>
  T required(const std::string& key, std::optional<T> fallback) const {
    if (!fallback) throw UsageError(fmt::format("{}: no '{}'", what_, key));
    return *fallback;
  }

  const json& j_;
  std::string what_;
  std::set<std::string> used_;
};

// The fork's switches both layouts write, each at the one value keel's ZAYA1 has.
void fork_flags(Keys& k) {
  k.require("cca", true, "keel's ZAYA1 attention is CCA");
  k.require("clamp_temp", false, "keel does not clamp CCA's key temperature");
  k.require("activation_func", "swiglu", "keel's experts are SwiGLU");
  k.require("gated_linear_unit", true, "keel's experts are SwiGLU");
  k.require("add_bias_linear", false, "keel's experts have no biases");
  k.require("normalization", "RMSNorm", "keel's norms are RMSNorm");
  k.require("zaya_use_eda", true, "keel's router always carries the previous layer's router state (EDA)");
  k.require("scale_residual_merge", true, "keel's ZAYA1 always scales the residual merge");
  k.require("attention_bias", false, "keel's attention projections have no biases");
  k.require("lm_head_bias", false, "keel's LM head has no bias");
  k.require("attention_dropout", 0, "keel has no attention dropout");
  const json* s = k.get("rope_scaling");
  if (s && *s != false) k.bad_value("rope_scaling", *s, "keel runs the default RoPE only (no scaling)");
}

// The fixed parts of keel's ZAYA1 (released_names.cc's require_zaya_shape).
ModelConfig zaya_skeleton(const std::string& name) {
  ModelConfig m;
  m.name = name;
  m.attention = AttentionKind::kCca;
  m.router_mlp_layers = 3;
  m.residual_scaling = true;
  m.top_k = 1;
  return m;
}

void finish_cca(ModelConfig& m) {
  m.cca_q_dim = m.heads * m.head_dim;
  m.cca_k_dim = m.kv_heads * m.head_dim;
  m.cca_v_dim = m.kv_heads * m.head_dim;  // two halves: current and previous token
}

struct Rope {
  double theta = 0, fraction = 0;
};

// One layer type's entry of rope_parameters; absent keys fall back to the top-level rope_theta /
// partial_rotary_factor, then (the fraction) to transformers' 1.0.
std::optional<Rope> rope_entry(Keys& k, const json& params, const std::string& type, const json* theta,
                               const json* fraction) {
  const auto it = params.find(type);
  if (it == params.end() || it->is_null()) return std::nullopt;
  const std::string at = "rope_parameters." + type;
  if (!it->is_object()) k.bad_value(at, *it, "must be an object (rope_type, rope_theta, partial_rotary_factor)");
  for (const char* key : {"rope_type", "type"})
    if (it->contains(key) && (*it)[key] != "default")
      k.bad_value(at + "." + key, (*it)[key], "keel runs the default RoPE only");
  for (const auto& [key, v] : it->items()) {
    if (key == "rope_type" || key == "type") continue;
    if (key != "rope_theta" && key != "partial_rotary_factor")
      k.bad(at + "." + key, "is a RoPE parameter keel does not have (it runs the default RoPE: rope_theta, "
                            "partial_rotary_factor)");
    if (!v.is_number()) k.bad_value(at + "." + key, v, "must be a number");
  }
  if (!it->contains("rope_theta") && !theta) k.bad(at, "has no rope_theta");
  const json& t = it->contains("rope_theta") ? (*it)["rope_theta"] : *theta;
  const json* f = it->contains("partial_rotary_factor") ? &(*it)["partial_rotary_factor"] : fraction;
  return Rope{t.get<double>(), f ? f->get<double>() : 1.0};
}

// The RoPE of the two layer types: rope_parameters (per type, as transformers' ZayaConfig), else
// the top-level rope_theta / partial_rotary_factor, else ZayaConfig's defaults.
std::pair<Rope, Rope> zaya1_rope(Keys& k) {
  const json* theta = k.get("rope_theta");
  const json* fraction = k.get("partial_rotary_factor");
  if (theta && !theta->is_number()) k.bad_value("rope_theta", *theta, "must be a number");
  if (fraction && !fraction->is_number()) k.bad_value("partial_rotary_factor", *fraction, "must be a number");
  const json* params = k.get("rope_parameters");
  if (!params) {
    const double f = fraction ? fraction->get<double>() : 0.5;
    return {{theta ? theta->get<double>() : 5e6, f}, {theta ? theta->get<double>() : 1e4, f}};
  }
  if (!params->is_object()) k.bad_value("rope_parameters", *params, "must be an object of layer types");
  for (const auto& [key, v] : params->items()) {
    // The Hub's ZAYA1-8B config also has a stray top-level rope_type, which transformers drops.
    if (key == "rope_type") {
      if (v != "default") k.bad_value("rope_parameters.rope_type", v, "keel runs the default RoPE only");
    } else if (key != "hybrid" && key != "hybrid_sliding") {
      k.bad("rope_parameters." + key, "is not a layer type (keel reads hybrid and hybrid_sliding)");
    }
  }
  const auto hybrid = rope_entry(k, *params, "hybrid", theta, fraction);
  const auto sliding = rope_entry(k, *params, "hybrid_sliding", theta, fraction);
  // The top-level keys (the fork's, which keel's export writes too) are the full layers' RoPE.
  if (hybrid && theta && theta->get<double>() != hybrid->theta)
    k.bad_value("rope_theta", *theta, fmt::format("rope_parameters.hybrid.rope_theta says {}", hybrid->theta));
  if (hybrid && fraction && fraction->get<double>() != hybrid->fraction)
    k.bad_value("partial_rotary_factor", *fraction,
                fmt::format("rope_parameters.hybrid.partial_rotary_factor says {}", hybrid->fraction));
  const Rope none{-1, -1};
  return {hybrid.value_or(none), sliding.value_or(none)};
}

// The shortest pattern that repeats to `per_layer` (keel's layer_sliding form); empty when no
// layer slides.
std::vector<bool> sliding_pattern(const std::vector<bool>& per_layer) {
  const std::size_t n = per_layer.size();
  bool any = false;
  for (const bool b : per_layer) any |= b;
  if (!any) return {};
  for (std::size_t p = 1; p < n; ++p) {
    if (n % p != 0) continue;
    bool repeats = true;
    for (std::size_t i = p; i < n && repeats; ++i) repeats = per_layer[i] == per_layer[i % p];
    if (repeats) return std::vector<bool>(per_layer.begin(), per_layer.begin() + static_cast<std::ptrdiff_t>(p));
  }
  return per_layer;
}

// Transformers' ZayaForCausalLM (branch zaya1): one decoder layer per keel layer.
ModelConfig zaya1_model(Keys& k, const std::string& name) {
  ModelConfig m = zaya_skeleton(name);
  m.vocab_size = k.integer("vocab_size", 262272);
  m.hidden = k.i32("hidden_size", 2048);
  m.layers = k.i32("num_hidden_layers", 40);
  if (m.layers < 1 || m.layers > 65536) k.bad("num_hidden_layers", fmt::format("is {}: must be in [1, 65536]", m.layers));
  m.heads = k.i32("num_attention_heads", 8);
  m.kv_heads = k.i32("num_key_value_heads", 2);
  m.head_dim = k.i32("head_dim", 128);
  k.require("hidden_act", "silu", "keel's experts are SwiGLU (a SiLU gate)");
  m.max_seq_len = k.i32("max_position_embeddings", 131072);
  m.norm_eps = k.number("rms_norm_eps", 1e-5);
  m.tied_embeddings = k.boolean("tie_word_embeddings", true);
  m.expert_hidden = k.i32("moe_intermediate_size", 2048);
  m.experts = k.i32("num_experts", 16);
  k.require("num_experts_per_tok", 1, "keel's ZAYA1 routes top-1");
  m.router_hidden = k.i32("router_hidden_size", 256);
  m.router_skip_expert = true;  // transformers' router always has the skip class
  m.cca_conv_width = k.i32("cca_time0", 2);
  m.cca_group_conv_width = k.i32("cca_time1", 2);
  finish_cca(m);

  // Layer types: "hybrid" (full causal attention) or "hybrid_sliding" (a window).
  std::vector<bool> sliding(static_cast<std::size_t>(m.layers), false);
  int slides = 0;
  if (const json* types = k.get("layer_types")) {
    if (!types->is_array() || types->size() != sliding.size())
      k.bad("layer_types", fmt::format("must list num_hidden_layers ({}) layer types", m.layers));
    for (std::size_t l = 0; l < sliding.size(); ++l) {
      const json& t = (*types)[l];
      if (t != "hybrid" && t != "hybrid_sliding")
        k.bad_value(fmt::format("layer_types[{}]", l), t, "keel has the layer types hybrid and hybrid_sliding");
      sliding[l] = t == "hybrid_sliding";
      slides += sliding[l];
    }
  }
  const json* window = k.get("sliding_window");
  if (window && !window->is_number_integer()) k.bad_value("sliding_window", *window, "must be an integer or null");
  if (slides > 0) {
    if (!window || window->get<std::int64_t>() < 1 || window->get<std::int64_t>() > INT32_MAX)
      k.bad("sliding_window", "must be a positive integer: layer_types has hybrid_sliding layers");
    m.sliding_window = window->get<int>();
    m.layer_sliding = sliding_pattern(sliding);
  }
  const auto [full, slid] = zaya1_rope(k);
  if (slides < m.layers && full.theta < 0) k.bad("rope_parameters", "has no 'hybrid' entry for the hybrid layers");
  if (slides > 0 && slid.theta < 0) k.bad("rope_parameters", "has no 'hybrid_sliding' entry for the hybrid_sliding layers");
  const Rope& base = slides < m.layers ? full : slid;
  m.rope_base = base.theta;
  m.rope_fraction = base.fraction;
  if (slides > 0 && slid.theta != m.rope_base) m.sliding_rope_base = slid.theta;
  if (slides > 0 && slid.fraction != m.rope_fraction) m.sliding_rope_fraction = slid.fraction;

  // The fork's keys for the same values (keel's export writes them): they must agree.
  k.agree("num_query_groups", m.kv_heads, "num_key_value_heads");
  k.agree("ffn_hidden_size", 2 * m.expert_hidden, "2 x moe_intermediate_size");
  k.agree("moe_router_topk", 1, "num_experts_per_tok");
  k.agree("norm_epsilon", m.norm_eps, "rms_norm_eps");
  k.agree("zaya_mlp_expansion", m.router_hidden, "router_hidden_size");
  k.require("zaya_use_mod", true, "the zaya1 layout always has the skip class");
  fork_flags(k);
  return m;
}

// A legacy per-stage value: a scalar, or a list over the 2L stages whose entries on the stages of
// `parity` (0: attention, 1: MoE) are all equal.
std::optional<std::int64_t> stage_value(Keys& k, const std::string& key, int stages, int parity) {
  const json* v = k.get(key);
  if (!v) return std::nullopt;
  if (v->is_number_integer()) return v->get<std::int64_t>();
  if (!v->is_array() || v->size() != static_cast<std::size_t>(stages))
    k.bad_value(key, *v, fmt::format("must be an integer or a list of num_hidden_layers ({}) integers", stages));
  std::optional<std::int64_t> x;
  for (int i = parity; i < stages; i += 2) {
    const json& e = (*v)[static_cast<std::size_t>(i)];
    if (!e.is_number_integer()) k.bad_value(fmt::format("{}[{}]", key, i), e, "must be an integer");
    if (x && e.get<std::int64_t>() != *x)
      k.bad_value(fmt::format("{}[{}]", key, i), e, fmt::format("stage {} has {}: keel's layers are all alike", parity, *x));
    x = e.get<std::int64_t>();
  }
  return x;
}

// The first of the keys given (each later one must agree with it), else `fallback`.
std::int64_t one_of(Keys& k, const std::vector<std::pair<std::string, std::optional<std::int64_t>>>& values,
                    std::optional<std::int64_t> fallback) {
  std::optional<std::int64_t> x;
  std::string from;
  for (const auto& [key, v] : values) {
    if (!v) continue;
    if (x && *v != *x) k.bad(key, fmt::format("is {}, but {} says {}", *v, from, *x));
    if (!x) x = v, from = key;
  }
  if (x) return *x;
  if (!fallback) {
    std::string keys;
    for (const auto& [key, v] : values) keys += fmt::format("{}'{}'", keys.empty() ? "" : " or ", key);
    k.missing(keys);
  }
  return *fallback;
}

int as_i32(Keys& k, const std::string& key, std::int64_t v) {
  if (v < 1 || v > INT32_MAX) k.bad(key, fmt::format("is {}: must be positive", v));
  return static_cast<int>(v);
}

// The legacy alternating-layer config (branch zaya1-legacy): 2L stages, Megatron-style keys.
ModelConfig alternating_model(Keys& k, const std::string& name) {
  ModelConfig m = zaya_skeleton(name);
  const int stages = k.i32("num_hidden_layers", std::nullopt);
  if (stages < 2 || stages % 2 != 0)
    k.bad("num_hidden_layers", fmt::format("is {}: must be even, the layout alternates attention and MoE stages", stages));
  m.layers = stages / 2;
  std::optional<std::int64_t> zaya_experts;
  if (const json* zl = k.get("zaya_layers")) {
    if (!zl->is_array() || zl->size() != static_cast<std::size_t>(stages))
      k.bad("zaya_layers", fmt::format("must list num_hidden_layers ({}) stages", stages));
    for (int i = 0; i < stages; ++i) {
      const json& e = (*zl)[static_cast<std::size_t>(i)];
      const bool ok = i % 2 == 0 ? e == "a" : e.is_number_integer() && (!zaya_experts || e == *zaya_experts);
      if (!ok) k.bad_value(fmt::format("zaya_layers[{}]", i), e, "keel's layers alternate \"a\" and the same expert count");
      if (i % 2) zaya_experts = e.get<std::int64_t>();
    }
  }
  m.vocab_size = k.integer("vocab_size", std::nullopt);
  m.hidden = k.i32("hidden_size", std::nullopt);
  const int attention_heads = k.i32("num_attention_heads", std::nullopt);
  if (attention_heads < 1 || m.hidden % attention_heads != 0)
    k.bad("num_attention_heads", fmt::format("is {}: must divide hidden_size ({})", attention_heads, m.hidden));
  // The head width: head_dim, kv_channels, or as the legacy config derives it.
  m.head_dim = as_i32(k, "head_dim",
                      one_of(k, {{"head_dim", k.maybe_integer("head_dim")}, {"kv_channels", k.maybe_integer("kv_channels")}},
                             m.hidden / attention_heads));
  m.heads = as_i32(k, "cca_num_q_heads",
                   one_of(k, {{"cca_num_q_heads", stage_value(k, "cca_num_q_heads", stages, 0)}}, std::nullopt));
  m.kv_heads = as_i32(k, "num_query_groups",
                      one_of(k, {{"num_query_groups", stage_value(k, "num_query_groups", stages, 0)},
                                 {"num_query_groups_list", stage_value(k, "num_query_groups_list", stages, 0)},
                                 {"num_key_value_heads", k.maybe_integer("num_key_value_heads")}},
                             std::nullopt));
  m.experts = as_i32(k, "num_experts",
                     one_of(k, {{"num_experts", k.maybe_integer("num_experts")}, {"zaya_layers", zaya_experts}}, std::nullopt));
  const std::int64_t ffn = one_of(k, {{"ffn_hidden_size", stage_value(k, "ffn_hidden_size", stages, 1)},
                                      {"ffn_hidden_size_list", stage_value(k, "ffn_hidden_size_list", stages, 1)}},
                                  std::nullopt);
  if (ffn < 2 || ffn % 2 != 0) k.bad("ffn_hidden_size", fmt::format("is {}: must be even (gate and up halves)", ffn));
  m.expert_hidden = as_i32(k, "ffn_hidden_size", ffn / 2);
  m.router_hidden = as_i32(
      k, "zaya_mlp_expansion", one_of(k, {{"zaya_mlp_expansion", stage_value(k, "zaya_mlp_expansion", stages, 1)}}, std::nullopt));
  k.require("moe_router_topk", 1, "keel's ZAYA1 routes top-1");
  k.require("num_experts_per_tok", 1, "keel's ZAYA1 routes top-1");
  m.router_skip_expert = k.boolean("zaya_use_mod", true);
  m.norm_eps = k.number("norm_epsilon", 1e-5);
  k.agree("rms_norm_eps", m.norm_eps, "norm_epsilon");
  const json* rotary_base = k.get("rotary_base");
  m.rope_base = k.number("rope_theta", rotary_base && rotary_base->is_number() ? rotary_base->get<double>() : 1e4);
  k.agree("rotary_base", m.rope_base, "rope_theta");
  const json* rope_pct = k.get("rope_pct");
  m.rope_fraction = k.number("partial_rotary_factor", rope_pct && rope_pct->is_number() ? rope_pct->get<double>() : 0.5);
  k.agree("rope_pct", m.rope_fraction, "partial_rotary_factor");
  m.max_seq_len = k.i32("max_position_embeddings", 4096);
  m.tied_embeddings = k.boolean("tie_word_embeddings", true);
  m.cca_conv_width = k.i32("cca_time0", 2);
  m.cca_group_conv_width = k.i32("cca_time1", 2);
  finish_cca(m);
  // Sliding windows of this layout (swa_layers, per stage) are not read: refused unless none slides.
  if (const json* swa = k.get("swa_layers")) {
    bool none = swa->is_array();
    if (none)
      for (const json& e : *swa) none &= e == 0 || e.is_null();
    if (!none) k.bad_value("swa_layers", *swa, "keel does not read this layout's sliding windows (use --names zaya1)");
  }
  k.get("swa_rotary_base");  // the RoPE of sliding stages: none slides
  if (const json* w = k.get("sliding_window")) k.bad_value("sliding_window", *w, "keel does not read this layout's sliding windows");
  fork_flags(k);
  return m;
}

}  // namespace

TokenIds default_token_ids(const ModelConfig& cfg) {
  if (cfg.vocab_size == 262272) return {0, 2, 106};
  return {};
}

TokenIds parse_token_ids(const std::string& text, std::int64_t vocab_size) {
  const std::string what = fmt::format("--token-ids '{}'", text);
  std::vector<std::string> parts;
  std::size_t at = 0;
  for (std::size_t comma; (comma = text.find(',', at)) != std::string::npos; at = comma + 1)
    parts.push_back(text.substr(at, comma - at));
  parts.push_back(text.substr(at));
  if (parts.size() != 3) throw UsageError(fmt::format("{}: give PAD,BOS,EOS (each an id or none)", what));
  std::optional<std::int64_t> v[3];
  for (int i = 0; i < 3; ++i) {
    if (parts[i] == "none") continue;
    std::size_t used = 0;
    long long id = -1;
    try {
      id = std::stoll(parts[i], &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != parts[i].size() || parts[i].empty() || id < 0 || id >= vocab_size)
      throw UsageError(fmt::format("{}: '{}' is not none or a token id below the vocabulary size {}", what, parts[i],
                                   vocab_size));
    v[i] = id;
  }
  return {v[0], v[1], v[2]};
}

nlohmann::json hf_config(const ModelConfig& cfg, Names names, std::string_view dtype, const TokenIds& ids) {
  // Keys as the fork's ZayaConfig reads them (configuration_zaya.py of each branch; checked
  // against the stored sources of github.com/Zyphra/transformers and a PrimeRL port of the
  // zaya1 branch's config on 2026-11-21) and, for zaya1, transformers' ZayaConfig (5.24). Keys
  // both branches read are written for both; model_of_hf_config reads them all back.
  nlohmann::json j;
  j["model_type"] = "zaya";
  j["architectures"] = {"ZayaForCausalLM"};
  j["torch_dtype"] = dtype;
  j["vocab_size"] = cfg.vocab_size;
  j["hidden_size"] = cfg.hidden;
  j["num_key_value_heads"] = cfg.kv_heads;
  j["num_query_groups"] = cfg.kv_heads;  // the zaya1 branch requires it to equal num_key_value_heads
  j["head_dim"] = cfg.head_dim;
  j["num_experts"] = cfg.experts;
  j["ffn_hidden_size"] = 2 * cfg.expert_hidden;  // linear_fc1's width (gate and up)
  j["moe_router_topk"] = 1;
  j["cca"] = true;
  j["cca_time0"] = cfg.cca_conv_width;
  j["cca_time1"] = cfg.cca_group_conv_width;
  j["clamp_temp"] = false;
  j["activation_func"] = "swiglu";
  j["gated_linear_unit"] = true;
  j["add_bias_linear"] = false;
  j["normalization"] = "RMSNorm";
  j["norm_epsilon"] = cfg.norm_eps;
  j["rope_theta"] = cfg.rope_base;  // the full-attention layers' (rope_parameters.hybrid)
  j["partial_rotary_factor"] = cfg.rope_fraction;
  j["zaya_use_mod"] = cfg.router_skip_expert;
  j["zaya_use_eda"] = true;
  j["zaya_high_prec"] = true;
  j["scale_residual_merge"] = true;
  j["residual_in_fp32"] = true;
  j["fused_add_norm"] = false;
  j["tie_word_embeddings"] = cfg.tied_embeddings;
  j["attention_bias"] = false;
  j["lm_head_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["max_position_embeddings"] = cfg.max_seq_len > 0 ? cfg.max_seq_len : 4096;
  j["use_cache"] = true;
  // Token ids: the tokenizer's, as the exporter was told (keel's model config has none).
  const auto id = [](const std::optional<std::int64_t>& v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); };
  j["pad_token_id"] = id(ids.pad);
  j["bos_token_id"] = id(ids.bos);
  j["eos_token_id"] = id(ids.eos);
  j["initializer_range"] = 0.02;
  if (names == Names::kZaya1) {
    // Branch zaya1 / transformers: one decoder layer (attention + MoE) per keel layer, "hybrid"
    // or, sliding, "hybrid_sliding"; RoPE per layer type, nested; num_attention_heads is the
    // number of query heads, head_dim explicit.
    const bool slides = any_sliding_layer(cfg);
    j["num_hidden_layers"] = cfg.layers;
    j["num_attention_heads"] = cfg.heads;
    std::vector<std::string> types;
    int first_sliding = -1;
    for (int l = 0; l < cfg.layers; ++l) {
      types.push_back(is_sliding_layer(cfg, l) ? "hybrid_sliding" : "hybrid");
      if (first_sliding < 0 && is_sliding_layer(cfg, l)) first_sliding = l;
    }
    j["layer_types"] = types;
    j["rope_parameters"] = {
        {"hybrid", {{"rope_type", "default"}, {"rope_theta", cfg.rope_base}, {"partial_rotary_factor", cfg.rope_fraction}}}};
    if (slides)
      j["rope_parameters"]["hybrid_sliding"] = {{"rope_type", "default"},
                                                {"rope_theta", layer_rope_base(cfg, first_sliding)},
                                                {"partial_rotary_factor", layer_rope_fraction(cfg, first_sliding)}};
    j["sliding_window"] = slides ? nlohmann::json(cfg.sliding_window) : nlohmann::json(nullptr);
    j["hidden_act"] = "silu";
    j["moe_intermediate_size"] = cfg.expert_hidden;
    j["num_experts_per_tok"] = 1;
    j["router_hidden_size"] = cfg.router_hidden;
    j["zaya_mlp_expansion"] = cfg.router_hidden;  // must equal router_hidden_size when given
    j["rms_norm_eps"] = cfg.norm_eps;
    j["output_router_logits"] = false;
  } else {
    // Branch zaya1-legacy: 2L alternating stages, Megatron-style keys. Its config derives the
    // head width as hidden_size / num_attention_heads (kv_channels) and takes the number of CCA
    // query heads from cca_num_q_heads, so num_attention_heads is hidden / head_dim here (16
    // for ZAYA1-8B), not the query-head count.
    if (cfg.head_dim <= 0 || cfg.hidden % cfg.head_dim != 0)
      fail("--names zaya1-alternating: hidden ({}) must be a multiple of head_dim ({}): the layout's config derives "
           "the head width as hidden_size / num_attention_heads",
           cfg.hidden, cfg.head_dim);
    if (any_sliding_layer(cfg))
      throw UsageError(fmt::format("--names zaya1-alternating: model '{}' has sliding-window layers, which keel does "
                                   "not write in this layout's config: use --names zaya1",
                                   cfg.name));
    j["num_hidden_layers"] = 2 * cfg.layers;
    j["num_attention_heads"] = cfg.hidden / cfg.head_dim;
    j["cca_num_q_heads"] = cfg.heads;
    j["zaya_mlp_expansion"] = cfg.router_hidden;
    j["swa_layers"] = nullptr;
  }
  return j;
}

ModelConfig model_of_hf_config(const nlohmann::json& config, Names names, const std::string& name,
                               const std::string& what) {
  Keys k(config, what);
  // A config of the other layout: say which --names reads it (keel's own export writes both
  // layouts' common keys, so only keys of one layout alone tell them apart).
  const bool zaya1 = names == Names::kZaya1;
  static const std::vector<std::string> kAlternatingOnly = {"cca_num_q_heads", "zaya_layers", "swa_layers",
                                                            "num_query_groups_list", "ffn_hidden_size_list"};
  static const std::vector<std::string> kZaya1Only = {"layer_types", "rope_parameters", "moe_intermediate_size",
                                                      "router_hidden_size"};
  for (const std::string& key : zaya1 ? kAlternatingOnly : kZaya1Only)
    if (config.is_object() && config.contains(key))
      k.bad(key, fmt::format("is a key of the {} layout's config: use --names {}", zaya1 ? "alternating-layer" : "zaya1",
                             zaya1 ? "zaya1-alternating" : "zaya1"));
  const json* type = k.get("model_type");
  if (type && !(type->is_string() && type->get<std::string>() == "zaya")) k.bad_value("model_type", *type, "not a ZAYA1 config (model_type \"zaya\")");
  ModelConfig m = names == Names::kZaya1 ? zaya1_model(k, name) : alternating_model(k, name);
  k.finish();
  try {
    validate(m);
  } catch (const UsageError& e) {
    throw UsageError(fmt::format("{}: describes a model keel cannot run: {}", what, e.what()));
  }
  return m;
}

}  // namespace keel::model::released
