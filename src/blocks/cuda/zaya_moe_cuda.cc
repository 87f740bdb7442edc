#include "blocks/cuda/zaya_moe.h"

#include "ops/cuda/cast.h"
#include "blocks/cuda/kernels.h"

namespace keel::blocks::cuda::zaya {

namespace k = ops::cuda;

void route(k::GemmRunner& gemm, const Shape& s, const Weights& w, const bf16* x, const float* prev_state,
           const float* bias, Acts& a, cudaStream_t stream) {
  k::zaya_router::forward(gemm, router_dims(s), x, prev_state, w.router, bias, a.router, stream);
  pack_routed(a.router.idx, s.tokens, s.experts, a.kept, a.kept_idx, a.pos, a.count, stream);
  // The plan's one sync also brings nk, the tokens left after the skip class, to the host.
  a.plan = k::moe::make_plan(a.kept_idx, s.tokens, 1, s.experts, a.plan_ws, stream, s.skip ? a.count : nullptr);
  a.nk = a.plan.tokens;
}

void share_routing(const Acts& from, Acts& to) {
  to.router = from.router;
  to.kept = from.kept, to.kept_idx = from.kept_idx, to.pos = from.pos, to.count = from.count;
  to.plan_ws = from.plan_ws;
  to.plan = from.plan;
  to.nk = from.nk;
}

void experts_forward(const Shape& s, const Weights& w, const bf16* x, Acts& a, const Scratch& sc, float* y,
                     cudaStream_t stream, k::moe::ExpertRunner* experts) {
  const std::int64_t N = s.tokens, D = s.hidden;
  if (!experts) {
    // The experts read x's kept rows and write y's in place (Plan::rows): no packed copies. The
    // skip path writes the skipped rows (0).
    a.plan.rows = a.kept;
    if (a.nk > 0) {
      gather_rows(a.router.gates, a.kept, a.nk, 1, sc.gk, stream);
      k::moe::forward(a.plan, x, sc.gk, w.experts, D, s.expert_hidden, a.experts, y, stream);
    }
    if (s.skip) k::zaya_router::skip_forward(x, a.router.idx, a.router.gates, s.experts, y, N, D, stream);
    return;
  }
  // With expert parallelism every rank takes part, with no routed tokens too.
  if (a.nk > 0 || experts->collective()) {
    gather_rows(x, a.kept, a.nk, D, sc.xk, stream);
    gather_rows(a.router.gates, a.kept, a.nk, 1, sc.gk, stream);
    experts->forward(a.plan, sc.xk, sc.gk, w.experts, D, s.expert_hidden, a.experts, sc.yk, stream);
  }
  // Expert rows from the packed output, 0 on skipped rows (the skip class's MoE output); the
  // skip path writes those rows again (0), after the unpack.
  unpack_rows(sc.yk, a.pos, N, D, y, stream);
  if (s.skip) k::zaya_router::skip_forward(x, a.router.idx, a.router.gates, s.experts, y, N, D, stream);
}

void moe_forward(k::GemmRunner& gemm, const Shape& s, const Weights& w, const bf16* x, const float* prev_state,
                 const float* bias, Acts& a, const Scratch& sc, float* y, cudaStream_t stream,
                 k::moe::ExpertRunner* experts) {
  route(gemm, s, w, x, prev_state, bias, a, stream);
  experts_forward(s, w, x, a, sc, y, stream, experts);
}

void experts_backward(const Shape& s, const Weights& w, const Grads& g, const bf16* x, Acts& a, const Scratch& sc,
                      const float* dy, float* dx, float* dgates, cudaStream_t stream, k::moe::ExpertRunner* experts) {
  const std::int64_t N = s.tokens, D = s.hidden;
  if (!experts) {
    // forward's plan reads dy's kept rows and writes dx's (fp32, unrounded) in place; the skip
    // path zeroes the skipped rows of dx and dgates.
    if (a.nk > 0) {
      gather_rows(a.router.gates, a.kept, a.nk, 1, sc.gk, stream);
      k::moe::backward_f32(a.plan, sc.gk, w.experts, D, s.expert_hidden, a.experts, dy, sc.experts, dx, sc.dgk,
                           g.experts, stream);
    } else {
      k::moe::zero_expert_grads(g.experts, s.experts, D, s.expert_hidden, stream);
    }
    unpack_rows(sc.dgk, a.pos, N, 1, dgates, stream);
    if (s.skip) k::zaya_router::skip_backward(x, a.router.idx, a.router.gates, s.experts, dy, dx, dgates, N, D, stream);
    return;
  }
  if (a.nk > 0 || experts->collective()) {
    gather_rows(a.router.gates, a.kept, a.nk, 1, sc.gk, stream);
    gather_rows(dy, a.kept, a.nk, D, sc.dyk, stream);
    experts->backward(a.plan, sc.gk, w.experts, D, s.expert_hidden, a.experts, sc.dyk, sc.experts, sc.dxk, sc.dgk,
                      g.experts, stream);
  } else {
    k::moe::zero_expert_grads(g.experts, s.experts, D, s.expert_hidden, stream);  // no routed rows: all zeros
  }
  // dx: the experts' dx on routed rows, 0 on skipped rows (fp32). dL/d gate: the experts' on
  // routed rows, 0 on skipped rows (skip_backward writes those rows after the unpack).
  unpack_moe_dx(sc.dxk, a.pos, N, D, dx, stream);
  unpack_rows(sc.dgk, a.pos, N, 1, dgates, stream);
  if (s.skip)
    k::zaya_router::skip_backward(x, a.router.idx, a.router.gates, s.experts, dy, static_cast<bf16*>(nullptr), dgates,
                                  N, D, stream);
}

void route_backward(k::GemmRunner& gemm, const Shape& s, const Weights& w, const Grads& g, const bf16* x,
                    const float* prev_state, Acts& a, const Scratch& sc, const float* dgates, const float* dstate_next,
                    float* dx, float* dprev_state, cudaStream_t stream, bool add_in_gemm, float aux_weight) {
  if (add_in_gemm) {  // the router's input gradient added into dx by its GEMM (fp32, beta = 1)
    k::zaya_router::backward_add_dx(gemm, router_dims(s), x, prev_state, w.router, a.router, dgates, dstate_next, dx,
                                    dprev_state, g.router, sc.router, stream, aux_weight);
    return;
  }
  // The router's share of dx goes through the bf16 scratch (the experts' packed dx there is consumed).
  k::zaya_router::backward(gemm, router_dims(s), x, prev_state, w.router, a.router, dgates, dstate_next, sc.dxk,
                           dprev_state, g.router, sc.router, stream, aux_weight);
  k::add_bf16_to_f32(sc.dxk, dx, s.tokens * s.hidden, stream);
}

void moe_backward(k::GemmRunner& gemm, const Shape& s, const Weights& w, const Grads& g, const bf16* x,
                  const float* prev_state, Acts& a, const Scratch& sc, const float* dy, const float* dstate_next,
                  float* dx, float* dprev_state, cudaStream_t stream, k::moe::ExpertRunner* experts,
                  float aux_weight) {
  experts_backward(s, w, g, x, a, sc, dy, dx, sc.dgates, stream, experts);
  route_backward(gemm, s, w, g, x, prev_state, a, sc, sc.dgates, dstate_next, dx, dprev_state, stream, !experts,
                 aux_weight);
}

}  // namespace keel::blocks::cuda::zaya
