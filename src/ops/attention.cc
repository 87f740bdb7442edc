#include "ops/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/error.h"
#include "common/parallel_for.h"

namespace keel::ops::attention {

namespace {
struct Dims {
  std::int64_t b, tq, tk, hq, hkv, d, group;
};

// q_pos == nullptr: forward()/backward() (Tk = Tq, query row t at position t); otherwise the _at
// variants (Tk from k, every q_pos[t] checked to lie in [0, Tk)); block: the block variants (Tk
// from k, q_pos and k_pos required, any values).
Dims check(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
           const std::int32_t* q_pos, int window, bool block = false, const std::int32_t* k_pos = nullptr) {
  if (block && (!q_pos || !k_pos)) fail("attention block: q_pos and k_pos must both be given");
  if (q.ndim() != 4 || k.ndim() != 4) fail("attention: q and k must be [B, T, H, Dh], got {} and {}", q.shape_string(), k.shape_string());
  if (window < 0) fail("attention: window {} must be >= 0 (0: full causal)", window);
  Dims s{q.dim(0), q.dim(1), q_pos ? k.dim(1) : q.dim(1), q.dim(2), k.dim(2), q.dim(3), 0};
  if (s.hkv <= 0 || s.hq % s.hkv) fail("attention: {} query heads do not split into groups over {} kv heads", s.hq, s.hkv);
  s.group = s.hq / s.hkv;
  require_shape(k, {s.b, s.tk, s.hkv, s.d}, "attention k");
  require_shape(v, {s.b, s.tk, s.hkv, s.d}, "attention v");
  require_shape(out, {s.b, s.tq, s.hq, s.d}, "attention out");
  require_shape(lse, {s.b, s.hq, s.tq}, "attention lse");
  if (q_pos && !block)
    for (std::int64_t t = 0; t < s.tq; ++t)
      if (q_pos[t] < 0 || q_pos[t] >= s.tk)
        fail("attention: q_pos[{}] = {} is outside the {} keys [0, {})", t, q_pos[t], s.tk, s.tk);
  return s;
}

inline float dot(const float* a, const float* b, std::int64_t n) {
  float s = 0.f;
  for (std::int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// The keys query row i reads, ascending: the prefix first_key(p, W)..p of the sequence's keys
// (forward / forward_at: p = q_pos[i], or i), or a block's keys at explicit positions k_pos (those
// it sees). fn(j) for each.
struct Keys {
  const std::int32_t* q_pos;  // null: row i at position i
  const std::int32_t* k_pos;  // null: key j at position j (the prefix form)
  std::int64_t tk;
  int window;
  template <typename Fn>
  void each(std::int64_t i, Fn&& fn) const {
    const std::int64_t pi = q_pos ? q_pos[i] : i;
    if (!k_pos) {
      for (std::int64_t j = first_key(pi, window); j <= pi; ++j) fn(j);
      return;
    }
    for (std::int64_t j = 0; j < tk; ++j)
      if (k_pos[j] <= pi && k_pos[j] >= first_key(pi, window)) fn(j);
  }
};

// The one forward of every entry point. A row that sees no key (a block's only): out 0, lse -inf.
void forward_impl(const Dims& s, const Keys& keys, const Tensor& q, const Tensor& k, const Tensor& v, float scale,
                  const Tensor& out, const Tensor& lse) {
  // Element pointers: q/out row (b, i, h) at ((b*Tq + i)*Hq + h)*Dh, k/v at ((b*Tk + j)*Hkv + g)*Dh.
  auto qp = [&](const Tensor& x, std::int64_t b, std::int64_t i, std::int64_t h) { return x.data() + ((b * s.tq + i) * s.hq + h) * s.d; };
  auto kp = [&](const Tensor& x, std::int64_t b, std::int64_t j, std::int64_t g) { return x.data() + ((b * s.tk + j) * s.hkv + g) * s.d; };
  parallel_for(s.b * s.hq, 1, [&](std::int64_t begin, std::int64_t end) {
    std::vector<float> p(static_cast<std::size_t>(s.tk));  // p[j] for keys the row does not read is never read
    for (std::int64_t bh = begin; bh < end; ++bh) {
      const std::int64_t b = bh / s.hq, h = bh % s.hq, g = h / s.group;
      for (std::int64_t i = 0; i < s.tq; ++i) {
        const float* qi = qp(q, b, i, h);
        float m = -std::numeric_limits<float>::infinity();
        keys.each(i, [&](std::int64_t j) { m = std::max(m, p[j] = scale * dot(qi, kp(k, b, j, g), s.d)); });
        float* oi = qp(out, b, i, h);
        std::fill(oi, oi + s.d, 0.f);
        float& l = lse.data()[(b * s.hq + h) * s.tq + i];
        if (m == -std::numeric_limits<float>::infinity()) {  // no key visible
          l = m;
          continue;
        }
        float sum = 0.f;
        keys.each(i, [&](std::int64_t j) { sum += (p[j] = std::exp(p[j] - m)); });
        const float inv = 1.f / sum;
        keys.each(i, [&](std::int64_t j) {
          const float w = p[j] * inv;
          const float* vj = kp(v, b, j, g);
          for (std::int64_t c = 0; c < s.d; ++c) oi[c] += w * vj[c];
        });
        l = m + std::log(sum);
      }
    }
  });
}

// The one backward of every entry point: dk, dv overwritten; dq overwritten, or added into
// (accumulate_dq: a block's share).
void backward_impl(const Dims& s, const Keys& keys, const Tensor& q, const Tensor& k, const Tensor& v,
                   const Tensor& out, const Tensor& lse, const Tensor& dout, float scale, const Tensor& dq,
                   const Tensor& dk, const Tensor& dv, bool accumulate_dq) {
  require_shape(dout, {s.b, s.tq, s.hq, s.d}, "attention dout");
  require_shape(dq, {s.b, s.tq, s.hq, s.d}, "attention dq");
  require_shape(dk, {s.b, s.tk, s.hkv, s.d}, "attention dk");
  require_shape(dv, {s.b, s.tk, s.hkv, s.d}, "attention dv");
  auto qp = [&](const Tensor& x, std::int64_t b, std::int64_t i, std::int64_t h) { return x.data() + ((b * s.tq + i) * s.hq + h) * s.d; };
  auto kp = [&](const Tensor& x, std::int64_t b, std::int64_t j, std::int64_t g) { return x.data() + ((b * s.tk + j) * s.hkv + g) * s.d; };
  // One task per (sequence, kv head): it owns dk/dv of that kv head (all Tk keys, zeroed here,
  // so keys no query attends come out zero) and dq of the query heads of its group, so no two
  // threads ever add into the same element.
  parallel_for(s.b * s.hkv, 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t bg = begin; bg < end; ++bg) {
      const std::int64_t b = bg / s.hkv, g = bg % s.hkv;
      for (std::int64_t j = 0; j < s.tk; ++j) {
        std::fill(kp(dk, b, j, g), kp(dk, b, j, g) + s.d, 0.f);
        std::fill(kp(dv, b, j, g), kp(dv, b, j, g) + s.d, 0.f);
      }
      for (std::int64_t h = g * s.group; h < (g + 1) * s.group; ++h) {
        for (std::int64_t i = 0; i < s.tq; ++i) {
          const float* qi = qp(q, b, i, h);
          const float* doi = qp(dout, b, i, h);
          float* dqi = qp(dq, b, i, h);
          if (!accumulate_dq) std::fill(dqi, dqi + s.d, 0.f);
          const float di = dot(doi, qp(out, b, i, h), s.d);
          const float li = lse.data()[(b * s.hq + h) * s.tq + i];
          keys.each(i, [&](std::int64_t j) {
            const float* kj = kp(k, b, j, g);
            const float* vj = kp(v, b, j, g);
            const float pij = std::exp(scale * dot(qi, kj, s.d) - li);
            const float ds = pij * (dot(doi, vj, s.d) - di) * scale;
            float* dkj = kp(dk, b, j, g);
            float* dvj = kp(dv, b, j, g);
            for (std::int64_t c = 0; c < s.d; ++c) {
              dqi[c] += ds * kj[c];
              dkj[c] += ds * qi[c];
              dvj[c] += pij * doi[c];
            }
          });
        }
      }
    }
  });
}

}  // namespace

void forward_block(const Tensor& q, const Tensor& k, const Tensor& v, const std::int32_t* q_pos,
                   const std::int32_t* k_pos, float scale, const Tensor& out, const Tensor& lse, int window) {
  const Dims s = check(q, k, v, out, lse, q_pos, window, true, k_pos);
  forward_impl(s, {q_pos, k_pos, s.tk, window}, q, k, v, scale, out, lse);
}

void merge(const Tensor& block_out, const Tensor& block_lse, const Tensor& out, const Tensor& lse) {
  if (out.ndim() != 4) fail("attention merge: out must be [B, T, H, Dh], got {}", out.shape_string());
  const std::int64_t B = out.dim(0), T = out.dim(1), H = out.dim(2), D = out.dim(3);
  require_shape(block_out, {B, T, H, D}, "attention merge block out");
  require_shape(lse, {B, H, T}, "attention merge lse");
  require_shape(block_lse, {B, H, T}, "attention merge block lse");
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  parallel_for(B * H, 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t bh = begin; bh < end; ++bh) {
      const std::int64_t b = bh / H, h = bh % H;
      for (std::int64_t t = 0; t < T; ++t) {
        const float la = lse.data()[bh * T + t], lb = block_lse.data()[bh * T + t];
        if (lb == kNone) continue;
        float* o = out.data() + ((b * T + t) * H + h) * D;
        const float* ob = block_out.data() + ((b * T + t) * H + h) * D;
        if (la == kNone) {
          std::copy(ob, ob + D, o);
          lse.data()[bh * T + t] = lb;
          continue;
        }
        const float m = std::max(la, lb), wa = std::exp(la - m), wb = std::exp(lb - m), sum = wa + wb;
        const float ca = wa / sum, cb = wb / sum;
        for (std::int64_t c = 0; c < D; ++c) o[c] = ca * o[c] + cb * ob[c];
        lse.data()[bh * T + t] = m + std::log(sum);
      }
    }
  });
}

void backward_block(const Tensor& q, const Tensor& k, const Tensor& v, const std::int32_t* q_pos,
                    const std::int32_t* k_pos, const Tensor& out, const Tensor& lse, const Tensor& dout, float scale,
                    const Tensor& dq, const Tensor& dk, const Tensor& dv, int window) {
  const Dims s = check(q, k, v, out, lse, q_pos, window, true, k_pos);
  backward_impl(s, {q_pos, k_pos, s.tk, window}, q, k, v, out, lse, dout, scale, dq, dk, dv, true);
}

void forward(const Tensor& q, const Tensor& k, const Tensor& v, float scale, const Tensor& out, const Tensor& lse,
             int window) {
  const Dims s = check(q, k, v, out, lse, nullptr, window);
  forward_impl(s, {nullptr, nullptr, s.tk, window}, q, k, v, scale, out, lse);
}

void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& dout,
              float scale, const Tensor& dq, const Tensor& dk, const Tensor& dv, int window) {
  const Dims s = check(q, k, v, out, lse, nullptr, window);
  backward_impl(s, {nullptr, nullptr, s.tk, window}, q, k, v, out, lse, dout, scale, dq, dk, dv, false);
}

void forward_at(const Tensor& q, const Tensor& k, const Tensor& v, const std::int32_t* q_pos, float scale,
                const Tensor& out, const Tensor& lse, int window) {
  if (!q_pos) fail("attention forward_at: q_pos is null (one key position per query row is required)");
  const Dims s = check(q, k, v, out, lse, q_pos, window);
  forward_impl(s, {q_pos, nullptr, s.tk, window}, q, k, v, scale, out, lse);
}

void backward_at(const Tensor& q, const Tensor& k, const Tensor& v, const std::int32_t* q_pos, const Tensor& out,
                 const Tensor& lse, const Tensor& dout, float scale, const Tensor& dq, const Tensor& dk,
                 const Tensor& dv, int window) {
  if (!q_pos) fail("attention backward_at: q_pos is null (one key position per query row is required)");
  const Dims s = check(q, k, v, out, lse, q_pos, window);
  backward_impl(s, {q_pos, nullptr, s.tk, window}, q, k, v, out, lse, dout, scale, dq, dk, dv, false);
}

}  // namespace keel::ops::attention
