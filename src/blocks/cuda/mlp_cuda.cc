#include "blocks/cuda/mlp.h"

#include <algorithm>

#include "blocks/cuda/kernels.h"
#include "device/cuda_check.h"
#include "ops/cuda/cast.h"
#include "ops/cuda/linear.h"
#include "ops/cuda/swiglu.h"

namespace keel::blocks::cuda {

namespace k = ops::cuda;

void carve(DeviceCarver& c, const MlpShape& s, const MlpParts& parts, MlpSaved& a) {
  const std::int64_t N = s.tokens, D = s.hidden, E = std::max(s.experts, 1), K = std::max(s.top_k, 1);
  const std::int64_t FE = std::max<std::int64_t>(s.expert_hidden, 1), FD = std::max<std::int64_t>(s.ffn, 1);
  const std::int64_t S = N * K;
  if (parts.dense) {
    a.g = c.take<bf16>(N * FD);
    a.u = c.take<bf16>(N * FD);
    a.a = c.take<bf16>(N * FD);
  }
  if (!parts.routed) return;
  if (!parts.routing) {
    // the routing pass's router state and indices are used (mlp_forward's `routing`)
  } else if (s.mlp_router) {
    // the router's `state` region goes unused: forward points it at the caller's EDA buffer
    const k::zaya_router::Dims zdims = zaya::router_dims(s.zaya);
    std::byte* buf = c.take<std::byte>(static_cast<std::int64_t>(k::zaya_router::saved_bytes(zdims)));
    if (buf) a.zmoe.router = k::zaya_router::carve_saved(zdims, buf);
    a.zmoe.kept = c.take<std::int32_t>(N);
    a.zmoe.kept_idx = c.take<std::int32_t>(N);
    a.zmoe.pos = c.take<std::int32_t>(N);
    a.zmoe.count = c.take<std::int32_t>(1);
    a.zmoe.plan_ws = c.take<std::int32_t>(k::moe::plan_ints(N, static_cast<int>(E)));
  } else {
    a.rlogits = c.take<float>(N * E);
    a.probs = c.take<float>(N * E);
    a.rlse = c.take<float>(N);
    a.gates = c.take<float>(N * K);
    a.losses = c.take<float>(k::router::loss_floats(E));
    a.idx = c.take<std::int32_t>(S);
    a.counts = c.take<std::int32_t>(E);
    a.plan_ws = c.take<std::int32_t>(k::moe::plan_ints(S, static_cast<int>(E)));
  }
  a.experts.xs = c.take<bf16>(S * D);
  if (parts.expert_rows) {  // with expert parallelism the experts' rows live at their rank
    a.experts.h_gate = c.take<bf16>(S * FE);
    a.experts.h_up = c.take<bf16>(S * FE);
    a.experts.act = c.take<bf16>(S * FE);
  }
  a.experts.ys = c.take<bf16>(S * D);
  a.zmoe.experts = a.experts;
}

void carve(DeviceCarver& c, const MlpShape& s, const MlpScratchParts& parts, MlpScratch& sc) {
  const std::int64_t N = s.tokens, D = s.hidden, E = std::max(s.experts, 1), K = std::max(s.top_k, 1);
  const std::int64_t FE = std::max<std::int64_t>(s.expert_hidden, 1), FD = std::max<std::int64_t>(s.ffn, 1);
  if (parts.residual_out && (parts.routed || (parts.dense && parts.dense_split))) sc.moe_out = c.take<float>(N * D);
  if (parts.backward && parts.dense) {
    sc.dg = c.take<bf16>(N * FD);
    sc.du = c.take<bf16>(N * FD);
    sc.da = c.take<bf16>(N * FD);
  }
  if (parts.backward && parts.routed && !s.mlp_router) {
    sc.dgates = c.take<float>(N * K);
    sc.dlogits = c.take<float>(N * E);
    sc.dlogits_bf = c.take<bf16>(N * E);
  }
  if (parts.backward && parts.routed && parts.expert_rows)
    sc.moe = c.take<std::byte>(static_cast<std::int64_t>(k::moe::backward_scratch_bytes(N * K, D, FE)));
  if (parts.routed && s.mlp_router) {
    zaya::Scratch& z = sc.zs;
    if (!parts.expert_rows) {  // the packed rows around an expert runner (zaya_moe.h)
      z.xk = c.take<bf16>(N * D);
      if (parts.backward) z.dxk = c.take<bf16>(N * D);
      z.yk = c.take<float>(N * D);
      if (parts.backward) z.dyk = c.take<float>(N * D);
    }
    z.gk = c.take<float>(N);
    if (parts.backward) {
      z.dgk = c.take<float>(N);
      z.dgates = c.take<float>(N);
      z.router = c.take<std::byte>(static_cast<std::int64_t>(k::zaya_router::backward_scratch_bytes(zaya::router_dims(s.zaya))));
      z.experts = sc.moe;
    }
  }
}

void mlp_forward(k::GemmRunner& gemm, const MlpShape& s, const LayerWeights& w, const float* bias, const bf16* x_in,
                 const EdaIo& eda, const float* residual, float* y, MlpSaved& a, const MlpScratch& sc,
                 LinearRunner& linear, k::moe::ExpertRunner* experts, cudaStream_t stream, const MlpSaved* routing) {
  const std::int64_t N = s.tokens, D = s.hidden, R = linear.rows(N);
  const bf16* x = linear.enter(x_in, N, D, stream);
  if (w.moe < 0) {
    const std::int64_t F = s.ffn;
    k::linear::forward(gemm, x, w.w_gate, a.g, N, D, F, stream);
    k::linear::forward(gemm, x, w.w_up, a.u, N, D, F, stream);
    k::swiglu::forward(a.g, a.u, a.a, N * F, stream);
    const bool fused = !residual || linear.output_is_whole();
    if (residual && fused && residual != y)
      KEEL_CUDA_CHECK(cudaMemcpyAsync(y, residual, R * D * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    // the residual add rides in the down projection (fp32 C, beta = 1) when its output is whole
    float* out = fused ? y : sc.moe_out;
    float* down = linear.out(out, N, D);
    k::GemmDesc d;
    d.m = N, d.n = D, d.k = F, d.trans_b = true, d.c_type = k::GemmOut::kFp32, d.beta = residual && fused ? 1.f : 0.f;
    gemm.run(d, a.a, w.w_down, down, stream);
    linear.exit(down, out, N, D, stream);
    if (!fused) add_f32(residual, out, y, R * D, stream);
    return;
  }
  float* out = residual ? sc.moe_out : y;
  float* partial = linear.out(out, N, D);
  if (s.mlp_router) {
    const zaya::Weights zw{w.zrouter, w.experts};
    if (routing) {
      zaya::share_routing(routing->zmoe, a.zmoe);
    } else {
      a.zmoe.router.state = eda.state;
      zaya::route(gemm, s.zaya, zw, x, eda.prev, bias, a.zmoe, stream);
    }
    zaya::experts_forward(s.zaya, zw, x, a.zmoe, sc.zs, partial, stream, experts);
  } else {
    const int E = s.experts;
    if (routing) {  // the router's saved pointers and the plan are the routing pass's
      a.rlogits = routing->rlogits, a.probs = routing->probs, a.rlse = routing->rlse, a.gates = routing->gates;
      a.losses = routing->losses, a.idx = routing->idx, a.counts = routing->counts, a.plan_ws = routing->plan_ws;
      a.plan = routing->plan;
    } else {
      k::linear::forward_f32(gemm, x, w.router, a.rlogits, N, D, E, stream);
      k::router::Options ro{s.top_k, s.renormalize, s.forced_classes()};
      k::router::forward(a.rlogits, bias, N, E, ro, a.probs, a.rlse, a.idx, a.gates, a.counts, a.losses, stream);
      a.plan = k::moe::make_plan(a.idx, N, s.top_k, E, a.plan_ws, stream);  // syncs: host expert offsets
    }
    if (experts)
      experts->forward(a.plan, x, a.gates, w.experts, D, s.expert_hidden, a.experts, partial, stream);
    else
      k::moe::forward(a.plan, x, a.gates, w.experts, D, s.expert_hidden, a.experts, partial, stream);
  }
  linear.exit(partial, out, N, D, stream);
  if (residual) add_f32(residual, out, y, R * D, stream);
}

void mlp_loads(const MlpShape& s, const MlpSaved& a, std::int32_t* counts) {
  const int E = s.experts;
  if (s.mlp_router) {
    for (int e = 0; e < E; ++e) counts[e] = a.zmoe.nk > 0 ? static_cast<std::int32_t>(a.zmoe.plan.count(e)) : 0;
    if (s.zaya.skip) counts[E] = static_cast<std::int32_t>(s.tokens - a.zmoe.nk);
    return;
  }
  for (int e = 0; e < E; ++e) counts[e] = static_cast<std::int32_t>(a.plan.count(e));
}

namespace {

// A pass's dL/d gates (n floats) into the shared sum (the first pass writes it); the sum to
// route back from.
const float* add_gates(const SharedRouting* shared, const float* dgates, std::int64_t n, cudaStream_t stream) {
  if (!shared) return dgates;
  if (shared->first)
    KEEL_CUDA_CHECK(cudaMemcpyAsync(shared->dgates, dgates, n * sizeof(float), cudaMemcpyDeviceToDevice, stream));
  else
    add_f32(shared->dgates, dgates, shared->dgates, n, stream);
  return shared->dgates;
}

}  // namespace

void mlp_backward(k::GemmRunner& gemm, const MlpShape& s, const LayerWeights& w, const LayerGrads& g, const bf16* x_in,
                  const EdaIo& eda, const EdaGrads& deda, MlpSaved& a, const MlpScratch& sc, const float* dy_in,
                  float* dx_in, float aux_weight, float z_weight, LinearRunner& linear, k::moe::ExpertRunner* experts,
                  cudaStream_t stream, const SharedRouting* shared) {
  const std::int64_t N = s.tokens, D = s.hidden, R = linear.rows(N);
  const bf16* x = linear.enter(x_in, N, D, stream);  // the rows forward's projections read
  float* dx = linear.dx_out(dx_in, N, D);            // their input gradient, summed over the group below
  auto gemm_dx = [&](std::int64_t kk, const bf16* da, const bf16* wt, float beta) {
    k::GemmDesc d;
    d.m = N, d.n = D, d.k = kk, d.c_type = k::GemmOut::kFp32, d.beta = beta;
    gemm.run(d, da, wt, dx, stream);
  };
  if (w.moe < 0) {
    const std::int64_t F = s.ffn;
    k::f32_to_bf16(dy_in, sc.dy, R * D, stream);
    const bf16* g_out = linear.exit_backward(sc.dy, N, D, stream);
    k::linear::backward(gemm, a.a, w.w_down, g_out, sc.da, g.w_down, N, F, D, stream);
    k::swiglu::backward(a.g, a.u, sc.da, sc.dg, sc.du, N * F, stream);
    k::linear::backward(gemm, x, w.w_gate, sc.dg, nullptr, g.w_gate, N, D, F, stream);
    k::linear::backward(gemm, x, w.w_up, sc.du, nullptr, g.w_up, N, D, F, stream);
    gemm_dx(F, sc.dg, w.w_gate, 0.f);
    gemm_dx(F, sc.du, w.w_up, 1.f);
    linear.enter_backward(dx, dx_in, N, D, stream);
    return;
  }
  const float* dy = linear.exit_backward(dy_in, N, D, stream);
  if (s.mlp_router) {
    const zaya::Weights zw{w.zrouter, w.experts};
    const zaya::Grads zg{g.zrouter, g.experts};
    zaya::experts_backward(s.zaya, zw, zg, x, a.zmoe, sc.zs, dy, dx, sc.zs.dgates, stream, experts);
    const float* dgates = add_gates(shared, sc.zs.dgates, N, stream);
    if (!shared || shared->last)
      zaya::route_backward(gemm, s.zaya, zw, zg, x, eda.prev, a.zmoe, sc.zs, dgates, deda.dstate_next, dx, deda.dprev,
                           stream, !experts, aux_weight);
    linear.enter_backward(dx, dx_in, N, D, stream);
    return;
  }
  const int E = s.experts;
  if (experts)
    experts->backward(a.plan, a.gates, w.experts, D, s.expert_hidden, a.experts, dy, sc.moe, sc.dx, sc.dgates,
                      g.experts, stream);
  else
    k::moe::backward(a.plan, a.gates, w.experts, D, s.expert_hidden, a.experts, dy, sc.moe, sc.dx, sc.dgates,
                     g.experts, stream);
  const float* dgates = add_gates(shared, sc.dgates, N * s.top_k, stream);
  if (shared && !shared->last) {
    k::bf16_to_f32(sc.dx, dx, N * D, stream);
    linear.enter_backward(dx, dx_in, N, D, stream);
    return;
  }
  k::router::Options ro{s.top_k, s.renormalize};
  k::router::backward(a.probs, a.rlse, a.idx, a.gates, a.counts, N, E, ro, dgates, aux_weight, z_weight, sc.dlogits,
                      stream);
  k::f32_to_bf16(sc.dlogits, sc.dlogits_bf, N * E, stream);
  k::bf16_to_f32(sc.dx, dx, N * D, stream);
  gemm_dx(E, sc.dlogits_bf, w.router, 1.f);
  k::linear::backward(gemm, x, w.router, sc.dlogits_bf, nullptr, g.router, N, D, E, stream);
  linear.enter_backward(dx, dx_in, N, D, stream);
}

}  // namespace keel::blocks::cuda
