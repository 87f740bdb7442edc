// round_and_merge: which granules a SparseDeviceBuffer backs for the ranges asked of it.
#include <gtest/gtest.h>

#include "device/sparse_device_buffer.h"

namespace keel {
namespace {

bool same(const std::vector<ByteRange>& got, const std::vector<ByteRange>& want) {
  if (got.size() != want.size()) return false;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (got[i].begin != want[i].begin || got[i].end != want[i].end) return false;
  return true;
}

TEST(SparseDeviceBuffer, RangesRoundOutToGranulesAndMerge) {
  const std::size_t g = 100;
  // Out of order, overlapping, touching after rounding, empty and reversed ones dropped.
  EXPECT_TRUE(same(round_and_merge({{950, 960}, {10, 20}, {150, 250}, {30, 30}, {500, 400}, {299, 301}}, g, 10000),
                   {{0, 400}, {900, 1000}}));
  // A range inside one granule still backs the whole granule; adjacent granules merge.
  EXPECT_TRUE(same(round_and_merge({{101, 102}, {200, 201}}, g, 10000), {{100, 300}}));
  // Clipped to the limit (the reservation), which need not be a multiple of the granule.
  EXPECT_TRUE(same(round_and_merge({{850, 990}}, g, 950), {{800, 950}}));
  EXPECT_TRUE(same(round_and_merge({{960, 990}}, g, 950), {{900, 950}}));  // its granule starts inside
  EXPECT_TRUE(same(round_and_merge({{960, 990}}, g, 900), {}));
  // Granularity 1: exact union.
  EXPECT_TRUE(same(round_and_merge({{5, 9}, {0, 5}, {12, 13}}, 1, 100), {{0, 9}, {12, 13}}));
  EXPECT_TRUE(round_and_merge({}, g, 1000).empty());
}

}  // namespace
}  // namespace keel
