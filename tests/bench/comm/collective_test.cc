#include "bench/comm/collective.h"

#include <gtest/gtest.h>

#include <set>

#include "bench/comm/runner.h"
#include "bench/comm/values.h"
#include "common/error.h"

namespace keel::bench {

TEST(Collective, ParsesNamesAndAll) {
  EXPECT_EQ(parse_collectives("allreduce,all-gather"),
            (std::vector<Collective>{Collective::kAllReduce, Collective::kAllGather}));
  EXPECT_EQ(parse_collectives("all").size(), 6u);
  EXPECT_THROW(parse_collectives("allreduce,bogus"), Error);
}

TEST(Collective, BusBandwidthFactorsMatchNcclTests) {
  EXPECT_DOUBLE_EQ(busbw_factor(Collective::kAllReduce, 8), 2.0 * 7 / 8);
  EXPECT_DOUBLE_EQ(busbw_factor(Collective::kAllGather, 8), 7.0 / 8);
  EXPECT_DOUBLE_EQ(busbw_factor(Collective::kReduceScatter, 4), 3.0 / 4);
  EXPECT_DOUBLE_EQ(busbw_factor(Collective::kAllToAll, 2), 0.5);
  EXPECT_DOUBLE_EQ(busbw_factor(Collective::kBroadcast, 8), 1.0);
  EXPECT_DOUBLE_EQ(busbw_factor(Collective::kSendRecv, 8), 1.0);
}

TEST(Collective, ShapesSplitTheLargerBuffer) {
  auto s = collective_shape(Collective::kAllGather, 1024, DType::kFP32, 4);
  EXPECT_EQ(s.recv_count, 256u);
  EXPECT_EQ(s.send_count, 64u);
  s = collective_shape(Collective::kReduceScatter, 1024, DType::kBF16, 8);
  EXPECT_EQ(s.send_count, 512u);
  EXPECT_EQ(s.recv_count, 64u);
  s = collective_shape(Collective::kAllToAll, 96, DType::kFP32, 3);
  EXPECT_EQ(s.send_count, 24u);
  EXPECT_EQ(s.recv_count, 24u);
  s = collective_shape(Collective::kAllReduce, 8, DType::kFP32, 8);
  EXPECT_EQ(s.send_count, 2u);
}

TEST(Collective, RejectsSizesThatDoNotSplit) {
  EXPECT_THROW(collective_shape(Collective::kAllGather, 8, DType::kFP32, 8), Error);
  EXPECT_THROW(collective_shape(Collective::kAllReduce, 6, DType::kFP32, 2), Error);
  EXPECT_THROW(collective_shape(Collective::kAllToAll, 100, DType::kFP32, 3), Error);
  try {
    collective_shape(Collective::kAllGather, 8, DType::kFP32, 8);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of 32 B"), std::string::npos) << e.what();
  }
}

TEST(Values, InputsAreSmallNonTrivialIntegers) {
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (int n : {1, 2, 8, 300, 5000}) {
      const ValueSpec v = make_value_spec(42, n, t);
      std::set<float> seen;
      double worst = 0;
      for (std::uint64_t i = 0; i < 64; ++i) {
        double sum = 0;
        for (int r = 0; r < n; ++r) {
          const float x = input_value(v, r, i);
          EXPECT_EQ(x, std::nearbyint(x));
          EXPECT_LE(std::fabs(x), v.magnitude);
          sum += std::fabs(x);
          if (r < 4) seen.insert(x);
        }
        worst = std::max(worst, sum);
      }
      // Any partial sum is exactly representable, and the data is not constant.
      EXPECT_LE(worst, static_cast<double>(dtype_exact_int_limit(t)));
      EXPECT_GT(seen.size(), 2u);
    }
  }
}

TEST(Values, ExpectedOutputsFollowTheCollectiveDefinitions) {
  const int n = 4;
  const ValueSpec v = make_value_spec(9, n, DType::kFP32);
  CaseGeometry g;
  g.op = Collective::kReduceScatter;
  g.send_count = 40;
  g.recv_count = 10;
  // Rank 2's reduce-scatter block is the sum over ranks of elements [20, 30).
  for (std::uint64_t j = 0; j < 10; ++j) {
    float s = 0;
    for (int r = 0; r < n; ++r) s += input_value(v, r, 20 + j);
    EXPECT_EQ(expected_output(v, g, 2, j), s);
  }
  g.op = Collective::kAllToAll;
  g.send_count = 40;
  // Rank 1 receives from rank 3 the block rank 3 sent to rank 1: elements [10, 20) of rank 3.
  EXPECT_EQ(expected_output(v, g, 1, 30 + 5), input_value(v, 3, 10 + 5));
  g.op = Collective::kSendRecv;
  EXPECT_EQ(expected_output(v, g, 0, 7), input_value(v, 3, 7));
  g.op = Collective::kAllGather;
  g.send_count = 10;
  EXPECT_EQ(expected_output(v, g, 0, 25), input_value(v, 2, 5));
  g.op = Collective::kBroadcast;
  g.root = 3;
  EXPECT_EQ(expected_output(v, g, 0, 4), input_value(v, 3, 4));
  g.op = Collective::kAllReduce;
  g.redop = RedOp::kAvg;
  EXPECT_FLOAT_EQ(expected_output(v, g, 0, 4), sum_over_ranks(v, 4) / 4.f);
  EXPECT_GT(tolerance(g, DType::kBF16, 10.f), 0.f);
  g.redop = RedOp::kSum;
  EXPECT_EQ(tolerance(g, DType::kBF16, 10.f), 0.f);
}

TEST(Runner, PercentileByNearestRank) {
  std::vector<double> v;
  for (int i = 1; i <= 100; ++i) v.push_back(101 - i);
  EXPECT_EQ(percentile(v, 50), 50);
  EXPECT_EQ(percentile(v, 99), 99);
  EXPECT_EQ(percentile(v, 100), 100);
  EXPECT_EQ(percentile({3.0}, 99), 3.0);
}

}  // namespace keel::bench
