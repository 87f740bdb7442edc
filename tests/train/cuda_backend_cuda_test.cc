// The CUDA TrainBackend against the CPU reference backend: the same parameters (one init, one
// layout) must give the same loss and gradients within bf16 tolerance, training must learn,
// and state must round-trip between the devices. Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "device/cuda_devices.h"
#include "train/backend.h"

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

struct Batch {
  std::vector<std::uint32_t> tokens;
  std::vector<std::int32_t> targets;
};

Batch random_batch(int n, int vocab, std::uint64_t seed) {
  Batch b;
  std::uint64_t s = seed;
  for (int i = 0; i < n; ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    b.tokens.push_back(static_cast<std::uint32_t>((s >> 33) % vocab));
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    b.targets.push_back(i % 17 == 5 ? -1 : static_cast<std::int32_t>((s >> 33) % vocab));  // some ignored
  }
  return b;
}

// ||a - b|| / ||b|| over [begin, begin + n).
double rel_error(const std::vector<float>& a, const std::vector<float>& b, std::int64_t begin, std::int64_t n) {
  double num = 0, den = 0;
  for (std::int64_t i = begin; i < begin + n; ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

void compare_with_cpu(bool tied, Recompute r) {
  if (visible_cuda_devices() == 0) GTEST_SKIP() << "no CUDA device visible";
  const auto cfg = small_config(tied);
  const auto opt = small_options(r);
  optim::AdamWConfig adamw;
  auto cpu = make_cpu_backend(cfg, opt, adamw, ParallelContext::single());
  auto gpu = make_cuda_backend(cfg, opt, adamw, ParallelContext::single());
  ASSERT_EQ(cpu->layout().total_floats, gpu->layout().total_floats);
  const Batch b = random_batch(opt.micro_batch * opt.seq_length, cfg.vocab_size, 11);
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
  for (const auto& p : cpu->layout().params) {
    // bf16 activations and weights: a few % of the gradient's norm; a router selection that a
    // bf16 rounding flips moves single tokens, not whole tensors
    const double tol = p.name.find("router") != std::string::npos ? 0.15 : 0.08;
    EXPECT_LT(rel_error(gg, gc, p.offset, p.numel), tol) << p.name;
  }
  for (int i = 0; i < cpu->moe_layer_count(); ++i) {
    std::int64_t tc = 0, tg = 0;
    for (auto c : cpu->load(i)) tc += c;
    for (auto c : gpu->load(i)) tg += c;
    EXPECT_EQ(tc, tg) << "every token routed top_k times, layer " << i;
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

TEST(CudaBackend, MatchesCpuUntied) { compare_with_cpu(false, Recompute::kNone); }
TEST(CudaBackend, MatchesCpuTiedWithRecompute) { compare_with_cpu(true, Recompute::kFull); }

TEST(CudaBackend, OverfitsOneBatchAndStateRoundTrips) {
  if (visible_cuda_devices() == 0) GTEST_SKIP() << "no CUDA device visible";
  const auto cfg = small_config(true);
  const auto opt = small_options();
  optim::AdamWConfig adamw;
  adamw.weight_decay = 0;
  auto gpu = make_cuda_backend(cfg, opt, adamw, ParallelContext::single());
  const Batch b = random_batch(opt.micro_batch * opt.seq_length, cfg.vocab_size, 5);
  double first = 0, last = 0;
  for (int step = 0; step < 40; ++step) {
    gpu->zero_grads();
    const LossParts lp = gpu->forward(b.tokens.data(), b.targets.data());
    if (step == 0) first = lp.ce;
    last = lp.ce;
    gpu->backward(1.0f);
    gpu->clip_and_step(1.0, 3e-3);
    gpu->update_router_bias();
  }
  EXPECT_LT(last, 0.5 * first) << "loss " << first << " -> " << last;

  // state out and back in: the same loss bit for bit; into the CPU backend: the same loss
  // within bf16 tolerance (checkpoints move between devices)
  const TrainState st = gpu->state();
  gpu->zero_grads();
  const double before = gpu->forward(b.tokens.data(), b.targets.data()).total;
  gpu->backward(1.0f);
  gpu->set_state(st);
  gpu->zero_grads();
  const double after = gpu->forward(b.tokens.data(), b.targets.data()).total;
  gpu->backward(1.0f);
  EXPECT_EQ(before, after);
  auto cpu = make_cpu_backend(cfg, opt, adamw, ParallelContext::single());
  cpu->set_state(st);
  cpu->zero_grads();
  const double on_cpu = cpu->forward(b.tokens.data(), b.targets.data()).total;
  EXPECT_NEAR(on_cpu, after, 0.02 * after);
}

TEST(CudaBackend, BadInputIsAClearError) {
  if (visible_cuda_devices() == 0) GTEST_SKIP() << "no CUDA device visible";
  auto cfg = small_config(false);
  const auto opt = small_options();
  auto gpu = make_cuda_backend(cfg, opt, {}, ParallelContext::single());
  Batch b = random_batch(opt.micro_batch * opt.seq_length, cfg.vocab_size, 3);
  b.tokens[7] = 100000;
  EXPECT_THROW(gpu->forward(b.tokens.data(), b.targets.data()), Error);
  cfg.head_dim = 32;
  cfg.hidden = 128;
  EXPECT_THROW(make_cuda_backend(cfg, opt, {}, ParallelContext::single()), UsageError);
}

}  // namespace
}  // namespace keel::train
