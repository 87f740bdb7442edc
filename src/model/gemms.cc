// The weight GEMMs of a model, layer type by layer type. This is the list `keel bench gemm`
// times and `keel size` predicts; docs/size.md shows it for ZAYA1-8B.
#include <algorithm>

#include "common/error.h"
#include "model/config.h"

namespace keel::model {
namespace {

struct Adder {
  std::vector<Gemm>& out;
  std::int64_t tokens;
  bool backward;

  // A linear map in -> out_features applied to `m` rows, `batch` times, in `layers` layers.
  void linear(const std::string& name, std::int64_t m, std::int64_t in, std::int64_t out_features,
              std::int64_t batch, std::int64_t layers) {
    if (layers <= 0 || m <= 0) return;
    out.push_back({name, "fwd", m, out_features, in, batch, layers});
    if (!backward) return;
    out.push_back({name, "bwd_data", m, in, out_features, batch, layers});     // dX = dY W^T
    out.push_back({name, "bwd_weight", in, out_features, m, batch, layers});   // dW = X^T dY
  }
};

}  // namespace

std::vector<Gemm> layer_gemms(const ModelConfig& m, std::int64_t tokens, bool backward) {
  if (tokens <= 0) throw UsageError(fmt::format("layer_gemms: tokens must be positive (got {})", tokens));
  std::vector<Gemm> out;
  Adder add{out, tokens, backward};
  const std::int64_t h = m.hidden, hd = m.head_dim;

  // Attention projections, one entry per kind present.
  const std::int64_t softmax_layers =
      attention_layer_count(m, AttentionKind::kMha) + attention_layer_count(m, AttentionKind::kGqa);
  const std::int64_t q = m.heads * hd, kv = m.kv_heads * hd;
  add.linear("qkv", tokens, h, q + 2 * kv, 1, softmax_layers);
  add.linear("attn_out", tokens, q, h, 1, softmax_layers);

  const std::int64_t cca_layers = attention_layer_count(m, AttentionKind::kCca);
  if (cca_layers > 0) {
    add.linear("q", tokens, h, m.cca_q_dim, 1, cca_layers);
    add.linear("k", tokens, h, m.cca_k_dim, 1, cca_layers);
    // val_proj1 on x_t and val_proj2 on x_{t-1}: two GEMMs of one shape.
    add.linear("v", tokens, h, m.cca_v_dim / 2, 2, cca_layers);
    add.linear("attn_out", tokens, m.cca_q_dim, h, 1, cca_layers);
  }

  const std::int64_t linear_layers = attention_layer_count(m, AttentionKind::kLinear);
  add.linear("linear_qkv", tokens, h, q + 2 * kv, 1, linear_layers);
  add.linear("linear_out", tokens, q, h, 1, linear_layers);

  // MLPs.
  const std::int64_t moe_layers = moe_layer_count(m);
  const std::int64_t dense_layers = m.layers - moe_layers;
  add.linear("mlp_up_gate", tokens, h, 2 * static_cast<std::int64_t>(m.ffn_hidden), 1, dense_layers);
  add.linear("mlp_down", tokens, m.ffn_hidden, h, 1, dense_layers);
  if (moe_layers > 0) {
    const std::int64_t classes = m.experts + (m.router_skip_expert ? 1 : 0);
    if (m.router_hidden == 0) {
      add.linear("router", tokens, h, classes, 1, moe_layers);
    } else {
      add.linear("router_down", tokens, h, m.router_hidden, 1, moe_layers);
      for (int i = 1; i < m.router_mlp_layers; ++i)
        add.linear(fmt::format("router_mlp{}", i), tokens, m.router_hidden, m.router_hidden, 1, moe_layers);
      add.linear("router_out", tokens, m.router_hidden, classes, 1, moe_layers);
    }
    if (m.shared_experts > 0) {
      const std::int64_t w = static_cast<std::int64_t>(m.shared_experts) * m.expert_hidden;
      add.linear("shared_up_gate", tokens, h, 2 * w, 1, moe_layers);
      add.linear("shared_down", tokens, w, h, 1, moe_layers);
    }
    const std::int64_t te = tokens_per_expert(m, tokens);
    add.linear("expert_up_gate", te, h, 2 * static_cast<std::int64_t>(m.expert_hidden), m.experts, moe_layers);
    add.linear("expert_down", te, m.expert_hidden, h, m.experts, moe_layers);
  }

  add.linear("lm_head", tokens, h, m.vocab_size, 1, 1);
  return out;
}

}  // namespace keel::model
