// The CUDA TrainBackend against the CPU reference backend: the same parameters (one init, one
// layout) must give the same loss and gradients within bf16 tolerance, training must learn,
// and state must round-trip between the devices; for mha/gqa models and for ZAYA1's layers (CCA,
// the MLP router with EDA and the skip class, residual scaling). Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "device/cuda_devices.h"
#include "train/backend.h"
#include "train/train_checkpoint.h"

#include "../ops/cuda/cuda_test_util.h"
#include "train_test_util.h"

namespace keel::train {
namespace {

model::ModelConfig small_config(bool tied) {
  model::ModelConfig m;
  m.name = "cuda-test";
  m.vocab_size = 517;  // not a multiple of the CE chunk or of 8
  m.hidden = 256;
  m.layers = 3;
  m.attention = model::AttentionKind::kGqa;
  m.heads = 4;
  m.kv_heads = 2;
  m.head_dim = 64;
  m.ffn_hidden = 384;
  m.experts = 4;
  m.top_k = 2;
  m.expert_hidden = 128;
  m.first_dense_layers = 1;  // layer 0 dense, layers 1-2 MoE
  m.tied_embeddings = tied;
  m.rope_fraction = 0.5;
  m.max_seq_len = 128;
  return m;
}

// ZAYA1 layers at a size the CUDA kernels take (head_dim 64): layer 0 dense, layers 1-2 MoE
// stages with the MLP router (two stages: the EDA chain runs), CCA everywhere.
model::ModelConfig zaya_config(bool skip, bool scaled = true) {
  model::ModelConfig m = small_config(true);
  m.name = "cuda-zaya-test";
  m.attention = model::AttentionKind::kCca;
  m.cca_q_dim = 256, m.cca_k_dim = 128, m.cca_v_dim = 128, m.cca_conv_width = 2, m.cca_group_conv_width = 2;
  m.top_k = 1;
  m.router_hidden = 64;
  m.router_mlp_layers = 3;
  m.router_skip_expert = skip;
  m.residual_scaling = scaled;
  return m;
}

// Layers 0 and 2 of 3 slide over 40 of the 96 tokens (the flash kernels' key tiles are 64 and
// 128: windows start inside tiles) with their own RoPE (base 1000, every channel rotated).
model::ModelConfig with_sliding(model::ModelConfig m) {
  m.name += "-sliding";
  m.layer_sliding = {true, false, true};
  m.sliding_window = 40;
  m.sliding_rope_base = 1000.0;
  m.sliding_rope_fraction = 1.0;
  return m;
}

ModelOptions small_options(Recompute r = Recompute::kNone) {
  ModelOptions o;
  o.micro_batch = 2;
  o.seq_length = 96;  // not a multiple of the attention tiles
  o.ce_chunk = 200;
  o.recompute = r;
  o.aux_loss_weight = 0.01;
  o.z_loss_weight = 0.001;
  o.init_std = 0.05;
  return o;
}

// At init the MLP router's logits are tiny (products of three small-std layers), so a top-1
// choice is decided by differences that bf16 rounding flips for many tokens. Scaling the output
// layer widens the margins, so the two backends route (nearly) every token alike and the
// comparison measures the arithmetic. The logits stay well below 1 even so, and the skip class's
// initial bias of -1 would keep every token off it: its bias is set to the experts' 0 here so
// that the skip path runs.
constexpr float kRouterSharpen = 100.f;

TrainState sharpened_router(const TrainBackend& b) {
  TrainState st = b.state();
  for (const auto& p : b.layout().params)
    if (p.name.ends_with("moe.router.out.weight"))
      for (std::int64_t i = p.offset; i < p.offset + p.numel; ++i) st.params[i] *= kRouterSharpen;
  for (auto& bias : st.router_bias) std::fill(bias.begin(), bias.end(), 0.f);
  return st;
}

void sharpen_router(TrainBackend& cpu, TrainBackend& gpu) {
  const TrainState st = sharpened_router(cpu);
  cpu.set_state(st);
  gpu.set_state(st);
}

// The CUDA backend's embedding lookup reads the table's bf16 copy (bf16 mixed precision, as
// its GEMMs read weights); the CPU reference reads fp32. Tables whose values are already bf16
// make the lookups agree exactly, so the comparison measures the rest of the arithmetic.
void bf16_embedding(TrainBackend& cpu, TrainBackend& gpu) {
  TrainState st = cpu.state();
  for (const auto& p : cpu.layout().params)
    if (p.name == "embed.weight")
      for (std::int64_t i = p.offset; i < p.offset + p.numel; ++i)
        st.params[i] = keel::bf16_bits_to_float(keel::float_to_bf16_bits(st.params[i]));
  cpu.set_state(st);
  gpu.set_state(st);
}

void compare_with_cpu(const model::ModelConfig& cfg, Recompute r, double mlp_router_aux = 0) {
  if (visible_cuda_devices() == 0) GTEST_SKIP() << "no CUDA device visible";
  auto opt = small_options(r);
  opt.mlp_router_aux_weight = mlp_router_aux;
  optim::AdamWConfig adamw;
  auto cpu = make_cpu_backend(cfg, opt, adamw, parallel::Mesh());
  auto gpu = make_cuda_backend(cfg, opt, adamw, parallel::Mesh());
  ASSERT_EQ(cpu->layout().total_floats, gpu->layout().total_floats);
  const bool mlp_router = cfg.router_hidden > 0;
  if (mlp_router) sharpen_router(*cpu, *gpu);
  bf16_embedding(*cpu, *gpu);
  const fixtures::Batch b = fixtures::random_batch(opt.micro_batch * opt.seq_length, cfg.vocab_size, 11, 17);
  cpu->zero_grads();
  gpu->zero_grads();
  const LossParts lc = cpu->forward(b.tokens.data(), b.targets.data());
  const LossParts lg = gpu->forward(b.tokens.data(), b.targets.data());
  EXPECT_NEAR(lg.ce, lc.ce, 2e-3 * lc.ce) << "CE loss";
  EXPECT_NEAR(lg.aux, lc.aux, 2e-2 * lc.aux) << "aux loss";
  EXPECT_NEAR(lg.z, lc.z, 5e-2 * lc.z + 1e-6) << "z loss";
  cpu->backward(1.0f);
  gpu->backward(1.0f);
  const auto gc = cpu->gradients(), gg = gpu->gradients();
  std::vector<std::pair<double, std::string>> errors;  // (error / bound, description)
  for (const auto& p : cpu->layout().params) {
    // bf16 activations and weights: a few % of the gradient's norm; a router selection that a
    // bf16 rounding flips moves single tokens, not whole tensors
    double tol = p.name.find("router") != std::string::npos ? 0.15 : 0.08;
    // CCA's temperatures: [kv_heads] sums over every token of terms that largely cancel, so
    // bf16 noise elsewhere shows up relatively large (0.15-0.31 observed on an H100, where every
    // other CCA gradient was within 0.08)
    if (p.name.ends_with("cca.temp")) tol = 0.5;
    // With the skip class, a token whose choice between skipping and an expert flips under bf16
    // changes what flows through every later merge (its output is x * p instead of an expert's):
    // the last stage's experts, norms and scales were 0.094-0.113 off on an H100 while the
    // class loads agreed within the 3% checked below and the skip-free runs stay within 0.08.
    if (cfg.router_skip_expert) tol = std::max(tol, 0.15);
    // Without the skip class the same flips, fewer: the last stage's experts and the final
    // residual scale were 0.075-0.084 off on an H200 once CCA's grouped conv ran on tensor cores
    // with bf16 weights (0.051-0.061 before, at other parameters: which tokens flip moved), while
    // the skip runs' worst fell from 0.161 to 0.128 with the same change.
    if (mlp_router) tol = std::max(tol, 0.1);
    // The later layer's MLP router sees those flips twice (its input and its gates' gradients):
    // 0.150-0.161 on an H200 for layer 1's router (below 0.15 before the embedding table was
    // made bf16-valued here, which moved the batch's flips); a wrong router backward is O(1) off.
    if (cfg.router_skip_expert && p.name.find("router") != std::string::npos) tol = 0.2;
    const double err = keel::test::norm_rel_err(gg, gc, p.offset, p.numel);
    EXPECT_LT(err, tol) << p.name;
    errors.emplace_back(err / tol, p.name + " " + std::to_string(err) + " (bound " + std::to_string(tol) + ")");
  }
  // The closest to their bounds, to see how much room the bounds leave.
  std::sort(errors.rbegin(), errors.rend());
  for (std::size_t i = 0; i < std::min<std::size_t>(4, errors.size()); ++i)
    std::printf("    gradient error %s\n", errors[i].second.c_str());
  const std::int64_t N = std::int64_t(opt.micro_batch) * opt.seq_length;
  for (int i = 0; i < cpu->moe_layer_count(); ++i) {
    const auto lc_i = cpu->load(i), lg_i = gpu->load(i);
    ASSERT_EQ(lc_i.size(), lg_i.size());
    std::int64_t tc = 0, tg = 0;
    for (auto c : lc_i) tc += c;
    for (auto c : lg_i) tg += c;
    EXPECT_EQ(tc, tg) << "every token routed top_k times, layer " << i;
    if (mlp_router) {
      // the same classes for (nearly) every token, the skip class included
      for (std::size_t e = 0; e < lc_i.size(); ++e) EXPECT_NEAR(lg_i[e], lc_i[e], 0.03 * N) << "class " << e;
      if (cfg.router_skip_expert) EXPECT_GT(lc_i.back(), 0) << "no token took the skip class, layer " << i;
    }
  }
  // one optimizer step on each: the same update within bf16 tolerance. AdamW's first step is
  // about lr * sign(g), so elements whose tiny gradient changes sign under bf16 move the other
  // way: compare the updates, not the parameters.
  const TrainState before = cpu->state();
  const StepResult sc = cpu->clip_and_step(1.0, 1e-3);
  const StepResult sg = gpu->clip_and_step(1.0, 1e-3);
  EXPECT_NEAR(sg.grad_norm, sc.grad_norm, 0.03 * sc.grad_norm);
  const TrainState tc = cpu->state(), tg = gpu->state();
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < tc.params.size(); ++i) {
    const double uc = static_cast<double>(tc.params[i]) - before.params[i];
    const double ug = static_cast<double>(tg.params[i]) - before.params[i];
    diff += (ug - uc) * (ug - uc);
    norm += uc * uc;
  }
  EXPECT_GT(norm, 0);
  EXPECT_LT(std::sqrt(diff / norm), 0.25) << "update of the GPU step against the CPU step";
  EXPECT_EQ(tg.adamw_step, 1);
}

// router.forced_balance (benchmarking only) on both backends: every MoE layer sends slot j of
// token n to expert (n * top_k + j) mod E on the GPU as on the CPU, so the loads are exactly
// N * top_k / E per expert (none on the skip class) on both, with no router sharpening needed;
// loss and gradients then agree to bf16 rounding.
TEST(CudaBackend, ForcedBalanceRoutesAsCpu) {
  if (visible_cuda_devices() == 0) GTEST_SKIP() << "no CUDA device visible";
  for (const model::ModelConfig& cfg : {small_config(false), zaya_config(true)}) {
    SCOPED_TRACE(cfg.name);
    ModelOptions opt = small_options();
    opt.forced_balance = true;
    optim::AdamWConfig adamw;
    auto cpu = make_cpu_backend(cfg, opt, adamw, parallel::Mesh());
    auto gpu = make_cuda_backend(cfg, opt, adamw, parallel::Mesh());
    bf16_embedding(*cpu, *gpu);
    const fixtures::Batch b = fixtures::random_batch(opt.micro_batch * opt.seq_length, cfg.vocab_size, 12, 17);
    cpu->zero_grads();
    gpu->zero_grads();
    const LossParts lc = cpu->forward(b.tokens.data(), b.targets.data());
    const LossParts lg = gpu->forward(b.tokens.data(), b.targets.data());
    EXPECT_NEAR(lg.ce, lc.ce, 2e-3 * lc.ce) << "CE loss";
    cpu->backward(1.0f);
    gpu->backward(1.0f);
    const auto gc = cpu->gradients(), gg = gpu->gradients();
    EXPECT_LT(keel::test::norm_rel_err(gg, gc, 0, static_cast<std::int64_t>(gc.size())), 0.08) << "gradients";
    const std::int64_t slots = std::int64_t(opt.micro_batch) * opt.seq_length * cfg.top_k;
    ASSERT_GT(cpu->moe_layer_count(), 0);
    for (int i = 0; i < cpu->moe_layer_count(); ++i) {
      const auto lc_i = cpu->load(i), lg_i = gpu->load(i);
      EXPECT_EQ(lg_i, lc_i) << "layer " << i;
      ASSERT_EQ(lc_i.size(), static_cast<std::size_t>(cfg.experts + (cfg.router_skip_expert ? 1 : 0)));
      for (int e = 0; e < cfg.experts; ++e) EXPECT_EQ(lc_i[e], slots / cfg.experts) << "layer " << i << " expert " << e;
      if (cfg.router_skip_expert) EXPECT_EQ(lc_i.back(), 0) << "skip class, layer " << i;
    }
  }
}

TEST(CudaBackend, MatchesCpuUntied) { compare_with_cpu(small_config(false), Recompute::kNone); }
TEST(CudaBackend, MatchesCpuTiedWithRecompute) { compare_with_cpu(small_config(true), Recompute::kFull); }
TEST(CudaBackend, ZayaMatchesCpuWithSkip) { compare_with_cpu(zaya_config(true), Recompute::kNone); }
TEST(CudaBackend, ZayaMatchesCpuWithSkipAndRecompute) { compare_with_cpu(zaya_config(true), Recompute::kFull); }
TEST(CudaBackend, ZayaMatchesCpuWithoutSkip) { compare_with_cpu(zaya_config(false), Recompute::kNone); }
TEST(CudaBackend, ZayaMatchesCpuWithoutSkipWithRecompute) { compare_with_cpu(zaya_config(false), Recompute::kFull); }
// CCA and the MLP router on the plain residual adds (no residual scaling)
// The MLP router's aux loss (router.aux_loss_weight; ZAYA1 has none), weighted so that its
// gradient dominates the routers': both backends report the loss and train it alike.
TEST(CudaBackend, ZayaWithAuxLossMatchesCpu) { compare_with_cpu(zaya_config(true), Recompute::kNone, 10.0); }
TEST(CudaBackend, ZayaMatchesCpuUnscaled) { compare_with_cpu(zaya_config(true, false), Recompute::kNone); }
// Sliding-window layers: the windowed flash kernels (forward and backward, GQA and CCA's core)
// and the per-layer RoPE tables against the CPU backend. GQA on dense layers: a linear top-2
// router's near-ties, which bf16 flips, moved layers 1-2's expert gradients 0.08-0.11 on an
// H200 (the attention's own were well inside), so the dense model keeps the bound strict.
TEST(CudaBackend, SlidingMatchesCpu) {
  model::ModelConfig m = with_sliding(small_config(false));
  m.experts = 0, m.top_k = 0, m.expert_hidden = 0, m.first_dense_layers = 0;
  compare_with_cpu(m, Recompute::kNone);
}
TEST(CudaBackend, ZayaSlidingMatchesCpuWithRecompute) {
  compare_with_cpu(with_sliding(zaya_config(true)), Recompute::kFull);
}
// Linear attention (ops/cuda/linear_attention.h) in the model against the CPU backend: dense
// models (a linear top-2 router's near-ties, which bf16 flips, moved the hybrid's expert
// gradients 0.08-0.2 on an H200 while its attention gradients stayed within 0.03: see
// SlidingMatchesCpu), of linear layers decayed with elu+1 features, and the hybrid of linear and
// softmax layers with recompute.
TEST(CudaBackend, LinearMatchesCpu) {
  model::ModelConfig m = small_config(false);
  m.experts = 0, m.top_k = 0, m.expert_hidden = 0, m.first_dense_layers = 0;
  m.attention = model::AttentionKind::kLinear;
  m.linear_feature = "elu1";
  m.linear_decay = "retnet";
  compare_with_cpu(m, Recompute::kNone);
}
TEST(CudaBackend, HybridMatchesCpuWithRecompute) {
  model::ModelConfig m = small_config(true);
  m.experts = 0, m.top_k = 0, m.expert_hidden = 0, m.first_dense_layers = 0;
  m.layer_attention = {model::AttentionKind::kLinear, model::AttentionKind::kLinear, model::AttentionKind::kGqa};
  compare_with_cpu(m, Recompute::kFull);
}

// Overfits one batch for `steps` steps (the loss must halve), then moves the state out and back
// in (the same loss bit for bit) and into the CPU backend (the same loss within
// `cpu_tolerance`, relative: checkpoints move between devices).
void expect_overfits_and_state_round_trips(TrainBackend& gpu, const model::ModelConfig& cfg, const ModelOptions& opt,
                                           const optim::AdamWConfig& adamw, int steps, double cpu_tolerance) {
  const fixtures::Batch b = fixtures::random_batch(opt.micro_batch * opt.seq_length, cfg.vocab_size, 5, 17);
  double first = 0, last = 0;
  for (int step = 0; step < steps; ++step) {
    gpu.zero_grads();
    const LossParts lp = gpu.forward(b.tokens.data(), b.targets.data());
    if (step == 0) first = lp.ce;
    last = lp.ce;
    gpu.backward(1.0f);
    gpu.clip_and_step(1.0, 3e-3);
    gpu.update_router_bias();
  }
  EXPECT_LT(last, 0.5 * first) << "loss " << first << " -> " << last;

  const TrainState st = gpu.state();
  // A checkpoint straight from device memory (checkpoint_view: pinned staging) holds exactly state().
  {
    const auto root = fixtures::temp_dir("cuda_backend", "view");
    TrainCheckpointer ck(root.string(), {});
    ck.save(1, gpu.checkpoint_view(), gpu.layout(), nlohmann::json{{"config", ""}});
    ASSERT_TRUE(ck.finish());
    const LoadedTrainState got = load_train_checkpoint(root.string(), cfg);
    EXPECT_EQ(got.state.params, st.params);
    EXPECT_EQ(got.state.adam_m, st.adam_m);
    EXPECT_EQ(got.state.adam_v, st.adam_v);
    EXPECT_EQ(got.state.router_bias, st.router_bias);
    EXPECT_EQ(got.state.adamw_step, st.adamw_step);
    std::filesystem::remove_all(root);
  }
  gpu.zero_grads();
  const double before = gpu.forward(b.tokens.data(), b.targets.data()).total;
  gpu.backward(1.0f);
  gpu.set_state(st);
  gpu.zero_grads();
  const double after = gpu.forward(b.tokens.data(), b.targets.data()).total;
  gpu.backward(1.0f);
  EXPECT_EQ(before, after);
  auto cpu = make_cpu_backend(cfg, opt, adamw, parallel::Mesh());
  cpu->set_state(st);
  cpu->zero_grads();
  const double on_cpu = cpu->forward(b.tokens.data(), b.targets.data()).total;
  // Relative to the loss, with a floor: an overfit batch ends near zero loss, where the bf16
  // logits alone move it by percents (an H200 run: 8.28e-4 on the GPU, 7.77e-4 on the CPU). A
  // state that loaded wrongly on either side lands orders of magnitude away.
  EXPECT_NEAR(on_cpu, after, cpu_tolerance * std::max(after, 0.03));
}

TEST(CudaBackend, ZayaOverfitsOneBatchAndStateRoundTrips) {
  if (visible_cuda_devices() == 0) GTEST_SKIP() << "no CUDA device visible";
  const auto cfg = zaya_config(true);
  auto opt = small_options();
  opt.bias_update_rate = 0.01;  // the controller runs over the 5 classes, skip included
  optim::AdamWConfig adamw;
  adamw.weight_decay = 0;
  auto gpu = make_cuda_backend(cfg, opt, adamw, parallel::Mesh());
  ASSERT_EQ(gpu->load(0).size(), 5u);
  ASSERT_EQ(gpu->state().router_bias[0].back(), -1.f) << "the skip class starts disfavoured, as on the CPU";
  gpu->set_state(sharpened_router(*gpu));  // (skip bias 0: the skip path trains too)
  expect_overfits_and_state_round_trips(*gpu, cfg, opt, adamw, 60, 0.03);
}

TEST(CudaBackend, OverfitsOneBatchAndStateRoundTrips) {
  if (visible_cuda_devices() == 0) GTEST_SKIP() << "no CUDA device visible";
  const auto cfg = small_config(true);
  const auto opt = small_options();
  optim::AdamWConfig adamw;
  adamw.weight_decay = 0;
  auto gpu = make_cuda_backend(cfg, opt, adamw, parallel::Mesh());
  expect_overfits_and_state_round_trips(*gpu, cfg, opt, adamw, 40, 0.02);
}

// A micro-batch's loss depends on that micro-batch alone, not on what the backend ran before
// (data parallelism hands each rank a different subsequence of micro-batches). Compared with
// the loss of the same batch in a fresh backend, and with the first two micro-batches swapped.
TEST(CudaBackend, LossDoesNotDependOnThePreviousMicroBatch) {
  if (visible_cuda_devices() == 0) GTEST_SKIP() << "no GPU";
  for (const auto& cfg : {small_config(true), zaya_config(true)}) {
    const ModelOptions opt = small_options();
    const std::int64_t n = std::int64_t(opt.micro_batch) * opt.seq_length;
    const auto a = fixtures::random_batch(static_cast<int>(n), cfg.vocab_size, 11);
    const auto b = fixtures::random_batch(static_cast<int>(n), cfg.vocab_size, 12);
    const optim::AdamWConfig adamw;
    auto first = make_cuda_backend(cfg, opt, adamw, parallel::Mesh());
    const double ab_a = first->forward(a.tokens.data(), a.targets.data()).total;
    const double ab_b = first->forward(b.tokens.data(), b.targets.data()).total;
    auto second = make_cuda_backend(cfg, opt, adamw, parallel::Mesh());
    const double ba_b = second->forward(b.tokens.data(), b.targets.data()).total;
    const double ba_a = second->forward(a.tokens.data(), a.targets.data()).total;
    EXPECT_NEAR(ab_a, ba_a, 1e-6 * std::fabs(ab_a)) << cfg.name;
    EXPECT_NEAR(ab_b, ba_b, 1e-6 * std::fabs(ab_b)) << cfg.name;
  }
}

// A step's gradients are its own micro-batches' sum: nothing of the previous step's stays (the
// expert blocks are written, not zeroed and added to, by a step's first backward), and a second
// micro-batch adds to the first. Per parameter against a fresh backend from the same state.
TEST(CudaBackend, GradientsAreTheStepsOwnAndMicroBatchesSum) {
  if (visible_cuda_devices() == 0) GTEST_SKIP() << "no GPU";
  for (const auto& cfg : {small_config(false), zaya_config(true)}) {
    SCOPED_TRACE(cfg.name);
    const ModelOptions opt = small_options();
    const std::int64_t n = std::int64_t(opt.micro_batch) * opt.seq_length;
    const auto a = fixtures::random_batch(static_cast<int>(n), cfg.vocab_size, 21);
    const auto b = fixtures::random_batch(static_cast<int>(n), cfg.vocab_size, 22);
    const optim::AdamWConfig adamw;
    auto grads_of = [](TrainBackend& be, const std::vector<const fixtures::Batch*>& batches) {
      be.zero_grads();
      for (const auto* batch : batches) {
        be.forward(batch->tokens.data(), batch->targets.data());
        be.backward(1.0f);
      }
      return be.gradients();
    };
    auto x = make_cuda_backend(cfg, opt, adamw, parallel::Mesh());
    if (cfg.router_hidden > 0) x->set_state(sharpened_router(*x));
    grads_of(*x, {&a});
    x->clip_and_step(1.0, 1e-2);
    const TrainState st = x->state();
    const std::vector<float> step2_b = grads_of(*x, {&b});
    const std::vector<float> step3_ba = grads_of(*x, {&b, &a});
    auto y = make_cuda_backend(cfg, opt, adamw, parallel::Mesh());
    y->set_state(st);
    const std::vector<float> fresh_b = grads_of(*y, {&b});
    const std::vector<float> fresh_a = grads_of(*y, {&a});
    std::vector<float> sum(fresh_a.size());
    for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = fresh_a[i] + fresh_b[i];
    for (const auto& p : x->layout().params) {
      EXPECT_LT(keel::test::norm_rel_err(step2_b, fresh_b, p.offset, p.numel), 1e-4) << p.name << ", one micro-batch";
      EXPECT_LT(keel::test::norm_rel_err(step3_ba, sum, p.offset, p.numel), 1e-4) << p.name << ", two micro-batches";
    }
  }
}

TEST(CudaBackend, BadInputIsAClearError) {
  if (visible_cuda_devices() == 0) GTEST_SKIP() << "no CUDA device visible";
  auto cfg = small_config(false);
  const auto opt = small_options();
  auto gpu = make_cuda_backend(cfg, opt, {}, parallel::Mesh());
  fixtures::Batch b = fixtures::random_batch(opt.micro_batch * opt.seq_length, cfg.vocab_size, 3, 17);
  b.tokens[7] = 100000;
  EXPECT_THROW(gpu->forward(b.tokens.data(), b.targets.data()), Error);
  cfg.head_dim = 32;
  cfg.hidden = 128;
  EXPECT_THROW(make_cuda_backend(cfg, opt, {}, parallel::Mesh()), UsageError);
}

}  // namespace
}  // namespace keel::train
