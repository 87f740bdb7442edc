// The attention block over a cache on the CPU (fp32): what keel generate (generate/generate.h)
// keeps per layer between tokens, how a prefill (attention.h's forward over the prompt) fills it,
// and the per-token forward that reads it. The GPU twin is blocks/cuda/attention_decode.h.
//
// Cache of one layer for B sequences of `capacity` positions:
//   mha/gqa  k (rotated) and v: [B, capacity, kv_heads, head_dim] each.
//   CCA      the same k/v cache of its kv heads (the attention operands: k normalized, scaled by
//            the temperature and rotated; v = [x_t W_v1^T | x_{t-1} W_v2^T]), plus a state of
//            fixed size: the last (W0 - 1) inputs of the depthwise conv (qk0 rows; zeros before
//            the sequence), the last (W1 - 1) depthwise outputs feeding the grouped conv (before
//            the sequence these are the conv0 bias alone, as in the reference's single up-front
//            padding: ops/causal_conv.h), and the previous token's value half x_{t-1} W_v2^T
//            (stored projected: kv_heads*head_dim/2 floats; zeros before the sequence).
//   linear   no k/v cache: the memory state [B, kv_heads, head_dim, head_dim] of
//            ops/linear_attention.h (constant size per sequence, whatever its length).
//
// decode computes, for one new token per sequence, what attention_forward computes for the last
// token of a sequence: the per-token ops (projections, RoPE at the position) are the same ops on
// B rows; what depends on earlier tokens (attention over the cache, the causal convs, CCA's
// previous-token values) comes from the cache. Degree 1 only (no runners).
#pragma once

#include <cstdint>
#include <vector>

#include "blocks/attention.h"
#include "blocks/weights.h"
#include "ops/rope.h"
#include "tensor/tensor.h"

namespace keel::blocks {

struct LayerCache {
  std::vector<float> k, v;       // [B, capacity, kv_heads, head_dim]
  std::vector<float> conv0_in;   // CCA: [B, W0 - 1, C] last depthwise-conv inputs, oldest first
  std::vector<float> conv1_in;   // CCA: [B, W1 - 1, C] last depthwise outputs, oldest first
  std::vector<float> prev_v;     // CCA: [B, kv_heads*head_dim/2] previous token's x W_v2^T
  std::vector<float> state;      // linear: [B, kv_heads, head_dim, head_dim]
};

// An empty cache of s.batch sequences of `capacity` positions (k/v zeros, CCA's states as before
// the sequence: w.cca.conv0_b feeds the grouped conv).
LayerCache make_layer_cache(const AttnShape& s, model::AttentionKind kind, const LayerWeights& w, int capacity);

// After attention_forward over s.batch x s.seq tokens from position 0 (h its input [N, D], a
// what it saved): k/v rows 0..seq-1 and, for CCA, the conv and value-shift states at the end;
// linear attention: the memory state at the end.
void fill_cache(const AttnShape& s, const LayerWeights& w, model::AttentionKind kind, const Tensor& h,
                const AttnSaved& a,
                int capacity, LayerCache& c);

// One new token per sequence (s.seq == 1; h [B, D], the stage's RMSNorm output) at position
// `length` (pos[b] == length, the cache filled up to it) with the layer's rotary table and
// window (0: full causal; W > 0: it attends to the last W cached positions, itself included):
// appends its k/v row, slides CCA's states, y [B, D] OVERWRITTEN. `a` is an AttnSaved set
// carved for (s.batch, 1), used as scratch.
void attention_decode(const AttnShape& s, const LayerWeights& w, model::AttentionKind kind, const Tensor& h,
                      const std::int32_t* pos,
                      const ops::rope::Table& rope, int window, int capacity, std::int64_t length, LayerCache& c,
                      const AttnSaved& a, const Tensor& y);

}  // namespace keel::blocks
