// The attention block on the CPU (fp32 reference), written once for training (train/model.h)
// and decoding's prefill (generate/generate.h): mha/gqa (q, k, v projections, RoPE, causal
// attention, output projection), ZAYA1's CCA (ops/cca.h, its output projection included), or
// linear attention (the same projections, no RoPE: the feature map on q and k, causal linear
// attention, each head's output RMS-normalized, the output projection; ops/linear_attention.h). The
// per-token decode over a cache is attention_decode.h. The GPU twin is blocks/cuda/attention.h.
//
// h (the stage's RMSNorm output) [N, D], N = batch x seq tokens -> y [N, D] OVERWRITTEN. Backward:
// dy [N, D] -> dh [N, D] OVERWRITTEN, parameter gradients ACCUMULATED. The runners (runners.h:
// the tensor-parallel boundary and the attention core) come from the plan; at degree 1 they are
// the local ops.
#pragma once

#include <cstdint>
#include <string>

#include "blocks/runners.h"
#include "blocks/shape.h"
#include "blocks/weights.h"
#include "model/config.h"
#include "ops/cca.h"
#include "ops/rope.h"
#include "tensor/arena.h"

namespace keel::blocks {

// What a layer's forward keeps for its backward (a decoder's prefill carves one set as scratch).
struct AttnSaved {
  Tensor q, k, v, att, lse;  // mha/gqa: [B, T, Hq, Dh], [B, T, Hkv, Dh] x 2, [B, T, Hq, Dh], [B, Hq, T]
  ops::cca::Saved cca;       // CCA
  // linear: q, k, v (feature-mapped), att (normalized output) as above; rstd [B*T*Hq]; init
  // [B*segments, Hkv, Dh, Dh] each run's initial state (context parallelism only)
  Tensor rstd, init;
};
void carve(ArenaPlanner& p, const std::string& prefix, const AttnShape& s, AttnKinds kinds, AttnSaved& a);

// Backward scratch shared by every layer; `tmp` [N, D] is the caller's.
struct AttnScratch {
  Tensor dq, dk, dv, datt;  // mha/gqa
  Tensor cca;               // cca::backward_scratch_floats
  Tensor tmp;               // [N, D]: one projection's input gradient before it is summed
};
void carve(ArenaPlanner& p, const AttnShape& s, AttnKinds kinds, AttnScratch& sc);

// Each token's position [N] with the layer's rotary table and attention window (0: full
// causal; a sliding layer's model::attention_window), and the block's runners.
struct AttnContext {
  const std::int32_t* pos = nullptr;
  const ops::rope::Table* rope = nullptr;
  int window = 0;
  LinearRunner* linear = &local_linear();
  AttentionCore* core = &local_attention();
};

void attention_forward(const AttnShape& s, const LayerWeights& w, model::AttentionKind kind, const Tensor& h,
                       const AttnContext& c, const AttnSaved& a, const Tensor& y);
void attention_backward(const AttnShape& s, const LayerWeights& w, LayerWeights& g, model::AttentionKind kind,
                        const Tensor& h,
                        const AttnContext& c, const AttnSaved& a, const AttnScratch& sc, const Tensor& dy,
                        const Tensor& dh);

}  // namespace keel::blocks
