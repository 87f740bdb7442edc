// Causal linear attention on the GPU: the CUDA twin of ops/linear_attention.h (same math, same
// layouts, same gradient conventions; read that header first). For kv head g with decay gamma_g
// (1: none) the state and the output of token s of a run are
//   M_s = gamma_g M_{s-1} + k_s^T v_s,   o_s = q_s M_s      (M_{-1} = the run's initial state)
// i.e. o_s = sum_{i<=s} gamma^(s-i) (q_s . k_i) v_i + gamma^(s+1) q_s M_{-1}; query head h reads
// kv head h / (Hq / Hkv). No softmax, no 1/sqrt(d) scale.
//
// Shapes and dtypes (R runs of L consecutive tokens, rows r * L + t):
//   q, out, dout, dq         [R * L, Hq * d]   bf16
//   k, v, dk, dv             [R * L, Hkv * d]  bf16
//   init, dinit, dlocal,
//   states (local_states)    [R, Hkv, d, d]    fp32 (row a, column b: M[a][b] multiplies q[a] into o[b])
//   step's state             [B, Hkv, d, d]    fp32, advanced in place
//   norm rstd                [M]               fp32
// The Config is the CPU op's; its decay vector (host memory) reaches the kernels by value.
// Supported: 1 <= head_dim <= 128 (tensor-core kernels at padded widths 16/32/64/128; 16, 32, 64
// and 128 themselves with 16-byte-aligned pointers take the vectorized loads, anything else
// element-wise loads), heads % kv_heads == 0, 1 <= kv_heads <= kMaxKvHeads, runs * kv_heads <=
// 65535, decays finite and >= 0, chunk >= 1 (as the CPU op; see below), any len >= 0 (0 runs
// nothing but zeroing dinit / states). Anything else throws keel::Error before launching.
//
// Chunked form. The kernels use their own chunk of kChunk = 64 tokens whatever Config::chunk
// says (the result does not depend on the chunk beyond rounding, exactly as the CPU op's):
//   1. scan: S_{c+1} = gamma^n S_c + K~_c^T V_c on tensor cores (K~ row j = gamma^(n-1-j) k_j,
//      n the chunk's tokens), fp32 tiles in registers, A and B tiles through cp.async stages; it
//      stores S_c, the state BEFORE chunk c, in bf16 ([R, Hkv, chunks, d, d] in the workspace).
//      Long runs scan in segments of `seg` chunks (4..32, aiming at ~1024 blocks of R * Hkv *
//      segments), in three launches: (a) every segment's own sum from zeros, in parallel (a block
//      per segment, run and kv head holding the whole padded state), fp32 to the workspace;
//      (b) each segment's starting state from those sums, sequential over the segments only
//      (x_s = x; x = gamma^(len_s) x + M_s; elementwise, in place); (c) every segment again from
//      its starting state, storing its chunks' S_c. A run that is one segment takes the single
//      scan: one block per (run, kv head, 32x32 tile of the state; 16x16 for d < 32) walking all
//      its chunks.
//   2. output: one block per (run, kv head, chunk), all query heads of the group in turn:
//        O = diag(gamma^(i+1)) Q S_c + (mask(Q K^T) * gamma^(i-j)) V     (i, j in the chunk)
//      with the mask exact (j <= i; entries above the diagonal are exact zeros, key tiles wholly
//      above it skipped), bf16 MMAs with fp32 accumulation, out rounded to bf16 once.
// Backward recomputes the S_c (scan 1), then runs scan 1 in reverse over the chunks with
// A = Q~ (row i = gamma^(i+1) q_i, all query heads of the group) and B = dout: G_c, the gradient
// of the state AFTER chunk c (G_last = 0, G_{c-1} = gamma^n G_c + sum_h Q~_c^T dO_c, dinit =
// G_{-1} in fp32), stored with dlocal's path added, Gk_c = G_c + gamma^(L - t1_c) dlocal, in bf16
// (the segmented scan starts from dlocal at the run's end: the same recurrence). dinit always
// comes from the single reverse scan without states (init_gradient's code): in the same pass as
// Gk_c where that is the single scan, a pass of its own (only when dinit is asked for) where the
// Gk_c are segmented.
// Then one block per (run, kv head, chunk):
//   dQ = diag(gamma^(i+1)) dO S_c^T + dP~ K,          dP~ = mask(dO V^T) * gamma^(i-j)
//   dK = diag(gamma^(n-1-j)) V Gk_c^T + sum_h dP~^T Q,  P~ = mask(Q K^T) * gamma^(i-j)
//   dV = diag(gamma^(n-1-j)) K Gk_c + sum_h P~^T dO
// so dk, dv of a kv head are summed over its query heads inside one block: no atomics, the
// results are deterministic (bit for bit run to run).
// Precision: inputs are bf16 and every sum is fp32; the MMA operands that are not inputs are
// rounded to bf16 first: the stored states S_c and Gk_c, the masked (d)P~ tiles, and the decayed
// K~ / Q~ rows of the scans (a decay of 1 leaves k and q exact). Outputs agree with the CPU op
// (fp32 on the same bf16-rounded inputs) to bf16 rounding: norm-relative ~1e-2, not fp32.
// dinit and local_states' states come from the fp32 registers of the single scan.
//
// Gradients (docs/ops.md): dq, dk, dv, dinit are OVERWRITTEN; dlocal's path is added into dk, dv
// but does not reach dinit (local_states starts from zeros). Any of init, dlocal, dinit may be
// null (zeros / none / skipped).
//
// Every call only enqueues work on `stream` (no host synchronization). Every pointer is a device
// pointer; the workspace must be 256-byte aligned and not shared with other work in flight.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/cuda/common.h"
#include "ops/linear_attention.h"

namespace keel::ops::cuda::linear_attention {

using Config = ops::linear_attention::Config;
using Feature = ops::linear_attention::Feature;

constexpr int kMaxKvHeads = 64;   // gammas travel to the kernels by value
constexpr int kMaxHeadDim = 128;  // the widest padded tile
constexpr int kChunk = 64;        // the kernels' own chunk (tokens)

// Bytes of device scratch forward and backward need: the bf16 per-chunk states S_c and Gk_c,
// [R, Hkv, ceil(L / kChunk), d, d] each, then (runs of more than 4 chunks) room for the segmented
// scan's fp32 buffer [R, Hkv, segments, d, d] (about 1 / seg of the two states'), 256-byte
// aligned regions; forward uses the first and the last. Never decreases as runs or len grow.
// Throws on unsupported extents.
std::size_t workspace_bytes(const Config& c, std::int64_t runs, std::int64_t len);

// out overwritten with the outputs of R runs of L tokens from init (null: zeros).
void forward(const Config& c, std::int64_t runs, std::int64_t len, const bf16* q, const bf16* k, const bf16* v,
             const float* init, bf16* out, void* workspace, cudaStream_t stream);

// The gradients of forward's out (dout) and of local_states' states (dlocal, null: none).
// dq, dk, dv overwritten with both paths summed; dinit (null: skipped) overwritten with the
// gradient of each run's initial state (dout's path only). init as forward's.
void backward(const Config& c, std::int64_t runs, std::int64_t len, const bf16* q, const bf16* k, const bf16* v,
              const float* init, const bf16* dout, const float* dlocal, bf16* dq, bf16* dk, bf16* dv, float* dinit,
              void* workspace, cudaStream_t stream);

// The gradient of each run's initial state through its outputs alone, dinit [R, Hkv, d, d] fp32 =
// sum_t gamma^(t+1) q_t^T dout_t (summed over the group's query heads), overwritten: backward's
// dinit bit for bit (the same reverse scan), without the rest of backward (LASP-2 gathers it
// first). Needs no workspace (the single scan, sequential over the chunks).
void init_gradient(const Config& c, std::int64_t runs, std::int64_t len, const bf16* q, const bf16* dout, float* dinit,
                   cudaStream_t stream);

// Each run's own end state from a zero start, M_run = sum_i gamma^(L-1-i) k_i^T v_i, fp32
// [R, Hkv, d, d], overwritten. Needs no workspace (the single scan, sequential over the chunks).
void local_states(const Config& c, std::int64_t runs, std::int64_t len, const bf16* k, const bf16* v, float* states,
                  cudaStream_t stream);

// Decode: one token of each of B sequences, q [B, Hq * d], k, v [B, Hkv * d] bf16; state
// [B, Hkv, d, d] fp32 advanced in place (M = gamma M + k^T v), then out [B, Hq * d] bf16 = q M.
void step(const Config& c, std::int64_t B, const bf16* q, const bf16* k, const bf16* v, float* state, bf16* out,
          cudaStream_t stream);

// The feature map over n elements: y = phi(x) (identity, or elu(x) + 1); y may alias x.
// Backward from the saved output: dx = dy * phi'(x), phi' = 1 (identity), or for elu1 1 where
// y > 1 and y elsewhere; dx overwritten, may alias dy.
void feature_forward(Feature f, const bf16* x, bf16* y, std::int64_t n, cudaStream_t stream);
void feature_backward(Feature f, const bf16* y, const bf16* dy, bf16* dx, std::int64_t n, cudaStream_t stream);

// Rows [M, d] normalized to unit RMS, no learned scale: rstd [M] = 1 / sqrt(mean(x^2) + eps)
// (fp32, from the bf16 x), y = x * rstd (bf16; may alias x). Backward from y and rstd:
// dx = rstd * (dy - y * mean(dy * y)), bf16, overwritten (may alias dy).
void norm_forward(const bf16* x, std::int64_t M, int d, float eps, bf16* y, float* rstd, cudaStream_t stream);
void norm_backward(const bf16* y, const float* rstd, const bf16* dy, bf16* dx, std::int64_t M, int d,
                   cudaStream_t stream);

}  // namespace keel::ops::cuda::linear_attention
