// Top-k MoE router on the GPU: the CUDA twin of ops/router.h (same math, same tie rule, same
// gradient), on precomputed fp32 router logits (the router linear writes fp32 so the softmax
// and the selection see full-precision scores).
//
// Forward, per token n, all fp32:
//   lse_n = logsumexp(logits[n]), p = exp(logits[n] - lse_n)               (probs, saved)
//   selection: the top_k experts by p_e + bias_e, best first; equal scores go to the lower
//     expert index (the CPU rule, so both pick the same experts). The bias only selects.
//   gates[n, k] = p[e_k], or p[e_k] / sum_k' p[e_k'] with renormalize.
//   counts[e] = slots routed to e (int32, built with atomics; integer sums, so exact).
// Forced balance (forced_classes F > 0; benchmarking only): the CPU rule, scores and bias
//   ignored: slot j of token n takes class (n * top_k + j) mod F (top_k <= F <= E required);
//   gates, counts, losses and backward as above on that selection.
// Losses, written to the device (no host sync; read_losses syncs):
//   losses[0] = aux = E * sum_e f_e P_e, f_e = counts[e] / (N top_k), P_e = mean_n p[n, e]
//   losses[1] = z   = mean_n lse_n^2
//   losses[2 + e] = P_e (kept: the aux loss needs it, and it is a useful load statistic)
// Both reductions run in a fixed order (no float atomics), so they are deterministic.
//
// Backward (the CPU formula): dlogits = p * (dp - sum_e p dp) + d_z * 2 lse_n p / N with
//   dp[e] = d_aux * E * f_e / N  +  gate terms: dgates[n, k] into p[e_k]; with renormalize,
//   dp[e_j] += (dgates_j - sum_k dgates_k gates_k) / sum_k p[e_k].
//
// Shapes and dtypes: logits, probs, dlogits [N, E] fp32; bias [E] fp32 or null; lse [N] fp32;
// expert_idx [N * top_k] int32 (row-major [N, top_k]); gates, dgates [N, top_k] fp32;
// counts [E] int32 (the CPU op uses int64: N * top_k < 2^31 here); losses [loss_floats(E)].
// Saved for backward: probs, lse, expert_idx, gates, counts. Every output of forward and
// dlogits are overwritten. One warp per token; any E >= 1; top_k in [1, min(E, kMaxTopK)].
#pragma once

#include <cstdint>

#include "ops/cuda/common.h"

namespace keel::ops::cuda::router {

inline constexpr int kMaxTopK = 16;

struct Options {
  int top_k = 1;
  bool renormalize = false;  // gates renormalized over the chosen top_k
  int forced_classes = 0;    // > 0: forced-balance selection over classes [0, forced_classes)
};

struct Losses {
  float aux = 0.f;  // Switch load-balancing loss (unweighted)
  float z = 0.f;    // router z-loss (unweighted)
};

// Floats of the device `losses` buffer: aux, z, then P_e for every expert.
inline std::int64_t loss_floats(std::int64_t experts) { return 2 + experts; }

// tokens may be 0 (then counts and losses are zeros). Throws keel::Error on a bad top_k or
// expert count. Launches on `stream`; no host sync.
void forward(const float* logits, const float* bias, std::int64_t tokens, int experts, const Options& o, float* probs,
             float* lse, std::int32_t* expert_idx, float* gates, std::int32_t* counts, float* losses,
             cudaStream_t stream);

// dgates may be null (only the aux and z terms then). d_aux, d_z: the losses' weights times the
// upstream loss gradient. dlogits is overwritten.
void backward(const float* probs, const float* lse, const std::int32_t* expert_idx, const float* gates,
              const std::int32_t* counts, std::int64_t tokens, int experts, const Options& o, const float* dgates,
              float d_aux, float d_z, float* dlogits, cudaStream_t stream);

// Copies losses[0..1] to the host. SYNCHRONIZES `stream` (for logging, not the hot path).
Losses read_losses(const float* losses, cudaStream_t stream);

}  // namespace keel::ops::cuda::router
