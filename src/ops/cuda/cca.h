// ZAYA1's CCA attention block on the GPU: the CUDA twin of ops/cca.h (same equations, same
// parameter layouts, same saved set), composed from the CUDA ops: linear (W_qk, W_v, W_o),
// causal_conv (depthwise; grouped on tensor cores, per sequence), rope, attention (flash, causal GQA), plus
// fused kernels of its own for the mixing terms + L2 normalization (+ temperature), the value
// shift, and their backward passes. docs/zaya1_ops.md §3 has the math; in short, per token:
//   qk0 = x W_qk^T;  qk = grouped(depthwise(qk0)) + mixing(qk0);  q, k = L2-normalized heads of
//   qk times sqrt(d) (k also times temp[g]);  RoPE;  v = [x_t W_v1^T | x_{t-1} W_v2^T];
//   att = causal GQA attention(q, k, v, 1/sqrt(d); Config::window: a sliding layer's window);
//   y = att W_o^T.
//
// Dtypes (docs/gpu_training.md: bf16 where a tensor feeds a GEMM or the attention kernel, fp32
// for statistics and the pre-normalization values):
//   x, y, dy, dx [N, H] bf16 (x is the RMSNorm'd residual; y is the block output, fed to the
//     residual scaling / residual add). N = B*T, token b*T + t.
//   weights: w_qk [C, H], w_v [nkv d, H], w_o [H, nq d] bf16 copies (GEMMs); conv0_w [C, W0],
//     conv0_b [C], conv1_w [C, d, W1], conv1_b [C], temp [nkv] fp32 (see cuda/causal_conv.h).
//   gradients: all fp32, ACCUMULATED (+=); any may be null. dx bf16, OVERWRITTEN (may be null).
// Saved by forward (Saved; saved_bytes / carve_saved lay it out, 256-byte aligned regions):
//   qk0 [N, C] bf16, c0 [R, L + W1 - 1, C] bf16, qk [N, C] fp32, rnorm [N, nq + nkv] fp32,
//   q [N, nq d], k [N, nkv d], v [N, nkv d], att [N, nq d] bf16, lse [B, nq, T] fp32, conv1_wt
//   [W1, C, d] bf16 (the grouped conv's weights re-laid out for its tensor-core GEMMs), halo
//   [R, F] bf16 (split only); plus the caller's x and positions. R = B, L = T without a split.
//   Forward uses att as its scratch for the unshifted values before the attention overwrites
//   it (and, with a split, qk for the packed tails before the grouped conv), so it needs no
//   workspace.
//
// Sequence split (ops/cuda/sequence_split.h; null: whole sequences, exactly the results and
// launches without one), as the CPU op's (ops/cca.h): with S = split->segments() the op sees B*S
// runs of L = T/S tokens (T % S == 0, L >= hh = (W0-1) + (W1-1); keel::Error otherwise, or for a
// Saved carved without the halo, before launching). Each run's tail, F = ops::cca::halo_floats(c) bf16 (its last hh rows of qk0, then
// its last row's shifted columns of u = x W_v^T), goes through split->halo into Saved::halo;
// the depthwise conv reads it as the times before the run, the value shift as the previous
// token of the run's first; attention is split->forward / backward. Backward: ONE
// split->halo_backward (fp32), dtails added into the runs' last hh rows of dqk0 (fp32, before the
// bf16 rounding) and last row's shifted du columns, before the W_v / W_qk GEMMs. Saved and
// scratch are sized with the split's segments (0: no split); the scratch's attention workspace
// is attention::backward_workspace_bytes(B, T, ...): backward throws for a split needing more.
// Limits: head_dim 64 or 128 (the attention kernel), nkv d even, C <= 12288 (one token's C
// fp32 values sit in shared memory), conv widths <= causal_conv::kMaxWidth, the rope table's
// head_dim = d. Violations throw keel::Error before anything is launched.
// Precision vs the CPU op: qk0, c0, q, k, v, att, the grouped conv's weights and its incoming
// gradient are rounded to bf16 (the CPU keeps fp32), so outputs and gradients agree to bf16
// rounding (norm-relative ~1e-2), not to fp32; dtemp is reduced per token into scratch and
// summed in a fixed order (deterministic); the depthwise conv's weight gradients use atomics
// (fp32 rounding order varies).
// Launches only; no host sync. One GemmRunner per stream (gemm.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/cca.h"
#include "ops/cuda/common.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/rope.h"
#include "ops/cuda/sequence_split.h"

namespace keel::ops::cuda::cca {

using Config = ops::cca::Config;

struct Weights {
  const bf16* w_qk = nullptr;      // [C, H]
  const bf16* w_v = nullptr;       // [nkv d, H]
  const float* conv0_w = nullptr;  // [C, W0]
  const float* conv0_b = nullptr;  // [C]
  const float* conv1_w = nullptr;  // [C, d, W1]
  const float* conv1_b = nullptr;  // [C]
  const float* temp = nullptr;     // [nkv]
  const bf16* w_o = nullptr;       // [H, nq d] ([H, attend_q d] attending a part)
};

struct Grads {  // fp32, accumulated; null to skip
  float *w_qk = nullptr, *w_v = nullptr, *conv0_w = nullptr, *conv0_b = nullptr, *conv1_w = nullptr,
        *conv1_b = nullptr, *temp = nullptr, *w_o = nullptr;
};

struct Saved {
  bf16* qk0 = nullptr;    // [N, C]
  bf16* c0 = nullptr;     // [R, L + W1 - 1, C] (R = B*S runs of L = T/S; B, T without a split)
  float* qk = nullptr;    // [N, C]
  float* rnorm = nullptr; // [N, nq + nkv]
  bf16* q = nullptr;      // [N, nq d]
  bf16* k = nullptr;      // [N, nkv d]
  bf16* v = nullptr;      // [N, nkv d]
  bf16* att = nullptr;    // [N, na d] (na = Config::att_heads(); the rows hold max(na d, nkv d) bf16)
  float* lse = nullptr;   // [B, na, T]
  bf16* conv1_wt = nullptr; // [W1, C, d] the grouped conv's weights, tap-major bf16 (causal_conv.h)
  bf16* halo = nullptr;   // [B*S, F] each run's halo (carved only for segments > 0)
  // Config::attend_q > 0 (a part of the query heads attended): their columns of q and their kv
  // head's of k and v, [N, attend_q d], [N, d], [N, d]; null otherwise.
  bf16 *qa = nullptr, *ka = nullptr, *va = nullptr;
};

// segments: the split's segments(), 0 without a split (today's layout).
std::size_t saved_bytes(const Config& c, std::int64_t B, std::int64_t T, int segments = 0);
Saved carve_saved(const Config& c, std::int64_t B, std::int64_t T, void* buffer, int segments = 0);

// positions [N] int32 (device; see cuda/rope.h). y overwritten. s carved with the split's segments.
void forward(GemmRunner& gemm, const Config& c, std::int64_t B, std::int64_t T, const bf16* x,
             const std::int32_t* positions, const rope::DeviceTable& rope_table, const Weights& w, const Saved& s,
             bf16* y, cudaStream_t stream, SequenceSplit* split = nullptr);

// Device scratch of backward (256-byte aligned, contents ignored; includes the attention
// backward workspace), not to be shared while this call's work runs.
std::size_t backward_scratch_bytes(const Config& c, std::int64_t B, std::int64_t T, int segments = 0);
// dy [N, H] -> dx [N, H] (overwritten), grads (+=). Needs x, positions, w and s from forward,
// and the same split.
void backward(GemmRunner& gemm, const Config& c, std::int64_t B, std::int64_t T, const bf16* x,
              const std::int32_t* positions, const rope::DeviceTable& rope_table, const Weights& w, const Saved& s,
              const bf16* dy, bf16* dx, const Grads& g, void* scratch, cudaStream_t stream,
              SequenceSplit* split = nullptr);

}  // namespace keel::ops::cuda::cca
