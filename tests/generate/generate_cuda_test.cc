// The GPU decoder (generate/cuda_decoder.h) against the CPU reference decoder (generate.h) on
// tiny random models of every kind the CPU path supports: gqa and mha with dense and
// linear-router top-2 MoE layers, ZAYA1 (CCA with conv widths 2/2 and 3/4, MLP router with EDA
// and the skip class, residual scaling, tied head), CCA without residual scaling under a
// linear router with head_dim 128, and sliding-window layers. Skips without a GPU.
//
// bf16 weights and activations on the GPU against fp32 on the CPU: logits agree to bf16
// rounding (norm-relative ~1e-2), not to fp32. Discrete routing would turn a near-tie into a
// different expert for one token (a large, legitimate difference), so the strict checks use
// router biases of +2 on the classes each MoE layer must pick (probabilities are in [0, 1], so
// the choice is fixed; the gates and every op stay live), with the skip class chosen in one
// ZAYA1 layer (the EDA chain runs through it); a second set of checks with spread-out routing
// (every class gets tokens) is statistical: most rows must agree.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "common/error.h"
#include "generate/cuda_decoder.h"
#include "generate/generate.h"
#include "train/model.h"

#include "generate_test_util.h"

#define KEEL_REQUIRE_GPU_DECODER()                                                  \
  do {                                                                              \
    if (!::keel::generate::cuda_decoder_available()) GTEST_SKIP() << "no CUDA device visible"; \
  } while (0)

namespace keel::generate {
namespace {

using test_util::max_abs;
using test_util::random_tokens;

model::ModelConfig gqa_config(int kv_heads) {
  model::ModelConfig m;
  m.name = "gen-gqa-gpu";
  m.vocab_size = 61;  // odd: the LM head's rows are not 16-byte aligned
  m.hidden = 128;
  m.layers = 3;
  m.attention = kv_heads == 4 ? model::AttentionKind::kMha : model::AttentionKind::kGqa;
  m.heads = 4;
  m.kv_heads = kv_heads;
  m.head_dim = 64;
  m.ffn_hidden = 96;
  m.experts = 4;
  m.top_k = 2;
  m.expert_hidden = 64;
  m.first_dense_layers = 1;
  m.tied_embeddings = false;
  m.rope_fraction = 1.0;
  m.max_seq_len = 64;
  return m;
}

model::ModelConfig zaya_config(int conv0, int conv1) {
  model::ModelConfig m;
  m.name = "gen-zaya-gpu";
  m.vocab_size = 72;
  m.hidden = 128;
  m.layers = 3;
  m.attention = model::AttentionKind::kCca;
  m.heads = 4;
  m.kv_heads = 2;
  m.head_dim = 64;
  m.cca_q_dim = 256, m.cca_k_dim = 128, m.cca_v_dim = 128;
  m.cca_conv_width = conv0;
  m.cca_group_conv_width = conv1;
  m.experts = 3;
  m.top_k = 1;
  m.expert_hidden = 64;
  m.router_hidden = 64;
  m.router_mlp_layers = 3;
  m.router_skip_expert = true;
  m.tied_embeddings = true;
  m.residual_scaling = true;
  m.rope_fraction = 0.5;
  m.max_seq_len = 64;
  return m;
}

// CCA under plain residual adds, a dense first layer and linear-router MoE; head_dim 128.
model::ModelConfig cca_plain_config() {
  model::ModelConfig m;
  m.name = "gen-cca-plain-gpu";
  m.vocab_size = 64;
  m.hidden = 128;
  m.layers = 3;
  m.attention = model::AttentionKind::kCca;
  m.heads = 2;
  m.kv_heads = 1;
  m.head_dim = 128;
  m.cca_q_dim = 256, m.cca_k_dim = 128, m.cca_v_dim = 128;
  m.cca_conv_width = 2;
  m.cca_group_conv_width = 3;
  m.ffn_hidden = 96;
  m.experts = 4;
  m.top_k = 2;
  m.expert_hidden = 64;
  m.first_dense_layers = 1;
  m.tied_embeddings = true;
  m.rope_fraction = 1.0;
  m.max_seq_len = 64;
  return m;
}

// Fresh weights with every 1-D parameter perturbed (as generate_test.cc) and router biases that
// either fix each MoE layer's choice (+2 on its classes) or spread tokens over every class.
ModelWeights test_weights(const model::ModelConfig& cfg, std::uint32_t seed, bool fixed_routing) {
  ModelWeights w = fresh_weights(cfg, true, 0.1, seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  test_util::perturb_weights(w, cfg, rng, n);
  const int E = cfg.experts, classes = static_cast<int>(w.router_bias.empty() ? 0 : w.router_bias[0].size());
  for (std::size_t m = 0; m < w.router_bias.size(); ++m) {
    auto& b = w.router_bias[m];
    for (auto& x : b) x = fixed_routing ? 0.f : 0.002f * n(rng);
    if (!fixed_routing) continue;
    if (cfg.router_hidden > 0) {
      // One class per stage: the skip class (E) first, then experts E-1, E-2, ...
      b[static_cast<std::size_t>((E - static_cast<int>(m) + classes) % classes)] = 2.f;
    } else {
      for (int j = 0; j < cfg.top_k; ++j) b[static_cast<std::size_t>((static_cast<int>(m) + j) % E)] = 2.f;
    }
  }
  return w;
}

double norm_rel(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double d = double(got[i]) - want[i];
    num += std::isfinite(got[i]) ? d * d : 1e30;
    den += double(want[i]) * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// Norm-relative error of each row of V logits, sorted ascending.
std::vector<double> row_errors(const std::vector<float>& got, const std::vector<float>& want, std::int64_t V) {
  std::vector<double> e;
  for (std::size_t r = 0; r * V < want.size(); ++r) {
    const std::vector<float> g(got.begin() + r * V, got.begin() + (r + 1) * V);
    const std::vector<float> w(want.begin() + r * V, want.begin() + (r + 1) * V);
    e.push_back(norm_rel(g, w));
  }
  std::sort(e.begin(), e.end());
  return e;
}

// Logits [B, T, V] decoded one position at a time (after a prefill of `prefix` positions).
std::vector<float> decode_all(Decoder& d, const std::vector<std::uint32_t>& tokens, int B, int T, int prefix) {
  const std::int64_t V = d.config().vocab_size;
  d.start(B, T);
  std::vector<float> out(static_cast<std::size_t>(B * T * V)), logits;
  int t = 0;
  if (prefix > 0) {
    std::vector<std::uint32_t> head;
    for (int b = 0; b < B; ++b) head.insert(head.end(), tokens.begin() + b * T, tokens.begin() + b * T + prefix);
    d.prefill(head.data(), prefix, logits, /*all_positions=*/true);
    for (int b = 0; b < B; ++b)
      std::copy(logits.begin() + b * prefix * V, logits.begin() + (b + 1) * prefix * V, out.begin() + b * T * V);
    t = prefix;
  }
  for (; t < T; ++t) {
    std::vector<std::uint32_t> step(B);
    for (int b = 0; b < B; ++b) step[b] = tokens[b * T + t];
    d.decode(step.data(), logits);
    EXPECT_EQ(d.length(), t + 1);
    for (int b = 0; b < B; ++b) std::copy(logits.begin() + b * V, logits.begin() + (b + 1) * V, out.begin() + (b * T + t) * V);
  }
  return out;
}

std::vector<float> prefill_all(Decoder& d, const std::vector<std::uint32_t>& tokens, int B, int T) {
  std::vector<float> logits;
  d.start(B, T);
  d.prefill(tokens.data(), T, logits, /*all_positions=*/true);
  return logits;
}

void report(const char* what, const std::vector<float>& got, const std::vector<float>& want, std::int64_t V) {
  const auto rows = row_errors(got, want, V);
  std::printf("    %-34s norm-relative %.2e, rows: median %.2e, max %.2e\n", what, norm_rel(got, want),
              rows[rows.size() / 2], rows.back());
}

// Fixed routing: every row must agree to bf16 rounding.
void check_strict(const model::ModelConfig& cfg, std::uint32_t seed) {
  const int B = 2, T = 11;
  const std::int64_t V = cfg.vocab_size;
  const ModelWeights w = test_weights(cfg, seed, /*fixed_routing=*/true);
  const auto tokens = random_tokens(B * T, V, seed + 7);
  InferenceModel cpu_model(w);
  CpuDecoder cpu(cpu_model);
  const auto ref = prefill_all(cpu, tokens, B, T);
  const double scale = max_abs(ref);
  ASSERT_GT(scale, 0.5) << "logits too small to make the tolerance meaningful";
  const auto gpu = make_cuda_decoder(w);
  EXPECT_NE(gpu->device().find("cuda"), std::string::npos);
  const auto full = prefill_all(*gpu, tokens, B, T);
  ASSERT_EQ(full.size(), ref.size());
  std::printf("  %s (logit scale %.2f)\n", cfg.name.c_str(), scale);
  report("gpu prefill vs cpu", full, ref, V);
  EXPECT_LT(norm_rel(full, ref), 2e-2) << cfg.name;
  EXPECT_LT(row_errors(full, ref, V).back(), 3e-2) << cfg.name;

  for (int prefix : {0, 1, 4}) {
    const auto inc = decode_all(*gpu, tokens, B, T, prefix);
    const std::string what = "gpu prefill " + std::to_string(prefix) + " + decode vs gpu prefill";
    report(what.c_str(), inc, full, V);
    EXPECT_LT(norm_rel(inc, full), 1.5e-2) << cfg.name << " prefix " << prefix;
    EXPECT_LT(row_errors(inc, full, V).back(), 2.5e-2) << cfg.name << " prefix " << prefix;
    EXPECT_LT(norm_rel(inc, ref), 2e-2) << cfg.name << " prefix " << prefix << " vs cpu";
    EXPECT_LT(row_errors(inc, ref, V).back(), 3e-2) << cfg.name << " prefix " << prefix << " vs cpu";
  }

  // The last-position logits of a prefill are its full logits' last rows.
  std::vector<float> last;
  gpu->start(B, T);
  gpu->prefill(tokens.data(), T, last, /*all_positions=*/false);
  ASSERT_EQ(last.size(), std::size_t(B * V));
  for (int b = 0; b < B; ++b)
    for (std::int64_t v = 0; v < V; ++v) EXPECT_NEAR(last[b * V + v], full[(b * T + T - 1) * V + v], 2e-3 * scale);
  // bf16 caches: k/v rows of every layer plus CCA's fixed state, half the CPU's fp32 bytes; a
  // linear layer's state is fp32 on both.
  std::int64_t state = 0;
  for (int l = 0; l < cfg.layers; ++l)
    if (model::layer_attention_kind(cfg, l) == model::AttentionKind::kLinear)
      state += std::int64_t(sizeof(float)) * cfg.kv_heads * cfg.head_dim * cfg.head_dim;
  EXPECT_EQ(gpu->cache_bytes_per_sequence() * 2 - state, cpu.cache_bytes_per_sequence()) << cfg.name;
}

// Spread-out routing: a near-tie may send a token elsewhere on one side, so most rows (not all)
// must agree.
void check_statistical(const model::ModelConfig& cfg, std::uint32_t seed) {
  const int B = 2, T = 11;
  const std::int64_t V = cfg.vocab_size;
  const ModelWeights w = test_weights(cfg, seed, /*fixed_routing=*/false);
  const auto tokens = random_tokens(B * T, V, seed + 7);
  InferenceModel cpu_model(w);
  CpuDecoder cpu(cpu_model);
  const auto ref = prefill_all(cpu, tokens, B, T);
  const auto gpu = make_cuda_decoder(w);
  const auto full = prefill_all(*gpu, tokens, B, T);
  const auto inc = decode_all(*gpu, tokens, B, T, 3);
  std::printf("  %s, spread-out routing\n", cfg.name.c_str());
  report("gpu prefill vs cpu", full, ref, V);
  report("gpu prefill 3 + decode vs gpu prefill", inc, full, V);
  for (const auto* got : {&full, &inc}) {
    const auto rows = row_errors(*got, ref, V);
    EXPECT_LT(rows[rows.size() / 2], 2e-2) << cfg.name;
    EXPECT_LT(rows[rows.size() * 3 / 4], 3e-2) << cfg.name;
  }
}

std::int64_t argmax(const float* z, std::int64_t n) {
  std::int64_t best = 0;
  for (std::int64_t v = 1; v < n; ++v)
    if (z[v] > z[best]) best = v;
  return best;
}

float margin(const float* z, std::int64_t n) {
  const std::int64_t a = argmax(z, n);
  float second = -1e30f;
  for (std::int64_t v = 0; v < n; ++v)
    if (v != a) second = std::max(second, z[v]);
  return z[a] - second;
}

// Greedy decoding: exact token equality with the CPU cannot be promised (bf16 moves logits by
// ~1% of their scale, enough to swap two nearly equal candidates), so the checks are: top-1
// agreement wherever the CPU's top-1 leads by more than 5% of the logit scale, teacher-forced
// along the CPU's tokens; and the free-running GPU tokens (picked on the device) equal the
// CPU's until a step where the CPU's lead was below that margin (the same prefix so far, so
// the teacher-forced margins apply).
void check_greedy(const model::ModelConfig& cfg, std::uint32_t seed) {
  const std::int64_t V = cfg.vocab_size;
  const int steps = 16;
  const ModelWeights w = test_weights(cfg, seed, /*fixed_routing=*/true);
  const auto prompt = random_tokens(5, V, seed + 3);
  InferenceModel cpu_model(w);
  CpuDecoder cpu(cpu_model);
  const auto gpu = make_cuda_decoder(w);
  GenerateOptions o;
  o.batch = 2;
  o.max_new_tokens = steps;
  const GenerateResult rc = generate(cpu, prompt, o);
  const GenerateResult rg = generate(*gpu, prompt, o);
  ASSERT_EQ(rg.generated.size(), 2u);
  ASSERT_EQ(rg.generated[0].size(), std::size_t(steps));
  ASSERT_EQ(rg.step_seconds.size(), std::size_t(steps - 1));

  const int T = static_cast<int>(prompt.size());
  cpu.start(1, T + steps);
  gpu->start(1, T + steps);
  std::vector<float> lc, lg;
  cpu.prefill(prompt.data(), T, lc, false);
  gpu->prefill(prompt.data(), T, lg, false);
  const double thr = 0.05 * max_abs(lc);
  std::vector<char> clear(steps, 0);
  int checked = 0;
  for (int i = 0; i < steps; ++i) {
    const std::uint32_t tok = rc.generated[0][static_cast<std::size_t>(i)];
    ASSERT_EQ(argmax(lc.data(), V), std::int64_t(tok));
    if (margin(lc.data(), V) > thr) {
      EXPECT_EQ(argmax(lg.data(), V), std::int64_t(tok)) << cfg.name << " step " << i;
      clear[i] = 1;
      ++checked;
    }
    if (i + 1 < steps) {
      cpu.decode(&tok, lc);
      gpu->decode(&tok, lg);
    }
  }
  int same = 0;
  while (same < steps && rg.generated[0][static_cast<std::size_t>(same)] == rc.generated[0][static_cast<std::size_t>(same)])
    ++same;
  std::printf("  %s: top-1 checked at %d of %d steps; free-running tokens equal for %d\n", cfg.name.c_str(), checked,
              steps, same);
  EXPECT_GE(checked, steps / 4) << cfg.name << ": too few steps with a clear top-1";
  if (same < steps) EXPECT_FALSE(clear[same]) << cfg.name << ": GPU and CPU part at step " << same << " where the CPU's lead was clear";

  // The device argmax is the host's over the same logits, with and without a vocabulary limit.
  for (std::int64_t allowed : {V, V - 7}) {
    std::vector<std::uint32_t> two;
    for (int b = 0; b < 2; ++b) two.insert(two.end(), prompt.begin(), prompt.end());
    std::vector<float> logits;
    gpu->start(2, T + 1);
    gpu->prefill(two.data(), T, logits, false);
    const std::uint32_t step[2] = {3, 4};
    std::uint32_t want[4], got[4];
    for (int b = 0; b < 2; ++b) want[b] = static_cast<std::uint32_t>(argmax(logits.data() + b * V, allowed));
    gpu->decode(step, logits);
    for (int b = 0; b < 2; ++b) want[2 + b] = static_cast<std::uint32_t>(argmax(logits.data() + b * V, allowed));
    gpu->start(2, T + 1);
    gpu->prefill_greedy(two.data(), T, allowed, got);
    gpu->decode_greedy(step, allowed, got + 2);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(got[i], want[i]) << cfg.name << " allowed " << allowed << " pick " << i;
  }
}

TEST(GenerateCuda, GqaMatchesCpuAndPrefill) {
  KEEL_REQUIRE_GPU_DECODER();
  check_strict(gqa_config(2), 3);
}
TEST(GenerateCuda, MhaMatchesCpuAndPrefill) {
  KEEL_REQUIRE_GPU_DECODER();
  check_strict(gqa_config(4), 5);
}
TEST(GenerateCuda, Zaya1MatchesCpuAndPrefill) {
  KEEL_REQUIRE_GPU_DECODER();
  check_strict(zaya_config(2, 2), 7);
}
TEST(GenerateCuda, Zaya1WideConvsMatchCpuAndPrefill) {
  KEEL_REQUIRE_GPU_DECODER();
  check_strict(zaya_config(3, 4), 9);
}
TEST(GenerateCuda, CcaPlainResidualHeadDim128MatchesCpuAndPrefill) {
  KEEL_REQUIRE_GPU_DECODER();
  check_strict(cca_plain_config(), 11);
}
// Linear attention: the GPU prefill (the chunk kernels) and decode from the memory state
// (ops/cuda/linear_attention.h's step) against the CPU reference; all layers linear with RetNet
// decay and elu+1 features, and a hybrid with a softmax layer.
TEST(GenerateCuda, LinearMatchesCpuAndPrefill) {
  KEEL_REQUIRE_GPU_DECODER();
  model::ModelConfig m = gqa_config(2);
  m.attention = model::AttentionKind::kLinear;
  m.linear_feature = "elu1";
  m.linear_decay = "retnet";
  check_strict(m, 31);
  m.layer_attention = {model::AttentionKind::kLinear, model::AttentionKind::kLinear, model::AttentionKind::kGqa};
  m.linear_feature = "identity";
  m.linear_decay = "none";
  check_strict(m, 33);
}
// Sliding-window layers (window 3 of T = 11, with their own RoPE): the GPU prefill (flash
// attention with a window) and decode over the last W cached positions against the CPU
// reference. The kernels' tile edges are tests/ops/cuda's (AttentionCuda.SlidingWindow).
TEST(GenerateCuda, SlidingMatchesCpuAndPrefill) {
  KEEL_REQUIRE_GPU_DECODER();
  check_strict(test_util::with_sliding(gqa_config(2), 3), 27);
  check_strict(test_util::with_sliding(zaya_config(3, 4), 3), 29);
}

TEST(GenerateCuda, SpreadRoutingMostlyAgrees) {
  KEEL_REQUIRE_GPU_DECODER();
  check_statistical(gqa_config(2), 13);
  check_statistical(zaya_config(2, 2), 15);
}
TEST(GenerateCuda, GreedyTopOneAgreesWithCpu) {
  KEEL_REQUIRE_GPU_DECODER();
  check_greedy(gqa_config(2), 17);
  check_greedy(zaya_config(2, 2), 19);
}

TEST(GenerateCuda, RejectsWhatTheGpuPathCannotRun) {
  KEEL_REQUIRE_GPU_DECODER();
  model::ModelConfig cfg = gqa_config(2);
  cfg.head_dim = 8;
  EXPECT_NE(cuda_decoder_unsupported(cfg), "");
  EXPECT_THROW(make_cuda_decoder(fresh_weights(cfg, true, 0.02, 1)), UsageError);
  const auto gpu = make_cuda_decoder(fresh_weights(gqa_config(2), true, 0.02, 1));
  EXPECT_THROW(gpu->start(1, 65), UsageError);  // max_seq_len 64
  gpu->start(1, 4);
  std::vector<float> logits;
  const std::uint32_t bad = 61;
  EXPECT_THROW(gpu->decode(&bad, logits), Error);
  const std::uint32_t toks[4] = {1, 2, 3, 4};
  gpu->prefill(toks, 4, logits, false);
  EXPECT_THROW(gpu->decode(toks, logits), Error);  // full
}


// The device argmax of a NaN row gives kNonFiniteLogits (a NaN never compares greater, so it
// would otherwise pick a token), and generate() turns it into one line naming the step.
TEST(GenerateCuda, NonFiniteLogitsAreAnError) {
  KEEL_REQUIRE_GPU_DECODER();
  const model::ModelConfig cfg = gqa_config(2);
  ModelWeights w = fresh_weights(cfg, true, 0.02, 1);
  for (const auto& p : model::param_layout(cfg).params)
    if (p.name == "final_norm.weight") w.params[p.offset] = std::numeric_limits<float>::quiet_NaN();
  const auto gpu = make_cuda_decoder(w);
  GenerateOptions o;
  o.max_new_tokens = 3;
  try {
    generate(*gpu, {1, 2, 3}, o);
    FAIL() << "generated from NaN logits";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "generate: logits are not finite at step 0: the model's weights are damaged or diverged");
  }
}

}  // namespace
}  // namespace keel::generate
