// Communication buckets for the overlapped ZeRO-1 step on GPUs (docs/parallel.md, "Overlap").
//
// The flat buffer is cut into buckets that each lie inside one stage (a contiguous range of
// parameters that becomes final at one point of backward and is first read at one point of
// forward: the embedding, each layer's attention part and MLP part, the final norm / head) and
// inside one rank's ZeRO-1 shard (zero1.h), so each bucket has exactly one owner: its gradients
// are reduced to that owner (ncclReduce) as soon as its stage's backward is done, and the
// owner broadcasts its updated parameters (ncclBroadcast) for the next forward. Per rank this
// moves what a reduce-scatter plus an all-gather move.
//
// Inside a stage and shard, buckets grow to about `target_floats`: cuts fall at parameter
// boundaries, at the matrix boundaries of Muon stacks, and every `target_floats` (aligned to
// kZero1AlignFloats) inside AdamW parameters; never inside a Muon matrix (its owner runs
// Newton-Schulz on the whole matrix, and does so per bucket), so a single Muon matrix larger
// than the target is one bucket.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "optim/param_groups.h"
#include "parallel/data_parallel_comm.h"
#include "parallel/zero1.h"

namespace keel::parallel {

struct Zero1Bucket {
  std::int64_t begin = 0, end = 0;  // [begin, end) of the flat buffer
  int owner = 0;                    // the rank whose shard holds it
  int stage = 0;                    // index into the stage list
};

// The stages of a model's flat layout (model::param_stage, in forward order: the embedding, each
// layer's attention part and MLP part, what follows the layers) inside [0, replicated_end), the
// region the overlapped step covers (the expert region after it is in no stage). Returns
// model::stage_count(layers) + 1 ascending offsets from 0 to replicated_end (empty stages
// allowed), or nothing when the layout does not order the stages by offset (that step then does
// not overlap).
std::optional<std::vector<std::int64_t>> overlap_stage_bounds(const optim::ParamLayout& layout, int layers,
                                                              std::int64_t replicated_end);
// The widest stage, in floats: what the overlapped step's bf16 gradient-reduction scratch must
// hold for one stage at a time.
std::int64_t largest_stage_floats(const std::vector<std::int64_t>& stage_bounds);

// Why keel train's GPU ZeRO-1 step cannot overlap a layout whose weights split over a tensor or
// TSP group (`weight_split`), or null when it can: with Muon (its split matrices gather over the
// tensor group shard by shard) or with an expert region (expert parallelism). One rule for the
// backend (train/cuda_backend_cuda.cc) and keel size (size/keel_train_shards.cc).
const char* weight_split_classic_reason(bool weight_split, bool muon, bool expert_region);

// `stage_bounds`: stages + 1 ascending offsets from 0 to layout.total_floats (empty stages
// allowed). Returns the buckets in offset order; they tile [0, total_floats). Throws
// keel::Error on bad stage bounds, a target < 1, or a plan of another buffer size.
std::vector<Zero1Bucket> plan_zero1_buckets(const optim::ParamLayout& layout, const Zero1Plan& plan,
                                            const std::vector<std::int64_t>& stage_bounds,
                                            std::int64_t target_floats);

// The GPU ZeRO-1 step's switches: `parallel.zero1` of the train config (docs/train.md), so they
// are in the config every rank hashes and compares at start-up (ranks that disagreed would hang
// in mismatched collectives).
//   overlap: false         the classic step (reduce-scatter after backward, all-gather after the
//                          update, nothing overlapped), for comparison and as a fallback
//   bucket_mib: X          bucket size in MiB of fp32 gradients (default 256; fractions allowed)
//   defer_embedding: auto  the deferred embedding-gradient scatter: on when it moves fewer floats
//                          than reducing the embedding does; true / false force it
//   broadcast_bf16: false  broadcast fp32 masters for every parameter (default: the bf16 copy for
//                          matrices only the GEMMs read; fp32 masters of other ranks' shards are
//                          then gathered only when state() asks for them)
//   shard_masters: false   keep every fp32 master on every rank (default, with bf16 broadcasts: a
//                          rank keeps the masters of its shard and of what travels in fp32 only;
//                          the rest of its address range is unbacked)
//   group_reduces: false   launch each bucket's reduce alone (default: a stage's reduces as one
//                          NCCL group)
//   optimizer_stream: false run the shard's optimizer on the compute stream before the next
//                          forward (default: on a third stream, beside the next forward)
//   profile: true          print each step's device timeline from the first and last rank
//                          (diagnostics; computes the same)
struct Zero1OverlapOptions {
  bool enabled = true;
  double bucket_mib = 256;
  int defer_embedding = -1;  // -1 automatic, 0 off, 1 on
  bool broadcast_bf16 = true;
  bool shard_masters = true;
  bool group_reduces = true;
  bool optimizer_stream = true;
  bool profile = false;
  std::int64_t bucket_floats() const;
};

// How a data-parallel run reduces and shards: `parallel.grad_reduce` and `parallel.zero1`.
struct DataParallelOptions {
  GradReduceDtype grad_reduce = GradReduceDtype::kFp32;
  Zero1OverlapOptions zero1;
};

}  // namespace keel::parallel
