#include "optim/param_groups.h"

#include <gtest/gtest.h>

#include <string>

#include "common/error.h"
#include "../error_message.h"

namespace keel::optim {
namespace {

std::string error_of(const std::vector<ParamSpec>& params, const std::vector<GroupRule>& rules) {
  return test::error_message([&] { assign_groups(params, rules); });
}

TEST(ParamGroupGlob, Patterns) {
  EXPECT_TRUE(glob_match("*", "anything"));
  EXPECT_TRUE(glob_match("*embed*", "model.embed_tokens.weight"));
  EXPECT_FALSE(glob_match("*embed*", "layers.0.attn.q.weight"));
  EXPECT_TRUE(glob_match("layers.?.norm*|*bias", "layers.3.norm.weight"));
  EXPECT_TRUE(glob_match("layers.?.norm*|*bias", "mlp.fc1.bias"));
  EXPECT_FALSE(glob_match("layers.?.norm*", "layers.12.norm.weight"));
  EXPECT_TRUE(glob_match("a*b*c", "aXXbYYc"));
  EXPECT_FALSE(glob_match("a*b*c", "aXXbYYcd"));
  EXPECT_FALSE(glob_match("", "x"));
  EXPECT_TRUE(glob_match("x|", "x"));
}

TEST(ParamGroupAssign, DefaultRulesZaya1Style) {
  std::vector<ParamSpec> params = {
      {"embed.weight", {1000, 64}},
      {"layers.0.attn_norm.weight", {64}},
      {"layers.0.cca.q.weight", {64, 64}},
      {"layers.0.cca.conv.weight", {64, 1, 2}},
      {"layers.0.cca.conv.bias", {64}},
      {"layers.0.cca.temperature", {}},
      {"layers.0.residual_scale", {64}},
      {"layers.0.router.weight", {16, 64}},
      {"layers.0.router.bias", {16}},
      {"layers.0.moe.experts.w_up", {16, 128, 64}},
      {"lm_head.weight", {1000, 64}},
  };
  ParamLayout layout = assign_groups(params, default_rules());
  ASSERT_EQ(layout.params.size(), params.size());
  auto kind = [&](int i) { return layout.params[static_cast<std::size_t>(i)].optimizer; };
  auto group = [&](int i) { return layout.params[static_cast<std::size_t>(i)].group; };
  EXPECT_EQ(group(0), "embeddings");
  EXPECT_EQ(kind(0), OptimizerKind::kAdamW);
  EXPECT_EQ(group(1), "vectors");
  EXPECT_FALSE(layout.params[1].weight_decay);
  EXPECT_EQ(kind(2), OptimizerKind::kMuon);
  EXPECT_EQ(group(3), "convs");
  EXPECT_EQ(group(4), "vectors");
  EXPECT_EQ(group(5), "vectors");
  EXPECT_EQ(group(6), "vectors");
  EXPECT_EQ(kind(7), OptimizerKind::kMuon);
  EXPECT_EQ(group(8), "vectors");
  EXPECT_EQ(kind(9), OptimizerKind::kMuon);
  EXPECT_EQ(layout.params[9].matrices(), 16);
  EXPECT_EQ(layout.params[9].rows(), 128);
  EXPECT_EQ(group(10), "embeddings");
  // Layout: 64-byte aligned offsets in order, no overlap.
  std::int64_t end = 0;
  for (const auto& p : layout.params) {
    EXPECT_EQ(p.offset % 16, 0) << p.name;
    EXPECT_GE(p.offset, end);
    end = p.offset + p.numel;
  }
  EXPECT_EQ(layout.total_floats, end);
  EXPECT_EQ(layout.params[5].numel, 1);  // a 0-D scalar
}

TEST(ParamGroupAssign, ConfigurableRulesAndLrScale) {
  std::vector<GroupRule> rules = {
      {"head", "lm_head.*", "", 2, 2, OptimizerKind::kAdamW, false, 0.5},
      {"hidden", "*", "lm_head.*", 2, 2, OptimizerKind::kMuon, true, 1.0},
      {"rest", "*", "", 0, 1, OptimizerKind::kAdamW, false, 2.0},
  };
  ParamLayout layout = assign_groups({{"lm_head.weight", {10, 4}}, {"w", {4, 4}}, {"b", {4}}}, rules, 1);
  EXPECT_EQ(layout.params[0].lr_scale, 0.5);
  EXPECT_FALSE(layout.params[0].weight_decay);
  EXPECT_EQ(layout.params[1].optimizer, OptimizerKind::kMuon);
  EXPECT_EQ(layout.params[2].lr_scale, 2.0);
  EXPECT_EQ(layout.params[1].offset, 40);  // align 1: packed
  EXPECT_EQ(layout.total_floats, 60);
}

TEST(ParamGroupAssign, ErrorsNameTheParameter) {
  // Unmatched: a 4-D tensor that no default rule covers.
  std::string e = error_of({{"layers.0.mix", {2, 2, 2, 2}}}, default_rules());
  EXPECT_NE(e.find("parameter 'layers.0.mix' [2, 2, 2, 2] matches no group rule"), std::string::npos) << e;
  EXPECT_NE(e.find("rules: embeddings, convs, vectors, matrices"), std::string::npos) << e;
  // Doubly matched: two overlapping rules.
  std::vector<GroupRule> overlap = {{"a", "*.weight", "", 0, 8, OptimizerKind::kAdamW, true, 1.0},
                                    {"b", "layers.*", "", 2, 2, OptimizerKind::kMuon, true, 1.0}};
  e = error_of({{"layers.0.q.weight", {4, 4}}}, overlap);
  EXPECT_NE(e.find("parameter 'layers.0.q.weight' [4, 4] matches group rules 'a' and 'b'"), std::string::npos) << e;
  // Muon on a vector.
  std::vector<GroupRule> muon_all = {{"all", "*", "", 0, 8, OptimizerKind::kMuon, true, 1.0}};
  e = error_of({{"norm.weight", {4}}}, muon_all);
  EXPECT_NE(e.find("'norm.weight' [4] is assigned to Muon by rule 'all'"), std::string::npos) << e;
  // Duplicates, bad shapes, bad lr_scale.
  EXPECT_NE(error_of({{"w", {4}}, {"w", {4}}}, default_rules()).find("duplicate parameter name 'w'"), std::string::npos);
  EXPECT_NE(error_of({{"w", {4, 0}}}, default_rules()).find("'w'"), std::string::npos);
  std::vector<GroupRule> bad = default_rules();
  bad[0].lr_scale = -1;
  EXPECT_NE(error_of({{"w", {4}}}, bad).find("lr_scale"), std::string::npos);
  EXPECT_NE(error_of({{"w", {4}}}, {}).find("rules: none"), std::string::npos);
}

}  // namespace
}  // namespace keel::optim
