// TSP on CPU ranks (MPI): tensor and sequence parallelism folded onto one axis of D ranks
// (../shared/reference/parallelism.md §1). Rank s of the tsp group holds 1/D of every weight
// matrix (the blocks a tensor-parallel rank s would hold: model::weight_shape) AND 1/D of each
// sequence's tokens (context parallelism's zigzag chunks, context_parallel.h), so weight memory
// and activation memory both divide by D on the same ranks.
//
// Per sub-block (a layer's attention, or its MLP / experts), forward visits the D weight shards
// and runs the tensor-parallel block of each on this rank's tokens (attention: shard r's heads,
// their k and v all-gathered over the sequence by the context-parallel core, causal attention;
// MLP and experts: shard r's columns); the row-parallel projection's output, a partial sum, is
// added into the block output (TspAccumulator). No all-reduce of activations.
//   attention   in order r = 0 .. D-1 on every rank (the k/v all-gather needs every rank on the
//               same heads): shard r is broadcast from rank r, the next one's broadcast posted
//               before the current one is computed. Backward: broadcast again; this rank's
//               tokens' share of shard r's gradients summed onto rank r (MPI_Ireduce,
//               overlapped with the next shard).
//   MLP         a ring: rank s starts with its own shard and at step k holds shard (s - k) mod D,
//               sending it to rank s + 1 while computing with it. Backward: the weights go
//               round again, each shard's gradients following them, summed on the way, and
//               handed to the shard's rank by the last holder.
// Either way at most two shards are in flight beyond the rank's own.
//
// Parameters the tensor axis does not split (norms, residual scales, routers, kv projections
// replicated over more ranks than kv heads) are read and accumulated in place; their gradients
// are partial (this rank's tokens, shard by shard) and sum over the group once per step, as
// sequence parallelism's do (tensor_parallel.h: reduce_partial_gradients). The embedding and
// the LM head are visited the same way, their rows split by vocabulary: each rank looks up its
// tokens in each shard's rows, and the head's log-sum-exp runs over the shards' logits of this
// rank's tokens (no hidden state is gathered).
// Experts are sliced like the dense MLP (expert tensor parallelism over the tsp axis); with
// expert parallelism (folded over the data ranks, as always) each shard's experts run where EP
// places them.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "blocks/runners.h"
#include "blocks/weights.h"
#include "model/config.h"
#include "optim/param_groups.h"
#include "parallel/tensor_parallel.h"
#include "tensor/tensor.h"

namespace keel::parallel {

// The unit a split parameter's shard travels with, among a model's 2 * layers + 2 (layer l's
// attention 2l, its MLP or experts 2l + 1, the embedding, the untied head); -1 for a parameter
// TSP reads in place (not split). keel::Error for a split one of no unit.
int tsp_unit(const optim::ParamInfo& p, int layers);
// From a rank's layout: the rows of a vocabulary table's shard that travel together (as many as
// fit in the largest layer unit's shard, at least 64, at most the shard's rows); the floats of
// the largest piece that travels (a layer unit's shard, or a table piece): what each shard
// buffer holds (`keel size` counts them too); whether the head has rows of its own (untied).
struct TspSizes {
  std::int64_t piece_rows = 0, largest = 0;
  bool own_head = false;
};
TspSizes tsp_sizes(const optim::ParamLayout& layout, int layers);

// The tensor-parallel boundary of one shard's pass through a block: the row-parallel
// projection's partial output is added into the block output (the first shard writes it), and
// in backward the input gradient likewise.
class TspAccumulator final : public blocks::LinearRunner {
 public:
  // first: the first shard of this pass (it writes; the others add).
  void begin(bool first) { first_ = first; }
  Tensor out(const Tensor& y) override;
  void exit(const Tensor& partial, const Tensor& y) override;
  Tensor dx_out(const Tensor& dx) override;
  void enter_backward(const Tensor& partial, const Tensor& dx) override;

 private:
  static Tensor like(std::vector<float>& buf, const Tensor& t);
  bool first_ = true;
  std::vector<float> out_, dx_;
};

class TspShards {
 public:
  // A layer's sub-blocks, and the model's two vocabulary tables.
  enum class Part { kAttention, kMlp, kEmbedding, kHead };

  // tsp: the mesh's tsp group (its communicator is duplicated for the shard traffic).
  explicit TspShards(MPI_Comm tsp);
  ~TspShards();
  TspShards(const TspShards&) = delete;
  TspShards& operator=(const TspShards&) = delete;

  int size() const { return group_.size(); }
  int rank() const { return group_.rank(); }
  // Collectives over the group (the vocabulary-parallel embedding and head, the gradient sums).
  const TensorGroup& group() const { return group_; }

  // The model's parameters and gradients: its layout (model::param_layout of the run's mesh), the
  // flat buffers and their views by role. Once, before forward.
  void bind(const optim::ParamLayout& layout, const blocks::WeightViews& params, const blocks::WeightViews& grads);

  // fn(shard, that shard's weights of the layer (its part sliced, the rest this rank's), the
  // accumulating boundary): once per shard, every rank of the group together.
  using Forward = std::function<void(int shard, const blocks::LayerWeights& w, blocks::LinearRunner& boundary)>;
  void forward(int layer, Part part, const Forward& fn);
  // fn(shard, weights, where its gradients go (the sliced ones: this shard's buffer, summed onto
  // the shard's rank afterwards; the rest: this rank's gradients), boundary).
  using Backward = std::function<void(int shard, const blocks::LayerWeights& w, blocks::LayerWeights& g,
                                      blocks::LinearRunner& boundary)>;
  void backward(int layer, Part part, const Backward& fn);
  // The same over a vocabulary table (kEmbedding, kHead: the embedding's or the untied head's
  // rows [shard V/D, (shard + 1) V/D); tied, the head's shards are the embedding's), each
  // shard's rows in pieces no larger than a layer's shard (tsp_table_piece_rows):
  // fn(shard, the vocabulary id of the piece's first row, its rows) and in backward fn(...,
  // their gradient buffer, summed onto the shard's rank afterwards).
  using TableForward = std::function<void(int shard, std::int64_t first, const Tensor& rows)>;
  using TableBackward =
      std::function<void(int shard, std::int64_t first, const Tensor& rows, const Tensor& grad)>;
  void forward(Part table, const TableForward& fn);
  void backward(Part table, const TableBackward& fn);

  // The floats of the largest sub-block shard: the shard buffers hold two of them, the
  // gradient buffers three (two in flight, the sum received).
  std::int64_t largest_shard() const { return sizes_.largest; }

 private:
  struct Slice {
    blocks::Slot slot;
    std::int64_t numel = 0;
    std::int64_t at = 0;  // in a shard buffer
    std::vector<std::int64_t> shape;
  };
  struct Unit {  // one sub-block's sliced parameters (or a vocabulary table)
    std::vector<Slice> slices;
    std::int64_t floats = 0;
  };
  const Unit& unit(int layer, Part part) const;  // kAttention or kMlp
  // Adds sum_ (u's gradients summed over the group) into this rank's gradients of u.
  void add_sum(int layer, const Unit& u);
  void table_sweep(Part table, bool backward, const TableBackward& fn);
  // Posts the broadcast of shard r of layer's unit u into buf (rank r packs its slices first).
  void post(int layer, const Unit& u, int r, float* buf, MPI_Request* req);
  // The layer's weights (base w_) or gradients (g_) with u's slices pointed into buf (null:
  // this rank's own).
  blocks::LayerWeights view(const blocks::WeightViews& base, int layer, const Unit& u, float* buf) const;
  // Visits the shards in order: broadcast (prefetching the next), compute(shard, weights,
  // gradients or null in forward), and in backward the shard's gradients summed on its rank.
  template <typename Compute>
  void sweep(int layer, const Unit& u, bool backward, Compute&& compute);
  // The MLP's (and experts') schedule: rank s holds shard (s - k) mod D at step k, passing it to
  // rank s + 1 while computing with it (double-buffered); in backward each shard's gradients
  // follow its weights round the ring, summed on the way, and end at its rank.
  template <typename Compute>
  void ring(int layer, const Unit& u, bool backward, Compute&& compute);

  TensorGroup group_;
  MPI_Comm comm_ = MPI_COMM_NULL;  // the duplicate the shards travel on
  blocks::WeightViews w_, g_;
  std::vector<Unit> units_;  // [layer * 2 + part]
  TspSizes sizes_;
  std::vector<float> shard_[2], grad_[2], sum_;
  TspAccumulator acc_;
};

}  // namespace keel::parallel
