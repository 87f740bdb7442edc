#include "model/params.h"

namespace keel::model {
namespace {

struct LayerParams {
  std::int64_t attention = 0, cca_conv = 0, qk_norm = 0;
};

}  // namespace

ParamCounts count_params(const ModelConfig& m) {
  ParamCounts pc;
  const std::int64_t h = m.hidden, V = m.vocab_size, hd = m.head_dim;
  const std::int64_t q = static_cast<std::int64_t>(m.heads) * hd, kv = static_cast<std::int64_t>(m.kv_heads) * hd;
  const std::int64_t L = m.layers;
  const std::int64_t moe_layers = moe_layer_count(m), dense_layers = L - moe_layers;
  auto add = [&](ComponentParams c) {
    if (c.total > 0) pc.components.push_back(std::move(c));
  };

  add({"embedding", V * h, V * h, 0, true, false, false});
  if (!m.tied_embeddings) add({"lm_head", V * h, V * h, 0, true, false, true});

  // Attention, per kind present.
  const std::int64_t softmax = attention_layer_count(m, AttentionKind::kMha) + attention_layer_count(m, AttentionKind::kGqa);
  const std::int64_t linear = attention_layer_count(m, AttentionKind::kLinear);
  const std::int64_t cca = attention_layer_count(m, AttentionKind::kCca);
  const std::int64_t proj = h * (q + 2 * kv) + q * h;
  add({"attention", softmax * proj, softmax * proj, proj, false, false, true});
  add({"linear_attention", linear * proj, linear * proj, proj, false, false, true});
  if (cca > 0) {
    const std::int64_t cproj = h * m.cca_q_dim + h * m.cca_k_dim + h * m.cca_v_dim + static_cast<std::int64_t>(m.cca_q_dim) * h;
    add({"cca_attention", cca * cproj, cca * cproj, cproj, false, false, true});
    // Depthwise conv (kernel cca_conv_width, bias) over the q|k channels, then a grouped conv
    // with one head_dim x head_dim mix per head and tap (bias), then kv_heads temperatures.
    const std::int64_t ch = m.cca_q_dim + m.cca_k_dim;
    const std::int64_t conv = ch * m.cca_conv_width + ch + ch * hd * m.cca_group_conv_width + ch + m.kv_heads;
    add({"cca_conv", cca * conv, cca * conv, conv, false, false, false});
  }

  // MLPs.
  const std::int64_t dense_mlp = 3 * h * m.ffn_hidden;
  add({"mlp", dense_layers * dense_mlp, dense_layers * dense_mlp, dense_mlp, false, false, true});
  if (moe_layers > 0) {
    const std::int64_t classes = m.experts + (m.router_skip_expert ? 1 : 0);
    std::int64_t router = 0;
    if (m.router_hidden == 0) {
      router = h * classes;
    } else {
      const std::int64_t r = m.router_hidden;
      // down_proj (bias), EDA scale, RMSNorm, (mlp_layers - 1) r x r layers (bias), r -> classes.
      router = h * r + r + r + r + (m.router_mlp_layers - 1) * (r * r + r) + r * classes;
    }
    add({"router", moe_layers * router, moe_layers * router, router, false, false, true});
    const std::int64_t expert = 3 * h * m.expert_hidden;
    const std::int64_t shared = m.shared_experts * expert;
    add({"shared_experts", moe_layers * shared, moe_layers * shared, shared, false, false, true});
    add({"experts", moe_layers * m.experts * expert, moe_layers * m.top_k * expert, m.experts * expert, false, true,
         true});
  }

  // Norms: two RMSNorms per layer and a final one; QK-norm vectors; ZAYA1's residual scaling
  // (4 vectors per stage, 2 stages per layer, plus one before the final norm).
  std::int64_t norms = 2 * L * h + h;
  if (m.qk_norm) norms += (softmax + linear) * (q + kv);
  if (m.residual_scaling) norms += 8 * L * h + 4 * h;
  add({"norms", norms, norms, 0, false, false, false});

  for (const auto& c : pc.components) {
    pc.total += c.total;
    pc.active += c.active;
    if (!c.embedding) {
      pc.total_non_embedding += c.total;
      pc.active_non_embedding += c.active;
    }
    if (c.name != "norms" && c.name != "embedding") pc.matmul_active += c.active;
  }
  // A tied head still runs its GEMM; biases/norm vectors inside components are negligible
  // but are subtracted where known so 6N is exactly the GEMM FLOPs.
  if (m.tied_embeddings) pc.matmul_active += V * h;
  if (cca > 0) {
    const std::int64_t ch = m.cca_q_dim + m.cca_k_dim;
    pc.matmul_active -= cca * (2 * ch + m.kv_heads);  // conv biases and temperatures
  }
  if (moe_layers > 0 && m.router_hidden > 0) {
    const std::int64_t r = m.router_hidden;
    pc.matmul_active -= moe_layers * (3 * r + (m.router_mlp_layers - 1) * r);  // biases, EDA, norm
  }
  pc.lm_head_matmul = V * h;
  return pc;
}

}  // namespace keel::model
