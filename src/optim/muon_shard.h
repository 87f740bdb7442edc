// Which data-parallel rank runs Muon on which matrix under ZeRO-1 (docs/optim.md).
//
// Newton-Schulz needs whole matrices, so instead of slicing Muon's momentum by flat offsets
// (as AdamW's m and v are), every matrix (each expert of a 3-D stack is its own matrix) is
// owned by one rank, which keeps its momentum, runs muon_matrix_step() on the full gradient and
// then sends the updated matrix to the others. Owners are chosen greedily, largest
// Newton-Schulz cost first, each to the currently least-loaded rank (LPT scheduling, within
// 4/3 of the best makespan); ties go to the lower parameter/matrix index and the lower rank, so
// every rank computes the same plan.
#pragma once

#include <cstdint>
#include <vector>

#include "optim/param_groups.h"

namespace keel::optim {

struct MuonMatrix {
  int param = 0;              // index into layout.params
  std::int64_t matrix = 0;    // index within a 3-D stack (0 for 2-D)
  std::int64_t offset = 0;    // float offset of the matrix in the flat buffers
  std::int64_t rows = 0, cols = 0;
  double flops = 0;           // newton_schulz_flops(rows, cols, ns_steps)
  int owner = 0;
};

struct MuonShardPlan {
  std::vector<MuonMatrix> matrices;   // in layout order
  std::vector<double> rank_flops;     // Newton-Schulz FLOPs per rank
  std::vector<std::int64_t> rank_floats;  // momentum floats per rank
};

MuonShardPlan plan_muon_shards(const ParamLayout& layout, int world_size, int ns_steps = 5);

}  // namespace keel::optim
