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
//
// forward_at/backward_at (context parallelism: this rank's query rows, the whole sequence's
// gathered keys): q, out, dq, dout [B, Tq, Hq, Dh] and lse [B, Hq, Tq]; k, v, dk, dv
// [B, Tk, Hkv, Dh] hold keys 0..Tk-1. Query row t sits at position q_pos[t] (0 <= q_pos[t] < Tk,
// any order, repeats allowed) and attends to keys first_key(q_pos[t], W)..q_pos[t]. dk, dv are
// this rank's partial sums (zero at keys none of its queries attends): summed over the ranks
// they are the full backward's dk, dv. forward/backward are the same code with Tq = Tk and
// q_pos[t] = t, bit for bit.
#pragma once

#include <cstdint>

#include "tensor/tensor.h"

namespace keel::ops::attention {

// window: 0 = full causal attention, W > 0 = the last W tokens (above).
void forward(const Tensor& q, const Tensor& k, const Tensor& v, float scale, const Tensor& out, const Tensor& lse,
             int window = 0);

void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& dout,
              float scale, const Tensor& dq, const Tensor& dk, const Tensor& dv, int window = 0);

// Queries at positions q_pos[0..Tq) (non-null, each in [0, Tk)) over the Tk keys of k, v (above).
// With Tq == Tk and q_pos[t] == t these are forward()/backward() exactly.
void forward_at(const Tensor& q, const Tensor& k, const Tensor& v, const std::int32_t* q_pos, float scale,
                const Tensor& out, const Tensor& lse, int window = 0);

// dq [B, Tq, Hq, Dh] and dk, dv [B, Tk, Hkv, Dh] are overwritten.
void backward_at(const Tensor& q, const Tensor& k, const Tensor& v, const std::int32_t* q_pos, const Tensor& out,
                 const Tensor& lse, const Tensor& dout, float scale, const Tensor& dq, const Tensor& dk,
                 const Tensor& dv, int window = 0);

// The first key query token t attends to: 0, or t - W + 1 with a window W > 0.
inline std::int64_t first_key(std::int64_t t, int window) { return window > 0 && t >= window ? t - window + 1 : 0; }

// One block of keys at explicit positions (ring context parallelism: one rank's keys at a time).
// q, out, dout, dq [B, Tq, Hq, Dh] with query row i at q_pos[i]; k, v, dk, dv [B, Tk, Hkv, Dh]
// with key row j at k_pos[j] (any positions, any order). Query i sees key j iff
// first_key(q_pos[i], W) <= k_pos[j] <= q_pos[i].
//   forward_block: this block's out and lse [B, Hq, Tq] (a row that sees no key of the block:
//     out 0, lse -inf).
//   merge: folds a block's (out, lse) into a running (out, lse) (log-sum-exp weights); a row of
//     lse -inf on either side takes the other. After every block of the sequence has been
//     merged, out and lse are forward's.
//   backward_block: with the final out and lse, this block's share of the gradients: added into
//     dq; dk, dv of the block's keys overwritten. Summed over the blocks, backward's.
void forward_block(const Tensor& q, const Tensor& k, const Tensor& v, const std::int32_t* q_pos,
                   const std::int32_t* k_pos, float scale, const Tensor& out, const Tensor& lse, int window = 0);
void merge(const Tensor& block_out, const Tensor& block_lse, const Tensor& out, const Tensor& lse);
void backward_block(const Tensor& q, const Tensor& k, const Tensor& v, const std::int32_t* q_pos,
                    const std::int32_t* k_pos, const Tensor& out, const Tensor& lse, const Tensor& dout, float scale,
                    const Tensor& dq, const Tensor& dk, const Tensor& dv, int window = 0);

}  // namespace keel::ops::attention
