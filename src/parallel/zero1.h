// ZeRO-1 over the data-parallel group (docs/parallel.md): each of the group's ranks keeps the
// optimizer state of one contiguous shard of the flat parameter buffer, updates that shard's
// parameters, and the group all-gathers them. Gradients reach the owners by a reduce-scatter
// with the same shard bounds.
//
// Muon needs whole matrices (Newton-Schulz), so no cut splits a Muon matrix: each cut starts at
// the ideal k * total / ranks, rounded to kZero1AlignFloats, and moves to the nearer end of a
// Muon matrix it would fall inside (each matrix of an expert stack is its own unit). The owner
// of a matrix then holds its whole averaged gradient and momentum after the reduce-scatter and
// runs muon_matrix_step() alone: distributed Muon costs no communication beyond ZeRO-1's, and
// shards differ from equal by at most one matrix. Cuts never cross each other; a rank's shard
// may be empty (more ranks than matrices).
#pragma once

#include <cstdint>
#include <vector>

#include "optim/param_groups.h"

namespace keel::parallel {

inline constexpr std::int64_t kZero1AlignFloats = 64;  // 256 bytes: whole cache lines and vector loads

struct Zero1Plan {
  std::vector<std::int64_t> bounds;  // ranks + 1 offsets: rank r holds [bounds[r], bounds[r + 1])

  int ranks() const { return static_cast<int>(bounds.size()) - 1; }
  std::int64_t begin(int r) const { return bounds.at(static_cast<std::size_t>(r)); }
  std::int64_t end(int r) const { return bounds.at(static_cast<std::size_t>(r) + 1); }
  std::int64_t count(int r) const { return end(r) - begin(r); }
  std::int64_t largest() const;  // the largest shard, in floats
};

// Throws keel::Error when ranks < 1.
Zero1Plan plan_zero1(const optim::ParamLayout& layout, int ranks);

// The parameters of `layout` starting inside [begin, end), re-based to offset 0, with
// total_floats = end - begin: a region of the flat buffer as a layout of its own.
optim::ParamLayout region_layout(const optim::ParamLayout& layout, std::int64_t begin, std::int64_t end);

// ZeRO-1 shards of the flat range [begin, end) over `ranks` (bounds in flat-buffer offsets,
// from begin to end): expert parallelism shards its replicated region and its expert region
// over different groups.
Zero1Plan plan_zero1_region(const optim::ParamLayout& layout, std::int64_t begin, std::int64_t end, int ranks);

// One Muon matrix (each matrix of a 3-D stack separately) inside [begin, end).
struct MuonMatrixRef {
  int param = 0;            // index into layout.params
  std::int64_t offset = 0;  // float offset of the matrix
  std::int64_t rows = 0, cols = 0;
};
std::vector<MuonMatrixRef> muon_matrices_in(const optim::ParamLayout& layout, std::int64_t begin, std::int64_t end);

}  // namespace keel::parallel
