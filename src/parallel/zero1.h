// ZeRO-1 over the data-parallel group (docs/parallel.md): each of the group's ranks keeps the
// optimizer state of one contiguous shard of the flat parameter buffer, updates that shard's
// parameters, and the group all-gathers them. Gradients reach the owners by a reduce-scatter
// with the same shard bounds.
//
// Muon needs whole matrices (Newton-Schulz), so no cut splits a Muon matrix (each matrix of an
// expert stack is its own unit): the owner of a matrix holds its whole averaged gradient and
// momentum after the reduce-scatter and runs muon_matrix_step() alone, so distributed Muon costs
// no communication beyond ZeRO-1's. Other cuts fall on multiples of kZero1AlignFloats or at
// parameter boundaries. Cuts never cross each other; a rank's shard may be empty (more ranks
// than matrices).
//
// Where the cuts fall balances two things at once: each shard's floats (its optimizer-state
// memory) and its optimizer work, in which a Muon matrix's Newton-Schulz GEMMs weigh about 12
// AdamW elements per float at 2048 x 2048 (zero1_muon_cost_per_float). Cutting at k/N of the
// floats leaves the owners of an AdamW-only region (the embedding) with little Newton-Schulz
// and the others with more; the plan instead takes the contiguous cuts whose busiest rank, in
// floats or in work relative to the mean, is least, and keeps the cuts at k/N of the floats
// when they are within 0.1% of that (AdamW alone, or equal matrices throughout).
#pragma once

#include <cstdint>
#include <vector>

#include "optim/param_groups.h"

namespace keel::parallel {

inline constexpr std::int64_t kZero1AlignFloats = 64;  // 256 bytes: whole cache lines and vector loads

// The optimizer-work model behind the cuts. One unit is an AdamW element (about 30 bytes of HBM
// traffic: fp32 param, grad, m, v read; param, m, v and the bf16 copy written), about 8 ps on an
// H200; a GEMM does about 700 TFLOP/s there, so a unit is worth about 5,600 GEMM FLOPs. A Muon
// matrix [r, c] (s = min, l = max) costs per float its elementwise passes (about one unit) plus
// 5 (4 s^2 l + 2 s^3) / (s l) Newton-Schulz FLOPs (docs/optim.md). Only the ratio matters, and
// it is much the same on other GPUs (GEMM rate over memory bandwidth). The Newton-Schulz step
// count is optim::MuonConfig's default (keel train's and ZAYA1's).
inline constexpr double kZero1FlopsPerAdamWFloat = 5600;
double zero1_muon_cost_per_float(std::int64_t rows, std::int64_t cols);

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

// The busiest shard of a plan relative to the mean: in floats (optimizer-state memory) and in
// optimizer work (the model above). 1.0 is perfect balance.
struct Zero1Balance {
  double floats = 0, cost = 0;
  double worst() const { return floats > cost ? floats : cost; }
};
Zero1Balance zero1_balance(const optim::ParamLayout& layout, const Zero1Plan& plan);

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
