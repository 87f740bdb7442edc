// The ZAYA1 MoE stage of MoeTransformer: the MLP router with EDA (ops::zaya_router), top-1
// dropless SwiGLU experts (ops::moe) over the tokens routed to an expert, and the MoD skip class
// (docs/zaya1_ops.md §4; docs/train.md). Kept out of model.cc because the skip class needs a
// compaction step around ops::moe, whose plan only accepts expert indices in [0, E).
//
// Per token n of x [N, D] (the stage's RMSNorm'd input), with E experts and, when `skip` is on,
// class E = skip:
//   router: state = a (post-EDA, pre-norm) [N, R], probs, idx = argmax(p + bias), gate = p_idx
//   y[n] = gate[n] * Expert_idx[n](x[n])   for idx[n] <  E
//   y[n] = gate[n] * x[n]                  for idx[n] == E (skip: no FFN compute)
// The experts run on the compacted rows `kept` (idx < E, ascending): ops::moe sees Nk <= N
// tokens, so skipped tokens cost nothing.
//
// Saved for backward (MoeActs): the router's Saved (its `state` is the caller's per-stage EDA
// buffer, kept across recompute so the next stage's EDA and backward can read it), `kept`, the
// experts' plan and Saved (first Nk rows of [N, ...] buffers). x, the gates and dy are gathered
// again in backward into scratch rather than kept.
// Gradients: dx and dprev_state overwritten; parameter gradients accumulated (+=).
#pragma once

#include <cstdint>
#include <vector>

#include "blocks/shape.h"
#include "ops/moe.h"
#include "ops/zaya_router.h"
#include "tensor/tensor.h"

namespace keel::blocks::zaya {

struct MoeParams {
  ops::zaya_router::Params router;  // gamma empty on the first MoE stage (no EDA there)
  ops::moe::Weights experts;        // [E, F, D], [E, F, D], [E, D, F] (this rank's experts)
  ops::moe::ExpertRunner* runner = nullptr;  // where the experts run (forward's p); null: all here
};

struct MoeActs {
  ops::zaya_router::Saved router;  // state -> the stage's EDA buffer [N, R] (set by the caller)
  std::vector<std::int32_t> kept;  // token rows routed to an expert (not skipped), ascending
  std::vector<std::int32_t> kept_idx;  // their expert index
  ops::moe::Plan plan;             // over the kept rows
  ops::moe::Saved experts;         // full [N, ...] buffers; the first kept.size() rows are used
  // The aux loss's class counts and the tokens they were taken over (the micro-batch's under
  // context parallelism; set by the caller, empty: the router's own counts over N).
  std::vector<std::int64_t> aux_counts;
  std::int64_t aux_rows = 0;
};

// Scratch shared by every MoE stage (forward and backward): [N, D] xk, yk, dyk, dxk, dx_router;
// [N, 1] gk, dgk, dgates; router: zaya_router::backward_scratch_floats; experts:
// moe::backward_scratch_floats(N, D, F).
struct MoeScratch {
  Tensor xk, yk, dyk, dxk, dx_router, gk, dgk, dgates, router, experts;
};

using Shape = ZayaShape;  // blocks/shape.h

// x [N, D]; prev_state [N, R] or empty (first MoE stage); bias [classes]; y [N, D] overwritten.
void moe_forward(const Shape& s, const MoeParams& p, const Tensor& x, const Tensor& prev_state, const Tensor& bias,
                 float eps, MoeActs& a, const MoeScratch& scratch, const Tensor& y);

// dy [N, D]; dstate_next [N, R] or empty (dL/d state from the next MoE stage's EDA);
// dx [N, D] and dprev_state [N, R] (or empty) overwritten; g: gradient views (+=). aux_weight:
// the router's load-balancing loss weight (zaya_router::backward's d_aux; 0: none).
void moe_backward(const Shape& s, const MoeParams& p, const MoeParams& g, const Tensor& x, const Tensor& prev_state,
                  MoeActs& a, const MoeScratch& scratch, const Tensor& dy, const Tensor& dstate_next, const Tensor& dx,
                  const Tensor& dprev_state, float aux_weight = 0.f);

// The two halves of each, for passes that share one routing (TSP: a layer's weight shards visit
// the same tokens, and the router runs once; blocks/mlp.h's `routing`):
//   route            the router and the compaction (kept rows, their plan) into a
//   share_routing    a later pass takes `from`'s routing (its experts' Saved stays its own)
//   experts_forward  the experts (and the skip rows' 0) over a's routing: y overwritten
//   experts_backward dx overwritten (the experts' input gradient, 0 on skip rows) and
//                    dgates [N, 1] overwritten (dL/d gate, the router's input)
//   route_backward   the router's backward from dgates (every pass's, summed): its share added
//                    into dx, dprev_state overwritten, the router's gradients accumulated
void route(const Shape& s, const MoeParams& p, const Tensor& x, const Tensor& prev_state, const Tensor& bias, float eps,
           MoeActs& a);
void share_routing(const MoeActs& from, MoeActs& to);
void experts_forward(const Shape& s, const MoeParams& p, const Tensor& x, MoeActs& a, const MoeScratch& scratch,
                     const Tensor& y);
void experts_backward(const Shape& s, const MoeParams& p, const MoeParams& g, const Tensor& x, MoeActs& a,
                      const MoeScratch& scratch, const Tensor& dy, const Tensor& dx, const Tensor& dgates);
void route_backward(const MoeParams& p, const MoeParams& g, const Tensor& x, const Tensor& prev_state, MoeActs& a,
                    const MoeScratch& scratch, const Tensor& dgates, const Tensor& dstate_next, const Tensor& dx,
                    const Tensor& dprev_state, float aux_weight);

}  // namespace keel::blocks::zaya
