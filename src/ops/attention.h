// Causal grouped-query softmax attention (GQA; MHA when kv_heads == heads, MQA when 1).
//
// Shapes (B sequences of T tokens, the [N = B*T, heads * head_dim] output of a projection seen
// as 4-D): q, out [B, T, Hq, Dh]; k, v [B, T, Hkv, Dh]; Hq % Hkv == 0 and query head h reads
// kv head h / (Hq / Hkv) (consecutive query heads share a kv head, as in HF repeat_kv).
// Token t attends to tokens 0..t of its own sequence, or with a sliding window W > 0 to the
// last W of them, t - W < j <= t (itself included: Hugging Face's sliding-window causal mask;
// W >= T is full causal attention). scores = scale * q.k (pass scale = 1/sqrt(Dh) for the
// usual attention).
//
// Flash-style bookkeeping: forward saves only out and lse [B, Hq, T] (the log-sum-exp of each
// query row's scaled scores); backward recomputes p_ij = exp(s_ij - lse_i) instead of storing
// the [T, T] probabilities. With D_i = dout_i . out_i:
//   ds_ij = p_ij (dout_i . v_j - D_i),  dq_i = scale sum_j ds_ij k_j,
//   dk_j  = scale sum_i ds_ij q_i,       dv_j = sum_i p_ij dout_i.
// Backward needs q, k, v, out, lse and forward's window. dq, dk, dv are overwritten.
// The CPU forward processes one query row at a time (O(T) scratch per thread).
#pragma once

#include "tensor/tensor.h"

namespace keel::ops::attention {

// window: 0 = full causal attention, W > 0 = the last W tokens (above).
void forward(const Tensor& q, const Tensor& k, const Tensor& v, float scale, const Tensor& out, const Tensor& lse,
             int window = 0);

void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& dout,
              float scale, const Tensor& dq, const Tensor& dk, const Tensor& dv, int window = 0);

// The first key query token t attends to: 0, or t - W + 1 with a window W > 0.
inline std::int64_t first_key(std::int64_t t, int window) { return window > 0 && t >= window ? t - window + 1 : 0; }

}  // namespace keel::ops::attention
