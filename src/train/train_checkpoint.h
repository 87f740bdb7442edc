// keel train's checkpoints through the keel ckpt library (src/ckpt, docs/checkpoint.md): a
// checkpoint is a step directory under checkpoint.dir (data files + metadata.json, committed
// atomically, `latest` pointer, retention), saved asynchronously: save() stages the state in
// host buffers and returns; background threads write while training goes on; the next save()
// or finish() completes the commit.
//
// Tensors, each an fp32 tensor of the parameter's shape (the parallelism-agnostic names every
// layout loads from):
//   model/<param>            the fp32 master weights
//   optim/exp_avg/<param>    AdamW m (Muon's momentum for Muon parameters)
//   optim/exp_avg_sq/<param> AdamW v (only for AdamW parameters: Muon keeps no v)
//   router/bias.<i>          the router selection bias of MoE layer i, [E]
//   router/bias_m.<i>, router/bias_v.<i>  the adam balancing rule's moments (only under it)
// Non-tensor state (metadata.json "state"): step, optimizer step count (and the adam balancing
// rule's update count, router_balance_updates, when its moments are saved), the data sampler's
// position, the model name, the effective config text, and "format": "keel.train/3" (/2, which
// also stored zero v for Muon parameters, loads too).
//
// Under data parallelism with ZeRO-1 (layout "dp=N,zero=1") every rank writes the boxes of its
// optimizer shard's flat range [shard_begin, shard_end), of the optimizer state and of the
// (replicated) parameters alike, so the writes are spread evenly and each element is stored
// once; router biases are spread over the ranks. Under tensor parallelism ("dp=N,tp=T,zero=1",
// the saving ranks are the world of N x T) the data ranks of each tensor rank shard that rank's
// flat buffer alike: a parameter split over tp is written by every tensor rank, the boxes of
// its own block (model::block_pieces: inner-dimension splits and parts make these several
// boxes) in its shard's range; a parameter every tensor rank holds whole is written by tensor
// rank 0 alone. A load reads the boxes of the loading rank's blocks and of its own shard, so a
// checkpoint from any number of ranks and any tensor degree resumes at any other (the ckpt
// library's resharding: each load names the boxes it needs).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "ckpt/comm.h"
#include "ckpt/types.h"
#include "ckpt/writer.h"
#include "mesh/shape.h"
#include "model/param_layout.h"
#include "optim/param_groups.h"
#include "train/backend.h"

namespace keel::train {

struct TrainCheckpointOptions {
  int keep_last = 0;   // newest K committed checkpoints kept (0: all)
  int keep_every = 0;  // also every step divisible by M
  int threads = 2;     // writer threads (data files per rank)
  std::uint64_t flush_behind_bytes = 256ull << 20;  // ckpt::SaveOptions::flush_behind_bytes
  int context_parallel = 1;  // the run's cp degree: named in the saved layout (it splits no tensor)
  int tsp = 1;               // the run's tsp degree: its blocks are the tensor degree's (model::weight_shape)
  std::function<bool(std::int64_t step)> fail_with_enospc_at;  // fault injection (ckpt::SaveOptions)
  std::function<std::int64_t(std::int64_t step)> write_delay_ms_at;  // fault injection (ckpt::SaveOptions)
};

// The mesh a slice stands for (only the degrees of the axes that split parameters matter: ep
// and tp; dp = ep) and its coordinate on it: model::param_layout(cfg, slice_mesh(s)) is the
// slice's layout, model::block_pieces(p, slice_mesh(s), slice_coord(s)) its blocks.
mesh::Shape slice_mesh(const StateSlice& s);
mesh::Coord slice_coord(const StateSlice& s);

// The boxes of the whole tensor that hold the elements [lo, hi) (local flat indices, 0 = the
// block's first element) of a block of p made of `pieces` (model::block_pieces): the local
// range as boxes of the block (ckpt::flat_range_boxes on p.shape), cut where pieces meet, moved
// to the pieces' places in the whole tensor. In local flat order, each box one contiguous run of
// the block (box k's elements start where box k-1's end). keel::Error for a range outside it.
std::vector<ckpt::Box> block_boxes(const optim::ParamInfo& p, const std::vector<model::BlockPiece>& pieces,
                                   std::int64_t lo, std::int64_t hi);
// The same for the block the rank of `slice` holds.
std::vector<ckpt::Box> block_boxes(const optim::ParamInfo& p, const StateSlice& slice, std::int64_t lo, std::int64_t hi);

// What rank `rank` of the `ranks` that save together writes of `view` (a state of `layout`):
// the boxes of its optimizer ranges of model/*, optim/exp_avg/* and optim/exp_avg_sq/* (those of
// parameters split over tp on every tensor rank, the others on tensor rank 0), and the router
// biases i with i % ranks == rank. Over all ranks of a mesh (each with its slice of
// train::plan_state_shards) every element of every tensor is written exactly once. keel::Error
// when the view has no data for its ranges.
std::vector<ckpt::SaveShard> checkpoint_shards(const CheckpointView& view, const optim::ParamLayout& layout, int rank,
                                               int ranks);
// The layout `ranks` saving ranks holding slices like `s` save, in the mesh vocabulary
// (mesh/shape.h): "dp=4,ep=2,zero=1", "dp=2,tp=2,zero=1", "dp=1,cp=2,zero=1" (dp = ranks / (tp
// x cp); ep folded into the data ranks; zero=1 when dp x cp > 1). keel::Error when tp x cp does
// not divide ranks.
std::string checkpoint_layout_name(int ranks, const StateSlice& s, int context_parallel = 1, int tsp = 1);

class TrainCheckpointer {
 public:
  // comm: the ranks that save together, every one calling save() and finish() together
  // (MPI_COMM_NULL: this process alone). Without tensor parallelism the data-parallel group;
  // with it, every rank that holds state: the world of the data x tensor ranks (each tensor
  // rank writes its own blocks).
  TrainCheckpointer(std::string root, const TrainCheckpointOptions& options, MPI_Comm comm = MPI_COMM_NULL);
  // The same over any ckpt::Comm (tests: ranks simulated by threads of one process).
  TrainCheckpointer(std::string root, const TrainCheckpointOptions& options, std::unique_ptr<ckpt::Comm> comm);
  ~TrainCheckpointer();

  // Stages `state` (plus `extra`: step, sampler position, ...) and starts writing; completes a
  // previous save first. Returns the stall: seconds this call blocked training.
  double save(std::int64_t step, const CheckpointView& view, const optim::ParamLayout& layout,
              const nlohmann::json& extra);
  double save(std::int64_t step, const TrainState& state, const optim::ParamLayout& layout, const nlohmann::json& extra) {
    return save(step, CheckpointView::of(std::make_shared<const TrainState>(state)), layout, extra);
  }
  // Allocates the staging buffers the saves of `view` will use (pinned for device memory), so
  // no save pays for the allocation. No communication.
  void reserve(const CheckpointView& view, const optim::ParamLayout& layout);
  // Completes the save in flight, if any (commit, `latest`, retention). A failed save is an
  // error naming the root and the step `latest` still names (nothing of that save is committed).
  std::optional<ckpt::SaveStats> finish();
  bool in_flight() const { return saver_->in_flight(); }
  // This rank's background writes of the save in flight are done (no communication).
  bool writes_done() const { return saver_->writes_done(); }
  std::int64_t bytes_written() const { return saver_->bytes_written(); }
  const std::string& root() const { return root_; }

 private:
  std::vector<ckpt::SaveShard> shards(const CheckpointView& view, const optim::ParamLayout& layout) const;

  std::string root_;
  std::unique_ptr<ckpt::Comm> comm_;
  int context_parallel_ = 1, tsp_ = 1;
  std::unique_ptr<ckpt::Saver> saver_;
};

struct LoadedTrainState {
  TrainState state;
  nlohmann::json extra;  // the "state" saved beside the tensors
  std::int64_t step = 0;  // its step (validated)
  std::string dir;       // the step directory read
  double read_amplification = 1.0;
  std::uint64_t bytes_read = 0;  // by this rank
  double read_seconds = 0;
};

// Reads a checkpoint directory (or a root whose `latest` names one) into the parameter layout
// (model::param_layout) and router-bias sizes of `cfg`: every parameter, and the optimizer state
// of the flat range `shard` (second < 0: all of it). Throws keel::Error naming the tensor or
// file on a missing tensor, a shape or dtype mismatch, or a damaged file.
LoadedTrainState load_train_checkpoint(const std::string& path, const model::ModelConfig& cfg,
                                       std::pair<std::int64_t, std::int64_t> shard = {0, -1});
// The same for what `slice` holds: its experts and tensor blocks (of layout
// model::param_layout(cfg, slice_mesh(slice))) and its optimizer ranges, from a checkpoint of
// any layout.
LoadedTrainState load_train_checkpoint(const std::string& path, const model::ModelConfig& cfg, const StateSlice& slice);

// The weights alone, to start a new run or to decode: every `model/<param>` of `cfg`, and the
// router balancing biases when the checkpoint has them (zeros otherwise). Reads keel train
// checkpoints and the weight sets `keel ckpt import` commits (released ZAYA1 weights); no
// optimizer state is read. The result has an empty optimizer shard ({0, 0}) and step 0.
// Throws keel::Error naming the tensor or file on a missing tensor, a shape or dtype mismatch,
// or a damaged file.
struct LoadedWeights {
  TrainState state;
  std::string dir;          // the step directory read
  std::string description;  // "step N" / "weights imported from PATH (zaya1 names)"
  bool router_bias = false; // the checkpoint had the balancing biases
};
// With expert_parallel > 1: the weights of that expert-parallel rank (its E / ep experts); with
// tensor_parallel > 1 the blocks of that tensor rank (layout model::param_layout(cfg, mesh with
// ep and tp)). The state's slice carries both.
LoadedWeights load_model_weights(const std::string& path, const model::ModelConfig& cfg, int expert_parallel = 1,
                                 int expert_rank = 0, int tensor_parallel = 1, int tensor_rank = 0);

// True when `path` looks like a keel ckpt root or step directory (has `latest` or
// metadata.json), as opposed to a single-file checkpoint of the older format.
bool is_ckpt_directory(const std::string& path);

}  // namespace keel::train
