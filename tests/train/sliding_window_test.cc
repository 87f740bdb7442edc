// Sliding-window layers (model keys layer_sliding, sliding_window, sliding_rope_base,
// sliding_rope_fraction) in keel::train::MoeTransformer on CPU: the model's forward against one
// composed from the CPU ops with each layer's own window and RoPE table, whole-model gradients
// by finite differences (GQA with an MoE layer, and CCA), one batch overfitted, and the loss
// moving with the window (the wiring is live).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "../ops/gradcheck.h"
#include "blocks/weights.h"
#include "ops/attention.h"
#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/swiglu.h"
#include "train/model.h"

#include "model_gradcheck.h"
#include "train_test_util.h"

namespace keel::train {
namespace {

// Layer 1 of 2 slides over 4 tokens with its own RoPE (base 500, half the channels rotated;
// layer 0: base 10000, all of them).
model::ModelConfig with_sliding(model::ModelConfig m, int window = 4) {
  m.layer_sliding = {false, true};
  m.sliding_window = window;
  m.sliding_rope_base = 500.0;
  m.sliding_rope_fraction = 0.5;
  return m;
}

// Two dense GQA layers (no routing: the reference below composes every op by hand).
model::ModelConfig dense_config() {
  model::ModelConfig m = fixtures::tiny_config(/*tied=*/false);
  m.name = "sliding-dense";
  m.experts = 0, m.top_k = 0, m.expert_hidden = 0, m.first_dense_layers = 0;
  return m;
}

// Two CCA layers with dense MLPs under plain residual adds.
model::ModelConfig cca_config() {
  model::ModelConfig m = dense_config();
  m.name = "sliding-cca";
  m.attention = model::AttentionKind::kCca;
  m.cca_q_dim = 16, m.cca_k_dim = 8, m.cca_v_dim = 8, m.cca_conv_width = 2, m.cca_group_conv_width = 2;
  return m;
}

ModelOptions options(int seq) {
  ModelOptions o;
  o.micro_batch = 2;
  o.seq_length = seq;
  o.init_std = 0.3;       // large weights: attention far from uniform, gradients above the noise
  o.precise_loss = true;  // the loss in double
  return o;
}

// Each row's log-probability of its target, from the CPU ops composed by hand (pre-norm layers:
// x += attn(n1(x)); x += down(silu(gate(n2(x))) * up(n2(x))); final norm; LM head), every layer
// rotating with a table of its own (base, fraction) and attending within its window.
std::vector<double> reference_logprobs(const model::ModelConfig& cfg, MoeTransformer& m, const fixtures::Batch& b,
                                       int B, int T) {
  const std::int64_t N = std::int64_t(B) * T, D = cfg.hidden, Hq = cfg.heads, Hkv = cfg.kv_heads, Dh = cfg.head_dim;
  const std::int64_t F = cfg.ffn_hidden, V = cfg.vocab_size;
  const float eps = static_cast<float>(cfg.norm_eps);
  const blocks::WeightViews w = blocks::map_weights(cfg, m.layout(), m.params());
  std::vector<float> x(N * D), h(N * D), q(N * Hq * Dh), k(N * Hkv * Dh), v(N * Hkv * Dh), att(N * Hq * Dh),
      lse(B * Hq * T), o(N * D), g(N * F), u(N * F), a(N * F), logits(N * V);
  std::vector<std::int32_t> pos(N);
  for (std::int64_t i = 0; i < N; ++i) pos[i] = static_cast<std::int32_t>(i % T);
  auto t2 = [](std::vector<float>& s, std::int64_t r, std::int64_t c) { return Tensor(s.data(), {r, c}); };
  ops::embedding::forward(b.tokens.data(), N, w.embed, t2(x, N, D));
  for (int l = 0; l < cfg.layers; ++l) {
    const blocks::LayerWeights& L = w.layers[l];
    ops::rmsnorm::forward(t2(x, N, D), L.attn_norm, eps, t2(h, N, D), Tensor());
    ops::linear::forward(t2(h, N, D), L.wq, {}, t2(q, N, Hq * Dh));
    ops::linear::forward(t2(h, N, D), L.wk, {}, t2(k, N, Hkv * Dh));
    ops::linear::forward(t2(h, N, D), L.wv, {}, t2(v, N, Hkv * Dh));
    const ops::rope::Table rt =
        ops::rope::make_table(int(Dh), model::layer_rope_fraction(cfg, l), model::layer_rope_base(cfg, l), T);
    ops::rope::forward(rt, Tensor(q.data(), {N, Hq, Dh}), pos.data(), Tensor(q.data(), {N, Hq, Dh}));
    ops::rope::forward(rt, Tensor(k.data(), {N, Hkv, Dh}), pos.data(), Tensor(k.data(), {N, Hkv, Dh}));
    ops::attention::forward(Tensor(q.data(), {B, T, Hq, Dh}), Tensor(k.data(), {B, T, Hkv, Dh}),
                            Tensor(v.data(), {B, T, Hkv, Dh}), 1.f / std::sqrt(float(Dh)),
                            Tensor(att.data(), {B, T, Hq, Dh}), Tensor(lse.data(), {B, Hq, T}),
                            model::attention_window(cfg, l));
    ops::linear::forward(t2(att, N, Hq * Dh), L.wo, {}, t2(o, N, D));
    for (std::int64_t i = 0; i < N * D; ++i) x[i] += o[i];
    ops::rmsnorm::forward(t2(x, N, D), L.mlp_norm, eps, t2(h, N, D), Tensor());
    ops::linear::forward(t2(h, N, D), L.w_gate, {}, t2(g, N, F));
    ops::linear::forward(t2(h, N, D), L.w_up, {}, t2(u, N, F));
    ops::swiglu::forward(t2(g, N, F), t2(u, N, F), t2(a, N, F));
    ops::linear::forward(t2(a, N, F), L.w_down, {}, t2(o, N, D));
    for (std::int64_t i = 0; i < N * D; ++i) x[i] += o[i];
  }
  ops::rmsnorm::forward(t2(x, N, D), w.final_norm, eps, t2(h, N, D), Tensor());
  ops::linear::forward(t2(h, N, D), w.lm_head, {}, t2(logits, N, V));
  std::vector<double> lp(N);
  for (std::int64_t i = 0; i < N; ++i) {
    const float* z = logits.data() + i * V;
    double mx = -1e300, se = 0;
    for (std::int64_t c = 0; c < V; ++c) mx = std::max(mx, double(z[c]));
    for (std::int64_t c = 0; c < V; ++c) se += std::exp(double(z[c]) - mx);
    lp[i] = double(z[b.targets[i]]) - mx - std::log(se);
  }
  return lp;
}

// The model's per-token log-probabilities equal the ops reference with windows and per-layer
// RoPE, and not the reference without them (the comparison would catch a model that ignored
// either).
TEST(TrainSliding, ForwardEqualsOpsReference) {
  const int B = 2, T = 10;
  const model::ModelConfig cfg = with_sliding(dense_config());
  MoeTransformer m(cfg, options(T), parallel::Mesh());
  const fixtures::Batch b = fixtures::random_batch(B * T, static_cast<int>(cfg.vocab_size), 3);
  m.forward(b.tokens.data(), b.targets.data());
  std::vector<float> lp(B * T);
  m.token_logprobs(0, lp.data(), nullptr, nullptr);
  const auto ref = reference_logprobs(cfg, m, b, B, T);
  const auto ref_full = reference_logprobs(dense_config(), m, b, B, T);
  double worst = 0, moved = 0;
  for (int i = 0; i < B * T; ++i) {
    worst = std::max(worst, std::fabs(lp[i] - ref[i]));
    moved = std::max(moved, std::fabs(ref_full[i] - ref[i]));
  }
  EXPECT_LT(worst, 2e-5);
  EXPECT_GT(moved, 1e-3) << "the window and the sliding layer's RoPE do not change the reference";
}

void sliding_gradcheck(const model::ModelConfig& cfg) {
  const ModelOptions o = options(7);  // window 3 of 7 tokens: edges inside every sequence
  MoeTransformer model(cfg, o, parallel::Mesh());
  const fixtures::Batch b = fixtures::random_batch(o.micro_batch * o.seq_length, static_cast<int>(cfg.vocab_size), 9);
  const double worst = fixtures::check_model_grads(model, b, cfg.name);
  std::printf("[gradcheck] %s: worst rel_err %.3e\n", cfg.name.c_str(), worst);
}

// Backward through the windowed attention and the sliding layer's RoPE (GQA, with a routed
// layer: tiny_config's), and through CCA's (its attention core takes the window).
TEST(TrainSliding, WholeModelGradCheckGqa) { sliding_gradcheck(with_sliding(fixtures::tiny_config(false), 3)); }
TEST(TrainSliding, WholeModelGradCheckCca) { sliding_gradcheck(with_sliding(cca_config(), 3)); }

// It trains, and the window is live: the same initial weights give another loss than full
// attention from the first step (sequences of 12 tokens, window 4).
TEST(TrainSliding, TrainsAndDiffersFromFullAttention) {
  const int T = 12;
  const model::ModelConfig full_cfg = fixtures::tiny_config(false), cfg = with_sliding(full_cfg);
  ModelOptions o = options(T);
  o.init_std = 0.02;
  o.bias_update_rate = 0.01;
  const fixtures::Batch b = fixtures::random_batch(o.micro_batch * T, static_cast<int>(cfg.vocab_size), 11);
  MoeTransformer sliding(cfg, o, parallel::Mesh()), full(full_cfg, o, parallel::Mesh());
  const auto [first, last] = fixtures::overfit_with_adamw(sliding, b.tokens.data(), b.targets.data(), 60, 1e-2);
  const auto [full_first, full_last] = fixtures::overfit_with_adamw(full, b.tokens.data(), b.targets.data(), 60, 1e-2);
  std::printf("[overfit] sliding ce %.4f -> %.4f; full attention %.4f -> %.4f\n", first, last, full_first, full_last);
  EXPECT_LT(last, 0.5 * first);
  EXPECT_GT(std::fabs(first - full_first), 1e-5) << "the sliding layer computed full attention";
}

}  // namespace
}  // namespace keel::train
