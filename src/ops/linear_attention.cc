#include "ops/linear_attention.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "common/error.h"
#include "common/parallel_for.h"

namespace keel::ops::linear_attention {

Feature parse_feature(const std::string& s) {
  if (s == "identity") return Feature::kIdentity;
  if (s == "elu1") return Feature::kElu1;
  throw UsageError("key 'linear_feature': unknown feature map '" + s + "' (choose identity or elu1)");
}
const char* feature_name(Feature f) { return f == Feature::kElu1 ? "elu1" : "identity"; }

std::vector<float> retnet_decay(int first, int count) {
  std::vector<float> g(static_cast<std::size_t>(count));
  for (int i = 0; i < count; ++i) g[static_cast<std::size_t>(i)] = static_cast<float>(1.0 - std::exp2(-5.0 - (first + i)));
  return g;
}

namespace {

struct Dims {
  std::int64_t runs, len, hq, hkv, d, group, chunk;
  std::int64_t qs() const { return hq * d; }   // q / out row stride
  std::int64_t ks() const { return hkv * d; }  // k / v row stride
  std::int64_t dd() const { return d * d; }
};

// q, k, v: the operands a function reads (an empty one is not checked; callers pass {} for what
// they do not read).
Dims check(const Config& c, std::int64_t runs, std::int64_t len, const Tensor& q, const Tensor& k, const Tensor& v) {
  if (c.heads <= 0 || c.kv_heads <= 0 || c.heads % c.kv_heads || c.head_dim <= 0)
    fail("linear attention: {} query heads do not split into groups over {} kv heads (head_dim {})", c.heads,
         c.kv_heads, c.head_dim);
  if (c.chunk < 1) fail("linear attention: chunk {} must be >= 1", c.chunk);
  if (!c.decay.empty() && static_cast<int>(c.decay.size()) != c.kv_heads)
    fail("linear attention: {} decays for {} kv heads", c.decay.size(), c.kv_heads);
  Dims s{runs, len, c.heads, c.kv_heads, c.head_dim, c.heads / c.kv_heads, c.chunk};
  if (!q.empty()) require_shape(q, {runs * len, s.qs()}, "linear attention q");
  if (!k.empty()) require_shape(k, {runs * len, s.ks()}, "linear attention k");
  if (!v.empty()) require_shape(v, {runs * len, s.ks()}, "linear attention v");
  return s;
}

void check_states(const Dims& s, const Tensor& t, const char* what) {
  if (!t.empty()) require_shape(t, {s.runs, s.hkv, s.d, s.d}, what);
}

// gamma^0 .. gamma^n, in double then rounded (the same powers for forward and backward).
std::vector<float> powers(float gamma, std::int64_t n) {
  std::vector<float> p(static_cast<std::size_t>(n + 1));
  for (std::int64_t j = 0; j <= n; ++j) p[static_cast<std::size_t>(j)] = static_cast<float>(std::pow(double(gamma), double(j)));
  return p;
}

inline float dot(const float* a, const float* b, std::int64_t n) {
  float s = 0.f;
  for (std::int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y[b] += w * sum_a x[a] S[a][b]
inline void vec_mat(const float* x, const float* S, float w, std::int64_t d, float* y) {
  for (std::int64_t a = 0; a < d; ++a) {
    const float xa = w * x[a];
    const float* Sa = S + a * d;
    for (std::int64_t b = 0; b < d; ++b) y[b] += xa * Sa[b];
  }
}
// y[a] += w * sum_b S[a][b] x[b]
inline void mat_vec(const float* S, const float* x, float w, std::int64_t d, float* y) {
  for (std::int64_t a = 0; a < d; ++a) y[a] += w * dot(S + a * d, x, d);
}
// S[a][b] += w * x[a] y[b]
inline void outer(const float* x, const float* y, float w, std::int64_t d, float* S) {
  for (std::int64_t a = 0; a < d; ++a) {
    const float xa = w * x[a];
    float* Sa = S + a * d;
    for (std::int64_t b = 0; b < d; ++b) Sa[b] += xa * y[b];
  }
}

}  // namespace

void forward(const Config& c, std::int64_t runs, std::int64_t len, const Tensor& q, const Tensor& k, const Tensor& v,
             const Tensor& init, const Tensor& out) {
  if (q.empty() || k.empty() || v.empty()) fail("linear attention: q, k and v are required");
  const Dims s = check(c, runs, len, q, k, v);
  require_shape(out, {runs * len, s.qs()}, "linear attention out");
  check_states(s, init, "linear attention init");
  parallel_for(s.runs * s.hkv, 1, [&](std::int64_t begin, std::int64_t end) {
    std::vector<float> S(static_cast<std::size_t>(s.dd()));
    for (std::int64_t task = begin; task < end; ++task) {
      const std::int64_t r = task / s.hkv, g = task % s.hkv;
      const std::vector<float> pw = powers(c.gamma(static_cast<int>(g)), std::max(s.chunk, std::int64_t{1}));
      if (init.empty()) std::fill(S.begin(), S.end(), 0.f);
      else std::copy_n(init.data() + task * s.dd(), s.dd(), S.begin());
      const std::int64_t row0 = r * s.len;
      auto K = [&](std::int64_t i) { return k.data() + (row0 + i) * s.ks() + g * s.d; };
      auto V = [&](std::int64_t i) { return v.data() + (row0 + i) * s.ks() + g * s.d; };
      for (std::int64_t t0 = 0; t0 < s.len; t0 += s.chunk) {
        const std::int64_t t1 = std::min(s.len, t0 + s.chunk);
        for (std::int64_t h = g * s.group; h < (g + 1) * s.group; ++h)
          for (std::int64_t t = t0; t < t1; ++t) {
            const float* qt = q.data() + (row0 + t) * s.qs() + h * s.d;
            float* o = out.data() + (row0 + t) * s.qs() + h * s.d;
            std::fill_n(o, s.d, 0.f);
            vec_mat(qt, S.data(), pw[static_cast<std::size_t>(t - t0 + 1)], s.d, o);  // the state before the chunk
            for (std::int64_t i = t0; i <= t; ++i) {                                 // this chunk, causal
              const float w = pw[static_cast<std::size_t>(t - i)] * dot(qt, K(i), s.d);
              const float* vi = V(i);
              for (std::int64_t b = 0; b < s.d; ++b) o[b] += w * vi[b];
            }
          }
        const float decay_all = pw[static_cast<std::size_t>(t1 - t0)];
        for (float& x : S) x *= decay_all;
        for (std::int64_t i = t0; i < t1; ++i) outer(K(i), V(i), pw[static_cast<std::size_t>(t1 - 1 - i)], s.d, S.data());
      }
    }
  });
}

void backward(const Config& c, std::int64_t runs, std::int64_t len, const Tensor& q, const Tensor& k, const Tensor& v,
              const Tensor& init, const Tensor& dout, const Tensor& dlocal, const Tensor& dq, const Tensor& dk,
              const Tensor& dv, const Tensor& dinit) {
  if (q.empty() || k.empty() || v.empty()) fail("linear attention: q, k and v are required");
  const Dims s = check(c, runs, len, q, k, v);
  require_shape(dout, {runs * len, s.qs()}, "linear attention dout");
  require_shape(dq, {runs * len, s.qs()}, "linear attention dq");
  require_shape(dk, {runs * len, s.ks()}, "linear attention dk");
  require_shape(dv, {runs * len, s.ks()}, "linear attention dv");
  check_states(s, init, "linear attention init");
  check_states(s, dinit, "linear attention dinit");
  check_states(s, dlocal, "linear attention dlocal");
  const std::int64_t chunks = (s.len + s.chunk - 1) / s.chunk;
  parallel_for(s.runs * s.hkv, 1, [&](std::int64_t begin, std::int64_t end) {
    std::vector<float> states(static_cast<std::size_t>(chunks * s.dd())), G(static_cast<std::size_t>(s.dd())),
        Gk(static_cast<std::size_t>(s.dd()));
    for (std::int64_t task = begin; task < end; ++task) {
      const std::int64_t r = task / s.hkv, g = task % s.hkv;
      const std::vector<float> pw = powers(c.gamma(static_cast<int>(g)), s.chunk);
      const float gamma = c.gamma(static_cast<int>(g));
      const std::int64_t row0 = r * s.len;
      auto at = [&](const Tensor& x, std::int64_t stride, std::int64_t i, std::int64_t head) {
        return x.data() + (row0 + i) * stride + head * s.d;
      };
      // The state before each chunk, as forward ran it.
      float* S0 = states.data();
      if (init.empty()) std::fill_n(S0, s.dd(), 0.f);
      else std::copy_n(init.data() + task * s.dd(), s.dd(), S0);
      for (std::int64_t ci = 0; ci + 1 < chunks; ++ci) {
        const std::int64_t t0 = ci * s.chunk, t1 = t0 + s.chunk;
        float* Sn = states.data() + (ci + 1) * s.dd();
        const float* Sc = states.data() + ci * s.dd();
        for (std::int64_t e = 0; e < s.dd(); ++e) Sn[e] = pw[static_cast<std::size_t>(t1 - t0)] * Sc[e];
        for (std::int64_t i = t0; i < t1; ++i)
          outer(at(k, s.ks(), i, g), at(v, s.ks(), i, g), pw[static_cast<std::size_t>(t1 - 1 - i)], s.d, Sn);
      }
      for (std::int64_t i = 0; i < s.len; ++i) {
        std::fill_n(at(dk, s.ks(), i, g), s.d, 0.f);
        std::fill_n(at(dv, s.ks(), i, g), s.d, 0.f);
        for (std::int64_t h = g * s.group; h < (g + 1) * s.group; ++h) std::fill_n(at(dq, s.qs(), i, h), s.d, 0.f);
      }
      // Backward over chunks, last first; G = the gradient of the state after the chunk.
      std::fill(G.begin(), G.end(), 0.f);
      for (std::int64_t ci = chunks - 1; ci >= 0; --ci) {
        const std::int64_t t0 = ci * s.chunk, t1 = std::min(s.len, t0 + s.chunk);
        const float* Sc = states.data() + ci * s.dd();
        // The chunk's update of the state reaches the loss through the state after it (G) and,
        // with dlocal, through local_states (gamma^(L - t1) dlocal after the chunk).
        std::copy(G.begin(), G.end(), Gk.begin());
        if (!dlocal.empty()) {
          const float w = static_cast<float>(std::pow(double(gamma), double(s.len - t1)));
          const float* dl = dlocal.data() + task * s.dd();
          for (std::int64_t e = 0; e < s.dd(); ++e) Gk[static_cast<std::size_t>(e)] += w * dl[e];
        }
        for (std::int64_t i = t0; i < t1; ++i) {
          const float w = pw[static_cast<std::size_t>(t1 - 1 - i)];
          mat_vec(Gk.data(), at(v, s.ks(), i, g), w, s.d, at(dk, s.ks(), i, g));
          vec_mat(at(k, s.ks(), i, g), Gk.data(), w, s.d, at(dv, s.ks(), i, g));
        }
        const float decay_all = pw[static_cast<std::size_t>(t1 - t0)];
        for (float& x : G) x *= decay_all;
        for (std::int64_t h = g * s.group; h < (g + 1) * s.group; ++h)
          for (std::int64_t t = t0; t < t1; ++t) {
            const float* qt = at(q, s.qs(), t, h);
            const float* dot_ = at(dout, s.qs(), t, h);
            float* dqt = at(dq, s.qs(), t, h);
            const float wt = pw[static_cast<std::size_t>(t - t0 + 1)];
            mat_vec(Sc, dot_, wt, s.d, dqt);  // o_t += wt q_t S_c
            outer(qt, dot_, wt, s.d, G.data());
            for (std::int64_t i = t0; i <= t; ++i) {
              const float w = pw[static_cast<std::size_t>(t - i)];
              const float* ki = at(k, s.ks(), i, g);
              const float* vi = at(v, s.ks(), i, g);
              const float dp = w * dot(dot_, vi, s.d);  // d(o_t)/d(q_t . k_i) . dout_t
              const float p = w * dot(qt, ki, s.d);
              float* dki = at(dk, s.ks(), i, g);
              float* dvi = at(dv, s.ks(), i, g);
              for (std::int64_t a = 0; a < s.d; ++a) {
                dqt[a] += dp * ki[a];
                dki[a] += dp * qt[a];
                dvi[a] += p * dot_[a];
              }
            }
          }
      }
      if (!dinit.empty()) std::copy(G.begin(), G.end(), dinit.data() + task * s.dd());
    }
  });
}

void local_states(const Config& c, std::int64_t runs, std::int64_t len, const Tensor& k, const Tensor& v,
                  const Tensor& states) {
  if (k.empty() || v.empty()) fail("linear attention: k and v are required");
  const Dims s = check(c, runs, len, {}, k, v);
  check_states(s, states, "linear attention states");
  parallel_for(s.runs * s.hkv, 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t task = begin; task < end; ++task) {
      const std::int64_t r = task / s.hkv, g = task % s.hkv;
      const std::vector<float> pw = powers(c.gamma(static_cast<int>(g)), s.len);
      float* M = states.data() + task * s.dd();
      std::fill_n(M, s.dd(), 0.f);
      for (std::int64_t i = 0; i < s.len; ++i) {
        const std::int64_t row = (r * s.len + i) * s.ks() + g * s.d;
        outer(k.data() + row, v.data() + row, pw[static_cast<std::size_t>(s.len - 1 - i)], s.d, M);
      }
    }
  });
}

void init_gradient(const Config& c, std::int64_t runs, std::int64_t len, const Tensor& q, const Tensor& dout,
                   const Tensor& dinit) {
  if (q.empty()) fail("linear attention: q is required");
  const Dims s = check(c, runs, len, q, {}, {});
  require_shape(dout, {runs * len, s.qs()}, "linear attention dout");
  require_shape(dinit, {s.runs, s.hkv, s.d, s.d}, "linear attention dinit");
  parallel_for(s.runs * s.hkv, 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t task = begin; task < end; ++task) {
      const std::int64_t r = task / s.hkv, g = task % s.hkv;
      const std::vector<float> pw = powers(c.gamma(static_cast<int>(g)), s.len);
      float* G = dinit.data() + task * s.dd();
      std::fill_n(G, s.dd(), 0.f);
      for (std::int64_t t = 0; t < s.len; ++t)
        for (std::int64_t h = g * s.group; h < (g + 1) * s.group; ++h) {
          const std::int64_t row = (r * s.len + t) * s.qs() + h * s.d;
          outer(q.data() + row, dout.data() + row, pw[static_cast<std::size_t>(t + 1)], s.d, G);
        }
    }
  });
}

void step(const Config& c, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& state, const Tensor& out) {
  const std::int64_t B = q.empty() ? 0 : q.dim(0);
  const Dims s = check(c, B, 1, q, k, v);
  require_shape(state, {B, s.hkv, s.d, s.d}, "linear attention state");
  require_shape(out, {B, s.qs()}, "linear attention out");
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t g = 0; g < s.hkv; ++g) {
      float* M = state.data() + (b * s.hkv + g) * s.dd();
      const float gamma = c.gamma(static_cast<int>(g));
      if (gamma != 1.0f)
        for (std::int64_t e = 0; e < s.dd(); ++e) M[e] *= gamma;
      outer(k.data() + b * s.ks() + g * s.d, v.data() + b * s.ks() + g * s.d, 1.0f, s.d, M);
      for (std::int64_t h = g * s.group; h < (g + 1) * s.group; ++h) {
        float* o = out.data() + b * s.qs() + h * s.d;
        std::fill_n(o, s.d, 0.f);
        vec_mat(q.data() + b * s.qs() + h * s.d, M, 1.0f, s.d, o);
      }
    }
}

void feature_forward(Feature f, const Tensor& x, const Tensor& y) {
  if (x.numel() != y.numel()) fail("linear attention feature: {} inputs, {} outputs", x.numel(), y.numel());
  const std::int64_t n = x.numel();
  if (f == Feature::kIdentity) {
    if (x.data() != y.data()) std::copy_n(x.data(), n, y.data());
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const float a = x.data()[i];
    y.data()[i] = a > 0.f ? a + 1.f : std::exp(a);
  }
}

void feature_backward(Feature f, const Tensor& y, const Tensor& dy, const Tensor& dx) {
  if (y.numel() != dy.numel() || y.numel() != dx.numel())
    fail("linear attention feature backward: {} outputs, {} gradients, {} input gradients", y.numel(), dy.numel(),
         dx.numel());
  const std::int64_t n = y.numel();
  if (f == Feature::kIdentity) {
    if (dx.data() != dy.data()) std::copy_n(dy.data(), n, dx.data());
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const float a = y.data()[i];
    dx.data()[i] = dy.data()[i] * (a > 1.f ? 1.f : a);
  }
}

void norm_forward(const Tensor& x, float eps, const Tensor& y, const Tensor& rstd) {
  const std::int64_t M = x.rows(), d = x.dim(-1);
  require_shape(y, {M, d}, "linear attention norm y");
  require_shape(rstd, {M}, "linear attention norm rstd");
  parallel_for(M, 256, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      const float* xr = x.row(r);
      const float rs = 1.0f / std::sqrt(dot(xr, xr, d) / static_cast<float>(d) + eps);
      rstd.data()[r] = rs;
      for (std::int64_t j = 0; j < d; ++j) y.row(r)[j] = xr[j] * rs;
    }
  });
}

void norm_backward(const Tensor& y, const Tensor& rstd, const Tensor& dy, const Tensor& dx) {
  const std::int64_t M = y.rows(), d = y.dim(-1);
  require_shape(rstd, {M}, "linear attention norm rstd");
  require_shape(dy, {M, d}, "linear attention norm dy");
  require_shape(dx, {M, d}, "linear attention norm dx");
  parallel_for(M, 256, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      const float* yr = y.row(r);
      const float* g = dy.row(r);
      const float m = dot(g, yr, d) / static_cast<float>(d);
      for (std::int64_t j = 0; j < d; ++j) dx.row(r)[j] = rstd.data()[r] * (g[j] - yr[j] * m);
    }
  });
}

}  // namespace keel::ops::linear_attention
