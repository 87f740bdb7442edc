#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "bench/mem/ops.h"
#include "bench/mem/runner.h"
#include "bench/mem/thread_team.h"
#include "bench/mem/values.h"
#include "common/error.h"

namespace keel::bench {

TEST(MemOps, ParsesNamesAndGroups) {
  EXPECT_EQ(parse_mem_ops("triad,copy"), (std::vector<MemOp>{MemOp::kCopy, MemOp::kTriad}));
  EXPECT_EQ(parse_mem_ops("stream").size(), 7u);  // six kernels and memcpy
  EXPECT_EQ(parse_mem_ops("transfers").size(), 4u);
  EXPECT_EQ(parse_mem_ops("peer").size(), 4u);
  EXPECT_EQ(parse_mem_ops("all").size(), 15u);
  EXPECT_THROW(parse_mem_ops("copy,bogus"), Error);
  EXPECT_THROW(parse_mem_ops(""), Error);
  EXPECT_THROW(parse_mem_type("int8"), Error);
}

TEST(MemOps, CountsBytesTheBabelStreamWay) {
  const std::uint64_t n = 1000;
  EXPECT_EQ(bytes_moved(MemOp::kCopy, MemType::kF32, n), 2 * 4 * n);
  EXPECT_EQ(bytes_moved(MemOp::kMul, MemType::kF64, n), 2 * 8 * n);
  EXPECT_EQ(bytes_moved(MemOp::kAdd, MemType::kF32, n), 3 * 4 * n);
  EXPECT_EQ(bytes_moved(MemOp::kTriad, MemType::kF32, n), 3 * 4 * n);
  EXPECT_EQ(bytes_moved(MemOp::kDot, MemType::kF32, n), 2 * 4 * n);
  EXPECT_EQ(bytes_moved(MemOp::kNstream, MemType::kF32, n), 4 * 4 * n);
  EXPECT_EQ(bytes_moved(MemOp::kMemcpy, MemType::kF32, n), 2 * 4 * n);
  EXPECT_EQ(bytes_moved(MemOp::kH2DPinned, MemType::kF32, n), 4 * n);
  EXPECT_EQ(bytes_moved(MemOp::kPeerBidirWrite, MemType::kF32, n), 2 * 4 * n);
}

TEST(MemValues, InputsAreNonZeroDistinctAndExactInFp32) {
  std::set<float> seen;
  for (std::uint64_t i = 0; i < 4096; ++i) {
    const float v = stream_input(7, kArrayA, i);
    EXPECT_GE(v, 0.5f);
    EXPECT_LT(v, 1.0f);
    seen.insert(v);
    EXPECT_NE(v, stream_input(7, kArrayB, i));
    EXPECT_NE(v, stream_input(8, kArrayA, i));
  }
  EXPECT_GT(seen.size(), 4000u);  // 23 random bits: collisions are rare
}

TEST(MemValues, ExpectationsFollowTheKernels) {
  const double s = static_cast<float>(kStreamScalar), eps = 0x1p-24;
  const double a = stream_input(3, kArrayA, 5), b = stream_input(3, kArrayB, 5), c = stream_input(3, kArrayC, 5);
  EXPECT_EQ(stream_expected(kKernelCopy, 3, 5, 1, s, eps).value, a);
  EXPECT_DOUBLE_EQ(stream_expected(kKernelMul, 3, 5, 1, s, eps).value, s * c);
  EXPECT_DOUBLE_EQ(stream_expected(kKernelAdd, 3, 5, 1, s, eps).value, a + b);
  EXPECT_DOUBLE_EQ(stream_expected(kKernelTriad, 3, 5, 9, s, eps).value, b + s * c);  // idempotent
  EXPECT_DOUBLE_EQ(stream_expected(kKernelNstream, 3, 5, 10, s, eps).value, a + 10 * (b + s * c));
  // nstream in float, run for real, stays within the tolerance; one ulp-scale nudge too many
  // (a wrong run count) does not.
  float fa = static_cast<float>(a);
  for (int r = 0; r < 100; ++r) fa += static_cast<float>(b) + static_cast<float>(s) * static_cast<float>(c);
  const StreamExpectation e = stream_expected(kKernelNstream, 3, 5, 100, s, eps);
  EXPECT_LE(std::fabs(fa - e.value), e.tolerance);
  EXPECT_GT(std::fabs(stream_expected(kKernelNstream, 3, 5, 101, s, eps).value - e.value), e.tolerance);
}

TEST(MemValues, SpecPeaksComeFromTheProfile) {
  MemDevice h200;
  h200.name = "NVIDIA H200";
  EXPECT_DOUBLE_EQ(mem_spec_gbps(MemOp::kTriad, h200, 0), 4800);
  EXPECT_DOUBLE_EQ(mem_spec_gbps(MemOp::kMemcpy, h200, 0), 4800);
  EXPECT_DOUBLE_EQ(mem_spec_gbps(MemOp::kH2DPinned, h200, 0), 63);
  EXPECT_DOUBLE_EQ(mem_spec_gbps(MemOp::kPeerWrite, h200, 0), 450);
  EXPECT_DOUBLE_EQ(mem_spec_gbps(MemOp::kPeerBidirRead, h200, 0), 900);
  MemDevice cpu;
  cpu.name = "AMD EPYC";
  EXPECT_EQ(mem_spec_gbps(MemOp::kCopy, cpu, 0), 0);
  EXPECT_EQ(mem_spec_gbps(MemOp::kCopy, cpu, 200), 200);
}

TEST(ThreadTeam, SlicesCoverEveryItemOnce) {
  ThreadTeam team(3);
  std::vector<int> hits(1001, 0);
  for (int rep = 0; rep < 50; ++rep)
    team.run([&](int t, int n) {
      std::uint64_t lo, hi;
      ThreadTeam::slice(hits.size(), t, n, &lo, &hi);
      for (auto i = lo; i < hi; ++i) hits[i]++;
    });
  for (int h : hits) EXPECT_EQ(h, 50);
}

}  // namespace keel::bench
