// ZAYA1's released names (src/model/released_names.*): the mapping covers every keel parameter
// exactly once under both layouts, with the released shapes of ZAYA1-8B, expert stacks
// interleave gate and up per expert, and a model that is not ZAYA1's is one clear error.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include <fmt/format.h>

#include "common/error.h"
#include "model/config.h"
#include "model/param_layout.h"
#include "model/released_names.h"
#include "../error_message.h"

namespace keel::model::released {
namespace {

model::ModelConfig config(const char* name) {
  return model::load_model_config(std::string(KEEL_SOURCE_DIR) + "/configs/" + name);
}

std::string shape_str(const Shape& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

template <typename F>
std::string error_of(F f) {
  return test::error_message(f, "(no error)");
}

TEST(ReleasedNames, EveryKeelParameterMapsExactlyOnce) {
  for (const char* file : {"zaya1-tiny.yaml", "zaya1-8b.yaml"}) {
    const auto cfg = config(file);
    const auto layout = model::param_layout(cfg);
    for (Names names : {Names::kZaya1, Names::kZaya1Alternating}) {
      SCOPED_TRACE(std::string(file) + " " + to_string(names));
      const NameMap map = build_name_map(cfg, names);
      EXPECT_NO_THROW(check_coverage(map));
      // Every parameter of the layout (and each MoE layer's router bias) is a keel tensor of the map.
      EXPECT_EQ(map.keel.size(), layout.params.size() + static_cast<std::size_t>(model::moe_layer_count(cfg)));
      std::map<std::string, int> used;
      for (const auto& r : map.rules)
        for (const auto& p : r.pieces) ++used[p.keel];
      for (const auto& p : layout.params) EXPECT_GT(used["model/" + p.name], 0) << p.name;
      // Released tensors: the embedding, the merges before each attention stage (2 for the
      // embedding, 4 after), 28 per layer for zaya1 (26 + 2E per-expert ones for the alternating
      // layout) less the first layer's EDA scale, the final merge (4) and norm.
      const std::size_t L = static_cast<std::size_t>(cfg.layers), E = static_cast<std::size_t>(cfg.experts);
      if (names == Names::kZaya1) EXPECT_EQ(map.rules.size(), 1 + 2 + (L - 1) * 4 + L * 28 - 1 + 4 + 1);
      else EXPECT_EQ(map.rules.size(), 1 + 2 + (L - 1) * 4 + L * (26 + 2 * E) - 1 + 4 + 1);
    }
  }
  // The released shapes of ZAYA1-8B (modeling_zaya.py, both layouts).
  const auto cfg = config("zaya1-8b.yaml");
  const NameMap hf = build_name_map(cfg, Names::kZaya1);
  auto shape = [](const NameMap& m, const std::string& n) {
    const Rule* r = m.find(n);
    return r ? shape_str(r->shape) : "(missing)";
  };
  EXPECT_EQ(shape(hf, "model.embed_tokens.weight"), "[262272, 2048]");
  EXPECT_EQ(shape(hf, "model.layers.0.self_attn.qkv_proj.q_proj.weight"), "[1024, 2048]");
  EXPECT_EQ(shape(hf, "model.layers.0.self_attn.qkv_proj.k_proj.weight"), "[256, 2048]");
  EXPECT_EQ(shape(hf, "model.layers.0.self_attn.qkv_proj.v_proj_delayed.weight"), "[128, 2048]");
  EXPECT_EQ(shape(hf, "model.layers.0.self_attn.qkv_proj.conv_qk_depthwise.weight"), "[1280, 1, 2]");
  EXPECT_EQ(shape(hf, "model.layers.0.self_attn.qkv_proj.conv_qk_grouped.weight"), "[1280, 128, 2]");
  EXPECT_EQ(shape(hf, "model.layers.39.self_attn.qk_norm.temp"), "[2]");
  EXPECT_EQ(shape(hf, "model.layers.39.mlp.experts.gate_up_proj"), "[16, 4096, 2048]");
  EXPECT_EQ(shape(hf, "model.layers.39.mlp.experts.down_proj"), "[16, 2048, 2048]");
  EXPECT_EQ(shape(hf, "model.layers.39.mlp.gate.router_mlp.out_proj.weight"), "[17, 256]");
  EXPECT_EQ(shape(hf, "model.layers.39.mlp.gate.balancing_biases"), "[17]");
  EXPECT_EQ(shape(hf, "model.layers.39.post_mlp_residual_scale.residual_bias"), "[2048]");
  EXPECT_EQ(shape(hf, "model.input_hidden_states_scale"), "[2048]");
  EXPECT_EQ(hf.find("model.layers.0.mlp.gate.router_states_scale"), nullptr);  // no EDA into the first
  EXPECT_NE(hf.find("model.layers.1.mlp.gate.router_states_scale"), nullptr);
  EXPECT_EQ(hf.find("lm_head.weight"), nullptr);  // tied
  const NameMap alt = build_name_map(cfg, Names::kZaya1Alternating);
  EXPECT_EQ(shape(alt, "model.layers.79.zaya_block.experts.local_experts.15.linear_fc1.weight"), "[4096, 2048]");
  EXPECT_EQ(shape(alt, "model.layers.79.zaya_block.experts.local_experts.15.linear_fc2.weight"), "[2048, 2048]");
  EXPECT_EQ(shape(alt, "model.layers.78.self_attn.qkv.conv_qk.1.weight"), "[1280, 128, 2]");
  EXPECT_EQ(shape(alt, "model.layers.1.zaya_block.router.router_mlp.4.weight"), "[17, 256]");
  EXPECT_EQ(alt.find("model.layers.1.zaya_block.router.router_states_scale"), nullptr);
  EXPECT_EQ(alt.find("model.layers.0.res_scale.residual_scale"), nullptr);  // stage 0: embedding only
  EXPECT_EQ(shape(alt, "model.res_scale.residual_scale"), "[2048]");
  EXPECT_EQ(shape(alt, "model.final_norm.weight"), "[2048]");
}

TEST(ReleasedNames, ExpertStacksInterleaveGateAndUpPerExpert) {
  const auto cfg = config("zaya1-tiny.yaml");
  const NameMap hf = build_name_map(cfg, Names::kZaya1), alt = build_name_map(cfg, Names::kZaya1Alternating);
  const Rule* gu = hf.find("model.layers.1.mlp.experts.gate_up_proj");
  ASSERT_NE(gu, nullptr);
  ASSERT_EQ(gu->pieces.size(), 2u * cfg.experts);
  EXPECT_EQ(gu->pieces[2].keel, "model/layers.1.moe.w_gate");
  EXPECT_EQ(gu->pieces[2].row0, 1);
  EXPECT_EQ(gu->pieces[3].keel, "model/layers.1.moe.w_up");
  const Rule* qk = alt.find("model.layers.2.self_attn.qkv.linear_k.weight");
  ASSERT_NE(qk, nullptr);
  EXPECT_EQ(qk->pieces[0].keel, "model/layers.1.attn.cca.w_qk");
  EXPECT_EQ(qk->pieces[0].row0, cfg.heads * cfg.head_dim);  // the k rows follow the q rows
}

TEST(ReleasedNames, NotAZaya1ModelOrUnknownNamesIsOneClearError) {
  const std::string dense = error_of([&] { build_name_map(config("llama3-8b.yaml"), Names::kZaya1); });
  EXPECT_NE(dense.find("--names zaya1: model 'llama3-8b' layer 0 attention is not cca: not a ZAYA1-shaped model"),
            std::string::npos)
      << dense;
  EXPECT_THROW(parse_names("zaya2"), UsageError);
  // A released name of the other layout gets a hint naming the --names that reads it.
  EXPECT_NE(layout_hint("model.layers.1.zaya_block.router.router_mlp.4.weight", Names::kZaya1).find("zaya1-alternating"),
            std::string::npos);
  EXPECT_NE(layout_hint("model.layers.0.mlp.experts.down_proj", Names::kZaya1Alternating).find("--names zaya1)"),
            std::string::npos);
  EXPECT_EQ(layout_hint("model.layers.0.mlp.experts.down_proj", Names::kZaya1), "");
}

}  // namespace
}  // namespace keel::model::released
