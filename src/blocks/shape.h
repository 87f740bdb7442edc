// The blocks' shapes, one struct each for the CPU block and its GPU twin: the attention block
// (blocks/attention.h, blocks/cuda/attention.h), ZAYA1's MoE stage (blocks/zaya_moe.h,
// blocks/cuda/zaya_moe.h) and the MLP block (blocks/mlp.h, blocks/cuda/mlp.h).
#pragma once

#include <cstdint>

#include "model/config.h"
#include "ops/cca.h"
#include "ops/linear_attention.h"

namespace keel::blocks {

// This rank's place in its tensor-parallel group (parallel/tensor_parallel.h): the blocks hold
// 1/degree of the heads and of the FFN widths. Degree 1: the whole block.
struct TensorSplit {
  int degree = 1, rank = 0;
};

struct AttnShape {
  std::int64_t batch = 0, seq = 0, hidden = 0;
  int heads = 0, kv_heads = 0, head_dim = 0;  // this rank's (heads / tp; kv heads: see kv_head0)
  // More tensor ranks than kv heads: the k and v projections are whole on every rank and this
  // rank's query heads read kv head kv_head0 (kv_heads is then 1). -1: the projections are this
  // rank's slice.
  int kv_head0 = -1;
  ops::cca::Config cca;  // this rank's heads
  // Linear-attention layers: this rank's heads, the chunk, the decays of its kv heads; the feature
  // map on q and k; each head's output normalized with eps (ops/linear_attention.h).
  ops::linear_attention::Config linear;
  ops::linear_attention::Feature feature = ops::linear_attention::Feature::kIdentity;
  float eps = 1e-5f;
  // Context parallelism: the runs of consecutive tokens this rank holds per sequence (seq tokens
  // in all; ops/sequence_split.h), whose halos CCA keeps for backward. 0: whole sequences.
  int segments = 0;
  std::int64_t tokens() const { return batch * seq; }
  std::int64_t q_dim() const { return std::int64_t(heads) * head_dim; }
  std::int64_t kv_dim() const { return std::int64_t(kv_heads) * head_dim; }
  float scale() const;  // 1 / sqrt(head_dim)
  static AttnShape of(const model::ModelConfig& cfg, std::int64_t batch, std::int64_t seq, TensorSplit tp = {});
};

// Which attention kinds a workspace serves (one layer's, or every layer's when layers share it).
struct AttnKinds {
  bool softmax = false, cca = false, linear = false;
  static AttnKinds of(model::AttentionKind k);
  AttnKinds& operator|=(const AttnKinds& o) {
    softmax |= o.softmax, cca |= o.cca, linear |= o.linear;
    return *this;
  }
};

// ZAYA1's MoE stage: the MLP router (with EDA) over E experts and the skip class, the experts.
struct ZayaShape {
  std::int64_t tokens = 0, hidden = 0, router_hidden = 0, expert_hidden = 0;
  int experts = 0;  // E (without the skip class)
  bool skip = false;
  float eps = 1e-5f;  // the router's RMSNorm
  bool forced_balance = false;  // benchmarking only: token n -> expert n mod experts, never skip
  int classes() const { return experts + (skip ? 1 : 0); }
  int forced_classes() const { return forced_balance ? experts : 0; }  // the router's forced_classes
};

// The MLP block of N = `tokens` rows: dense, a linear top-k router's MoE, or ZAYA1's stage.
struct MlpShape {
  std::int64_t tokens = 0, hidden = 0, ffn = 0, expert_hidden = 0;  // ffn, expert_hidden: this rank's (/ tp)
  int experts = 0, top_k = 1;
  bool mlp_router = false;  // ZAYA1's MLP router (zaya), else the linear top-k router
  bool renormalize = true;  // linear router: gates renormalized over the top_k
  // Benchmarking only (train::ModelOptions::forced_balance): forced-balance selection, slot j
  // of token n -> expert (n * top_k + j) mod experts (ops/router.h); the ZAYA1 stage's too.
  bool forced_balance = false;
  ZayaShape zaya;           // the ZAYA1 stage (mlp_router)
  int classes() const { return mlp_router ? zaya.classes() : experts; }
  int forced_classes() const { return forced_balance ? experts : 0; }  // the router's forced_classes
  static MlpShape of(const model::ModelConfig& cfg, std::int64_t tokens, bool renormalize, TensorSplit tp = {},
                     bool forced_balance = false);
};

}  // namespace keel::blocks
