// Top-k MoE router on precomputed router logits (the router's linear layer or MLP is separate).
//
// Forward, per token n (all in fp32):
//   p = softmax(logits[n])                                           (probs, saved)
//   selection: the top_k experts by p_e + bias_e, best first; ties go to the lower expert
//     index. The bias (aux-loss-free balancing, DeepSeek-V3 / ZAYA1) only changes WHICH
//     experts are chosen: it never enters a gate or a gradient.
//   gates[n, k] = p[e_k] (the unbiased probability), or p[e_k] / sum_k' p[e_k'] with renormalize.
//   counts[e] = tokens routed to e (summed over the k slots): the bias controller's input.
// Forced balance (forced_classes F > 0; benchmarking only, as Megatron's forced load balancing):
//   the selection ignores p and the bias: slot j of token n takes class (n * top_k + j) mod F
//   (distinct classes per token: top_k <= F <= E is required). Gates, counts, losses and
//   backward are the normal ones on that selection (gates[n, k] = p[e_k], renormalized or not).
//   With N * top_k a multiple of F every class < F gets exactly N * top_k / F slots.
// Losses (returned; the caller weights them and passes the weights back as d_aux, d_z):
//   aux = E * sum_e f_e * P_e (Switch Transformer), f_e = counts[e] / (N * top_k) (fraction
//     of routed slots, not differentiable), P_e = mean_n p[n, e]; 1.0 at perfect balance.
//   z   = mean_n lse_n^2, lse_n = logsumexp(logits[n]) (ST-MoE router z-loss).
// Backward: dlogits = softmax_backward(dp) + d_z * 2 lse_n p / N, where
//   dp[e] = d_aux * E * f_e / N  +  gate terms: dgates[n,k] into p[e_k]; with renormalize,
//   dp[e_j] += (dgates_j - sum_k dgates_k gates_k) / sum_k p[e_k].
// The selection is piecewise constant, so it has no gradient (gradient checks keep inputs
// away from ties).
//
// Shapes: logits, probs, dlogits [N, E]; bias [E] or empty; lse [N]; expert_idx [N * top_k]
// int32 (row-major [N, top_k]); gates, dgates [N, top_k]; counts [E] int64.
// Backward needs probs, lse, expert_idx, gates and counts. dlogits is overwritten.
#pragma once

#include <cstdint>

#include "tensor/tensor.h"

namespace keel::ops::router {

struct Options {
  int top_k = 1;
  bool renormalize = false;  // gates renormalized over the chosen top_k
  int forced_classes = 0;    // > 0: forced-balance selection over classes [0, forced_classes)
};

struct Losses {
  float aux = 0.f;  // Switch load-balancing loss (unweighted)
  float z = 0.f;    // router z-loss (unweighted)
};

Losses forward(const Tensor& logits, const Tensor& bias, const Options& o, const Tensor& probs, const Tensor& lse,
               std::int32_t* expert_idx, const Tensor& gates, std::int64_t* counts);

// count_rows: the tokens `counts` were taken over (0: this call's N; see aux_loss).
void backward(const Tensor& probs, const Tensor& lse, const std::int32_t* expert_idx, const Tensor& gates,
              const std::int64_t* counts, const Options& o, const Tensor& dgates, float d_aux, float d_z,
              const Tensor& dlogits, std::int64_t count_rows = 0);

// The aux loss with f_e from counts over count_rows tokens (f_e = counts[e] / (count_rows *
// top_k)) and P_e this call's mean: forward's with counts and N. Under context parallelism a
// rank passes the micro-batch's counts (summed over the ranks sharing its sequences): the mean
// of the ranks' values is then the micro-batch's aux loss, and backward with the same counts and
// count_rows its gradient (times the number of ranks).
float aux_loss(const Tensor& probs, const std::int64_t* counts, std::int64_t count_rows, int top_k);

}  // namespace keel::ops::router
