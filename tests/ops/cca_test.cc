// ZAYA1 CCA block: end-to-end gradient check, a naive double-precision forward written from the
// reference's equations (with and without a sliding layer's window), causality and independence
// of the sequences of a batch.
#include "ops/cca.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "adjacent_runs.h"
#include "common/error.h"
#include "gradcheck.h"
#include "ops/sequence_split.h"

namespace keel {
namespace {

using test::check_grad;
using test::kGradTol;
using test::random_vector;
using test::weighted_sum;
namespace ca = ops::cca;

struct CcaCase {
  ca::Config c;
  std::int64_t B, T, N, C;
  ops::rope::Table rt;
  std::vector<std::vector<float>> p, g;  // w_qk w_v conv0_w conv0_b conv1_w conv1_b temp w_o
  std::vector<float> x, y, saved_buf;
  std::vector<std::int32_t> pos;
  ca::Saved s;
  CcaCase(std::int64_t B_, std::int64_t T_, std::int64_t H, std::int64_t nq, std::int64_t nkv, std::int64_t d, int W0 = 2,
          int W1 = 2)
      : B(B_), T(T_), N(B_ * T_) {
    c.hidden = H;
    c.q_heads = nq;
    c.kv_heads = nkv;
    c.head_dim = d;
    c.conv0_width = W0;
    c.conv1_width = W1;
    C = c.qk_channels();
    rt = ops::rope::make_table(int(d), 0.5, 10000.0, 64);
    const float sh = 1.f / std::sqrt(float(H));
    p = {random_vector(C * H, 700, sh),      random_vector(nkv * d * H, 701, sh), random_vector(C * W0, 702, 0.8f),
         random_vector(C, 703, 0.3f),        random_vector(C * d * W1, 704, 0.5f / std::sqrt(float(d))),
         random_vector(C, 705, 0.3f),        random_vector(nkv, 706, 0.5f),       random_vector(H * nq * d, 707, 1.f / std::sqrt(float(nq * d)))};
    for (auto& t : p[6]) t = 1.f + t;  // temperatures in [0.5, 1.5]
    for (auto& v : p) g.emplace_back(v.size(), 0.f);
    x = random_vector(N * H, 710);
    y.resize(N * H);
    saved_buf.resize(ca::saved_floats(c, B, T));
    s = ca::carve_saved(c, B, T, saved_buf.data());
    for (std::int64_t i = 0; i < N; ++i) pos.push_back(std::int32_t(i % T));
  }
  ca::Params view(std::vector<std::vector<float>>& v) {
    const std::int64_t d = c.head_dim;
    ca::Params q;
    q.w_qk = Tensor(v[0].data(), {C, c.hidden});
    q.w_v = Tensor(v[1].data(), {c.kv_heads * d, c.hidden});
    q.conv0_w = Tensor(v[2].data(), {C, c.conv0_width});
    q.conv0_b = Tensor(v[3].data(), {C});
    q.conv1_w = Tensor(v[4].data(), {C, d, c.conv1_width});
    q.conv1_b = Tensor(v[5].data(), {C});
    q.temp = Tensor(v[6].data(), {c.kv_heads});
    q.w_o = Tensor(v[7].data(), {c.hidden, c.att_heads() * d});
    return q;
  }
  void forward() { ca::forward(c, B, T, Tensor(x.data(), {N, c.hidden}), pos.data(), rt, view(p), s, Tensor(y.data(), {N, c.hidden})); }
};

const char* kNames[] = {"w_qk", "w_v", "conv0_w", "conv0_b", "conv1_w", "conv1_b", "temp", "w_o"};

// The reference's equations in double, token by token (modeling_zaya.py CCA + ZayaAttention).
std::vector<double> naive_cca(CcaCase& k) {
  const auto& c = k.c;
  const std::int64_t B = k.B, T = k.T, H = c.hidden, d = c.head_dim, nq = c.q_heads, nkv = c.kv_heads, G = nq / nkv,
                     C = k.C, W0 = c.conv0_width, W1 = c.conv1_width, dq = nq * d, dk = nkv * d;
  const auto &wqk = k.p[0], &wv = k.p[1], &w0 = k.p[2], &b0 = k.p[3], &w1 = k.p[4], &b1 = k.p[5], &tmp = k.p[6], &wo = k.p[7];
  std::vector<double> y(B * T * H, 0.0);
  const int R = k.rt.rotary_dim;
  for (std::int64_t b = 0; b < B; ++b) {
    auto X = [&](std::int64_t t, std::int64_t j) { return t < 0 ? 0.0 : double(k.x[(b * T + t) * H + j]); };
    std::vector<double> qk0(T * C, 0.0), Q(T * dq), K(T * dk), V(T * dk);
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t o = 0; o < C; ++o)
        for (std::int64_t j = 0; j < H; ++j) qk0[t * C + o] += wqk[o * H + j] * X(t, j);
    auto Q0 = [&](std::int64_t t, std::int64_t ch) { return t < 0 ? 0.0 : qk0[t * C + ch]; };
    // Depthwise output at time s (s >= -(W1-1)), then grouped output at t.
    auto O = [&](std::int64_t s, std::int64_t ch) {
      double a = b0[ch];
      for (std::int64_t kk = 0; kk < W0; ++kk) a += w0[ch * W0 + kk] * Q0(s - (W0 - 1) + kk, ch);
      return a;
    };
    for (std::int64_t t = 0; t < T; ++t) {
      std::vector<double> a(C);
      for (std::int64_t o = 0; o < C; ++o) {
        double acc = b1[o];
        const std::int64_t g0 = (o / d) * d;
        for (std::int64_t kk = 0; kk < W1; ++kk)
          for (std::int64_t i = 0; i < d; ++i) acc += w1[(o * d + i) * W1 + kk] * O(t - (W1 - 1) + kk, g0 + i);
        a[o] = acc;
      }
      // Mixing: qk_mean_q = (q + repeat(k)) / 2; qk_mean_k = mean over the group of qk_mean_q.
      for (std::int64_t h = 0; h < nq; ++h)
        for (std::int64_t i = 0; i < d; ++i) a[h * d + i] += 0.5 * (qk0[t * C + h * d + i] + qk0[t * C + dq + (h / G) * d + i]);
      for (std::int64_t gk = 0; gk < nkv; ++gk)
        for (std::int64_t i = 0; i < d; ++i) {
          double m = 0;
          for (std::int64_t j = 0; j < G; ++j) m += 0.5 * (qk0[t * C + (gk * G + j) * d + i] + qk0[t * C + dq + gk * d + i]);
          a[dq + gk * d + i] += m / G;
        }
      for (std::int64_t h = 0; h < nq + nkv; ++h) {
        double ss = 0;
        for (std::int64_t i = 0; i < d; ++i) ss += a[h * d + i] * a[h * d + i];
        const double sc = std::sqrt(double(d)) / std::sqrt(ss) * (h < nq ? 1.0 : double(tmp[h - nq]));
        std::vector<double> u(d);
        for (std::int64_t i = 0; i < d; ++i) u[i] = a[h * d + i] * sc;
        // Partial rotate-half RoPE, angles in double.
        const double pos = double(k.pos[b * T + t]);
        std::vector<double> r = u;
        for (int i = 0; i < R / 2; ++i) {
          const double ang = pos * std::pow(10000.0, -2.0 * i / R);
          r[i] = u[i] * std::cos(ang) - u[i + R / 2] * std::sin(ang);
          r[i + R / 2] = u[i + R / 2] * std::cos(ang) + u[i] * std::sin(ang);
        }
        for (std::int64_t i = 0; i < d; ++i) (h < nq ? Q[t * dq + h * d + i] : K[t * dk + (h - nq) * d + i]) = r[i];
      }
      for (std::int64_t o = 0; o < dk; ++o) {
        double acc = 0;
        for (std::int64_t j = 0; j < H; ++j) acc += wv[o * H + j] * (o < dk / 2 ? X(t, j) : X(t - 1, j));
        V[t * dk + o] = acc;
      }
    }
    for (std::int64_t t = 0; t < T; ++t) {
      std::vector<double> att(dq, 0.0);
      const std::int64_t j0 = c.window > 0 ? std::max<std::int64_t>(0, t - c.window + 1) : 0;  // sliding layer
      for (std::int64_t h = 0; h < nq; ++h) {
        const std::int64_t gk = h / G;
        std::vector<double> sc(t + 1);
        double mx = -1e300, z = 0;
        for (std::int64_t j = j0; j <= t; ++j) {
          double dot = 0;
          for (std::int64_t i = 0; i < d; ++i) dot += Q[t * dq + h * d + i] * K[j * dk + gk * d + i];
          sc[j] = dot / std::sqrt(double(d));
          mx = std::max(mx, sc[j]);
        }
        for (std::int64_t j = j0; j <= t; ++j) z += (sc[j] = std::exp(sc[j] - mx));
        for (std::int64_t j = j0; j <= t; ++j)
          for (std::int64_t i = 0; i < d; ++i) att[h * d + i] += sc[j] / z * V[j * dk + gk * d + i];
      }
      for (std::int64_t o = 0; o < H; ++o) {
        double acc = 0;
        for (std::int64_t i = 0; i < dq; ++i) acc += wo[o * dq + i] * att[i];
        y[(b * T + t) * H + o] = acc;
      }
    }
  }
  return y;
}

TEST(OpCca, ForwardMatchesNaiveReferenceEquations) {
  struct Shape {
    std::int64_t nq, nkv;
    int W0, W1;
  };
  for (Shape sh : {Shape{4, 2, 2, 2}, Shape{2, 2, 3, 2}, Shape{3, 1, 2, 3}}) {
    CcaCase k(2, 6, 12, sh.nq, sh.nkv, 8, sh.W0, sh.W1);
    k.forward();
    const auto ref = naive_cca(k);
    double err = 0, mag = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      err = std::max(err, std::abs(ref[i] - k.y[i]));
      mag = std::max(mag, std::abs(ref[i]));
    }
    EXPECT_GT(mag, 0.1);
    EXPECT_LT(err, 1e-4 * std::max(1.0, mag)) << "nq " << sh.nq << " nkv " << sh.nkv << " W0 " << sh.W0 << " W1 " << sh.W1;
  }
}

// A sliding layer's CCA (Config::window): the attention sees the last W tokens; the convs and
// the value shift are unchanged. The window must change the output (else it was ignored).
TEST(OpCca, SlidingWindowMatchesNaiveReferenceEquations) {
  CcaCase full(2, 7, 12, 4, 2, 8, 2, 3);
  full.forward();
  for (int w : {1, 2, 4}) {
    CcaCase k(2, 7, 12, 4, 2, 8, 2, 3);
    k.c.window = w;
    k.forward();
    const auto ref = naive_cca(k);
    double err = 0, mag = 0, moved = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      err = std::max(err, std::abs(ref[i] - k.y[i]));
      mag = std::max(mag, std::abs(ref[i]));
      moved = std::max(moved, double(std::abs(k.y[i] - full.y[i])));
    }
    EXPECT_LT(err, 1e-4 * std::max(1.0, mag)) << "window " << w;
    EXPECT_GT(moved, 1e-3) << "window " << w << " computed full causal attention";
  }
}

TEST(OpCca, ValuesAreCurrentAndPreviousTokenWithZeroBeforeTheFirst) {
  CcaCase k(2, 4, 12, 4, 2, 8);
  k.forward();
  const std::int64_t H = 12, dk = 16, half = 8;
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t t = 0; t < 4; ++t)
      for (std::int64_t o = 0; o < dk; ++o) {
        double acc = 0;
        const std::int64_t src = o < half ? t : t - 1;
        if (src >= 0)
          for (std::int64_t j = 0; j < H; ++j) acc += k.p[1][o * H + j] * k.x[(b * 4 + src) * H + j];
        EXPECT_NEAR(k.s.v.row(b * 4 + t)[o], acc, 1e-5) << b << " " << t << " " << o;
      }
}

TEST(OpCca, CausalAndSequencesIndependent) {
  CcaCase k(2, 6, 12, 4, 2, 8);
  k.forward();
  const auto y0 = k.y;
  const std::int64_t H = 12, t_change = 3;
  for (std::int64_t j = 0; j < H; ++j) k.x[t_change * H + j] += 0.5f;  // sequence 0, token 3
  k.forward();
  for (std::int64_t t = 0; t < 6; ++t) {
    double diff = 0;
    for (std::int64_t j = 0; j < H; ++j) diff += std::abs(k.y[t * H + j] - y0[t * H + j]);
    if (t < t_change) {
      EXPECT_EQ(diff, 0.0) << "token " << t << " saw a later token";
    } else {
      EXPECT_GT(diff, 1e-4) << "token " << t;
    }
  }
  for (std::int64_t i = 6 * H; i < 12 * H; ++i) EXPECT_EQ(k.y[i], y0[i]) << "sequence 1 changed";
}

TEST(OpCca, GradCheckEndToEnd) {
  struct Shape {
    std::int64_t nq, nkv;
    int W0, W1;
  };
  for (Shape sh : {Shape{4, 2, 2, 2}, Shape{3, 1, 3, 2}}) {
    CcaCase k(2, 5, 12, sh.nq, sh.nkv, 8, sh.W0, sh.W1);
    if (sh.nkv == 1) k.c.l2_eps = 0.05f;  // the eps path of the normalization (large, so it matters)
    if (sh.nkv == 2) k.c.window = 2;      // a sliding layer
    auto r = random_vector(k.y.size(), 720);
    auto loss = [&] {
      k.forward();
      return weighted_sum(k.y.data(), r);
    };
    loss();
    std::vector<float> dx(k.x.size()), scratch(ca::backward_scratch_floats(k.c, k.B, k.T));
    ca::backward(k.c, k.B, k.T, Tensor(k.x.data(), {k.N, 12}), k.pos.data(), k.rt, k.view(k.p), k.s, Tensor(r.data(), {k.N, 12}),
                 Tensor(dx.data(), {k.N, 12}), k.view(k.g), Tensor(scratch.data(), {std::int64_t(scratch.size())}));
    const std::string tag = " (nq " + std::to_string(sh.nq) + ", nkv " + std::to_string(sh.nkv) + ", W0 " +
                            std::to_string(sh.W0) + (k.c.l2_eps > 0 ? ", l2_eps" : "") +
                            (k.c.window > 0 ? ", window 2" : "") + ")";
    EXPECT_LT(check_grad("cca dx" + tag, loss, k.x.data(), dx.data(), dx.size()).rel_err, kGradTol);
    for (int i = 0; i < 8; ++i)
      EXPECT_LT(check_grad(std::string("cca d") + kNames[i] + tag, loss, k.p[i].data(), k.g[i].data(), k.p[i].size()).rel_err,
                kGradTol);
  }
}

// ---- CCA over a SequenceSplit (ops/sequence_split.h) ----

using test::AdjacentRuns;  // tests/ops/adjacent_runs.h

// Two runs whose halos are always zeros (the base class's halo): what an ignored halo would give.
class ZeroHalos : public ops::SequenceSplit {
 public:
  int segments() const override { return 2; }
};

struct CcaResult {
  std::vector<float> y, dx;
  std::vector<std::vector<float>> g;  // kNames order
};

// Forward then backward (dy) of k's case through `split` (null: whole sequences), with Saved and
// scratch sized for the split's segments.
CcaResult run_cca(CcaCase& k, ops::SequenceSplit* split, std::vector<float>& dy) {
  const int S = split ? split->segments() : 0;
  const std::int64_t H = k.c.hidden;
  std::vector<float> saved(ca::saved_floats(k.c, k.B, k.T, S)), scratch(ca::backward_scratch_floats(k.c, k.B, k.T, S));
  const ca::Saved s = ca::carve_saved(k.c, k.B, k.T, saved.data(), S);
  CcaResult r;
  r.y.resize(k.N * H);
  r.dx.resize(k.N * H);
  for (auto& v : k.p) r.g.emplace_back(v.size(), 0.f);
  const Tensor x(k.x.data(), {k.N, H});
  ca::forward(k.c, k.B, k.T, x, k.pos.data(), k.rt, k.view(k.p), s, Tensor(r.y.data(), {k.N, H}), split);
  ca::backward(k.c, k.B, k.T, x, k.pos.data(), k.rt, k.view(k.p), s, Tensor(dy.data(), {k.N, H}),
               Tensor(r.dx.data(), {k.N, H}), k.view(r.g), Tensor(scratch.data(), {std::int64_t(scratch.size())}), split);
  return r;
}

// max |a - b| / max(1, max |b|)
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double err = 0, mag = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    err = std::max(err, double(std::abs(a[i] - b[i])));
    mag = std::max(mag, double(std::abs(b[i])));
  }
  return err / std::max(1.0, mag);
}

TEST(CcaSplit, AdjacentRunsEqualWholeSequences) {
  struct Shape {
    int W0, W1, S, window;
  };
  for (Shape sh : {Shape{2, 2, 2, 0}, Shape{2, 2, 3, 0}, Shape{3, 2, 2, 0}, Shape{3, 2, 3, 0}, Shape{2, 3, 3, 0},
                   Shape{3, 2, 2, 5}}) {
    CcaCase k(2, 12, 32, 4, 2, 8, sh.W0, sh.W1);
    k.c.window = sh.window;
    auto dy = random_vector(k.N * 32, 730);
    const CcaResult whole = run_cca(k, nullptr, dy);
    AdjacentRuns split(sh.S);
    const CcaResult runs = run_cca(k, &split, dy);
    const std::string tag = "W0 " + std::to_string(sh.W0) + " W1 " + std::to_string(sh.W1) + " S " +
                            std::to_string(sh.S) + " window " + std::to_string(sh.window);
    EXPECT_EQ(rel_diff(runs.y, whole.y), 0.0) << tag << ": y (the same float operations: bit-exact)";
    EXPECT_LT(rel_diff(runs.dx, whole.dx), 1e-5) << tag << ": dx";
    for (int i = 0; i < 8; ++i) {
      EXPECT_LT(rel_diff(runs.g[i], whole.g[i]), 1e-5) << tag << ": d" << kNames[i];
      EXPECT_GT(rel_diff(whole.g[i], std::vector<float>(whole.g[i].size(), 0.f)), 0.0) << tag << ": d" << kNames[i] << " is zero";
    }
  }
}

// Config::attend_q (tensor parallelism past the kv heads): P parts, each attending its query
// heads with W_o's matching columns, sum to the whole op: y and dx summed over the parts, the
// projections', convolutions' and temperatures' gradients too (each part's a partial one), and
// each part's W_o gradient is the whole one's columns. With and without a sequence split.
TEST(OpCca, AttendedPartsSumToTheWhole) {
  for (int P : {4, 2}) {
    for (int S : {0, 2}) {
      CcaCase k(2, 12, 32, 4, 2, 8);
      const std::int64_t H = 32, d = 8, per = 4 / P;
      auto dy = random_vector(k.N * H, 740);
      AdjacentRuns runs(S > 0 ? S : 1);
      ops::SequenceSplit* split = S > 0 ? &runs : nullptr;
      const CcaResult whole = run_cca(k, split, dy);
      std::vector<float> y(whole.y.size(), 0.f), dx(whole.dx.size(), 0.f);
      std::vector<std::vector<float>> g;
      for (int i = 0; i < 7; ++i) g.emplace_back(whole.g[i].size(), 0.f);
      for (int r = 0; r < P; ++r) {
        CcaCase part = k;
        part.c.attend_q0 = r * per;
        part.c.attend_q = per;
        std::vector<float> wo(static_cast<std::size_t>(H * per * d));
        for (std::int64_t i = 0; i < H; ++i)
          for (std::int64_t j = 0; j < per * d; ++j) wo[i * per * d + j] = k.p[7][i * 4 * d + r * per * d + j];
        part.p[7] = wo;
        const CcaResult got = run_cca(part, split, dy);
        for (std::size_t i = 0; i < y.size(); ++i) y[i] += got.y[i], dx[i] += got.dx[i];
        for (int i = 0; i < 7; ++i)
          for (std::size_t j = 0; j < g[i].size(); ++j) g[i][j] += got.g[i][j];
        std::vector<float> want_wo(wo.size());
        for (std::int64_t i = 0; i < H; ++i)
          for (std::int64_t j = 0; j < per * d; ++j) want_wo[i * per * d + j] = whole.g[7][i * 4 * d + r * per * d + j];
        EXPECT_LT(rel_diff(got.g[7], want_wo), 1e-6) << "P " << P << " S " << S << " part " << r << ": dw_o";
      }
      const std::string tag = "P " + std::to_string(P) + " S " + std::to_string(S);
      EXPECT_LT(rel_diff(y, whole.y), 1e-5) << tag << ": y";
      EXPECT_LT(rel_diff(dx, whole.dx), 1e-5) << tag << ": dx";
      for (int i = 0; i < 7; ++i) EXPECT_LT(rel_diff(g[i], whole.g[i]), 1e-5) << tag << ": d" << kNames[i];
    }
  }
}

TEST(OpCca, AttendedHeadsMustShareOneKvHead) {
  CcaCase k(1, 4, 16, 4, 2, 8);
  k.c.attend_q0 = 1, k.c.attend_q = 2;  // heads 1 and 2: kv heads 0 and 1
  std::vector<float> dy(k.y.size(), 1.f);
  try {
    run_cca(k, nullptr, dy);
    ADD_FAILURE() << "accepted query heads of two kv groups";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("inside one kv group"), std::string::npos) << e.what();
  }
}

// The base split (whole sequences, segments 1): zero halos, the same result as no split.
TEST(CcaSplit, WholeSequencesSplitEqualsNoSplit) {
  CcaCase k(2, 6, 32, 4, 2, 8, 3, 2);
  auto dy = random_vector(k.N * 32, 731);
  const CcaResult whole = run_cca(k, nullptr, dy), one = run_cca(k, &ops::whole_sequences(), dy);
  EXPECT_LT(rel_diff(one.y, whole.y), 1e-6);
  EXPECT_LT(rel_diff(one.dx, whole.dx), 1e-5);
  for (int i = 0; i < 8; ++i) EXPECT_LT(rel_diff(one.g[i], whole.g[i]), 1e-5) << kNames[i];
}

// Halos of zeros (as if the halo were ignored) must change run 1's first tokens (conv and value
// shift) and leave run 0 alone: the equality above cannot come from an unused halo.
TEST(CcaSplit, ZeroHalosDifferAtTheFirstTokensOfTheSecondRun) {
  for (auto [W0, W1] : {std::pair<int, int>{2, 2}, {3, 2}}) {
    CcaCase k(2, 8, 32, 4, 2, 8, W0, W1);
    auto dy = random_vector(k.N * 32, 732);
    const CcaResult whole = run_cca(k, nullptr, dy);
    ZeroHalos split;
    const CcaResult zero = run_cca(k, &split, dy);
    const std::int64_t H = 32, L = 4;
    for (std::int64_t b = 0; b < 2; ++b) {
      for (std::int64_t t = 0; t < L; ++t)
        for (std::int64_t j = 0; j < H; ++j)
          EXPECT_EQ(zero.y[(b * 8 + t) * H + j], whole.y[(b * 8 + t) * H + j]) << "run 0 token " << t;
      double diff = 0;
      for (std::int64_t j = 0; j < H; ++j) diff += std::abs(zero.y[(b * 8 + L) * H + j] - whole.y[(b * 8 + L) * H + j]);
      EXPECT_GT(diff, 1e-3) << "W0 " << W0 << " W1 " << W1 << " sequence " << b << ": run 1's first token ignored its halo";
    }
  }
}

TEST(CcaSplit, RejectsTokensNotDivisibleIntoRuns) {
  CcaCase k(2, 7, 32, 4, 2, 8);
  AdjacentRuns split(2);
  EXPECT_THROW(ca::saved_floats(k.c, k.B, k.T, 2), Error);
  EXPECT_THROW(ca::backward_scratch_floats(k.c, k.B, k.T, 2), Error);
  try {
    ca::forward(k.c, k.B, k.T, Tensor(k.x.data(), {k.N, 32}), k.pos.data(), k.rt, k.view(k.p), k.s,
                Tensor(k.y.data(), {k.N, 32}), &split);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("divisible"), std::string::npos) << e.what();
  }
}

TEST(CcaSplit, RejectsRunsShorterThanTheConvHalo) {
  CcaCase k(2, 4, 32, 4, 2, 8, 3, 2);  // runs of 2 tokens, halo (3-1) + (2-1) = 3
  AdjacentRuns split(2);
  EXPECT_THROW(ca::saved_floats(k.c, k.B, k.T, 2), Error);
  try {
    ca::forward(k.c, k.B, k.T, Tensor(k.x.data(), {k.N, 32}), k.pos.data(), k.rt, k.view(k.p), k.s,
                Tensor(k.y.data(), {k.N, 32}), &split);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("shorter than the conv halo"), std::string::npos) << e.what();
  }
}

// Saved carved without the split's segments (no halo tensor) is refused, not overrun.
TEST(CcaSplit, RejectsSavedWithoutTheHalo) {
  CcaCase k(2, 6, 32, 4, 2, 8);
  AdjacentRuns split(2);
  EXPECT_THROW(ca::forward(k.c, k.B, k.T, Tensor(k.x.data(), {k.N, 32}), k.pos.data(), k.rt, k.view(k.p), k.s,
                           Tensor(k.y.data(), {k.N, 32}), &split),
               Error);
}

}  // namespace
}  // namespace keel
