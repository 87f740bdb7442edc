// Residual scaling and causal convolutions (ZAYA1 / CCA building blocks).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "gradcheck.h"
#include "ops/causal_conv.h"
#include "ops/residual_scale.h"

namespace keel {
namespace {

using test::check_grad;
using test::kGradTol;
using test::random_vector;
using test::weighted_sum;
namespace rs = ops::residual_scale;
namespace cc = ops::causal_conv;

TEST(OpResidualScale, ForwardMatchesFormula) {
  const std::int64_t n = 3, d = 5;
  auto x = random_vector(n * d, 1), b = random_vector(d, 2), s = random_vector(d, 3), y = std::vector<float>(n * d);
  rs::forward(Tensor(x.data(), {n, d}), Tensor(b.data(), {d}), Tensor(s.data(), {d}), Tensor(y.data(), {n, d}));
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < d; ++j) EXPECT_FLOAT_EQ(y[i * d + j], (x[i * d + j] + b[j]) * s[j]);
  // Identity at init (b = 0, s = 1).
  std::vector<float> zero(d, 0.f), one(d, 1.f);
  rs::forward(Tensor(x.data(), {n, d}), Tensor(zero.data(), {d}), Tensor(one.data(), {d}), Tensor(y.data(), {n, d}));
  EXPECT_EQ(x, y);
}

TEST(OpResidualScale, GradCheck) {
  const std::int64_t n = 6, d = 7;
  auto x = random_vector(n * d, 10), b = random_vector(d, 11, 0.5f), s = random_vector(d, 12), r = random_vector(n * d, 13);
  std::vector<float> y(n * d), dx(n * d), db(d, 0.f), ds(d, 0.f);
  auto loss = [&] {
    rs::forward(Tensor(x.data(), {n, d}), Tensor(b.data(), {d}), Tensor(s.data(), {d}), Tensor(y.data(), {n, d}));
    return weighted_sum(y.data(), r);
  };
  rs::backward(Tensor(x.data(), {n, d}), Tensor(b.data(), {d}), Tensor(s.data(), {d}), Tensor(r.data(), {n, d}),
               Tensor(dx.data(), {n, d}), Tensor(db.data(), {d}), Tensor(ds.data(), {d}));
  EXPECT_LT(check_grad("residual_scale dx", loss, x.data(), dx.data(), n * d).rel_err, kGradTol);
  EXPECT_LT(check_grad("residual_scale db", loss, b.data(), db.data(), d).rel_err, kGradTol);
  EXPECT_LT(check_grad("residual_scale ds", loss, s.data(), ds.data(), d).rel_err, kGradTol);
  // Parameter gradients accumulate: a second backward doubles them.
  const auto db1 = db;
  rs::backward(Tensor(x.data(), {n, d}), Tensor(b.data(), {d}), Tensor(s.data(), {d}), Tensor(r.data(), {n, d}), Tensor(),
               Tensor(db.data(), {d}), Tensor());
  for (std::int64_t j = 0; j < d; ++j) EXPECT_NEAR(db[j], 2 * db1[j], 1e-5);
}

TEST(OpResidualScale, MergeGradCheck) {
  const std::int64_t n = 5, d = 6;
  auto r = random_vector(n * d, 20), h = random_vector(n * d, 21), br = random_vector(d, 22, 0.3f),
       sr = random_vector(d, 23), bh = random_vector(d, 24, 0.3f), sh = random_vector(d, 25), w = random_vector(n * d, 26);
  std::vector<float> out(n * d), dr(n * d), dh(n * d), dbr(d, 0.f), dsr(d, 0.f), dbh(d, 0.f), dsh(d, 0.f);
  auto T2 = [&](std::vector<float>& v) { return Tensor(v.data(), {n, d}); };
  auto T1 = [&](std::vector<float>& v) { return Tensor(v.data(), {d}); };
  auto loss = [&] {
    rs::merge_forward(T2(r), T2(h), T1(br), T1(sr), T1(bh), T1(sh), T2(out));
    return weighted_sum(out.data(), w);
  };
  loss();
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < d; ++j)
      EXPECT_NEAR(out[i * d + j], (r[i * d + j] + br[j]) * sr[j] + (h[i * d + j] + bh[j]) * sh[j], 1e-6);
  // dr aliases dout (allowed): the h branch must read dout first.
  std::vector<float> dout = w;
  rs::merge_backward(T2(r), T2(h), T1(br), T1(sr), T1(bh), T1(sh), T2(dout), T2(dout), T2(dh), T1(dbr), T1(dsr), T1(dbh),
                     T1(dsh));
  dr = dout;
  EXPECT_LT(check_grad("residual merge dr", loss, r.data(), dr.data(), n * d).rel_err, kGradTol);
  EXPECT_LT(check_grad("residual merge dh", loss, h.data(), dh.data(), n * d).rel_err, kGradTol);
  EXPECT_LT(check_grad("residual merge db_r", loss, br.data(), dbr.data(), d).rel_err, kGradTol);
  EXPECT_LT(check_grad("residual merge ds_r", loss, sr.data(), dsr.data(), d).rel_err, kGradTol);
  EXPECT_LT(check_grad("residual merge db_h", loss, bh.data(), dbh.data(), d).rel_err, kGradTol);
  EXPECT_LT(check_grad("residual merge ds_h", loss, sh.data(), dsh.data(), d).rel_err, kGradTol);
}

// Direct loops over PyTorch's definition: pad (W0-1)+(W1-1) zeros on the left of each sequence,
// depthwise conv (bias) to T + W1 - 1 outputs, then grouped conv (bias) to T outputs.
std::vector<float> naive_two_convs(const std::vector<float>& x, std::int64_t B, std::int64_t T, std::int64_t C,
                                   std::int64_t Cg, std::int64_t W0, std::int64_t W1, const std::vector<float>& w0,
                                   const std::vector<float>& b0, const std::vector<float>& w1, const std::vector<float>& b1) {
  const std::int64_t P = (W0 - 1) + (W1 - 1), Tp = T + P, T0 = Tp - W0 + 1;
  std::vector<float> y(B * T * C);
  for (std::int64_t b = 0; b < B; ++b) {
    std::vector<double> pad(Tp * C, 0.0), o0(T0 * C, 0.0);
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t c = 0; c < C; ++c) pad[(t + P) * C + c] = x[(b * T + t) * C + c];
    for (std::int64_t j = 0; j < T0; ++j)
      for (std::int64_t c = 0; c < C; ++c) {
        double a = b0[c];
        for (std::int64_t k = 0; k < W0; ++k) a += w0[c * W0 + k] * pad[(j + k) * C + c];
        o0[j * C + c] = a;
      }
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t o = 0; o < C; ++o) {
        const std::int64_t g0 = (o / Cg) * Cg;
        double a = b1[o];
        for (std::int64_t k = 0; k < W1; ++k)
          for (std::int64_t i = 0; i < Cg; ++i) a += w1[(o * Cg + i) * W1 + k] * o0[(t + k) * C + g0 + i];
        y[(b * T + t) * C + o] = static_cast<float>(a);
      }
  }
  return y;
}

struct ConvCase {
  std::int64_t B, T, C, Cg, W0, W1;
  std::vector<float> x, w0, b0, w1, b1, mid, y;
  ConvCase(std::int64_t B_, std::int64_t T_, std::int64_t C_, std::int64_t Cg_, std::int64_t W0_, std::int64_t W1_)
      : B(B_), T(T_), C(C_), Cg(Cg_), W0(W0_), W1(W1_) {
    x = random_vector(B * T * C, 40);
    w0 = random_vector(C * W0, 41);
    b0 = random_vector(C, 42, 0.5f);
    w1 = random_vector(C * Cg * W1, 43, 0.5f);
    b1 = random_vector(C, 44, 0.5f);
    mid.resize(B * (T + W1 - 1) * C);
    y.resize(B * T * C);
  }
  Tensor tx() { return Tensor(x.data(), {B, T, C}); }
  Tensor tmid() { return Tensor(mid.data(), {B, T + W1 - 1, C}); }
  Tensor ty() { return Tensor(y.data(), {B, T, C}); }
  Tensor tw0() { return Tensor(w0.data(), {C, W0}); }
  Tensor tw1() { return Tensor(w1.data(), {C, Cg, W1}); }
  void forward() {
    cc::depthwise_forward(tx(), tw0(), Tensor(b0.data(), {C}), int(W1 - 1), tmid());
    cc::grouped_forward(tmid(), tw1(), Tensor(b1.data(), {C}), int(W1 - 1), ty());
  }
};

TEST(OpConv, TwoConvsMatchPaddedPyTorchDefinition) {
  for (auto [W0, W1] : {std::pair<int, int>{2, 2}, {3, 2}, {2, 3}, {1, 1}}) {
    ConvCase c(2, 6, 6, 3, W0, W1);
    c.forward();
    auto ref = naive_two_convs(c.x, c.B, c.T, c.C, c.Cg, c.W0, c.W1, c.w0, c.b0, c.w1, c.b1);
    for (std::size_t i = 0; i < ref.size(); ++i) ASSERT_NEAR(c.y[i], ref[i], 1e-5) << "W0 " << W0 << " W1 " << W1 << " i " << i;
  }
}

TEST(OpConv, SingleConvsMatchDirectLoops) {
  // Depthwise with extra = 0: the plain causal conv; grouped with lead = 0: zero left padding.
  const std::int64_t B = 2, T = 5, C = 4, W = 3, Cg = 2;
  auto x = random_vector(B * T * C, 50), w = random_vector(C * W, 51), b = random_vector(C, 52), wg = random_vector(C * Cg * W, 53);
  std::vector<float> y(B * T * C), yg(B * T * C);
  cc::depthwise_forward(Tensor(x.data(), {B, T, C}), Tensor(w.data(), {C, W}), Tensor(b.data(), {C}), 0, Tensor(y.data(), {B, T, C}));
  cc::grouped_forward(Tensor(x.data(), {B, T, C}), Tensor(wg.data(), {C, Cg, W}), Tensor(), 0, Tensor(yg.data(), {B, T, C}));
  for (std::int64_t bi = 0; bi < B; ++bi)
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t c = 0; c < C; ++c) {
        double a = b[c], ag = 0;
        for (std::int64_t k = 0; k < W; ++k) {
          const std::int64_t s = t - (W - 1) + k;
          if (s < 0) continue;
          a += w[c * W + k] * x[(bi * T + s) * C + c];
          for (std::int64_t i = 0; i < Cg; ++i) ag += wg[(c * Cg + i) * W + k] * x[(bi * T + s) * C + (c / Cg) * Cg + i];
        }
        EXPECT_NEAR(y[(bi * T + t) * C + c], a, 1e-5);
        EXPECT_NEAR(yg[(bi * T + t) * C + c], ag, 1e-5);
      }
}

TEST(OpConv, CausalAndSequencesIndependent) {
  ConvCase c(2, 6, 6, 3, 2, 2);
  c.forward();
  const auto y0 = c.y;
  // Change token t = 3 of sequence 0: outputs before t = 3 and all of sequence 1 are unchanged.
  for (std::int64_t ch = 0; ch < c.C; ++ch) c.x[3 * c.C + ch] += 0.7f;
  c.forward();
  for (std::int64_t t = 0; t < c.T; ++t)
    for (std::int64_t ch = 0; ch < c.C; ++ch) {
      const std::int64_t i = t * c.C + ch;
      if (t < 3) {
        EXPECT_EQ(c.y[i], y0[i]);
      } else {
        EXPECT_NE(c.y[i], y0[i]) << "t " << t;  // the two width-2 convs carry token 3 to t = 3, 4, 5
      }
    }
  for (std::int64_t i = c.T * c.C; i < 2 * c.T * c.C; ++i) EXPECT_EQ(c.y[i], y0[i]);
}

TEST(OpConv, GradCheck) {
  for (auto [W0, W1] : {std::pair<int, int>{2, 2}, {3, 2}}) {
    ConvCase c(2, 5, 6, 3, W0, W1);
    auto r = random_vector(c.y.size(), 60);
    auto loss = [&] {
      c.forward();
      return weighted_sum(c.y.data(), r);
    };
    loss();
    std::vector<float> dmid(c.mid.size()), dx(c.x.size()), dw0(c.w0.size(), 0.f), db0(c.C, 0.f), dw1(c.w1.size(), 0.f),
        db1(c.C, 0.f);
    cc::grouped_backward(c.tmid(), c.tw1(), int(W1 - 1), Tensor(r.data(), {c.B, c.T, c.C}), Tensor(dmid.data(), {c.B, c.T + W1 - 1, c.C}),
                         Tensor(dw1.data(), {c.C, c.Cg, W1}), Tensor(db1.data(), {c.C}));
    cc::depthwise_backward(c.tx(), c.tw0(), int(W1 - 1), Tensor(dmid.data(), {c.B, c.T + W1 - 1, c.C}), Tensor(dx.data(), {c.B, c.T, c.C}),
                           Tensor(dw0.data(), {c.C, W0}), Tensor(db0.data(), {c.C}));
    const std::string tag = " (W0 " + std::to_string(W0) + ", W1 " + std::to_string(W1) + ")";
    EXPECT_LT(check_grad("conv dx" + tag, loss, c.x.data(), dx.data(), c.x.size()).rel_err, kGradTol);
    EXPECT_LT(check_grad("conv depthwise dw" + tag, loss, c.w0.data(), dw0.data(), c.w0.size()).rel_err, kGradTol);
    EXPECT_LT(check_grad("conv depthwise db" + tag, loss, c.b0.data(), db0.data(), c.C).rel_err, kGradTol);
    EXPECT_LT(check_grad("conv grouped dw" + tag, loss, c.w1.data(), dw1.data(), c.w1.size()).rel_err, kGradTol);
    EXPECT_LT(check_grad("conv grouped db" + tag, loss, c.b1.data(), db1.data(), c.C).rel_err, kGradTol);
  }
}

// Halo: the depthwise conv of a run reads the run's halo (the P = (W1-1) + (W0-1) inputs before
// it) instead of zeros. A sequence of T tokens split at p: part 1 (tokens 0 .. p-1, no halo) and
// part 2 (tokens p .. T-1, halo = part 1's last P rows) compose to the whole sequence's result.
std::vector<float> take_rows(const std::vector<float>& v, std::int64_t B, std::int64_t T, std::int64_t C,
                             std::int64_t t0, std::int64_t n) {
  std::vector<float> out(B * n * C);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t c = 0; c < C; ++c) out[(b * n + t) * C + c] = v[(b * T + t0 + t) * C + c];
  return out;
}

struct HaloSplit {
  ConvCase& w;  // the whole sequence (weights, x, forward results)
  std::int64_t p, P, T1, T2;
  std::vector<float> x1, x2, halo, mid1, mid2, y1, y2;
  HaloSplit(ConvCase& whole, std::int64_t p_)
      : w(whole), p(p_), P(whole.W1 - 1 + whole.W0 - 1), T1(p_), T2(whole.T - p_) {
    x1 = take_rows(w.x, w.B, w.T, w.C, 0, T1);
    x2 = take_rows(w.x, w.B, w.T, w.C, p, T2);
    halo = take_rows(w.x, w.B, w.T, w.C, p - P, P);
    mid1.resize(w.B * (T1 + w.W1 - 1) * w.C);
    mid2.resize(w.B * (T2 + w.W1 - 1) * w.C);
    y1.resize(w.B * T1 * w.C);
    y2.resize(w.B * T2 * w.C);
  }
  Tensor t(std::vector<float>& v, std::int64_t T) { return Tensor(v.data(), {w.B, T, w.C}); }
  void forward() {
    const int e = int(w.W1 - 1);
    cc::depthwise_forward(t(x1, T1), w.tw0(), Tensor(w.b0.data(), {w.C}), e, t(mid1, T1 + e));
    cc::grouped_forward(t(mid1, T1 + e), w.tw1(), Tensor(w.b1.data(), {w.C}), e, t(y1, T1));
    cc::depthwise_forward(t(x2, T2), w.tw0(), Tensor(w.b0.data(), {w.C}), e, t(mid2, T2 + e), t(halo, P));
    cc::grouped_forward(t(mid2, T2 + e), w.tw1(), Tensor(w.b1.data(), {w.C}), e, t(y2, T2));
  }
};

TEST(OpConv, HaloForwardMatchesWholeSequence) {
  for (auto [W0, W1] : {std::pair<int, int>{2, 2}, {3, 2}, {2, 3}})
    for (std::int64_t p : {3, 4}) {
      ConvCase c(2, 7, 6, 3, W0, W1);
      c.forward();
      HaloSplit h(c, p);
      h.forward();
      const auto ref1 = take_rows(c.y, c.B, c.T, c.C, 0, p), ref2 = take_rows(c.y, c.B, c.T, c.C, p, c.T - p);
      for (std::size_t i = 0; i < ref1.size(); ++i) ASSERT_EQ(h.y1[i], ref1[i]) << "W0 " << W0 << " W1 " << W1 << " p " << p;
      for (std::size_t i = 0; i < ref2.size(); ++i)
        ASSERT_NEAR(h.y2[i], ref2[i], 1e-6) << "W0 " << W0 << " W1 " << W1 << " p " << p << " i " << i;
      // The halo matters: zeros instead give another result at part 2's first token.
      std::vector<float> mid(h.mid2.size()), y(h.y2.size());
      const int e = int(W1 - 1);
      cc::depthwise_forward(h.t(h.x2, h.T2), c.tw0(), Tensor(c.b0.data(), {c.C}), e, h.t(mid, h.T2 + e));
      cc::grouped_forward(h.t(mid, h.T2 + e), c.tw1(), Tensor(c.b1.data(), {c.C}), e, h.t(y, h.T2));
      double diff = 0;
      for (std::int64_t ch = 0; ch < c.C; ++ch) diff += std::abs(y[ch] - h.y2[ch]);
      EXPECT_GT(diff, 1e-3) << "W0 " << W0 << " W1 " << W1;
    }
}

TEST(OpConv, HaloOfZerosEqualsNoHalo) {
  for (auto [W0, W1] : {std::pair<int, int>{2, 2}, {3, 2}, {2, 3}}) {
    ConvCase c(2, 5, 6, 3, W0, W1);
    const std::int64_t P = (W1 - 1) + (W0 - 1), e = W1 - 1;
    std::vector<float> zeros(c.B * P * c.C, 0.f), mid(c.mid.size()), dx(c.x.size()), dx0(c.x.size()),
        dhalo(zeros.size(), 7.f), dw(c.w0.size(), 0.f), dw0(c.w0.size(), 0.f);
    const Tensor th(zeros.data(), {c.B, P, c.C});
    cc::depthwise_forward(c.tx(), c.tw0(), Tensor(c.b0.data(), {c.C}), int(e), c.tmid());
    cc::depthwise_forward(c.tx(), c.tw0(), Tensor(c.b0.data(), {c.C}), int(e), Tensor(mid.data(), {c.B, c.T + e, c.C}), th);
    for (std::size_t i = 0; i < mid.size(); ++i) ASSERT_EQ(mid[i], c.mid[i]);
    auto dmid = random_vector(mid.size(), 61);
    const Tensor tdm(dmid.data(), {c.B, c.T + e, c.C});
    cc::depthwise_backward(c.tx(), c.tw0(), int(e), tdm, Tensor(dx0.data(), {c.B, c.T, c.C}), Tensor(dw0.data(), {c.C, W0}),
                           Tensor());
    cc::depthwise_backward(c.tx(), c.tw0(), int(e), tdm, Tensor(dx.data(), {c.B, c.T, c.C}), Tensor(dw.data(), {c.C, W0}),
                           Tensor(), th, Tensor(dhalo.data(), {c.B, P, c.C}));
    for (std::size_t i = 0; i < dx.size(); ++i) ASSERT_EQ(dx[i], dx0[i]);
    for (std::size_t i = 0; i < dw.size(); ++i) ASSERT_EQ(dw[i], dw0[i]);
    // dhalo overwritten: halo row h (time h - P) gets w[c, k] dmid[row h - P + (W0-1) - k + e].
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < P; ++h)
        for (std::int64_t ch = 0; ch < c.C; ++ch) {
          double a = 0;
          for (std::int64_t k = 0; k < W0; ++k) {
            const std::int64_t j = h - P + (W0 - 1) - k + e;
            if (j >= 0) a += c.w0[ch * W0 + k] * dmid[(b * (c.T + e) + j) * c.C + ch];
          }
          EXPECT_NEAR(dhalo[(b * P + h) * c.C + ch], a, 1e-6);
        }
  }
}

TEST(OpConv, HaloBackwardMatchesWholeSequence) {
  for (auto [W0, W1] : {std::pair<int, int>{2, 2}, {3, 2}, {2, 3}})
    for (std::int64_t p : {3, 4}) {
      ConvCase c(2, 7, 6, 3, W0, W1);
      c.forward();
      HaloSplit h(c, p);
      h.forward();
      const std::int64_t B = c.B, T = c.T, C = c.C, e = W1 - 1, P = h.P, T1 = h.T1, T2 = h.T2;
      const auto dy = random_vector(B * T * C, 62);
      // Whole sequence.
      std::vector<float> dmid(c.mid.size()), dx(c.x.size()), dw0(c.w0.size(), 0.f), db0(C, 0.f), dw1(c.w1.size(), 0.f),
          db1(C, 0.f);
      auto dyw = dy;
      cc::grouped_backward(c.tmid(), c.tw1(), int(e), Tensor(dyw.data(), {B, T, C}), Tensor(dmid.data(), {B, T + e, C}),
                           Tensor(dw1.data(), {C, c.Cg, W1}), Tensor(db1.data(), {C}));
      cc::depthwise_backward(c.tx(), c.tw0(), int(e), Tensor(dmid.data(), {B, T + e, C}), Tensor(dx.data(), {B, T, C}),
                             Tensor(dw0.data(), {C, W0}), Tensor(db0.data(), {C}));
      // The two parts; parameter gradients accumulate over both.
      auto dy1 = take_rows(dy, B, T, C, 0, T1), dy2 = take_rows(dy, B, T, C, p, T2);
      std::vector<float> dmid1(h.mid1.size()), dmid2(h.mid2.size()), dx1(h.x1.size()), dx2(h.x2.size()),
          dhalo(h.halo.size(), 7.f), sw0(c.w0.size(), 0.f), sb0(C, 0.f), sw1(c.w1.size(), 0.f), sb1(C, 0.f);
      const Tensor tsw0(sw0.data(), {C, W0}), tsb0(sb0.data(), {C}), tsw1(sw1.data(), {C, c.Cg, W1}), tsb1(sb1.data(), {C});
      cc::grouped_backward(h.t(h.mid1, T1 + e), c.tw1(), int(e), h.t(dy1, T1), h.t(dmid1, T1 + e), tsw1, tsb1);
      cc::depthwise_backward(h.t(h.x1, T1), c.tw0(), int(e), h.t(dmid1, T1 + e), h.t(dx1, T1), tsw0, tsb0);
      cc::grouped_backward(h.t(h.mid2, T2 + e), c.tw1(), int(e), h.t(dy2, T2), h.t(dmid2, T2 + e), tsw1, tsb1);
      cc::depthwise_backward(h.t(h.x2, T2), c.tw0(), int(e), h.t(dmid2, T2 + e), h.t(dx2, T2), tsw0, tsb0, h.t(h.halo, P),
                             h.t(dhalo, P));
      // dhalo is the gradient of part 1's last P rows.
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t i = 0; i < P * C; ++i) dx1[(b * T1 + T1 - P) * C + i] += dhalo[b * P * C + i];
      const std::string tag = "W0 " + std::to_string(W0) + " W1 " + std::to_string(W1) + " p " + std::to_string(p);
      const auto ref1 = take_rows(dx, B, T, C, 0, T1), ref2 = take_rows(dx, B, T, C, p, T2);
      for (std::size_t i = 0; i < ref1.size(); ++i) ASSERT_NEAR(dx1[i], ref1[i], 1e-5) << tag << " dx part 1, i " << i;
      for (std::size_t i = 0; i < ref2.size(); ++i) ASSERT_NEAR(dx2[i], ref2[i], 1e-5) << tag << " dx part 2, i " << i;
      for (std::size_t i = 0; i < dw0.size(); ++i) EXPECT_NEAR(sw0[i], dw0[i], 1e-5) << tag << " dw0 " << i;
      for (std::size_t i = 0; i < dw1.size(); ++i) EXPECT_NEAR(sw1[i], dw1[i], 1e-5) << tag << " dw1 " << i;
      for (std::int64_t i = 0; i < C; ++i) {
        EXPECT_NEAR(sb0[i], db0[i], 1e-5) << tag << " db0 " << i;
        EXPECT_NEAR(sb1[i], db1[i], 1e-5) << tag << " db1 " << i;
      }
    }
}

}  // namespace
}  // namespace keel
