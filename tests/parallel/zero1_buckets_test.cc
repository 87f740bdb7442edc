// Buckets of the overlapped ZeRO-1 step: they tile the flat buffer in offset order, each inside
// one stage and one rank's shard (so it has one owner), never split a Muon matrix, and stay
// within the target size unless a single Muon matrix is larger. The environment switches parse.
#include <gtest/gtest.h>

#include <cstdlib>

#include "common/error.h"
#include "optim/param_groups.h"
#include "parallel/zero1.h"
#include "parallel/zero1_buckets.h"

namespace keel::parallel {
namespace {

optim::ParamLayout layout() {
  return optim::assign_groups({{"embed.weight", {100, 32}},
                               {"layers.0.attn.qkv.weight", {96, 32}},
                               {"layers.0.norm.weight", {32}},
                               {"layers.0.moe.experts.w_up", {8, 64, 32}},
                               {"layers.0.moe.experts.w_down", {8, 32, 64}},
                               {"layers.1.attn.qkv.weight", {96, 32}},
                               {"final_norm.weight", {32}}},
                              optim::default_rules());
}

const optim::ParamInfo& param(const optim::ParamLayout& l, const std::string& name) {
  for (const auto& p : l.params)
    if (p.name == name) return p;
  throw Error("no parameter " + name);
}

// embedding | layer 0 attention | layer 0 MLP | layer 1 (empty MLP part) | final
std::vector<std::int64_t> stages(const optim::ParamLayout& l) {
  const std::int64_t a0 = param(l, "layers.0.attn.qkv.weight").offset, m0 = param(l, "layers.0.moe.experts.w_up").offset;
  const std::int64_t a1 = param(l, "layers.1.attn.qkv.weight").offset, f = param(l, "final_norm.weight").offset;
  return {0, a0, m0, a1, f, f, l.total_floats};
}

void expect_valid(const optim::ParamLayout& l, const Zero1Plan& plan, const std::vector<std::int64_t>& st,
                  const std::vector<Zero1Bucket>& buckets, std::int64_t target) {
  ASSERT_FALSE(buckets.empty());
  EXPECT_EQ(buckets.front().begin, 0);
  EXPECT_EQ(buckets.back().end, l.total_floats);
  for (std::size_t i = 0; i < buckets.size(); ++i) {
    const auto& b = buckets[i];
    EXPECT_LT(b.begin, b.end) << "bucket " << i;
    if (i > 0) EXPECT_EQ(b.begin, buckets[i - 1].end) << "gap or overlap before bucket " << i;
    EXPECT_GE(b.begin, plan.begin(b.owner)) << "bucket " << i;
    EXPECT_LE(b.end, plan.end(b.owner)) << "bucket " << i;
    EXPECT_GE(b.begin, st[static_cast<std::size_t>(b.stage)]) << "bucket " << i;
    EXPECT_LE(b.end, st[static_cast<std::size_t>(b.stage) + 1]) << "bucket " << i;
    if (i > 0) EXPECT_GE(b.stage, buckets[i - 1].stage);
    // within the target, or one whole Muon matrix
    if (b.end - b.begin > target) {
      const auto m = muon_matrices_in(l, b.begin, b.end);
      ASSERT_EQ(m.size(), 1u) << "bucket " << i << " of " << b.end - b.begin << " floats, target " << target;
      EXPECT_EQ(m[0].offset, b.begin);
    }
  }
  // no Muon matrix split by a bucket cut
  for (const auto& m : muon_matrices_in(l, 0, l.total_floats))
    for (const auto& b : buckets)
      EXPECT_FALSE(b.begin > m.offset && b.begin < m.offset + m.rows * m.cols) << "cut inside the matrix at " << m.offset;
}

TEST(Zero1Buckets, TileEachStageAndShardAndKeepMatricesWhole) {
  const auto l = layout();
  const auto st = stages(l);
  for (int ranks = 1; ranks <= 5; ++ranks) {
    const Zero1Plan plan = plan_zero1(l, ranks);
    for (std::int64_t target : {64, 1024, 4096, 1 << 30}) {
      SCOPED_TRACE(testing::Message() << ranks << " ranks, target " << target);
      expect_valid(l, plan, st, plan_zero1_buckets(l, plan, st, target), target);
    }
  }
}

TEST(Zero1Buckets, AHugeTargetGivesOneBucketPerStageAndShard) {
  const auto l = layout();
  const auto st = stages(l);
  const auto buckets = plan_zero1_buckets(l, plan_zero1(l, 1), st, std::int64_t(1) << 40);
  // five non-empty stages, one rank
  ASSERT_EQ(buckets.size(), 5u);
  for (std::size_t i = 0; i < buckets.size(); ++i) EXPECT_EQ(buckets[i].owner, 0);
  EXPECT_EQ(buckets[4].stage, 5) << "the empty stage 4 holds no bucket";
}

TEST(Zero1Buckets, AdamWParametersSplitAtTheTarget) {
  const auto l = layout();  // the embedding (AdamW, 3200 floats) is stage 0
  const auto buckets = plan_zero1_buckets(l, plan_zero1(l, 1), stages(l), 1024);
  ASSERT_GE(buckets.size(), 4u);
  EXPECT_EQ(buckets[0].end, 1024);
  EXPECT_EQ(buckets[1].end, 2048);
  EXPECT_EQ(buckets[2].end, 3072);
  EXPECT_EQ(buckets[3].end, param(l, "layers.0.attn.qkv.weight").offset);
  EXPECT_EQ(buckets[3].stage, 0);
}

TEST(Zero1Buckets, RejectsBadStagesAndTargets) {
  const auto l = layout();
  const Zero1Plan plan = plan_zero1(l, 2);
  EXPECT_THROW(plan_zero1_buckets(l, plan, {0, 10}, 64), Error);                          // does not reach the end
  EXPECT_THROW(plan_zero1_buckets(l, plan, {0, 500, 100, l.total_floats}, 64), Error);     // descends
  EXPECT_THROW(plan_zero1_buckets(l, plan, {0, l.total_floats}, 0), Error);
}

}  // namespace
}  // namespace keel::parallel
