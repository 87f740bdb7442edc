// ZeRO-1 shard plans: contiguous shards that tile the flat buffer, never split a Muon matrix,
// stay within one matrix (plus alignment) of equal, and may be empty when there are more ranks
// than units.
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
    // within half a matrix and the alignment of the ideal cut on each side
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

}  // namespace
}  // namespace keel::parallel
