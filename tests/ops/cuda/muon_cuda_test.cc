// The CUDA Muon step (ops/cuda/muon.h) against the CPU optim::muon_matrix_step on fresh random
// matrices (wide, tall, square, odd sizes, expert stacks; every scale mode), the non-finite
// skip, DeviceMuon on a mixed layout, and the CUDA TrainBackend with Muon against the CPU
// backend with Muon after one step. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include "common/error.h"
#include "cuda_test_util.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/muon.h"
#include "optim/muon.h"
#include "optim/muon_workspace.h"
#include "optim/param_groups.h"
#include "train/backend.h"
#include "train/param_rules.h"
#include "train/train_checkpoint.h"

namespace keel {
namespace {

using cuda_bf16 = __nv_bfloat16;
using test::all_close;
using test::DeviceArray;
using test::ints_to_device;
using test::ints_to_host;
using test::minus;
using test::norm_rel_err;
using test::to_device;
using test::to_host;

std::vector<float> randn(std::size_t n, std::uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

struct Case {
  std::int64_t matrices, rows, cols;
  optim::MuonScale scale = optim::MuonScale::kMatchAdamW;
  bool nesterov = true;
};

// One step from a random state (non-zero momentum), host and device gradient scales, decay on.
void step_against_cpu(const Case& k) {
  SCOPED_TRACE(testing::Message() << k.matrices << " x [" << k.rows << ", " << k.cols << "] scale "
                                  << train::to_string(k.scale) << (k.nesterov ? " nesterov" : ""));
  const std::size_t n = static_cast<std::size_t>(k.matrices * k.rows * k.cols), mn = k.rows * k.cols;
  optim::MuonConfig c;
  c.scale = k.scale;
  c.nesterov = k.nesterov;
  c.weight_decay = 0.1;
  const double lr = 0.02;
  const float host_scale = 0.5f, dev_scale = 0.8f;
  const auto seed = static_cast<std::uint64_t>(k.matrices * 1000003 + k.rows * 1009 + k.cols);
  auto p = randn(n, seed, 0.5f), g = randn(n, seed + 1, 1.f), m = randn(n, seed + 2, 0.3f);
  auto d_p = to_device<float>(p), d_g = to_device<float>(g), d_m = to_device<float>(m), d_s = to_device<float>({dev_scale});
  DeviceArray<cuda_bf16> d_pb(n);
  DeviceArray<float> d_upd(n);
  DeviceArray<std::byte> ws(ops::cuda::muon::workspace_bytes(k.matrices, k.rows, k.cols));
  ops::cuda::muon::matrix_step(d_p.get(), d_g.get(), d_m.get(), d_pb.get(), k.matrices, k.rows, k.cols, c, lr, true,
                               host_scale, d_s.get(), ws.get(), ops::cuda::thread_gemm(), nullptr, d_upd.get());
  const std::vector<float> p0 = p;
  std::vector<float> upd(n), scratch(static_cast<std::size_t>(optim::muon_scratch_floats(k.rows, k.cols)));
  optim::muon_matrix_step(p.data(), g.data(), m.data(), k.matrices, k.rows, k.cols, c, lr, true, host_scale * dev_scale,
                          scratch.data(), upd.data());
  const auto gp = to_host(d_p), gm = to_host(d_m), gu = to_host(d_upd), gpb = to_host(d_pb);
  // momentum: the same fp32 operations, bit for bit
  EXPECT_TRUE(all_close(gm, m, 0.f, 0.f, "momentum"));
  // the orthogonalized update: bf16 Newton-Schulz against fp32 (about 2% in Frobenius norm)
  double worst = 0;
  float max_u = 0;
  for (float x : upd) max_u = std::max(max_u, std::fabs(x));
  for (std::int64_t e = 0; e < k.matrices; ++e) {
    const double err = norm_rel_err(gu, upd, e * mn, mn);
    worst = std::max(worst, err);
    EXPECT_LT(err, 0.05) << "update of matrix " << e;
  }
  std::printf("[muon cuda] %lld x [%lld, %lld] %s: update rel error %.4f\n", static_cast<long long>(k.matrices),
              static_cast<long long>(k.rows), static_cast<long long>(k.cols), train::to_string(k.scale), worst);
  EXPECT_TRUE(all_close(gu, upd, 0.f, 0.15f * max_u, "update elements"));
  // parameters: the same decay, an update lr k X within the same tolerance
  std::vector<float> dp_gpu(n), dp_cpu(n);
  for (std::size_t i = 0; i < n; ++i) dp_gpu[i] = gp[i] - p0[i], dp_cpu[i] = p[i] - p0[i];
  EXPECT_LT(norm_rel_err(dp_gpu, dp_cpu, 0, n), 0.05) << "parameter change";
  std::vector<float> want_b(n);
  for (std::size_t i = 0; i < n; ++i) want_b[i] = test::bf16_round(gp[i]);
  EXPECT_TRUE(all_close(gpb, want_b, 0.f, 0.f, "bf16 copy"));
}

TEST(MuonCuda, MatchesCpuOnOddShapes) {
  KEEL_REQUIRE_GPU();
  step_against_cpu({1, 37, 53});    // wide
  step_against_cpu({1, 53, 37});    // tall
  step_against_cpu({1, 64, 64});    // square
  step_against_cpu({1, 1, 41});     // one row
  step_against_cpu({1, 517, 256});  // LM-head-like, tall
  step_against_cpu({1, 96, 33, optim::MuonScale::kExactRms});
  step_against_cpu({1, 33, 96, optim::MuonScale::kKeller, false});
  step_against_cpu({1, 40, 24, optim::MuonScale::kNone});
}

TEST(MuonCuda, MatchesCpuOnExpertStacks) {
  KEEL_REQUIRE_GPU();
  step_against_cpu({4, 12, 40});   // [E, F, D] wide experts
  step_against_cpu({3, 48, 20});   // [E, D, F] tall experts
  step_against_cpu({8, 128, 256});
  step_against_cpu({5, 30, 17, optim::MuonScale::kExactRms});
}

// Wall time of one Muon step on ZAYA1's matrices (printed, not checked): an expert stack
// [16, 2048, 2048], CCA's w_qk [1280, 2048] and o_proj [2048, 1024] (tall). TFLOP/s counts the
// Newton-Schulz GEMMs' 5 (4 s^2 l + 2 s^3) FLOPs over the whole step's time.
TEST(MuonCuda, Timing) {
  KEEL_REQUIRE_GPU();
  struct Shape {
    std::int64_t e, r, c;
  };
  for (const Shape& sh : {Shape{16, 2048, 2048}, Shape{1, 1280, 2048}, Shape{1, 2048, 1024}}) {
    const std::int64_t n = sh.e * sh.r * sh.c, s = std::min(sh.r, sh.c), l = std::max(sh.r, sh.c);
    auto d_p = to_device<float>(randn(n, 21, 0.02f)), d_g = to_device<float>(randn(n, 22, 1e-3f));
    DeviceArray<float> d_m(n);  // zeros: the momentum of a first step
    DeviceArray<cuda_bf16> d_pb(n);
    DeviceArray<std::byte> ws(ops::cuda::muon::workspace_bytes(sh.e, sh.r, sh.c));
    cudaEvent_t t0, t1;
    KEEL_CUDA_CHECK(cudaEventCreate(&t0));
    KEEL_CUDA_CHECK(cudaEventCreate(&t1));
    auto step = [&](const optim::MuonConfig& c) {
      ops::cuda::muon::matrix_step(d_p.get(), d_g.get(), d_m.get(), d_pb.get(), sh.e, sh.r, sh.c, c, 1e-4, true, 1.f,
                                   nullptr, ws.get(), ops::cuda::thread_gemm(), nullptr);
    };
    // The mean of 10 steps after a warm-up (GEMM heuristics), with `ns_steps` iterations.
    auto time_step = [&](int ns_steps) {
      optim::MuonConfig c;
      c.ns_steps = ns_steps;
      const int iters = 10;
      float ms = 0;
      for (int it = 0; it <= iters; ++it) {
        KEEL_CUDA_CHECK(cudaEventRecord(t0, nullptr));
        step(c);
        KEEL_CUDA_CHECK(cudaEventRecord(t1, nullptr));
        KEEL_CUDA_CHECK(cudaEventSynchronize(t1));
        float a = 0;
        KEEL_CUDA_CHECK(cudaEventElapsedTime(&a, t0, t1));
        if (it > 0) ms += a / iters;
      }
      return ms;
    };
    const float ms = time_step(optim::MuonConfig{}.ns_steps);
    // one Newton-Schulz iteration from the difference of 2 and 1; what is left of the 1-iteration
    // step is the elementwise part (momentum, norm, X0, update)
    const float one = time_step(1), iteration = time_step(2) - one;
    const double flop = 5.0 * (4.0 * s * s * l + 2.0 * s * s * s) * sh.e;
    std::printf("muon timing %lld x [%lld, %lld]: %.3f ms (%.0f TFLOP/s); one iteration %.3f ms, elementwise %.3f ms\n",
                (long long)sh.e, (long long)sh.r, (long long)sh.c, ms, flop / ms * 1e-9, iteration, one - iteration);
    if (sh.e > 1) {
      // As a training step runs them: one stack after another for about 150 ms (the 8-layer
      // bench model has 24 such stacks), where sustained GEMM power can lower the clocks.
      const int steps = 24;
      KEEL_CUDA_CHECK(cudaEventRecord(t0, nullptr));
      for (int i = 0; i < steps; ++i) step(optim::MuonConfig{});
      KEEL_CUDA_CHECK(cudaEventRecord(t1, nullptr));
      KEEL_CUDA_CHECK(cudaEventSynchronize(t1));
      float all = 0;
      KEEL_CUDA_CHECK(cudaEventElapsedTime(&all, t0, t1));
      std::printf("muon timing %lld x [%lld, %lld], %d steps back to back: %.3f ms each\n", (long long)sh.e,
                  (long long)sh.r, (long long)sh.c, steps, all / steps);
    }
    cudaEventDestroy(t0);
    cudaEventDestroy(t1);
  }
}

TEST(MuonCuda, NonFiniteDeviceScaleSkipsTheStep) {
  KEEL_REQUIRE_GPU();
  const std::int64_t E = 2, R = 24, C = 40, n = E * R * C;
  auto p = randn(n, 1, 0.5f), g = randn(n, 2, 1.f), m = randn(n, 3, 0.1f);
  auto d_p = to_device<float>(p), d_g = to_device<float>(g), d_m = to_device<float>(m);
  auto d_nan = to_device<float>({std::numeric_limits<float>::quiet_NaN()});
  const std::vector<float> sentinel(n, 3.f);
  auto d_pb = to_device<cuda_bf16>(sentinel);
  DeviceArray<std::byte> ws(ops::cuda::muon::workspace_bytes(E, R, C));
  ops::cuda::muon::matrix_step(d_p.get(), d_g.get(), d_m.get(), d_pb.get(), E, R, C, optim::MuonConfig{}, 0.01, true,
                               1.f, d_nan.get(), ws.get(), ops::cuda::thread_gemm(), nullptr);
  EXPECT_TRUE(all_close(to_host(d_p), p, 0.f, 0.f, "param after a skipped step"));
  EXPECT_TRUE(all_close(to_host(d_m), m, 0.f, 0.f, "momentum after a skipped step"));
  EXPECT_TRUE(all_close(to_host(d_pb), sentinel, 0.f, 0.f, "bf16 copy after a skipped step"));
}

TEST(MuonCuda, DeviceMuonStepsOnlyMuonParameters) {
  KEEL_REQUIRE_GPU();
  train::MuonTrainOptions mo;
  mo.enabled = true;
  mo.lr_scale = 0.5;
  const optim::ParamLayout layout = optim::assign_groups(
      {{"embed.weight", {19, 24}}, {"norm.weight", {24}}, {"attn.wq", {32, 24}}, {"moe.w_down", {3, 24, 10}}},
      train::train_group_rules(mo));
  const auto n = static_cast<std::size_t>(layout.total_floats);
  auto p = randn(n, 11, 0.5f), g = randn(n, 12, 1.f);
  std::vector<float> m(n, 0.f);
  auto d_p = to_device<float>(p), d_g = to_device<float>(g), d_m = to_device<float>(m);
  const std::vector<float> sentinel(n, 3.f);
  auto d_pb = to_device<cuda_bf16>(sentinel);
  DeviceArray<std::byte> ws(ops::cuda::muon::workspace_bytes(layout));
  ops::cuda::muon::DeviceMuon gpu(mo.config);
  optim::Muon cpu(mo.config);
  for (int t = 0; t < 3; ++t) {
    gpu.step(layout, d_p.get(), d_g.get(), d_m.get(), d_pb.get(), 0.01, 1.f, nullptr, ws.get(),
             ops::cuda::thread_gemm(), nullptr);
    cpu.step(layout, p.data(), g.data(), m.data(), 0.01, 1.f);
  }
  const auto gp = to_host(d_p), gpb = to_host(d_pb);
  for (const auto& q : layout.params) {
    const auto o = static_cast<std::size_t>(q.offset), len = static_cast<std::size_t>(q.numel);
    if (q.optimizer == optim::OptimizerKind::kAdamW) {
      for (std::size_t i = o; i < o + len; ++i) {
        ASSERT_EQ(gp[i], p[i]) << q.name << " (AdamW) was touched";
        ASSERT_EQ(gpb[i], 3.f) << q.name << " bf16 copy was touched";
      }
    } else {
      EXPECT_LT(norm_rel_err(gp, p, o, len), 1e-2) << q.name;
    }
  }
  EXPECT_THROW(gpu.step(layout, d_p.get(), d_g.get(), d_m.get(), nullptr, -1.0, 1.f, nullptr, ws.get(),
                        ops::cuda::thread_gemm(), nullptr),
               Error);
  EXPECT_THROW(gpu.step(layout, d_p.get(), d_g.get(), d_m.get(), nullptr, 0.01, 1.f, nullptr, nullptr,
                        ops::cuda::thread_gemm(), nullptr),
               Error);
}

// ------------------------------------------------------------ the CUDA backend with Muon

model::ModelConfig small_config() {
  model::ModelConfig m;
  m.name = "muon-cuda-test";
  m.vocab_size = 517;
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
  m.first_dense_layers = 1;
  m.tied_embeddings = false;
  m.rope_fraction = 0.5;
  m.max_seq_len = 128;
  return m;
}

train::ModelOptions small_options() {
  train::ModelOptions o;
  o.micro_batch = 2;
  o.seq_length = 96;
  o.ce_chunk = 200;
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
    b.targets.push_back(static_cast<std::int32_t>((s >> 33) % vocab));
  }
  return b;
}

TEST(MuonCuda, BackendMatchesCpuBackendAfterOneStep) {
  KEEL_REQUIRE_GPU();
  const auto cfg = small_config();
  const auto opt = small_options();
  train::MuonTrainOptions mo;
  mo.enabled = true;
  const train::OptimizerConfig oc(optim::AdamWConfig{}, mo);
  auto cpu = train::make_cpu_backend(cfg, opt, oc, parallel::Mesh());
  auto gpu = train::make_cuda_backend(cfg, opt, oc, parallel::Mesh());
  const auto& layout = gpu->layout();
  // The memory report names the Muon workspace, as large as the largest matrix batch's.
  std::size_t workspace = 0;
  for (const auto& it : gpu->memory_breakdown())
    if (it.name == "Muon workspace") workspace = it.bytes;
  EXPECT_EQ(workspace, optim::muon_workspace_bytes(layout));
  EXPECT_GT(workspace, 0u);
  std::printf("[muon backend] %s\n", train::memory_report(*gpu).c_str());
  ASSERT_EQ(train::optimizer_share(layout, optim::OptimizerKind::kMuon).tensors,
            train::optimizer_share(cpu->layout(), optim::OptimizerKind::kMuon).tensors);
  ASSERT_GT(train::optimizer_share(layout, optim::OptimizerKind::kMuon).tensors, 0);
  const Batch b = random_batch(opt.micro_batch * opt.seq_length, cfg.vocab_size, 11);
  for (auto* be : {cpu.get(), gpu.get()}) {
    be->zero_grads();
    be->forward(b.tokens.data(), b.targets.data());
    be->backward(1.0f);
  }
  const train::TrainState before = cpu->state();
  const auto sc = cpu->clip_and_step(1.0, 2e-3);
  const auto sg = gpu->clip_and_step(1.0, 2e-3);
  EXPECT_NEAR(sg.grad_norm, sc.grad_norm, 0.03 * sc.grad_norm);
  const train::TrainState tc = cpu->state(), tg = gpu->state();
  double adam_diff = 0, adam_norm = 0;
  for (const auto& q : layout.params) {
    const auto o = static_cast<std::size_t>(q.offset), len = static_cast<std::size_t>(q.numel);
    std::vector<float> uc(len), ug(len);
    for (std::size_t i = 0; i < len; ++i)
      uc[i] = tc.params[o + i] - before.params[o + i], ug[i] = tg.params[o + i] - before.params[o + i];
    if (q.optimizer == optim::OptimizerKind::kMuon) {
      // bf16 activations move the gradients a few % (routers more); Newton-Schulz in bf16 adds ~2%
      const bool router = q.name.find("router") != std::string::npos;
      const double err = norm_rel_err(ug, uc, 0, len);
      std::printf("[muon backend] %-22s update rel error %.4f\n", q.name.c_str(), err);
      EXPECT_LT(err, router ? 0.35 : 0.2) << q.name;
      for (std::size_t i = o; i < o + len; ++i) ASSERT_EQ(tg.adam_v[i], 0.f) << q.name << ": Muon leaves v at zero";
      EXPECT_LT(norm_rel_err(tg.adam_m, tc.adam_m, o, len), router ? 0.2 : 0.1) << q.name << " momentum";
    } else {
      for (std::size_t i = 0; i < len; ++i) adam_diff += double(ug[i] - uc[i]) * (ug[i] - uc[i]), adam_norm += double(uc[i]) * uc[i];
    }
  }
  EXPECT_LT(std::sqrt(adam_diff / adam_norm), 0.25) << "AdamW parameters' update";
  EXPECT_EQ(tg.adamw_step, 1);

  // a few more steps on one batch: the loss falls on the GPU with Muon
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    gpu->zero_grads();
    const double ce = gpu->forward(b.tokens.data(), b.targets.data()).ce;
    gpu->backward(1.0f);
    gpu->clip_and_step(1.0, 1e-2);
    gpu->update_router_bias();
    if (step == 0) first = ce;
    last = ce;
  }
  std::printf("[muon backend] overfit ce %.4f -> %.4f\n", first, last);
  EXPECT_LT(last, 0.5 * first);
  // the GPU's Muon state loads into the CPU backend with Muon (checkpoints move between devices)
  const train::TrainState st = gpu->state();
  EXPECT_NO_THROW(cpu->set_state(st));
  // A checkpoint straight from device memory holds exactly state(): the Muon matrices' v has no
  // GPU memory behind it and is neither read nor stored; loading it back changes nothing.
  const auto root = std::filesystem::temp_directory_path() / ("keel_muon_cuda_view_" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  {
    train::TrainCheckpointer ck(root.string(), {});
    ck.save(1, gpu->checkpoint_view(), layout, nlohmann::json{{"config", ""}});
    ASSERT_TRUE(ck.finish());
  }
  const train::LoadedTrainState got = train::load_train_checkpoint(root.string(), cfg);
  EXPECT_EQ(got.state.params, st.params);
  EXPECT_EQ(got.state.adam_m, st.adam_m);
  EXPECT_EQ(got.state.adam_v, st.adam_v);
  gpu->zero_grads();
  const double loss = gpu->forward(b.tokens.data(), b.targets.data()).total;
  gpu->backward(1.0f);
  gpu->clip_and_step(1.0, 1e-2);
  gpu->set_state(got.state);
  EXPECT_EQ(gpu->state().adam_v, st.adam_v);
  gpu->zero_grads();
  EXPECT_EQ(gpu->forward(b.tokens.data(), b.targets.data()).total, loss);
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace keel
