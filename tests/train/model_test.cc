// Whole-model tests of keel::train::MoeTransformer on CPU: finite-difference gradient check
// through every op, recompute = full against none, overfitting one batch.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include "../ops/gradcheck.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "parallel/plan.h"
#include "train/model.h"

#include "model_gradcheck.h"
#include "train_test_util.h"

namespace keel::train {
namespace {

void whole_model_gradcheck(bool tied, bool linear = false) {
  auto cfg = fixtures::tiny_config(tied);
  if (linear) {  // layer 0 linear attention (decayed, elu+1 features, chunks of 2), layer 1 gqa
    cfg.layer_attention = {model::AttentionKind::kLinear, model::AttentionKind::kGqa};
    cfg.linear_chunk = 2;
    cfg.linear_feature = "elu1";
    cfg.linear_decay = "retnet";
  }
  ModelOptions o;
  o.micro_batch = 2;
  o.seq_length = 5;
  o.aux_loss_weight = 0.1;  // large, so the aux and z terms visibly matter
  o.z_loss_weight = 0.05;
  o.init_std = 0.3;         // large weights: gradients well above the fp32 noise floor
  o.ce_chunk = 7;           // several vocabulary chunks
  o.precise_loss = true;    // the loss in double: fp32 rounding would dominate the differences
  MoeTransformer model(cfg, o, parallel::Mesh());
  const fixtures::Batch b = fixtures::random_batch(o.micro_batch * o.seq_length, static_cast<int>(cfg.vocab_size), 7);
  const double worst = fixtures::check_model_grads(model, b, tied ? "tied" : "untied");
  std::printf("[gradcheck] whole model (tied=%d): worst rel_err %.3e\n", tied ? 1 : 0, worst);
}

TEST(TrainModel, WholeModelGradCheckUntied) { whole_model_gradcheck(false); }
TEST(TrainModel, WholeModelGradCheckTied) { whole_model_gradcheck(true); }
TEST(TrainModel, WholeModelGradCheckLinearHybrid) { whole_model_gradcheck(false, /*linear=*/true); }

TEST(TrainModel, AuxLossesContributeToGradients) {
  const auto cfg = fixtures::tiny_config(false);
  ModelOptions o;
  o.micro_batch = 2;
  o.seq_length = 5;
  o.init_std = 0.3;
  const fixtures::Batch b = fixtures::random_batch(10, 23, 3);
  auto router_grad = [&](double aux, double z) {
    o.aux_loss_weight = aux;
    o.z_loss_weight = z;
    MoeTransformer m(cfg, o, parallel::Mesh());
    m.zero_grads();
    const auto lp = m.forward(b.tokens.data(), b.targets.data());
    EXPECT_GT(lp.aux, 0.0);
    EXPECT_GT(lp.z, 0.0);
    m.backward();
    const Tensor g = m.grad("layers.1.moe.router");
    return std::vector<float>(g.data(), g.data() + g.numel());
  };
  EXPECT_NE(router_grad(0, 0), router_grad(0.1, 0));
  EXPECT_NE(router_grad(0, 0), router_grad(0, 0.1));
}

TEST(TrainModel, RecomputeFullGivesIdenticalGradients) {
  const auto cfg = fixtures::tiny_config(true, 3);
  const fixtures::Batch b = fixtures::random_batch(2 * 8, 23, 11);
  auto run = [&](Recompute r, float* loss) {
    ModelOptions o;
    o.micro_batch = 2;
    o.seq_length = 8;
    o.recompute = r;
    o.init_std = 0.2;
    MoeTransformer m(cfg, o, parallel::Mesh());
    m.zero_grads();
    *loss = static_cast<float>(m.forward(b.tokens.data(), b.targets.data()).total);
    m.backward();
    // a second micro-batch accumulates
    m.forward(b.tokens.data(), b.targets.data());
    m.backward(0.5f);
    return std::vector<float>(m.grads(), m.grads() + m.param_floats());
  };
  float l0 = 0, l1 = 0;
  const auto g0 = run(Recompute::kNone, &l0);
  const auto g1 = run(Recompute::kFull, &l1);
  EXPECT_EQ(l0, l1);
  ASSERT_EQ(g0.size(), g1.size());
  EXPECT_EQ(0, std::memcmp(g0.data(), g1.data(), g0.size() * sizeof(float)));
}

// ||a - b|| over elements [off, off + n) of two gradient vectors (b empty: ||a||).
double slice_dist(const std::vector<float>& a, const std::vector<float>& b, std::int64_t off, std::int64_t n) {
  double s = 0;
  for (std::int64_t i = off; i < off + n; ++i) {
    const double d = double(a[i]) - (b.empty() ? 0.0 : double(b[i]));
    s += d * d;
  }
  return std::sqrt(s);
}

// Two micro-batches' gradients are the sum of each one's alone (fresh models from the same
// init), per parameter, the embedding included: nothing of one backward's residual-stream
// gradient may leak into the next (rmsnorm adds its dx into that buffer, so the final norm's
// backward must start from zeros). The CPU twin of CudaBackend.GradientsAreTheStepsOwnAndMicroBatchesSum.
TEST(TrainModel, MicroBatchGradientsSum) {
  for (const bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const auto cfg = fixtures::tiny_config(tied);
    ModelOptions o;
    o.micro_batch = 2;
    o.seq_length = 6;
    o.init_std = 0.2;
    const int n = o.micro_batch * o.seq_length, vocab = static_cast<int>(cfg.vocab_size);
    const fixtures::Batch a = fixtures::random_batch(n, vocab, 31), b = fixtures::random_batch(n, vocab, 32);
    const MoeTransformer probe(cfg, o, parallel::Mesh());  // for the layout
    auto grads_of = [&](const std::vector<const fixtures::Batch*>& batches) {
      MoeTransformer m(cfg, o, parallel::Mesh());
      m.zero_grads();
      for (const auto* batch : batches) {
        m.forward(batch->tokens.data(), batch->targets.data());
        m.backward();
      }
      return std::vector<float>(m.grads(), m.grads() + m.param_floats());
    };
    const auto ga = grads_of({&a}), gb = grads_of({&b}), gab = grads_of({&a, &b});
    std::vector<float> sum(ga.size());
    for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = ga[i] + gb[i];
    for (const auto& p : probe.layout().params) {
      const double ref = slice_dist(sum, {}, p.offset, p.numel);
      if (p.name == "embed.weight" || p.name.ends_with("norm.weight")) EXPECT_GT(ref, 0.0) << p.name;
      EXPECT_LE(slice_dist(gab, sum, p.offset, p.numel), 1e-5 * ref) << p.name;
    }
  }
}

TEST(TrainModel, RecomputeFullUsesLessActivationMemory) {
  const auto cfg = fixtures::tiny_config(false, 4);
  ModelOptions o;
  o.micro_batch = 2;
  o.seq_length = 16;
  MoeTransformer none(cfg, o, parallel::Mesh());
  o.recompute = Recompute::kFull;
  MoeTransformer full(cfg, o, parallel::Mesh());
  EXPECT_LT(full.act_arena().capacity(), none.act_arena().capacity());
}

TEST(TrainModel, OverfitsOneBatch) {
  const auto cfg = fixtures::tiny_config(false);
  ModelOptions o;
  o.micro_batch = 2;
  o.seq_length = 8;
  MoeTransformer m(cfg, o, parallel::Mesh());
  const fixtures::Batch b = fixtures::random_batch(16, 23, 5);
  const auto [first, last] = fixtures::overfit_with_adamw(m, b.tokens.data(), b.targets.data(), 100, 1e-2);
  std::printf("[overfit] ce %.4f -> %.4f\n", first, last);
  EXPECT_LT(last, 0.1 * first);
}

TEST(TrainModel, RejectsUnsupportedConfigs) {
  auto cfg = fixtures::tiny_config(false);
  ModelOptions o;
  o.micro_batch = 1;
  o.seq_length = 4;
  cfg.qk_norm = true;
  try {
    MoeTransformer m(cfg, o, parallel::Mesh());
    FAIL() << "qk_norm accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("qk_norm is not supported"), std::string::npos) << e.what();
  }
  mesh::Shape tensor;  // not implemented yet: the one check every backend calls
  tensor.tp = 2;
  EXPECT_THROW(parallel::check_plan(fixtures::tiny_config(false), tensor), UsageError);
}

TEST(TrainModel, RouterBiasBalancesLoad) {
  const auto cfg = fixtures::tiny_config(false);
  ModelOptions o;
  o.micro_batch = 2;
  o.seq_length = 8;
  o.bias_update_rate = 0.5;
  MoeTransformer m(cfg, o, parallel::Mesh());
  const fixtures::Batch b = fixtures::random_batch(16, 23, 9);
  m.forward(b.tokens.data(), b.targets.data());
  auto load = m.load(0);
  std::int64_t total = 0;
  for (auto c : load) total += c;
  EXPECT_EQ(total, 16 * 2);
  m.update_router_bias();
  const auto& bias = m.router_bias(0);
  const double mean = total / 4.0;
  for (int e = 0; e < 4; ++e) {
    if (load[e] > mean) EXPECT_LT(bias[e], 0.f);
    if (load[e] < mean) EXPECT_GT(bias[e], 0.f);
  }
  EXPECT_EQ(m.load(0)[0], 0);  // reset
}

TEST(TrainModel, InitIsDeterministicAndOneStreamAcrossParallelChunks) {
  // Embedding 4096 x 512 = 2M elements: filled in parallel chunks of 1M (model::init_parameters).
  model::ModelConfig cfg = fixtures::tiny_config(true);
  cfg.vocab_size = 4096;
  cfg.hidden = 512;
  cfg.heads = 8;
  cfg.kv_heads = 2;
  cfg.head_dim = 64;
  const optim::ParamLayout layout = model::param_layout(cfg);
  std::vector<float> a(layout.total_floats), b(layout.total_floats);
  model::init_parameters(cfg, layout, 0.02, 77, a.data());
  model::init_parameters(cfg, layout, 0.02, 77, b.data());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "init depends on thread timing";
  const optim::ParamInfo* embed = nullptr;
  for (const auto& p : layout.params)
    if (p.name.find("embed") != std::string::npos) embed = &p;
  ASSERT_NE(embed, nullptr);
  ASSERT_GT(embed->numel, std::int64_t{1} << 20);
  // The second chunk continues the stream instead of restarting it, and the values look normal(0, 0.02).
  const float* e = a.data() + embed->offset;
  const std::int64_t c = std::int64_t{1} << 20;
  EXPECT_NE(std::memcmp(e, e + c, 64 * sizeof(float)), 0) << "chunk 1 repeats chunk 0";
  double sum = 0, sq = 0;
  for (std::int64_t i = 0; i < embed->numel; ++i) sum += e[i], sq += double(e[i]) * e[i];
  const double mean = sum / embed->numel, sd = std::sqrt(sq / embed->numel - mean * mean);
  EXPECT_NEAR(mean, 0.0, 1e-4);
  EXPECT_NEAR(sd, 0.02, 2e-4);
  // another seed, other values
  model::init_parameters(cfg, layout, 0.02, 78, b.data());
  EXPECT_NE(std::memcmp(a.data() + embed->offset, b.data() + embed->offset, 64 * sizeof(float)), 0);
}

// keel eval's --logprobs: the per-token log-probabilities after forward() average (negated) to
// the forward's CE over the valid targets, ignored targets give 0, and the top-k ids are the
// most likely ones in order, the target's log-probability among them where it ranks.

TEST(TrainModel, TokenLogprobsGiveTheForwardCe) {
  for (const bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const auto cfg = fixtures::tiny_config(tied);
    ModelOptions o;
    o.micro_batch = 2;
    o.seq_length = 6;
    o.init_std = 0.3;
    o.ce_chunk = 5;  // several vocabulary chunks
    const int n = o.micro_batch * o.seq_length, V = static_cast<int>(cfg.vocab_size);
    fixtures::Batch b = fixtures::random_batch(n, V, 41);
    b.targets[3] = -1;  // one ignored target
    MoeTransformer m(cfg, o, parallel::Mesh());
    const double ce = m.forward(b.tokens.data(), b.targets.data()).ce;
    for (const int k : {0, 3}) {
      std::vector<float> lp(n), top_lp(static_cast<std::size_t>(n * k));
      std::vector<std::int32_t> top_ids(top_lp.size());
      m.token_logprobs(k, lp.data(), top_ids.data(), top_lp.data());
      double sum = 0;
      int valid = 0;
      for (int i = 0; i < n; ++i) {
        if (b.targets[i] < 0) {
          EXPECT_EQ(lp[i], 0.f);
          continue;
        }
        EXPECT_LT(lp[i], 0.f);
        sum -= lp[i], ++valid;
        for (int j = 0; j < k; ++j) {
          if (j > 0) EXPECT_LE(top_lp[i * k + j], top_lp[i * k + j - 1]);
          if (top_ids[i * k + j] == b.targets[i]) EXPECT_NEAR(top_lp[i * k + j], lp[i], 1e-5);
        }
        if (k > 0) EXPECT_GE(top_lp[i * k] + 1e-6, lp[i]);
      }
      EXPECT_NEAR(sum / valid, ce, 1e-5 * ce) << "top_k " << k;
    }
  }
}

}  // namespace
}  // namespace keel::train
