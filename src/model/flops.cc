#include "model/flops.h"

#include <algorithm>

#include "common/error.h"
#include "model/params.h"

namespace keel::model {

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::kNone: return "none";
    case Recompute::kSelective: return "selective";
    case Recompute::kFull: return "full";
  }
  return "?";
}

Recompute parse_recompute(const std::string& s) {
  if (s == "none") return Recompute::kNone;
  if (s == "selective") return Recompute::kSelective;
  if (s == "full") return Recompute::kFull;
  throw UsageError(fmt::format("unknown recompute '{}' (choose none, selective or full)", s));
}

double TokenFlops::training_with(Recompute r) const {
  switch (r) {
    case Recompute::kNone: return training();
    case Recompute::kSelective: return training() + recomputable_selective;
    case Recompute::kFull: return training() + body_forward + attention_forward;
  }
  return training();
}

TokenFlops token_flops(const ModelConfig& m, std::int64_t seq) {
  if (seq <= 0) throw UsageError(fmt::format("sequence length must be positive (got {})", seq));
  TokenFlops f;
  f.seq = seq;
  const ParamCounts pc = count_params(m);
  const double hd = m.head_dim;
  const double q = static_cast<double>(m.heads) * hd;

  // Weight multiply-adds, component by component (biases and norm vectors are not GEMMs).
  double conv = 0;
  for (const auto& c : pc.components) {
    if (c.name == "embedding" || c.name == "lm_head" || c.name == "norms") continue;
    double weights = static_cast<double>(c.active);
    const double layers = c.per_layer > 0 ? static_cast<double>(c.total) / c.per_layer : 0;
    if (c.name == "cca_conv") {
      const double ch = m.cca_q_dim + m.cca_k_dim;
      weights = layers * (ch * m.cca_conv_width + ch * hd * m.cca_group_conv_width);
      conv = 2 * weights;
    } else if (c.name == "router" && m.router_hidden > 0) {
      // its vectors (down_proj bias, EDA scale, norm, r x r biases) are no GEMM; the first MoE
      // stage has no EDA scale
      const double r = m.router_hidden;
      weights -= moe_layer_count(m) * (3 * r + (m.router_mlp_layers - 1) * r) - r;
    }
    f.items.push_back({c.name, 2 * weights});
    f.body_forward += 2 * weights;
  }

  // Attention core per layer and token. Softmax (MHA/GQA/CCA): QK^T and PV over the keys a query
  // attends, 2*C each per key (attended_keys: the causal half of the context, or of a sliding
  // layer's window). Linear attention (chunked): the d x d state update and readout (4*d^2 per
  // head) plus the causal intra-chunk products.
  const double linear_layers = attention_layer_count(m, AttentionKind::kLinear);
  const double T = static_cast<double>(seq);
  double softmax_causal = 0, softmax_full = 0;
  for (int l = 0; l < m.layers; ++l) {
    if (layer_attention_kind(m, l) == AttentionKind::kLinear) continue;
    softmax_causal += 4 * q * attended_keys(m, l, seq);
    softmax_full += 4 * q * attended_keys(m, l, seq, /*halved=*/false);
  }
  const double linear_core = linear_layers * m.heads * (4 * hd * hd + 2 * hd * std::min<double>(m.linear_chunk, T));
  f.attention_forward = softmax_causal + linear_core;
  f.attention_forward_palm = softmax_full + linear_core;
  f.items.push_back({"attention_core", f.attention_forward});

  f.lm_head_forward = 2.0 * static_cast<double>(pc.lm_head_matmul);
  f.items.push_back({"lm_head", f.lm_head_forward});
  f.recomputable_selective = conv;
  return f;
}

double attended_keys(const ModelConfig& m, int layer, std::int64_t seq, bool halved) {
  const double T = static_cast<double>(seq);
  const int w = attention_window(m, layer);
  const double W = w > 0 && w < seq ? w : T;  // the keys of the last query
  return halved ? W - W * W / (2 * T) : W;
}

}  // namespace keel::model
