#include "blocks/zaya_moe.h"

#include <cstring>

#include "common/error.h"

namespace keel::blocks::zaya {
namespace {

// The first `rows` rows of a [N, C] buffer.
Tensor head(const Tensor& t, std::int64_t rows) { return Tensor(t.data(), {rows, t.dim(1)}); }

ops::moe::Saved head(const ops::moe::Saved& s, std::int64_t rows) {
  return {head(s.xs, rows), head(s.h_gate, rows), head(s.h_up, rows), head(s.act, rows), head(s.ys, rows)};
}

void gather(const Tensor& src, const std::vector<std::int32_t>& rows, const Tensor& dst) {
  const std::size_t bytes = sizeof(float) * static_cast<std::size_t>(src.dim(1));
  for (std::size_t i = 0; i < rows.size(); ++i) std::memcpy(dst.row(std::int64_t(i)), src.row(rows[i]), bytes);
}

void scatter(const Tensor& src, const std::vector<std::int32_t>& rows, const Tensor& dst) {
  const std::size_t bytes = sizeof(float) * static_cast<std::size_t>(dst.dim(1));
  for (std::size_t i = 0; i < rows.size(); ++i) std::memcpy(dst.row(rows[i]), src.row(std::int64_t(i)), bytes);
}

}  // namespace

void route(const Shape& s, const MoeParams& p, const Tensor& x, const Tensor& prev_state, const Tensor& bias, float eps,
           MoeActs& a) {
  ops::zaya_router::forward(x, prev_state, p.router, bias, eps, a.router, s.forced_classes());
  const std::int64_t n = s.tokens;
  a.kept.clear();
  a.kept_idx.clear();
  for (std::int64_t i = 0; i < n; ++i)
    if (a.router.idx[i] < s.experts) a.kept.push_back(static_cast<std::int32_t>(i)), a.kept_idx.push_back(a.router.idx[i]);
  const std::int64_t nk = static_cast<std::int64_t>(a.kept.size());
  const bool collective = p.runner && p.runner->collective();
  if (nk > 0 || collective) a.plan = ops::moe::make_plan(a.kept_idx.data(), nk, 1, s.experts);
}

void share_routing(const MoeActs& from, MoeActs& to) {
  to.router = from.router;
  to.kept = from.kept;
  to.kept_idx = from.kept_idx;
  to.plan = from.plan;
  to.aux_counts = from.aux_counts;
  to.aux_rows = from.aux_rows;
}

void experts_forward(const Shape& s, const MoeParams& p, const Tensor& x, MoeActs& a, const MoeScratch& sc,
                     const Tensor& y) {
  // Skip rows get 0 here (the skip class runs no expert); routed rows get their expert output from the scatter below;
  // together they cover every row (every token is either skipped or routed).
  ops::zaya_router::skip_forward(x, a.router.idx.data(), a.router.gates, s.skip ? s.experts : -1, y);
  const std::int64_t nk = static_cast<std::int64_t>(a.kept.size());
  const bool collective = p.runner && p.runner->collective();
  if (nk == 0 && !collective) return;  // expert parallel: the exchange is collective, 0 rows included
  const Tensor xk = head(sc.xk, nk), gk = head(sc.gk, nk), yk = head(sc.yk, nk);
  gather(x, a.kept, xk);
  gather(a.router.gates, a.kept, gk);
  if (p.runner)
    p.runner->forward(a.plan, xk, gk, p.experts, head(a.experts, nk), yk);
  else
    ops::moe::forward(a.plan, xk, gk, p.experts, head(a.experts, nk), yk);
  scatter(yk, a.kept, y);
}

void moe_forward(const Shape& s, const MoeParams& p, const Tensor& x, const Tensor& prev_state, const Tensor& bias,
                 float eps, MoeActs& a, const MoeScratch& sc, const Tensor& y) {
  route(s, p, x, prev_state, bias, eps, a);
  experts_forward(s, p, x, a, sc, y);
}

void experts_backward(const Shape& s, const MoeParams& p, const MoeParams& g, const Tensor& x, MoeActs& a,
                      const MoeScratch& sc, const Tensor& dy, const Tensor& dx, const Tensor& dgates) {
  // The skip path writes the skip rows of dx and dgates; the scatters below write the routed
  // rows; together they cover every row.
  ops::zaya_router::skip_backward(x, a.router.idx.data(), a.router.gates, s.skip ? s.experts : -1, dy, dx, dgates);
  const std::int64_t nk = static_cast<std::int64_t>(a.kept.size());
  if (nk > 0 || (p.runner && p.runner->collective())) {
    const Tensor xk = head(sc.xk, nk), gk = head(sc.gk, nk), dyk = head(sc.dyk, nk), dxk = head(sc.dxk, nk),
                 dgk = head(sc.dgk, nk);
    gather(x, a.kept, xk);
    gather(a.router.gates, a.kept, gk);
    gather(dy, a.kept, dyk);
    if (p.runner)
      p.runner->backward(a.plan, xk, gk, p.experts, head(a.experts, nk), dyk, sc.experts, dxk, dgk, g.experts);
    else
      ops::moe::backward(a.plan, xk, gk, p.experts, head(a.experts, nk), dyk, sc.experts, dxk, dgk, g.experts);
    scatter(dxk, a.kept, dx);
    scatter(dgk, a.kept, dgates);
  }
}

void route_backward(const MoeParams& p, const MoeParams& g, const Tensor& x, const Tensor& prev_state, MoeActs& a,
                    const MoeScratch& sc, const Tensor& dgates, const Tensor& dstate_next, const Tensor& dx,
                    const Tensor& dprev_state, float aux_weight) {
  const bool group = !a.aux_counts.empty();
  ops::zaya_router::backward(x, prev_state, p.router, a.router, dgates, dstate_next, sc.dx_router, dprev_state,
                             g.router, sc.router, aux_weight, group ? a.aux_counts.data() : nullptr, a.aux_rows);
  const std::int64_t total = dx.numel();
  float* d = dx.data();
  const float* r = sc.dx_router.data();
  for (std::int64_t i = 0; i < total; ++i) d[i] += r[i];
}

void moe_backward(const Shape& s, const MoeParams& p, const MoeParams& g, const Tensor& x, const Tensor& prev_state,
                  MoeActs& a, const MoeScratch& sc, const Tensor& dy, const Tensor& dstate_next, const Tensor& dx,
                  const Tensor& dprev_state, float aux_weight) {
  experts_backward(s, p, g, x, a, sc, dy, dx, sc.dgates);
  route_backward(p, g, x, prev_state, a, sc, sc.dgates, dstate_next, dx, dprev_state, aux_weight);
}

}  // namespace keel::blocks::zaya
