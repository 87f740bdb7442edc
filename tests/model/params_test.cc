// Parameter counts and FLOPs pinned to published figures.
#include "model/params.h"

#include <gtest/gtest.h>

#include <map>

#include "common/error.h"
#include "model/flops.h"
#include "../error_message.h"

namespace keel::model {
namespace {

ModelConfig load(const std::string& name) {
  return load_model_config(std::string(KEEL_SOURCE_DIR) + "/configs/" + name + ".yaml");
}

std::int64_t component(const ParamCounts& pc, const std::string& name, bool active = false) {
  for (const auto& c : pc.components)
    if (c.name == name) return active ? c.active : c.total;
  return 0;
}

// A published "8.3B" is any count that rounds to it: [8.25e9, 8.35e9).
void expect_rounds_to(double value, double published, double unit, const char* what) {
  EXPECT_GE(value, published - unit / 2) << what;
  EXPECT_LT(value, published + unit / 2) << what;
}

TEST(Params, Zaya1MatchesPublishedNonEmbeddingCounts) {
  const ParamCounts pc = count_params(load("zaya1-8b"));
  // arXiv 2511.17127: "760M active / 8.3B total" are non-embedding counts.
  expect_rounds_to(pc.total_non_embedding, 8.3e9, 0.1e9, "total (8.3B)");
  // The published 760M is rounded from a count the config gives as 753.7M (zaya1.md 2.9
  // derives 0.754B by hand): within 1% of 760M, and exactly the hand derivation.
  EXPECT_NEAR(pc.active_non_embedding, 760e6, 7.6e6);
  expect_rounds_to(pc.active_non_embedding, 0.754e9, 0.001e9, "active (0.754B)");
  // Component by component against the hand count (zaya1.md 2.9).
  EXPECT_EQ(component(pc, "cca_attention") / 40, 2048 * 1024 + 2048 * 256 + 2048 * 256 + 1024 * 2048);  // 5.24M
  EXPECT_NEAR(component(pc, "cca_conv") / 40, 0.33e6, 0.005e6);
  EXPECT_EQ(component(pc, "experts") / 640, 3LL * 2048 * 2048);  // 12.58M each, 640 of them
  EXPECT_EQ(component(pc, "experts", true) / 40, 3LL * 2048 * 2048);
  EXPECT_NEAR(component(pc, "router") / 40, 0.66e6, 0.005e6);
  EXPECT_NEAR(component(pc, "norms"), 0.8e6, 0.05e6);
  EXPECT_EQ(component(pc, "embedding"), 262272LL * 2048);
  EXPECT_EQ(component(pc, "lm_head"), 0);  // tied
  expect_rounds_to(pc.total, 8.84e9, 0.01e9, "with embedding (8.84B)");
  expect_rounds_to(pc.active, 1.29e9, 0.01e9, "active with embedding (1.29B)");
}

TEST(Params, Mixtral8x7b) {
  const ParamCounts pc = count_params(load("mixtral-8x7b"));
  expect_rounds_to(pc.total, 46.7e9, 0.1e9, "total (46.7B)");
  expect_rounds_to(pc.active, 12.9e9, 0.1e9, "active (12.9B)");
}

TEST(Params, Llama3_8b) {
  const ParamCounts pc = count_params(load("llama3-8b"));
  expect_rounds_to(pc.total, 8.03e9, 0.01e9, "total (8.03B)");
  EXPECT_EQ(pc.total, pc.active);
  // Exact: 2 x 128256 x 4096 embeddings + 32 x (attention 41.9M + MLP 176.2M) + norms.
  EXPECT_EQ(pc.total, 2LL * 128256 * 4096 + 32LL * (4096LL * (4096 + 2 * 1024) + 4096LL * 4096 + 3LL * 4096 * 14336) +
                          65LL * 4096);
}

TEST(Params, Olmoe1b7b) {
  const ParamCounts pc = count_params(load("olmoe-1b-7b"));
  expect_rounds_to(pc.total, 6.9e9, 0.1e9, "total (6.9B)");
  expect_rounds_to(pc.active, 1.3e9, 0.1e9, "active (1.3B)");
}

// The message of the UsageError count_params throws, or "" when it counts.
std::string count_error(const ModelConfig& m) {
  return test::error_message<UsageError>([&] { count_params(m); });
}

TEST(Params, LargeCountsAreExactAndNoComponentIsDropped) {
  // 2^20 experts of Mixtral's width: 5.9e15 parameters, far past int32 but inside int64.
  ModelConfig m = load("mixtral-8x7b");
  m.experts = 1 << 20;
  const ParamCounts pc = count_params(m);
  EXPECT_EQ(component(pc, "experts"), 32LL * (1 << 20) * 3 * 4096 * 14336);
  EXPECT_EQ(component(pc, "experts", true), 32LL * 2 * 3 * 4096 * 14336);
  EXPECT_EQ(component(pc, "router"), 32LL * 4096 * (1 << 20));
  std::int64_t sum = 0;
  for (const auto& c : pc.components) sum += c.total;
  EXPECT_EQ(sum, pc.total);
  EXPECT_EQ(pc.components.size(), 6u);  // embedding, lm_head, attention, router, experts, norms
}

TEST(Params, OverflowIsAnErrorNamingTheModelAndComponent) {
  // The auditor's cases: the experts row vanished (its total wrapped negative) and the
  // router printed 281.47T; a 2^62 vocabulary dropped the embedding and the LM head.
  ModelConfig experts = load("mixtral-8x7b");
  experts.experts = 2147483647;
  EXPECT_EQ(count_error(experts),
            "model 'mixtral-8x7b': parameter count of 'experts' overflows int64 (a size in the config is too large)");
  // Set in code, past the loader's own range check: count_params must hold on its own.
  ModelConfig vocab = load("mixtral-8x7b");
  vocab.vocab_size = 4611686018427387904LL;
  EXPECT_NE(count_error(vocab).find("parameter count of 'embedding' overflows"), std::string::npos);
  vocab.tied_embeddings = true;
  EXPECT_NE(count_error(vocab).find("parameter count of 'embedding' overflows"), std::string::npos);
  // Every component fits, their sum does not: the total is checked too.
  ModelConfig total = load("llama3-8b");
  total.hidden = 1;
  total.heads = total.kv_heads = total.head_dim = 1;
  total.ffn_hidden = 1;
  total.vocab_size = 4611686018427387904LL;
  EXPECT_EQ(count_error(total),
            "model 'llama3-8b': parameter count of 'total' overflows int64 (a size in the config is too large)");
  // ZAYA1's skip class: experts + 1 must not overflow int before it widens.
  ModelConfig skip = load("zaya1-8b");
  skip.experts = 2147483647;
  skip.expert_hidden = 1;
  EXPECT_EQ(component(count_params(skip), "router"),  // 40 MoE stages, the first without an EDA scale
            40 * (2048LL * 256 + 3 * 256 + 2 * (256LL * 256 + 256) + 256 * 2147483648LL) - 256);
}

TEST(Flops, TrainingIsSixNPlusAttention) {
  for (const char* name : {"zaya1-8b", "llama3-8b", "mixtral-8x7b", "olmoe-1b-7b"}) {
    SCOPED_TRACE(name);
    const ModelConfig m = load(name);
    const ParamCounts pc = count_params(m);
    const std::int64_t seq = 4096;
    const TokenFlops f = token_flops(m, seq);
    // N: weights a token multiplies by, LM head included even when tied. Attention: the
    // causal-halved 6*L*C*T of llm.c, C = query width.
    const double attention = 6.0 * m.layers * m.heads * m.head_dim * seq;
    EXPECT_NEAR(f.training(), 6.0 * pc.matmul_active + attention, 1e-9 * f.training());
    // 6N with N the non-embedding active count + head is within 0.1% (norm vectors, biases).
    EXPECT_NEAR(f.training(), 6.0 * (pc.active_non_embedding + pc.lm_head_matmul) + attention, 1e-3 * f.training());
    EXPECT_DOUBLE_EQ(f.backward(), 2 * f.forward());
    EXPECT_GT(f.training_with(Recompute::kFull), f.training_with(Recompute::kSelective));
    EXPECT_GE(f.training_with(Recompute::kSelective), f.training());
    EXPECT_NEAR(f.training_palm() - f.training(), 3 * f.attention_forward, 1e-9 * f.training());
  }
}

// A sliding layer's attention counts only its window: W - W^2 / 2T keys per query (the first W
// queries ramp up as causal ones do), exactly the causal T / 2 at W = T; PaLM's non-halved count
// is W. The other terms do not change.
TEST(Flops, SlidingLayersCountTheirWindow) {
  const ModelConfig full = load("zaya1-8b");
  ModelConfig m = full;
  m.layer_sliding = {false, true};  // every other layer of 40 slides
  m.sliding_window = 1024;
  validate(m);
  const std::int64_t T = 4096;
  const double C = double(m.heads) * m.head_dim, W = 1024;
  const TokenFlops f = token_flops(m, T), g = token_flops(full, T);
  EXPECT_DOUBLE_EQ(f.body_forward, g.body_forward);
  EXPECT_DOUBLE_EQ(f.lm_head_forward, g.lm_head_forward);
  EXPECT_NEAR(f.attention_forward, 20 * 4 * C * (T / 2.0) + 20 * 4 * C * (W - W * W / (2.0 * T)),
              1e-9 * g.attention_forward);
  EXPECT_NEAR(f.attention_forward_palm, 20 * 4 * C * T + 20 * 4 * C * W, 1e-9 * g.attention_forward_palm);
  EXPECT_DOUBLE_EQ(attended_keys(m, 1, T), W - W * W / (2.0 * T));
  EXPECT_DOUBLE_EQ(attended_keys(m, 0, T), T / 2.0);
  EXPECT_DOUBLE_EQ(attended_keys(m, 1, 1024), 512.0);  // window = T: full causal
  EXPECT_DOUBLE_EQ(attended_keys(m, 1, 512), 256.0);   // window beyond T: full causal
  EXPECT_DOUBLE_EQ(attended_keys(m, 1, T, /*halved=*/false), W);
}

TEST(Flops, Zaya1MatchesTheHandDerivation) {
  // zaya1.md 2.9: at T = 4096, body 4.52e9, LM head 3.22e9, attention 1.01e9, total ~8.75e9.
  const TokenFlops f = token_flops(load("zaya1-8b"), 4096);
  EXPECT_NEAR(3 * f.body_forward, 4.52e9, 0.01e9);
  EXPECT_NEAR(3 * f.lm_head_forward, 3.22e9, 0.01e9);
  EXPECT_NEAR(3 * f.attention_forward, 1.01e9, 0.01e9);
  EXPECT_NEAR(f.training(), 8.75e9, 0.01e9);
}

TEST(Flops, SumOfLayerGemmsEqualsTheParameterCount) {
  // Two independent routes to the same number: the GEMM list (what bench gemm times) and the
  // parameter count. Tokens chosen so top_k * tokens divides evenly over the experts.
  for (const char* name : {"zaya1-8b", "llama3-8b", "mixtral-8x7b", "olmoe-1b-7b", "lasp2-hybrid-1b"}) {
    SCOPED_TRACE(name);
    const ModelConfig m = load(name);
    const std::int64_t tokens = 8192;
    double fwd = 0, all = 0;
    for (const Gemm& g : layer_gemms(m, tokens, true)) {
      const double fl = 2.0 * g.m * g.n * g.k * g.batch * g.layers;
      all += fl;
      if (g.pass == "fwd") fwd += fl;
    }
    const TokenFlops f = token_flops(m, 4096);
    double conv = 0;
    for (const auto& it : f.items)
      if (it.name == "cca_conv") conv = it.forward;
    EXPECT_NEAR(fwd / tokens, f.body_forward - conv + f.lm_head_forward, 1e-9 * fwd / tokens);
    EXPECT_NEAR(all, 3 * fwd, 1e-9 * all);
  }
}

TEST(Gemms, Zaya1LayerList) {
  const ModelConfig m = load("zaya1-8b");
  std::map<std::string, Gemm> fwd;
  for (const Gemm& g : layer_gemms(m, 16384, false)) {
    EXPECT_EQ(g.pass, "fwd");
    fwd[g.name] = g;
  }
  ASSERT_EQ(fwd.size(), 11u);
  auto expect = [&](const char* name, std::int64_t M, std::int64_t N, std::int64_t K, std::int64_t batch,
                    std::int64_t layers) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(fwd.count(name));
    const Gemm& g = fwd[name];
    EXPECT_EQ(g.m, M);
    EXPECT_EQ(g.n, N);
    EXPECT_EQ(g.k, K);
    EXPECT_EQ(g.batch, batch);
    EXPECT_EQ(g.layers, layers);
  };
  expect("q", 16384, 1024, 2048, 1, 40);
  expect("k", 16384, 256, 2048, 1, 40);
  expect("v", 16384, 128, 2048, 2, 40);
  expect("attn_out", 16384, 2048, 1024, 1, 40);
  expect("router_down", 16384, 256, 2048, 1, 40);
  expect("router_mlp1", 16384, 256, 256, 1, 40);
  expect("router_mlp2", 16384, 256, 256, 1, 40);
  expect("router_out", 16384, 17, 256, 1, 40);
  expect("expert_up_gate", 1024, 4096, 2048, 16, 40);  // 16384 tokens x top-1 / 16 experts
  expect("expert_down", 1024, 2048, 2048, 16, 40);
  expect("lm_head", 16384, 262272, 2048, 1, 1);
  // Uneven routing rounds up: 1000 tokens top-1 over 16 experts -> 63 per expert.
  for (const Gemm& g : layer_gemms(m, 1000, false))
    if (g.name == "expert_down") EXPECT_EQ(g.m, 63);
}

TEST(Gemms, BackwardShapes) {
  const ModelConfig m = load("llama3-8b");
  const auto gemms = layer_gemms(m, 4096, true);
  ASSERT_EQ(gemms.size(), 5u * 3);
  // qkv: fwd [4096 x 2048] <- [4096 x 4096] x [4096 x 6144]
  EXPECT_EQ(gemms[0].name, "qkv");
  EXPECT_EQ(gemms[0].n, 6144);
  EXPECT_EQ(gemms[1].pass, "bwd_data");
  EXPECT_EQ(gemms[1].m, 4096);
  EXPECT_EQ(gemms[1].n, 4096);
  EXPECT_EQ(gemms[1].k, 6144);
  EXPECT_EQ(gemms[2].pass, "bwd_weight");
  EXPECT_EQ(gemms[2].m, 4096);
  EXPECT_EQ(gemms[2].n, 6144);
  EXPECT_EQ(gemms[2].k, 4096);
  EXPECT_EQ(gemms.back().name, "lm_head");
}

}  // namespace
}  // namespace keel::model
