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

}  // namespace
}  // namespace keel
