#include "optim/adamw.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/error.h"
#include "optim_test_util.h"

namespace keel::optim {
namespace {

using testing::randn;

// Three AdamW parameters with different decay / lr_scale, and one Muon matrix AdamW must skip.
ParamLayout test_layout() {
  std::vector<GroupRule> rules = {
      {"embeddings", "*embed*", "", 2, 2, OptimizerKind::kAdamW, true, 1.0},
      {"vectors", "*", "", 1, 1, OptimizerKind::kAdamW, false, 1.0},
      {"scalars", "*", "", 0, 0, OptimizerKind::kAdamW, true, 0.5},
      {"matrices", "*", "*embed*", 2, 2, OptimizerKind::kMuon, true, 1.0},
  };
  return assign_groups({{"embed.weight", {7, 5}}, {"norm.weight", {9}}, {"mix.w", {6, 4}}, {"temp", {}}}, rules);
}

struct RefState {
  std::vector<double> p, m, v;
};

// Straightforward double AdamW (torch.optim.AdamW semantics), one element at a time.
void adamw_ref(RefState& s, const std::vector<float>& g, std::int64_t begin, std::int64_t n, const AdamWConfig& c,
               int t, double lr, bool decay, double gs) {
  for (std::int64_t i = begin; i < begin + n; ++i) {
    double gi = gs * g[i];
    s.m[i] = c.beta1 * s.m[i] + (1 - c.beta1) * gi;
    s.v[i] = c.beta2 * s.v[i] + (1 - c.beta2) * gi * gi;
    double mhat = s.m[i] / (1 - std::pow(c.beta1, t));
    double vhat = s.v[i] / (1 - std::pow(c.beta2, t));
    if (decay) s.p[i] -= lr * c.weight_decay * s.p[i];
    s.p[i] -= lr * mhat / (std::sqrt(vhat) + c.eps);
  }
}

TEST(AdamW, MatchesDoubleReferenceOverSteps) {
  ParamLayout layout = test_layout();
  const auto n = static_cast<std::size_t>(layout.total_floats);
  AdamWConfig c;
  c.beta1 = 0.9;
  c.beta2 = 0.95;
  c.eps = 1e-8;
  c.weight_decay = 0.1;
  AdamW opt(c);
  auto p = randn(n, 1, 0.5f);
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  RefState ref{testing::to_double(p), std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)};
  const auto initial = p;
  const int steps = 8;
  for (int t = 1; t <= steps; ++t) {
    auto g = randn(n, 100u + static_cast<unsigned>(t), 0.01f * static_cast<float>(t));
    double lr = 1e-2 / t;  // a changing lr, large enough that decay matters
    float gs = 0.75f;
    opt.step(layout, FlatRange{0, layout.total_floats, p.data(), g.data(), m.data(), v.data()}, lr, gs);
    for (const auto& info : layout.params)
      if (info.optimizer == OptimizerKind::kAdamW)
        adamw_ref(ref, g, info.offset, info.numel, c, t, lr * info.lr_scale, info.weight_decay, gs);
  }
  EXPECT_EQ(opt.step_count(), steps);
  double max_err = 0, max_merr = 0, max_verr = 0;
  for (const auto& info : layout.params) {
    for (std::int64_t i = info.offset; i < info.offset + info.numel; ++i) {
      if (info.optimizer == OptimizerKind::kMuon) {
        EXPECT_EQ(p[i], initial[i]) << info.name << " is Muon's and must be left alone";
        EXPECT_EQ(m[i], 0.0f);
        continue;
      }
      // Relative to the parameter (floor 0.1): p itself is rounded twice per step in fp32.
      max_err = std::max(max_err, std::fabs(p[i] - ref.p[i]) / std::max(std::fabs(ref.p[i]), 0.1));
      max_merr = std::max(max_merr, std::fabs(m[i] - ref.m[i]) / (std::fabs(ref.m[i]) + 1e-6));
      max_verr = std::max(max_verr, std::fabs(v[i] - ref.v[i]) / (std::fabs(ref.v[i]) + 1e-10));
    }
  }
  RecordProperty("max_param_rel_err", testing::sci(max_err));
  RecordProperty("max_m_rel_err", testing::sci(max_merr));
  RecordProperty("max_v_rel_err", testing::sci(max_verr));
  EXPECT_LT(max_err, 1e-6);   // ~16 fp32 roundings of p over 8 steps at most
  EXPECT_LT(max_merr, 1e-4);  // relative (plus a small floor)
  EXPECT_LT(max_verr, 1e-4);
}

TEST(AdamW, BiasCorrectionAndDecoupledDecay) {
  // Step 1: m_hat = g, v_hat = g^2, so the step is lr * g / (|g| + eps) = lr * sign(g) (up to
  // eps) whatever beta1, beta2; decay multiplies the old p by (1 - lr wd).
  AdamWConfig c;
  c.beta1 = 0.8;
  c.beta2 = 0.99;
  c.eps = 1e-12;
  c.weight_decay = 0.5;
  auto g = randn(64, 4, 1e-3f);
  auto p = randn(64, 5);
  auto p0 = p;
  std::vector<float> m(64, 0.0f), v(64, 0.0f);
  const double lr = 0.01;
  adamw_update(p.data(), g.data(), m.data(), v.data(), 64, c, 1, lr, true);
  for (int i = 0; i < 64; ++i) {
    double expect = p0[i] * (1 - lr * c.weight_decay) - lr * (g[i] > 0 ? 1 : -1);
    EXPECT_NEAR(p[i], expect, 2e-7) << i;
  }
  // Without decay the parameter moves by the Adam step only.
  auto q = p0;
  std::fill(m.begin(), m.end(), 0.0f);
  std::fill(v.begin(), v.end(), 0.0f);
  adamw_update(q.data(), g.data(), m.data(), v.data(), 64, c, 1, lr, false);
  for (int i = 0; i < 64; ++i) EXPECT_NEAR(q[i], p0[i] - lr * (g[i] > 0 ? 1 : -1), 2e-7);
}

TEST(AdamW, ShardedRangesMatchFullBuffer) {
  // ZeRO-1: three ranks own ranges that cut through parameters; each keeps m and v for its
  // range only. The result is bit-identical to one full-range optimizer.
  ParamLayout layout = test_layout();
  const std::int64_t total = layout.total_floats;
  auto p_full = randn(static_cast<std::size_t>(total), 2);
  auto p_shard = p_full;
  std::vector<float> m(static_cast<std::size_t>(total), 0.0f), v(m);
  AdamWConfig c;
  AdamW full(c);
  std::vector<std::int64_t> cuts = {0, 13, 29, total};
  std::vector<AdamW> ranks(3, AdamW(c));
  std::vector<std::vector<float>> ms(3), vs(3);
  for (int r = 0; r < 3; ++r) {
    ms[r].assign(static_cast<std::size_t>(cuts[r + 1] - cuts[r]), 0.0f);
    vs[r] = ms[r];
  }
  for (int t = 1; t <= 3; ++t) {
    auto g = randn(static_cast<std::size_t>(total), 50u + static_cast<unsigned>(t), 0.1f);
    full.step(layout, {0, total, p_full.data(), g.data(), m.data(), v.data()}, 1e-3);
    for (int r = 0; r < 3; ++r) {
      std::vector<float> g_shard(g.begin() + cuts[r], g.begin() + cuts[r + 1]);  // as after reduce-scatter
      ranks[r].step(layout, {cuts[r], cuts[r + 1], p_shard.data() + cuts[r], g_shard.data(), ms[r].data(), vs[r].data()},
                    1e-3);
    }
  }
  EXPECT_EQ(p_full, p_shard);
}

TEST(AdamW, RejectsBadConfigAndRanges) {
  AdamWConfig c;
  c.beta1 = 1.0;
  EXPECT_THROW(AdamW{c}, Error);
  c = {};
  c.eps = 0;
  EXPECT_THROW(AdamW{c}, Error);
  c = {};
  c.weight_decay = -1;
  EXPECT_THROW(AdamW{c}, Error);
  AdamW opt(AdamWConfig{});
  ParamLayout layout = test_layout();
  std::vector<float> x(static_cast<std::size_t>(layout.total_floats) + 16, 1.0f);
  EXPECT_THROW(opt.step(layout, {0, layout.total_floats + 1, x.data(), x.data(), x.data(), x.data()}, 1e-3), Error);
  EXPECT_THROW(opt.step(layout, {0, 8, x.data(), x.data(), x.data(), x.data()}, std::nan("")), Error);
  std::vector<float> one(1, 1.0f);
  EXPECT_THROW(adamw_update(one.data(), one.data(), one.data(), one.data(), 1, AdamWConfig{}, 0, 1e-3, true), Error);
}

}  // namespace
}  // namespace keel::optim
