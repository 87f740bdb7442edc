#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/error.h"
#include "gradcheck.h"
#include "ops/attention.h"
#include "ops/rope.h"

namespace keel {
namespace {

using test::check_grad;
using test::kGradTol;
using test::random_vector;
using test::weighted_sum;

TEST(OpRope, PartialFractionMatchesNaive) {
  const int d = 8, h = 2;
  const double base = 500.0;
  auto t = ops::rope::make_table(d, 0.5, base, 64);  // R = 4: channels 0..3 rotate, 4..7 pass
  ASSERT_EQ(t.rotary_dim, 4);
  std::vector<std::int32_t> pos = {0, 5, 63};
  const std::int64_t n = 3;
  auto x = random_vector(n * h * d, 40);
  std::vector<float> y(x.size());
  ops::rope::forward(t, Tensor(x.data(), {n, h, d}), pos.data(), Tensor(y.data(), {n, h, d}));
  for (std::int64_t i = 0; i < n; ++i)
    for (int hh = 0; hh < h; ++hh) {
      const float* xr = x.data() + (i * h + hh) * d;
      const float* yr = y.data() + (i * h + hh) * d;
      double nx = 0, ny = 0;
      for (int c = 0; c < d; ++c) {
        nx += double(xr[c]) * xr[c];
        ny += double(yr[c]) * yr[c];
      }
      EXPECT_NEAR(nx, ny, 1e-5);  // a rotation preserves the norm
      for (int k = 0; k < 2; ++k) {  // rotate-half pairing: (k, k + R/2)
        const double a = pos[i] * std::pow(base, -2.0 * k / 4);
        EXPECT_NEAR(yr[k], xr[k] * std::cos(a) - xr[k + 2] * std::sin(a), 1e-5);
        EXPECT_NEAR(yr[k + 2], xr[k + 2] * std::cos(a) + xr[k] * std::sin(a), 1e-5);
      }
      for (int c = 4; c < d; ++c) EXPECT_EQ(yr[c], xr[c]);  // the tail passes through untouched
    }
  // Position 0 is the identity.
  for (int c = 0; c < h * d; ++c) EXPECT_EQ(y[c], x[c]);
}

TEST(OpRope, ScoresDependOnlyOnRelativePosition) {
  const int d = 8;
  auto t = ops::rope::make_table(d, 1.0, 10000.0, 32);
  auto q = random_vector(d, 41), k = random_vector(d, 42);
  auto score = [&](std::int32_t pq, std::int32_t pk) {
    std::vector<float> rq(d), rk(d);
    ops::rope::forward(t, Tensor(q.data(), {1, 1, d}), &pq, Tensor(rq.data(), {1, 1, d}));
    ops::rope::forward(t, Tensor(k.data(), {1, 1, d}), &pk, Tensor(rk.data(), {1, 1, d}));
    double s = 0;
    for (int c = 0; c < d; ++c) s += double(rq[c]) * rk[c];
    return s;
  };
  EXPECT_NEAR(score(5, 2), score(13, 10), 1e-5);
  EXPECT_NEAR(score(7, 7), score(0, 0), 1e-5);
}

TEST(OpRope, GradCheckAndInPlace) {
  const int d = 12, h = 3;
  const std::int64_t n = 4;
  auto t = ops::rope::make_table(d, 0.5, 10000.0, 16);  // R = 6
  std::vector<std::int32_t> pos = {0, 3, 1, 15};
  auto x = random_vector(n * h * d, 43), r = random_vector(n * h * d, 44);
  std::vector<float> y(x.size()), dx(x.size());
  auto loss = [&] {
    ops::rope::forward(t, Tensor(x.data(), {n, h, d}), pos.data(), Tensor(y.data(), {n, h, d}));
    return weighted_sum(y.data(), r);
  };
  loss();
  ops::rope::backward(t, Tensor(r.data(), {n, h, d}), pos.data(), Tensor(dx.data(), {n, h, d}));
  EXPECT_LT(check_grad("rope dx (fraction 0.5)", loss, x.data(), dx.data(), x.size()).rel_err, kGradTol);
  // In place: forward then backward on the same buffer is the identity (orthogonal rotation).
  loss();  // y for the unperturbed x
  std::vector<float> z = x;
  Tensor tz(z.data(), {n, h, d});
  ops::rope::forward(t, tz, pos.data(), tz);
  for (std::size_t i = 0; i < z.size(); ++i) EXPECT_NEAR(z[i], y[i], 1e-6);
  ops::rope::backward(t, tz, pos.data(), tz);
  for (std::size_t i = 0; i < z.size(); ++i) EXPECT_NEAR(z[i], x[i], 1e-5);
}

TEST(OpRope, RejectsBadFractionAndPosition) {
  EXPECT_THROW(ops::rope::make_table(8, 0.375, 10000.0, 4), Error);  // 3 channels: odd
  EXPECT_THROW(ops::rope::make_table(8, 0.0, 10000.0, 4), Error);
  auto t = ops::rope::make_table(8, 1.0, 10000.0, 4);
  std::vector<float> x(8);
  std::int32_t p = 4;
  EXPECT_THROW(ops::rope::forward(t, Tensor(x.data(), {1, 1, 8}), &p, Tensor(x.data(), {1, 1, 8})), Error);
}

struct AttnCase {
  std::int64_t b, t, hq, hkv, d;
  std::vector<float> q, k, v, out, lse;
  float scale;
  int window = 0;  // 0: full causal
  AttnCase(std::int64_t b_, std::int64_t t_, std::int64_t hq_, std::int64_t hkv_, std::int64_t d_, std::uint32_t seed)
      : b(b_), t(t_), hq(hq_), hkv(hkv_), d(d_) {
    q = random_vector(b * t * hq * d, seed);
    k = random_vector(b * t * hkv * d, seed + 1);
    v = random_vector(b * t * hkv * d, seed + 2);
    out.resize(q.size());
    lse.resize(b * hq * t);
    scale = 1.f / std::sqrt(float(d));
  }
  Tensor tq() { return Tensor(q.data(), {b, t, hq, d}); }
  Tensor tk() { return Tensor(k.data(), {b, t, hkv, d}); }
  Tensor tv() { return Tensor(v.data(), {b, t, hkv, d}); }
  Tensor tout() { return Tensor(out.data(), {b, t, hq, d}); }
  Tensor tlse() { return Tensor(lse.data(), {b, hq, t}); }
  void forward() { ops::attention::forward(tq(), tk(), tv(), scale, tout(), tlse(), window); }
  // dL/dout = r -> dq, dk, dv (resized).
  void backward(std::vector<float>& r, std::vector<float>& dq, std::vector<float>& dk, std::vector<float>& dv) {
    dq.resize(q.size()), dk.resize(k.size()), dv.resize(v.size());
    ops::attention::backward(tq(), tk(), tv(), tout(), tlse(), Tensor(r.data(), {b, t, hq, d}), scale,
                             Tensor(dq.data(), {b, t, hq, d}), Tensor(dk.data(), {b, t, hkv, d}),
                             Tensor(dv.data(), {b, t, hkv, d}), window);
  }
};

// c.forward() against the full [T, T] score matrix with a -inf mask (causal, and outside the
// window: key j is visible to query i when j <= i and i - j < W) and a double-precision softmax.
void expect_matches_naive(AttnCase& c) {
  c.forward();
  const std::int64_t hq = c.hq, hkv = c.hkv, g = hq / hkv;
  for (std::int64_t bb = 0; bb < c.b; ++bb)
    for (std::int64_t h = 0; h < hq; ++h) {
      std::vector<double> s(c.t * c.t);
      for (std::int64_t i = 0; i < c.t; ++i)
        for (std::int64_t j = 0; j < c.t; ++j) {
          double acc = 0;
          for (std::int64_t x = 0; x < c.d; ++x)
            acc += double(c.q[((bb * c.t + i) * hq + h) * c.d + x]) * c.k[((bb * c.t + j) * hkv + h / g) * c.d + x];
          const bool visible = j <= i && (c.window == 0 || i - j < c.window);
          s[i * c.t + j] = visible ? acc * c.scale : -std::numeric_limits<double>::infinity();
        }
      for (std::int64_t i = 0; i < c.t; ++i) {
        double m = -1e300, z = 0;
        for (std::int64_t j = 0; j < c.t; ++j) m = std::max(m, s[i * c.t + j]);
        for (std::int64_t j = 0; j < c.t; ++j) z += std::exp(s[i * c.t + j] - m);
        EXPECT_NEAR(c.lse[(bb * hq + h) * c.t + i], m + std::log(z), 1e-5);
        for (std::int64_t x = 0; x < c.d; ++x) {
          double o = 0;
          for (std::int64_t j = 0; j < c.t; ++j)
            o += std::exp(s[i * c.t + j] - m) / z * c.v[((bb * c.t + j) * hkv + h / g) * c.d + x];
          EXPECT_NEAR(c.out[((bb * c.t + i) * hq + h) * c.d + x], o, 1e-5)
              << "hq " << hq << " hkv " << hkv << " window " << c.window;
        }
      }
    }
}

TEST(OpAttention, ForwardMatchesNaiveFullSoftmax) {
  for (auto [hq, hkv] : {std::pair<int, int>{4, 4}, {4, 2}, {6, 1}}) {
    AttnCase c(2, 7, hq, hkv, 8, 50);
    expect_matches_naive(c);
  }
}

// Sliding windows (t - W < j <= t), from one key to nearly the whole sequence.
TEST(OpAttention, WindowForwardMatchesNaiveMaskedSoftmax) {
  for (int w : {1, 2, 3, 5, 8}) {
    for (auto [hq, hkv] : {std::pair<int, int>{4, 4}, {4, 2}, {6, 1}}) {
      AttnCase c(2, 9, hq, hkv, 8, 80 + w);
      c.window = w;
      expect_matches_naive(c);
    }
  }
}

// Finite differences of dq, dk, dv for a weighted sum of the output (weights from `seed`).
void expect_attention_grads(AttnCase& c, std::uint64_t seed, const std::string& tag) {
  auto r = random_vector(c.q.size(), seed);
  auto loss = [&] {
    c.forward();
    return weighted_sum(c.out.data(), r);
  };
  loss();
  std::vector<float> dq, dk, dv;
  c.backward(r, dq, dk, dv);
  EXPECT_LT(check_grad("attention dq" + tag, loss, c.q.data(), dq.data(), c.q.size()).rel_err, kGradTol);
  EXPECT_LT(check_grad("attention dk" + tag, loss, c.k.data(), dk.data(), c.k.size()).rel_err, kGradTol);
  EXPECT_LT(check_grad("attention dv" + tag, loss, c.v.data(), dv.data(), c.v.size()).rel_err, kGradTol);
}

TEST(OpAttention, GradCheckGqaAndMha) {
  for (auto [hq, hkv] : {std::pair<int, int>{4, 2}, {2, 2}}) {
    AttnCase c(2, 5, hq, hkv, 8, 60);
    expect_attention_grads(c, 64, " (hq " + std::to_string(hq) + ", hkv " + std::to_string(hkv) + ")");
  }
}

TEST(OpAttention, WindowGradCheck) {
  for (int w : {1, 3}) {
    AttnCase c(2, 7, 4, 2, 8, 90 + w);
    c.window = w;
    expect_attention_grads(c, 95, " (window " + std::to_string(w) + ")");
  }
}

// A window of T or more is full causal attention: the same out, lse and gradients, bit for bit.
TEST(OpAttention, WindowAtLeastTIsFullCausal) {
  AttnCase full(2, 6, 4, 2, 8, 100);
  auto r = random_vector(full.q.size(), 101);
  std::vector<float> dq0, dk0, dv0;
  full.forward();
  full.backward(r, dq0, dk0, dv0);
  for (int w : {6, 7, 100}) {
    AttnCase c(2, 6, 4, 2, 8, 100);
    c.window = w;
    c.forward();
    std::vector<float> dq, dk, dv;
    c.backward(r, dq, dk, dv);
    EXPECT_EQ(c.out, full.out) << "window " << w;
    EXPECT_EQ(c.lse, full.lse) << "window " << w;
    EXPECT_EQ(dq, dq0) << "window " << w;
    EXPECT_EQ(dk, dk0) << "window " << w;
    EXPECT_EQ(dv, dv0) << "window " << w;
  }
}

// Window 1: each token attends only to itself, out = its own v (of its kv head), lse = its own
// score, and no gradient reaches q or k (a softmax over one key is constant).
TEST(OpAttention, WindowOneAttendsOnlyItself) {
  AttnCase c(2, 5, 4, 2, 8, 110);
  c.window = 1;
  c.forward();
  for (std::int64_t bb = 0; bb < c.b; ++bb)
    for (std::int64_t i = 0; i < c.t; ++i)
      for (std::int64_t h = 0; h < c.hq; ++h) {
        const std::int64_t g = h / (c.hq / c.hkv);
        const float* qi = c.q.data() + ((bb * c.t + i) * c.hq + h) * c.d;
        const float* ki = c.k.data() + ((bb * c.t + i) * c.hkv + g) * c.d;
        const float* vi = c.v.data() + ((bb * c.t + i) * c.hkv + g) * c.d;
        double qk = 0;
        for (std::int64_t x = 0; x < c.d; ++x) {
          qk += double(qi[x]) * ki[x];
          EXPECT_FLOAT_EQ(c.out[((bb * c.t + i) * c.hq + h) * c.d + x], vi[x]);
        }
        EXPECT_NEAR(c.lse[(bb * c.hq + h) * c.t + i], qk * c.scale, 1e-5);
      }
  auto r = random_vector(c.q.size(), 111);
  std::vector<float> dq, dk, dv;
  c.backward(r, dq, dk, dv);
  for (float x : dq) EXPECT_NEAR(x, 0.f, 1e-6f);
  for (float x : dk) EXPECT_NEAR(x, 0.f, 1e-6f);
}

// Changing token j's key and value changes the outputs of queries j..j+W-1 and of no other:
// the window is live (full causal attention would change every query from j on).
TEST(OpAttention, TokensOutsideTheWindowDoNotAffectTheOutput) {
  const int W = 3;
  const std::int64_t j = 2;
  AttnCase base(1, 10, 2, 1, 8, 120);
  base.window = W;
  base.forward();
  AttnCase moved = base;
  for (std::int64_t x = 0; x < moved.d; ++x) {
    moved.k[j * moved.d + x] += 0.5f;
    moved.v[j * moved.d + x] -= 0.7f;
  }
  moved.forward();
  for (std::int64_t i = 0; i < base.t; ++i)
    for (std::int64_t h = 0; h < base.hq; ++h) {
      double diff = 0;
      for (std::int64_t x = 0; x < base.d; ++x) {
        const std::size_t e = static_cast<std::size_t>((i * base.hq + h) * base.d + x);
        diff = std::max(diff, std::fabs(double(moved.out[e]) - base.out[e]));
      }
      if (i >= j && i < j + W)
        EXPECT_GT(diff, 1e-3) << "query " << i << " sees token " << j;
      else
        EXPECT_EQ(diff, 0.0) << "query " << i << " is outside token " << j << "'s window";
    }
}

TEST(OpAttention, RejectsNegativeWindow) {
  AttnCase c(1, 3, 2, 2, 4, 130);
  c.window = -1;
  EXPECT_THROW(c.forward(), Error);
}

TEST(OpAttention, RejectsHeadsNotDividing) {
  AttnCase c(1, 2, 3, 2, 4, 70);
  EXPECT_THROW(c.forward(), Error);
}

// ---- forward_at / backward_at: queries at given positions over a longer key sequence ----

// Tq query rows at positions pos over Tk keys; outputs pre-filled with garbage (overwrite checks).
struct AtCase {
  std::int64_t b, tq, tk, hq, hkv, d;
  std::vector<float> q, k, v, out, lse;
  std::vector<std::int32_t> pos;
  float scale;
  int window = 0;
  AtCase(std::int64_t b_, std::int64_t tk_, std::int64_t hq_, std::int64_t hkv_, std::int64_t d_,
         std::vector<std::int32_t> pos_, std::uint32_t seed)
      : b(b_), tq(static_cast<std::int64_t>(pos_.size())), tk(tk_), hq(hq_), hkv(hkv_), d(d_), pos(std::move(pos_)) {
    q = random_vector(b * tq * hq * d, seed);
    k = random_vector(b * tk * hkv * d, seed + 1);
    v = random_vector(b * tk * hkv * d, seed + 2);
    out.assign(q.size(), 7.f);
    lse.assign(b * hq * tq, 7.f);
    scale = 1.f / std::sqrt(float(d));
  }
  Tensor tq4(std::vector<float>& x) { return Tensor(x.data(), {b, tq, hq, d}); }
  Tensor tk4(std::vector<float>& x) { return Tensor(x.data(), {b, tk, hkv, d}); }
  Tensor tlse() { return Tensor(lse.data(), {b, hq, tq}); }
  void forward() { ops::attention::forward_at(tq4(q), tk4(k), tk4(v), pos.data(), scale, tq4(out), tlse(), window); }
  void backward(std::vector<float>& r, std::vector<float>& dq, std::vector<float>& dk, std::vector<float>& dv) {
    dq.assign(q.size(), 7.f), dk.assign(k.size(), 7.f), dv.assign(v.size(), 7.f);
    ops::attention::backward_at(tq4(q), tk4(k), tk4(v), pos.data(), tq4(out), tlse(), tq4(r), scale, tq4(dq), tk4(dk),
                                tk4(dv), window);
  }
};

// Identity positions with Tq == Tk: forward_at/backward_at are forward/backward bit for bit.
TEST(AttentionAt, IdentityPositionsEqualForwardBackwardBitwise) {
  for (int w : {0, 1, 3, 9}) {
    AttnCase full(2, 9, 4, 2, 8, 200 + w);
    full.window = w;
    auto r = random_vector(full.q.size(), 210 + w);
    std::vector<float> dq0, dk0, dv0;
    full.forward();
    full.backward(r, dq0, dk0, dv0);
    std::vector<std::int32_t> pos(9);
    for (int t = 0; t < 9; ++t) pos[t] = t;
    AtCase c(2, 9, 4, 2, 8, pos, 200 + w);  // the same seed: the same q, k, v
    c.window = w;
    ASSERT_EQ(c.q, full.q);
    ASSERT_EQ(c.k, full.k);
    c.forward();
    std::vector<float> dq, dk, dv;
    c.backward(r, dq, dk, dv);
    EXPECT_EQ(c.out, full.out) << "window " << w;
    EXPECT_EQ(c.lse, full.lse) << "window " << w;
    EXPECT_EQ(dq, dq0) << "window " << w;
    EXPECT_EQ(dk, dk0) << "window " << w;
    EXPECT_EQ(dv, dv0) << "window " << w;
  }
}

// Context parallelism with zigzag chunks: of 2R chunks of length L = T / 2R, rank r holds chunks r
// and 2R-1-r. Each rank's forward_at over the full k, v gives the full attention's rows of out and
// lse; its backward_at gives the full dq rows, and the ranks' dk, dv sum to the full dk, dv (each
// rank's dk, dv is exactly zero at the keys none of its queries attends).
void expect_zigzag_split_matches_full(int ranks, int window, std::uint32_t seed) {
  const std::int64_t B = 2, T = 24, Hq = 4, Hkv = 2, D = 8, L = T / (2 * ranks);
  const std::string tag = " (ranks " + std::to_string(ranks) + ", window " + std::to_string(window) + ")";
  AttnCase full(B, T, Hq, Hkv, D, seed);
  full.window = window;
  full.forward();
  auto r = random_vector(full.q.size(), seed + 10);
  std::vector<float> dq0, dk0, dv0;
  full.backward(r, dq0, dk0, dv0);
  std::vector<float> dk_sum(dk0.size(), 0.f), dv_sum(dv0.size(), 0.f);
  const std::int64_t row = Hq * D;  // one token's q (or out, dout) row
  for (int rk = 0; rk < ranks; ++rk) {
    std::vector<std::int32_t> pos;
    for (int chunk : {rk, 2 * ranks - 1 - rk})
      for (std::int64_t x = 0; x < L; ++x) pos.push_back(static_cast<std::int32_t>(chunk * L + x));
    AtCase c(B, T, Hq, Hkv, D, pos, seed);
    c.window = window;
    c.k = full.k, c.v = full.v;
    const std::int64_t tq = c.tq;
    std::vector<float> rr(c.q.size());
    for (std::int64_t bb = 0; bb < B; ++bb)
      for (std::int64_t t = 0; t < tq; ++t) {
        std::copy_n(full.q.begin() + (bb * T + pos[t]) * row, row, c.q.begin() + (bb * tq + t) * row);
        std::copy_n(r.begin() + (bb * T + pos[t]) * row, row, rr.begin() + (bb * tq + t) * row);
      }
    c.forward();
    std::vector<float> dq, dk, dv;
    c.backward(rr, dq, dk, dv);
    for (std::int64_t bb = 0; bb < B; ++bb)
      for (std::int64_t t = 0; t < tq; ++t) {
        for (std::int64_t x = 0; x < row; ++x) {
          EXPECT_NEAR(c.out[(bb * tq + t) * row + x], full.out[(bb * T + pos[t]) * row + x], 1e-6) << "out" << tag;
          EXPECT_NEAR(dq[(bb * tq + t) * row + x], dq0[(bb * T + pos[t]) * row + x], 1e-5) << "dq" << tag;
        }
        for (std::int64_t h = 0; h < Hq; ++h)
          EXPECT_NEAR(c.lse[(bb * Hq + h) * tq + t], full.lse[(bb * Hq + h) * T + pos[t]], 1e-6) << "lse" << tag;
      }
    std::vector<bool> attended(static_cast<std::size_t>(T), false);
    for (std::int32_t p : pos)
      for (std::int64_t j = ops::attention::first_key(p, window); j <= p; ++j) attended[j] = true;
    for (std::int64_t bb = 0; bb < B; ++bb)
      for (std::int64_t j = 0; j < T; ++j)
        for (std::int64_t x = 0; x < Hkv * D; ++x) {
          const std::size_t e = static_cast<std::size_t>((bb * T + j) * Hkv * D + x);
          if (!attended[j]) {
            EXPECT_EQ(dk[e], 0.f) << "rank " << rk << " key " << j << tag;
            EXPECT_EQ(dv[e], 0.f) << "rank " << rk << " key " << j << tag;
          }
          dk_sum[e] += dk[e];
          dv_sum[e] += dv[e];
        }
  }
  for (std::size_t e = 0; e < dk0.size(); ++e) {
    EXPECT_NEAR(dk_sum[e], dk0[e], 1e-5) << "dk" << tag;
    EXPECT_NEAR(dv_sum[e], dv0[e], 1e-5) << "dv" << tag;
  }
}

TEST(AttentionAt, ZigzagSplitOverTwoRanksMatchesFullAttention) {
  expect_zigzag_split_matches_full(2, 0, 300);
  expect_zigzag_split_matches_full(2, 5, 310);
}

TEST(AttentionAt, ZigzagSplitOverThreeRanksMatchesFullAttention) {
  expect_zigzag_split_matches_full(3, 0, 320);
  expect_zigzag_split_matches_full(3, 5, 330);
}

// Against a masked softmax in double: query row t sees key j when j <= pos[t] and pos[t] - j < W.
// Positions in any order, repeated, Tq < Tk, the last key attended by none.
TEST(AttentionAt, ForwardMatchesNaiveMaskedSoftmax) {
  const std::vector<std::int32_t> pos = {7, 2, 7, 0, 5, 2};
  const std::int64_t tk = 9;
  for (int w : {0, 1, 3}) {
    for (auto [hq, hkv] : {std::pair<int, int>{4, 4}, {4, 2}, {6, 1}}) {
      AtCase c(2, tk, hq, hkv, 8, pos, 400 + w);
      c.window = w;
      c.forward();
      const std::int64_t g = hq / hkv, tq = c.tq;
      for (std::int64_t bb = 0; bb < c.b; ++bb)
        for (std::int64_t h = 0; h < hq; ++h)
          for (std::int64_t i = 0; i < tq; ++i) {
            std::vector<double> s(static_cast<std::size_t>(tk));
            double m = -1e300, z = 0;
            for (std::int64_t j = 0; j < tk; ++j) {
              double acc = 0;
              for (std::int64_t x = 0; x < c.d; ++x)
                acc += double(c.q[((bb * tq + i) * hq + h) * c.d + x]) * c.k[((bb * tk + j) * hkv + h / g) * c.d + x];
              const bool visible = j <= pos[i] && (w == 0 || pos[i] - j < w);
              s[j] = visible ? acc * c.scale : -std::numeric_limits<double>::infinity();
              m = std::max(m, s[j]);
            }
            for (std::int64_t j = 0; j < tk; ++j) z += std::exp(s[j] - m);
            EXPECT_NEAR(c.lse[(bb * hq + h) * tq + i], m + std::log(z), 1e-5);
            for (std::int64_t x = 0; x < c.d; ++x) {
              double o = 0;
              for (std::int64_t j = 0; j < tk; ++j)
                o += std::exp(s[j] - m) / z * c.v[((bb * tk + j) * hkv + h / g) * c.d + x];
              EXPECT_NEAR(c.out[((bb * tq + i) * hq + h) * c.d + x], o, 1e-5)
                  << "hq " << hq << " hkv " << hkv << " window " << w << " row " << i;
            }
          }
    }
  }
}

// Finite differences of dq, dk, dv (keys 5 and 6 are attended by no query: their gradient is 0).
TEST(AttentionAt, GradCheck) {
  for (int w : {0, 2}) {
    AtCase c(2, 7, 4, 2, 8, {4, 1, 1, 2}, 500 + w);
    c.window = w;
    auto r = random_vector(c.q.size(), 510 + w);
    auto loss = [&] {
      c.forward();
      return weighted_sum(c.out.data(), r);
    };
    loss();
    std::vector<float> dq, dk, dv;
    c.backward(r, dq, dk, dv);
    const std::string tag = " (at, window " + std::to_string(w) + ")";
    EXPECT_LT(check_grad("attention dq" + tag, loss, c.q.data(), dq.data(), c.q.size()).rel_err, kGradTol);
    EXPECT_LT(check_grad("attention dk" + tag, loss, c.k.data(), dk.data(), c.k.size()).rel_err, kGradTol);
    EXPECT_LT(check_grad("attention dv" + tag, loss, c.v.data(), dv.data(), c.v.size()).rel_err, kGradTol);
    for (std::int64_t bb = 0; bb < c.b; ++bb)
      for (std::int64_t j = 5; j < 7; ++j)
        for (std::int64_t x = 0; x < c.hkv * c.d; ++x) {
          EXPECT_EQ(dk[(bb * c.tk + j) * c.hkv * c.d + x], 0.f);
          EXPECT_EQ(dv[(bb * c.tk + j) * c.hkv * c.d + x], 0.f);
        }
  }
}

TEST(AttentionAt, RejectsBadPositionsAndShapes) {
  AtCase c(1, 6, 2, 1, 4, {0, 5, 3}, 600);
  auto r = random_vector(c.q.size(), 601);
  std::vector<float> dq, dk, dv;
  c.forward();  // valid
  c.backward(r, dq, dk, dv);
  for (std::int32_t bad : {6, -1, 1000}) {
    AtCase e = c;
    e.pos[1] = bad;
    EXPECT_THROW(e.forward(), Error) << "q_pos " << bad;
    EXPECT_THROW(e.backward(r, dq, dk, dv), Error) << "q_pos " << bad;
    try {
      e.forward();
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(std::to_string(bad)), std::string::npos) << err.what();
    }
  }
  // k with 6 keys, v with 5.
  std::vector<float> v5(static_cast<std::size_t>(5 * c.hkv * c.d));
  Tensor tv5(v5.data(), {1, 5, c.hkv, c.d});
  EXPECT_THROW(ops::attention::forward_at(c.tq4(c.q), c.tk4(c.k), tv5, c.pos.data(), c.scale, c.tq4(c.out), c.tlse()),
               Error);
  EXPECT_THROW(ops::attention::backward_at(c.tq4(c.q), c.tk4(c.k), tv5, c.pos.data(), c.tq4(c.out), c.tlse(),
                                           c.tq4(r), c.scale, c.tq4(dq), c.tk4(dk), c.tk4(dv)),
               Error);
  // dk with Tq rows instead of Tk.
  EXPECT_THROW(ops::attention::backward_at(c.tq4(c.q), c.tk4(c.k), c.tk4(c.v), c.pos.data(), c.tq4(c.out), c.tlse(),
                                           c.tq4(r), c.scale, c.tq4(dq), Tensor(dk.data(), {1, 3, c.hkv, c.d}),
                                           c.tk4(dv)),
               Error);
  // Null q_pos.
  EXPECT_THROW(ops::attention::forward_at(c.tq4(c.q), c.tk4(c.k), c.tk4(c.v), nullptr, c.scale, c.tq4(c.out), c.tlse()),
               Error);
  EXPECT_THROW(ops::attention::backward_at(c.tq4(c.q), c.tk4(c.k), c.tk4(c.v), nullptr, c.tq4(c.out), c.tlse(),
                                           c.tq4(r), c.scale, c.tq4(dq), c.tk4(dk), c.tk4(dv)),
               Error);
}

// ---- forward_block / merge / backward_block: keys in blocks at explicit positions ----

// A rank's zigzag queries over the whole sequence's keys, the keys cut into `blocks` blocks of
// scattered positions (key j goes to block (j * 7) % blocks, so a block's positions are neither
// contiguous nor sorted, and some rows see no key of a block): forward_block on each block,
// merged, gives forward_at's out and lse; backward_block's dq summed and dk, dv put back at their
// keys give backward_at's.
void expect_blocks_match_at(int blocks, int window, std::uint32_t seed) {
  const std::int64_t B = 2, T = 24, Hq = 4, Hkv = 2, D = 8, L = T / 6;
  const std::string tag = " (blocks " + std::to_string(blocks) + ", window " + std::to_string(window) + ")";
  std::vector<std::int32_t> pos;
  for (int chunk : {0, 4})  // chunk 0: its first query sees key 0 alone, so other blocks are empty for it
    for (std::int64_t x = 0; x < L; ++x) pos.push_back(static_cast<std::int32_t>(chunk * L + x));
  AtCase c(B, T, Hq, Hkv, D, pos, seed);
  c.window = window;
  c.forward();
  auto r = random_vector(c.q.size(), seed + 5);
  std::vector<float> dq0, dk0, dv0;
  c.backward(r, dq0, dk0, dv0);
  const std::int64_t tq = c.tq, w = Hkv * D;
  std::vector<float> out(c.q.size(), 3.f), lse(c.lse.size(), 3.f), dq(c.q.size(), 0.f), dk(c.k.size(), 0.f),
      dv(c.v.size(), 0.f);
  const Tensor tout(out.data(), {B, tq, Hq, D}), tlse(lse.data(), {B, Hq, tq}), tdq(dq.data(), {B, tq, Hq, D});
  bool empty_row = false;
  for (int pass = 0; pass < 2; ++pass)  // 0: forward and merge; 1: backward with the merged out, lse
    for (int blk = 0; blk < blocks; ++blk) {
      std::vector<std::int32_t> kpos;
      for (std::int64_t j = 0; j < T; ++j)
        if ((j * 7) % blocks == blk) kpos.push_back(static_cast<std::int32_t>(j));
      const std::int64_t tk = static_cast<std::int64_t>(kpos.size());
      std::vector<float> bk(B * tk * w), bv(bk.size());
      for (std::int64_t bb = 0; bb < B; ++bb)
        for (std::int64_t j = 0; j < tk; ++j) {
          std::copy_n(c.k.begin() + (bb * T + kpos[j]) * w, w, bk.begin() + (bb * tk + j) * w);
          std::copy_n(c.v.begin() + (bb * T + kpos[j]) * w, w, bv.begin() + (bb * tk + j) * w);
        }
      const Tensor tk4(bk.data(), {B, tk, Hkv, D}), tv4(bv.data(), {B, tk, Hkv, D});
      if (pass == 0) {
        std::vector<float> bo(out.size(), 9.f), bl(lse.size(), 9.f);
        const Tensor tbo(bo.data(), {B, tq, Hq, D}), tbl(bl.data(), {B, Hq, tq});
        ops::attention::forward_block(c.tq4(c.q), tk4, tv4, pos.data(), kpos.data(), c.scale, tbo, tbl, window);
        for (std::int64_t i = 0; i < B * Hq * tq; ++i)
          if (bl[i] == -std::numeric_limits<float>::infinity()) {
            empty_row = true;
            const std::int64_t bb = i / (Hq * tq), h = (i / tq) % Hq, t = i % tq;
            for (std::int64_t x = 0; x < D; ++x) ASSERT_EQ(bo[((bb * tq + t) * Hq + h) * D + x], 0.f) << tag;
          }
        if (blk == 0) {
          std::copy(bo.begin(), bo.end(), out.begin());  // (tout, tlse view these buffers)
          std::copy(bl.begin(), bl.end(), lse.begin());
        } else {
          ops::attention::merge(tbo, tbl, tout, tlse);
        }
      } else {
        std::vector<float> bdk(bk.size(), 9.f), bdv(bk.size(), 9.f);
        ops::attention::backward_block(c.tq4(c.q), tk4, tv4, pos.data(), kpos.data(), tout, tlse, c.tq4(r), c.scale,
                                       tdq, Tensor(bdk.data(), {B, tk, Hkv, D}), Tensor(bdv.data(), {B, tk, Hkv, D}),
                                       window);
        for (std::int64_t bb = 0; bb < B; ++bb)
          for (std::int64_t j = 0; j < tk; ++j) {
            std::copy_n(bdk.begin() + (bb * tk + j) * w, w, dk.begin() + (bb * T + kpos[j]) * w);
            std::copy_n(bdv.begin() + (bb * tk + j) * w, w, dv.begin() + (bb * T + kpos[j]) * w);
          }
      }
    }
  EXPECT_TRUE(empty_row || blocks == 1) << "no row saw an empty block" << tag;
  for (std::size_t i = 0; i < out.size(); ++i) {
    ASSERT_NEAR(out[i], c.out[i], 1e-6) << "out" << tag;
    ASSERT_NEAR(dq[i], dq0[i], 1e-5) << "dq" << tag;
  }
  for (std::size_t i = 0; i < lse.size(); ++i) ASSERT_NEAR(lse[i], c.lse[i], 1e-6) << "lse" << tag;
  for (std::size_t i = 0; i < dk.size(); ++i) {
    ASSERT_NEAR(dk[i], dk0[i], 1e-5) << "dk" << tag;
    ASSERT_NEAR(dv[i], dv0[i], 1e-5) << "dv" << tag;
  }
}

TEST(AttentionBlocks, MergedBlocksMatchForwardAtAndBackwardAt) {
  for (int blocks : {1, 2, 3, 5})
    for (int window : {0, 5}) expect_blocks_match_at(blocks, window, 600 + 10 * blocks + window);
}

TEST(AttentionBlocks, RejectsMissingPositions) {
  AtCase c(1, 4, 2, 1, 4, {0, 1, 2, 3}, 7);
  const std::vector<std::int32_t> kpos = {0, 1, 2, 3};
  EXPECT_THROW(ops::attention::forward_block(c.tq4(c.q), c.tk4(c.k), c.tk4(c.v), c.pos.data(), nullptr, c.scale,
                                             c.tq4(c.out), c.tlse()),
               Error);
  EXPECT_THROW(ops::attention::forward_block(c.tq4(c.q), c.tk4(c.k), c.tk4(c.v), nullptr, kpos.data(), c.scale,
                                             c.tq4(c.out), c.tlse()),
               Error);
  std::vector<float> bad(3);
  EXPECT_THROW(ops::attention::merge(c.tq4(c.out), Tensor(bad.data(), {1, 1, 3}), c.tq4(c.out), c.tlse()), Error);
}

}  // namespace
}  // namespace keel
