#include "blocks/attention_decode.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "common/parallel_for.h"
#include "ops/attention.h"
#include "ops/linear.h"
#include "ops/linear_attention.h"

namespace keel::blocks {
namespace {

inline float dot(const float* a, const float* b, std::int64_t n) {
  float s = 0.f;
  for (std::int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Attention of one new query row per (sequence, head) over positions first..len-1 of the cache
// (the new token's k/v already appended; first > 0 in a sliding layer). q, out [B, Hq, Dh];
// caches [B, capacity, Hkv, Dh].
void cached_attention(const Tensor& q, const std::vector<float>& kc, const std::vector<float>& vc, int capacity,
                      std::int64_t first, std::int64_t len, std::int64_t hq, std::int64_t hkv, std::int64_t dh,
                      const Tensor& out) {
  const std::int64_t B = q.dim(0), group = hq / hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  // Threads only when a task has enough work to pay for starting them (common/parallel_for.h).
  const std::int64_t min_tasks = std::max<std::int64_t>(1, 65536 / std::max<std::int64_t>(1, len * dh));
  parallel_for(B * hq, min_tasks, [&](std::int64_t lo, std::int64_t hi) {
    std::vector<float> p(static_cast<std::size_t>(len));
    for (std::int64_t bh = lo; bh < hi; ++bh) {
      const std::int64_t b = bh / hq, h = bh % hq, g = h / group;
      const float* qi = q.data() + (b * hq + h) * dh;
      const float* kb = kc.data() + (b * capacity * hkv + g) * dh;
      const float* vb = vc.data() + (b * capacity * hkv + g) * dh;
      float m = -std::numeric_limits<float>::infinity();
      for (std::int64_t j = first; j < len; ++j) {
        p[j] = scale * dot(qi, kb + j * hkv * dh, dh);
        m = std::max(m, p[j]);
      }
      float sum = 0.f;
      for (std::int64_t j = first; j < len; ++j) sum += (p[j] = std::exp(p[j] - m));
      float* oi = out.data() + (b * hq + h) * dh;
      std::fill(oi, oi + dh, 0.f);
      const float inv = 1.f / sum;
      for (std::int64_t j = first; j < len; ++j) {
        const float w = p[j] * inv;
        const float* vj = vb + j * hkv * dh;
        for (std::int64_t c = 0; c < dh; ++c) oi[c] += w * vj[c];
      }
    }
  });
}

// Row t of sequence b of a [B*T, width] buffer into row `pos` of cache [B, capacity, width].
void put_row(std::vector<float>& cache, int capacity, std::int64_t b, std::int64_t pos, const float* src,
             std::int64_t width) {
  std::memcpy(cache.data() + (b * capacity + pos) * width, src, sizeof(float) * static_cast<std::size_t>(width));
}

// mha/gqa of the B new tokens (h [B, D], the normed input) at position `length`.
void mha_decode(const AttnShape& s, const LayerWeights& w, const Tensor& h, const std::int32_t* pos,
                const ops::rope::Table& rope, int window, int capacity, std::int64_t length, LayerCache& c,
                const AttnSaved& a, const Tensor& y) {
  const std::int64_t B = s.batch, Hq = s.heads, Hkv = s.kv_heads, Dh = s.head_dim, Q = Hq * Dh, KV = Hkv * Dh;
  const Tensor q = a.q.reshaped({B, Q}), k = a.k.reshaped({B, KV}), v = a.v.reshaped({B, KV});
  ops::linear::forward(h, w.wq, {}, q);
  ops::linear::forward(h, w.wk, {}, k);
  ops::linear::forward(h, w.wv, {}, v);
  ops::rope::forward(rope, q.reshaped({B, Hq, Dh}), pos, q.reshaped({B, Hq, Dh}));
  ops::rope::forward(rope, k.reshaped({B, Hkv, Dh}), pos, k.reshaped({B, Hkv, Dh}));
  for (std::int64_t b = 0; b < B; ++b) {
    put_row(c.k, capacity, b, length, k.row(b), KV);
    put_row(c.v, capacity, b, length, v.row(b), KV);
  }
  const Tensor att = a.att.reshaped({B, Hq, Dh});
  cached_attention(q.reshaped({B, Hq, Dh}), c.k, c.v, capacity, ops::attention::first_key(length, window), length + 1,
                   Hq, Hkv, Dh, att);
  ops::linear::forward(att.reshaped({B, Q}), w.wo, {}, y);
}

// CCA of the B new tokens at position `length`, from the conv states and the cache (ops/cca.h
// has the equations; this is its forward restricted to the last token). The cca Saved regions
// (carved for T = 1) are the scratch.
void cca_decode(const AttnShape& s, const LayerWeights& w, const Tensor& h, const std::int32_t* pos,
                const ops::rope::Table& rope, int window, int capacity, std::int64_t length, LayerCache& c,
                const AttnSaved& as, const Tensor& y) {
  const ops::cca::Params& p = w.cca;
  const ops::cca::Config& cc = s.cca;
  const std::int64_t B = s.batch, d = cc.head_dim, nq = cc.q_heads, nkv = cc.kv_heads, G = nq / nkv;
  const std::int64_t C = cc.qk_channels(), dq = nq * d, dk = nkv * d, half = dk / 2;
  const std::int64_t W0 = cc.conv0_width, W1 = cc.conv1_width;
  const Tensor qk0 = as.cca.qk0.reshaped({B, C}), c0(as.cca.c0.data(), {B, C}), a = as.cca.qk.reshaped({B, C});
  const Tensor q = as.cca.q.reshaped({B, dq}), k = as.cca.k.reshaped({B, dk}), u = as.cca.v.reshaped({B, dk});
  ops::linear::forward(h, p.w_qk, Tensor(), qk0);
  const float sqrt_d = static_cast<float>(std::sqrt(double(d)));
  const float* w0 = p.conv0_w.data();
  const float* w1 = p.conv1_w.data();
  parallel_for(B, 4, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t b = lo; b < hi; ++b) {
      float* st0 = c.conv0_in.data() + b * (W0 - 1) * C;  // [W0-1, C] oldest first
      float* st1 = c.conv1_in.data() + b * (W1 - 1) * C;  // [W1-1, C]
      const float* x0 = qk0.row(b);
      float* cr = c0.row(b);
      // Depthwise: tap W0-1 multiplies the current token, tap k < W0-1 state row k.
      for (std::int64_t ch = 0; ch < C; ++ch) {
        float acc = p.conv0_b[ch];
        for (std::int64_t kk = 0; kk < W0 - 1; ++kk) acc += w0[ch * W0 + kk] * st0[kk * C + ch];
        acc += w0[ch * W0 + W0 - 1] * x0[ch];
        cr[ch] = acc;
      }
      // Grouped: output channel o of group g = o / d reads the group's d channels at each tap.
      float* ar = a.row(b);
      for (std::int64_t o = 0; o < C; ++o) {
        const std::int64_t g0 = (o / d) * d;
        float acc = p.conv1_b[o];
        for (std::int64_t kk = 0; kk < W1; ++kk) {
          const float* src = kk < W1 - 1 ? st1 + kk * C + g0 : cr + g0;
          const float* wr = w1 + o * d * W1;
          for (std::int64_t i = 0; i < d; ++i) acc += wr[i * W1 + kk] * src[i];
        }
        ar[o] = acc;
      }
      // Slide the states by one token.
      if (W0 > 1) {
        std::memmove(st0, st0 + C, sizeof(float) * static_cast<std::size_t>((W0 - 2) * C));
        std::memcpy(st0 + (W0 - 2) * C, x0, sizeof(float) * static_cast<std::size_t>(C));
      }
      if (W1 > 1) {
        std::memmove(st1, st1 + C, sizeof(float) * static_cast<std::size_t>((W1 - 2) * C));
        std::memcpy(st1 + (W1 - 2) * C, cr, sizeof(float) * static_cast<std::size_t>(C));
      }
      // Mixing terms (pre-conv skips), then L2 normalization, sqrt(d) and the k temperature.
      for (std::int64_t g = 0; g < nkv; ++g) {
        const float* k0 = x0 + dq + g * d;
        float* ak = ar + dq + g * d;
        for (std::int64_t i = 0; i < d; ++i) {
          double mean_q = 0;
          for (std::int64_t j = 0; j < G; ++j) mean_q += x0[(g * G + j) * d + i];
          mean_q /= double(G);
          for (std::int64_t j = 0; j < G; ++j) ar[(g * G + j) * d + i] += 0.5f * (x0[(g * G + j) * d + i] + k0[i]);
          ak[i] += static_cast<float>(0.5 * mean_q + 0.5 * k0[i]);
        }
      }
      for (std::int64_t hh = 0; hh < nq + nkv; ++hh) {
        const float* ah = ar + hh * d;
        double ss = 0;
        for (std::int64_t i = 0; i < d; ++i) ss += double(ah[i]) * ah[i];
        const float rn = static_cast<float>(1.0 / std::sqrt(ss + double(cc.l2_eps)));
        float* out = hh < nq ? q.row(b) + hh * d : k.row(b) + (hh - nq) * d;
        const float scale = hh < nq ? sqrt_d * rn : p.temp[hh - nq] * sqrt_d * rn;
        for (std::int64_t i = 0; i < d; ++i) out[i] = ah[i] * scale;
      }
    }
  });
  ops::rope::forward(rope, q.reshaped({B, nq, d}), pos, q.reshaped({B, nq, d}));
  ops::rope::forward(rope, k.reshaped({B, nkv, d}), pos, k.reshaped({B, nkv, d}));
  // Values: [x_t W_v1^T | x_{t-1} W_v2^T]; this token's second half waits for the next one.
  ops::linear::forward(h, p.w_v, Tensor(), u);
  for (std::int64_t b = 0; b < B; ++b) {
    float* ur = u.row(b);
    float* pv = c.prev_v.data() + b * half;
    for (std::int64_t i = 0; i < half; ++i) std::swap(ur[half + i], pv[i]);
    put_row(c.k, capacity, b, length, k.row(b), dk);
    put_row(c.v, capacity, b, length, ur, dk);
  }
  const Tensor att = as.cca.att.reshaped({B, nq, d});
  cached_attention(q.reshaped({B, nq, d}), c.k, c.v, capacity, ops::attention::first_key(length, window), length + 1,
                   nq, nkv, d, att);
  ops::linear::forward(att.reshaped({B, dq}), p.w_o, Tensor(), y);
}

// Linear attention of the B new tokens: the state advanced by each token (ops::linear_attention::
// step), its output normalized per head, the output projection.
void linear_decode(const AttnShape& s, const LayerWeights& w, const Tensor& h, LayerCache& c, const AttnSaved& a,
                   const Tensor& y) {
  namespace la = ops::linear_attention;
  const std::int64_t B = s.batch, Hq = s.heads, Hkv = s.kv_heads, Dh = s.head_dim, Q = Hq * Dh, KV = Hkv * Dh;
  const Tensor q = a.q.reshaped({B, Q}), k = a.k.reshaped({B, KV}), v = a.v.reshaped({B, KV});
  ops::linear::forward(h, w.wq, {}, q);
  ops::linear::forward(h, w.wk, {}, k);
  ops::linear::forward(h, w.wv, {}, v);
  la::feature_forward(s.feature, q, q);
  la::feature_forward(s.feature, k, k);
  const Tensor att = a.att.reshaped({B, Q});
  la::step(s.linear, q, k, v, Tensor(c.state.data(), {B, Hkv, Dh, Dh}), att);
  const Tensor heads = att.reshaped({B * Hq, Dh});
  la::norm_forward(heads, s.eps, heads, a.rstd.reshaped({B * Hq}));
  ops::linear::forward(att, w.wo, {}, y);
}

}  // namespace

LayerCache make_layer_cache(const AttnShape& s, model::AttentionKind kind, const LayerWeights& w, int capacity) {
  const std::int64_t B = s.batch, kv = std::int64_t(s.kv_heads) * s.head_dim, C = s.cca.qk_channels();
  const bool cca = kind == model::AttentionKind::kCca;
  LayerCache c;
  if (kind == model::AttentionKind::kLinear) {
    c.state.assign(static_cast<std::size_t>(B * kv * s.head_dim), 0.f);
    return c;
  }
  c.k.assign(static_cast<std::size_t>(B * capacity * kv), 0.f);
  c.v.assign(c.k.size(), 0.f);
  if (cca) {
    c.conv0_in.assign(static_cast<std::size_t>(B * (s.cca.conv0_width - 1) * C), 0.f);
    // Before the sequence the grouped conv reads depthwise outputs of all-zero input: the bias.
    c.conv1_in.resize(static_cast<std::size_t>(B * (s.cca.conv1_width - 1) * C));
    for (std::size_t i = 0; i < c.conv1_in.size(); ++i) c.conv1_in[i] = w.cca.conv0_b[static_cast<std::int64_t>(i % C)];
    c.prev_v.assign(static_cast<std::size_t>(B * kv / 2), 0.f);
  }
  return c;
}

void fill_cache(const AttnShape& s, const LayerWeights& w, model::AttentionKind kind, const Tensor& h,
                const AttnSaved& a, int capacity, LayerCache& c) {
  const std::int64_t B = s.batch, T = s.seq, D = s.hidden, KV = std::int64_t(s.kv_heads) * s.head_dim;
  if (kind == model::AttentionKind::kLinear) {  // the state the prompt leaves (forward's k, v are feature-mapped)
    ops::linear_attention::local_states(s.linear, B, T, a.k.reshaped({B * T, KV}), a.v.reshaped({B * T, KV}),
                                        Tensor(c.state.data(), {B, s.kv_heads, s.head_dim, s.head_dim}));
    return;
  }
  if (kind != model::AttentionKind::kCca) {
    const Tensor k = a.k.reshaped({B * T, KV}), v = a.v.reshaped({B * T, KV});
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < T; ++t) {
        put_row(c.k, capacity, b, t, k.row(b * T + t), KV);
        put_row(c.v, capacity, b, t, v.row(b * T + t), KV);
      }
    return;
  }
  // Attention operands k and v, and the conv / value-shift states at the end.
  const ops::cca::Saved& sv = a.cca;
  const std::int64_t C = s.cca.qk_channels(), W0 = s.cca.conv0_width, W1 = s.cca.conv1_width, half = KV / 2;
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t t = 0; t < T; ++t) {
      put_row(c.k, capacity, b, t, sv.k.row(b * T + t), KV);
      put_row(c.v, capacity, b, t, sv.v.row(b * T + t), KV);
    }
    for (std::int64_t j = 0; j < W0 - 1; ++j) {
      const std::int64_t t = T - (W0 - 1) + j;
      float* dst = c.conv0_in.data() + (b * (W0 - 1) + j) * C;
      if (t >= 0)
        std::memcpy(dst, sv.qk0.row(b * T + t), sizeof(float) * static_cast<std::size_t>(C));
      else
        std::fill(dst, dst + C, 0.f);
    }
    // c0 rows are times -(W1-1) .. T-1; the last W1-1 of them are the grouped conv's state.
    for (std::int64_t j = 0; j < W1 - 1; ++j)
      std::memcpy(c.conv1_in.data() + (b * (W1 - 1) + j) * C, sv.c0.data() + (b * (T + W1 - 1) + T + j) * C,
                  sizeof(float) * static_cast<std::size_t>(C));
    // The last token's x W_v2^T (the forward's value shift dropped it): the next token's
    // previous-token values.
    const float* x_last = h.row(b * T + T - 1);
    for (std::int64_t i = 0; i < half; ++i) c.prev_v[b * half + i] = dot(x_last, w.cca.w_v.row(half + i), D);
  }
}

void attention_decode(const AttnShape& s, const LayerWeights& w, model::AttentionKind kind, const Tensor& h,
                      const std::int32_t* pos, const ops::rope::Table& rope, int window, int capacity,
                      std::int64_t length, LayerCache& c, const AttnSaved& a, const Tensor& y) {
  if (kind == model::AttentionKind::kLinear)
    linear_decode(s, w, h, c, a, y);
  else if (kind == model::AttentionKind::kCca)
    cca_decode(s, w, h, pos, rope, window, capacity, length, c, a, y);
  else
    mha_decode(s, w, h, pos, rope, window, capacity, length, c, a, y);
}

}  // namespace keel::blocks
