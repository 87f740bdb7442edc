// Causal linear attention (LASP-2's setting, arXiv 2502.07563), optionally with a per-head scalar
// decay (RetNet / Lightning Attention), in chunked form. For kv head g with decay gamma_g (1: none)
// the memory state and the output of token s are
//   M_s = gamma_g M_{s-1} + k_s^T v_s   (d x d; M_{-1} = the run's initial state, zeros by default)
//   o_s = q_s M_s                       (query head h reads kv head h / (Hq / Hkv), as attention.h)
// i.e. o_s = sum_{i<=s} gamma^(s-i) (q_s . k_i) v_i + gamma^(s+1) q_s M_{-1}: the token sees itself
// and every earlier token of its run, never a later one. q and k are the feature-mapped ones
// (feature_forward below); there is no softmax and no 1/sqrt(d) scale (the layer normalizes each
// head's output instead: norm_forward).
//
// Chunked form (`chunk` tokens, config key linear_chunk): within a chunk the masked, decayed
// (Q K^T) V; across chunks the running state, so the work is O(T chunk d + T d^2), not O(T^2 d).
// The result does not depend on `chunk` beyond rounding.
//
// Layout: R runs of L consecutive tokens (ops/sequence_split.h: B sequences x segments runs),
// q, out [R * L, Hq * d]; k, v [R * L, Hkv * d]; states [R, Hkv, d, d] (row a, column b: M[a][b]
// multiplies q[a] into o[b]). A run's initial state carries what the tokens before it left (LASP-2:
// the prefix of the other ranks' chunk states); whole sequences start from zeros.
//
// Gradients (docs/ops.md): backward OVERWRITES dq, dk, dv and dinit.
// The CUDA twin is ops/cuda/linear_attention.h.
#pragma once

#include <cstdint>
#include <vector>

#include "tensor/tensor.h"

namespace keel::ops::linear_attention {

enum class Feature { kIdentity, kElu1 };  // phi(x) = x, or elu(x) + 1 (positive features)
Feature parse_feature(const std::string& s);  // "identity" / "elu1"; UsageError naming the word otherwise
const char* feature_name(Feature f);

struct Config {
  int heads = 0, kv_heads = 0, head_dim = 0;
  int chunk = 64;
  // gamma per kv head [kv_heads]; empty: no decay (gamma = 1).
  std::vector<float> decay;
  float gamma(int g) const { return decay.empty() ? 1.0f : decay[static_cast<std::size_t>(g)]; }
};

// RetNet's per-head decay, gamma_g = 1 - 2^(-5 - g), for kv heads first..first+count-1 of the model.
std::vector<float> retnet_decay(int first, int count);

// Outputs of R runs of L tokens from their initial states (empty: zeros). out is overwritten.
void forward(const Config& c, std::int64_t runs, std::int64_t len, const Tensor& q, const Tensor& k, const Tensor& v,
             const Tensor& init, const Tensor& out);

// Each run's own state at its end from a zero start: M_run = sum_i gamma^(L-1-i) k_i^T v_i
// [R, Hkv, d, d], overwritten. A run that starts from S ends at gamma^L S + M_run. (LASP-2
// gathers these: the initial state of a later run is a decayed sum of earlier runs' M_run.)
void local_states(const Config& c, std::int64_t runs, std::int64_t len, const Tensor& k, const Tensor& v,
                  const Tensor& states);

// The gradients of forward's outputs (dout) and, optionally, of local_states' (dlocal
// [R, Hkv, d, d]; empty: none): dq, dk, dv overwritten with both paths summed; dinit
// [R, Hkv, d, d] (each run's initial state; dlocal does not reach it) overwritten, or empty to
// skip. init as forward's (empty: zeros).
void backward(const Config& c, std::int64_t runs, std::int64_t len, const Tensor& q, const Tensor& k, const Tensor& v,
              const Tensor& init, const Tensor& dout, const Tensor& dlocal, const Tensor& dq, const Tensor& dk,
              const Tensor& dv, const Tensor& dinit);

// The gradient of each run's initial state through its outputs alone, dinit [R, Hkv, d, d] =
// sum_t gamma^(t+1) q_t^T dout_t (summed over the group's query heads), overwritten: what
// backward's dinit holds, without the rest of backward (LASP-2 gathers it first).
void init_gradient(const Config& c, std::int64_t runs, std::int64_t len, const Tensor& q, const Tensor& dout,
                   const Tensor& dinit);

// Decode: one new token of each of B sequences, q [B, Hq * d], k, v [B, Hkv * d]; state
// [B, Hkv, d, d] advanced in place (M = gamma M + k^T v), then out [B, Hq * d] = q M.
void step(const Config& c, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& state, const Tensor& out);

// The feature map, elementwise: y = phi(x) (y may alias x). Backward from the saved output:
// dx = dy * phi'(x), with phi'(x) = 1 (identity), or for elu1 1 where y > 1 and y elsewhere;
// dx overwritten (may alias dy).
void feature_forward(Feature f, const Tensor& x, const Tensor& y);
void feature_backward(Feature f, const Tensor& y, const Tensor& dy, const Tensor& dx);

// Each head's output normalized to unit RMS, no learned scale: rows [M, d] (M = tokens x heads),
// y = x * rstd, rstd [M] = 1 / sqrt(mean(x^2) + eps). Backward from y and rstd:
// dx = rstd * (dy - y * mean(dy * y)), overwritten.
void norm_forward(const Tensor& x, float eps, const Tensor& y, const Tensor& rstd);
void norm_backward(const Tensor& y, const Tensor& rstd, const Tensor& dy, const Tensor& dx);

}  // namespace keel::ops::linear_attention
