#include <gtest/gtest.h>

#include <filesystem>

#include "bench/gemm/backend.h"
#include "bench/gemm/check.h"
#include "bench/gemm/runner.h"
#include "bench/gemm/tune_cache.h"
#include "common/error.h"
#include "common/fileio.h"

namespace keel::bench {
namespace {

GemmPlan quick_plan() {
  GemmPlan p;
  p.warmup = 1;
  p.iters = 3;
  p.check_samples = 32;
  p.rotate_bytes = 1 << 20;
  return p;
}

}  // namespace

TEST(GemmOpenBlas, EveryLayoutAndBatchChecksOut) {
  auto backend = make_openblas_backend(2);
  for (Layout l : {Layout::kNN, Layout::kNT, Layout::kTN, Layout::kTT})
    for (auto [m, n, k, b] : {std::array<std::int64_t, 4>{1, 1, 1, 1}, {37, 53, 91, 1}, {64, 48, 300, 3}}) {
      GemmShape s;
      s.m = m, s.n = n, s.k = k, s.batch = b, s.layout = l;
      SCOPED_TRACE(fmt::format("{}x{}x{}x{} {}", m, n, k, b, layout_name(l)));
      GemmPlan plan = quick_plan();
      const auto pos = gemm_check_positions(s, plan.check_samples, 3);
      GemmResult r = backend->run(s, GemmType::kFP32, plan, pos);
      ASSERT_EQ(r.seconds.size(), 3u);
      EXPECT_TRUE(r.checked);
      EXPECT_EQ(r.nonfinite, 0u);
      EXPECT_GE(r.rotating_sets, 1);
      const GemmCheckOutcome c = check_gemm(r, GemmType::kFP32, k);
      EXPECT_EQ(c.wrong, 0) << c.first_wrong;
      EXPECT_EQ(c.samples, static_cast<int>(pos.size()));
    }
}

TEST(GemmOpenBlas, CorruptionAndBadTypesAreCaught) {
  auto backend = make_openblas_backend(1);
  GemmShape s;
  s.m = 40, s.n = 30, s.k = 20;
  GemmPlan plan = quick_plan();
  plan.corrupt = true;
  GemmResult r = backend->run(s, GemmType::kFP32, plan, gemm_check_positions(s, 8, 1));
  EXPECT_EQ(check_gemm(r, GemmType::kFP32, s.k).wrong, 1);
  EXPECT_NE(backend->unsupported_type(GemmType::kBF16), "");
  EXPECT_EQ(backend->unsupported_type(GemmType::kFP32), "");
  GemmOptions o;
  o.dtypes = {GemmType::kFP8};
  o.shapes = {s};
  EXPECT_THROW(resolve_gemm_options(o, *backend), UsageError);
  GemmShape huge;
  huge.m = huge.n = huge.k = 1 << 22;  // 3 x 64 TiB
  EXPECT_THROW(backend->check_fits(huge, GemmType::kFP32, plan), Error);
}

TEST(GemmOpenBlas, RunnerReportsMedianAndPeakFromTheOverride) {
  auto backend = make_openblas_backend(2);
  GemmOptions o;
  o.shapes = shapes_from_ranges({32, 64}, {48}, {16}, Layout::kNT);
  o.plan = quick_plan();
  o.peak_tflops = 1.0;
  resolve_gemm_options(o, *backend);
  ASSERT_EQ(o.dtypes, (std::vector<GemmType>{GemmType::kFP32}));
  GemmReport rep = run_gemm_bench(*backend, o, nullptr);
  ASSERT_EQ(rep.rows.size(), 2u);
  for (const auto& r : rep.rows) {
    EXPECT_NEAR(r.tflops, r.flops / (r.median_us * 1e-6) / 1e12, 1e-9 * r.tflops);
    EXPECT_NEAR(r.pct_peak, 100.0 * r.tflops, 1e-9);
    EXPECT_LE(r.min_us, r.median_us);
    EXPECT_EQ(r.wrong, 0);
    EXPECT_EQ(r.samples, 32);
  }
}

TEST(GemmTuneCache, RoundTripsAndMerges) {
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("keel_tune_{}", ::testing::UnitTest::GetInstance()->random_seed());
  std::filesystem::remove_all(dir);
  const std::string path = (dir / "sub" / "tune.json").string();
  const std::string k1 = tune_key("NVIDIA H200", 132, "13.0.0", "bf16", "nn", 8192, 8192, 8192, 1, 32 << 20);
  const std::string k2 = tune_key("NVIDIA H200", 132, "13.0.0", "bf16", "nt", 8192, 8192, 8192, 1, 32 << 20);
  EXPECT_NE(k1, k2);
  {
    TuneCache c(path);
    EXPECT_FALSE(c.find(k1));
    c.put(k1, {{1, 2, 255}, "algo 1", 12.5, ""});
    c.save();
  }
  {
    TuneCache other(path);  // another run adds its own entry
    other.put(k2, {{7}, "algo 7", 3, ""});
    TuneCache late(path);   // opened before other saved: must not lose k2 when it saves
    other.save();
    late.put(k1, {{9, 9}, "algo 9", 1, ""});
    late.save();
  }
  TuneCache c(path);
  ASSERT_TRUE(c.find(k1));
  EXPECT_EQ(c.find(k1)->algo, (std::vector<std::uint8_t>{9, 9}));
  ASSERT_TRUE(c.find(k2));
  EXPECT_EQ(c.find(k2)->description, "algo 7");
  EXPECT_FALSE(c.find(k2)->tuned_at.empty());
  write_file_atomically(path, "{not json");
  EXPECT_THROW(TuneCache{path}, Error);
  std::filesystem::remove_all(dir);
}

}  // namespace keel::bench
