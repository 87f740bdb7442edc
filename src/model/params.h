// Parameter counts of a model, per component, total and active (what one token touches).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace keel::model {

struct ComponentParams {
  std::string name;          // "embedding", "lm_head", "attention", "cca_conv", "mlp", "router", ...
  std::int64_t total = 0;    // whole model
  std::int64_t active = 0;   // used by one token (routed experts: top_k of experts)
  std::int64_t per_layer = 0;  // in one layer that has it (0 for embedding/lm_head/final norms)
  bool embedding = false;    // embedding or LM head: left out of "non-embedding" counts
  bool expert = false;       // sharded over expert parallelism
  bool matrix = false;       // 2-D weight matrices (Muon's share); else vectors, convs, embeddings
};

struct ParamCounts {
  std::vector<ComponentParams> components;
  std::int64_t total = 0, active = 0;                              // with embeddings
  std::int64_t total_non_embedding = 0, active_non_embedding = 0;  // without embedding/LM head
  // Weights that do a multiply-add per token (projections, convs, router, experts, LM head;
  // not norms or biases), active share: training FLOPs ~ 6 x this.
  std::int64_t matmul_active = 0;
  std::int64_t lm_head_matmul = 0;  // vocab x hidden, tied or not (the LM head GEMM runs either way)
};

// Counting rules (docs/size.md): no biases except where the architecture has them (CCA convs,
// ZAYA1's router); RMSNorm has one vector; a tied LM head adds no parameters.
ParamCounts count_params(const ModelConfig& m);

}  // namespace keel::model
