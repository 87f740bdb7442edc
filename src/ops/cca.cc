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
}
}  // namespace

std::int64_t saved_floats(const Config& c, std::int64_t B, std::int64_t T) {
  const std::int64_t N = B * T, C = c.qk_channels(), dq = c.q_heads * c.head_dim, dk = c.kv_heads * c.head_dim;
  return 2 * N * C + B * (T + c.conv1_width - 1) * C + N * (c.q_heads + c.kv_heads) + 2 * N * dq + 2 * N * dk +
         B * c.q_heads * T;
}

Saved carve_saved(const Config& c, std::int64_t B, std::int64_t T, float* p) {
  const std::int64_t N = B * T, C = c.qk_channels(), dq = c.q_heads * c.head_dim, dk = c.kv_heads * c.head_dim;
  auto take = [&p](std::initializer_list<std::int64_t> shape) {
    Tensor t(p, shape);
    p += t.numel();
    return t;
  };
  Saved s;
  s.qk0 = take({N, C});
  s.c0 = take({B, T + c.conv1_width - 1, C});
  s.qk = take({N, C});
  s.rnorm = take({N, c.q_heads + c.kv_heads});
  s.q = take({N, dq});
  s.k = take({N, dk});
  s.v = take({N, dk});
  s.att = take({N, dq});
  s.lse = take({B, c.q_heads, T});
  return s;
}

void forward(const Config& c, std::int64_t B, std::int64_t T, const Tensor& x, const std::int32_t* positions,
             const rope::Table& rt, const Params& p, const Saved& s, const Tensor& y) {
  check_config(c, B, T, rt);
  const std::int64_t N = B * T, H = c.hidden, d = c.head_dim, nq = c.q_heads, nkv = c.kv_heads, G = nq / nkv;
  const std::int64_t C = c.qk_channels(), dq = nq * d, W1 = c.conv1_width;
  require_shape(x, {N, H}, "cca x");
  require_shape(y, {N, H}, "cca y");
  require_shape(p.temp, {nkv}, "cca temp");
  require_shape(s.qk, {N, C}, "cca saved qk");
  require_shape(s.rnorm, {N, nq + nkv}, "cca saved rnorm");
  require_shape(p.conv1_w, {C, d, W1}, "cca conv1_w");

  // 1. Projections and the two causal convolutions.
  linear::forward(x, p.w_qk, Tensor(), s.qk0);
  const Tensor qk0_3 = s.qk0.reshaped({B, T, C}), qk_3 = s.qk.reshaped({B, T, C});
  causal_conv::depthwise_forward(qk0_3, p.conv0_w, p.conv0_b, int(W1 - 1), s.c0);
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

  // 4. Values: current token | previous token (zero before the first token of a sequence).
  linear::forward(x, p.w_v, Tensor(), s.v);
  const std::int64_t half = c.shift_begin(), width = c.shift_end() - half;
  for (std::int64_t b = 0; b < B && width > 0; ++b) {
    for (std::int64_t t = T - 1; t >= 1; --t)
      std::memcpy(s.v.row(b * T + t) + half, s.v.row(b * T + t - 1) + half, sizeof(float) * width);
    std::memset(s.v.row(b * T) + half, 0, sizeof(float) * width);
  }

  // 5. Causal GQA attention (the layer's window) and the output projection.
  attention::forward(s.q.reshaped({B, T, nq, d}), s.k.reshaped({B, T, nkv, d}), s.v.reshaped({B, T, nkv, d}),
                     static_cast<float>(1.0 / std::sqrt(double(d))), s.att.reshaped({B, T, nq, d}), s.lse, c.window);
  linear::forward(s.att, p.w_o, Tensor(), y);
}

std::int64_t backward_scratch_floats(const Config& c, std::int64_t B, std::int64_t T) {
  const std::int64_t N = B * T, C = c.qk_channels(), dq = c.q_heads * c.head_dim, dk = c.kv_heads * c.head_dim;
  return N * (2 * dq + 2 * dk + 2 * C + c.hidden) + B * (T + c.conv1_width - 1) * C;
}

void backward(const Config& c, std::int64_t B, std::int64_t T, const Tensor& x, const std::int32_t* positions,
              const rope::Table& rt, const Params& p, const Saved& s, const Tensor& dy, const Tensor& dx,
              const Params& g, const Tensor& scratch) {
  check_config(c, B, T, rt);
  const std::int64_t N = B * T, H = c.hidden, d = c.head_dim, nq = c.q_heads, nkv = c.kv_heads, G = nq / nkv;
  const std::int64_t C = c.qk_channels(), dq = nq * d, dk = nkv * d, W1 = c.conv1_width;
  require_shape(dy, {N, H}, "cca dy");
  if (scratch.numel() < backward_scratch_floats(c, B, T))
    fail("cca backward: scratch has {} floats, needs {}", scratch.numel(), backward_scratch_floats(c, B, T));
  float* sp = scratch.data();
  auto take = [&sp](std::initializer_list<std::int64_t> shape) {
    Tensor t(sp, shape);
    sp += t.numel();
    return t;
  };
  const Tensor datt = take({N, dq}), dqv = take({N, dq}), dkv = take({N, dk}), dv = take({N, dk});
  const Tensor dqk = take({N, C}), dqk0 = take({N, C}), dxt = take({N, H}), dc0 = take({B, T + W1 - 1, C});

  // 5. Output projection and attention.
  linear::backward(s.att, p.w_o, dy, datt, g.w_o, Tensor());
  attention::backward(s.q.reshaped({B, T, nq, d}), s.k.reshaped({B, T, nkv, d}), s.v.reshaped({B, T, nkv, d}),
                      s.att.reshaped({B, T, nq, d}), s.lse, datt.reshaped({B, T, nq, d}),
                      static_cast<float>(1.0 / std::sqrt(double(d))), dqv.reshaped({B, T, nq, d}),
                      dkv.reshaped({B, T, nkv, d}), dv.reshaped({B, T, nkv, d}), c.window);

  // 4. Values: undo the shift (du2[t] = dv2[t + 1], 0 for the last token), then W_v.
  const std::int64_t half = c.shift_begin(), width = c.shift_end() - half;
  for (std::int64_t b = 0; b < B && width > 0; ++b) {
    for (std::int64_t t = 0; t + 1 < T; ++t)
      std::memcpy(dv.row(b * T + t) + half, dv.row(b * T + t + 1) + half, sizeof(float) * width);
    std::memset(dv.row(b * T + T - 1) + half, 0, sizeof(float) * width);
  }
  linear::backward(x, p.w_v, dv, dx.empty() ? Tensor() : dxt, g.w_v, Tensor());

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
  causal_conv::grouped_backward(s.c0, p.conv1_w, int(W1 - 1), dqk.reshaped({B, T, C}), dc0, g.conv1_w, g.conv1_b);
  causal_conv::depthwise_backward(s.qk0.reshaped({B, T, C}), p.conv0_w, int(W1 - 1), dc0, dqk0.reshaped({B, T, C}),
                                  g.conv0_w, g.conv0_b);
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
  if (!dx.empty()) {
    require_shape(dx, {N, H}, "cca dx");
    linear::backward(x, p.w_qk, dqk0, dx, g.w_qk, Tensor());
    for (std::int64_t i = 0; i < N * H; ++i) dx[i] += dxt[i];
  } else {
    linear::backward(x, p.w_qk, dqk0, Tensor(), g.w_qk, Tensor());
  }
}

}  // namespace keel::ops::cca
