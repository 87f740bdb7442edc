// The ZAYA1 MoE stage on the GPU: the CUDA twin of blocks/zaya_moe.h (same data flow, same
// packing of the routed tokens), composed from ops/cuda/zaya_router.h (MLP router with EDA, the
// skip path), ops/cuda/moe.h (dropless top-1 SwiGLU experts) and the packing kernels of
// blocks/cuda/kernels.h. Per token n of x [N, D] (the stage's RMSNorm output, bf16), E experts
// and, with `skip`, class E = skip:
//   router: state [N, R] (post-EDA; the caller's per-stage buffer), probs, idx, gate = p_idx
//   y[n] = gate[n] * Expert_idx[n](x[n])   for idx[n] <  E
//   y[n] = 0                               for idx[n] == E (skip: no expert compute)
// The experts run on the packed rows `kept` (idx < E, in token order): moe::make_plan only
// accepts indices in [0, E), and skipped tokens then cost no expert FLOPs. With the experts all
// on this GPU the plan reads x and dy and writes y and dx at the kept rows themselves
// (moe::Plan::rows), dx in fp32, and the router's input gradient is added into dx by its GEMM:
// no packed copies of x, y, dy or dx. With an expert runner (expert parallelism) the kept rows
// are packed into Scratch::xk / dyk and unpacked from yk / dxk around it.
//
// Dtypes: x bf16; y, dy, dx fp32 [N, D] (y is the block output that the fp32 residual stream or
// the residual merge consumes; dx feeds the fp32 sum of the stage's input gradient); prev_state,
// dstate_next, dprev_state fp32 [N, R]; parameter gradients fp32, ACCUMULATED (+=).
// y, dx and dprev_state are OVERWRITTEN.
//
// Host syncs: one in forward, moe::make_plan's copy of the expert offsets, which also brings
// the packed count nk (the plan reads it on the device; without the skip class nk = N).
// Backward never syncs. Load counts after forward: expert e = plan.count(e), skip = N - nk.
#pragma once

#include <cstdint>

#include "blocks/shape.h"
#include "ops/cuda/common.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/zaya_router.h"

namespace keel::blocks::cuda::zaya {

using ops::cuda::bf16;

using Shape = ZayaShape;  // blocks/shape.h, shared with the CPU block
inline ops::cuda::zaya_router::Dims router_dims(const Shape& s) {
  return {s.tokens, s.hidden, s.router_hidden, s.classes(), s.eps, s.forced_classes()};
}

struct Weights {
  ops::cuda::zaya_router::Weights router;  // gamma null on the first MoE stage (no EDA there)
  ops::cuda::moe::Weights experts;
};

struct Grads {
  ops::cuda::zaya_router::Grads router;
  ops::cuda::moe::Grads experts;
};

// What forward keeps for backward (one set per layer, or one shared set with full recompute).
struct Acts {
  ops::cuda::zaya_router::Saved router;  // router.state -> the caller's EDA buffer of this stage
  std::int32_t* kept = nullptr;          // [N] packed token rows (first nk used)
  std::int32_t* kept_idx = nullptr;      // [N] their expert
  std::int32_t* pos = nullptr;           // [N] packed row of each token, -1 when skipped
  std::int32_t* count = nullptr;         // [1] nk on the device
  std::int32_t* plan_ws = nullptr;       // [moe::plan_ints(N, E)]
  ops::cuda::moe::Plan plan;             // over the packed rows (valid when nk > 0)
  std::int64_t nk = 0;                   // tokens routed to an expert
  ops::cuda::moe::Saved experts;         // [N, ...] buffers; the first nk rows are used
};

// Scratch shared by every stage, forward and backward (contents ignored between calls):
// xk [N, D] bf16, yk [N, D] fp32, gk [N], dgk [N], dgates [N] fp32, dyk [N, D] fp32,
// dxk [N, D] bf16 (the experts' packed dx, then the router's dx; xk, yk, dyk and dxk are used
// only with an expert runner), router
// (zaya_router::backward_scratch_bytes), experts (moe::backward_scratch_bytes(N, D, F)).
struct Scratch {
  bf16 *xk = nullptr, *dxk = nullptr;
  float *yk = nullptr, *gk = nullptr, *dgk = nullptr, *dgates = nullptr, *dyk = nullptr;
  void *router = nullptr, *experts = nullptr;
};

// x [N, D] bf16; prev_state [N, R] or null (first MoE stage); bias [classes] (device, selection
// only); y [N, D] fp32 overwritten. a.router.state must point at this stage's EDA buffer.
// experts: where the experts run (null: all on this GPU, moe::forward; with expert parallelism
// w.experts holds this rank's experts and the runner moves the rows, parallel/
// expert_parallel_cuda.h).
void moe_forward(ops::cuda::GemmRunner& gemm, const Shape& s, const Weights& w, const bf16* x, const float* prev_state,
                 const float* bias, Acts& a, const Scratch& sc, float* y, cudaStream_t stream,
                 ops::cuda::moe::ExpertRunner* experts = nullptr);

// dy [N, D] fp32; dstate_next [N, R] or null (dL/d state from the next stage's EDA); dx [N, D]
// fp32 and dprev_state [N, R] (null on the first stage) overwritten; g accumulated.
void moe_backward(ops::cuda::GemmRunner& gemm, const Shape& s, const Weights& w, const Grads& g, const bf16* x,
                  const float* prev_state, Acts& a, const Scratch& sc, const float* dy, const float* dstate_next,
                  float* dx, float* dprev_state, cudaStream_t stream,
                  ops::cuda::moe::ExpertRunner* experts = nullptr, float aux_weight = 0.f);

// The two halves of each, for passes that share one routing (TSP: a layer's weight shards visit
// the same tokens and the router runs once; blocks/cuda/mlp.h's `routing`), as on the CPU
// (blocks/zaya_moe.h):
//   route            the router, the packing and the plan (forward's one sync) into a
//   share_routing    a later pass takes `from`'s routing (device pointers; its experts' Saved
//                    stays its own)
//   experts_forward  the experts (and the skip rows' 0) over a's routing: y overwritten
//   experts_backward dx overwritten (the experts' input gradient, 0 on skip rows) and dgates
//                    [N] overwritten (dL/d gate, the router's input)
//   route_backward   the router's backward from dgates (every pass's, summed): its share added
//                    into dx (by its GEMM with add_in_gemm, else through Scratch::dxk),
//                    dprev_state overwritten, the router's gradients accumulated
void route(ops::cuda::GemmRunner& gemm, const Shape& s, const Weights& w, const bf16* x, const float* prev_state,
           const float* bias, Acts& a, cudaStream_t stream);
void share_routing(const Acts& from, Acts& to);
void experts_forward(const Shape& s, const Weights& w, const bf16* x, Acts& a, const Scratch& sc, float* y,
                     cudaStream_t stream, ops::cuda::moe::ExpertRunner* experts);
void experts_backward(const Shape& s, const Weights& w, const Grads& g, const bf16* x, Acts& a, const Scratch& sc,
                      const float* dy, float* dx, float* dgates, cudaStream_t stream,
                      ops::cuda::moe::ExpertRunner* experts);
void route_backward(ops::cuda::GemmRunner& gemm, const Shape& s, const Weights& w, const Grads& g, const bf16* x,
                    const float* prev_state, Acts& a, const Scratch& sc, const float* dgates, const float* dstate_next,
                    float* dx, float* dprev_state, cudaStream_t stream, bool add_in_gemm, float aux_weight);

}  // namespace keel::blocks::cuda::zaya
