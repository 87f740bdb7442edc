#include "hw/gemm_model.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <limits>

#include "common/error.h"
#include "hw/measured.h"

namespace keel::hw {
namespace {

TEST(GemmModel, WaveQuantization) {
  // NVIDIA's example: on 108 SMs (A100), 108 tiles of 256x128 fill one wave; a little more
  // work spills into a second wave (or smaller, less efficient tiles): it costs far more than
  // the extra work.
  const HardwareProfile a100 = *find_profile("a100");
  const GemmModel gm(a100);
  const GemmPrediction one = gm.analytic({12 * 256, 9 * 128, 8192, 1});
  EXPECT_EQ(one.tiles, 108);
  EXPECT_EQ(one.waves, 1);
  EXPECT_DOUBLE_EQ(one.wave_efficiency, 1.0);
  EXPECT_DOUBLE_EQ(one.tile_efficiency, 1.0);
  const GemmPrediction more = gm.analytic({12 * 256, 9 * 128 + 64, 8192, 1});
  EXPECT_GT(more.waves * 108, more.tiles - 1);
  EXPECT_LT(more.tflops, one.tflops * 0.85);
  EXPECT_GT(more.seconds, one.seconds * 1.1);
}

TEST(GemmModel, LargeGemmsApproachTheCeilingSmallOnesDoNot) {
  const HardwareProfile h100 = *find_profile("h100");
  const GemmModel gm(h100);
  const GemmPrediction big = gm.predict({8192, 8192, 8192, 1});
  EXPECT_GT(big.tflops, 0.9 * h100.mamf_bf16_tflops);
  EXPECT_LE(big.tflops, h100.mamf_bf16_tflops);
  const GemmPrediction small = gm.predict({256, 256, 256, 1});
  EXPECT_LT(small.efficiency, 0.1);
  const GemmPrediction skinny = gm.predict({1, 8192, 8192, 1});  // a decode GEMV: memory-bound
  EXPECT_TRUE(skinny.memory_bound);
}

TEST(GemmModel, MisalignedDimensionsCost) {
  const GemmModel gm(*find_profile("h100"));
  const double aligned = gm.predict({8192, 10944, 4096, 1}).tflops;
  const double odd = gm.predict({8192, 10922, 4096, 1}).tflops;
  EXPECT_GT(aligned / odd, 1.3);  // measured +46% (ml-engineering swiglu-maf-bench)
}

TEST(GemmModel, ProfileExactAndNearest) {
  const HardwareProfile h100 = *find_profile("h100");
  std::vector<GemmSample> prof = {{{4096, 4096, 4096, 1}, "bf16", 600},
                                  {{8192, 8192, 8192, 1}, "bf16", 700},
                                  {{1024, 1024, 1024, 1}, "bf16", 200},
                                  {{4096, 4096, 4096, 1}, "fp8", 1200}};
  const GemmModel gm(h100, prof);
  ASSERT_TRUE(gm.has_profile());
  EXPECT_DOUBLE_EQ(gm.predict({4096, 4096, 4096, 1}).tflops, 600);  // measured shapes are returned as measured
  EXPECT_DOUBLE_EQ(gm.predict({1024, 1024, 1024, 1}).tflops, 200);
  const double between = gm.predict({6144, 6144, 6144, 1}).tflops;
  EXPECT_GT(between, 550);
  EXPECT_LT(between, 750);
  EXPECT_NE(gm.predict({6144, 6144, 6144, 1}).source.find("profile"), std::string::npos);
  // The analytic ceiling is calibrated to the measurements: 700 TFLOP/s at 8192^3.
  EXPECT_NEAR(gm.analytic({8192, 8192, 8192, 1}).tflops, 700, 1);
}

TEST(GemmModel, TileCountsPastInt64AreAnError) {
  // ceil(m/256) x ceil(n/128) wrapped into a small or negative tile (and wave) count.
  const GemmModel gm(*find_profile("h100"));
  try {
    gm.predict({1LL << 62, 1LL << 62, 128, 1});
    ADD_FAILURE() << "no error";
  } catch (const UsageError& e) {
    EXPECT_STREQ(e.what(),
                 "GEMM 4611686018427387904x4611686018427387904x128 x1 is too large to model: its tile count overflows "
                 "int64");
  }
  const GemmPrediction p = gm.predict({std::numeric_limits<std::int64_t>::max(), 1, 1, 1});  // no m + 255 overflow
  EXPECT_GT(p.tiles, 0);
  EXPECT_GT(p.waves, 0);
}

std::string write(const std::string& name, const std::string& text) {
  const auto dir = std::filesystem::temp_directory_path() / "keel_hw_test";
  std::filesystem::create_directories(dir);
  const auto p = dir / name;
  std::ofstream(p) << text;
  return p.string();
}

TEST(MeasuredHardware, BenchJsonOverridesTheProfile) {
  const std::string comm = write("comm.json", R"({"schema": "keel.bench.comm/1",
    "devices": [{"rank": 0, "name": "NVIDIA H200"}],
    "results": [{"op": "all_reduce", "ranks": 8, "size_bytes": 1073741824, "out_of_place": {"busbw_gbps": 467.6}},
                {"op": "all_reduce", "ranks": 8, "size_bytes": 8589934592, "out_of_place": {"busbw_gbps": 480.0}},
                {"op": "all_reduce", "ranks": 2, "size_bytes": 8589934592, "out_of_place": {"busbw_gbps": 300.0}},
                {"op": "all_gather", "ranks": 8, "size_bytes": 8589934592, "out_of_place": {"busbw_gbps": 370.0}}]})");
  const std::string mem = write("mem.json", R"({"schema": "keel.bench.mem/1", "devices": [{"name": "NVIDIA H200"}],
    "results": [{"kernel": "copy", "bytes": 1e9, "gbps": 4010}, {"kernel": "triad", "bytes": 1e9, "gbps": 4150}]})");
  const std::string gemm = write("gemm.json", R"({"schema": "keel.bench.gemm/1",
    "devices": [{"name": "NVIDIA H200", "sm_count": 132}],
    "results": [{"m": 8192, "n": 8192, "k": 8192, "dtype": "bf16", "tflops": 760.5}]})");
  const Hardware hw = load_hardware(comm + "," + mem + "," + gemm);
  EXPECT_EQ(hw.profile.name, "h200");  // from the device name
  EXPECT_DOUBLE_EQ(hw.measured_busbw_gbps, 480.0);
  EXPECT_EQ(hw.measured_busbw_ranks, 8);
  EXPECT_DOUBLE_EQ(hw.measured_hbm_tbps, 4.15);
  EXPECT_DOUBLE_EQ(hw.profile.hbm_tbps, 4.15);
  EXPECT_DOUBLE_EQ(hw.spec.hbm_tbps, 4.8);
  ASSERT_EQ(hw.gemm_profile.size(), 1u);
  EXPECT_DOUBLE_EQ(hw.gemm_profile[0].tflops, 760.5);
  EXPECT_EQ(hw.sources.size(), 4u);
}

TEST(MeasuredHardware, ErrorsNameTheFile) {
  auto error = [](const std::string& spec) -> std::string {
    try {
      load_hardware(spec);
    } catch (const UsageError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(error("v100").find("unknown hardware 'v100'"), std::string::npos);
  EXPECT_NE(error("h100,h200").find("two base profiles"), std::string::npos);
  const std::string cpu = write("cpu.json", R"({"schema": "keel.bench.mem/1", "devices": [{"name": "cpu"}],
    "results": [{"kernel": "copy", "bytes": 1e9, "gbps": 40}]})");
  EXPECT_NE(error(cpu).find("device 'cpu' matches no built-in profile"), std::string::npos);
  EXPECT_EQ(load_hardware("mi300x," + cpu).measured_hbm_tbps, 0.04);  // a named base takes any device
  const std::string other = write("other.json", R"({"schema": "something/2", "results": []})");
  EXPECT_NE(error("h100," + other).find("unsupported schema 'something/2'"), std::string::npos);
  const std::string bad = write("bad.json", "{not json");
  EXPECT_NE(error(bad).find("not valid JSON"), std::string::npos);
  const std::string norow = write("norow.json", R"({"schema": "keel.bench.gemm/1", "results": [{"m": 1}]})");
  const std::string baddevice = write("baddevice.json", R"({"schema": "keel.bench.gemm/1", "devices": [{"name": 7}],
    "results": [{"m": 1, "n": 1, "k": 1, "dtype": "bf16", "tflops": 1}]})");
  EXPECT_NE(error(baddevice).find("baddevice.json: unexpected layout"), std::string::npos);
  EXPECT_NE(error("h100," + norow).find("results[0].n is missing or not a number"), std::string::npos);
  // Issue 34: a profile that is no file is refused before reading (through a .json link to
  // /dev/zero, the read ran until the OOM killer)
  const std::filesystem::path zero = std::filesystem::path(write("x.json", "")).parent_path() / "zero.json";
  std::filesystem::remove(zero);
  std::filesystem::create_symlink("/dev/zero", zero);
  EXPECT_EQ(error("h100," + zero.string()),
            "cannot read " + zero.string() + ": it is a character device, not a config file");
}

// The error load_hardware gives for a file of `schema` with `device` and `results`, or "".
std::string measured_error(const std::string& name, const std::string& schema, const std::string& device,
                           const std::string& results) {
  const std::string file = write(name, R"({"schema": ")" + schema + R"(", "devices": [)" + device +
                                           R"(], "results": [)" + results + "]}");
  try {
    load_hardware("h200," + file);
  } catch (const UsageError& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;  // one line
    EXPECT_EQ(what.rfind(file, 0), 0u) << what;             // naming the file first
    return what.substr(file.size());
  }
  return "";
}

TEST(MeasuredHardware, ImpossibleMeasurementsNameTheFileAndField) {
  const std::string h200 = R"({"name": "NVIDIA H200"})";
  auto comm = [&](const std::string& busbw) {
    return measured_error("comm.json", "keel.bench.comm/1", h200,
                          R"({"op": "all_reduce", "ranks": 8, "size_bytes": 1e9, "out_of_place": {"busbw_gbps": )" +
                              busbw + "}}");
  };
  EXPECT_EQ(comm("-3"), ": out_of_place.busbw_gbps must be a measurement in [1e-06, 1e+06] GB/s (got -3)");
  EXPECT_EQ(comm("0"), ": out_of_place.busbw_gbps must be a measurement in [1e-06, 1e+06] GB/s (got 0)");
  EXPECT_EQ(comm("480"), "");
  auto gemm = [&](const std::string& row) { return measured_error("gemm.json", "keel.bench.gemm/1", h200, row); };
  for (const char* tflops : {"0", "-500", "1e-300", "1e300"})
    EXPECT_EQ(gemm(std::string(R"({"m": 8192, "n": 8192, "k": 8192, "dtype": "bf16", "tflops": )") + tflops + "}"),
              fmt::format(": results[0].tflops must be a measurement in [1e-06, 100000] TFLOP/s (got {})",
                          std::stod(tflops)));
  // Shapes used to be skipped silently when not positive; fractional ones truncated.
  EXPECT_EQ(gemm(R"({"m": -5, "n": 8192, "k": 8192, "dtype": "bf16", "tflops": 500})"),
            ": results[0].m must be a whole number in [1, 9.0072e+15] (got -5)");
  EXPECT_EQ(gemm(R"({"m": 8, "n": 8, "k": 8, "batch": 2.5, "dtype": "bf16", "tflops": 500})"),
            ": results[0].batch must be a whole number in [1, 9.0072e+15] (got 2.5)");
  // A row keel bench gemm skipped has no tflops: left out, and said so.
  EXPECT_EQ(gemm(R"({"m": 8, "n": 8, "k": 8, "dtype": "bf16", "tflops": null, "skipped": "out of memory"},
                   {"m": 8192, "n": 8192, "k": 8192, "dtype": "bf16", "tflops": 700})"),
            "");
  auto mem = [&](const std::string& device, const std::string& gbps) {
    return measured_error("mem.json", "keel.bench.mem/1", device, R"({"kernel": "copy", "gbps": )" + gbps + "}");
  };
  EXPECT_EQ(mem(R"({"name": "NVIDIA H200", "sm_count": 4294967297})", "4150"),
            ": devices[0].sm_count must be a whole number in [1, 65536] (got 4294967297)");
  EXPECT_EQ(mem(R"({"name": "NVIDIA H200", "sm_count": 0})", "4150"),
            ": devices[0].sm_count must be a whole number in [1, 65536] (got 0)");
  EXPECT_EQ(mem(R"({"name": "NVIDIA H200", "sm_count": "132"})", "4150"), ": devices[0].sm_count is missing or not a number");
  EXPECT_EQ(mem(h200, "-1"), ": 'gbps' must be a measurement in [1e-06, 1e+06] GB/s (got -1)");
  EXPECT_EQ(mem(R"({"name": "NVIDIA H200", "sm_count": 132})", "4150"), "");
}

TEST(MeasuredHardware, SkippedGemmRowsAreCountedInTheSource) {
  const std::string file = write("skipped.json", R"({"schema": "keel.bench.gemm/1", "devices": [{"name": "NVIDIA H200"}],
    "results": [{"m": 8, "n": 8, "k": 8, "dtype": "bf16", "tflops": null, "skipped": "out of memory"},
                {"m": 8192, "n": 8192, "k": 8192, "dtype": "bf16", "tflops": 700}]})");
  const Hardware hw = load_hardware(file);
  ASSERT_EQ(hw.gemm_profile.size(), 1u);
  EXPECT_NE(hw.sources.back().find("1 shapes (1 skipped rows left out)"), std::string::npos) << hw.sources.back();
}

}  // namespace
}  // namespace keel::hw
