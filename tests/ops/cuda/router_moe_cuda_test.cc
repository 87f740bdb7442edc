// The CUDA router and dropless MoE against the CPU reference ops (src/ops/router.h, moe.h) on
// fresh random inputs: the router exactly where the math is exact (selection, counts, plan)
// and to fp32 rounding elsewhere; the MoE to bf16 rounding (norm-relative errors).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "common/error.h"
#include "cuda_test_util.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/router.h"
#include "ops/moe.h"
#include "ops/router.h"
#include "tensor/tensor.h"

namespace keel {
namespace {

namespace cpu_router = ops::router;
namespace gpu_router = ops::cuda::router;
namespace cpu_moe = ops::moe;
namespace gpu_moe = ops::cuda::moe;
using ops::cuda::bf16;
using test::all_close;
using test::DeviceArray;
using test::ints_to_device;
using test::ints_to_host;
using test::minus;
using test::norm_rel_err;
using test::random_vector;
using test::rounded_bf16;
using test::to_device;
using test::to_host;

// Smallest gap between consecutive scores (p + bias) among the top_k + 1 best of one row: a
// near-tie there could legitimately pick differently in fp32 on two devices.
float row_margin(const float* logits, const std::vector<float>& bias, int e, int k) {
  double m = -INFINITY, s = 0;
  for (int j = 0; j < e; ++j) m = std::max(m, double(logits[j]));
  for (int j = 0; j < e; ++j) s += std::exp(logits[j] - m);
  std::vector<double> sc(e);
  for (int j = 0; j < e; ++j) sc[j] = std::exp(logits[j] - m) / s + (bias.empty() ? 0.0 : bias[j]);
  std::sort(sc.begin(), sc.end(), std::greater<double>());
  double margin = INFINITY;
  for (int j = 0; j < std::min(k, e - 1); ++j) margin = std::min(margin, sc[j] - sc[j + 1]);
  return static_cast<float>(margin);
}

// Router logits with well separated selections: each row is a random permutation of
// 0.7 * {0..E-1} plus noise of +-0.1, shifted by a random row offset; a row whose scores
// (with the bias) still have a near-tie at the top_k boundary is drawn again.
std::vector<float> separated_logits(std::int64_t n, int e, int k, const std::vector<float>& bias, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> noise(-0.1f, 0.1f), shift(-2.f, 2.f);
  std::vector<float> l(static_cast<std::size_t>(n * e));
  std::vector<int> perm(e);
  for (std::int64_t i = 0; i < n; ++i) {
    float* row = l.data() + i * e;
    do {
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      const float s = shift(rng);
      for (int j = 0; j < e; ++j) row[j] = 0.7f * perm[j] + noise(rng) + s;
    } while (row_margin(row, bias, e, k) < 1e-4f);
  }
  return l;
}

struct RouterCase {
  std::int64_t n;
  int e, k;
  bool renormalize, bias;
};

TEST(RouterCuda, MatchesCpuForwardAndBackward) {
  KEEL_REQUIRE_GPU();
  const RouterCase cases[] = {{37, 4, 1, false, false}, {37, 4, 2, true, true},    {200, 8, 2, false, true},
                              {512, 16, 1, true, false}, {512, 16, 2, true, true},  {300, 64, 4, false, true},
                              {129, 5, 5, true, false}};
  std::uint64_t seed = 100;
  for (const RouterCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "N " << c.n << " E " << c.e << " k " << c.k << " renorm " << c.renormalize
                                      << " bias " << c.bias);
    const std::int64_t n = c.n;
    const int e = c.e, k = c.k;
    std::vector<float> bias = c.bias ? random_vector(e, ++seed, -0.02f, 0.02f) : std::vector<float>{};
    std::vector<float> logits = separated_logits(n, e, k, bias, ++seed);
    std::vector<float> dgates = random_vector(n * k, ++seed);
    const float d_aux = 0.37f, d_z = 0.013f;

    // CPU reference.
    std::vector<float> probs(n * e), lse(n), gates(n * k), dlogits(n * e);
    std::vector<std::int32_t> idx(n * k);
    std::vector<std::int64_t> counts(e);
    cpu_router::Options co{k, c.renormalize};
    const cpu_router::Losses want = cpu_router::forward(
        Tensor(logits.data(), {n, e}), c.bias ? Tensor(bias.data(), {e}) : Tensor(), co, Tensor(probs.data(), {n, e}),
        Tensor(lse.data(), {n}), idx.data(), Tensor(gates.data(), {n, k}), counts.data());
    cpu_router::backward(Tensor(probs.data(), {n, e}), Tensor(lse.data(), {n}), idx.data(), Tensor(gates.data(), {n, k}),
                         counts.data(), co, Tensor(dgates.data(), {n, k}), d_aux, d_z, Tensor(dlogits.data(), {n, e}));

    // GPU.
    auto d_logits = to_device<float>(logits);
    auto d_bias = to_device<float>(bias);
    DeviceArray<float> d_probs(n * e), d_lse(n), d_gates(n * k), d_dlogits(n * e), d_losses(gpu_router::loss_floats(e));
    DeviceArray<std::int32_t> d_idx(n * k), d_counts(e);
    auto d_dgates = to_device<float>(dgates);
    gpu_router::Options go{k, c.renormalize};
    gpu_router::forward(d_logits.get(), c.bias ? d_bias.get() : nullptr, n, e, go, d_probs.get(), d_lse.get(),
                        d_idx.get(), d_gates.get(), d_counts.get(), d_losses.get(), nullptr);
    gpu_router::backward(d_probs.get(), d_lse.get(), d_idx.get(), d_gates.get(), d_counts.get(), n, e, go,
                         d_dgates.get(), d_aux, d_z, d_dlogits.get(), nullptr);
    const gpu_router::Losses got = gpu_router::read_losses(d_losses.get(), nullptr);

    EXPECT_EQ(ints_to_host(d_idx.get(), n * k), idx);
    const std::vector<std::int32_t> got_counts = ints_to_host(d_counts.get(), e);
    for (int j = 0; j < e; ++j) EXPECT_EQ(got_counts[j], counts[j]) << "expert " << j;
    EXPECT_TRUE(all_close(to_host(d_probs), probs, 1e-5f, 1e-7f, "probs"));
    EXPECT_TRUE(all_close(to_host(d_lse), lse, 1e-5f, 1e-6f, "lse"));
    EXPECT_TRUE(all_close(to_host(d_gates), gates, 1e-5f, 1e-7f, "gates"));
    EXPECT_NEAR(got.aux, want.aux, 1e-5 * std::fabs(want.aux) + 1e-6);
    EXPECT_NEAR(got.z, want.z, 1e-5 * std::fabs(want.z) + 1e-6);
    // P_e, the per-expert mean probability, against the CPU probs.
    const std::vector<float> stats = to_host(d_losses);
    for (int j = 0; j < e; ++j) {
      double pm = 0;
      for (std::int64_t i = 0; i < n; ++i) pm += probs[i * e + j];
      EXPECT_NEAR(stats[2 + j], pm / n, 1e-6) << "P_" << j;
    }
    EXPECT_TRUE(all_close(to_host(d_dlogits), dlogits, 1e-4f, 1e-6f, "dlogits"));

    // Without gate gradients: only the aux and z terms.
    std::vector<float> dlogits0(n * e);
    cpu_router::backward(Tensor(probs.data(), {n, e}), Tensor(lse.data(), {n}), idx.data(), Tensor(gates.data(), {n, k}),
                         counts.data(), co, Tensor(), d_aux, d_z, Tensor(dlogits0.data(), {n, e}));
    gpu_router::backward(d_probs.get(), d_lse.get(), d_idx.get(), d_gates.get(), d_counts.get(), n, e, go, nullptr,
                         d_aux, d_z, d_dlogits.get(), nullptr);
    EXPECT_TRUE(all_close(to_host(d_dlogits), dlogits0, 1e-4f, 1e-7f, "dlogits without dgates"));
  }
}

TEST(RouterCuda, TiesGoToTheLowerExpert) {
  KEEL_REQUIRE_GPU();
  const int e = 8, k = 2;
  std::vector<float> logits(2 * e, 0.f);  // row 0: all equal
  for (int j = 0; j < e; ++j) logits[e + j] = 0.25f * (j % 2);  // row 1: ties among the odd experts
  logits[e + 5] = logits[e + 2] = 3.f;                          // ... and a tie at the top: 2 before 5
  auto d_logits = to_device<float>(logits);
  DeviceArray<float> probs(2 * e), lse(2), gates(2 * k), losses(gpu_router::loss_floats(e));
  DeviceArray<std::int32_t> idx(2 * k), counts(e);
  gpu_router::forward(d_logits.get(), nullptr, 2, e, {k, false}, probs.get(), lse.get(), idx.get(), gates.get(),
                      counts.get(), losses.get(), nullptr);
  EXPECT_EQ(ints_to_host(idx.get(), 2 * k), (std::vector<std::int32_t>{0, 1, 2, 5}));
}

TEST(RouterCuda, RejectsBadTopK) {
  KEEL_REQUIRE_GPU();
  DeviceArray<float> buf(64);
  DeviceArray<std::int32_t> ibuf(64);
  EXPECT_THROW(gpu_router::forward(buf.get(), nullptr, 2, 4, {5, false}, buf.get(), buf.get(), ibuf.get(), buf.get(),
                                   ibuf.get(), buf.get(), nullptr),
               Error);
}

// Forced balance (benchmarking): both twins pick class (n * top_k + j) mod F for slot j of
// token n whatever the scores and the bias, so indices and counts match exactly; gates,
// losses and the backward (the normal formulas on that selection) to fp32 rounding.
TEST(RouterCuda, ForcedBalanceMatchesCpu) {
  KEEL_REQUIRE_GPU();
  struct ForcedCase {
    std::int64_t n;
    int e, k, forced;
    bool renormalize;
  };
  const ForcedCase cases[] = {{64, 8, 2, 8, true}, {37, 8, 1, 8, false}, {200, 17, 1, 16, false},
                              {129, 64, 4, 64, true}, {300, 6, 3, 5, true}};
  std::uint64_t seed = 500;
  for (const ForcedCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "N " << c.n << " E " << c.e << " k " << c.k << " forced " << c.forced);
    const std::int64_t n = c.n;
    const int e = c.e, k = c.k;
    std::vector<float> bias = random_vector(e, ++seed, -0.5f, 0.5f);
    std::vector<float> logits = random_vector(n * e, ++seed, -3.f, 3.f);
    std::vector<float> dgates = random_vector(n * k, ++seed);
    const float d_aux = 0.37f, d_z = 0.013f;
    std::vector<float> probs(n * e), lse(n), gates(n * k), dlogits(n * e);
    std::vector<std::int32_t> idx(n * k);
    std::vector<std::int64_t> counts(e);
    cpu_router::Options co{k, c.renormalize, c.forced};
    const cpu_router::Losses want = cpu_router::forward(
        Tensor(logits.data(), {n, e}), Tensor(bias.data(), {e}), co, Tensor(probs.data(), {n, e}),
        Tensor(lse.data(), {n}), idx.data(), Tensor(gates.data(), {n, k}), counts.data());
    cpu_router::backward(Tensor(probs.data(), {n, e}), Tensor(lse.data(), {n}), idx.data(), Tensor(gates.data(), {n, k}),
                         counts.data(), co, Tensor(dgates.data(), {n, k}), d_aux, d_z, Tensor(dlogits.data(), {n, e}));
    for (std::int64_t s = 0; s < n * k; ++s) ASSERT_EQ(idx[s], s % c.forced) << "CPU slot " << s;

    auto d_logits = to_device<float>(logits);
    auto d_bias = to_device<float>(bias);
    DeviceArray<float> d_probs(n * e), d_lse(n), d_gates(n * k), d_dlogits(n * e), d_losses(gpu_router::loss_floats(e));
    DeviceArray<std::int32_t> d_idx(n * k), d_counts(e);
    auto d_dgates = to_device<float>(dgates);
    gpu_router::Options go{k, c.renormalize, c.forced};
    gpu_router::forward(d_logits.get(), d_bias.get(), n, e, go, d_probs.get(), d_lse.get(), d_idx.get(), d_gates.get(),
                        d_counts.get(), d_losses.get(), nullptr);
    gpu_router::backward(d_probs.get(), d_lse.get(), d_idx.get(), d_gates.get(), d_counts.get(), n, e, go,
                         d_dgates.get(), d_aux, d_z, d_dlogits.get(), nullptr);
    const gpu_router::Losses got = gpu_router::read_losses(d_losses.get(), nullptr);
    EXPECT_EQ(ints_to_host(d_idx.get(), n * k), idx);
    const std::vector<std::int32_t> got_counts = ints_to_host(d_counts.get(), e);
    for (int j = 0; j < e; ++j) EXPECT_EQ(got_counts[j], counts[j]) << "expert " << j;
    EXPECT_TRUE(all_close(to_host(d_gates), gates, 1e-5f, 1e-7f, "gates"));
    EXPECT_NEAR(got.aux, want.aux, 1e-5 * std::fabs(want.aux) + 1e-6);
    EXPECT_NEAR(got.z, want.z, 1e-5 * std::fabs(want.z) + 1e-6);
    EXPECT_TRUE(all_close(to_host(d_dlogits), dlogits, 1e-4f, 1e-6f, "dlogits"));
  }
  // top_k above the forced classes (no distinct classes per token) and more than E are rejected.
  DeviceArray<float> buf(64);
  DeviceArray<std::int32_t> ibuf(64);
  for (int forced : {1, 5, -1})
    EXPECT_THROW(gpu_router::forward(buf.get(), nullptr, 2, 4, {2, false, forced}, buf.get(), buf.get(), ibuf.get(),
                                     buf.get(), ibuf.get(), buf.get(), nullptr),
                 Error)
        << "forced " << forced;
}

// Random routing over experts 0..E-2 (distinct per token), so expert E-1 gets no tokens.
std::vector<std::int32_t> random_routing(std::int64_t n, int e, int k, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::int32_t> idx(n * k);
  std::vector<int> pool(e - 1);
  for (std::int64_t i = 0; i < n; ++i) {
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    for (int kk = 0; kk < k; ++kk) idx[i * k + kk] = pool[kk];
  }
  return idx;
}

struct MoeCase {
  std::int64_t n, d, f;
  int e, k;
};

TEST(MoeCuda, MatchesCpuForwardAndBackward) {
  KEEL_REQUIRE_GPU();
  const MoeCase cases[] = {{37, 64, 96, 4, 1}, {200, 128, 64, 8, 2}, {512, 256, 128, 16, 2}, {129, 72, 40, 5, 2}};
  std::uint64_t seed = 500;
  for (const MoeCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "N " << c.n << " D " << c.d << " F " << c.f << " E " << c.e << " k " << c.k);
    const std::int64_t n = c.n, d = c.d, f = c.f, s = c.n * c.k;
    const int e = c.e, k = c.k;
    const std::vector<std::int32_t> idx = random_routing(n, e, k, ++seed);
    std::vector<float> x = rounded_bf16(random_vector(n * d, ++seed));
    std::vector<float> gates = random_vector(n * k, ++seed, 0.1f, 1.f);
    std::vector<float> wg = rounded_bf16(random_vector(e * f * d, ++seed, -1.f / std::sqrt(float(d)), 1.f / std::sqrt(float(d))));
    std::vector<float> wu = rounded_bf16(random_vector(e * f * d, ++seed, -1.f / std::sqrt(float(d)), 1.f / std::sqrt(float(d))));
    std::vector<float> wd = rounded_bf16(random_vector(e * d * f, ++seed, -1.f / std::sqrt(float(f)), 1.f / std::sqrt(float(f))));
    std::vector<float> dy = random_vector(n * d, ++seed);
    // Nonzero starting gradients: the weight gradients must be accumulated into them.
    const std::vector<float> g0_gate = random_vector(e * f * d, ++seed), g0_up = random_vector(e * f * d, ++seed),
                             g0_down = random_vector(e * d * f, ++seed);

    // CPU reference.
    const cpu_moe::Plan plan = cpu_moe::make_plan(idx.data(), n, k, e);
    std::vector<float> xs(s * d), hg(s * f), hu(s * f), act(s * f), ys(s * d), y(n * d);
    cpu_moe::Weights cw{Tensor(wg.data(), {e, f, d}), Tensor(wu.data(), {e, f, d}), Tensor(wd.data(), {e, d, f})};
    cpu_moe::Saved csv{Tensor(xs.data(), {s, d}), Tensor(hg.data(), {s, f}), Tensor(hu.data(), {s, f}),
                       Tensor(act.data(), {s, f}), Tensor(ys.data(), {s, d})};
    cpu_moe::forward(plan, Tensor(x.data(), {n, d}), Tensor(gates.data(), {n, k}), cw, csv, Tensor(y.data(), {n, d}));
    std::vector<float> scratch(cpu_moe::backward_scratch_floats(s, d, f)), dx(n * d), dgates(n * k);
    std::vector<float> dwg = g0_gate, dwu = g0_up, dwd = g0_down;
    cpu_moe::backward(plan, Tensor(x.data(), {n, d}), Tensor(gates.data(), {n, k}), cw, csv, Tensor(dy.data(), {n, d}),
                      Tensor(scratch.data(), {static_cast<std::int64_t>(scratch.size())}), Tensor(dx.data(), {n, d}),
                      Tensor(dgates.data(), {n, k}),
                      cpu_moe::Weights{Tensor(dwg.data(), {e, f, d}), Tensor(dwu.data(), {e, f, d}),
                                       Tensor(dwd.data(), {e, d, f})});

    // GPU: plan.
    auto d_idx = ints_to_device(idx);
    DeviceArray<std::int32_t> ws(gpu_moe::plan_ints(s, e));
    const gpu_moe::Plan gp = gpu_moe::make_plan(d_idx.get(), n, k, e, ws.get(), nullptr);
    ASSERT_EQ(gp.host_offsets, plan.offsets);
    EXPECT_EQ(gp.count(e - 1), 0);
    EXPECT_EQ(ints_to_host(gp.source, s), plan.source);
    EXPECT_EQ(ints_to_host(gp.position, s), plan.position);
    const std::vector<std::int32_t> offs = ints_to_host(gp.offsets, e + 1);
    for (int j = 0; j <= e; ++j) EXPECT_EQ(offs[j], plan.offsets[j]);

    // GPU: forward.
    auto d_x = to_device<bf16>(x);
    auto d_gates = to_device<float>(gates);
    auto d_wg = to_device<bf16>(wg), d_wu = to_device<bf16>(wu), d_wd = to_device<bf16>(wd);
    DeviceArray<bf16> d_xs(s * d), d_hg(s * f), d_hu(s * f), d_act(s * f), d_ys(s * d);
    DeviceArray<float> d_y(n * d);
    const gpu_moe::Weights gw{d_wg.get(), d_wu.get(), d_wd.get()};
    const gpu_moe::Saved gsv{d_xs.get(), d_hg.get(), d_hu.get(), d_act.get(), d_ys.get()};
    gpu_moe::forward(gp, d_x.get(), d_gates.get(), gw, d, f, gsv, d_y.get(), nullptr);
    EXPECT_EQ(to_host(d_xs), xs);  // the gather is a copy
    const double e_h = norm_rel_err(to_host(d_hg), hg), e_act = norm_rel_err(to_host(d_act), act),
                 e_ys = norm_rel_err(to_host(d_ys), ys), e_y = norm_rel_err(to_host(d_y), y);
    EXPECT_LT(e_h, 1e-2);
    EXPECT_LT(e_act, 1e-2);
    EXPECT_LT(e_ys, 1.5e-2);
    EXPECT_LT(e_y, 1.5e-2);

    // GPU: backward.
    auto d_dy = to_device<float>(dy);
    DeviceArray<char> d_scratch(gpu_moe::backward_scratch_bytes(s, d, f));
    DeviceArray<bf16> d_dx(n * d);
    DeviceArray<float> d_dgates(n * k);
    auto d_dwg = to_device<float>(g0_gate), d_dwu = to_device<float>(g0_up), d_dwd = to_device<float>(g0_down);
    gpu_moe::backward(gp, d_gates.get(), gw, d, f, gsv, d_dy.get(), d_scratch.get(), d_dx.get(), d_dgates.get(),
                      gpu_moe::Grads{d_dwg.get(), d_dwu.get(), d_dwd.get()}, nullptr);
    const std::vector<float> got_dwg = to_host(d_dwg), got_dwu = to_host(d_dwu), got_dwd = to_host(d_dwd);
    const double e_dx = norm_rel_err(to_host(d_dx), dx), e_dg = norm_rel_err(to_host(d_dgates), dgates),
                 e_wg = norm_rel_err(minus(got_dwg, g0_gate), minus(dwg, g0_gate)),
                 e_wu = norm_rel_err(minus(got_dwu, g0_up), minus(dwu, g0_up)),
                 e_wd = norm_rel_err(minus(got_dwd, g0_down), minus(dwd, g0_down));
    EXPECT_LT(e_dx, 2e-2);
    EXPECT_LT(e_dg, 1.5e-2);
    EXPECT_LT(e_wg, 2e-2);
    EXPECT_LT(e_wu, 2e-2);
    EXPECT_LT(e_wd, 1.5e-2);
    // The idle expert's gradients are untouched, bit for bit.
    for (std::int64_t i = (e - 1) * f * d; i < e * f * d; ++i) {
      ASSERT_EQ(got_dwg[i], g0_gate[i]);
      ASSERT_EQ(got_dwu[i], g0_up[i]);
      ASSERT_EQ(got_dwd[i], g0_down[i]);
    }
    std::printf("moe N=%lld D=%lld F=%lld E=%d k=%d rel err: h %.1e act %.1e ys %.1e y %.1e | dx %.1e dgates %.1e "
                "dWg %.1e dWu %.1e dWd %.1e\n",
                (long long)n, (long long)d, (long long)f, e, k, e_h, e_act, e_ys, e_y, e_dx, e_dg, e_wg, e_wu, e_wd);

    // Skipping gradients: dx and dgates only must give the same dx.
    DeviceArray<bf16> d_dx2(n * d);
    gpu_moe::backward(gp, d_gates.get(), gw, d, f, gsv, d_dy.get(), d_scratch.get(), d_dx2.get(), nullptr, {}, nullptr);
    EXPECT_EQ(to_host(d_dx2), to_host(d_dx));

    // Overwriting (a step's first micro-batch): the gradients without the starting values, and
    // zeros, not the starting values, for the idle expert.
    auto o_dwg = to_device<float>(g0_gate), o_dwu = to_device<float>(g0_up), o_dwd = to_device<float>(g0_down);
    gpu_moe::backward(gp, d_gates.get(), gw, d, f, gsv, d_dy.get(), d_scratch.get(), d_dx2.get(), nullptr,
                      gpu_moe::Grads{o_dwg.get(), o_dwu.get(), o_dwd.get(), /*overwrite=*/true}, nullptr);
    const std::vector<float> ow_g = to_host(o_dwg), ow_u = to_host(o_dwu), ow_d = to_host(o_dwd);
    EXPECT_LT(norm_rel_err(ow_g, minus(dwg, g0_gate)), 2e-2);
    EXPECT_LT(norm_rel_err(ow_u, minus(dwu, g0_up)), 2e-2);
    EXPECT_LT(norm_rel_err(ow_d, minus(dwd, g0_down)), 1.5e-2);
    for (std::int64_t i = (e - 1) * f * d; i < e * f * d; ++i) {
      ASSERT_EQ(ow_g[i], 0.f);
      ASSERT_EQ(ow_u[i], 0.f);
      ASSERT_EQ(ow_d[i], 0.f);
    }
  }
}

// A plan with Plan::rows reads x and dy and writes y and dx at those rows of larger tensors,
// leaving the other rows alone, and computes exactly what the plain plan computes on the rows
// packed by hand (the same kernels in the same order): ZAYA1's kept tokens without copies. Both
// the 8-column and the element-wise kernels (d % 8 != 0).
TEST(MoeCuda, PlanRowsReadAndWriteInPlace) {
  KEEL_REQUIRE_GPU();
  for (const std::int64_t d : {64, 36}) {
    SCOPED_TRACE(d);
    const std::int64_t full = 300, n = 170, f = 48;
    const int e = 5, k = 2;
    const std::int64_t s = n * k;
    std::vector<std::int32_t> order(full);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937_64(d));
    const std::vector<std::int32_t> rows(order.begin(), order.begin() + n);  // any order, no repeats
    const std::vector<std::int32_t> idx = random_routing(n, e, k, 90 + d);
    const std::vector<float> x = rounded_bf16(random_vector(full * d, 91 + d)), dy = random_vector(full * d, 92 + d);
    const std::vector<float> gates = random_vector(n * k, 93 + d, 0.1f, 1.f);
    const float a = 1.f / std::sqrt(float(d));
    const std::vector<float> wg = rounded_bf16(random_vector(e * f * d, 94 + d, -a, a)),
                             wu = rounded_bf16(random_vector(e * f * d, 95 + d, -a, a)),
                             wd = rounded_bf16(random_vector(e * d * f, 96 + d, -a, a));
    std::vector<float> xp(n * d), dyp(n * d);
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t c = 0; c < d; ++c) {
        xp[t * d + c] = x[rows[t] * d + c];
        dyp[t * d + c] = dy[rows[t] * d + c];
      }
    auto d_idx = ints_to_device(idx);
    auto d_rows = ints_to_device(rows);
    DeviceArray<std::int32_t> ws(gpu_moe::plan_ints(s, e));
    const gpu_moe::Plan packed = gpu_moe::make_plan(d_idx.get(), n, k, e, ws.get(), nullptr);
    gpu_moe::Plan in_place = packed;
    in_place.rows = d_rows.get();
    auto d_wg = to_device<bf16>(wg), d_wu = to_device<bf16>(wu), d_wd = to_device<bf16>(wd);
    const gpu_moe::Weights gw{d_wg.get(), d_wu.get(), d_wd.get()};
    auto d_gates = to_device<float>(gates);
    struct Run {
      std::vector<float> xs, y, dx, dgates, dwg, dwu, dwd;
    };
    const float sentinel = 7.f;
    auto run = [&](const gpu_moe::Plan& plan, const std::vector<float>& xin, const std::vector<float>& dyin,
                   std::int64_t rows_out) {
      auto d_x = to_device<bf16>(xin);
      auto d_dy = to_device<float>(dyin);
      DeviceArray<bf16> xs(s * d), hg(s * f), hu(s * f), act(s * f), ys(s * d);
      auto y = to_device<float>(std::vector<float>(rows_out * d, sentinel));
      const gpu_moe::Saved sv{xs.get(), hg.get(), hu.get(), act.get(), ys.get()};
      gpu_moe::forward(plan, d_x.get(), d_gates.get(), gw, d, f, sv, y.get(), nullptr);
      DeviceArray<char> scratch(gpu_moe::backward_scratch_bytes(s, d, f));
      auto dx = to_device<float>(std::vector<float>(rows_out * d, sentinel));
      DeviceArray<float> dgates(n * k);
      const std::vector<float> zeros(static_cast<std::size_t>(e * f * d), 0.f);
      auto dwg = to_device<float>(zeros), dwu = to_device<float>(zeros), dwd = to_device<float>(zeros);
      gpu_moe::backward_f32(plan, d_gates.get(), gw, d, f, sv, d_dy.get(), scratch.get(), dx.get(), dgates.get(),
                            gpu_moe::Grads{dwg.get(), dwu.get(), dwd.get()}, nullptr);
      return Run{to_host(xs), to_host(y), to_host(dx), to_host(dgates), to_host(dwg), to_host(dwu), to_host(dwd)};
    };
    const Run want = run(packed, xp, dyp, n);
    const Run got = run(in_place, x, dy, full);
    EXPECT_EQ(got.xs, want.xs);
    EXPECT_EQ(got.dgates, want.dgates);
    EXPECT_EQ(got.dwg, want.dwg);
    EXPECT_EQ(got.dwu, want.dwu);
    EXPECT_EQ(got.dwd, want.dwd);
    std::vector<bool> named(full, false);
    for (std::int64_t t = 0; t < n; ++t) named[rows[t]] = true;
    for (std::int64_t r = 0; r < full; ++r)
      for (std::int64_t c = 0; c < d; ++c)
        if (!named[r]) {
          ASSERT_EQ(got.y[r * d + c], sentinel) << "row " << r;
          ASSERT_EQ(got.dx[r * d + c], sentinel) << "row " << r;
        }
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t c = 0; c < d; ++c) {
        ASSERT_EQ(got.y[rows[t] * d + c], want.y[t * d + c]) << "token " << t;
        ASSERT_EQ(got.dx[rows[t] * d + c], want.dx[t * d + c]) << "token " << t;
      }
    // backward_f32's dx is backward's before its bf16 rounding.
    auto d_xp = to_device<bf16>(xp);
    auto d_dyp = to_device<float>(dyp);
    DeviceArray<bf16> xs(s * d), hg(s * f), hu(s * f), act(s * f), ys(s * d), dx_bf(n * d);
    DeviceArray<float> y(n * d);
    const gpu_moe::Saved sv{xs.get(), hg.get(), hu.get(), act.get(), ys.get()};
    gpu_moe::forward(packed, d_xp.get(), d_gates.get(), gw, d, f, sv, y.get(), nullptr);
    DeviceArray<char> scratch(gpu_moe::backward_scratch_bytes(s, d, f));
    gpu_moe::backward(packed, d_gates.get(), gw, d, f, sv, d_dyp.get(), scratch.get(), dx_bf.get(), nullptr, {},
                      nullptr);
    EXPECT_EQ(to_host(dx_bf), rounded_bf16(want.dx));
  }
}

// An overwriting backward over no tokens (no expert got a row) leaves every expert's gradient
// zero; an accumulating one leaves them as they were.
TEST(MoeCuda, OverwriteWithNoTokensZeroesEveryExpert) {
  KEEL_REQUIRE_GPU();
  const std::int64_t d = 32, f = 48;
  const int e = 3;
  DeviceArray<std::int32_t> ws(gpu_moe::plan_ints(0, e));
  const gpu_moe::Plan gp = gpu_moe::make_plan(nullptr, 0, 1, e, ws.get(), nullptr);
  const std::vector<float> g0 = random_vector(e * f * d, 77);
  auto dwg = to_device<float>(g0), dwu = to_device<float>(g0), dwd = to_device<float>(g0);
  const gpu_moe::Saved none{};
  gpu_moe::backward(gp, nullptr, {}, d, f, none, nullptr, nullptr, nullptr, nullptr,
                    gpu_moe::Grads{dwg.get(), dwu.get(), dwd.get(), /*overwrite=*/false}, nullptr);
  EXPECT_EQ(to_host(dwg), g0);
  gpu_moe::backward(gp, nullptr, {}, d, f, none, nullptr, nullptr, nullptr, nullptr,
                    gpu_moe::Grads{dwg.get(), dwu.get(), dwd.get(), /*overwrite=*/true}, nullptr);
  const std::vector<float> zeros(static_cast<std::size_t>(e * f * d), 0.f);
  EXPECT_EQ(to_host(dwg), zeros);
  EXPECT_EQ(to_host(dwu), zeros);
  EXPECT_EQ(to_host(dwd), zeros);
}

// A plan over a count of tokens held on the device (make_plan's device_tokens) is the plan of
// that prefix, for counts inside, at and past the buffer's length.
TEST(MoeCuda, PlanOverADeviceCountIsThePlanOfThePrefix) {
  KEEL_REQUIRE_GPU();
  const std::int64_t n = 300;
  const int e = 6, k = 2;
  const std::vector<std::int32_t> idx = random_routing(n, e, k, 41);
  auto d_idx = ints_to_device(idx);
  for (const std::int32_t count : {0, 1, 137, 300, 400}) {
    SCOPED_TRACE(count);
    const std::int64_t used = std::min<std::int64_t>(count, n);
    auto d_count = ints_to_device({count});
    DeviceArray<std::int32_t> ws(gpu_moe::plan_ints(n * k, e)), ws_prefix(gpu_moe::plan_ints(n * k, e));
    const gpu_moe::Plan got = gpu_moe::make_plan(d_idx.get(), n, k, e, ws.get(), nullptr, d_count.get());
    const gpu_moe::Plan want = gpu_moe::make_plan(d_idx.get(), used, k, e, ws_prefix.get(), nullptr);
    EXPECT_EQ(got.tokens, used);
    EXPECT_EQ(got.host_offsets, want.host_offsets);
    EXPECT_EQ(ints_to_host(got.source, used * k), ints_to_host(want.source, used * k));
    EXPECT_EQ(ints_to_host(got.position, used * k), ints_to_host(want.position, used * k));
  }
}

TEST(MoeCuda, PlanRejectsExpertOutOfRange) {
  KEEL_REQUIRE_GPU();
  auto d_idx = ints_to_device({0, 1, 4, 2});
  DeviceArray<std::int32_t> ws(gpu_moe::plan_ints(4, 4));
  EXPECT_THROW(gpu_moe::make_plan(d_idx.get(), 4, 1, 4, ws.get(), nullptr), Error);
}

// Wall time of one MoE layer at training-like sizes (printed, not checked): top-2 of 16 experts
// of width 1024, and ZAYA1's top-1 of 16 of width 2048; routing uniform at random, so each
// expert gets about N k / E rows.
TEST(MoeCuda, Timing) {
  KEEL_REQUIRE_GPU();
  struct Case {
    std::int64_t n, d, f;
    int e, k;
  };
  for (const Case& c : {Case{8192, 2048, 1024, 16, 2}, Case{8192, 2048, 2048, 16, 1}}) {
    const std::int64_t n = c.n, d = c.d, f = c.f, s = c.n * c.k;
    const int e = c.e, k = c.k;
    std::vector<std::int32_t> idx(s);
    std::mt19937_64 rng(7);
    for (std::int64_t i = 0; i < n; ++i) {  // k distinct experts per token
      const int a = int(rng() % e);
      for (int j = 0; j < k; ++j) idx[i * k + j] = (a + j) % e;
    }
    auto d_idx = ints_to_device(idx);
    DeviceArray<std::int32_t> ws(gpu_moe::plan_ints(s, e));
    auto d_x = to_device<bf16>(random_vector(n * d, 1));
    auto d_gates = to_device<float>(random_vector(n * k, 2, 0.1f, 1.f));
    auto d_wg = to_device<bf16>(random_vector(e * f * d, 3, -0.02f, 0.02f));
    auto d_wu = to_device<bf16>(random_vector(e * f * d, 4, -0.02f, 0.02f));
    auto d_wd = to_device<bf16>(random_vector(e * d * f, 5, -0.02f, 0.02f));
    auto d_dy = to_device<float>(random_vector(n * d, 6));
    DeviceArray<bf16> xs(s * d), hg(s * f), hu(s * f), act(s * f), ys(s * d), dx(n * d);
    DeviceArray<float> y(n * d), dgates(n * k), dwg(e * f * d), dwu(e * f * d), dwd(e * d * f);
    DeviceArray<char> scratch(gpu_moe::backward_scratch_bytes(s, d, f));
    const gpu_moe::Weights gw{d_wg.get(), d_wu.get(), d_wd.get()};
    const gpu_moe::Saved sv{xs.get(), hg.get(), hu.get(), act.get(), ys.get()};
    cudaEvent_t t0, t1, t2;
    KEEL_CUDA_CHECK(cudaEventCreate(&t0));
    KEEL_CUDA_CHECK(cudaEventCreate(&t1));
    KEEL_CUDA_CHECK(cudaEventCreate(&t2));
    float fwd_ms = 0, bwd_ms = 0;
    double host_ms = 0;  // enqueueing forward (after the plan's sync) and backward, on the host
    const int iters = 10;
    for (int it = 0; it <= iters; ++it) {  // iteration 0 warms up (GEMM heuristics)
      KEEL_CUDA_CHECK(cudaEventRecord(t0, nullptr));
      const gpu_moe::Plan p = gpu_moe::make_plan(d_idx.get(), n, k, e, ws.get(), nullptr);
      const auto h0 = std::chrono::steady_clock::now();
      gpu_moe::forward(p, d_x.get(), d_gates.get(), gw, d, f, sv, y.get(), nullptr);
      KEEL_CUDA_CHECK(cudaEventRecord(t1, nullptr));
      gpu_moe::backward(p, d_gates.get(), gw, d, f, sv, d_dy.get(), scratch.get(), dx.get(), dgates.get(),
                        gpu_moe::Grads{dwg.get(), dwu.get(), dwd.get()}, nullptr);
      const double enqueue_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - h0).count();
      KEEL_CUDA_CHECK(cudaEventRecord(t2, nullptr));
      KEEL_CUDA_CHECK(cudaEventSynchronize(t2));
      float a = 0, b = 0;
      KEEL_CUDA_CHECK(cudaEventElapsedTime(&a, t0, t1));
      KEEL_CUDA_CHECK(cudaEventElapsedTime(&b, t1, t2));
      if (it > 0) fwd_ms += a / iters, bwd_ms += b / iters, host_ms += enqueue_ms / iters;
    }
    const double fwd_flop = 2.0 * s * d * f * 3;
    std::printf("moe timing N=%lld D=%lld F=%lld E=%d k=%d: plan+forward %.3f ms (%.0f TFLOP/s), backward %.3f ms "
                "(%.0f TFLOP/s); host enqueue %.3f ms\n",
                (long long)n, (long long)d, (long long)f, e, k, fwd_ms, fwd_flop / fwd_ms * 1e-9, bwd_ms,
                2 * fwd_flop / bwd_ms * 1e-9, host_ms);
    cudaEventDestroy(t0);
    cudaEventDestroy(t1);
    cudaEventDestroy(t2);
  }
}

}  // namespace
}  // namespace keel
