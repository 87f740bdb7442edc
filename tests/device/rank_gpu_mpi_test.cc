// bind_rank_gpu under mpiexec: every rank of a node takes part in the GPU check and all of them
// fail alike (no rank left waiting in a collective) when there is no GPU to bind; with a GPU
// per rank each binds its node-local rank's.
#include <gtest/gtest.h>
#include <mpi.h>

#include <string>

#include "../error_message.h"
#include "../mpi_test_util.h"
#include "common/error.h"
#include "device/cuda_devices.h"
#include "device/rank_gpu.h"

namespace keel {
namespace {

int node_local(bool size) {
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, test::world_rank(), MPI_INFO_NULL, &node);
  int v = 0;
  if (size)
    MPI_Comm_size(node, &v);
  else
    MPI_Comm_rank(node, &v);
  MPI_Comm_free(&node);
  return v;
}

TEST(RankGpuMpi, EveryRankOfTheNodeBindsOrFailsAlike) {
  const int visible = visible_cuda_devices(), local_size = node_local(true), local_rank = node_local(false);
  if (visible >= local_size) {
    EXPECT_EQ(bind_rank_gpu(), local_rank);
  } else if (visible == 0) {
    // No GPU (the CI machine): each rank says why, and none waits for another.
    const std::string e = test::error_message<UsageError>([] { bind_rank_gpu(); });
    EXPECT_NE(e.find(std::to_string(local_size) + " ranks run on host"), std::string::npos) << e;
    EXPECT_NE(e.find("each sees 0 GPUs"), std::string::npos) << e;
  } else {
    GTEST_SKIP() << visible << " GPUs for " << local_size << " ranks on this node";
  }
  // Still in step: a rank stuck in bind_rank_gpu would hang this barrier (and the test's timeout).
  EXPECT_EQ(MPI_Barrier(MPI_COMM_WORLD), MPI_SUCCESS);
}

}  // namespace
}  // namespace keel
