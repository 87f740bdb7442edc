#include "model/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>

#include "common/error.h"
#include "common/fileio.h"
#include "common/yaml_checks.h"

namespace keel::model {
namespace {

AttentionKind parse_attention(const std::string& s, const std::string& key) {
  if (s == "mha") return AttentionKind::kMha;
  if (s == "gqa") return AttentionKind::kGqa;
  if (s == "cca") return AttentionKind::kCca;
  if (s == "linear") return AttentionKind::kLinear;
  throw UsageError(fmt::format("key '{}': unknown attention kind '{}' (choose mha, gqa, cca or linear)", key, s));
}

// Scalar readers that name the key (and line) when a value has the wrong type.
template <typename T>
T scalar(const YAML::Node& v, const std::string& key, const char* type) {
  if (!v.IsScalar())
    throw UsageError(fmt::format("key '{}'{} must be {}", key, yaml_line_suffix(v), type));
  try {
    return v.as<T>();
  } catch (const YAML::Exception&) {
    throw UsageError(
        fmt::format("key '{}'{} must be {}, got '{}'", key, yaml_line_suffix(v), type, v.Scalar()));
  }
}

int as_int(const YAML::Node& v, const std::string& key) {
  const auto x = scalar<std::int64_t>(v, key, "an integer");
  if (x < INT32_MIN || x > INT32_MAX) throw UsageError(fmt::format("key '{}' is out of range ({})", key, x));
  return static_cast<int>(x);
}

// Expands a per-layer attention list: one entry per layer, or a shorter pattern repeated
// (its length must divide `layers`).
std::vector<AttentionKind> attention_pattern(const YAML::Node& v, const std::string& key) {
  if (!v.IsSequence())
    throw UsageError(
        fmt::format("key '{}'{} must be a list such as [linear, linear, linear, gqa]", key, yaml_line_suffix(v)));
  std::vector<AttentionKind> out;
  for (const auto& e : v) out.push_back(parse_attention(scalar<std::string>(e, key, "an attention kind"), key));
  return out;
}

}  // namespace

const char* attention_kind_name(AttentionKind k) {
  switch (k) {
    case AttentionKind::kMha: return "mha";
    case AttentionKind::kGqa: return "gqa";
    case AttentionKind::kCca: return "cca";
    case AttentionKind::kLinear: return "linear";
  }
  return "?";
}

AttentionKind layer_attention_kind(const ModelConfig& m, int layer) {
  if (m.layer_attention.empty()) return m.attention;
  return m.layer_attention[static_cast<size_t>(layer) % m.layer_attention.size()];
}

bool is_moe_layer(const ModelConfig& m, int layer) {
  if (m.experts <= 0 || layer < m.first_dense_layers) return false;
  return (layer - m.first_dense_layers) % std::max(1, m.moe_layer_interval) == 0;
}

bool is_sliding_layer(const ModelConfig& m, int layer) {
  if (m.layer_sliding.empty()) return false;
  return m.layer_sliding[static_cast<size_t>(layer) % m.layer_sliding.size()];
}

int attention_window(const ModelConfig& m, int layer) { return is_sliding_layer(m, layer) ? m.sliding_window : 0; }

double layer_rope_base(const ModelConfig& m, int layer) {
  return is_sliding_layer(m, layer) && m.sliding_rope_base > 0 ? m.sliding_rope_base : m.rope_base;
}

double layer_rope_fraction(const ModelConfig& m, int layer) {
  return is_sliding_layer(m, layer) && m.sliding_rope_fraction >= 0 ? m.sliding_rope_fraction : m.rope_fraction;
}

bool any_sliding_layer(const ModelConfig& m) {
  for (int l = 0; l < m.layers; ++l)
    if (is_sliding_layer(m, l)) return true;
  return false;
}

int moe_layer_count(const ModelConfig& m) {
  int n = 0;
  for (int l = 0; l < m.layers; ++l) n += is_moe_layer(m, l);
  return n;
}

int attention_layer_count(const ModelConfig& m, AttentionKind kind) {
  int n = 0;
  for (int l = 0; l < m.layers; ++l) n += layer_attention_kind(m, l) == kind;
  return n;
}

std::int64_t tokens_per_expert(const ModelConfig& m, std::int64_t tokens) {
  if (m.experts <= 0) return tokens;
  return (tokens * m.top_k + m.experts - 1) / m.experts;
}

constexpr std::int64_t kMaxWidth = std::int64_t{1} << 24;  // any width, a head dimension product included
constexpr std::int64_t kMaxCount = std::int64_t{1} << 16;  // layers, experts, conv widths, chunk

void validate(const ModelConfig& m) {
  auto need_positive = [](std::int64_t v, const char* key) {
    if (v <= 0) throw UsageError(fmt::format("key '{}' must be positive (got {})", key, v));
  };
  need_positive(m.vocab_size, "vocab_size");
  // Bounds far beyond any model (ZAYA1-8B: hidden 2048, 40 layers, 16 experts) that keep every
  // product of them inside the integer types the accounting uses: a value past them is a typo.
  const std::pair<std::int64_t, const char*> bounded[] = {
      {m.hidden, "hidden"},           {m.ffn_hidden, "ffn_hidden"},       {m.expert_hidden, "expert_hidden"},
      {m.router_hidden, "router_hidden"}, {m.cca_q_dim, "cca_q_dim"},     {m.cca_k_dim, "cca_k_dim"},
      {m.cca_v_dim, "cca_v_dim"},     {std::int64_t(m.heads) * m.head_dim, "heads x head_dim"},
      {std::int64_t(m.kv_heads) * m.head_dim, "kv_heads x head_dim"}, {m.max_seq_len, "max_seq_len"}};
  for (const auto& [v, key] : bounded)
    if (v > kMaxWidth) throw UsageError(fmt::format("key '{}' ({}) must be at most {}", key, v, kMaxWidth));
  const std::pair<std::int64_t, const char*> counted[] = {{m.layers, "layers"},
                                                          {m.experts, "experts"},
                                                          {m.shared_experts, "shared_experts"},
                                                          {m.router_mlp_layers, "router_mlp_layers"},
                                                          {m.cca_conv_width, "cca_conv_width"},
                                                          {m.cca_group_conv_width, "cca_group_conv_width"},
                                                          {m.linear_chunk, "linear_chunk"}};
  for (const auto& [v, key] : counted)
    if (v > kMaxCount) throw UsageError(fmt::format("key '{}' ({}) must be at most {}", key, v, kMaxCount));
  // token ids are 32-bit everywhere (datasets, kernels); a larger table is a typo, not a model
  if (m.vocab_size > INT32_MAX)
    throw UsageError(fmt::format("key 'vocab_size' ({}) must be at most {} (token ids are 32-bit)", m.vocab_size,
                                 INT32_MAX));
  need_positive(m.hidden, "hidden");
  need_positive(m.layers, "layers");
  need_positive(m.heads, "heads");
  need_positive(m.kv_heads, "kv_heads");
  need_positive(m.head_dim, "head_dim");
  if (m.hidden % m.heads != 0)
    throw UsageError(fmt::format("key 'heads' ({}) does not divide 'hidden' ({})", m.heads, m.hidden));
  if (m.heads % m.kv_heads != 0)
    throw UsageError(fmt::format("key 'kv_heads' ({}) does not divide 'heads' ({})", m.kv_heads, m.heads));
  if (m.kv_heads > m.heads)
    throw UsageError(fmt::format("key 'kv_heads' ({}) is larger than 'heads' ({})", m.kv_heads, m.heads));

  if (!m.layer_attention.empty() && m.layers % static_cast<int>(m.layer_attention.size()) != 0)
    throw UsageError(fmt::format("key 'layer_attention' has {} entries, which neither equals nor divides 'layers' ({})",
                                 m.layer_attention.size(), m.layers));
  bool any_cca = false, any_linear = false, any_softmax = false;
  for (int l = 0; l < m.layers; ++l) {
    const AttentionKind k = layer_attention_kind(m, l);
    any_cca |= k == AttentionKind::kCca;
    any_linear |= k == AttentionKind::kLinear;
    any_softmax |= k == AttentionKind::kMha || k == AttentionKind::kGqa;
    if (k == AttentionKind::kMha && m.kv_heads != m.heads)
      throw UsageError(fmt::format("attention 'mha' needs 'kv_heads' ({}) equal to 'heads' ({}); use gqa",
                                   m.kv_heads, m.heads));
  }
  (void)any_softmax;
  if (any_cca) {
    need_positive(m.cca_q_dim, "cca_q_dim");
    need_positive(m.cca_k_dim, "cca_k_dim");
    need_positive(m.cca_v_dim, "cca_v_dim");
    need_positive(m.cca_conv_width, "cca_conv_width");
    need_positive(m.cca_group_conv_width, "cca_group_conv_width");
    if (m.cca_q_dim != m.heads * m.head_dim)
      throw UsageError(fmt::format("key 'cca_q_dim' ({}) must equal heads*head_dim ({})", m.cca_q_dim,
                                   m.heads * m.head_dim));
    if (m.cca_k_dim != m.kv_heads * m.head_dim)
      throw UsageError(fmt::format("key 'cca_k_dim' ({}) must equal kv_heads*head_dim ({})", m.cca_k_dim,
                                   m.kv_heads * m.head_dim));
    if (m.cca_v_dim % 2 != 0)
      throw UsageError(fmt::format("key 'cca_v_dim' ({}) must be even (current- and previous-token halves)",
                                   m.cca_v_dim));
  }
  if (any_linear) need_positive(m.linear_chunk, "linear_chunk");
  if (m.linear_feature != "identity" && m.linear_feature != "elu1")
    throw UsageError(fmt::format("key 'linear_feature': unknown feature map '{}' (choose identity or elu1)",
                                 m.linear_feature));
  if (m.linear_decay != "none" && m.linear_decay != "retnet")
    throw UsageError(fmt::format("key 'linear_decay': unknown decay '{}' (choose none or retnet)", m.linear_decay));

  if (m.moe_layer_interval < 1)
    throw UsageError(fmt::format("key 'moe_layer_interval' must be at least 1 (got {})", m.moe_layer_interval));
  if (m.first_dense_layers < 0 || m.first_dense_layers > m.layers)
    throw UsageError(fmt::format("key 'first_dense_layers' ({}) must be in [0, layers={}]", m.first_dense_layers,
                                 m.layers));
  if (m.experts < 0) throw UsageError(fmt::format("key 'experts' must not be negative (got {})", m.experts));
  if (m.experts > 0) {
    need_positive(m.top_k, "top_k");
    need_positive(m.expert_hidden, "expert_hidden");
    if (m.top_k > m.experts)
      throw UsageError(fmt::format("key 'top_k' ({}) is larger than 'experts' ({})", m.top_k, m.experts));
    if (m.shared_experts < 0) throw UsageError("key 'shared_experts' must not be negative");
    if (m.router_hidden < 0) throw UsageError("key 'router_hidden' must not be negative");
    if (m.router_hidden > 0 && m.router_mlp_layers < 1)
      throw UsageError(fmt::format("key 'router_mlp_layers' must be at least 1 with 'router_hidden' {} (the last "
                                   "layer maps router_hidden to the expert logits)",
                                   m.router_hidden));
    if (m.router_skip_expert && m.top_k != 1)
      throw UsageError("key 'router_skip_expert' needs 'top_k' 1 (ZAYA1's skip class is a top-1 choice)");
  } else if (m.top_k != 0 || m.expert_hidden != 0 || m.shared_experts != 0) {
    throw UsageError("keys 'top_k', 'expert_hidden', 'shared_experts' need 'experts' > 0");
  }
  const bool any_dense_mlp = moe_layer_count(m) < m.layers;
  if (any_dense_mlp && m.ffn_hidden <= 0)
    throw UsageError(fmt::format("key 'ffn_hidden' must be positive: {} of {} layers have a dense MLP",
                                 m.layers - moe_layer_count(m), m.layers));
  // Written as "!(in range)" so that NaN, which fails every comparison, is refused too.
  if (!(m.rope_fraction >= 0 && m.rope_fraction <= 1))
    throw UsageError(fmt::format("key 'rope_fraction' ({}) must be in [0, 1]", m.rope_fraction));
  if (!(m.norm_eps > 0 && std::isfinite(m.norm_eps)))
    throw UsageError(fmt::format("key 'norm_eps' ({}) must be a positive number", m.norm_eps));
  if (!std::isfinite(m.rope_base) || (m.rope_fraction > 0 && !(m.rope_base > 1)))
    throw UsageError(fmt::format("key 'rope_base' ({}) must be a finite number above 1", m.rope_base));
  if (m.max_seq_len < 0) throw UsageError("key 'max_seq_len' must not be negative");

  if (!m.layer_sliding.empty() && m.layers % static_cast<int>(m.layer_sliding.size()) != 0)
    throw UsageError(fmt::format("key 'layer_sliding' has {} entries, which neither equals nor divides 'layers' ({})",
                                 m.layer_sliding.size(), m.layers));
  if (any_sliding_layer(m)) {
    if (m.sliding_window < 1)
      throw UsageError(fmt::format("key 'sliding_window' must be positive: 'layer_sliding' makes layers slide (got {})",
                                   m.sliding_window));
    for (int l = 0; l < m.layers; ++l)
      if (is_sliding_layer(m, l) && layer_attention_kind(m, l) == AttentionKind::kLinear)
        throw UsageError(fmt::format("key 'layer_sliding': layer {} is linear attention, which has no window", l));
  } else if (m.sliding_window != 0) {
    throw UsageError(fmt::format("key 'sliding_window' ({}) needs 'layer_sliding' naming the layers that slide",
                                 m.sliding_window));
  }
  if (m.sliding_window < 0) throw UsageError("key 'sliding_window' must not be negative");
  if (!(m.sliding_rope_fraction <= 1))  // negative: as rope_fraction (the YAML key takes [0, 1] only)
    throw UsageError(fmt::format("key 'sliding_rope_fraction' ({}) must be in [0, 1]", m.sliding_rope_fraction));
  if (!std::isfinite(m.sliding_rope_base) || m.sliding_rope_base < 0 ||
      (m.sliding_rope_base > 0 && !(m.sliding_rope_base > 1)))  // 0: as rope_base
    throw UsageError(fmt::format("key 'sliding_rope_base' ({}) must be a finite number above 1", m.sliding_rope_base));
}

YAML::Node model_node(const ModelConfig& m) {
  // Scalars as text: doubles in their shortest exact form, so they parse back to the same value.
  const auto v = [](const auto& x) { return fmt::format("{}", x); };
  YAML::Node n;
  n["name"] = m.name;
  n["vocab_size"] = v(m.vocab_size);
  n["hidden"] = v(m.hidden);
  n["layers"] = v(m.layers);
  n["attention"] = attention_kind_name(m.attention);
  n["heads"] = v(m.heads);
  n["kv_heads"] = v(m.kv_heads);
  n["head_dim"] = v(m.head_dim);
  if (!m.layer_attention.empty()) {
    YAML::Node list(YAML::NodeType::Sequence);
    for (const AttentionKind k : m.layer_attention) list.push_back(attention_kind_name(k));
    list.SetStyle(YAML::EmitterStyle::Flow);
    n["layer_attention"] = list;
  }
  n["cca_q_dim"] = v(m.cca_q_dim);
  n["cca_k_dim"] = v(m.cca_k_dim);
  n["cca_v_dim"] = v(m.cca_v_dim);
  n["cca_conv_width"] = v(m.cca_conv_width);
  n["cca_group_conv_width"] = v(m.cca_group_conv_width);
  n["linear_chunk"] = v(m.linear_chunk);
  if (attention_layer_count(m, AttentionKind::kLinear) > 0) {
    n["linear_feature"] = m.linear_feature;
    n["linear_decay"] = m.linear_decay;
  }
  n["qk_norm"] = v(m.qk_norm);
  n["ffn_hidden"] = v(m.ffn_hidden);
  n["experts"] = v(m.experts);
  n["top_k"] = v(m.top_k);
  n["expert_hidden"] = v(m.expert_hidden);
  n["shared_experts"] = v(m.shared_experts);
  n["moe_layer_interval"] = v(m.moe_layer_interval);
  n["first_dense_layers"] = v(m.first_dense_layers);
  n["router_hidden"] = v(m.router_hidden);
  n["router_mlp_layers"] = v(m.router_mlp_layers);
  n["router_skip_expert"] = v(m.router_skip_expert);
  n["tied_embeddings"] = v(m.tied_embeddings);
  n["residual_scaling"] = v(m.residual_scaling);
  n["rope_fraction"] = v(m.rope_fraction);
  n["rope_base"] = v(m.rope_base);
  n["norm_eps"] = v(m.norm_eps);
  n["max_seq_len"] = v(m.max_seq_len);
  if (!m.layer_sliding.empty()) {
    YAML::Node list(YAML::NodeType::Sequence);
    for (const bool b : m.layer_sliding) list.push_back(v(b));
    list.SetStyle(YAML::EmitterStyle::Flow);
    n["layer_sliding"] = list;
  }
  n["sliding_window"] = v(m.sliding_window);
  n["sliding_rope_base"] = v(m.sliding_rope_base);
  if (m.sliding_rope_fraction >= 0) n["sliding_rope_fraction"] = v(m.sliding_rope_fraction);
  return n;
}

std::string model_yaml(const ModelConfig& m) {
  YAML::Emitter em;
  em << model_node(m);
  return std::string(em.c_str()) + "\n";
}

std::vector<std::pair<std::string, std::string>> model_key_values(const ModelConfig& m) {
  const auto v = [](const auto& x) { return fmt::format("{}", x); };
  std::string attention = attention_kind_name(layer_attention_kind(m, 0)), sliding;
  bool mixed = false;
  int first_sliding = -1;
  for (int l = 0; l < m.layers; ++l) {
    mixed |= layer_attention_kind(m, l) != layer_attention_kind(m, 0);
    if (!is_sliding_layer(m, l)) continue;
    sliding += fmt::format("{}{}", sliding.empty() ? "layers " : ",", l);
    if (first_sliding < 0) first_sliding = l;
  }
  if (mixed) {
    attention.clear();
    for (int l = 0; l < m.layers; ++l)
      attention += fmt::format("{}{}", l ? "," : "", attention_kind_name(layer_attention_kind(m, l)));
  }
  const bool slides = first_sliding >= 0;
  return {{"vocab_size", v(m.vocab_size)},
          {"hidden", v(m.hidden)},
          {"layers", v(m.layers)},
          {"attention", attention},
          {"heads", v(m.heads)},
          {"kv_heads", v(m.kv_heads)},
          {"head_dim", v(m.head_dim)},
          {"cca_q_dim", v(m.cca_q_dim)},
          {"cca_k_dim", v(m.cca_k_dim)},
          {"cca_v_dim", v(m.cca_v_dim)},
          {"cca_conv_width", v(m.cca_conv_width)},
          {"cca_group_conv_width", v(m.cca_group_conv_width)},
          {"linear_chunk", v(m.linear_chunk)},
          {"linear_feature", m.linear_feature},
          {"linear_decay", m.linear_decay},
          {"qk_norm", v(m.qk_norm)},
          {"ffn_hidden", v(m.ffn_hidden)},
          {"experts", v(m.experts)},
          {"top_k", v(m.top_k)},
          {"expert_hidden", v(m.expert_hidden)},
          {"shared_experts", v(m.shared_experts)},
          {"moe_layer_interval", v(m.moe_layer_interval)},
          {"first_dense_layers", v(m.first_dense_layers)},
          {"router_hidden", v(m.router_hidden)},
          {"router_mlp_layers", v(m.router_mlp_layers)},
          {"router_skip_expert", v(m.router_skip_expert)},
          {"tied_embeddings", v(m.tied_embeddings)},
          {"residual_scaling", v(m.residual_scaling)},
          {"rope_fraction", v(m.rope_fraction)},
          {"rope_base", v(m.rope_base)},
          {"norm_eps", v(m.norm_eps)},
          {"max_seq_len", v(m.max_seq_len)},
          {"layer_sliding", slides ? sliding : "none"},
          {"sliding_window", slides ? v(m.sliding_window) : "0"},
          {"sliding_rope_base", slides ? v(layer_rope_base(m, first_sliding)) : "0"},
          {"sliding_rope_fraction", slides ? v(layer_rope_fraction(m, first_sliding)) : "0"}};
}

// A model or train YAML file, bounded and refused by name when it is no file (a directory read
// through YAML::LoadFile said only "basic_filebuf::underflow error reading the file").
static YAML::Node load_yaml_file(const std::string& path) {
  std::string text;
  try {
    text = read_config_file(path);
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
  try {
    return YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw UsageError(fmt::format("{}: not valid YAML: {}", path, e.what()));
  }
}

ModelConfig load_model_config(const std::string& path) {
  const YAML::Node root = load_yaml_file(path);
  return parse_model_config(root, std::filesystem::path(path).stem().string(), path);
}

ModelConfig model_of_train_config(const YAML::Node& node, const std::string& what) {
  if (node.IsScalar()) return load_model_config(node.as<std::string>());
  if (node.IsMap()) return parse_model_config(node, "inline", what);
  throw UsageError(fmt::format("{}: must be a model YAML path or a mapping of model keys", what));
}

ModelConfig load_model_or_train_config(const std::string& path) {
  const YAML::Node root = load_yaml_file(path);
  check_yaml_document(root, path);
  if (root.IsMap() && root["model"]) return model_of_train_config(root["model"], path + ": model");
  return parse_model_config(root, std::filesystem::path(path).stem().string(), path);
}

ModelConfig parse_model_config(const YAML::Node& root, const std::string& name, const std::string& what) {
  if (!root.IsMap()) throw UsageError(fmt::format("{}: a model config must be a YAML mapping of keys", what));
  check_yaml_document(root, what);

  ModelConfig m;
  m.name = name;
  bool have_kv_heads = false, have_head_dim = false;
  using Setter = std::function<void(const YAML::Node&, const std::string&)>;
  auto i32 = [](int* f) -> Setter { return [f](const YAML::Node& v, const std::string& k) { *f = as_int(v, k); }; };
  auto f64 = [](double* f) -> Setter {
    return [f](const YAML::Node& v, const std::string& k) { *f = scalar<double>(v, k, "a number"); };
  };
  auto boolean = [](bool* f) -> Setter {
    return [f](const YAML::Node& v, const std::string& k) { *f = scalar<bool>(v, k, "true or false"); };
  };
  const std::map<std::string, Setter> keys = {
      {"name", [&](const YAML::Node& v, const std::string& k) { m.name = scalar<std::string>(v, k, "a string"); }},
      {"vocab_size",
       [&](const YAML::Node& v, const std::string& k) { m.vocab_size = scalar<std::int64_t>(v, k, "an integer"); }},
      {"hidden", i32(&m.hidden)},
      {"layers", i32(&m.layers)},
      {"attention",
       [&](const YAML::Node& v, const std::string& k) {
         m.attention = parse_attention(scalar<std::string>(v, k, "a string"), k);
       }},
      {"heads", i32(&m.heads)},
      {"kv_heads", [&](const YAML::Node& v, const std::string& k) { m.kv_heads = as_int(v, k), have_kv_heads = true; }},
      {"head_dim", [&](const YAML::Node& v, const std::string& k) { m.head_dim = as_int(v, k), have_head_dim = true; }},
      {"layer_attention",
       [&](const YAML::Node& v, const std::string& k) { m.layer_attention = attention_pattern(v, k); }},
      {"cca_q_dim", i32(&m.cca_q_dim)},
      {"cca_k_dim", i32(&m.cca_k_dim)},
      {"cca_v_dim", i32(&m.cca_v_dim)},
      {"cca_conv_width", i32(&m.cca_conv_width)},
      {"cca_group_conv_width", i32(&m.cca_group_conv_width)},
      {"linear_chunk", i32(&m.linear_chunk)},
      {"linear_feature",
       [&](const YAML::Node& v, const std::string& k) { m.linear_feature = scalar<std::string>(v, k, "a string"); }},
      {"linear_decay",
       [&](const YAML::Node& v, const std::string& k) { m.linear_decay = scalar<std::string>(v, k, "a string"); }},
      {"qk_norm", boolean(&m.qk_norm)},
      {"ffn_hidden", i32(&m.ffn_hidden)},
      {"experts", i32(&m.experts)},
      {"top_k", i32(&m.top_k)},
      {"expert_hidden", i32(&m.expert_hidden)},
      {"shared_experts", i32(&m.shared_experts)},
      {"moe_layer_interval", i32(&m.moe_layer_interval)},
      {"first_dense_layers", i32(&m.first_dense_layers)},
      {"router_hidden", i32(&m.router_hidden)},
      {"router_mlp_layers", i32(&m.router_mlp_layers)},
      {"router_skip_expert", boolean(&m.router_skip_expert)},
      {"tied_embeddings", boolean(&m.tied_embeddings)},
      {"residual_scaling", boolean(&m.residual_scaling)},
      {"rope_fraction", f64(&m.rope_fraction)},
      {"rope_base", f64(&m.rope_base)},
      {"norm_eps", f64(&m.norm_eps)},
      {"max_seq_len", i32(&m.max_seq_len)},
      {"layer_sliding",
       [&](const YAML::Node& v, const std::string& k) {
         if (!v.IsSequence())
           throw UsageError(fmt::format("key '{}'{} must be a list such as [false, false, false, true]", k,
                                        yaml_line_suffix(v)));
         m.layer_sliding.clear();
         for (const auto& e : v) m.layer_sliding.push_back(scalar<bool>(e, k, "a list of true or false"));
       }},
      {"sliding_window", i32(&m.sliding_window)},
      {"sliding_rope_base", f64(&m.sliding_rope_base)},
      {"sliding_rope_fraction",
       [&](const YAML::Node& v, const std::string& k) {
         m.sliding_rope_fraction = scalar<double>(v, k, "a number");
         if (!(m.sliding_rope_fraction >= 0 && m.sliding_rope_fraction <= 1))
           throw UsageError(fmt::format("key '{}' ({}) must be in [0, 1]", k, m.sliding_rope_fraction));
       }},
  };
  try {
    for (const auto& kv : root) {
      const std::string key = kv.first.as<std::string>();
      const auto it = keys.find(key);
      if (it == keys.end())
        throw UsageError(fmt::format("unknown key '{}'{}", key, yaml_line_suffix(kv.first)));
      it->second(kv.second, key);
    }
    // Defaults that follow from other keys: MHA has as many kv heads as heads; head_dim is
    // hidden/heads unless given.
    // The name goes into checkpoints' JSON; without a `name` key it is the file's name.
    if (!root["name"])
      if (const std::string why = why_not_utf8(m.name); !why.empty())
        throw UsageError(fmt::format("the model's name, taken from the file name '{}' as there is no key 'name', is "
                                     "not valid UTF-8 ({}): add a key 'name'",
                                     escape_bytes(m.name), why));
    if (!have_kv_heads) m.kv_heads = m.heads;
    if (!have_head_dim && m.heads > 0) m.head_dim = m.hidden / m.heads;
    validate(m);
  } catch (const UsageError& e) {
    throw UsageError(fmt::format("{}: {}", what, e.what()));
  } catch (const YAML::Exception& e) {
    throw UsageError(fmt::format("{}: {}", what, e.what()));
  }
  return m;
}

}  // namespace keel::model
