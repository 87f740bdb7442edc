// expert_major_layout: where an expert-parallel rank stores the rows it receives (the GPU path
// receives each (source, local expert) block straight at its place; parallel/
// expert_parallel_cuda.h).
#include <gtest/gtest.h>

#include <vector>

#include "common/error.h"
#include "parallel/expert_parallel.h"

namespace keel::parallel {
namespace {

TEST(ExpertMajorLayout, BlocksAreExpertMajorThenSourceOrdered) {
  // 3 sources, 2 local experts: recv[p * 2 + j]
  const std::vector<std::int64_t> recv = {4, 1,   // source 0: 4 rows for expert 0, 1 for expert 1
                                          0, 3,   // source 1
                                          2, 0};  // source 2
  const ExpertMajorLayout l = expert_major_layout(recv, 3, 2);
  // expert 0: source 0 [0, 4), source 1 [4, 4), source 2 [4, 6); expert 1: [6, 7), [7, 10), [10, 10)
  EXPECT_EQ(l.expert_offsets, (std::vector<std::int64_t>{0, 6, 10}));
  EXPECT_EQ(l.block_start, (std::vector<std::int64_t>{0, 6, 4, 7, 4, 10}));
  EXPECT_EQ(l.rows(), 10);
}

TEST(ExpertMajorLayout, BlocksTileTheRowsOnce) {
  const int P = 4, El = 3;
  std::vector<std::int64_t> recv(P * El);
  for (int i = 0; i < P * El; ++i) recv[i] = (i * 7) % 5;  // zeros included
  const ExpertMajorLayout l = expert_major_layout(recv, P, El);
  std::vector<int> owner(static_cast<std::size_t>(l.rows()), -1);
  for (int p = 0; p < P; ++p)
    for (int j = 0; j < El; ++j) {
      const std::int64_t b = l.block_start[p * El + j];
      EXPECT_GE(b, l.expert_offsets[j]);
      EXPECT_LE(b + recv[p * El + j], l.expert_offsets[j + 1]) << "block inside its expert's rows";
      for (std::int64_t r = b; r < b + recv[p * El + j]; ++r) {
        EXPECT_EQ(owner[r], -1) << "row " << r << " in two blocks";
        owner[r] = p * El + j;
      }
    }
  for (int o : owner) EXPECT_GE(o, 0) << "a row no block covers";
}

TEST(ExpertMajorLayout, NothingReceived) {
  const ExpertMajorLayout l = expert_major_layout(std::vector<std::int64_t>(6, 0), 2, 3);
  EXPECT_EQ(l.rows(), 0);
  EXPECT_EQ(l.expert_offsets, (std::vector<std::int64_t>{0, 0, 0, 0}));
}

TEST(ExpertMajorLayout, BadCountsAreErrors) {
  EXPECT_THROW(expert_major_layout({1, 2, 3}, 2, 2), Error);
  EXPECT_THROW(expert_major_layout({1, -1, 0, 0}, 2, 2), Error);
}

}  // namespace
}  // namespace keel::parallel
