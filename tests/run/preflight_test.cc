// keel run's pre-flight gate (run/preflight.h): the verdict on the ranks' figures (below a
// fraction of the median, below a floor), and the floors' flag; the benchmarks themselves run
// in the drills (tests/run/check_run.py, "preflight").
#include "run/preflight.h"

#include <gtest/gtest.h>

#include "common/error.h"

namespace keel::run {
namespace {

Preflight figures(std::vector<std::pair<double, double>> gemm_mem) {
  Preflight p;
  int r = 0;
  for (const auto& [g, m] : gemm_mem) {
    RankHealth h;
    h.rank = r++;
    h.host = "node" + std::to_string(h.rank / 2);
    h.device = "H200";
    h.gemm_tflops = g, h.mem_gbps = m;
    p.ranks.push_back(h);
  }
  return p;
}

TEST(Preflight, ARankBelowTheMedianFractionIsNamed) {
  Preflight p = figures({{700, 4000}, {690, 3950}, {300, 4010}, {710, 1000}});
  PreflightOptions o;
  judge(p, o);
  EXPECT_DOUBLE_EQ(p.gemm_median, 695);  // of every rank (reported)
  ASSERT_EQ(p.failures.size(), 2u);
  // each rank against the others' median: rank 2's is that of 700, 690 and 710
  EXPECT_NE(p.failures[0].find("rank 2 (host node1, device H200): GEMM 300 TFLOP/s, below 0.7 x the other ranks' "
                               "median 700"),
            std::string::npos)
      << p.failures[0];
  EXPECT_NE(p.failures[1].find("rank 3 (host node1, device H200): memory bandwidth 1e+03 GB/s"), std::string::npos)
      << p.failures[1];
  EXPECT_EQ(p.failed_ranks, (std::vector<int>{2, 3}));
  EXPECT_FALSE(p.comm_failed);
  // healthy ranks pass; one rank alone has no median to fall below
  Preflight ok = figures({{700, 4000}, {650, 3900}});
  judge(ok, o);
  EXPECT_TRUE(ok.failures.empty());
  Preflight one = figures({{1, 1}});
  judge(one, o);
  EXPECT_TRUE(one.failures.empty());
  // two ranks: the slow one against the other's figure, not a median it drags down with it
  Preflight two = figures({{100, 4000}, {12, 4000}});
  judge(two, o);
  ASSERT_EQ(two.failures.size(), 1u);
  EXPECT_NE(two.failures[0].find("rank 1 (host node0, device H200): GEMM 12 TFLOP/s, below 0.7 x the other ranks' median 100"),
            std::string::npos)
      << two.failures[0];
}

TEST(Preflight, FloorsApplyToEveryRankAndTheAllReduce) {
  Preflight p = figures({{700, 4000}, {690, 3950}});
  p.comm_busbw = 120;
  PreflightOptions o;
  parse_preflight_floors("gemm=695,comm=300", o);
  EXPECT_DOUBLE_EQ(o.gemm_floor, 695);
  EXPECT_DOUBLE_EQ(o.comm_floor, 300);
  EXPECT_DOUBLE_EQ(o.mem_floor, 0);
  judge(p, o);
  ASSERT_EQ(p.failures.size(), 2u);
  EXPECT_NE(p.failures[0].find("rank 1 (host node0, device H200): GEMM 690 TFLOP/s, below the floor 695"),
            std::string::npos)
      << p.failures[0];
  EXPECT_NE(p.failures[1].find("all-reduce: bus bandwidth 120 GB/s, below the floor 300"), std::string::npos)
      << p.failures[1];
  EXPECT_EQ(p.failed_ranks, (std::vector<int>{1}));
  EXPECT_TRUE(p.comm_failed);
}

TEST(Preflight, BadFloorsAreOneLine) {
  PreflightOptions o;
  for (const auto& [text, word] : std::vector<std::pair<std::string, std::string>>{
           {"gemm=fast", "--preflight-floor gemm=fast: 'fast' is not a number >= 0"},
           {"flops=3", "--preflight-floor flops=3: expected gemm=TFLOPS"},
           {"mem", "--preflight-floor mem: expected"},
           {"comm=-1", "'-1' is not a number >= 0"}}) {
    try {
      parse_preflight_floors(text, o);
      ADD_FAILURE() << "accepted " << text;
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace keel::run
