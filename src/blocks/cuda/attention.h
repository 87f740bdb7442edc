// The attention block on the GPU, written once for training (train/cuda_model_cuda.h) and
// decoding's prefill (generate/cuda_decoder_cuda.cc): mha/gqa (q, k, v projections, RoPE,
// flash attention, output projection), ZAYA1's CCA (ops/cuda/cca.h, its output projection
// included) or linear attention (the projections, the feature map, ops/cuda/linear_attention.h,
// each head's output RMS-normalized, the output projection; the CPU block's math). The per-token decode over a cache is attention_decode.h. The CPU twin is
// blocks/attention.h.
//
// Dtypes: h (the stage's RMSNorm output) bf16 [N, D], N = batch x seq tokens; the block output
// written bf16 to `out` (residual scaling merges it, ops/cuda/residual_scale.h) and, with
// `add_into`, ADDED into an fp32 [N, D] (the plain pre-norm layer's residual stream; for mha/gqa
// with a whole output the add rides in the output GEMM, beta = 1, and `out` is not written).
// Backward: dy bf16 [N, D] in, dh bf16 [N, D] OVERWRITTEN, parameter gradients ACCUMULATED. No
// host sync. The runners (runners.h: the tensor-parallel boundary and the attention core) come
// from the plan; at degree 1 they are the local ops.
#pragma once

#include <cstddef>
#include <cstdint>

#include "blocks/cuda/runners.h"
#include "blocks/cuda/weights.h"
#include "blocks/shape.h"
#include "device/device_arena.h"
#include "model/config.h"
#include "ops/cuda/cca.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/rope.h"

namespace keel::blocks::cuda {

using blocks::AttnKinds;
using blocks::AttnShape;  // blocks/shape.h, shared with the CPU block

// What a layer's forward keeps for its backward (the decoder carves one set as prefill scratch).
struct AttnSaved {
  bf16 *q = nullptr, *k = nullptr, *v = nullptr, *att = nullptr;  // mha/gqa [N, Q], [N, KV], [N, KV], [N, Q]
  float* lse = nullptr;                                            // [B, Hq, T]
  ops::cuda::cca::Saved cca;                                       // CCA
  // linear: q, k, v (feature-mapped), att (normalized output) as above; rstd [N * Hq]; init
  // [B * segments, Hkv, Dh, Dh] each run's initial state (context parallelism only)
  float *rstd = nullptr, *init = nullptr;
};
void carve(DeviceCarver& c, const AttnShape& s, AttnKinds kinds, AttnSaved& a);

// Backward scratch shared by every layer.
struct AttnScratch {
  bf16 *datt = nullptr, *dq = nullptr, *dk = nullptr, *dv = nullptr;  // mha/gqa
  void* attn = nullptr;                                                // attention::backward_workspace_bytes
  void* cca = nullptr;                                                 // cca::backward_scratch_bytes
  void* linear = nullptr;  // linear attention: forward's and backward's workspace (the core's)
  float* dh = nullptr;  // [N, D] fp32: the projections' input gradient before it is rounded (the caller's)
};
void carve(DeviceCarver& c, const AttnShape& s, AttnKinds kinds, const AttentionCore& core, AttnScratch& sc);

// Each token's position (device [N]) with the layer's rotary table and attention window (0:
// full causal; a sliding layer's model::attention_window), and the block's runners.
struct AttnContext {
  const std::int32_t* pos = nullptr;
  const ops::cuda::rope::DeviceTable* rope = nullptr;
  int window = 0;
  LinearRunner* linear = &local_linear();
  AttentionCore* core = &local_attention();
  // Linear attention's forward workspace (AttnScratch::linear: the layers share it).
  void* linear_workspace = nullptr;
};

// out: bf16 [N, D]; add_into: fp32 [N, D] or null (see the top).
void attention_forward(ops::cuda::GemmRunner& gemm, const AttnShape& s, const LayerWeights& w, const bf16* h,
                       const AttnContext& p, const AttnSaved& a, float* add_into, bf16* out, cudaStream_t stream);

void attention_backward(ops::cuda::GemmRunner& gemm, const AttnShape& s, const LayerWeights& w, const LayerGrads& g,
                        const bf16* h, const AttnContext& p, const AttnSaved& a, const AttnScratch& sc, const bf16* dy,
                        bf16* dh, cudaStream_t stream);

}  // namespace keel::blocks::cuda
