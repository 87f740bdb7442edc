#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
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

}  // namespace
}  // namespace keel
