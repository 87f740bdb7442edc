// The attention block over a cache on the GPU (CUDA builds only): what the GPU decoder
// (generate/cuda_decoder_cuda.cc) keeps per layer between tokens, how a prefill (attention.h's
// forward over the prompt) fills it, and the per-token forward that reads it. The CPU twin is
// blocks/attention_decode.h.
//
// Cache of one layer for B sequences of `capacity` positions, bf16: k (after RoPE) and v
// [B, capacity, kv_heads * head_dim]; CCA's fixed state: the last W0 - 1 depthwise-conv inputs
// (qk0 rows) [B, W0 - 1, C], the last W1 - 1 depthwise outputs [B, W1 - 1, C] (bf16, as the CUDA
// CCA keeps c0) and the previous token's value half x_{t-1} W_v2^T [B, kv_heads * head_dim / 2].
// Linear attention keeps no k/v rows: its fp32 memory state [B, kv_heads, head_dim, head_dim]
// (ops/cuda/linear_attention.h), advanced one token per decode step.
//
// decode runs, for one new token per sequence, the per-token ops of the block on B rows
// (projections, RoPE at the position), ops/cuda/decode_attention.h for the attention over the
// cache, and decode_kernels.h's steps for CCA's convs and value shift (the CUDA CCA's bf16
// roundings, so prefill and decode agree to GEMM summation order). No host sync. Degree 1 only
// (no runners).
#pragma once

#include <cstdint>

#include "blocks/cuda/attention.h"
#include "blocks/cuda/weights.h"
#include "device/device_arena.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/rope.h"

namespace keel::blocks::cuda {

struct LayerCache {
  bf16 *k = nullptr, *v = nullptr;      // [B, capacity, kv_heads * head_dim]
  bf16 *st0 = nullptr, *st1 = nullptr;  // CCA: [B, W0 - 1, C], [B, W1 - 1, C]
  bf16* prev_v = nullptr;               // CCA: [B, kv_heads * head_dim / 2]
  float* state = nullptr;               // linear: [B, kv_heads, head_dim, head_dim]
};
// One layer's cache (w: its kind) for s.batch sequences of `capacity` positions.
void carve(DeviceCarver& c, const AttnShape& s, const LayerWeights& w, std::int64_t capacity, LayerCache& lc);
// Empty CCA states: the depthwise conv reads zeros before the sequence, the grouped conv the
// depthwise output of zeros (its bias, in bf16 as the CUDA CCA's c0), the value shift zeros.
// (k/v rows need none: rows at or past the length are never read.) Nothing for mha/gqa; a
// linear layer's state is zeroed.
void reset_cache(const AttnShape& s, const LayerWeights& w, const LayerCache& lc, cudaStream_t stream);

// The decoder's scratch beside the block's saved set, for s.batch sequences.
struct CacheScratch {
  bf16* last_x = nullptr;   // CCA prefill: [B, D] each sequence's last normed input
  void* attn_ws = nullptr;  // decode: decode_attention::workspace_bytes(B, heads, head_dim)
  void* linear_ws = nullptr;  // linear prefill: linear_attention::workspace_bytes over (B, seq)
};
void carve(DeviceCarver& c, const AttnShape& s, AttnKinds kinds, CacheScratch& sc);

// After attention_forward over s.batch x s.seq tokens from position 0 (h its input [N, D], a
// what it saved): k/v rows 0..seq-1 and, for CCA, the last W0 - 1 conv inputs and W1 - 1
// depthwise outputs, and the last token's x W_v2^T; for linear attention the state the prompt
// leaves.
void fill_cache(ops::cuda::GemmRunner& gemm, const AttnShape& s, const LayerWeights& w, const bf16* h,
                const AttnSaved& a, std::int64_t capacity, const LayerCache& lc, const CacheScratch& sc,
                cudaStream_t stream);

// One new token per sequence (s.seq == 1; h bf16 [B, D]) at position `length` (pos: device [B],
// each `length`) with the layer's rotary table and window (0: full causal; W > 0: the last W
// cached positions, itself included): appends its k/v row, slides CCA's states; the block
// output as attention_forward's (out bf16 [B, D]; add_into fp32 [B, D] or null: mha/gqa add in
// the output GEMM, CCA writes out then adds). `a` is an AttnSaved set carved for (s.batch, 1),
// the scratch.
void attention_decode(ops::cuda::GemmRunner& gemm, const AttnShape& s, const LayerWeights& w, const bf16* h,
                      const std::int32_t* pos, const ops::cuda::rope::DeviceTable& rope, int window,
                      std::int64_t capacity, std::int64_t length, const LayerCache& lc, const AttnSaved& a,
                      const CacheScratch& sc, float* add_into, bf16* out, cudaStream_t stream);

}  // namespace keel::blocks::cuda
