// ZAYA1's CCA block (compressed convolutional attention, GQA variant), composed from keel ops.
// Source: Zyphra transformers fork, modeling_zaya.py classes `CCA` (q/k/v) and `ZayaAttention`
// (RoPE, attention, o_proj); docs/zaya1_ops.md has the derivation and the choices made.
//
// Per sequence of T tokens (B sequences, N = B*T, token b*T + t), x [N, H] (the RMSNorm'd
// residual). nq query heads, nkv kv heads, head dim d, G = nq / nkv, C = (nq + nkv) d:
//   qk0 = x W_qk^T                    [N, C]  (W_qk = [linear_q.weight; linear_k.weight], no bias)
//   conv = grouped(depthwise(qk0))    [N, C]  (causal_conv: W0, W1 taps, biases; per sequence,
//                                              exactly the reference's single left padding)
//   mixing (pre-conv skip terms), per q head h with kv head g = h / G:
//     m_q[h] = (qk0_q[h] + qk0_k[g]) / 2;   m_k[g] = mean_{h in g} m_q[h]
//   a_q = conv_q + m_q,  a_k = conv_k + m_k                                    (saved: qk)
//   q[h] = sqrt(d) a_q[h] / ||a_q[h]||;  k[g] = temp[g] sqrt(d) a_k[g] / ||a_k[g]||
//     (norm = sqrt(sum a^2 + l2_eps); the reference has no eps: l2_eps = 0 by default)
//   q, k <- RoPE (the rope::Table given: ZAYA1 rotates the first 64 of 128 dims, rotate-half)
//   v = [x_t W_v1^T | x_{t-1} W_v2^T]  [N, nkv d]  (W_v = [val_proj1.weight; val_proj2.weight];
//     x_{-1} = 0: the first token of each sequence sees a zero previous hidden state, as the
//     reference's F.pad(hs[:-1]) does. Computed as u = x W_v^T, then the second half of u
//     shifted one token later within each sequence: linear maps commute with the shift.)
//   att = causal GQA softmax attention(q, k, v), scale 1/sqrt(d)       [N, nq d]
//     (with Config::window W > 0 token t attends to tokens t - W < j <= t only: a sliding
//     layer; the convolutions and the value shift are unchanged)
//   y = att W_o^T                                                       [N, H]
//   (Config::attend_q > 0: att holds only query heads [attend_q0, attend_q0 + attend_q), all
//   in one kv group, and W_o their columns; every step before the attention is whole.)
// Positions are per token (rope); the conv and the value shift restart per sequence (of T, or of
// a split's runs joined by their halos, below), not at document boundaries inside a packed
// sequence (neither does the reference).
//
// Sequence split (ops/sequence_split.h; null: whole sequences, as above). With S = segments()
// the op sees x as B*S runs of L = T/S tokens (T: this rank's tokens per sequence; T % S == 0,
// L >= hh = (W0-1) + (W1-1)). Each run gives the run after it its tail, halo_floats floats: its
// last hh rows of qk0, then its last row's value-shift columns of u; split->halo returns each
// run's halo (saved), which the depthwise conv reads as the times before the run and the value
// shift as the previous token of the run's first. Attention goes through split->attend. Backward
// sends the halos' gradients back through ONE split->halo_backward, added into the runs' tails
// before the W_v and W_qk backward. Positions stay per row (each row's global position).
//
// Gradients: dx overwritten; parameter gradients accumulated (+=); any may be empty.
#pragma once

#include <cstdint>

#include "ops/rope.h"
#include "ops/sequence_split.h"
#include "tensor/tensor.h"

namespace keel::ops::cca {

struct Config {
  std::int64_t hidden = 2048;
  std::int64_t q_heads = 8, kv_heads = 2, head_dim = 128;
  int conv0_width = 2, conv1_width = 2;  // cca_time0, cca_time1
  float l2_eps = 0.f;                     // added to the squared norm; 0 = the reference
  // The value columns [v_shift_begin, v_shift_end) that hold the previous token's projection
  // (val_proj2); -1: the second half, [nkv d / 2, nkv d). A tensor-parallel rank holding some of
  // the value heads gives its own range (blocks::cca_config).
  std::int64_t v_shift_begin = -1, v_shift_end = -1;
  int window = 0;  // the attention's sliding window (ops/attention.h); 0: full causal
  // The query heads the attention and the output projection take: [attend_q0, attend_q0 +
  // attend_q) of q_heads, inside one kv group (they read its kv head); 0: all of them. Tensor
  // parallelism over more ranks than kv heads (blocks::cca_config) computes the projections,
  // convolutions and mixing of every head on every rank (the k mixing averages a group's query
  // heads) and attends only the rank's own query heads; W_o is then [H, attend_q d].
  std::int64_t attend_q0 = 0, attend_q = 0;
  bool attends_part() const { return attend_q > 0 && attend_q < q_heads; }
  std::int64_t att_heads() const { return attends_part() ? attend_q : q_heads; }
  std::int64_t att_kv_heads() const { return attends_part() ? 1 : kv_heads; }
  std::int64_t att_kv0() const { return attends_part() ? attend_q0 / (q_heads / kv_heads) : 0; }
  std::int64_t qk_channels() const { return (q_heads + kv_heads) * head_dim; }
  std::int64_t shift_begin() const { return v_shift_begin < 0 ? kv_heads * head_dim / 2 : v_shift_begin; }
  std::int64_t shift_end() const { return v_shift_end < 0 ? kv_heads * head_dim : v_shift_end; }
};

struct Params {
  Tensor w_qk;     // [C, H]
  Tensor w_v;      // [nkv d, H]
  Tensor conv0_w;  // [C, W0]     depthwise (nn.Conv1d weight [C, 1, W0])
  Tensor conv0_b;  // [C]
  Tensor conv1_w;  // [C, d, W1]  grouped, one group per head
  Tensor conv1_b;  // [C]
  Tensor temp;     // [nkv]       per-kv-head temperature on k (HF init 0, Primus 1)
  Tensor w_o;      // [H, nq d] ([H, attend_q d] when attending a part)
};

// What forward saves for backward (caller-allocated; saved_floats / carve_saved, given the
// split's segments S, 0 without a split; R = B*S runs of L = T/S tokens, R = B and L = T without):
struct Saved {
  Tensor qk0;    // [N, C] pre-conv projections (conv input, mixing terms)
  Tensor c0;     // [R, L + W1 - 1, C] depthwise output (grouped conv input)
  Tensor qk;     // [N, C] conv output + mixing terms, before the L2 normalization
  Tensor rnorm;  // [N, nq + nkv] 1 / norm per head (q heads first)
  Tensor q;      // [N, nq d] attention query (normalized, scaled, rotated)
  Tensor k;      // [N, nkv d] attention key (normalized, temperature, rotated)
  Tensor v;      // [N, nkv d] values (current | previous token)
  Tensor att;    // [N, na d] attention output (na = att_heads(): nq, or attend_q)
  Tensor lse;    // [B, na, T] attention log-sum-exp
  Tensor halo;   // [R, halo_floats] each run's halo (split only; empty for segments 0)
  // Attending a part: the attended query heads' columns of q, and their kv head's of k and v
  // ([N, attend_q d], [N, d], [N, d]); empty otherwise.
  Tensor qa, ka, va;
};

// Floats a run gives the next one: (W0-1 + W1-1) qk0 rows of C, plus the value-shift columns.
std::int64_t halo_floats(const Config& c);
std::int64_t saved_floats(const Config& c, std::int64_t B, std::int64_t T, int segments = 0);
Saved carve_saved(const Config& c, std::int64_t B, std::int64_t T, float* p, int segments = 0);

// x [N, H] with N = B*T; positions [N] (rope positions); y [N, H]. s carved with the split's
// segments (0 when split is null).
void forward(const Config& c, std::int64_t B, std::int64_t T, const Tensor& x, const std::int32_t* positions,
             const rope::Table& rope_table, const Params& p, const Saved& s, const Tensor& y,
             SequenceSplit* split = nullptr);

std::int64_t backward_scratch_floats(const Config& c, std::int64_t B, std::int64_t T, int segments = 0);
// dy [N, H] -> dx [N, H] (overwritten), grads (+=). Needs x, positions, p and s from forward,
// and the same split.
void backward(const Config& c, std::int64_t B, std::int64_t T, const Tensor& x, const std::int32_t* positions,
              const rope::Table& rope_table, const Params& p, const Saved& s, const Tensor& dy, const Tensor& dx,
              const Params& grads, const Tensor& scratch, SequenceSplit* split = nullptr);

}  // namespace keel::ops::cca
