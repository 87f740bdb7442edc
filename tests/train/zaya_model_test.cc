// ZAYA1 layers in keel::train::MoeTransformer on CPU: CCA attention, the MLP router with EDA
// and the skip class, residual scaling. Whole-model finite-difference gradient checks (with and
// without the skip class), recompute = full against none, overfitting one batch, the layout.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "../ops/gradcheck.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "model/params.h"
#include "train/model.h"

#include "train_test_util.h"

namespace keel::train {
namespace {

// zaya1-tiny's structure at toy widths: every layer CCA + MoE with the MLP router.
model::ModelConfig zaya_config(bool skip, int layers = 2, int first_dense = 0) {
  model::ModelConfig m;
  m.name = "zaya-test";
  m.vocab_size = 23;
  m.hidden = 16;
  m.layers = layers;
  m.attention = model::AttentionKind::kCca;
  m.heads = 4;
  m.kv_heads = 2;
  m.head_dim = 4;
  m.cca_q_dim = 16, m.cca_k_dim = 8, m.cca_v_dim = 8, m.cca_conv_width = 2, m.cca_group_conv_width = 2;
  m.experts = 3;
  m.top_k = 1;
  m.expert_hidden = 12;
  m.ffn_hidden = first_dense > 0 ? 20 : 0;
  m.first_dense_layers = first_dense;
  m.router_hidden = 8;
  m.router_mlp_layers = 3;
  m.router_skip_expert = skip;
  m.tied_embeddings = true;
  m.residual_scaling = true;
  m.rope_fraction = 0.5;
  m.max_seq_len = 64;
  return m;
}

struct Batch {
  std::vector<std::uint32_t> tokens;
  std::vector<std::int32_t> targets;
};

Batch random_batch(int n, int vocab, std::uint32_t seed) {
  Batch b;
  std::mt19937 rng(seed);
  for (int i = 0; i < n; ++i) {
    b.tokens.push_back(static_cast<std::uint32_t>(rng() % vocab));
    b.targets.push_back(static_cast<std::int32_t>(rng() % vocab));
  }
  return b;
}

// Moves every 1-D parameter off its init (scales 1, biases 0, ...) so that swapped or dropped
// terms (e.g. s_h for s_r) change the result.
void perturb_vectors(MoeTransformer& m, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-0.3f, 0.3f);
  for (const auto& p : m.layout().params) {
    if (p.ndim() != 1) continue;
    float* d = m.params() + p.offset;
    for (std::int64_t i = 0; i < p.numel; ++i) d[i] += u(rng);
  }
}

void zaya_gradcheck(bool skip, double aux_weight = 0) {
  const auto cfg = zaya_config(skip);
  ModelOptions o;
  o.mlp_router_aux_weight = aux_weight;  // the MLP router's load-balancing loss (0: none, as ZAYA1)
  o.micro_batch = 2;
  o.seq_length = 6;
  o.init_std = 0.3;       // large weights: gradients well above the fp32 noise floor
  o.ce_chunk = 7;         // several vocabulary chunks
  o.precise_loss = true;  // the loss in double: fp32 rounding would dominate the differences
  o.bias_update_rate = 0.01;
  MoeTransformer model(cfg, o, parallel::Mesh());
  perturb_vectors(model, 5);
  // Sharper router logits: the choice then depends more on the token (every class gets used
  // on a small batch) and the top-1 margins are wider.
  for (const auto& p : model.layout().params)
    if (p.name.ends_with("router.out.weight"))
      for (std::int64_t i = 0; i < p.numel; ++i) model.params()[p.offset + i] *= 4.f;
  // A batch on which every class of every stage, skip included, is chosen (all paths checked)
  // and no finite-difference step flips a top-1 choice (the selection is piecewise constant:
  // a flip shows as a changed load vector, and the batch is then skipped).
  const std::size_t stages = model.moe_layers().size();
  auto loads = [&] {
    std::vector<std::vector<std::int64_t>> l;
    for (std::size_t m = 0; m < stages; ++m) l.push_back(model.load(static_cast<int>(m)));
    return l;
  };
  std::vector<std::vector<float>> biases(stages);
  for (std::uint32_t seed = 1;; ++seed) {
    ASSERT_LT(seed, 100u) << "no batch uses every class without selection flips";
    const Batch b = random_batch(o.micro_batch * o.seq_length, static_cast<int>(cfg.vocab_size), seed);
    // Balance the classes on this batch with the bias controller (the bias is not a
    // parameter: the gradients do not depend on how it was reached).
    for (auto& bias : biases) bias.assign(static_cast<std::size_t>(cfg.experts + (skip ? 1 : 0)), 0.f);
    for (int i = 0; i < 40; ++i) {
      for (std::size_t m = 0; m < stages; ++m) model.router_bias(static_cast<int>(m)) = biases[m];
      model.reset_load();
      model.forward(b.tokens.data(), b.targets.data());
      model.update_router_bias();
      for (std::size_t m = 0; m < stages; ++m) biases[m] = model.router_bias(static_cast<int>(m));
    }
    model.reset_load();
    model.zero_grads();
    model.forward(b.tokens.data(), b.targets.data());
    const auto base = loads();
    bool all_used = true;
    for (const auto& l : base) {
      EXPECT_EQ(l.size(), std::size_t(cfg.experts + (skip ? 1 : 0)));
      for (auto c : l) all_used &= c > 0;
    }
    if (!all_used) continue;
    const LossParts parts = model.forward(b.tokens.data(), b.targets.data());
    // the aux loss over all classes is reported either way (1 at a perfect balance), and is in
    // the total only with its weight
    EXPECT_GT(parts.aux, 0.5);
    EXPECT_NEAR(parts.total, parts.ce + aux_weight * parts.aux, 1e-6 * parts.total);
    model.backward();
    std::vector<float> grads(model.grads(), model.grads() + model.param_floats());
    bool flipped = false;
    auto loss = [&] {
      model.reset_load();
      const double l = model.forward(b.tokens.data(), b.targets.data()).total;
      flipped |= loads() != base;
      return l;
    };
    std::vector<test::GradResult> results;
    for (const auto& p : model.layout().params) {
      // The router's gradients are small (they act through the gate only): at h = 1e-3 the
      // fp32 forward's noise is up to ~1% of them (measured: the error scales as 1/h, so it is
      // noise, not truncation); h = 3e-3 divides it by 3 and rarely flips a choice.
      const double eps = p.name.find(".router.") != std::string::npos ? 3e-3 : 1e-3;
      results.push_back(test::check_grad(p.name, loss, model.params() + p.offset, grads.data() + p.offset, p.numel,
                                         eps, /*max_elems=*/60));
    }
    if (flipped) continue;
    double worst = 0;
    for (std::size_t i = 0; i < results.size(); ++i) {
      const auto& name = model.layout().params[i].name;
      EXPECT_LT(results[i].rel_err, test::kGradTol) << name;
      EXPECT_GT(results[i].ana_norm, 0.0) << name;
      worst = std::max(worst, results[i].rel_err);
    }
    std::printf("[gradcheck] zaya model (skip=%d, batch seed %u): %zu parameters, worst rel_err %.3e\n", skip ? 1 : 0,
                seed, model.layout().params.size(), worst);
    break;
  }
}

TEST(TrainZaya, WholeModelGradCheck) { zaya_gradcheck(false); }
TEST(TrainZaya, WholeModelGradCheckWithSkipClass) { zaya_gradcheck(true); }
// The MLP router's aux loss (router.aux_loss_weight; ZAYA1 trains without it), weighted large so
// its gradient through the router's softmax is well above the CE's in the check.
TEST(TrainZaya, WholeModelGradCheckWithAuxLoss) { zaya_gradcheck(true, 0.5); }

TEST(TrainZaya, LayoutNamesGroupsAndInit) {
  const auto cfg = zaya_config(true);
  const auto layout = model::param_layout(cfg);
  std::set<std::string> names;
  for (const auto& p : layout.params) names.insert(p.name);
  for (const char* n : {"layers.0.res_scale.attn.h_scale", "layers.0.attn.cca.w_qk", "layers.0.attn.cca.conv1.weight",
                        "layers.0.attn.cca.temp", "layers.1.res_scale.attn.r_bias", "layers.1.res_scale.mlp.h_bias",
                        "layers.0.moe.router.down.weight", "layers.1.moe.router.eda_scale", "layers.1.moe.router.out.weight",
                        "final_res_scale.r_scale"})
    EXPECT_TRUE(names.count(n)) << n;
  // Layer 0 scales the embedding only; the first MoE stage has no EDA.
  EXPECT_FALSE(names.count("layers.0.res_scale.attn.r_scale"));
  EXPECT_FALSE(names.count("layers.0.moe.router.eda_scale"));
  for (const auto& p : layout.params) {
    if (p.name.find("conv") != std::string::npos && p.ndim() >= 2) EXPECT_EQ(p.group, "convs") << p.name;
    if (p.ndim() == 1) EXPECT_EQ(p.group, "vectors") << p.name;
    if (p.name == "layers.0.moe.router.out.weight") EXPECT_EQ(p.shape, (std::vector<std::int64_t>{4, 8}));
  }
  ModelOptions o;
  o.micro_batch = 1;
  o.seq_length = 4;
  MoeTransformer m(cfg, o, parallel::Mesh());
  EXPECT_EQ(m.param("layers.0.attn.cca.conv0.bias")[0], 0.f);
  EXPECT_EQ(m.param("layers.1.res_scale.mlp.r_bias")[3], 0.f);
  EXPECT_EQ(m.param("layers.1.res_scale.mlp.r_scale")[3], 1.f);
  EXPECT_EQ(m.param("layers.0.attn.cca.temp")[1], 1.f);
  EXPECT_EQ(m.param("layers.1.moe.router.eda_scale")[0], 1.f);
  EXPECT_EQ(m.router_bias(0).size(), 4u);
  EXPECT_EQ(m.router_bias(0)[0], 0.f);
  EXPECT_EQ(m.router_bias(0)[3], -1.f);  // the skip class starts disfavoured
}

// The shipped ZAYA1-8B config is trainable structurally: its layout holds exactly keel size's
// parameters (neither has layer 0's residual pair nor the first MoE stage's EDA scale, which no
// computation would read), and no buffer is allocated.
TEST(TrainZaya, Zaya8bLayoutMatchesKeelSize) {
  const auto cfg = model::load_model_config(std::string(KEEL_SOURCE_DIR) + "/configs/zaya1-8b.yaml");
  ModelOptions o;
  o.micro_batch = 1;
  o.seq_length = 4096;
  validate_trainable(cfg, o);
  const auto layout = model::param_layout(cfg);
  std::int64_t n = 0;
  for (const auto& p : layout.params) n += p.numel;
  EXPECT_EQ(n, model::count_params(cfg).total);
  EXPECT_GT(model_flops_per_micro_batch(cfg, 1, 4096), 0.0);
  // Sliding layers count only their window's attention (model::attended_keys): half the layers
  // with window 1024 of 4096 save 12 * Hq * Dh * (T/2 - (W - W^2 / 2T)) per token and layer.
  model::ModelConfig sliding = cfg;
  sliding.layer_sliding = {false, true};
  sliding.sliding_window = 1024;
  const double saved = 12.0 * cfg.heads * cfg.head_dim * (2048 - (1024 - 1024.0 * 1024 / 8192)) * 4096 * cfg.layers / 2;
  EXPECT_NEAR(model_flops_per_micro_batch(cfg, 1, 4096) - model_flops_per_micro_batch(sliding, 1, 4096), saved,
              1e-9 * saved);
}

TEST(TrainZaya, RecomputeFullGivesIdenticalGradients) {
  // 3 layers, the first dense: the EDA chain skips the dense layer.
  const auto cfg = zaya_config(true, 3, 1);
  const Batch b = random_batch(2 * 8, 23, 11);
  auto run = [&](Recompute r, float* loss) {
    ModelOptions o;
    o.micro_batch = 2;
    o.seq_length = 8;
    o.recompute = r;
    o.init_std = 0.2;
    MoeTransformer m(cfg, o, parallel::Mesh());
    perturb_vectors(m, 3);
    for (int i = 0; i < 2; ++i) m.router_bias(i).back() = 0.02f;  // some tokens skip, some run an expert
    m.zero_grads();
    *loss = static_cast<float>(m.forward(b.tokens.data(), b.targets.data()).total);
    m.backward();
    m.forward(b.tokens.data(), b.targets.data());  // a second micro-batch accumulates
    m.backward(0.5f);
    for (int i = 0; i < 2; ++i) {
      const auto& l = m.load(i);
      EXPECT_GT(l.back(), 0) << "MoE layer " << i << ": some tokens skipped";
      EXPECT_GT(std::accumulate(l.begin(), l.end() - 1, std::int64_t{0}), 0) << "MoE layer " << i << ": some routed";
    }
    return std::vector<float>(m.grads(), m.grads() + m.param_floats());
  };
  float l0 = 0, l1 = 0;
  const auto g0 = run(Recompute::kNone, &l0);
  const auto g1 = run(Recompute::kFull, &l1);
  EXPECT_EQ(l0, l1);
  ASSERT_EQ(g0.size(), g1.size());
  EXPECT_EQ(0, std::memcmp(g0.data(), g1.data(), g0.size() * sizeof(float)));
}

// Two micro-batches' gradients are the sum of each one's alone (fresh models from the same
// init), per parameter, with residual scaling, EDA and the skip class: nothing of one backward's
// residual-stream gradient may leak into the next (rmsnorm adds into it; the final norm's
// backward starts from zeros). The CPU twin of CudaBackend.GradientsAreTheStepsOwnAndMicroBatchesSum.
TEST(TrainZaya, MicroBatchGradientsSum) {
  const auto cfg = zaya_config(true, 3, 1);
  const Batch a = random_batch(2 * 8, 23, 31), b = random_batch(2 * 8, 23, 32);
  ModelOptions o;
  o.micro_batch = 2;
  o.seq_length = 8;
  o.init_std = 0.2;
  auto grads_of = [&](const std::vector<const Batch*>& batches) {
    MoeTransformer m(cfg, o, parallel::Mesh());
    perturb_vectors(m, 3);
    for (int i = 0; i < 2; ++i) m.router_bias(i).back() = 0.02f;  // some tokens skip, some run an expert
    m.zero_grads();
    for (const auto* batch : batches) {
      m.forward(batch->tokens.data(), batch->targets.data());
      m.backward();
    }
    for (int i = 0; i < 2; ++i) {
      const auto& l = m.load(i);
      EXPECT_GT(l.back(), 0) << "MoE layer " << i << ": some tokens skipped";
      EXPECT_GT(std::accumulate(l.begin(), l.end() - 1, std::int64_t{0}), 0) << "MoE layer " << i << ": some routed";
    }
    return std::vector<float>(m.grads(), m.grads() + m.param_floats());
  };
  const auto ga = grads_of({&a}), gb = grads_of({&b}), gab = grads_of({&a, &b});
  std::vector<float> sum(ga.size());
  for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = ga[i] + gb[i];
  const MoeTransformer probe(cfg, o, parallel::Mesh());  // for the layout
  for (const auto& p : probe.layout().params) {
    double num = 0, den = 0;
    for (std::int64_t i = p.offset; i < p.offset + p.numel; ++i) {
      num += (double(gab[i]) - sum[i]) * (double(gab[i]) - sum[i]);
      den += double(sum[i]) * sum[i];
    }
    if (p.name == "embed.weight" || p.name.ends_with("norm.weight")) EXPECT_GT(den, 0.0) << p.name;
    EXPECT_LE(std::sqrt(num), 1e-5 * std::sqrt(den)) << p.name;
  }
}

TEST(TrainZaya, OverfitsOneBatch) {
  const auto cfg = zaya_config(true);
  ModelOptions o;
  o.micro_batch = 2;
  o.seq_length = 8;
  o.bias_update_rate = 0.01;
  MoeTransformer m(cfg, o, parallel::Mesh());
  const Batch b = random_batch(16, 23, 5);
  const auto [first, last] = fixtures::overfit_with_adamw(m, b.tokens.data(), b.targets.data(), 100, 1e-2);
  std::printf("[overfit] zaya ce %.4f -> %.4f, skip bias %.3f\n", first, last, m.router_bias(0).back());
  EXPECT_LT(last, 0.5 * first);
  EXPECT_GT(m.router_bias(0).back(), -1.f);  // the controller raised the unused skip class
}

TEST(TrainZaya, RejectsWhatIsStillUnsupported) {
  ModelOptions o;
  o.micro_batch = 1;
  o.seq_length = 4;
  auto expect_error = [&](model::ModelConfig cfg, const char* needle) {
    try {
      MoeTransformer m(cfg, o, parallel::Mesh());
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto c = zaya_config(true);
  c.router_mlp_layers = 2;
  expect_error(c, "router_mlp_layers 2");
  c = zaya_config(false);
  c.router_hidden = 0;
  c.router_skip_expert = true;
  expect_error(c, "router_skip_expert without an MLP router");
  c = zaya_config(false);
  c.qk_norm = true;
  expect_error(c, "qk_norm is not supported");
  c = zaya_config(false);
  c.shared_experts = 1;
  expect_error(c, "shared_experts is not supported");
}

}  // namespace
}  // namespace keel::train
