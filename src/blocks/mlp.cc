#include "blocks/mlp.h"

#include <algorithm>

#include "common/error.h"
#include "ops/linear.h"
#include "ops/router.h"
#include "ops/swiglu.h"
#include "ops/zaya_router.h"

namespace keel::blocks {

MlpShape MlpShape::of(const model::ModelConfig& cfg, std::int64_t tokens, bool renormalize, TensorSplit tp,
                      bool forced_balance) {
  MlpShape s;
  s.tokens = tokens;
  s.hidden = cfg.hidden;
  s.ffn = cfg.ffn_hidden / tp.degree;
  s.expert_hidden = cfg.expert_hidden / tp.degree;
  s.experts = cfg.experts;
  s.top_k = cfg.top_k;
  s.mlp_router = cfg.router_hidden > 0;
  s.renormalize = renormalize;
  s.forced_balance = forced_balance;
  s.zaya.tokens = tokens;
  s.zaya.hidden = cfg.hidden;
  s.zaya.router_hidden = cfg.router_hidden;
  s.zaya.expert_hidden = s.expert_hidden;
  s.zaya.experts = cfg.experts;
  s.zaya.skip = cfg.router_skip_expert;
  s.zaya.eps = static_cast<float>(cfg.norm_eps);
  s.zaya.forced_balance = forced_balance;
  return s;
}

void carve(ArenaPlanner& p, const std::string& prefix, const MlpShape& s, bool dense, bool routed, MlpSaved& a,
           bool routing) {
  const std::int64_t N = s.tokens, D = s.hidden, E = std::max(s.experts, 1), K = std::max(s.top_k, 1);
  const std::int64_t FE = std::max<std::int64_t>(s.expert_hidden, 1), FD = std::max<std::int64_t>(s.ffn, 1);
  const std::int64_t SL = N * K, R = std::max<std::int64_t>(s.zaya.router_hidden, 1);
  if (dense) {
    a.g = p.tensor(prefix + "g", {N, FD});
    a.u = p.tensor(prefix + "u", {N, FD});
    a.a = p.tensor(prefix + "a", {N, FD});
  }
  if (!routed) return;
  if (!routing) {
    // the routing pass's router state and indices are used (mlp_forward's `routing`)
  } else if (s.mlp_router) {
    // The router's `state` view in this buffer goes unused: forward points it at the caller's EDA buffer.
    const Tensor buf = p.tensor(prefix + "router_saved", {ops::zaya_router::saved_floats(N, R, s.zaya.classes())});
    if (!p.sizing()) a.zmoe.router = ops::zaya_router::carve_saved(buf.data(), N, R, s.zaya.classes());
  } else {
    a.rlogits = p.tensor(prefix + "router_logits", {N, E});
    a.probs = p.tensor(prefix + "router_probs", {N, E});
    a.rlse = p.tensor(prefix + "router_lse", {N});
    a.gates = p.tensor(prefix + "gates", {N, K});
    a.idx = p.take<std::int32_t>(prefix + "expert_idx", static_cast<std::size_t>(SL));
    a.counts = p.take<std::int64_t>(prefix + "counts", static_cast<std::size_t>(E));
  }
  a.experts.xs = p.tensor(prefix + "xs", {SL, D});
  a.experts.h_gate = p.tensor(prefix + "h_gate", {SL, FE});
  a.experts.h_up = p.tensor(prefix + "h_up", {SL, FE});
  a.experts.act = p.tensor(prefix + "act", {SL, FE});
  a.experts.ys = p.tensor(prefix + "ys", {SL, D});
  a.zmoe.experts = a.experts;
}

void carve(ArenaPlanner& p, const MlpShape& s, bool dense, bool routed, bool backward, MlpScratch& sc) {
  const std::int64_t N = s.tokens, D = s.hidden, E = std::max(s.experts, 1), K = std::max(s.top_k, 1);
  const std::int64_t FE = std::max<std::int64_t>(s.expert_hidden, 1), FD = std::max<std::int64_t>(s.ffn, 1);
  const std::int64_t SL = N * K, R = std::max<std::int64_t>(s.zaya.router_hidden, 1);
  if (backward && dense) {
    sc.dg = p.tensor("bwd.dg", {N, FD});
    sc.du = p.tensor("bwd.du", {N, FD});
    sc.da = p.tensor("bwd.da", {N, FD});
  }
  if (!routed) return;
  if (backward && !s.mlp_router) {
    sc.dgates = p.tensor("bwd.dgates", {N, K});
    sc.dlogits = p.tensor("bwd.dlogits", {N, E});
  }
  if (backward) sc.moe = p.tensor("bwd.moe_scratch", {ops::moe::backward_scratch_floats(SL, D, FE)});
  if (s.mlp_router) {
    zaya::MoeScratch& z = sc.zs;
    z.xk = p.tensor("moe.xk", {N, D});
    z.yk = p.tensor("moe.yk", {N, D});
    z.gk = p.tensor("moe.gk", {N, 1});
    if (backward) {
      z.dyk = p.tensor("bwd.moe.dyk", {N, D});
      z.dxk = p.tensor("bwd.moe.dxk", {N, D});
      z.dx_router = p.tensor("bwd.moe.dx_router", {N, D});
      z.dgk = p.tensor("bwd.moe.dgk", {N, 1});
      z.dgates = p.tensor("bwd.moe.dgates", {N, 1});
      z.router = p.tensor("bwd.moe.router_scratch", {ops::zaya_router::backward_scratch_floats(N, R, s.zaya.classes())});
      z.experts = sc.moe;
    }
  }
}

void mlp_forward(const MlpShape& s, const LayerWeights& w, const Tensor& bias, const Tensor& x_in, const EdaIo& eda,
                 MlpSaved& a, const MlpScratch& sc, const Tensor& y, LinearRunner& linear,
                 ops::moe::ExpertRunner* experts, std::int64_t* load, RouterLosses* losses, TokenGroup& tokens,
                 const MlpSaved* routing) {
  const std::int64_t N = s.tokens;
  // Under tensor parallelism the routers run on every token of the group (replicated) and the
  // experts, like the dense MLP, are column- then row-parallel: `out` is a partial sum.
  const Tensor x = linear.enter(x_in), out = linear.out(y);
  if (!w.moe) {
    ops::linear::forward(x, w.w_gate, {}, a.g);
    ops::linear::forward(x, w.w_up, {}, a.u);
    ops::swiglu::forward(a.g, a.u, a.a);
    ops::linear::forward(a.a, w.w_down, {}, out);
  } else if (s.mlp_router) {
    // ZAYA1 router: no z loss; its Switch aux loss over all classes is reported, and trained
    // only where its weight is set (ZAYA1 has none: balancing is the bias controller's job).
    const zaya::MoeParams p{w.zrouter, w.experts, experts};
    if (routing) {
      zaya::share_routing(routing->zmoe, a.zmoe);
    } else {
      a.zmoe.router.state = eda.state;
      zaya::route(s.zaya, p, x, eda.prev, bias, s.zaya.eps, a.zmoe);
      const int classes = s.zaya.classes();
      if (load)
        for (int e = 0; e < classes; ++e) load[e] += a.zmoe.router.counts[static_cast<std::size_t>(e)];
      // the micro-batch's counts over its tokens (backward reads them too; one rank: its own)
      a.zmoe.aux_counts = a.zmoe.router.counts;
      tokens.sum(a.zmoe.aux_counts.data(), classes);
      a.zmoe.aux_rows = N * tokens.size();
      if (losses)
        losses->aux += ops::router::aux_loss(a.zmoe.router.probs, a.zmoe.aux_counts.data(), a.zmoe.aux_rows, 1);
    }
    zaya::experts_forward(s.zaya, p, x, a.zmoe, sc.zs, out);
  } else {
    if (routing) {  // the router's saved views and the plan are the routing pass's
      a.rlogits = routing->rlogits, a.probs = routing->probs, a.rlse = routing->rlse, a.gates = routing->gates;
      a.idx = routing->idx, a.counts = routing->counts, a.plan = routing->plan;
    } else {
      ops::linear::forward(x, w.router, {}, a.rlogits);
      ops::router::Losses l =
          ops::router::forward(a.rlogits, bias, {s.top_k, s.renormalize, s.forced_classes()}, a.probs, a.rlse, a.idx,
                               a.gates, a.counts);
      if (load)
        for (int e = 0; e < s.experts; ++e) load[e] += a.counts[e];
      if (tokens.size() > 1) {  // the micro-batch's counts (backward reads them too)
        tokens.sum(a.counts, s.experts);
        l.aux = ops::router::aux_loss(a.probs, a.counts, N * tokens.size(), s.top_k);
      }
      if (losses) losses->aux += l.aux, losses->z += l.z;
      a.plan = ops::moe::make_plan(a.idx, N, s.top_k, s.experts);
    }
    if (experts)
      experts->forward(a.plan, x, a.gates, w.experts, a.experts, out);
    else
      ops::moe::forward(a.plan, x, a.gates, w.experts, a.experts, out);
  }
  linear.exit(out, y);
}

namespace {

// A pass's dL/d gates into the shared sum (the first pass writes it); the sum to route back from.
Tensor add_gates(const SharedRouting* shared, const Tensor& dgates) {
  if (!shared) return dgates;
  const std::int64_t n = dgates.numel();
  if (shared->dgates.numel() < n)
    fail("mlp: the shared routing's gate gradients hold {} floats, not {}", shared->dgates.numel(), n);
  const Tensor sum(shared->dgates.data(), {dgates.dim(0), dgates.dim(1)});
  const float* d = dgates.data();
  float* o = sum.data();
  if (shared->first)
    std::copy(d, d + n, o);
  else
    for (std::int64_t i = 0; i < n; ++i) o[i] += d[i];
  return sum;
}

}  // namespace

void mlp_backward(const MlpShape& s, const LayerWeights& w, LayerWeights& g, const Tensor& x_in, const EdaIo& eda,
                  const EdaGrads& deda, MlpSaved& a, const MlpScratch& sc, const Tensor& dy_in, const Tensor& dx_in,
                  float aux_weight, float z_weight, LinearRunner& linear, ops::moe::ExpertRunner* experts,
                  TokenGroup& tokens, const SharedRouting* shared) {
  const Tensor x = linear.enter(x_in);  // the rows forward's projections read
  const Tensor dy = linear.exit_backward(dy_in), dx = linear.dx_out(dx_in);
  if (!w.moe) {
    ops::linear::backward(a.a, w.w_down, dy, sc.da, g.w_down, {});
    ops::swiglu::backward(a.g, a.u, sc.da, sc.dg, sc.du);
    ops::linear::backward(x, w.w_gate, sc.dg, dx, g.w_gate, {});
    ops::linear::backward(x, w.w_up, sc.du, sc.tmp, g.w_up, {});
    add_into(dx, sc.tmp);
  } else if (s.mlp_router) {
    const zaya::MoeParams p{w.zrouter, w.experts, experts}, gp{g.zrouter, g.experts, nullptr};
    zaya::experts_backward(s.zaya, p, gp, x, a.zmoe, sc.zs, dy, dx, sc.zs.dgates);
    const Tensor dgates = add_gates(shared, sc.zs.dgates);
    if (!shared || shared->last)
      zaya::route_backward(p, gp, x, eda.prev, a.zmoe, sc.zs, dgates, deda.dstate_next, dx, deda.dprev, aux_weight);
  } else {
    if (experts)
      experts->backward(a.plan, x, a.gates, w.experts, a.experts, dy, sc.moe, dx, sc.dgates, g.experts);
    else
      ops::moe::backward(a.plan, x, a.gates, w.experts, a.experts, dy, sc.moe, dx, sc.dgates, g.experts);
    const Tensor dgates = add_gates(shared, sc.dgates);
    if (shared && !shared->last) return linear.enter_backward(dx, dx_in);
    ops::router::backward(a.probs, a.rlse, a.idx, a.gates, a.counts, {s.top_k, s.renormalize}, dgates, aux_weight,
                          z_weight, sc.dlogits, s.tokens * tokens.size());
    ops::linear::backward(x, w.router, sc.dlogits, sc.tmp, g.router, {});
    add_into(dx, sc.tmp);
  }
  linear.enter_backward(dx, dx_in);
}

}  // namespace keel::blocks
