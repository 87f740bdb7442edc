// The whole `bench comm` harness on CPU ranks: every collective, dtype, reduce op and
// placement must produce exactly its expected values, and the checker must catch a
// corrupted result. Runs under mpiexec with 2, 3 and 4 ranks.
#include <gtest/gtest.h>
#include <mpi.h>

#include "../../mpi_test_util.h"

#include "bench/comm/backend.h"
#include "bench/comm/runner.h"

#include <set>

namespace keel::bench {
namespace {

using keel::test::world_rank;
using keel::test::world_size;

CommOptions small_sweep() {
  CommOptions o;
  o.backend = "mpi";
  o.ops = parse_collectives("all");
  o.dtypes = {DType::kBF16, DType::kFP16, DType::kFP32};
  o.redops = {RedOp::kSum, RedOp::kAvg};
  o.min_bytes = 48;  // splits over 1, 2, 3 and 4 ranks of 4-byte elements
  o.max_bytes = 48 << 6;
  o.factor = 4;
  o.plan.warmup = 1;
  o.plan.iters = 3;
  o.plan.timeout_s = 120;
  return o;
}

TEST(CommHarnessMpi, EveryCaseIsCorrectAtEveryGroupSize) {
  const int world = world_size();
  CommOptions o = small_sweep();
  o.ranks = {world};  // one rank is not a collective (validate_options refuses it)
  if (world > 2) o.ranks.push_back(2);
  auto backend = make_mpi_backend();
  validate_options(o, backend->world_size());
  CommReport report = run_comm_bench(*backend, o, nullptr);
  if (world_rank() != 0) {
    EXPECT_TRUE(report.rows.empty());
    return;
  }
  // ranks x (4 reducing-op x 3 dtypes x 2 redops ... ) rows: count them from first principles.
  const size_t sizes = 4;  // 48, 192, 768, 3072
  const size_t per_rank_count = (2 * 3 * 2 + 4 * 3) * sizes;
  EXPECT_EQ(report.rows.size(), per_rank_count * o.ranks.size());
  for (const auto& r : report.rows) {
    SCOPED_TRACE(std::string(collective_name(r.op)) + " " + std::string(dtype_name(r.dtype)) + " n=" +
                 std::to_string(r.nranks) + " size=" + std::to_string(r.size_bytes));
    ASSERT_TRUE(r.out_of_place.measured);
    EXPECT_EQ(r.out_of_place.wrong, 0u) << r.out_of_place.first_wrong;
    EXPECT_GT(r.out_of_place.time_us, 0);
    EXPECT_GE(r.out_of_place.iter_p99_us, r.out_of_place.iter_p50_us);
    EXPECT_GE(r.out_of_place.slowest_rank, 0);
    EXPECT_LT(r.out_of_place.slowest_rank, r.nranks);
    EXPECT_NEAR(r.out_of_place.algbw, r.size_bytes / (r.out_of_place.time_us * 1e3), 1e-9 * r.out_of_place.algbw + 1e-12);
    EXPECT_NEAR(r.out_of_place.busbw, r.out_of_place.algbw * busbw_factor(r.op, r.nranks), 1e-9);
    EXPECT_EQ(r.in_place.measured, collective_has_in_place(r.op));
    EXPECT_EQ(r.in_place.wrong, 0u) << r.in_place.first_wrong;
  }
}

TEST(CommHarnessMpi, AllGroupsRunAtOnceAndReportEachGroup) {
  const int world = world_size();
  if (world % 2 != 0) GTEST_SKIP() << "needs an even world";
  CommOptions o = small_sweep();
  o.ops = {Collective::kAllReduce, Collective::kAllGather};
  o.dtypes = {DType::kFP32};
  o.redops = {RedOp::kSum};
  o.ranks = {2};
  o.all_groups = true;
  auto backend = make_mpi_backend();
  CommReport report = run_comm_bench(*backend, o, nullptr);
  if (world_rank() != 0) return;
  std::set<int> groups;
  for (const auto& r : report.rows) {
    groups.insert(r.group);
    EXPECT_EQ(r.ngroups, world / 2);
    EXPECT_EQ(r.out_of_place.wrong, 0u);
    EXPECT_EQ(r.out_of_place.slowest_rank / 2, r.group);  // the slowest rank is one of the group's
  }
  EXPECT_EQ(static_cast<int>(groups.size()), world / 2);
}

TEST(CommHarnessMpi, CheckerCatchesACorruptedResult) {
  const int world = world_size();
  CommOptions o = small_sweep();
  o.ops = {Collective::kAllReduce, Collective::kAllToAll};
  o.dtypes = {DType::kBF16};
  o.redops = {RedOp::kSum};
  o.min_bytes = o.max_bytes = 96 * 4;
  o.corrupt_rank = world - 1;
  auto backend = make_mpi_backend();
  CommReport report = run_comm_bench(*backend, o, nullptr);
  if (world_rank() != 0) return;
  ASSERT_FALSE(report.rows.empty());
  for (const auto& r : report.rows) {
    EXPECT_EQ(r.out_of_place.wrong, 1u);
    EXPECT_NE(r.out_of_place.first_wrong.find("rank " + std::to_string(world - 1) + " "), std::string::npos)
        << r.out_of_place.first_wrong;
    EXPECT_NE(r.out_of_place.first_wrong.find("got 12288"), std::string::npos) << r.out_of_place.first_wrong;
  }
}

}  // namespace
}  // namespace keel::bench
