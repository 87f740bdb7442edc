// ZAYA1 router: MLP router with EDA, biased top-1, skip class; the bias controller.
#include "ops/zaya_router.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "common/error.h"
#include "gradcheck.h"

namespace keel {
namespace {

using test::check_grad;
using test::kGradTol;
using test::random_vector;
using test::weighted_sum;
namespace zr = ops::zaya_router;
namespace bc = ops::bias_controller;

// One router stage's parameters and gradients as owned vectors.
struct Stage {
  std::int64_t h, d, e;
  std::vector<std::vector<float>> p, g;  // w_down b_down gamma w_norm w1 b1 w2 b2 w3
  std::vector<float> saved_buf;
  zr::Saved s;
  Stage(std::int64_t h_, std::int64_t d_, std::int64_t e_, std::int64_t n, std::uint32_t seed) : h(h_), d(d_), e(e_) {
    const float sw = 1.f / std::sqrt(float(h)), sd = 1.5f / std::sqrt(float(d));
    p = {random_vector(d * h, seed, sw),         random_vector(d, seed + 1, 0.2f), random_vector(d, seed + 2, 0.8f),
         random_vector(d, seed + 3, 1.f),        random_vector(d * d, seed + 4, sd), random_vector(d, seed + 5, 0.3f),
         random_vector(d * d, seed + 6, sd),     random_vector(d, seed + 7, 0.3f), random_vector(e * d, seed + 8, 3.f * sd)};
    for (auto& v : p[3]) v = 1.f + 0.3f * v;  // norm weight around 1
    for (auto& v : p) g.emplace_back(v.size(), 0.f);
    saved_buf.resize(zr::saved_floats(n, d, e));
    s = zr::carve_saved(saved_buf.data(), n, d, e);
  }
  zr::Params view(std::vector<std::vector<float>>& v) {
    zr::Params q;
    q.w_down = Tensor(v[0].data(), {d, h});
    q.b_down = Tensor(v[1].data(), {d});
    q.gamma = Tensor(v[2].data(), {d});
    q.w_norm = Tensor(v[3].data(), {d});
    q.w1 = Tensor(v[4].data(), {d, d});
    q.b1 = Tensor(v[5].data(), {d});
    q.w2 = Tensor(v[6].data(), {d, d});
    q.b2 = Tensor(v[7].data(), {d});
    q.w3 = Tensor(v[8].data(), {e, d});
    return q;
  }
};

const char* kParamNames[] = {"w_down", "b_down", "gamma", "w_norm", "w1", "b1", "w2", "b2", "w3"};

TEST(OpZayaRouter, GeluIsExactErfForm) {
  EXPECT_NEAR(zr::gelu(1.f), 0.8413447f, 1e-6);
  EXPECT_NEAR(zr::gelu(-0.5f), -0.1542687f, 1e-6);  // tanh approximation gives -0.1542859
  for (float x : {-2.1f, -0.3f, 0.4f, 1.7f}) {
    const double num = (double(zr::gelu(x + 1e-3f)) - zr::gelu(x - 1e-3f)) / (double(x + 1e-3f) - double(x - 1e-3f));
    EXPECT_NEAR(zr::gelu_grad(x), num, 1e-3);
  }
}

// Two consecutive MoE stages: stage 1 without EDA, stage 2 with EDA on stage 1's state, and the
// skip class (class e - 1) enabled on both; loss = gates, skip outputs and stage 2's state.
TEST(OpZayaRouter, GradCheckTwoStagesWithEdaAndSkip) {
  const std::int64_t n = 8, h = 10, d = 6, e = 4;
  const int skip = int(e - 1);
  Stage s1(h, d, e, n, 100), s2(h, d, e, n, 200);
  auto x1 = random_vector(n * h, 300), x2 = random_vector(n * h, 301);
  // Balancing biases chosen so that some tokens go to the skip class.
  std::vector<float> bias = {0.02f, -0.01f, 0.f, 0.05f};
  auto rg1 = random_vector(n, 310), rg2 = random_vector(n, 311), rs2 = random_vector(n * d, 312),
       ry1 = random_vector(n * h, 313), ry2 = random_vector(n * h, 314);
  std::vector<float> y1(n * h), y2(n * h);
  auto P1 = s1.view(s1.p), P2 = s2.view(s2.p);
  P1.gamma = Tensor();  // the first MoE stage has no EDA parameter
  const float eps = 1e-5f;
  auto run = [&] {
    zr::forward(Tensor(x1.data(), {n, h}), Tensor(), P1, Tensor(bias.data(), {e}), eps, s1.s);
    zr::forward(Tensor(x2.data(), {n, h}), s1.s.state, P2, Tensor(bias.data(), {e}), eps, s2.s);
    zr::skip_forward(Tensor(x1.data(), {n, h}), s1.s.idx.data(), s1.s.gates, skip, Tensor(y1.data(), {n, h}));
    zr::skip_forward(Tensor(x2.data(), {n, h}), s2.s.idx.data(), s2.s.gates, skip, Tensor(y2.data(), {n, h}));
    return weighted_sum(s1.s.gates.data(), rg1) + weighted_sum(s2.s.gates.data(), rg2) + weighted_sum(s2.s.state.data(), rs2) +
           weighted_sum(y1.data(), ry1) + weighted_sum(y2.data(), ry2);
  };
  run();
  const auto idx1 = s1.s.idx, idx2 = s2.s.idx;
  int skipped = 0, routed = 0;
  for (auto i : idx1) (i == skip ? skipped : routed)++;
  for (auto i : idx2) (i == skip ? skipped : routed)++;
  ASSERT_GT(skipped, 0) << "the test needs tokens on the skip class";
  ASSERT_GT(routed, 0);
  bool stable = true;
  auto loss = [&] {
    const double l = run();
    stable &= s1.s.idx == idx1 && s2.s.idx == idx2;
    return l;
  };
  // Backward, stage 2 first: its dprev_state is stage 1's dstate_next.
  std::vector<float> dg1(n), dg2(n), dxs1(n * h), dxs2(n * h), dx1(n * h), dx2(n * h), dprev(n * d);
  std::vector<float> scratch(zr::backward_scratch_floats(n, d, e));
  auto G1 = s1.view(s1.g), G2 = s2.view(s2.g);
  G1.gamma = Tensor();
  zr::skip_backward(Tensor(x2.data(), {n, h}), s2.s.idx.data(), s2.s.gates, skip, Tensor(ry2.data(), {n, h}),
                    Tensor(dxs2.data(), {n, h}), Tensor(dg2.data(), {n, 1}));
  for (std::int64_t i = 0; i < n; ++i) dg2[i] += rg2[i];
  zr::backward(Tensor(x2.data(), {n, h}), s1.s.state, P2, s2.s, Tensor(dg2.data(), {n, 1}), Tensor(rs2.data(), {n, d}),
               Tensor(dx2.data(), {n, h}), Tensor(dprev.data(), {n, d}), G2, Tensor(scratch.data(), {std::int64_t(scratch.size())}));
  zr::skip_backward(Tensor(x1.data(), {n, h}), s1.s.idx.data(), s1.s.gates, skip, Tensor(ry1.data(), {n, h}),
                    Tensor(dxs1.data(), {n, h}), Tensor(dg1.data(), {n, 1}));
  for (std::int64_t i = 0; i < n; ++i) dg1[i] += rg1[i];
  zr::backward(Tensor(x1.data(), {n, h}), Tensor(), P1, s1.s, Tensor(dg1.data(), {n, 1}), Tensor(dprev.data(), {n, d}),
               Tensor(dx1.data(), {n, h}), Tensor(), G1, Tensor(scratch.data(), {std::int64_t(scratch.size())}));
  for (std::int64_t i = 0; i < n * h; ++i) {
    dx1[i] += dxs1[i];
    dx2[i] += dxs2[i];
  }
  EXPECT_LT(check_grad("zaya_router stage1 dx", loss, x1.data(), dx1.data(), n * h).rel_err, kGradTol);
  EXPECT_LT(check_grad("zaya_router stage2 dx", loss, x2.data(), dx2.data(), n * h).rel_err, kGradTol);
  for (int k = 0; k < 9; ++k) {
    if (k != 2) {  // stage 1 has no EDA scale
      EXPECT_LT(check_grad(std::string("zaya_router stage1 d") + kParamNames[k], loss, s1.p[k].data(), s1.g[k].data(), s1.p[k].size())
                    .rel_err,
                kGradTol);
    }
    EXPECT_LT(check_grad(std::string("zaya_router stage2 d") + kParamNames[k], loss, s2.p[k].data(), s2.g[k].data(), s2.p[k].size())
                  .rel_err,
              kGradTol);
  }
  EXPECT_TRUE(stable) << "a perturbation changed the selection";
  // EDA reached stage 1 through the chain: stage 1's w_down gradient differs from what it gets
  // without stage 2's dprev_state.
  std::vector<float> gw(s1.p[0].size(), 0.f);
  zr::Params G1b;
  G1b.w_down = Tensor(gw.data(), {d, h});
  zr::backward(Tensor(x1.data(), {n, h}), Tensor(), P1, s1.s, Tensor(dg1.data(), {n, 1}), Tensor(), Tensor(), Tensor(), G1b,
               Tensor(scratch.data(), {std::int64_t(scratch.size())}));
  double diff = 0;
  for (std::size_t i = 0; i < gw.size(); ++i) diff += std::abs(gw[i] - s1.g[0][i]);
  EXPECT_GT(diff, 1e-3);
}

TEST(OpZayaRouter, BiasChangesSelectionButNotGates) {
  const std::int64_t n = 16, h = 8, d = 6, e = 5;
  Stage st(h, d, e, n, 400);
  auto P = st.view(st.p);
  auto x = random_vector(n * h, 401);
  zr::forward(Tensor(x.data(), {n, h}), Tensor(), P, Tensor(), 1e-5f, st.s);
  const auto probs0 = std::vector<float>(st.s.probs.data(), st.s.probs.data() + n * e);
  const auto idx0 = st.s.idx;
  for (std::int64_t i = 0; i < n; ++i) {  // unbiased: argmax p, gate = max p
    const float* pr = probs0.data() + i * e;
    EXPECT_EQ(st.s.idx[i], std::max_element(pr, pr + e) - pr);
    EXPECT_EQ(st.s.gates[i], pr[st.s.idx[i]]);
  }
  std::vector<float> bias(e, 0.f);
  bias[2] = 2.f;  // larger than any probability gap: everything goes to class 2
  zr::forward(Tensor(x.data(), {n, h}), Tensor(), P, Tensor(bias.data(), {e}), 1e-5f, st.s);
  EXPECT_EQ(std::vector<float>(st.s.probs.data(), st.s.probs.data() + n * e), probs0);
  for (std::int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(st.s.idx[i], 2);
    EXPECT_EQ(st.s.gates[i], probs0[i * e + 2]);  // the gate is the unbiased probability
  }
  EXPECT_EQ(st.s.counts[2], n);
  EXPECT_NE(idx0, st.s.idx);
}

// Forced balance (benchmarking) with the skip class on: forced over the E - 1 experts, token n
// goes to expert n mod (E - 1) whatever the scores and the bias (here strongly favouring skip),
// so no token skips and every expert gets exactly N / (E - 1) tokens; the gate is p of that class.
TEST(OpZayaRouter, ForcedBalanceNeverSkipsAndBalancesTheExperts) {
  const std::int64_t n = 20, h = 8, d = 6, e = 5;  // 4 experts + skip (class 4)
  const int skip = int(e - 1);
  Stage st(h, d, e, n, 410);
  auto P = st.view(st.p);
  P.gamma = Tensor();
  auto x = random_vector(n * h, 411);
  std::vector<float> bias(e, 0.f);
  bias[skip] = 2.f;  // without forcing every token would skip
  zr::forward(Tensor(x.data(), {n, h}), Tensor(), P, Tensor(bias.data(), {e}), 1e-5f, st.s);
  EXPECT_EQ(st.s.counts[static_cast<std::size_t>(skip)], n);
  const auto probs0 = std::vector<float>(st.s.probs.data(), st.s.probs.data() + n * e);
  zr::forward(Tensor(x.data(), {n, h}), Tensor(), P, Tensor(bias.data(), {e}), 1e-5f, st.s, skip);
  EXPECT_EQ(std::vector<float>(st.s.probs.data(), st.s.probs.data() + n * e), probs0);
  for (std::int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(st.s.idx[i], i % skip) << "token " << i;
    EXPECT_EQ(st.s.gates[i], probs0[i * e + st.s.idx[i]]) << "token " << i;
  }
  EXPECT_EQ(st.s.counts, (std::vector<std::int64_t>{5, 5, 5, 5, 0}));
  EXPECT_THROW(zr::forward(Tensor(x.data(), {n, h}), Tensor(), P, Tensor(), 1e-5f, st.s, int(e) + 1), Error);
}

// The skip path writes only the skip rows (class 2 here) and leaves every other row as it was:
// the outputs start at a sentinel, which the routed rows must keep (the experts' scatter writes
// those in the trainer). A skip token's MoE output is 0 (Hugging Face's and Zyphra's ZAYA1
// implementations mask its probability to 0), so its gradients are 0 too.
TEST(OpZayaRouter, SkipClassOutputsZero) {
  const std::int64_t n = 5, h = 3;
  const int skip = 2;
  const float sentinel = 7.f;
  auto x = random_vector(n * h, 500), dy = random_vector(n * h, 501);
  std::vector<std::int32_t> idx = {2, 0, 2, 1, 3};
  std::vector<float> gates = {0.6f, 0.3f, 0.45f, 0.9f, 0.2f};
  std::vector<float> y(n * h, sentinel), dx(n * h, sentinel), dg(n, sentinel);
  zr::skip_forward(Tensor(x.data(), {n, h}), idx.data(), Tensor(gates.data(), {n, 1}), skip, Tensor(y.data(), {n, h}));
  zr::skip_backward(Tensor(x.data(), {n, h}), idx.data(), Tensor(gates.data(), {n, 1}), skip, Tensor(dy.data(), {n, h}),
                    Tensor(dx.data(), {n, h}), Tensor(dg.data(), {n, 1}));
  for (std::int64_t i = 0; i < n; ++i) {
    SCOPED_TRACE(testing::Message() << "row " << i << (idx[i] == skip ? " (skip)" : " (routed)"));
    EXPECT_EQ(dg[i], idx[i] == skip ? 0.f : sentinel);
    for (std::int64_t j = 0; j < h; ++j) {
      EXPECT_EQ(y[i * h + j], idx[i] == skip ? 0.f : sentinel);
      EXPECT_EQ(dx[i * h + j], idx[i] == skip ? 0.f : sentinel);
    }
  }
  // Either gradient may be empty; the other is still written.
  std::vector<float> dg2(n, sentinel);
  zr::skip_backward(Tensor(x.data(), {n, h}), idx.data(), Tensor(gates.data(), {n, 1}), skip, Tensor(dy.data(), {n, h}),
                    Tensor(), Tensor(dg2.data(), {n, 1}));
  EXPECT_EQ(dg2, dg);
}

// A synthetic imbalanced router: fixed per-token probabilities with class 0 favoured. Each
// step selects argmax(p + bias), counts, and updates the bias. The load must move toward 1/E.
double max_imbalance(const std::vector<float>& probs, std::int64_t n, std::int64_t e, const std::vector<float>& bias,
                     std::vector<std::int64_t>& counts) {
  std::fill(counts.begin(), counts.end(), 0);
  for (std::int64_t i = 0; i < n; ++i) {
    int best = 0;
    for (int j = 1; j < e; ++j)
      if (probs[i * e + j] + bias[j] > probs[i * e + best] + bias[best]) best = j;
    counts[best]++;
  }
  double m = 0;
  for (int j = 0; j < e; ++j) m = std::max(m, std::abs(double(counts[j]) / n - 1.0 / e));
  return m;
}

TEST(OpZayaRouter, BiasControllerMovesLoadTowardUniform) {
  const std::int64_t n = 2000, e = 4;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> probs(n * e);
  for (std::int64_t i = 0; i < n; ++i) {
    double z[4], s = 0;
    for (int j = 0; j < e; ++j) s += (z[j] = std::exp(0.8 * nd(rng) + (j == 0 ? 1.2 : 0.0) + (j == 1 ? 0.4 : 0.0)));
    for (int j = 0; j < e; ++j) probs[i * e + j] = float(z[j] / s);
  }
  std::vector<std::int64_t> counts(e);
  for (auto rule : {bc::Rule::Adam, bc::Rule::Sign, bc::Rule::Proportional, bc::Rule::Pid}) {
    bc::Config c;
    c.rule = rule;
    c.lr = rule == bc::Rule::Proportional || rule == bc::Rule::Pid ? 0.05f : 2e-3f;
    if (rule == bc::Rule::Pid) c.kp = 0.2, c.kd = 0.05;
    bc::State s = bc::init(int(e), false);
    const double start = max_imbalance(probs, n, e, s.bias, counts);
    EXPECT_GT(start, 0.3);
    double end = start;
    for (int step = 0; step < 400; ++step) {
      end = max_imbalance(probs, n, e, s.bias, counts);
      const bc::State before = s;
      bc::State next = bc::update(c, s, counts.data());
      EXPECT_EQ(s.bias, before.bias);  // pure: the input state is untouched
      s = next;
    }
    end = max_imbalance(probs, n, e, s.bias, counts);
    std::printf("[controller] rule %d: max |f - 1/E| %.3f -> %.3f, bias %.3f %.3f %.3f %.3f\n", int(rule), start, end, s.bias[0],
                s.bias[1], s.bias[2], s.bias[3]);
    EXPECT_LT(end, 0.05) << "rule " << int(rule);
    EXPECT_LT(s.bias[0], s.bias[3]);  // the favoured class is pushed down
  }
}

TEST(OpZayaRouter, BiasControllerStepDetails) {
  bc::State s = bc::init(5, true);
  EXPECT_EQ(s.bias, (std::vector<float>{0.f, 0.f, 0.f, 0.f, -1.f}));
  bc::Config c;  // Adam, lr 1e-3, target 1/5
  std::vector<std::int64_t> counts = {50, 20, 20, 10, 0};
  bc::State s1 = bc::update(c, s, counts.data());
  // First Adam step: m/(1-b1) = g, sqrt(v/(1-b2)) = |g|, so each bias moves by lr * sign(g).
  const double f[5] = {0.5, 0.2, 0.2, 0.1, 0.0};
  for (int j = 0; j < 5; ++j) {
    const double g = f[j] - 0.2;
    const double expect = s.bias[j] - 1e-3 * g / (std::abs(g) + 1e-8);
    EXPECT_NEAR(s1.bias[j], expect, 1e-7) << j;
  }
  EXPECT_EQ(s1.step, 1);
  // Same input, same output; no tokens: unchanged.
  EXPECT_EQ(bc::update(c, s, counts.data()).bias, s1.bias);
  std::vector<std::int64_t> none(5, 0);
  EXPECT_EQ(bc::update(c, s1, none.data()).bias, s1.bias);
  // Decoupled weight decay shrinks the bias before the step (skip class: -1 -> -(1 - lr wd)).
  bc::Config cw = c;
  cw.weight_decay = 0.5f;
  EXPECT_NEAR(bc::update(cw, s, counts.data()).bias[4], -1.0 * (1 - 1e-3 * 0.5) + 1e-3, 1e-7);
  c.rule = bc::Rule::Sign;
  c.lr = 0.01f;
  bc::State s2 = bc::update(c, s, counts.data());
  EXPECT_FLOAT_EQ(s2.bias[0], -0.01f);
  EXPECT_FLOAT_EQ(s2.bias[1], 0.f);
  EXPECT_FLOAT_EQ(s2.bias[3], 0.01f);
}

}  // namespace
}  // namespace keel
