#include "ops/cca.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "common/error.h"
#include "ops/attention.h"
#include "ops/causal_conv.h"
#include "ops/linear.h"
#include "common/parallel_for.h"

namespace keel::ops::cca {

namespace {
// Config::attend_q0 / attend_q: a range of query heads inside one kv group, or none.
void check_attended(const Config& c) {
  if (c.attend_q == 0 && c.attend_q0 == 0) return;
  const std::int64_t G = c.q_heads / c.kv_heads, last = c.attend_q0 + c.attend_q - 1;
  if (c.attend_q < 1 || c.attend_q0 < 0 || last >= c.q_heads || (c.attends_part() && c.attend_q0 / G != last / G))
    fail("cca: attended query heads [{}, {}) must lie inside one kv group of {} query heads (of {})", c.attend_q0,
         c.attend_q0 + c.attend_q, G, c.q_heads);
}

// Attending a part: columns [c0, c0 + w) of each of the n rows of src (row length ld) to dst
// (rows of w), or back (to_src, into src's columns).
void copy_columns(float* src, std::int64_t ld, std::int64_t c0, std::int64_t w, float* dst, std::int64_t n,
                  bool to_src) {
  for (std::int64_t i = 0; i < n; ++i) {
    float* a = src + i * ld + c0;
    float* b = dst + i * w;
    if (to_src) std::memcpy(a, b, sizeof(float) * w);
    else std::memcpy(b, a, sizeof(float) * w);
  }
}

void check_config(const Config& c, std::int64_t B, std::int64_t T, const rope::Table& rt) {
  if (c.hidden <= 0 || c.q_heads <= 0 || c.kv_heads <= 0 || c.head_dim <= 0 || c.q_heads % c.kv_heads)
    fail("cca: need positive sizes and q_heads % kv_heads == 0 (got q {}, kv {})", c.q_heads, c.kv_heads);
  if (c.v_shift_begin < 0 && (c.kv_heads * c.head_dim) % 2) fail("cca: kv_heads * head_dim must be even (two value halves)");
  if (c.shift_begin() < 0 || c.shift_begin() > c.shift_end() || c.shift_end() > c.kv_heads * c.head_dim)
    fail("cca: value shift columns [{}, {}) outside the {} value columns", c.shift_begin(), c.shift_end(),
         c.kv_heads * c.head_dim);
  if (c.conv0_width < 1 || c.conv1_width < 1) fail("cca: conv widths must be >= 1");
  if (B <= 0 || T <= 0) fail("cca: B and T must be positive, got {} and {}", B, T);
  if (rt.head_dim != c.head_dim) fail("cca: rope table head_dim {} != head_dim {}", rt.head_dim, c.head_dim);
  check_attended(c);
}

std::int64_t halo_rows(const Config& c) { return (c.conv0_width - 1) + (c.conv1_width - 1); }

// The runs the op sees: R = B * S runs of L tokens (segments 0, no split: R = B, L = T).
struct Runs {
  std::int64_t R, L;
};
Runs runs_of(const Config& c, std::int64_t B, std::int64_t T, int segments) {
  if (segments < 0) fail("cca: segments must be >= 0, got {}", segments);
  if (segments == 0) return {B, T};
  if (T % segments)
    fail("cca: a sequence split into {} runs needs the rank's tokens per sequence ({}) divisible by {}", segments, T,
         segments);
  const std::int64_t L = T / segments;
  if (L < halo_rows(c))
    fail("cca: runs of {} tokens ({} per sequence in {} runs) are shorter than the conv halo (W0-1)+(W1-1) = {}", L, T,
         segments, halo_rows(c));
  return {B * segments, L};
}

int split_segments(const SequenceSplit* split) {
  if (!split) return 0;
  const int S = split->segments();
  if (S < 1) fail("cca: the sequence split has {} segments (need >= 1)", S);
  return S;
}
}  // namespace

std::int64_t halo_floats(const Config& c) { return halo_rows(c) * c.qk_channels() + (c.shift_end() - c.shift_begin()); }

std::int64_t saved_floats(const Config& c, std::int64_t B, std::int64_t T, int segments) {
  const std::int64_t N = B * T, C = c.qk_channels(), dq = c.q_heads * c.head_dim, dk = c.kv_heads * c.head_dim;
  const std::int64_t da = c.att_heads() * c.head_dim, part = c.attends_part() ? N * (da + 2 * c.head_dim) : 0;
  const Runs r = runs_of(c, B, T, segments);
  return 2 * N * C + r.R * (r.L + c.conv1_width - 1) * C + N * (c.q_heads + c.kv_heads) + N * dq + 2 * N * dk +
         N * da + B * c.att_heads() * T + part + (segments > 0 ? r.R * halo_floats(c) : 0);
}

Saved carve_saved(const Config& c, std::int64_t B, std::int64_t T, float* p, int segments) {
  const std::int64_t N = B * T, C = c.qk_channels(), dq = c.q_heads * c.head_dim, dk = c.kv_heads * c.head_dim;
  const Runs r = runs_of(c, B, T, segments);
  auto take = [&p](std::initializer_list<std::int64_t> shape) {
    Tensor t(p, shape);
    p += t.numel();
    return t;
  };
  Saved s;
  s.qk0 = take({N, C});
  s.c0 = take({r.R, r.L + c.conv1_width - 1, C});
  s.qk = take({N, C});
  s.rnorm = take({N, c.q_heads + c.kv_heads});
  s.q = take({N, dq});
  s.k = take({N, dk});
  s.v = take({N, dk});
  s.att = take({N, c.att_heads() * c.head_dim});
  s.lse = take({B, c.att_heads(), T});
  if (segments > 0) s.halo = take({r.R, halo_floats(c)});
  if (c.attends_part()) {
    s.qa = take({N, c.attend_q * c.head_dim});
    s.ka = take({N, c.head_dim});
    s.va = take({N, c.head_dim});
  }
  return s;
}

void forward(const Config& c, std::int64_t B, std::int64_t T, const Tensor& x, const std::int32_t* positions,
             const rope::Table& rt, const Params& p, const Saved& s, const Tensor& y, SequenceSplit* split) {
  check_config(c, B, T, rt);
  const std::int64_t N = B * T, H = c.hidden, d = c.head_dim, nq = c.q_heads, nkv = c.kv_heads, G = nq / nkv;
  const std::int64_t C = c.qk_channels(), dq = nq * d, W1 = c.conv1_width, hh = halo_rows(c);
  const std::int64_t half = c.shift_begin(), width = c.shift_end() - half;
  const Runs r = runs_of(c, B, T, split_segments(split));
  const std::int64_t R = r.R, L = r.L;
  require_shape(x, {N, H}, "cca x");
  require_shape(y, {N, H}, "cca y");
  require_shape(p.temp, {nkv}, "cca temp");
  require_shape(s.qk, {N, C}, "cca saved qk");
  require_shape(s.rnorm, {N, nq + nkv}, "cca saved rnorm");
  require_shape(s.c0, {R, L + W1 - 1, C}, "cca saved c0 (carve_saved with the split's segments)");
  require_shape(p.conv1_w, {C, d, W1}, "cca conv1_w");
  if (split) require_shape(s.halo, {R, halo_floats(c)}, "cca saved halo (carve_saved with the split's segments)");

  // 1. Projections (u = x W_v^T: the value shift is applied in 4), the halo exchange, and the
  //    two causal convolutions.
  linear::forward(x, p.w_qk, Tensor(), s.qk0);
  linear::forward(x, p.w_v, Tensor(), s.v);
  const Tensor qk0_3 = s.qk0.reshaped({R, L, C}), qk_3 = s.qk.reshaped({R, L, C});
  if (!split) {
    causal_conv::depthwise_forward(qk0_3, p.conv0_w, p.conv0_b, int(W1 - 1), s.c0);
  } else {
    // Each run's tail: its last hh rows of qk0, then its last row's shift columns of u.
    const std::int64_t F = halo_floats(c);
    std::vector<float> tails(static_cast<std::size_t>(R * F));
    for (std::int64_t i = 0; i < R; ++i) {
      float* tail = tails.data() + i * F;
      std::memcpy(tail, s.qk0.row(i * L + L - hh), sizeof(float) * hh * C);
      std::memcpy(tail + hh * C, s.v.row(i * L + L - 1) + half, sizeof(float) * width);
    }
    if (F > 0) split->halo(Tensor(tails.data(), {R, F}), s.halo);
    for (std::int64_t i = 0; i < R; ++i)
      causal_conv::depthwise_forward(qk0_3.slice0(i, 1), p.conv0_w, p.conv0_b, int(W1 - 1), s.c0.slice0(i, 1),
                                     Tensor(s.halo.row(i), {1, hh, C}));
  }
  causal_conv::grouped_forward(s.c0, p.conv1_w, p.conv1_b, int(W1 - 1), qk_3);

  // 2. Mixing terms, L2 normalization, sqrt(d) scale, temperature on k.
  const float sqrt_d = static_cast<float>(std::sqrt(double(d)));
  parallel_for(N, 64, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t n = lo; n < hi; ++n) {
      const float* a0 = s.qk0.row(n);
      float* a = s.qk.row(n);
      for (std::int64_t g = 0; g < nkv; ++g) {
        const float* k0 = a0 + dq + g * d;
        float* ak = a + dq + g * d;
        for (std::int64_t i = 0; i < d; ++i) {
          double mean_q = 0;
          for (std::int64_t j = 0; j < G; ++j) mean_q += a0[(g * G + j) * d + i];
          mean_q /= double(G);
          for (std::int64_t j = 0; j < G; ++j) a[(g * G + j) * d + i] += 0.5f * (a0[(g * G + j) * d + i] + k0[i]);
          ak[i] += static_cast<float>(0.5 * mean_q + 0.5 * k0[i]);
        }
      }
      for (std::int64_t h = 0; h < nq + nkv; ++h) {
        const float* ah = a + h * d;
        double ss = 0;
        for (std::int64_t i = 0; i < d; ++i) ss += double(ah[i]) * ah[i];
        const float rn = static_cast<float>(1.0 / std::sqrt(ss + double(c.l2_eps)));
        s.rnorm.row(n)[h] = rn;
        float* out = h < nq ? s.q.row(n) + h * d : s.k.row(n) + (h - nq) * d;
        const float scale = h < nq ? sqrt_d * rn : p.temp[h - nq] * sqrt_d * rn;
        for (std::int64_t i = 0; i < d; ++i) out[i] = ah[i] * scale;
      }
    }
  });

  // 3. Partial RoPE (in place).
  rope::forward(rt, s.q.reshaped({N, nq, d}), positions, s.q.reshaped({N, nq, d}));
  rope::forward(rt, s.k.reshaped({N, nkv, d}), positions, s.k.reshaped({N, nkv, d}));

  // 4. Values: current token | previous token, within each run; before a run's first token the
  //    halo's u row (zero where the run starts its sequence; no split: zero).
  for (std::int64_t i = 0; i < R && width > 0; ++i) {
    for (std::int64_t t = L - 1; t >= 1; --t)
      std::memcpy(s.v.row(i * L + t) + half, s.v.row(i * L + t - 1) + half, sizeof(float) * width);
    if (split)
      std::memcpy(s.v.row(i * L) + half, s.halo.row(i) + hh * C, sizeof(float) * width);
    else
      std::memset(s.v.row(i * L) + half, 0, sizeof(float) * width);
  }

  // 5. Causal GQA attention (the layer's window; a split's over its whole sequences) of the
  //    attended query heads, and the output projection.
  const std::int64_t na = c.att_heads(), nka = c.att_kv_heads();
  if (c.attends_part()) {
    copy_columns(s.q.data(), dq, c.attend_q0 * d, na * d, s.qa.data(), N, false);
    copy_columns(s.k.data(), nkv * d, c.att_kv0() * d, d, s.ka.data(), N, false);
    copy_columns(s.v.data(), nkv * d, c.att_kv0() * d, d, s.va.data(), N, false);
  }
  const Tensor& qs = c.attends_part() ? s.qa : s.q;
  const Tensor& ks = c.attends_part() ? s.ka : s.k;
  const Tensor& vs = c.attends_part() ? s.va : s.v;
  const Tensor q4 = qs.reshaped({B, T, na, d}), k4 = ks.reshaped({B, T, nka, d}), v4 = vs.reshaped({B, T, nka, d});
  const float scale = static_cast<float>(1.0 / std::sqrt(double(d)));
  if (split)
    split->attend(q4, k4, v4, scale, c.window, s.att.reshaped({B, T, na, d}), s.lse);
  else
    attention::forward(q4, k4, v4, scale, s.att.reshaped({B, T, na, d}), s.lse, c.window);
  linear::forward(s.att, p.w_o, Tensor(), y);
}

std::int64_t backward_scratch_floats(const Config& c, std::int64_t B, std::int64_t T, int segments) {
  const std::int64_t N = B * T, C = c.qk_channels(), dq = c.q_heads * c.head_dim, dk = c.kv_heads * c.head_dim;
  const std::int64_t da = c.att_heads() * c.head_dim, part = c.attends_part() ? N * (da + 2 * c.head_dim) : 0;
  const Runs r = runs_of(c, B, T, segments);
  return N * (da + dq + 2 * dk + 2 * C + c.hidden) + part + r.R * (r.L + c.conv1_width - 1) * C +
         (segments > 0 ? 2 * r.R * halo_floats(c) : 0);
}

void backward(const Config& c, std::int64_t B, std::int64_t T, const Tensor& x, const std::int32_t* positions,
              const rope::Table& rt, const Params& p, const Saved& s, const Tensor& dy, const Tensor& dx,
              const Params& g, const Tensor& scratch, SequenceSplit* split) {
  check_config(c, B, T, rt);
  const std::int64_t N = B * T, H = c.hidden, d = c.head_dim, nq = c.q_heads, nkv = c.kv_heads, G = nq / nkv;
  const std::int64_t C = c.qk_channels(), dq = nq * d, dk = nkv * d, W1 = c.conv1_width, hh = halo_rows(c);
  const int S = split_segments(split);
  const Runs r = runs_of(c, B, T, S);
  const std::int64_t R = r.R, L = r.L, F = halo_floats(c);
  require_shape(dy, {N, H}, "cca dy");
  if (split) require_shape(s.halo, {R, F}, "cca saved halo (carve_saved with the split's segments)");
  const std::int64_t need = backward_scratch_floats(c, B, T, S);
  if (scratch.numel() < need) fail("cca backward: scratch has {} floats, needs {}", scratch.numel(), need);
  float* sp = scratch.data();
  auto take = [&sp](std::initializer_list<std::int64_t> shape) {
    Tensor t(sp, shape);
    sp += t.numel();
    return t;
  };
  const std::int64_t na = c.att_heads(), nka = c.att_kv_heads();
  const Tensor datt = take({N, na * d}), dqv = take({N, dq}), dkv = take({N, dk}), dv = take({N, dk});
  const Tensor dqk = take({N, C}), dqk0 = take({N, C}), dxt = take({N, H}), dc0 = take({R, L + W1 - 1, C});
  const Tensor dhalos = split ? take({R, F}) : Tensor(), dtails = split ? take({R, F}) : Tensor();
  const bool part = c.attends_part();
  const Tensor dqa = part ? take({N, na * d}) : dqv, dka = part ? take({N, d}) : dkv, dva = part ? take({N, d}) : dv;

  // 5. Output projection and attention (of the attended query heads; the others' q, k and v
  //    gradients are 0 here: they reach the loss only through the k mixing, below).
  linear::backward(s.att, p.w_o, dy, datt, g.w_o, Tensor());
  const Tensor& qs = part ? s.qa : s.q;
  const Tensor& ks = part ? s.ka : s.k;
  const Tensor& vs = part ? s.va : s.v;
  const Tensor q4 = qs.reshaped({B, T, na, d}), k4 = ks.reshaped({B, T, nka, d}), v4 = vs.reshaped({B, T, nka, d});
  const float scale = static_cast<float>(1.0 / std::sqrt(double(d)));
  if (split)
    split->attend_backward(q4, k4, v4, s.att.reshaped({B, T, na, d}), s.lse, datt.reshaped({B, T, na, d}), scale,
                           c.window, dqa.reshaped({B, T, na, d}), dka.reshaped({B, T, nka, d}),
                           dva.reshaped({B, T, nka, d}));
  else
    attention::backward(q4, k4, v4, s.att.reshaped({B, T, na, d}), s.lse, datt.reshaped({B, T, na, d}), scale,
                        dqa.reshaped({B, T, na, d}), dka.reshaped({B, T, nka, d}), dva.reshaped({B, T, nka, d}),
                        c.window);
  if (part) {
    dqv.fill(0.f);
    dkv.fill(0.f);
    dv.fill(0.f);
    copy_columns(dqv.data(), dq, c.attend_q0 * d, na * d, dqa.data(), N, true);
    copy_columns(dkv.data(), dk, c.att_kv0() * d, d, dka.data(), N, true);
    copy_columns(dv.data(), dk, c.att_kv0() * d, d, dva.data(), N, true);
  }

  // 4. Values: undo the shift within each run (du2[t] = dv2[t + 1]; a run's first token's dv2 is
  //    its halo's gradient; 0 for the last token, where the next run's part is added below).
  const std::int64_t half = c.shift_begin(), width = c.shift_end() - half;
  for (std::int64_t i = 0; i < R && width > 0; ++i) {
    if (split) std::memcpy(dhalos.row(i) + hh * C, dv.row(i * L) + half, sizeof(float) * width);
    for (std::int64_t t = 0; t + 1 < L; ++t)
      std::memcpy(dv.row(i * L + t) + half, dv.row(i * L + t + 1) + half, sizeof(float) * width);
    std::memset(dv.row(i * L + L - 1) + half, 0, sizeof(float) * width);
  }

  // 3. RoPE (inverse rotation, in place).
  rope::backward(rt, dqv.reshaped({N, nq, d}), positions, dqv.reshaped({N, nq, d}));
  rope::backward(rt, dkv.reshaped({N, nkv, d}), positions, dkv.reshaped({N, nkv, d}));

  // 2. Normalization: out = c a rn, rn = (|a|^2 + eps)^-1/2, c = sqrt(d) (times temp for k):
  //    da = c (rn g - a rn^3 (a . g));  dtemp += sqrt(d) rn (a . g).
  const bool want_temp = !g.temp.empty();
  if (want_temp) require_shape(g.temp, {nkv}, "cca dtemp");
  const double sqrt_d = std::sqrt(double(d));
  std::vector<double> dtemp(static_cast<std::size_t>(nkv), 0.0);
  for (std::int64_t n = 0; n < N; ++n) {
    const float* a = s.qk.row(n);
    float* da = dqk.row(n);
    for (std::int64_t h = 0; h < nq + nkv; ++h) {
      const float* gh = h < nq ? dqv.row(n) + h * d : dkv.row(n) + (h - nq) * d;
      const float* ah = a + h * d;
      const double rn = s.rnorm.row(n)[h];
      double ag = 0;
      for (std::int64_t i = 0; i < d; ++i) ag += double(ah[i]) * gh[i];
      const double cc = h < nq ? sqrt_d : sqrt_d * p.temp[h - nq];
      for (std::int64_t i = 0; i < d; ++i) da[h * d + i] = static_cast<float>(cc * (rn * gh[i] - ah[i] * rn * rn * rn * ag));
      if (h >= nq) dtemp[h - nq] += sqrt_d * rn * ag;
    }
  }
  if (want_temp)
    for (std::int64_t j = 0; j < nkv; ++j) g.temp[j] += static_cast<float>(dtemp[j]);

  // 1. Convolutions, then the mixing terms' direct path into qk0, then W_qk.
  causal_conv::grouped_backward(s.c0, p.conv1_w, int(W1 - 1), dqk.reshaped({R, L, C}), dc0, g.conv1_w, g.conv1_b);
  if (!split) {
    causal_conv::depthwise_backward(s.qk0.reshaped({B, T, C}), p.conv0_w, int(W1 - 1), dc0, dqk0.reshaped({B, T, C}),
                                    g.conv0_w, g.conv0_b);
  } else {
    const Tensor qk0_3 = s.qk0.reshaped({R, L, C}), dqk0_3 = dqk0.reshaped({R, L, C});
    for (std::int64_t i = 0; i < R; ++i)
      causal_conv::depthwise_backward(qk0_3.slice0(i, 1), p.conv0_w, int(W1 - 1), dc0.slice0(i, 1), dqk0_3.slice0(i, 1),
                                      g.conv0_w, g.conv0_b, Tensor(s.halo.row(i), {1, hh, C}),
                                      Tensor(dhalos.row(i), {1, hh, C}));
  }
  // m_q[h] = (q0[h] + k0[g]) / 2, m_k[g] = (mean_h q0[h]) / 2 + k0[g] / 2.
  parallel_for(N, 64, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t n = lo; n < hi; ++n) {
      const float* ga = dqk.row(n);
      float* g0 = dqk0.row(n);
      for (std::int64_t kg = 0; kg < nkv; ++kg)
        for (std::int64_t i = 0; i < d; ++i) {
          const float gk = ga[dq + kg * d + i];
          double sum_q = 0;
          for (std::int64_t j = 0; j < G; ++j) {
            const std::int64_t ch = (kg * G + j) * d + i;
            g0[ch] += 0.5f * ga[ch] + static_cast<float>(0.5 * gk / double(G));
            sum_q += ga[ch];
          }
          g0[dq + kg * d + i] += static_cast<float>(0.5 * sum_q + 0.5 * gk);
        }
    }
  });

  // 0. The halos' gradients back to the runs that gave them (one exchange), into the tails: the
  //    last hh rows of dqk0 and the last row's shift columns of du. Then W_v and W_qk.
  if (split) {
    if (F > 0) split->halo_backward(dhalos, dtails);
    for (std::int64_t i = 0; i < R; ++i) {
      const float* dt = dtails.row(i);
      float* dq0 = dqk0.row(i * L + L - hh);
      for (std::int64_t j = 0; j < hh * C; ++j) dq0[j] += dt[j];
      float* du = dv.row(i * L + L - 1) + half;
      for (std::int64_t j = 0; j < width; ++j) du[j] += dt[hh * C + j];
    }
  }
  linear::backward(x, p.w_v, dv, dx.empty() ? Tensor() : dxt, g.w_v, Tensor());
  if (!dx.empty()) {
    require_shape(dx, {N, H}, "cca dx");
    linear::backward(x, p.w_qk, dqk0, dx, g.w_qk, Tensor());
    for (std::int64_t i = 0; i < N * H; ++i) dx[i] += dxt[i];
  } else {
    linear::backward(x, p.w_qk, dqk0, Tensor(), g.w_qk, Tensor());
  }
}

}  // namespace keel::ops::cca
