#include "model/params.h"

#include <fmt/format.h>

#include "common/error.h"

namespace keel::model {
namespace {

// An int64 count that carries overflow along (as a NaN carries through floating point)
// instead of wrapping: a config with absurd sizes must fail naming the component whose count
// overflowed, not print a wrapped number or, wrapped negative, drop the component.
struct Count {
  std::int64_t value = 0;
  bool overflow = false;
  Count(std::int64_t v = 0) : value(v) {}  // implicit, so the config's ints mix in
};

Count operator+(Count a, Count b) {
  Count r;
  r.overflow = a.overflow || b.overflow || __builtin_add_overflow(a.value, b.value, &r.value);
  return r;
}
Count operator-(Count a, Count b) {
  Count r;
  r.overflow = a.overflow || b.overflow || __builtin_sub_overflow(a.value, b.value, &r.value);
  return r;
}
Count operator*(Count a, Count b) {
  Count r;
  r.overflow = a.overflow || b.overflow || __builtin_mul_overflow(a.value, b.value, &r.value);
  return r;
}

// The int64 behind `c`, or a one-line error naming the model and what was being counted.
std::int64_t checked(const Count& c, const ModelConfig& m, const std::string& what) {
  if (c.overflow)
    throw UsageError(fmt::format("model '{}': parameter count of '{}' overflows int64 (a size in the config is too "
                                 "large)",
                                 m.name, what));
  if (c.value < 0)
    throw UsageError(fmt::format("model '{}': parameter count of '{}' is negative ({})", m.name, what, c.value));
  return c.value;
}

}  // namespace

ParamCounts count_params(const ModelConfig& m) {
  ParamCounts pc;
  // Every size enters as a Count, so no product or sum below can wrap unnoticed (the config's
  // fields are ints: two of them added or multiplied directly could overflow int itself).
  const Count h = m.hidden, V = m.vocab_size, hd = m.head_dim, L = m.layers;
  const Count q = Count(m.heads) * hd, kv = Count(m.kv_heads) * hd;
  const Count moe_layers = moe_layer_count(m), dense_layers = L - moe_layers;
  // A component whose count is zero is absent from this model (no linear-attention layers, no
  // shared experts): only those are left out; an overflowing count is an error, never dropped.
  auto add = [&](const char* name, Count total, Count active, Count per_layer, bool embedding, bool expert,
                 bool matrix) {
    ComponentParams c{name, checked(total, m, name), checked(active, m, name), checked(per_layer, m, name),
                      embedding, expert, matrix};
    if (c.total > 0) pc.components.push_back(std::move(c));
  };

  add("embedding", V * h, V * h, 0, true, false, false);
  if (!m.tied_embeddings) add("lm_head", V * h, V * h, 0, true, false, true);

  // Attention, per kind present.
  const Count softmax = Count(attention_layer_count(m, AttentionKind::kMha)) +
                        attention_layer_count(m, AttentionKind::kGqa);
  const Count linear = attention_layer_count(m, AttentionKind::kLinear);
  const Count cca = attention_layer_count(m, AttentionKind::kCca);
  const Count proj = h * (q + 2 * kv) + q * h;
  add("attention", softmax * proj, softmax * proj, proj, false, false, true);
  add("linear_attention", linear * proj, linear * proj, proj, false, false, true);
  // Depthwise conv (kernel cca_conv_width, bias) over the q|k channels, then a grouped conv
  // with one head_dim x head_dim mix per head and tap (bias), then kv_heads temperatures.
  const Count ch = Count(m.cca_q_dim) + m.cca_k_dim;
  const Count conv_extras = 2 * ch + m.kv_heads;  // the two conv biases and the temperatures
  if (cca.value > 0) {
    const Count cproj = h * m.cca_q_dim + h * m.cca_k_dim + h * m.cca_v_dim + Count(m.cca_q_dim) * h;
    add("cca_attention", cca * cproj, cca * cproj, cproj, false, false, true);
    const Count conv = ch * m.cca_conv_width + ch * hd * m.cca_group_conv_width + conv_extras;
    add("cca_conv", cca * conv, cca * conv, conv, false, false, false);
  }

  // MLPs.
  const Count dense_mlp = 3 * h * m.ffn_hidden;
  add("mlp", dense_layers * dense_mlp, dense_layers * dense_mlp, dense_mlp, false, false, true);
  // ZAYA1's MLP router's vectors: down_proj bias, EDA scale, RMSNorm, one bias per r x r layer.
  const Count r = m.router_hidden, router_mlps = Count(m.router_mlp_layers) - 1;
  const Count router_vectors = 3 * r + router_mlps * r;
  if (moe_layers.value > 0) {
    const Count classes = Count(m.experts) + (m.router_skip_expert ? 1 : 0);
    // Linear router h -> classes, or down_proj, (mlp_layers - 1) r x r layers, r -> classes.
    const Count router = m.router_hidden == 0 ? h * classes : h * r + router_mlps * r * r + r * classes + router_vectors;
    // The first MoE stage has no EDA (nothing to average with): one EDA scale fewer.
    const Count routers = moe_layers * router - (m.router_hidden == 0 ? Count(0) : r);
    add("router", routers, routers, router, false, false, true);
    const Count expert = 3 * h * m.expert_hidden;
    const Count shared = Count(m.shared_experts) * expert;
    add("shared_experts", moe_layers * shared, moe_layers * shared, shared, false, false, true);
    add("experts", moe_layers * m.experts * expert, moe_layers * m.top_k * expert, Count(m.experts) * expert, false,
        true, true);
  }

  // Norms: two RMSNorms per layer and a final one; QK-norm vectors; ZAYA1's residual scaling
  // (4 vectors per stage, 2 stages per layer, plus one before the final norm; stage 0 has no
  // residual stream yet, so only its 2 hidden-stream vectors).
  Count norms = 2 * L * h + h;
  if (m.qk_norm) norms = norms + (softmax + linear) * (q + kv);
  if (m.residual_scaling) norms = norms + 8 * L * h - 2 * h + 4 * h;
  add("norms", norms, norms, 0, false, false, false);

  // Each component fits; their sums are checked too.
  Count total, active, total_ne, active_ne, matmul;
  for (const auto& c : pc.components) {
    total = total + c.total;
    active = active + c.active;
    if (!c.embedding) {
      total_ne = total_ne + c.total;
      active_ne = active_ne + c.active;
    }
    if (c.name != "norms" && c.name != "embedding") matmul = matmul + c.active;
  }
  // A tied head still runs its GEMM; biases/norm vectors inside components are negligible
  // but are subtracted where known so 6N is exactly the GEMM FLOPs.
  if (m.tied_embeddings) matmul = matmul + V * h;
  if (cca.value > 0) matmul = matmul - cca * conv_extras;
  if (moe_layers.value > 0 && m.router_hidden > 0) matmul = matmul - (moe_layers * router_vectors - r);
  pc.total = checked(total, m, "total");
  pc.active = checked(active, m, "active total");
  pc.total_non_embedding = checked(total_ne, m, "non-embedding total");
  pc.active_non_embedding = checked(active_ne, m, "non-embedding active total");
  pc.matmul_active = checked(matmul, m, "matmul weights");
  pc.lm_head_matmul = checked(V * h, m, "lm_head");
  return pc;
}

}  // namespace keel::model
