#include "ops/moe.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>

#include "common/error.h"
#include "common/parallel_for.h"
#include "ops/swiglu.h"

namespace keel::ops::moe {

Plan make_plan(const std::int32_t* expert_idx, std::int64_t tokens, int top_k, int experts) {
  if (top_k < 1 || experts < 1) fail("moe: need top_k >= 1 and experts >= 1, got {} and {}", top_k, experts);
  Plan p;
  p.tokens = tokens;
  p.top_k = top_k;
  p.experts = experts;
  const std::int64_t s = tokens * top_k;
  p.counts.assign(experts, 0);
  for (std::int64_t a = 0; a < s; ++a) {
    if (expert_idx[a] < 0 || expert_idx[a] >= experts)
      fail("moe: token {} choice {} routed to expert {}, outside [0, {})", a / top_k, a % top_k, expert_idx[a], experts);
    ++p.counts[expert_idx[a]];
  }
  p.offsets.assign(experts + 1, 0);
  for (int e = 0; e < experts; ++e) p.offsets[e + 1] = p.offsets[e] + p.counts[e];
  p.source.resize(s);
  p.position.resize(s);
  std::vector<std::int64_t> next(p.offsets.begin(), p.offsets.end() - 1);
  for (std::int64_t a = 0; a < s; ++a) {  // stable counting sort
    const std::int64_t slot = next[expert_idx[a]]++;
    p.source[slot] = static_cast<std::int32_t>(a);
    p.position[a] = static_cast<std::int32_t>(slot);
  }
  return p;
}

namespace {
struct Dims {
  std::int64_t n, d, f, s;
  int k, e;
};

Dims check(const Plan& plan, const Tensor& x, const Tensor& gates, const Weights& w, const Saved& sv) {
  if (x.ndim() != 2) fail("moe: x must be [N, D], got {}", x.shape_string());
  if (w.w_gate.ndim() != 3) fail("moe: W_gate must be [E, F, D], got {}", w.w_gate.shape_string());
  Dims s{x.dim(0), x.dim(1), w.w_gate.dim(1), plan.slots(), plan.top_k, plan.experts};
  if (plan.tokens != s.n) fail("moe: plan is for {} tokens, x has {}", plan.tokens, s.n);
  require_shape(gates, {s.n, s.k}, "moe gates");
  require_shape(w.w_gate, {s.e, s.f, s.d}, "moe W_gate");
  require_shape(w.w_up, {s.e, s.f, s.d}, "moe W_up");
  require_shape(w.w_down, {s.e, s.d, s.f}, "moe W_down");
  require_shape(sv.xs, {s.s, s.d}, "moe saved xs");
  require_shape(sv.h_gate, {s.s, s.f}, "moe saved h_gate");
  require_shape(sv.h_up, {s.s, s.f}, "moe saved h_up");
  require_shape(sv.act, {s.s, s.f}, "moe saved act");
  require_shape(sv.ys, {s.s, s.d}, "moe saved ys");
  return s;
}

// C[m, n] (ldc n) = alpha * op(A) op(B) + beta C, row-major, for the per-expert blocks.
void gemm(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, const float* a, std::int64_t lda, const float* b,
          std::int64_t ldb, float beta, float* c) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, int(m), int(n), int(k), 1.f, a,
              int(lda), b, int(ldb), beta, c, int(n));
}
}  // namespace

void forward(const Plan& plan, const Tensor& x, const Tensor& gates, const Weights& w, const Saved& sv, const Tensor& y) {
  const Dims s = check(plan, x, gates, w, sv);
  require_shape(y, {s.n, s.d}, "moe y");
  // Dispatch: gather each slot's token row into expert order.
  parallel_for(s.s, 256, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t slot = b; slot < e; ++slot) std::memcpy(sv.xs.row(slot), x.row(plan.source[slot] / s.k), sizeof(float) * s.d);
  });
  // Grouped expert MLPs: one GEMM per expert and projection over its contiguous block.
  for (int e = 0; e < s.e; ++e) {
    const std::int64_t off = plan.offsets[e], cnt = plan.counts[e];
    if (cnt == 0) continue;
    const float* xs = sv.xs.row(off);
    gemm(false, true, cnt, s.f, s.d, xs, s.d, w.w_gate.data() + e * s.f * s.d, s.d, 0.f, sv.h_gate.row(off));
    gemm(false, true, cnt, s.f, s.d, xs, s.d, w.w_up.data() + e * s.f * s.d, s.d, 0.f, sv.h_up.row(off));
    swiglu::forward_n(sv.h_gate.row(off), sv.h_up.row(off), sv.act.row(off), cnt * s.f);
    gemm(false, true, cnt, s.d, s.f, sv.act.row(off), s.f, w.w_down.data() + e * s.d * s.f, s.f, 0.f, sv.ys.row(off));
  }
  // Combine in token order (each token owns its output row: no races, fixed summation order).
  parallel_for(s.n, 64, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) {
      float* yr = y.row(i);
      std::fill(yr, yr + s.d, 0.f);
      for (int kk = 0; kk < s.k; ++kk) {
        const float g = gates.row(i)[kk];
        const float* src = sv.ys.row(plan.position[i * s.k + kk]);
        for (std::int64_t c = 0; c < s.d; ++c) yr[c] += g * src[c];
      }
    }
  });
}

std::int64_t backward_scratch_floats(std::int64_t slots, std::int64_t d, std::int64_t f) { return 2 * slots * d + 3 * slots * f; }

void backward(const Plan& plan, const Tensor& x, const Tensor& gates, const Weights& w, const Saved& sv, const Tensor& dy,
              const Tensor& scratch, const Tensor& dx, const Tensor& dgates, const Weights& dw) {
  const Dims s = check(plan, x, gates, w, sv);
  require_shape(dy, {s.n, s.d}, "moe dy");
  if (scratch.numel() < backward_scratch_floats(s.s, s.d, s.f))
    fail("moe: backward scratch has {} floats, needs {}", scratch.numel(), backward_scratch_floats(s.s, s.d, s.f));
  if (!dx.empty()) require_shape(dx, {s.n, s.d}, "moe dx");
  if (!dgates.empty()) require_shape(dgates, {s.n, s.k}, "moe dgates");
  if (!dw.w_gate.empty()) require_shape(dw.w_gate, {s.e, s.f, s.d}, "moe dW_gate");
  if (!dw.w_up.empty()) require_shape(dw.w_up, {s.e, s.f, s.d}, "moe dW_up");
  if (!dw.w_down.empty()) require_shape(dw.w_down, {s.e, s.d, s.f}, "moe dW_down");
  float* dys = scratch.data();      // [S, D]
  float* dxs = dys + s.s * s.d;     // [S, D]
  float* dact = dxs + s.s * s.d;    // [S, F]
  float* dhg = dact + s.s * s.f;    // [S, F]
  float* dhu = dhg + s.s * s.f;     // [S, F]
  // Combine backward: gate gradients and the gate-weighted output gradient per slot.
  parallel_for(s.n, 64, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) {
      const float* dyr = dy.row(i);
      for (int kk = 0; kk < s.k; ++kk) {
        const std::int64_t slot = plan.position[i * s.k + kk];
        const float* ysr = sv.ys.row(slot);
        if (!dgates.empty()) {
          float acc = 0.f;
          for (std::int64_t c = 0; c < s.d; ++c) acc += dyr[c] * ysr[c];
          dgates.row(i)[kk] = acc;
        }
        const float g = gates.row(i)[kk];
        float* d = dys + slot * s.d;
        for (std::int64_t c = 0; c < s.d; ++c) d[c] = g * dyr[c];
      }
    }
  });
  for (int e = 0; e < s.e; ++e) {
    const std::int64_t off = plan.offsets[e], cnt = plan.counts[e];
    if (cnt == 0) continue;
    const float* wg = w.w_gate.data() + e * s.f * s.d;
    const float* wu = w.w_up.data() + e * s.f * s.d;
    const float* wd = w.w_down.data() + e * s.d * s.f;
    const float* dyse = dys + off * s.d;
    // dW_down[e][D, F] += dys_e^T [D, cnt] * act_e [cnt, F]
    if (!dw.w_down.empty()) gemm(true, false, s.d, s.f, cnt, dyse, s.d, sv.act.row(off), s.f, 1.f, dw.w_down.data() + e * s.d * s.f);
    // dact_e [cnt, F] = dys_e [cnt, D] * W_down[e] [D, F]
    gemm(false, false, cnt, s.f, s.d, dyse, s.d, wd, s.f, 0.f, dact + off * s.f);
    swiglu::backward_n(sv.h_gate.row(off), sv.h_up.row(off), dact + off * s.f, dhg + off * s.f, dhu + off * s.f, cnt * s.f);
    // dW_gate[e][F, D] += dh_gate^T [F, cnt] * xs_e [cnt, D]; same for up.
    if (!dw.w_gate.empty()) gemm(true, false, s.f, s.d, cnt, dhg + off * s.f, s.f, sv.xs.row(off), s.d, 1.f, dw.w_gate.data() + e * s.f * s.d);
    if (!dw.w_up.empty()) gemm(true, false, s.f, s.d, cnt, dhu + off * s.f, s.f, sv.xs.row(off), s.d, 1.f, dw.w_up.data() + e * s.f * s.d);
    // dxs_e [cnt, D] = dh_gate W_gate[e] + dh_up W_up[e]
    if (!dx.empty()) {
      gemm(false, false, cnt, s.d, s.f, dhg + off * s.f, s.f, wg, s.d, 0.f, dxs + off * s.d);
      gemm(false, false, cnt, s.d, s.f, dhu + off * s.f, s.f, wu, s.d, 1.f, dxs + off * s.d);
    }
  }
  // Dispatch backward: sum each token's k slot gradients, in k order.
  if (!dx.empty()) {
    parallel_for(s.n, 64, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) {
        float* dxr = dx.row(i);
        std::fill(dxr, dxr + s.d, 0.f);
        for (int kk = 0; kk < s.k; ++kk) {
          const float* src = dxs + std::int64_t(plan.position[i * s.k + kk]) * s.d;
          for (std::int64_t c = 0; c < s.d; ++c) dxr[c] += src[c];
        }
      }
    });
  }
}

}  // namespace keel::ops::moe
