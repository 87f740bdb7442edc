#include "blocks/attention.h"

#include <algorithm>
#include <cmath>

#include "ops/linear.h"

namespace keel::blocks {
namespace {

// A [B, T, H, Dh] (or [N, X]) tensor seen as [N, rest].
Tensor rows(const Tensor& t, std::int64_t n) { return t.reshaped({n, t.numel() / n}); }

// The rows of a k or v projection (or its gradient) this rank's query heads read: all of it, or
// with kv heads replicated over the tensor group (AttnShape::kv_head0) one head's.
Tensor kv_rows(const AttnShape& s, const Tensor& w) {
  if (s.kv_head0 < 0 || w.empty()) return w;
  return Tensor(w.row(std::int64_t(s.kv_head0) * s.head_dim), {s.head_dim, w.dim(1)});
}

// CCA's config for this layer: the shape's, with the layer's window.
ops::cca::Config layer_cca(const AttnShape& s, const AttnContext& c) {
  ops::cca::Config cc = s.cca;
  cc.window = c.window;
  return cc;
}

// CCA's view of the split: none for whole sequences (no halos kept).
ops::SequenceSplit* split(const AttnShape& s, const AttnContext& c) { return s.segments > 0 ? c.core : nullptr; }

}  // namespace

float AttnShape::scale() const { return 1.0f / std::sqrt(static_cast<float>(head_dim)); }

AttnShape AttnShape::of(const model::ModelConfig& cfg, std::int64_t batch, std::int64_t seq, TensorSplit tp) {
  AttnShape s;
  s.batch = batch;
  s.seq = seq;
  s.hidden = cfg.hidden;
  s.heads = cfg.heads / tp.degree;
  s.head_dim = cfg.head_dim;
  if (tp.degree > cfg.kv_heads) {  // model::kv_replicated: the query heads of this rank share one kv head
    s.kv_heads = 1;
    s.kv_head0 = tp.rank * s.heads / (cfg.heads / cfg.kv_heads);
  } else {
    s.kv_heads = cfg.kv_heads / tp.degree;
  }
  s.cca = cca_config(cfg, tp);
  s.linear.heads = s.heads;
  s.linear.kv_heads = s.kv_heads;
  s.linear.head_dim = s.head_dim;
  s.linear.chunk = cfg.linear_chunk;
  if (cfg.linear_decay == "retnet")  // indexed by the model's kv head
    s.linear.decay = ops::linear_attention::retnet_decay(s.kv_head0 >= 0 ? s.kv_head0 : tp.rank * s.kv_heads, s.kv_heads);
  s.feature = ops::linear_attention::parse_feature(cfg.linear_feature);
  s.eps = cfg.norm_eps;
  return s;
}

AttnKinds AttnKinds::of(model::AttentionKind k) {
  AttnKinds a;
  a.cca = k == model::AttentionKind::kCca;
  a.linear = k == model::AttentionKind::kLinear;
  a.softmax = !a.cca && !a.linear;
  return a;
}

void carve(ArenaPlanner& p, const std::string& prefix, const AttnShape& s, AttnKinds kinds, AttnSaved& a) {
  const std::int64_t B = s.batch, T = s.seq, Hq = s.heads, Hkv = s.kv_heads, Dh = s.head_dim;
  if (kinds.softmax || kinds.linear) {
    a.q = p.tensor(prefix + "q", {B, T, Hq, Dh});
    a.k = p.tensor(prefix + "k", {B, T, Hkv, Dh});
    a.v = p.tensor(prefix + "v", {B, T, Hkv, Dh});
    a.att = p.tensor(prefix + "att", {B, T, Hq, Dh});
  }
  if (kinds.softmax) a.lse = p.tensor(prefix + "lse", {B, Hq, T});
  if (kinds.linear) {
    a.rstd = p.tensor(prefix + "rstd", {B * T * Hq});
    if (s.segments > 0) a.init = p.tensor(prefix + "init", {B * s.segments, Hkv, Dh, Dh});
  }
  if (kinds.cca) {
    const Tensor buf = p.tensor(prefix + "cca_saved", {ops::cca::saved_floats(s.cca, B, T, s.segments)});
    if (!p.sizing()) a.cca = ops::cca::carve_saved(s.cca, B, T, buf.data(), s.segments);
  }
}

void carve(ArenaPlanner& p, const AttnShape& s, AttnKinds kinds, AttnScratch& sc) {
  const std::int64_t B = s.batch, T = s.seq, Hq = s.heads, Hkv = s.kv_heads, Dh = s.head_dim;
  if (kinds.softmax || kinds.linear) {
    sc.dq = p.tensor("bwd.dq", {B, T, Hq, Dh});
    sc.dk = p.tensor("bwd.dk", {B, T, Hkv, Dh});
    sc.dv = p.tensor("bwd.dv", {B, T, Hkv, Dh});
    sc.datt = p.tensor("bwd.datt", {B, T, Hq, Dh});
  }
  if (kinds.cca) sc.cca = p.tensor("bwd.cca_scratch", {ops::cca::backward_scratch_floats(s.cca, B, T, s.segments)});
}

void attention_forward(const AttnShape& s, const LayerWeights& w, model::AttentionKind kind, const Tensor& h,
                       const AttnContext& c, const AttnSaved& a, const Tensor& y) {
  const std::int64_t N = s.tokens();
  const Tensor x = c.linear->enter(h), out = c.linear->out(y);
  if (kind == model::AttentionKind::kCca) {
    ops::cca::forward(layer_cca(s, c), s.batch, s.seq, x, c.pos, *c.rope, w.cca, a.cca, out, split(s, c));
    c.linear->exit(out, y);
    return;
  }
  if (kind == model::AttentionKind::kLinear) {
    // k and v first: the core's exchange that needs only them (LASP-2's states) starts before
    // the q projection, which computes while it travels
    namespace la = ops::linear_attention;
    const std::int64_t runs = s.batch * std::max(s.segments, 1);
    ops::linear::forward(x, kv_rows(s, w.wk), {}, rows(a.k, N));
    ops::linear::forward(x, kv_rows(s, w.wv), {}, rows(a.v, N));
    la::feature_forward(s.feature, a.k, a.k);
    c.core->begin_linear(s.linear, runs, rows(a.k, N), rows(a.v, N));
    ops::linear::forward(x, w.wq, {}, rows(a.q, N));
    la::feature_forward(s.feature, a.q, a.q);
    c.core->attend_linear(s.linear, runs, rows(a.q, N), rows(a.k, N), rows(a.v, N), a.init, rows(a.att, N));
    const Tensor heads = a.att.reshaped({N * s.heads, s.head_dim});
    la::norm_forward(heads, s.eps, heads, a.rstd);
    ops::linear::forward(rows(a.att, N), w.wo, {}, out);
    c.linear->exit(out, y);
    return;
  }
  ops::linear::forward(x, w.wq, {}, rows(a.q, N));
  ops::linear::forward(x, kv_rows(s, w.wk), {}, rows(a.k, N));
  ops::linear::forward(x, kv_rows(s, w.wv), {}, rows(a.v, N));
  const Tensor q3 = a.q.reshaped({N, s.heads, s.head_dim}), k3 = a.k.reshaped({N, s.kv_heads, s.head_dim});
  ops::rope::forward(*c.rope, q3, c.pos, q3);
  ops::rope::forward(*c.rope, k3, c.pos, k3);
  c.core->attend(a.q, a.k, a.v, s.scale(), c.window, a.att, a.lse);
  ops::linear::forward(rows(a.att, N), w.wo, {}, out);
  c.linear->exit(out, y);
}

void attention_backward(const AttnShape& s, const LayerWeights& w, LayerWeights& g, model::AttentionKind kind,
                        const Tensor& h, const AttnContext& c, const AttnSaved& a, const AttnScratch& sc,
                        const Tensor& dy, const Tensor& dh) {
  const std::int64_t N = s.tokens();
  const Tensor x = c.linear->enter(h);  // the rows forward's projections read
  const Tensor g_out = c.linear->exit_backward(dy), dx = c.linear->dx_out(dh);
  if (kind == model::AttentionKind::kCca) {
    ops::cca::backward(layer_cca(s, c), s.batch, s.seq, x, c.pos, *c.rope, w.cca, a.cca, g_out, dx, g.cca, sc.cca,
                       split(s, c));
    c.linear->enter_backward(dx, dh);
    return;
  }
  if (kind == model::AttentionKind::kLinear) {
    // the output projection's input gradient, the core's exchange begun from it (LASP-2's
    // initial-state gradients), then its weight gradient while that travels
    namespace la = ops::linear_attention;
    const std::int64_t runs = s.batch * std::max(s.segments, 1);
    ops::linear::backward(rows(a.att, N), w.wo, g_out, rows(sc.datt, N), {}, {});
    const Tensor dheads = sc.datt.reshaped({N * s.heads, s.head_dim});
    la::norm_backward(a.att.reshaped({N * s.heads, s.head_dim}), a.rstd, dheads, dheads);
    c.core->begin_linear_backward(s.linear, runs, rows(a.q, N), rows(sc.datt, N));
    ops::linear::backward(rows(a.att, N), w.wo, g_out, {}, g.wo, {});
    c.core->attend_linear_backward(s.linear, runs, rows(a.q, N), rows(a.k, N), rows(a.v, N), a.init, rows(sc.datt, N),
                                   rows(sc.dq, N), rows(sc.dk, N), rows(sc.dv, N));
    la::feature_backward(s.feature, a.q, sc.dq, sc.dq);
    la::feature_backward(s.feature, a.k, sc.dk, sc.dk);
  } else {
    ops::linear::backward(rows(a.att, N), w.wo, g_out, rows(sc.datt, N), g.wo, {});
    c.core->attend_backward(a.q, a.k, a.v, a.att, a.lse, sc.datt, s.scale(), c.window, sc.dq, sc.dk, sc.dv);
    const Tensor dq3 = sc.dq.reshaped({N, s.heads, s.head_dim}), dk3 = sc.dk.reshaped({N, s.kv_heads, s.head_dim});
    ops::rope::backward(*c.rope, dq3, c.pos, dq3);
    ops::rope::backward(*c.rope, dk3, c.pos, dk3);
  }
  ops::linear::backward(x, w.wq, rows(sc.dq, N), dx, g.wq, {});
  ops::linear::backward(x, kv_rows(s, w.wk), rows(sc.dk, N), sc.tmp, kv_rows(s, g.wk), {});
  add_into(dx, sc.tmp);
  ops::linear::backward(x, kv_rows(s, w.wv), rows(sc.dv, N), sc.tmp, kv_rows(s, g.wv), {});
  add_into(dx, sc.tmp);
  c.linear->enter_backward(dx, dh);
}

}  // namespace keel::blocks
