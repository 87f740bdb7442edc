// ops::linear_attention against the naive quadratic form (in double), by finite differences, across
// chunk sizes, against its own state and decode step, and a leak check that would catch a
// diagonal tile left unmasked (LASP-2's published intra-chunk kernel, ../shared/reference).
#include "ops/linear_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "gradcheck.h"

namespace keel {
namespace {

namespace la = ops::linear_attention;
using test::check_grad;
using test::kGradTol;
using test::random_vector;
using test::weighted_sum;

struct Case {
  std::int64_t runs = 2, len = 13;
  int hq = 4, hkv = 2, d = 5, chunk = 4;
  bool decay = false, init = false;
};

la::Config config_of(const Case& c) {
  la::Config cfg;
  cfg.heads = c.hq;
  cfg.kv_heads = c.hkv;
  cfg.head_dim = c.d;
  cfg.chunk = c.chunk;
  if (c.decay) cfg.decay = {0.9f, 0.6f, 0.97f, 0.8f};
  cfg.decay.resize(c.decay ? std::size_t(c.hkv) : 0);
  return cfg;
}

// p viewed with t's shape (2-D or 4-D).
Tensor like(float* p, const Tensor& t) {
  if (t.ndim() == 4) return Tensor(p, {t.dim(0), t.dim(1), t.dim(2), t.dim(3)});
  return Tensor(p, {t.dim(0), t.dim(1)});
}

struct Data {
  std::vector<float> q, k, v, init;
  Tensor tq, tk, tv, tinit;
};

Data make(const Case& c, std::uint32_t seed) {
  Data x;
  const std::int64_t N = c.runs * c.len;
  x.q = random_vector(std::size_t(N * c.hq * c.d), seed, 0.5f);
  x.k = random_vector(std::size_t(N * c.hkv * c.d), seed + 1, 0.5f);
  x.v = random_vector(std::size_t(N * c.hkv * c.d), seed + 2);
  x.tq = Tensor(x.q.data(), {N, std::int64_t(c.hq) * c.d});
  x.tk = Tensor(x.k.data(), {N, std::int64_t(c.hkv) * c.d});
  x.tv = Tensor(x.v.data(), {N, std::int64_t(c.hkv) * c.d});
  if (c.init) {
    x.init = random_vector(std::size_t(c.runs * c.hkv * c.d * c.d), seed + 3, 0.3f);
    x.tinit = Tensor(x.init.data(), {c.runs, c.hkv, c.d, c.d});
  }
  return x;
}

// o_t = gamma^(t+1) q_t init + sum_{i<=t} gamma^(t-i) (q_t . k_i) v_i, in double.
std::vector<double> naive(const Case& c, const la::Config& cfg, const Data& x) {
  const std::int64_t N = c.runs * c.len, group = c.hq / c.hkv;
  std::vector<double> out(std::size_t(N * c.hq * c.d), 0.0);
  for (std::int64_t r = 0; r < c.runs; ++r)
    for (int h = 0; h < c.hq; ++h) {
      const int g = int(h / group);
      const double gamma = cfg.gamma(g);
      for (std::int64_t t = 0; t < c.len; ++t) {
        const float* qt = x.q.data() + ((r * c.len + t) * c.hq + h) * c.d;
        double* o = out.data() + ((r * c.len + t) * c.hq + h) * c.d;
        if (c.init)
          for (int a = 0; a < c.d; ++a)
            for (int b = 0; b < c.d; ++b)
              o[b] += std::pow(gamma, double(t + 1)) * qt[a] * x.init[std::size_t(((r * c.hkv + g) * c.d + a) * c.d + b)];
        for (std::int64_t i = 0; i <= t; ++i) {
          const float* ki = x.k.data() + ((r * c.len + i) * c.hkv + g) * c.d;
          const float* vi = x.v.data() + ((r * c.len + i) * c.hkv + g) * c.d;
          double p = 0;
          for (int a = 0; a < c.d; ++a) p += double(qt[a]) * ki[a];
          p *= std::pow(gamma, double(t - i));
          for (int b = 0; b < c.d; ++b) o[b] += p * vi[b];
        }
      }
    }
  return out;
}

double max_rel(const std::vector<float>& got, const std::vector<double>& want) {
  double err = 0, scale = 1e-6;
  for (std::size_t i = 0; i < got.size(); ++i) {
    err = std::max(err, std::abs(double(got[i]) - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return err / scale;
}

std::vector<float> run_forward(const Case& c, const la::Config& cfg, const Data& x) {
  std::vector<float> out(x.q.size());
  la::forward(cfg, c.runs, c.len, x.tq, x.tk, x.tv, x.tinit, like(out.data(), x.tq));
  return out;
}

TEST(OpLinearAttention, ChunkedMatchesNaive) {
  for (const bool decay : {false, true})
    for (const bool init : {false, true})
      for (const int chunk : {1, 3, 4, 13, 64}) {
        Case c;
        c.decay = decay;
        c.init = init;
        c.chunk = chunk;
        const la::Config cfg = config_of(c);
        const Data x = make(c, 10);
        EXPECT_LT(max_rel(run_forward(c, cfg, x), naive(c, cfg, x)), 2e-6)
            << "decay " << decay << " init " << init << " chunk " << chunk;
      }
}

TEST(OpLinearAttention, MhaShapesAndOneToken) {
  Case c;
  c.hq = c.hkv = 3;
  c.runs = 1;
  c.len = 1;
  c.decay = true;
  const la::Config cfg = config_of(c);
  const Data x = make(c, 20);
  EXPECT_LT(max_rel(run_forward(c, cfg, x), naive(c, cfg, x)), 2e-6);
}

// A later token never reaches an earlier output, within a chunk (every diagonal tile position)
// or across chunks; and each token reaches itself and every later output. A kernel that left
// its diagonal tile unmasked would change outputs before the perturbed token.
TEST(OpLinearAttention, NoFutureTokenLeaks) {
  Case c;
  c.runs = 1;
  c.len = 24;
  c.chunk = 8;
  const la::Config cfg = config_of(c);
  const Data base = make(c, 30);
  const std::vector<float> o0 = run_forward(c, cfg, base);
  const std::int64_t row = std::int64_t(c.hq) * c.d;
  for (std::int64_t p = 0; p < c.len; ++p) {
    Data x = make(c, 30);
    for (int j = 0; j < c.hkv * c.d; ++j) {
      x.k[std::size_t(p * c.hkv * c.d + j)] += 0.5f;
      x.v[std::size_t(p * c.hkv * c.d + j)] -= 0.5f;
    }
    const std::vector<float> o1 = run_forward(c, cfg, x);
    for (std::int64_t t = 0; t < c.len; ++t) {
      bool same = true;
      for (std::int64_t j = 0; j < row; ++j) same &= o0[std::size_t(t * row + j)] == o1[std::size_t(t * row + j)];
      if (t < p) EXPECT_TRUE(same) << "token " << p << " leaked into output " << t;
      else EXPECT_FALSE(same) << "token " << p << " does not reach output " << t;
    }
  }
}

// A run that starts from S ends at gamma^L S + local_states; the end state of one run is the
// initial state that continues it: forward over [a | b] == forward(a) then forward(b, init).
TEST(OpLinearAttention, StatesContinueARun) {
  Case whole;
  whole.runs = 1;
  whole.len = 14;
  whole.decay = true;
  const la::Config cfg = config_of(whole);
  const Data x = make(whole, 40);
  const std::vector<float> full = run_forward(whole, cfg, x);
  const std::int64_t split = 9, qs = std::int64_t(whole.hq) * whole.d, ks = std::int64_t(whole.hkv) * whole.d;
  std::vector<float> M(std::size_t(whole.hkv * whole.d * whole.d));
  const Tensor tM(M.data(), {1, whole.hkv, whole.d, whole.d});
  la::local_states(cfg, 1, split, Tensor(const_cast<float*>(x.k.data()), {split, ks}), Tensor(const_cast<float*>(x.v.data()), {split, ks}), tM);
  const std::int64_t rest = whole.len - split;
  std::vector<float> tail(std::size_t(rest * qs));
  la::forward(cfg, 1, rest, Tensor(const_cast<float*>(x.q.data() + split * qs), {rest, qs}),
              Tensor(const_cast<float*>(x.k.data() + split * ks), {rest, ks}),
              Tensor(const_cast<float*>(x.v.data() + split * ks), {rest, ks}), tM, Tensor(tail.data(), {rest, qs}));
  for (std::int64_t i = 0; i < rest * qs; ++i) EXPECT_NEAR(tail[std::size_t(i)], full[std::size_t(split * qs + i)], 1e-5);
}

// Decode: stepping token by token from a zero state gives forward's rows.
TEST(OpLinearAttention, StepMatchesForward) {
  Case c;
  c.runs = 3;  // decode batch
  c.len = 7;
  c.decay = true;
  const la::Config cfg = config_of(c);
  const Data x = make(c, 50);
  const std::vector<float> full = run_forward(c, cfg, x);
  const std::int64_t qs = std::int64_t(c.hq) * c.d, ks = std::int64_t(c.hkv) * c.d;
  std::vector<float> state(std::size_t(c.runs * c.hkv * c.d * c.d), 0.f), q(std::size_t(c.runs * qs)),
      k(std::size_t(c.runs * ks)), v(std::size_t(c.runs * ks)), out(std::size_t(c.runs * qs));
  for (std::int64_t t = 0; t < c.len; ++t) {
    for (std::int64_t b = 0; b < c.runs; ++b) {
      std::copy_n(x.q.data() + (b * c.len + t) * qs, qs, q.data() + b * qs);
      std::copy_n(x.k.data() + (b * c.len + t) * ks, ks, k.data() + b * ks);
      std::copy_n(x.v.data() + (b * c.len + t) * ks, ks, v.data() + b * ks);
    }
    la::step(cfg, Tensor(q.data(), {c.runs, qs}), Tensor(k.data(), {c.runs, ks}), Tensor(v.data(), {c.runs, ks}),
             Tensor(state.data(), {c.runs, c.hkv, c.d, c.d}), Tensor(out.data(), {c.runs, qs}));
    for (std::int64_t b = 0; b < c.runs; ++b)
      for (std::int64_t j = 0; j < qs; ++j)
        EXPECT_NEAR(out[std::size_t(b * qs + j)], full[std::size_t((b * c.len + t) * qs + j)], 1e-5);
  }
}

// Finite differences through forward + local_states (LASP-2's two paths from k, v), for q, k, v
// and the initial state, with and without decay, chunk smaller than the run.
TEST(OpLinearAttention, GradientsMatchFiniteDifferences) {
  for (const bool decay : {false, true}) {
    Case c;
    c.len = 10;
    c.chunk = 4;
    c.init = true;
    c.decay = decay;
    const la::Config cfg = config_of(c);
    Data x = make(c, 60);
    const auto r_out = random_vector(x.q.size(), 61), r_state = random_vector(x.init.size(), 62);
    std::vector<float> out(x.q.size()), st(x.init.size());
    const Tensor tout = like(out.data(), x.tq), tst = like(st.data(), x.tinit);
    auto loss = [&] {
      la::forward(cfg, c.runs, c.len, x.tq, x.tk, x.tv, x.tinit, tout);
      la::local_states(cfg, c.runs, c.len, x.tk, x.tv, tst);
      return weighted_sum(out.data(), r_out) + weighted_sum(st.data(), r_state);
    };
    std::vector<float> dq(x.q.size()), dk(x.k.size()), dv(x.v.size()), dinit(x.init.size());
    auto dout = r_out, dst = r_state;
    la::backward(cfg, c.runs, c.len, x.tq, x.tk, x.tv, x.tinit, like(dout.data(), x.tq), like(dst.data(), x.tinit),
                 like(dq.data(), x.tq), like(dk.data(), x.tk), like(dv.data(), x.tv), like(dinit.data(), x.tinit));
    EXPECT_LT(check_grad("q", loss, x.q.data(), dq.data(), std::int64_t(x.q.size())).rel_err, kGradTol);
    EXPECT_LT(check_grad("k", loss, x.k.data(), dk.data(), std::int64_t(x.k.size())).rel_err, kGradTol);
    EXPECT_LT(check_grad("v", loss, x.v.data(), dv.data(), std::int64_t(x.v.size())).rel_err, kGradTol);
    EXPECT_LT(check_grad("init", loss, x.init.data(), dinit.data(), std::int64_t(x.init.size())).rel_err, kGradTol);
  }
}

TEST(OpLinearAttention, BackwardDoesNotDependOnChunk) {
  Case c;
  c.len = 17;
  c.decay = true;
  c.init = true;
  std::vector<std::vector<float>> grads;
  for (const int chunk : {1, 5, 32}) {
    c.chunk = chunk;
    const la::Config cfg = config_of(c);
    const Data x = make(c, 70);
    auto dout = random_vector(x.q.size(), 71);
    std::vector<float> dq(x.q.size()), dk(x.k.size()), dv(x.v.size()), dinit(x.init.size());
    la::backward(cfg, c.runs, c.len, x.tq, x.tk, x.tv, x.tinit, like(dout.data(), x.tq), {},
                 like(dq.data(), x.tq), like(dk.data(), x.tk), like(dv.data(), x.tv),
                 like(dinit.data(), x.tinit));
    std::vector<float> all = dq;
    all.insert(all.end(), dk.begin(), dk.end());
    all.insert(all.end(), dv.begin(), dv.end());
    all.insert(all.end(), dinit.begin(), dinit.end());
    grads.push_back(all);
  }
  for (std::size_t i = 0; i < grads[0].size(); ++i) {
    EXPECT_NEAR(grads[1][i], grads[0][i], 1e-4 * (1 + std::abs(grads[0][i])));
    EXPECT_NEAR(grads[2][i], grads[0][i], 1e-4 * (1 + std::abs(grads[0][i])));
  }
}

// init_gradient is backward's dinit, alone (LASP-2 gathers it before the rest of backward).
TEST(OpLinearAttention, InitGradientIsBackwardsDinit) {
  Case c;
  c.len = 9;
  c.decay = true;
  c.init = true;
  const la::Config cfg = config_of(c);
  const Data x = make(c, 90);
  auto dout = random_vector(x.q.size(), 91);
  std::vector<float> dq(x.q.size()), dk(x.k.size()), dv(x.v.size()), dinit(x.init.size()), alone(x.init.size());
  la::backward(cfg, c.runs, c.len, x.tq, x.tk, x.tv, x.tinit, like(dout.data(), x.tq), {}, like(dq.data(), x.tq),
               like(dk.data(), x.tk), like(dv.data(), x.tv), like(dinit.data(), x.tinit));
  la::init_gradient(cfg, c.runs, c.len, x.tq, like(dout.data(), x.tq), like(alone.data(), x.tinit));
  for (std::size_t i = 0; i < alone.size(); ++i) EXPECT_NEAR(alone[i], dinit[i], 1e-5 * (1 + std::abs(dinit[i])));
}

TEST(OpLinearAttention, FeatureAndNormGradients) {
  const std::int64_t M = 6, d = 5;
  for (const la::Feature f : {la::Feature::kIdentity, la::Feature::kElu1}) {
    auto x = random_vector(std::size_t(M * d), 80, 2.f);
    std::vector<float> y(x.size()), n(x.size()), rstd(static_cast<std::size_t>(M));
    const auto r = random_vector(x.size(), 81);
    auto loss = [&] {
      la::feature_forward(f, Tensor(x.data(), {M, d}), Tensor(y.data(), {M, d}));
      la::norm_forward(Tensor(y.data(), {M, d}), 1e-5f, Tensor(n.data(), {M, d}), Tensor(rstd.data(), {M}));
      return weighted_sum(n.data(), r);
    };
    loss();
    std::vector<float> dy(x.size()), dx(x.size());
    auto dn = r;
    la::norm_backward(Tensor(n.data(), {M, d}), Tensor(rstd.data(), {M}), Tensor(dn.data(), {M, d}),
                      Tensor(dy.data(), {M, d}));
    la::feature_backward(f, Tensor(y.data(), {M, d}), Tensor(dy.data(), {M, d}), Tensor(dx.data(), {M, d}));
    EXPECT_LT(check_grad("x", loss, x.data(), dx.data(), M * d).rel_err, kGradTol) << la::feature_name(f);
  }
  EXPECT_THROW(la::parse_feature("relu"), UsageError);
}

TEST(OpLinearAttention, RetnetDecay) {
  const auto g = la::retnet_decay(1, 2);
  ASSERT_EQ(g.size(), 2u);
  EXPECT_FLOAT_EQ(g[0], 1.0f - 1.0f / 64);
  EXPECT_FLOAT_EQ(g[1], 1.0f - 1.0f / 128);
}

}  // namespace
}  // namespace keel
