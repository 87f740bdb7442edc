#include "blocks/cuda/attention.h"

#include <algorithm>
#include <cmath>

#include "blocks/weights.h"
#include "ops/cuda/cast.h"
#include "ops/cuda/linear.h"
#include "ops/cuda/linear_attention.h"

namespace keel::blocks::cuda {

namespace k = ops::cuda;

namespace {
// CCA's config for this layer: the shape's, with the layer's window.
k::cca::Config layer_cca(const AttnShape& s, const AttnContext& p) {
  k::cca::Config cc = s.cca;
  cc.window = p.window;
  return cc;
}

// CCA's view of the split: none for whole sequences (no halos kept).
AttentionCore* split(const AttnShape& s, const AttnContext& p) { return s.segments > 0 ? p.core : nullptr; }
}  // namespace

// Linear attention's runs: B sequences x segments (1 for whole sequences) of seq / segments tokens.
static std::int64_t linear_runs(const AttnShape& s) { return s.batch * std::max(s.segments, 1); }

void carve(DeviceCarver& c, const AttnShape& s, AttnKinds kinds, AttnSaved& a) {
  const std::int64_t N = s.tokens(), Q = s.q_dim(), KV = s.kv_dim();
  if (kinds.softmax || kinds.linear) {
    a.q = c.take<bf16>(N * Q);
    a.k = c.take<bf16>(N * KV);
    a.v = c.take<bf16>(N * KV);
    a.att = c.take<bf16>(N * Q);
  }
  if (kinds.softmax) a.lse = c.take<float>(s.batch * s.heads * s.seq);
  if (kinds.linear) {
    a.rstd = c.take<float>(N * s.heads);
    if (s.segments > 0) a.init = c.take<float>(linear_runs(s) * KV * s.head_dim);
  }
  if (kinds.cca) {
    std::byte* buf =
        c.take<std::byte>(static_cast<std::int64_t>(k::cca::saved_bytes(s.cca, s.batch, s.seq, s.segments)));
    if (buf) a.cca = k::cca::carve_saved(s.cca, s.batch, s.seq, buf, s.segments);
  }
}

void carve(DeviceCarver& c, const AttnShape& s, AttnKinds kinds, const AttentionCore& core, AttnScratch& sc) {
  const std::int64_t N = s.tokens(), Q = s.q_dim(), KV = s.kv_dim();
  if (kinds.softmax || kinds.linear) {
    sc.datt = c.take<bf16>(N * Q);
    sc.dq = c.take<bf16>(N * Q);
    sc.dk = c.take<bf16>(N * KV);
    sc.dv = c.take<bf16>(N * KV);
  }
  if (kinds.softmax)
    sc.attn = c.take<std::byte>(static_cast<std::int64_t>(
        core.backward_workspace_bytes(static_cast<int>(s.batch), static_cast<int>(s.seq), s.heads, s.kv_heads, s.head_dim)));
  if (kinds.linear)
    sc.linear = c.take<std::byte>(
        static_cast<std::int64_t>(core.linear_workspace_bytes(s.linear, linear_runs(s), N / linear_runs(s))));
  if (kinds.cca)
    sc.cca = c.take<std::byte>(
        static_cast<std::int64_t>(k::cca::backward_scratch_bytes(s.cca, s.batch, s.seq, s.segments)));
}

// kv heads replicated over the tensor group (AttnShape::kv_head0): this rank's query heads read
// the rows of one head of the whole k and v projections.
static const bf16* kv_rows(const AttnShape& s, const bf16* w) {
  return s.kv_head0 < 0 || !w ? w : w + std::int64_t(s.kv_head0) * s.head_dim * s.hidden;
}
static float* kv_rows(const AttnShape& s, float* g) {
  return s.kv_head0 < 0 || !g ? g : g + std::int64_t(s.kv_head0) * s.head_dim * s.hidden;
}

void attention_forward(k::GemmRunner& gemm, const AttnShape& s, const LayerWeights& w, const bf16* h,
                       const AttnContext& p, const AttnSaved& a, float* add_into, bf16* out, cudaStream_t stream) {
  const std::int64_t N = s.tokens(), D = s.hidden, Q = s.q_dim(), KV = s.kv_dim(), R = p.linear->rows(N);
  const bf16* x = p.linear->enter(h, N, D, stream);
  if (w.cca) {
    bf16* partial = p.linear->out(out, N, D);
    k::cca::forward(gemm, layer_cca(s, p), s.batch, s.seq, x, p.pos, *p.rope, w.cca_w, a.cca, partial, stream,
                    split(s, p));
    p.linear->exit(partial, out, N, D, stream);
    if (add_into) k::add_bf16_to_f32(out, add_into, R * D, stream);
    return;
  }
  if (w.linear) {
    // k and v first: the core's exchange that needs only them (LASP-2's states, on its side
    // stream) starts before the q projection, which computes while it travels
    namespace la = k::linear_attention;
    const std::int64_t runs = linear_runs(s);
    k::linear::forward(gemm, x, kv_rows(s, w.wk), a.k, N, D, KV, stream);
    k::linear::forward(gemm, x, kv_rows(s, w.wv), a.v, N, D, KV, stream);
    la::feature_forward(s.feature, a.k, a.k, N * KV, stream);
    p.core->begin_linear(s.linear, runs, N / runs, a.k, a.v, stream);
    k::linear::forward(gemm, x, w.wq, a.q, N, D, Q, stream);
    la::feature_forward(s.feature, a.q, a.q, N * Q, stream);
    // forward's workspace is the backward scratch's (layers run one at a time)
    p.core->attend_linear(s.linear, runs, N / runs, a.q, a.k, a.v, a.init, a.att, p.linear_workspace, stream);
    la::norm_forward(a.att, N * s.heads, s.head_dim, s.eps, a.att, a.rstd, stream);
  } else {
    k::linear::forward(gemm, x, w.wq, a.q, N, D, Q, stream);
    k::linear::forward(gemm, x, kv_rows(s, w.wk), a.k, N, D, KV, stream);
    k::linear::forward(gemm, x, kv_rows(s, w.wv), a.v, N, D, KV, stream);
    k::rope::forward(*p.rope, a.q, p.pos, N, s.heads, stream);
    k::rope::forward(*p.rope, a.k, p.pos, N, s.kv_heads, stream);
    p.core->forward(a.q, a.k, a.v, a.att, a.lse, static_cast<int>(s.batch), static_cast<int>(s.seq), s.heads,
                    s.kv_heads, s.head_dim, s.scale(), p.window, stream);
  }
  if (add_into && p.linear->output_is_whole()) {
    // add_into += att Wo^T: the residual add rides in the GEMM (fp32 C, beta = 1)
    k::GemmDesc d;
    d.m = N, d.n = D, d.k = Q, d.trans_b = true, d.c_type = k::GemmOut::kFp32, d.beta = 1.f;
    gemm.run(d, a.att, w.wo, add_into, stream);
    return;
  }
  bf16* partial = p.linear->out(out, N, D);
  k::linear::forward(gemm, a.att, w.wo, partial, N, Q, D, stream);
  p.linear->exit(partial, out, N, D, stream);
  if (add_into) k::add_bf16_to_f32(out, add_into, R * D, stream);
}

void attention_backward(k::GemmRunner& gemm, const AttnShape& s, const LayerWeights& w, const LayerGrads& g,
                        const bf16* h, const AttnContext& p, const AttnSaved& a, const AttnScratch& sc, const bf16* dy,
                        bf16* dh, cudaStream_t stream) {
  const std::int64_t N = s.tokens(), D = s.hidden, Q = s.q_dim(), KV = s.kv_dim(), R = p.linear->rows(N);
  const bf16* x = p.linear->enter(h, N, D, stream);  // the rows forward's projections read
  const bf16* g_out = p.linear->exit_backward(dy, N, D, stream);
  if (w.cca) {
    bf16* dpart = p.linear->dx_out(dh, N, D);
    k::cca::backward(gemm, layer_cca(s, p), s.batch, s.seq, x, p.pos, *p.rope, w.cca_w, a.cca, g_out, dpart, g.cca,
                     sc.cca, stream, split(s, p));
    p.linear->enter_backward(dpart, dh, N, D, stream);
    return;
  }
  if (w.linear) {
    // the output projection's input gradient, the core's exchange begun from it (LASP-2's
    // initial-state gradients, on its side stream), then its weight gradient while that travels
    namespace la = k::linear_attention;
    const std::int64_t runs = linear_runs(s);
    k::linear::backward(gemm, a.att, w.wo, g_out, sc.datt, nullptr, N, Q, D, stream);
    la::norm_backward(a.att, a.rstd, sc.datt, sc.datt, N * s.heads, s.head_dim, stream);
    p.core->begin_linear_backward(s.linear, runs, N / runs, a.q, sc.datt, stream);
    k::linear::backward(gemm, a.att, w.wo, g_out, nullptr, g.wo, N, Q, D, stream);
    p.core->attend_linear_backward(s.linear, runs, N / runs, a.q, a.k, a.v, a.init, sc.datt, sc.dq, sc.dk, sc.dv,
                                   sc.linear, stream);
    la::feature_backward(s.feature, a.q, sc.dq, sc.dq, N * Q, stream);
    la::feature_backward(s.feature, a.k, sc.dk, sc.dk, N * KV, stream);
  } else {
    k::linear::backward(gemm, a.att, w.wo, g_out, sc.datt, g.wo, N, Q, D, stream);
    p.core->backward(a.q, a.k, a.v, a.att, a.lse, sc.datt, sc.dq, sc.dk, sc.dv, sc.attn, static_cast<int>(s.batch),
                     static_cast<int>(s.seq), s.heads, s.kv_heads, s.head_dim, s.scale(), p.window, stream);
    k::rope::backward(*p.rope, sc.dq, p.pos, N, s.heads, stream);
    k::rope::backward(*p.rope, sc.dk, p.pos, N, s.kv_heads, stream);
  }
  k::linear::backward(gemm, x, w.wq, sc.dq, nullptr, g.wq, N, D, Q, stream);
  k::linear::backward(gemm, x, kv_rows(s, w.wk), sc.dk, nullptr, kv_rows(s, g.wk), N, D, KV, stream);
  k::linear::backward(gemm, x, kv_rows(s, w.wv), sc.dv, nullptr, kv_rows(s, g.wv), N, D, KV, stream);
  // dh = dq Wq + dk Wk + dv Wv, summed in fp32 (over the group too), then rounded once
  float* dpart = p.linear->dx_out(sc.dh, N, D);
  auto dgemm = [&](std::int64_t kk, const bf16* da, const bf16* wt, float beta) {
    k::GemmDesc d;
    d.m = N, d.n = D, d.k = kk, d.c_type = k::GemmOut::kFp32, d.beta = beta;
    gemm.run(d, da, wt, dpart, stream);
  };
  dgemm(Q, sc.dq, w.wq, 0.f);
  dgemm(KV, sc.dk, kv_rows(s, w.wk), 1.f);
  dgemm(KV, sc.dv, kv_rows(s, w.wv), 1.f);
  p.linear->enter_backward(dpart, sc.dh, N, D, stream);
  k::f32_to_bf16(sc.dh, dh, R * D, stream);
}

}  // namespace keel::blocks::cuda
