// ZeRO-1 shard plans: contiguous shards that tile the flat buffer, never split a Muon matrix,
// may be empty when there are more ranks than units, stay within one matrix (plus alignment) of
// equal where costs follow floats, and balance memory and Newton-Schulz work together where
// they do not (against a closed form and against every plan on a grid of cuts).
#include <gtest/gtest.h>

#include <algorithm>

#include "common/error.h"
#include "optim/param_groups.h"
#include "parallel/zero1.h"

namespace keel::parallel {
namespace {

optim::ParamLayout layout() {
  return optim::assign_groups({{"embed.weight", {100, 32}},
                               {"layers.0.attn.qkv.weight", {96, 32}},
                               {"layers.0.moe.experts.w_up", {8, 64, 32}},
                               {"layers.0.moe.experts.w_down", {8, 32, 64}},
                               {"layers.0.norm.weight", {32}},
                               {"layers.1.attn.qkv.weight", {96, 32}}},
                              optim::default_rules());
}

void expect_valid(const optim::ParamLayout& l, const Zero1Plan& p, int ranks) {
  ASSERT_EQ(p.ranks(), ranks);
  EXPECT_EQ(p.begin(0), 0);
  EXPECT_EQ(p.end(ranks - 1), l.total_floats);
  for (int r = 0; r < ranks; ++r) {
    EXPECT_LE(p.begin(r), p.end(r));
    if (r > 0) EXPECT_EQ(p.begin(r), p.end(r - 1));
  }
  // every Muon matrix inside exactly one shard
  std::size_t whole = 0;
  for (int r = 0; r < ranks; ++r) whole += muon_matrices_in(l, p.begin(r), p.end(r)).size();
  EXPECT_EQ(whole, muon_matrices_in(l, 0, l.total_floats).size()) << ranks << " ranks";
}

TEST(Zero1Plan, TilesTheBufferAndKeepsMatricesWhole) {
  const auto l = layout();
  ASSERT_EQ(muon_matrices_in(l, 0, l.total_floats).size(), 2u + 8u + 8u);
  std::int64_t biggest = 0;
  for (const auto& m : muon_matrices_in(l, 0, l.total_floats)) biggest = std::max(biggest, m.rows * m.cols);
  for (int ranks : {1, 2, 3, 4, 7, 8}) {
    const Zero1Plan p = plan_zero1(l, ranks);
    expect_valid(l, p, ranks);
    // within half a matrix and the alignment of the ideal cut on each side (32-wide matrices
    // cost about what AdamW elements cost, so the cuts by floats are kept)
    const double ideal = double(l.total_floats) / ranks;
    EXPECT_LE(p.largest(), ideal + biggest + 2 * kZero1AlignFloats) << ranks << " ranks";
  }
  EXPECT_EQ(plan_zero1(l, 1).count(0), l.total_floats);
}

TEST(Zero1Plan, MoreRanksThanUnitsLeavesEmptyShards) {
  const auto l = optim::assign_groups({{"w", {64, 64}}}, optim::default_rules());  // one Muon matrix
  ASSERT_EQ(l.params[0].optimizer, optim::OptimizerKind::kMuon);
  const Zero1Plan p = plan_zero1(l, 4);
  expect_valid(l, p, 4);
  int empty = 0;
  for (int r = 0; r < 4; ++r) empty += p.count(r) == 0;
  EXPECT_GE(empty, 3);
}

TEST(Zero1Plan, CutsAdamWParametersAnywhereAligned) {
  const auto l = optim::assign_groups({{"embed.weight", {1000, 64}}}, optim::default_rules());  // AdamW
  const Zero1Plan p = plan_zero1(l, 3);
  expect_valid(l, p, 3);
  for (int r = 1; r < 3; ++r) EXPECT_EQ(p.begin(r) % kZero1AlignFloats, 0);
  EXPECT_LE(p.largest() - l.total_floats / 3, kZero1AlignFloats);
  EXPECT_THROW(plan_zero1(l, 0), Error);
}


// A layout shaped like the 8-layer ZAYA1 bench model, scaled down: an AdamW embedding of a
// quarter of the floats in front of Muon expert stacks of 512 x 512 matrices.
optim::ParamLayout embedding_then_stacks() {
  std::vector<optim::ParamSpec> specs = {{"embed.weight", {4096, 512}}};
  for (int i = 0; i < 6; ++i) {
    specs.push_back({"layers." + std::to_string(i) + ".moe.experts.w_up", {4, 512, 512}});
    specs.push_back({"layers." + std::to_string(i) + ".norm.weight", {512}});
  }
  return optim::assign_groups(specs, optim::default_rules());
}

// Per-float optimizer cost at each offset of the layout, computed from the parameters directly.
std::vector<double> cost_prefix(const optim::ParamLayout& l) {
  std::vector<double> rate(static_cast<std::size_t>(l.total_floats), 1.0);
  for (const auto& p : l.params)
    if (p.optimizer == optim::OptimizerKind::kMuon)
      for (std::int64_t i = 0; i < p.numel; ++i) rate[p.offset + i] = zero1_muon_cost_per_float(p.rows(), p.cols());
  std::vector<double> prefix(rate.size() + 1, 0.0);
  for (std::size_t i = 0; i < rate.size(); ++i) prefix[i + 1] = prefix[i] + rate[i];
  return prefix;
}

// The busiest shard in floats or cost, relative to the mean, for cuts `b` (ranks + 1 offsets).
double worst_of(const std::vector<double>& prefix, const std::vector<std::int64_t>& b) {
  const double ranks = double(b.size() - 1), total = double(prefix.size() - 1);
  double worst = 0;
  for (std::size_t r = 0; r + 1 < b.size(); ++r)
    worst = std::max({worst, double(b[r + 1] - b[r]) / (total / ranks),
                      (prefix[b[r + 1]] - prefix[b[r]]) / (prefix.back() / ranks)});
  return worst;
}

TEST(Zero1Plan, MuonCostPerFloatFollowsTheSmallerSide) {
  EXPECT_NEAR(zero1_muon_cost_per_float(2048, 2048), 1 + 5.0 * 6 * 2048 / kZero1FlopsPerAdamWFloat, 1e-12);
  EXPECT_NEAR(zero1_muon_cost_per_float(2048, 2048), 11.97, 0.01);  // about 12 AdamW elements
  EXPECT_DOUBLE_EQ(zero1_muon_cost_per_float(1280, 2048), zero1_muon_cost_per_float(2048, 1280));
  // s = 1024, l = 2048: 5 (4 s^2 l + 2 s^3) / (s l) = 5 (4 s + 2 s^2 / l) = 5 x 5120
  EXPECT_NEAR(zero1_muon_cost_per_float(2048, 1024), 1 + 5.0 * 5120 / kZero1FlopsPerAdamWFloat, 1e-12);
}

TEST(Zero1Plan, BalancesNewtonSchulzWorkBesideAnAdamWEmbedding) {
  const auto l = embedding_then_stacks();
  const auto prefix = cost_prefix(l);
  const double E = 4096.0 * 512, M = 6 * 4 * 512.0 * 512, rho = zero1_muon_cost_per_float(512, 512);
  // Two ranks: the embedding and x Muon floats on rank 0, the rest on rank 1. Floats and cost
  // both at the bound B: (E + x) / F = B and (M - x) rho / C = B, F and C the means.
  const double F = (E + M) / 2, C = (E + M * rho) / 2, best = (E + M) * rho / (C + F * rho);
  const Zero1Plan two = plan_zero1(l, 2);
  expect_valid(l, two, 2);
  const double matrix_share = 512.0 * 512 * rho / C;  // one matrix more or less on a rank
  EXPECT_GE(worst_of(prefix, two.bounds), best - 1e-9);
  EXPECT_LE(worst_of(prefix, two.bounds), best + matrix_share);
  // The cut by floats leaves rank 1 with Newton-Schulz only: far busier.
  const double by_floats = (M - (F - E)) * rho / C;
  EXPECT_GT(by_floats, best + matrix_share);
  const Zero1Balance b = zero1_balance(l, two);
  EXPECT_NEAR(b.worst(), worst_of(prefix, two.bounds), 1e-9);
  EXPECT_GT(b.floats, 1.05);  // rank 0 holds more than half the floats...
  EXPECT_LT(b.cost, by_floats);  // ... so that rank 1 does less of the work

  // Against every plan whose cuts lie on a grid (4,096 floats inside AdamW runs, every piece
  // boundary): the plan is at least as good as the best of them, whatever the rank count.
  std::vector<std::int64_t> grid = {0, l.total_floats};
  for (const auto& p : l.params) {
    grid.push_back(p.offset);
    if (p.optimizer == optim::OptimizerKind::kMuon)
      for (std::int64_t m = 0; m <= p.matrices(); ++m) grid.push_back(p.offset + m * p.rows() * p.cols());
    else
      for (std::int64_t o = 4096; o < p.numel; o += 4096) grid.push_back(p.offset + o);
  }
  std::sort(grid.begin(), grid.end());
  grid.erase(std::unique(grid.begin(), grid.end()), grid.end());
  for (int ranks : {2, 3, 4, 8}) {
    // dp[r][j]: the least busiest-shard load of r shards covering [0, grid[j])
    const std::size_t n = grid.size();
    const double inf = 1e300;
    std::vector<double> dp(n, inf), next(n);
    dp[0] = 0;
    for (int r = 0; r < ranks; ++r) {
      std::fill(next.begin(), next.end(), inf);
      for (std::size_t j = 0; j < n; ++j)
        for (std::size_t i = 0; i <= j; ++i)
          if (dp[i] < inf) {
            // shard [grid[i], grid[j]) relative to the mean of `ranks` shards
            const double floats = double(grid[j] - grid[i]) / (double(l.total_floats) / ranks);
            const double cost = (prefix[grid[j]] - prefix[grid[i]]) / (prefix.back() / ranks);
            next[j] = std::min(next[j], std::max({dp[i], floats, cost}));
          }
      dp.swap(next);
    }
    const Zero1Plan p = plan_zero1(l, ranks);
    expect_valid(l, p, ranks);
    EXPECT_LE(worst_of(prefix, p.bounds), dp[n - 1] * 1.0011) << ranks << " ranks";
  }
}

}  // namespace
}  // namespace keel::parallel
