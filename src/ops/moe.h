// Dropless MoE: dispatch tokens to their routed experts, run every expert's SwiGLU MLP as one
// GEMM block over its tokens, and combine the outputs weighted by the router gates.
//
// Dispatch plan (make_plan): the N * top_k routed slots (token n, choice k), flattened as
// a = n * top_k + k, are counting-sorted by expert, stable in a, so expert e's tokens form the
// contiguous block [offsets[e], offsets[e + 1]) of the sorted order. Nothing is dropped: a
// block is as long as the expert's load (possibly 0), unlike capacity-factor MoE.
//
// Per expert e (nn.Linear convention, weights [out, in]) on its block xs_e = x[tokens of e]:
//   h_gate = xs_e W_gate[e]^T, h_up = xs_e W_up[e]^T      [cnt, F]
//   act    = silu(h_gate) * h_up                         [cnt, F]
//   ys_e   = act W_down[e]^T                             [cnt, D]
// Combine: y[n] = sum_k gates[n, k] * ys[position[n * top_k + k]].
//
// Shapes: x, y, dx [N, D]; gates, dgates [N, top_k]; W_gate, W_up [E, F, D]; W_down [E, D, F].
// Saved (caller-allocated, filled by forward, read by backward): xs [S, D], h_gate, h_up,
// act [S, F], ys [S, D] with S = N * top_k. Backward also takes scratch of
// backward_scratch_floats(S, D, F) floats. dx, dgates are overwritten; weight gradients are
// accumulated (+=); an expert with no tokens adds nothing.
// Backward: dgates[n, k] = dy[n] . ys[slot]; dys[slot] = gates[n, k] dy[n]; then per expert
// the SwiGLU MLP backward (dW_down += dys^T act, dact = dys W_down, swiglu backward,
// dW_gate += dh_gate^T xs, dW_up += dh_up^T xs, dxs = dh_gate W_gate + dh_up W_up);
// dx[n] = sum_k dxs[slot of (n, k)].
#pragma once

#include <cstdint>
#include <vector>

#include "tensor/tensor.h"

namespace keel::ops::moe {

struct Plan {
  std::int64_t tokens = 0;
  int top_k = 0, experts = 0;
  std::vector<std::int64_t> counts;    // [E] slots per expert (the router's load counts)
  std::vector<std::int64_t> offsets;   // [E + 1] exclusive prefix sum of counts
  std::vector<std::int32_t> source;    // [S] sorted slot -> flat assignment a = n * top_k + k
  std::vector<std::int32_t> position;  // [S] flat assignment a -> sorted slot
  std::int64_t slots() const { return tokens * top_k; }
};

// expert_idx [N * top_k] (as router::forward writes it); throws on an index outside [0, E).
Plan make_plan(const std::int32_t* expert_idx, std::int64_t tokens, int top_k, int experts);

struct Weights {
  Tensor w_gate, w_up;  // [E, F, D]
  Tensor w_down;        // [E, D, F]
};

struct Saved {
  Tensor xs;                   // [S, D] tokens gathered in expert order
  Tensor h_gate, h_up, act;    // [S, F]
  Tensor ys;                   // [S, D] expert outputs before the gate weighting
};

void forward(const Plan& plan, const Tensor& x, const Tensor& gates, const Weights& w, const Saved& saved, const Tensor& y);

std::int64_t backward_scratch_floats(std::int64_t slots, std::int64_t d, std::int64_t f);

// dweights: accumulated gradients with the shapes of w (any may be empty to skip).
void backward(const Plan& plan, const Tensor& x, const Tensor& gates, const Weights& w, const Saved& saved,
              const Tensor& dy, const Tensor& scratch, const Tensor& dx, const Tensor& dgates, const Weights& dweights);

// Where a routed layer's experts run when they are not all on this rank (callers without a
// runner call forward() and backward() above): spread over an expert-parallel group of ranks
// (parallel/expert_parallel.h). One object per MoE layer (it keeps what backward needs). Same
// arguments as forward() and backward(); `w` and `dweights` hold the experts this rank has (all
// E, or E / P), the plan routes over all E; a runner may keep its own saved rows and scratch
// and ignore the caller's. The CUDA twin is ops/cuda/moe.h's ExpertRunner.
class ExpertRunner {
 public:
  virtual ~ExpertRunner() = default;
  virtual void forward(const Plan& plan, const Tensor& x, const Tensor& gates, const Weights& w, const Saved& saved,
                       const Tensor& y) = 0;
  virtual void backward(const Plan& plan, const Tensor& x, const Tensor& gates, const Weights& w, const Saved& saved,
                        const Tensor& dy, const Tensor& scratch, const Tensor& dx, const Tensor& dgates,
                        const Weights& dweights) = 0;
  // True when every rank of a group must call forward() and backward() together, even with no
  // tokens.
  virtual bool collective() const { return false; }
};

}  // namespace keel::ops::moe
