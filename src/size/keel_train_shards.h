// What `keel train` itself holds and steps per GPU, for the layouts it runs: data parallelism
// with ZeRO-1, expert parallelism and tensor parallelism (tsp = pp = cp = 1), on a model it can
// train (with tp: its placements, model/param_layout.h; every tensor rank alike).
//
// keel size's general formulas give every GPU 1/G of the optimizer state and of Muon's
// Newton-Schulz work. keel train's ZeRO-1 cuts (parallel/zero1.h) never split a Muon matrix and
// balance optimizer work against floats, so its busiest rank holds and steps somewhat more than
// the mean, most where there are few matrices per rank. These are the plans keel train makes
// (train::plan_state_shards over its own parameter layout), not a model of them.
#pragma once

#include <optional>
#include <vector>

#include "size/estimate.h"

namespace keel::size {

struct KeelTrainShards {
  // Optimizer-state floats (fp32 master, m, v) of each rank's ZeRO-1 shards: its shard of the
  // replicated region (over dp) plus its expert group's shard of the expert region (over
  // dp / ep). Ranks in launch order.
  std::vector<double> rank_optimizer_floats;
  // Of those, the floats of AdamW parameters: the only ones with a v (Muon keeps its momentum in
  // m and has no v), so a rank holds 8 B per optimizer float plus 4 B per AdamW float.
  std::vector<double> rank_adamw_floats;
  // Newton-Schulz FLOPs and GEMM-model seconds of each rank's Muon matrices (empty with AdamW).
  std::vector<double> rank_muon_flops, rank_muon_seconds;
  double muon_flops_total = 0;  // every Muon matrix of the model once
  // parallel.grad_reduce: bf16 on more than one rank: the bf16 scratch the overlapped step
  // rounds a stage's (or the expert region's) gradients into, in elements.
  double bf16_reduce_scratch = 0;
  // With Muon: the device workspace of its largest matrix batch (an expert stack), in bytes.
  double muon_workspace_bytes = 0;

  double busiest_optimizer_floats() const;
  double busiest_optimizer_bytes() const;  // fp32 master and m for every float, v for AdamW's
  double mean_optimizer_floats() const;
  int busiest_muon_rank() const;  // by seconds; 0 without Muon
};

// nullopt when keel train does not run this layout (tsp, pp or cp above 1, a tensor degree the
// model does not split over; ZeRO other than
// 1 on several data-parallel ranks) or this model (train::validate_trainable): the general
// formulas then stand alone.
std::optional<KeelTrainShards> keel_train_shards(const Setup& s);

}  // namespace keel::size
