#include "optim/clip.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "optim_test_util.h"

namespace keel::optim {
namespace {

using testing::randn;

ParamLayout clip_layout() {
  return assign_groups({{"embed.weight", {10, 8}}, {"layers.0.attn.qkv.weight", {24, 8}}, {"norm.weight", {8}}},
                       default_rules());
}

double ref_norm(const ParamLayout& layout, const std::vector<float>& g) {
  double s = 0;
  for (const auto& p : layout.params)
    for (std::int64_t i = p.offset; i < p.offset + p.numel; ++i) s += static_cast<double>(g[i]) * g[i];
  return std::sqrt(s);
}

TEST(ClipGradNorm, NormAndScalingMatchReference) {
  ParamLayout layout = clip_layout();
  auto g = randn(static_cast<std::size_t>(layout.total_floats), 21, 0.3f);
  const double norm = ref_norm(layout, g);
  auto views = grad_views(layout, g.data());
  EXPECT_NEAR(global_grad_norm(views), norm, 1e-12 * norm);

  // Above the threshold: scaled to max_norm (the 1e-6 guard aside), norm reported pre-clip.
  const double max_norm = norm / 3;
  auto before = g;
  ClipResult r = clip_grad_norm(views, max_norm);
  EXPECT_TRUE(r.clipped);
  EXPECT_NEAR(r.norm, norm, 1e-12 * norm);
  EXPECT_NEAR(r.coefficient, max_norm / (norm + 1e-6), 1e-15);
  EXPECT_NEAR(ref_norm(layout, g), max_norm, 1e-6 * max_norm);
  RecordProperty("post_clip_norm_rel_err", testing::sci(ref_norm(layout, g) / max_norm - 1));
  for (std::size_t i = 0; i < g.size(); ++i) EXPECT_FLOAT_EQ(g[i], before[i] * static_cast<float>(r.coefficient));

  // Below the threshold, and max_norm <= 0 (disabled): untouched, coefficient 1.
  before = g;
  r = clip_grad_norm(views, 10 * max_norm);
  EXPECT_FALSE(r.clipped);
  EXPECT_EQ(r.coefficient, 1.0);
  EXPECT_EQ(g, before);
  r = clip_grad_norm(views, 0);
  EXPECT_EQ(r.coefficient, 1.0);
  EXPECT_EQ(g, before);

  // Deferred: the coefficient to fuse into the optimizer, gradients untouched.
  r = clip_grad_norm_deferred(views, max_norm / 2);
  EXPECT_TRUE(r.clipped);
  EXPECT_EQ(g, before);
}

TEST(ClipGradNorm, PartialSumsCombineAcrossShards) {
  // Data-parallel ranks each sum their shard; the all-reduced sum gives the same norm.
  auto g = randn(1000, 22);
  double total = sum_squares(g.data(), 377) + sum_squares(g.data() + 377, 623);
  double whole = sum_squares(g.data(), 1000);
  EXPECT_NEAR(norm_from_sum_squares(total), std::sqrt(whole), 1e-12 * std::sqrt(whole));
}

TEST(ClipGradNorm, NonFiniteIsReportedNotApplied) {
  ParamLayout layout = clip_layout();
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    auto g = randn(static_cast<std::size_t>(layout.total_floats), 23);
    g[static_cast<std::size_t>(layout.params[1].offset + 5)] = bad;
    auto before = g;
    auto views = grad_views(layout, g.data());
    try {
      clip_grad_norm(views, 1.0);
      FAIL() << "expected NonFiniteGradient";
    } catch (const NonFiniteGradient& e) {
      EXPECT_EQ(e.param(), "layers.0.attn.qkv.weight");
      EXPECT_FALSE(std::isfinite(e.norm()));
      EXPECT_NE(std::string(e.what()).find("layers.0.attn.qkv.weight"), std::string::npos) << e.what();
    }
    // Nothing was scaled (compare bitwise: NaN != NaN).
    for (std::size_t i = 0; i < g.size(); ++i) {
      if (std::isfinite(before[i])) {
        EXPECT_EQ(g[i], before[i]);
      }
    }
  }
  // Huge but finite fp32 gradients do not overflow the double accumulation.
  std::vector<float> big(4, 3e38f);
  EXPECT_NEAR(global_grad_norm({{"big", big.data(), 4}}), 6e38, 1e32);
  // NonFiniteGradient is a keel::Error (the CLI prints it as one line).
  EXPECT_THROW(norm_from_sum_squares(std::numeric_limits<double>::infinity()), Error);
  EXPECT_THROW(clip_coefficient(std::nan(""), 1.0), Error);
}

}  // namespace
}  // namespace keel::optim
