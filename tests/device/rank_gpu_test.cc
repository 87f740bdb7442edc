// Which GPU a rank drives under a one-process-per-GPU launch: the node-local rank's when every
// rank sees all of the node's GPUs, device 0 when a launcher bound each rank to one, refused
// otherwise; and two ranks on one physical GPU are found by UUID.
#include "device/rank_gpu.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "../error_message.h"
#include "common/error.h"

namespace keel {
namespace {

TEST(RankGpu, EveryGpuVisiblePicksTheNodeLocalRank) {
  EXPECT_EQ(rank_gpu_index(0, 1, 1, "h"), 0);
  EXPECT_EQ(rank_gpu_index(3, 8, 8, "h"), 3);
  EXPECT_EQ(rank_gpu_index(7, 8, 8, "h"), 7);
  EXPECT_EQ(rank_gpu_index(2, 4, 8, "h"), 2) << "fewer ranks than GPUs: the first ones";
}

TEST(RankGpu, OneGpuPerRankIsDeviceZero) {
  // srun --gpus-per-task 1 (or a CUDA_VISIBLE_DEVICES per rank): each rank sees only its own.
  EXPECT_EQ(rank_gpu_index(0, 8, 1, "h"), 0);
  EXPECT_EQ(rank_gpu_index(5, 8, 1, "h"), 0);
}

TEST(RankGpu, SeveralButTooFewGpusAreRefused) {
  EXPECT_EQ(test::error_message<UsageError>([] { rank_gpu_index(3, 8, 4, "node7"); }),
            "8 ranks run on host node7 and each sees 4 GPUs: launch one rank per GPU, with every GPU visible to "
            "every rank or one GPU per rank (e.g. srun --gpus-per-task 1)");
  EXPECT_NE(test::error_message<UsageError>([] { rank_gpu_index(0, 2, 0, "h"); }), "") << "no GPU at all";
  EXPECT_NE(test::error_message([] { rank_gpu_index(8, 8, 8, "h"); }), "") << "a rank outside the node's";
}

TEST(RankGpu, FindsTwoRanksOnOneGpu) {
  using P = std::pair<int, int>;
  EXPECT_EQ(first_shared_gpu({}), P(-1, -1));
  EXPECT_EQ(first_shared_gpu({"a"}), P(-1, -1));
  EXPECT_EQ(first_shared_gpu({"a", "b", "c"}), P(-1, -1));
  EXPECT_EQ(first_shared_gpu({"a", "b", "a"}), P(0, 2));
  EXPECT_EQ(first_shared_gpu({"x", "y", "y", "x"}), P(1, 2)) << "the first repeat in rank order";
}

}  // namespace
}  // namespace keel
