// The NCCL backend on the GPUs of this machine, one process driving all of them: every
// collective, dtype, reduce op and placement must produce exactly its expected values
// (checked on the device against the same definitions the CPU checker uses), in the
// host-timed loop and in CUDA-graph mode, and the checker must catch a corrupted result.
// Skips where there is no GPU (CI).
#include <gtest/gtest.h>
#include <mpi.h>

#include "bench/comm/backend.h"
#include "bench/comm/runner.h"
#include "device/cuda_devices.h"

namespace keel::bench {
namespace {

class NcclBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (visible_cuda_devices() < 1) GTEST_SKIP() << "no GPU";
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
      std::atexit([] { MPI_Finalize(); });
    }
  }

  static CommOptions sweep() {
    CommOptions o;
    o.backend = "nccl";
    o.ops = parse_collectives("all");
    o.dtypes = {DType::kBF16, DType::kFP16, DType::kFP32};
    o.redops = {RedOp::kSum, RedOp::kAvg};
    o.min_bytes = 3 * 8 * 64;      // splits over 1..8 ranks of any dtype
    o.max_bytes = 3 * 8 * 64 << 12;
    o.factor = 16;
    o.plan.warmup = 2;
    o.plan.iters = 5;
    o.plan.timeout_s = 60;
    return o;
  }
};

TEST_F(NcclBackendTest, EveryCaseIsCorrectOnEveryGroupSize) {
  const int gpus = std::min(visible_cuda_devices(), 8);
  if (gpus < 2) GTEST_SKIP() << "collectives need at least 2 GPUs";
  CommOptions o = sweep();
  o.ranks = {gpus};
  if (gpus > 2) o.ranks.push_back(2);
  auto backend = make_nccl_backend(gpus);
  validate_options(o, backend->world_size());
  CommReport report = run_comm_bench(*backend, o, nullptr);
  ASSERT_FALSE(report.rows.empty());
  for (const auto& r : report.rows) {
    SCOPED_TRACE(std::string(collective_name(r.op)) + " " + std::string(dtype_name(r.dtype)) + " " +
                 std::string(redop_name(r.redop)) + " n=" + std::to_string(r.nranks) + " size=" + std::to_string(r.size_bytes));
    ASSERT_TRUE(r.out_of_place.measured);
    EXPECT_EQ(r.out_of_place.wrong, 0u) << r.out_of_place.first_wrong;
    EXPECT_EQ(r.in_place.wrong, 0u) << r.in_place.first_wrong;
    EXPECT_GT(r.out_of_place.algbw, 0);
    // busbw is algbw x a factor that is 0 on one rank for the reductions (nccl-tests' definition).
    if (r.nranks > 1) EXPECT_GT(r.out_of_place.busbw, 0);
    EXPECT_GT(r.out_of_place.iter_p50_us, 0);
  }
}

TEST_F(NcclBackendTest, GraphModeAndAllGroupsAreCorrect) {
  const int gpus = std::min(visible_cuda_devices(), 8);
  if (gpus < 2 || gpus % 2 != 0) GTEST_SKIP() << "needs an even number of GPUs (groups of 2)";
  CommOptions o = sweep();
  o.ops = {Collective::kAllReduce, Collective::kAllGather, Collective::kSendRecv};
  o.dtypes = {DType::kBF16};
  o.redops = {RedOp::kSum};
  o.plan.graph_replays = 3;
  o.ranks = {2};
  o.all_groups = true;
  auto backend = make_nccl_backend(gpus);
  validate_options(o, backend->world_size());
  CommReport report = run_comm_bench(*backend, o, nullptr);
  int groups = 0;
  for (const auto& r : report.rows) {
    groups = std::max(groups, r.ngroups);
    EXPECT_EQ(r.out_of_place.wrong, 0u) << r.out_of_place.first_wrong;
    EXPECT_GT(r.out_of_place.time_us, 0);
  }
  EXPECT_EQ(groups, backend->world_size() / 2);
}

TEST_F(NcclBackendTest, CheckerCatchesACorruptedResult) {
  const int gpus = std::min(visible_cuda_devices(), 8);
  if (gpus < 2) GTEST_SKIP() << "collectives need at least 2 GPUs";
  CommOptions o = sweep();
  o.ops = {Collective::kAllReduce, Collective::kReduceScatter};
  o.dtypes = {DType::kBF16, DType::kFP32};
  o.redops = {RedOp::kSum};
  o.min_bytes = o.max_bytes = 3 * 8 * 64 * 16;
  o.corrupt_rank = gpus - 1;
  auto backend = make_nccl_backend(gpus);
  CommReport report = run_comm_bench(*backend, o, nullptr);
  ASSERT_FALSE(report.rows.empty());
  for (const auto& r : report.rows) {
    EXPECT_EQ(r.out_of_place.wrong, 1u);
    EXPECT_EQ(r.in_place.wrong, 1u);
    EXPECT_NE(r.out_of_place.first_wrong.find("got 12288"), std::string::npos) << r.out_of_place.first_wrong;
  }
}

}  // namespace
}  // namespace keel::bench
