// keel generate's inference model (src/generate/generate.h): the cached incremental decode must
// give the logits of a full-sequence prefill, and the prefill those of the training model
// (MoeTransformer::forward, through its per-position cross-entropy), for a gqa/mha model with
// dense and linear-router MoE layers and for a ZAYA1 model (CCA, MLP router with EDA and the
// skip class, residual scaling), each also with sliding-window layers. Every 1-D parameter
// (norms, biases, residual scales, conv biases, temperatures) is perturbed away from its init so
// no state's initial value hides.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "common/error.h"
#include "generate/generate.h"
#include "train/model.h"

#include "generate_test_util.h"

namespace keel::generate {
namespace {

using test_util::max_abs;
using test_util::random_tokens;

model::ModelConfig gqa_config(int kv_heads) {
  model::ModelConfig m;
  m.name = "gen-gqa";
  m.vocab_size = 37;
  m.hidden = 32;
  m.layers = 3;
  m.attention = kv_heads == 4 ? model::AttentionKind::kMha : model::AttentionKind::kGqa;
  m.heads = 4;
  m.kv_heads = kv_heads;
  m.head_dim = 8;
  m.ffn_hidden = 48;
  m.experts = 4;
  m.top_k = 2;
  m.expert_hidden = 24;
  m.first_dense_layers = 1;
  m.tied_embeddings = false;
  m.rope_fraction = 1.0;
  m.max_seq_len = 64;
  return m;
}

model::ModelConfig zaya_config(int conv0, int conv1) {
  model::ModelConfig m;
  m.name = "gen-zaya";
  m.vocab_size = 41;
  m.hidden = 32;
  m.layers = 3;
  m.attention = model::AttentionKind::kCca;
  m.heads = 4;
  m.kv_heads = 2;
  m.head_dim = 8;
  m.cca_q_dim = 32, m.cca_k_dim = 16, m.cca_v_dim = 16;
  m.cca_conv_width = conv0;
  m.cca_group_conv_width = conv1;
  m.experts = 3;
  m.top_k = 1;
  m.expert_hidden = 20;
  m.router_hidden = 8;
  m.router_mlp_layers = 3;
  m.router_skip_expert = true;
  m.tied_embeddings = true;
  m.residual_scaling = true;
  m.rope_fraction = 0.5;
  m.max_seq_len = 64;
  return m;
}

// Fresh weights with every 1-D parameter and the router biases perturbed (so the skip class and
// every expert get tokens, and the conv biases are not zero).
ModelWeights perturbed_weights(const model::ModelConfig& cfg, std::uint32_t seed) {
  ModelWeights w = fresh_weights(cfg, true, 0.15, seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  test_util::perturb_weights(w, cfg, rng, n);
  for (auto& b : w.router_bias)
    for (auto& x : b) x = 0.002f * n(rng);
  return w;
}

// Logits [B, T, V] decoded one position at a time from an empty cache (after a prefill of the
// first `prefix` positions when prefix > 0).
std::vector<float> decode_all(InferenceModel& m, const std::vector<std::uint32_t>& tokens, int B, int T, int prefix) {
  const std::int64_t V = m.config().vocab_size;
  Cache c = m.make_cache(B, T);
  std::vector<float> out(static_cast<std::size_t>(B * T * V)), logits;
  int t = 0;
  if (prefix > 0) {
    std::vector<std::uint32_t> head;
    for (int b = 0; b < B; ++b) head.insert(head.end(), tokens.begin() + b * T, tokens.begin() + b * T + prefix);
    m.prefill(head.data(), prefix, c, logits, /*all_positions=*/true);
    for (int b = 0; b < B; ++b)
      std::copy(logits.begin() + b * prefix * V, logits.begin() + (b + 1) * prefix * V, out.begin() + b * T * V);
    t = prefix;
  }
  for (; t < T; ++t) {
    std::vector<std::uint32_t> step(B);
    for (int b = 0; b < B; ++b) step[b] = tokens[b * T + t];
    m.decode(step.data(), c, logits);
    EXPECT_EQ(c.length, t + 1);
    for (int b = 0; b < B; ++b) std::copy(logits.begin() + b * V, logits.begin() + (b + 1) * V, out.begin() + (b * T + t) * V);
  }
  return out;
}

// The test of the brief: prefill logits == step-by-step decode logits == the training model.
void check_model(const model::ModelConfig& cfg, std::uint32_t seed) {
  const int B = 2, T = 11;
  const std::int64_t V = cfg.vocab_size;
  const ModelWeights w = perturbed_weights(cfg, seed);
  InferenceModel m(w);
  const auto tokens = random_tokens(B * T, V, seed + 7);

  std::vector<float> full;
  Cache c = m.make_cache(B, T);
  m.prefill(tokens.data(), T, c, full, /*all_positions=*/true);
  ASSERT_EQ(full.size(), std::size_t(B * T * V));
  const double scale = max_abs(full);
  ASSERT_GT(scale, 0.5) << "logits too small to make the tolerance meaningful";
  const double tol = 1e-4 * scale;

  for (int prefix : {0, 1, 4}) {
    const auto inc = decode_all(m, tokens, B, T, prefix);
    double worst = 0;
    for (std::size_t i = 0; i < full.size(); ++i) worst = std::max(worst, double(std::fabs(full[i] - inc[i])));
    EXPECT_LT(worst, tol) << cfg.name << ": prefill of " << prefix << " then decode; logit scale " << scale;
  }

  // The last-position logits of a prefill are its full logits' last rows (up to the LM head's
  // GEMM rounding on another row count).
  std::vector<float> last;
  Cache c2 = m.make_cache(B, T);
  m.prefill(tokens.data(), T, c2, last, /*all_positions=*/false);
  ASSERT_EQ(last.size(), std::size_t(B * V));
  for (int b = 0; b < B; ++b)
    for (std::int64_t v = 0; v < V; ++v) EXPECT_NEAR(last[b * V + v], full[(b * T + T - 1) * V + v], tol);

  // Reference: the training model's cross-entropy at each position for two targets gives
  // lse_t - z_t[target]; the prefill's logits must give the same numbers.
  train::ModelOptions mo;
  mo.micro_batch = B;
  mo.seq_length = T;
  mo.precise_loss = true;  // double CE from the fp32 final hidden states
  mo.aux_loss_weight = 0;
  mo.z_loss_weight = 0;
  train::MoeTransformer ref(cfg, mo, parallel::Mesh());
  std::copy(w.params.begin(), w.params.end(), ref.params());
  for (std::size_t i = 0; i < w.router_bias.size(); ++i) ref.router_bias(static_cast<int>(i)) = w.router_bias[i];
  std::mt19937 rng(seed + 11);
  double worst = 0;
  for (int n = 0; n < B * T; ++n)
    for (int rep = 0; rep < 2; ++rep) {
      const int target = static_cast<int>(rng() % V);
      std::vector<std::int32_t> targets(static_cast<std::size_t>(B * T), -1);
      targets[n] = target;
      const double ce_ref = ref.forward(tokens.data(), targets.data()).ce;
      const float* z = full.data() + n * V;
      double mx = -1e300, se = 0;
      for (std::int64_t v = 0; v < V; ++v) mx = std::max(mx, double(z[v]));
      for (std::int64_t v = 0; v < V; ++v) se += std::exp(double(z[v]) - mx);
      const double ce = mx + std::log(se) - z[target];
      worst = std::max(worst, std::fabs(ce - ce_ref));
    }
  EXPECT_LT(worst, tol) << cfg.name << ": prefill vs MoeTransformer cross-entropy";
  // The routing exercised every class in some MoE layer (every expert, and the skip class
  // where there is one).
  std::vector<std::int64_t> total;
  for (std::size_t i = 0; i < ref.moe_layers().size(); ++i) {
    const auto& load = ref.load(static_cast<int>(i));
    total.resize(load.size(), 0);
    for (std::size_t e = 0; e < load.size(); ++e) total[e] += load[e];
  }
  for (std::size_t e = 0; e < total.size(); ++e) EXPECT_GT(total[e], 0) << cfg.name << ": class " << e;
}

TEST(Generate, GqaDecodeMatchesPrefillAndTrainingModel) { check_model(gqa_config(2), 3); }
TEST(Generate, MhaDecodeMatchesPrefillAndTrainingModel) { check_model(gqa_config(4), 5); }
TEST(Generate, Zaya1DecodeMatchesPrefillAndTrainingModel) { check_model(zaya_config(2, 2), 7); }
// Wider convs: states of more than one token (W0 - 1 = 2, W1 - 1 = 3).
TEST(Generate, CcaWiderConvStates) { check_model(zaya_config(3, 4), 9); }

// Linear attention decodes from its memory state (constant size per sequence): every layer
// linear with RetNet decay and elu+1 features, chunk 4 < T = 11; and a hybrid of linear and
// softmax layers with the identity feature map and no decay.
model::ModelConfig linear_config(std::vector<model::AttentionKind> pattern, const char* feature, const char* decay) {
  model::ModelConfig m = gqa_config(2);
  m.name = "gen-linear";
  m.layer_attention = std::move(pattern);
  m.linear_chunk = 4;
  m.linear_feature = feature;
  m.linear_decay = decay;
  return m;
}
TEST(Generate, LinearDecodeMatchesPrefillAndTrainingModel) {
  check_model(linear_config({model::AttentionKind::kLinear}, "elu1", "retnet"), 41);
}
TEST(Generate, HybridDecodeMatchesPrefillAndTrainingModel) {
  check_model(linear_config({model::AttentionKind::kLinear, model::AttentionKind::kLinear, model::AttentionKind::kGqa},
                            "identity", "none"),
              43);
}

// Sliding-window layers (window 3 < T = 11, their own RoPE): decode attends to the last 3 cached
// positions and must give the prefill's logits, and the prefill the training model's.
TEST(Generate, GqaSlidingDecodeMatchesPrefillAndTrainingModel) {
  check_model(test_util::with_sliding(gqa_config(2), 3), 21);
}
TEST(Generate, Zaya1SlidingDecodeMatchesPrefillAndTrainingModel) {
  check_model(test_util::with_sliding(zaya_config(3, 4), 3), 31);
}

// The window is live end to end: with the model's own RoPE in the sliding layers, positions
// before the window fills (t < W) give the full-attention model's logits to float rounding,
// later positions differ; decode over the window agrees with both. Not bit for bit: where later
// positions route to other experts, each expert's GEMM runs on other rows, and OpenBLAS's kernels
// for some CPUs (AVX-512 on AMD EPYC) round a row differently with the row count (7e-7 seen).
TEST(Generate, SlidingWindowChangesOnlyPositionsPastTheWindow) {
  const int B = 2, T = 9, W = 4;
  for (const model::ModelConfig& full_cfg : {gqa_config(2), zaya_config(2, 2)}) {
    model::ModelConfig cfg = full_cfg;
    cfg.layer_sliding = {true};
    cfg.sliding_window = W;
    const ModelWeights w = perturbed_weights(full_cfg, 25);
    ModelWeights ws = w;
    ws.config = cfg;
    InferenceModel full(w), sliding(ws);
    const std::int64_t V = cfg.vocab_size;
    const auto tokens = random_tokens(B * T, V, 26);
    std::vector<float> zf, zs;
    Cache cf = full.make_cache(B, T), cs = sliding.make_cache(B, T);
    full.prefill(tokens.data(), T, cf, zf, /*all_positions=*/true);
    sliding.prefill(tokens.data(), T, cs, zs, /*all_positions=*/true);
    const double rounding = 1e-6 * max_abs(zf);
    ASSERT_LT(rounding, 2e-5) << cfg.name << ": rounding must stay far below a window's effect";
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t) {
        double diff = 0;
        for (std::int64_t v = 0; v < V; ++v) {
          const std::size_t i = static_cast<std::size_t>((b * T + t) * V + v);
          diff = std::max(diff, double(std::fabs(zs[i] - zf[i])));
        }
        if (t < W)
          EXPECT_LE(diff, rounding) << cfg.name << " position " << t << " sees no more than its window";
        else
          EXPECT_GT(diff, 1e-4) << cfg.name << " position " << t << ": the window was ignored";
      }
    const auto inc = decode_all(sliding, tokens, B, T, 0);
    double worst = 0;
    for (std::size_t i = 0; i < zs.size(); ++i) worst = std::max(worst, double(std::fabs(zs[i] - inc[i])));
    EXPECT_LT(worst, 1e-4 * max_abs(zs)) << cfg.name << ": decode over the window vs prefill";
  }
}

TEST(Generate, CacheSizes) {
  const model::ModelConfig g = gqa_config(2), z = zaya_config(2, 2);
  InferenceModel mg(fresh_weights(g, true, 0.02, 1)), mz(fresh_weights(z, true, 0.02, 1));
  Cache cg = mg.make_cache(3, 10), cz = mz.make_cache(3, 10);
  std::vector<float> logits;
  std::vector<std::uint32_t> tok(3 * 4, 1);
  mg.prefill(tok.data(), 4, cg, logits, false);
  mz.prefill(tok.data(), 4, cz, logits, false);
  const std::int64_t kv = 2 * 8;  // kv_heads * head_dim
  EXPECT_EQ(cg.bytes_per_sequence(), std::int64_t(sizeof(float)) * g.layers * 4 * 2 * kv);
  // CCA: the same k/v rows plus a fixed state: (W0-1) + (W1-1) rows of C channels and half a value row.
  const std::int64_t C = (4 + 2) * 8;
  EXPECT_EQ(cz.bytes_per_sequence(), std::int64_t(sizeof(float)) * z.layers * (4 * 2 * kv + C + C + kv / 2));
  // Linear attention: a d x d state per kv head, whatever the length.
  const model::ModelConfig l = linear_config({model::AttentionKind::kLinear}, "identity", "none");
  InferenceModel ml(fresh_weights(l, true, 0.02, 1));
  Cache cl = ml.make_cache(3, 10);
  ml.prefill(tok.data(), 4, cl, logits, false);
  EXPECT_EQ(cl.bytes_per_sequence(), std::int64_t(sizeof(float)) * l.layers * 2 * 8 * 8);
  EXPECT_THROW(mg.make_cache(1, 65), UsageError);  // beyond max_seq_len
  Cache full = mg.make_cache(1, 2);
  mg.prefill(tok.data(), 2, full, logits, false);
  EXPECT_THROW(mg.decode(tok.data(), full, logits), Error);
}

TEST(Generate, SamplerGreedyTopKAndSeeds) {
  std::vector<float> logits{0.1f, 2.0f, -1.f, 1.9f, 5.0f};
  Sampler greedy({0.0, 0, 1}, 0);
  EXPECT_EQ(greedy.next(logits.data(), 5), 4u);
  EXPECT_EQ(greedy.next(logits.data(), 4), 1u);  // ids >= allowed are never chosen
  Sampler top1({1.0, 1, 1}, 0);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(top1.next(logits.data(), 4), 1u);
  // top-2 at a high temperature draws both candidates, never a third.
  Sampler top2({100.0, 2, 3}, 0);
  int seen1 = 0, seen3 = 0;
  for (int i = 0; i < 200; ++i) {
    const auto t = top2.next(logits.data(), 4);
    ASSERT_TRUE(t == 1 || t == 3) << t;
    (t == 1 ? seen1 : seen3)++;
  }
  EXPECT_GT(seen1, 50);
  EXPECT_GT(seen3, 50);
  // Same seed and sequence: same draws; another sequence: another stream.
  Sampler a({1.0, 0, 42}, 0), b({1.0, 0, 42}, 0), c({1.0, 0, 42}, 1);
  std::vector<std::uint32_t> da, db, dc;
  for (int i = 0; i < 50; ++i) da.push_back(a.next(logits.data(), 5)), db.push_back(b.next(logits.data(), 5)),
                               dc.push_back(c.next(logits.data(), 5));
  EXPECT_EQ(da, db);
  EXPECT_NE(da, dc);
}

TEST(Generate, GreedyLoopMatchesArgmaxOfFullForward) {
  // generate()'s greedy tokens: each is the argmax of a full prefill of everything before it.
  const model::ModelConfig cfg = zaya_config(2, 2);
  InferenceModel m(perturbed_weights(cfg, 13));
  const std::vector<std::uint32_t> prompt{3, 5, 7};
  GenerateOptions o;
  o.batch = 3;
  o.max_new_tokens = 6;
  const GenerateResult r = generate(m, prompt, o);
  ASSERT_EQ(r.generated.size(), 3u);
  ASSERT_EQ(r.generated[0].size(), 6u);
  EXPECT_EQ(r.step_seconds.size(), 5u);
  EXPECT_EQ(r.generated[1], r.generated[0]);  // greedy: every row the same
  EXPECT_EQ(r.generated[2], r.generated[0]);
  std::vector<std::uint32_t> seq = prompt;
  for (std::size_t i = 0; i < 6; ++i) {
    Cache c = m.make_cache(1, static_cast<int>(seq.size()));
    std::vector<float> logits;
    m.prefill(seq.data(), static_cast<int>(seq.size()), c, logits, false);
    const auto best = std::max_element(logits.begin(), logits.end()) - logits.begin();
    EXPECT_EQ(r.generated[0][i], static_cast<std::uint32_t>(best)) << "token " << i;
    seq.push_back(r.generated[0][i]);
  }
  // EOS stops a sequence (here every sequence: greedy rows are identical) with the EOS kept.
  o.eos = r.generated[0][2];
  const std::size_t first = std::find(r.generated[0].begin(), r.generated[0].end(), *o.eos) - r.generated[0].begin();
  const GenerateResult s = generate(m, prompt, o);
  EXPECT_EQ(s.generated[0].size(), first + 1);
  EXPECT_EQ(s.step_seconds.size(), first);
}


// A model whose weights went NaN (damaged or diverged) must stop with one line, not emit the
// token a NaN comparison happens to leave (greedy: id 0; sampling: whatever sorted first).
TEST(Generate, NonFiniteLogitsAreAnErrorNamingTheStep) {
  const model::ModelConfig cfg = gqa_config(2);
  ModelWeights w = fresh_weights(cfg, true, 0.02, 1);
  for (const auto& p : model::param_layout(cfg).params)
    if (p.name == "final_norm.weight") w.params[p.offset] = std::numeric_limits<float>::quiet_NaN();
  InferenceModel m(std::move(w));
  GenerateOptions o;
  o.max_new_tokens = 3;
  for (double temperature : {0.0, 0.8}) {
    o.sampling.temperature = temperature;
    try {
      generate(m, {1, 2, 3}, o);
      FAIL() << "generated from NaN logits at temperature " << temperature;
    } catch (const Error& e) {
      EXPECT_STREQ(e.what(), "generate: logits are not finite at step 0: the model's weights are damaged or diverged");
    }
  }
  std::vector<float> logits{0.1f, std::numeric_limits<float>::infinity(), 0.3f};
  EXPECT_EQ(Sampler({0.0, 0, 1}, 0).next(logits.data(), 3), kNonFiniteLogits);
  EXPECT_EQ(Sampler({1.0, 2, 1}, 0).next(logits.data(), 3), kNonFiniteLogits);
  EXPECT_EQ(Sampler({0.0, 0, 1}, 0).next(logits.data(), 1), 0u);  // only eligible ids are checked
}

TEST(Generate, NonFiniteTemperatureIsRefused) {
  EXPECT_THROW(Sampler({std::numeric_limits<double>::quiet_NaN(), 0, 1}, 0), UsageError);
  EXPECT_THROW(Sampler({std::numeric_limits<double>::infinity(), 0, 1}, 0), UsageError);
  EXPECT_THROW(Sampler({-1.0, 0, 1}, 0), UsageError);
}

// Without a max_seq_len nothing bounded prompt + new tokens: T + max_new_tokens overflowed an int
// and the error spoke of negative positions.
TEST(Generate, PositionsBeyondAnIntAreAUsageError) {
  model::ModelConfig cfg = gqa_config(2);
  cfg.max_seq_len = 0;
  InferenceModel m(fresh_weights(cfg, true, 0.02, 1));
  GenerateOptions o;
  o.max_new_tokens = std::numeric_limits<int>::max();
  try {
    generate(m, {1, 2, 3}, o);
    FAIL() << "accepted 2^31 + 1 positions";
  } catch (const UsageError& e) {
    EXPECT_STREQ(e.what(), "generate: prompt + new tokens = 2147483649 positions, more than a cache holds (2147483647)");
  }
}

}  // namespace
}  // namespace keel::generate
