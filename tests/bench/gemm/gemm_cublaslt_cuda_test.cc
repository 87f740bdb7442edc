// GPU path of `keel bench gemm`: cuBLASLt in every dtype and layout, autotuning and the tune
// cache, each checked on sampled outputs against the double-precision host reference. Skips
// cleanly where no GPU is visible (CI builds this with CUDA but has no GPU).
#include <gtest/gtest.h>

#include "device/cuda_devices.h"

#include <filesystem>

#include "bench/gemm/backend.h"
#include "bench/gemm/check.h"
#include "bench/gemm/runner.h"
#include "common/error.h"

namespace keel::bench {
namespace {

#define SKIP_WITHOUT_GPU() \
  if (visible_cuda_devices() == 0) GTEST_SKIP() << "no CUDA device visible"

GemmPlan quick_plan() {
  GemmPlan p;
  p.warmup = 1;
  p.iters = 3;
  p.candidates = 4;
  p.tune_iters = 2;
  p.check_samples = 48;
  return p;
}

GemmCheckOutcome run_and_check(GemmBackend& b, GemmShape s, GemmType t, const GemmPlan& plan, GemmResult* out = nullptr) {
  GemmResult r = b.run(s, t, plan, gemm_check_positions(s, plan.check_samples, 5));
  EXPECT_TRUE(r.skipped.empty()) << r.skipped;
  EXPECT_TRUE(r.checked);
  EXPECT_EQ(r.nonfinite, 0u);
  EXPECT_EQ(r.seconds.size(), static_cast<std::size_t>(plan.iters));
  const GemmCheckOutcome c = check_gemm(r, t, s.k);
  if (out) *out = r;
  return c;
}

}  // namespace

TEST(GemmCublasLt, EveryTypeAndLayoutChecksOut) {
  SKIP_WITHOUT_GPU();
  auto backend = make_cublaslt_backend(0, "");
  for (GemmType t : {GemmType::kBF16, GemmType::kFP16, GemmType::kFP32, GemmType::kTF32})
    for (Layout l : {Layout::kNN, Layout::kNT, Layout::kTN, Layout::kTT})
      for (auto [m, n, k, b] : {std::array<std::int64_t, 4>{256, 384, 512, 1}, {131, 77, 1000, 1}, {64, 128, 4096, 4}}) {
        GemmShape s;
        s.m = m, s.n = n, s.k = k, s.batch = b, s.layout = l;
        SCOPED_TRACE(fmt::format("{} {}x{}x{}x{} {}", gemm_type_name(t), m, n, k, b, layout_name(l)));
        const GemmCheckOutcome c = run_and_check(*backend, s, t, quick_plan());
        EXPECT_EQ(c.wrong, 0) << c.first_wrong;
        EXPECT_LT(c.worst_ratio, 1.0);
      }
}

TEST(GemmCublasLt, Fp8WithScalesChecksOut) {
  SKIP_WITHOUT_GPU();
  auto backend = make_cublaslt_backend(0, "");
  if (!backend->unsupported_type(GemmType::kFP8).empty()) GTEST_SKIP() << backend->unsupported_type(GemmType::kFP8);
  for (auto [m, n, k, b] : {std::array<std::int64_t, 4>{256, 256, 256, 1}, {1024, 2048, 4096, 1}, {512, 256, 1024, 3}}) {
    GemmShape s;
    s.m = m, s.n = n, s.k = k, s.batch = b, s.layout = Layout::kNT;
    GemmResult r;
    const GemmCheckOutcome c = run_and_check(*backend, s, GemmType::kFP8, quick_plan(), &r);
    EXPECT_EQ(c.wrong, 0) << c.first_wrong;
    EXPECT_DOUBLE_EQ(r.scale, 0.125);
  }
}

TEST(GemmCublasLt, AutotunesReportsTilesAndReusesTheCache) {
  SKIP_WITHOUT_GPU();
  const auto path = std::filesystem::temp_directory_path() / "keel_gemm_tune_test.json";
  std::filesystem::remove(path);
  GemmShape s;
  s.m = s.n = s.k = 2048;
  GemmPlan plan = quick_plan();
  plan.tune_cache = path.string();
  {
    auto backend = make_cublaslt_backend(0, path.string());
    GemmResult r;
    EXPECT_EQ(run_and_check(*backend, s, GemmType::kBF16, plan, &r).wrong, 0);
    EXPECT_EQ(r.algo.source, "autotuned");
    EXPECT_GE(r.algo.candidates, 1);
    EXPECT_GT(r.algo.tile_m, 0);
    EXPECT_GT(r.algo.tile_n, 0);
    EXPECT_GT(r.rotating_sets, 1);  // 24 MiB per set: several to exceed 4 x L2
    backend->save_tuning();
  }
  ASSERT_TRUE(std::filesystem::exists(path));
  auto backend = make_cublaslt_backend(0, path.string());
  GemmResult again;
  EXPECT_EQ(run_and_check(*backend, s, GemmType::kBF16, plan, &again).wrong, 0);
  EXPECT_EQ(again.algo.source, "cache");
  plan.retune = true;
  EXPECT_EQ(run_and_check(*backend, s, GemmType::kBF16, plan, &again).wrong, 0);
  EXPECT_EQ(again.algo.source, "autotuned");
  std::filesystem::remove(path);
}

TEST(GemmCublasLt, CorruptionAndImpossibleSizesAreCaught) {
  SKIP_WITHOUT_GPU();
  auto backend = make_cublaslt_backend(0, "");
  GemmShape s;
  s.m = 512, s.n = 256, s.k = 128;
  GemmPlan plan = quick_plan();
  plan.corrupt = true;
  GemmResult r = backend->run(s, GemmType::kBF16, plan, gemm_check_positions(s, 16, 1));
  EXPECT_EQ(check_gemm(r, GemmType::kBF16, s.k).wrong, 1);
  GemmShape huge;
  huge.m = huge.n = huge.k = 1 << 20;  // 6 TiB of bf16 operands
  try {
    backend->check_fits(huge, GemmType::kBF16, plan);
    FAIL() << "a 6 TiB GEMM fits?";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out of memory"), std::string::npos) << e.what();
  }
}

}  // namespace keel::bench
