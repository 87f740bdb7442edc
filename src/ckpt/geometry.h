// Shard geometry: box intersection, the contiguous byte runs a copy between two row-major
// boxes decomposes into, and an interval index over a tensor's stored shards so that a load
// finds the overlapping shards without testing every pair.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "ckpt/types.h"

namespace keel::ckpt {

// The common part of two boxes of the same rank; nullopt when they do not overlap (or
// either is empty).
std::optional<Box> intersect(const Box& a, const Box& b);

// A contiguous run of `count` elements at element offset `src` in box `src_box` (row-major)
// and `dst` in `dst_box`.
struct Run {
  std::int64_t src = 0, dst = 0, count = 0;
};

// Calls f for each maximal contiguous run of `part` (which lies inside both boxes): trailing
// dimensions that `part` spans fully in both boxes collapse into one run.
void for_each_run(const Box& part, const Box& src_box, const Box& dst_box, const std::function<void(const Run&)>& f);

// Index over the boxes of one tensor's shards, keyed on the first dimension: boxes sorted by
// start with a prefix maximum of their ends, so a query visits O(log n + k) candidates
// (k = shards whose first-dimension interval overlaps).
class ShardIndex {
 public:
  ShardIndex() = default;
  explicit ShardIndex(const std::vector<Box>& boxes);
  // Positions (into the constructor's vector) of the boxes that overlap `q`.
  std::vector<std::size_t> query(const Box& q) const;

 private:
  std::vector<Box> boxes_;              // sorted by first-dimension start
  std::vector<std::size_t> original_;   // sorted position -> constructor position
  std::vector<std::int64_t> max_end_;   // prefix maximum of first-dimension ends
};

// The first pair of boxes (positions into `boxes`, first < second) that share an element, or
// nullopt. Sweeps along the dimension where the boxes' starts differ most, so boxes split along
// any one dimension (row-, column- or expert-split shards) cost O(n log n), not all pairs.
std::optional<std::pair<std::size_t, std::size_t>> find_overlap(const std::vector<Box>& boxes);

// The elements [begin, end) of a tensor in row-major (flat) order as boxes: at most
// 2 ndim - 1 of them, in flat order, each one contiguous run of the flat range (so box k's data
// starts at the flat offset where the previous box's ended). A ZeRO-1 shard is such a range.
std::vector<Box> flat_range_boxes(const Shape& shape, std::int64_t begin, std::int64_t end);

// Coverage of a tensor by boxes: every element exactly once. Returns "" when covered, or a
// sentence describing the first problem (out of bounds, overlap, hole).
std::string coverage_problem(const Shape& shape, const std::vector<Box>& boxes);

}  // namespace keel::ckpt
