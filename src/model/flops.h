// FLOPs per token. Convention (docs/size.md): a multiply-add is 2 FLOPs; backward is twice
// the forward (dX and dW); attention's score and value products are counted causal-halved
// (llm.c: training 6*N + 6*L*C*T with C the query width, T the sequence); PaLM's non-halved
// 6*N + 12*L*C*T is reported beside it. A sliding-window layer counts only its window
// (attended_keys). MFU = model FLOPs (no recomputation) / (time x dense
// bf16 peak); recomputation is hardware FLOPs (HFU), never MFU.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace keel::model {

enum class Recompute {
  kNone,       // keep every activation backward needs
  kSelective,  // recompute the cheap ops between GEMMs: norm outputs, SwiGLU products, CCA convs and q/k
               // normalisation (kept: residuals, GEMM outputs the cheap ops start from, attention in/out)
  kFull,       // keep each layer's input; rerun the layer's forward in backward
};
const char* recompute_name(Recompute r);
Recompute parse_recompute(const std::string& s);  // none|selective|full; UsageError otherwise

struct FlopsItem {
  std::string name;
  double forward = 0;  // per token
};

struct TokenFlops {
  std::int64_t seq = 0;
  std::vector<FlopsItem> items;  // forward per token: projections, convs, MLPs, router, experts, attention core, lm_head
  double body_forward = 0;       // every weight multiply-add except the LM head (2 x non-embedding matmul weights)
  double lm_head_forward = 0;
  double attention_forward = 0;       // score/value products, causal-halved
  double attention_forward_palm = 0;  // the same, not halved
  double recomputable_selective = 0;  // forward FLOPs selective recomputation repeats (CCA convs; elementwise ops count 0)
  double forward() const { return body_forward + lm_head_forward + attention_forward; }
  double backward() const { return 2 * forward(); }
  double training() const { return 3 * forward(); }  // model FLOPs: the MFU numerator
  double training_palm() const { return 3 * (body_forward + lm_head_forward + attention_forward_palm); }
  // Hardware FLOPs with recomputation: full repeats the layers' forward (not the LM head).
  double training_with(Recompute r) const;
};

TokenFlops token_flops(const ModelConfig& m, std::int64_t seq);

// Keys a query of softmax layer `layer` attends to, averaged over the seq queries of a sequence:
// the T of attention's per-token 4*C*T. Causal-halved: seq / 2, or in a sliding layer with window
// W < seq, W - W^2 / (2 seq) (the first W queries ramp up as causal ones do, the rest see W each;
// W = seq gives seq / 2). Not halved (PaLM): seq, or min(W, seq).
double attended_keys(const ModelConfig& m, int layer, std::int64_t seq, bool halved = true);

}  // namespace keel::model
