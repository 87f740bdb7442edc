// TSP on GPUs: the GPU twin of tsp.h (read that first: which parameters are split, what each
// shard's pass computes, which gradients are partial). Rank s of the tsp group holds a tensor
// rank's blocks of every matrix and context parallelism's zigzag chunks of every sequence; the
// model (train/cuda_model_cuda.cc) runs each layer's attention and MLP (or experts) once per
// weight shard through this object, over the NCCL communicators of the tsp group. CUDA builds
// only.
//
//   sub-blocks  for shard r = 0 .. D-1 in order, on every rank: shard r's slices (bf16 for what
//               the blocks read in bf16, fp32 for CCA's convolutions and temperatures) are
//               broadcast from rank r into a shard buffer, on a side stream and a communicator
//               of their own (Mesh::nccl_side), shard r + 1's broadcast posted before shard r
//               is computed (two buffers). Backward broadcasts again; this rank's share of
//               shard r's gradients goes to a gradient buffer and is summed onto rank r
//               (ncclReduce, in place there) on the side stream while shard r + 1 computes.
//   MLP ring    the MLP's (or experts') shards travel in a ring, as on CPU ranks: at step
//               k = 0 .. D-1 rank s computes shard (s - k) mod D, its own first, while it sends
//               the shard it holds to rank s + 1 and receives the next from rank s - 1 (two
//               buffers, on the side stream). Backward rings the weights again; shard j's
//               gradients start at rank j + 1 in a zeroed buffer, each rank adds its share into
//               the buffer it receives and passes it on, and rank j adds the other ranks' sum
//               into its own gradients (which its own pass wrote) at the end. The block output
//               (and input gradient) is written by the first pass a rank makes, its own shard's.
//   boundary    the block output (and in backward the input gradient) is the sum of the
//               shards' row-parallel partials: a sweep's first pass writes (shard 0's, or
//               under the ring this rank's own), later passes add (boundary(), first()).
//   tables      the embedding's and the untied LM head's rows are split by vocabulary; each
//               shard's rows travel the same way in pieces no larger than a sub-block's shard
//               (tsp_sizes), and the model looks its tokens up in each piece and keeps the
//               head's log-sum-exp statistics piece by piece: no hidden state is gathered.
// Buffers: two weight shards and three gradient shards (two computed into, one the ring's
// receive) of the largest sub-block (or table piece), and the boundary's bf16 and fp32 [N, D].
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "blocks/cuda/runners.h"
#include "blocks/cuda/weights.h"
#include "model/config.h"
#include "optim/param_groups.h"
#include "parallel/nccl_group.h"

namespace keel::parallel {

// The accumulating boundary of one shard's pass (begin(first) before each pass).
class CudaTspBoundary final : public blocks::cuda::LinearRunner {
 public:
  using bf16 = blocks::cuda::bf16;
  CudaTspBoundary(bf16* tmp_bf16, float* tmp_f32) : tmp_bf_(tmp_bf16), tmp_f32_(tmp_f32) {}
  void begin(bool first) { first_ = first; }
  // The fp32 outputs add into the block output inside their GEMMs (beta = 1): the model passes
  // the block output as the residual of every pass after the first.
  bool output_is_whole() const override { return true; }
  bf16* out(bf16* y, std::int64_t, std::int64_t) override { return first_ ? y : tmp_bf_; }
  void exit(bf16* partial, bf16* y, std::int64_t tokens, std::int64_t width, cudaStream_t stream) override;
  float* dx_out(float* dx, std::int64_t, std::int64_t) override { return first_ ? dx : tmp_f32_; }
  bf16* dx_out(bf16* dx, std::int64_t, std::int64_t) override { return first_ ? dx : tmp_bf_; }
  void enter_backward(float* partial, float* dx, std::int64_t tokens, std::int64_t width, cudaStream_t stream) override;
  void enter_backward(bf16* partial, bf16* dx, std::int64_t tokens, std::int64_t width, cudaStream_t stream) override;

 private:
  bf16* tmp_bf_;
  float* tmp_f32_;
  bool first_ = true;
};

class CudaTspShards {
 public:
  using bf16 = blocks::cuda::bf16;
  enum class Part { kAttention, kMlp, kEmbedding, kHead };

  // side: a communicator of the group for the shards (Mesh::nccl_side), on a stream of this
  // object's; group: the group's own (Mesh::nccl), for the model's collectives on its stream
  // (group()). tokens: this rank's rows of a micro-batch; hidden: D. Allocates the boundary's
  // buffers (this rank's GPU).
  CudaTspShards(std::shared_ptr<NcclGroup> side, std::shared_ptr<NcclGroup> group, std::int64_t tokens,
                std::int64_t hidden);
  ~CudaTspShards();
  CudaTspShards(const CudaTspShards&) = delete;
  CudaTspShards& operator=(const CudaTspShards&) = delete;

  int size() const { return side_->size(); }
  int rank() const { return side_->rank(); }
  // The group's communicator for collectives on the model's stream (parallel.tsp_tables: gather).
  NcclGroup& group() const { return *group_; }
  // Inside a sweep's fn: whether this is the sweep's first pass (it writes the block output and
  // input gradient; later passes add), and the boundary of this pass.
  bool first() const { return first_; }
  blocks::cuda::LinearRunner& boundary() {
    boundary_->begin(first_);
    return *boundary_;
  }
  // An fp32 [tokens, hidden] buffer the model may use between shards' passes (the tables').
  float* scratch_f32() const { return tmp_f32_; }

  // The model's flat buffers (model::param_layout of the run's mesh): its fp32 parameters, their
  // bf16 copy, its gradients. Allocates the shard buffers. Once, before forward.
  void bind(const model::ModelConfig& cfg, const optim::ParamLayout& layout, const float* params,
            const bf16* params_bf16, float* grads);

  // fn(shard, that shard's weights of the layer: its part's slices in a shard buffer, or this
  // rank's own for its own shard, the rest this rank's), once per shard, every rank together.
  // Enqueues on `stream` (the model's); returns with the stream ordered after the traffic.
  using Forward = std::function<void(int shard, const blocks::cuda::LayerWeights& w)>;
  void forward(int layer, Part part, cudaStream_t stream, const Forward& fn);
  // fn(shard, weights, where its gradients go: the part's slices in a gradient buffer (zeroed;
  // summed onto the shard's rank afterwards) or, for this rank's own shard, its gradients; the
  // rest this rank's gradients).
  using Backward =
      std::function<void(int shard, const blocks::cuda::LayerWeights& w, const blocks::cuda::LayerGrads& g)>;
  void backward(int layer, Part part, cudaStream_t stream, const Backward& fn);

  // The same over a vocabulary table (kEmbedding, or kHead: the untied head's rows, else the
  // embedding's): its pieces in order, each piece's shards in order: fn(shard, the vocabulary
  // id of the piece's first row, its rows, their bf16 weights [rows, hidden], where their
  // gradients go: a zeroed buffer summed onto the shard's rank afterwards, or this rank's own;
  // null in forward).
  using TableFn = std::function<void(int shard, std::int64_t first, std::int64_t rows, const bf16* w, float* g)>;
  void forward(Part table, cudaStream_t stream, const TableFn& fn);
  void backward(Part table, cudaStream_t stream, const TableFn& fn);

  // Device bytes: the shard buffers and the boundary's.
  std::size_t shard_bytes() const { return shard_bytes_; }

 private:
  struct Slice {
    std::int64_t numel = 0, offset = 0;  // the parameter's, in the flat buffers
    bool bf16 = false;                   // read in bf16 (else fp32)
    std::size_t at = 0;                  // bytes into a weight buffer
    std::int64_t grad_at = 0;            // floats into a gradient buffer
  };
  struct Unit {
    std::vector<Slice> slices;
    std::size_t bytes = 0;
    std::int64_t grad_floats = 0;
  };
  struct Table {  // this rank's rows of a vocabulary table, in pieces
    std::int64_t offset = 0, rows = 0, width = 0, piece_rows = 0;
    int pieces() const { return piece_rows > 0 ? static_cast<int>((rows + piece_rows - 1) / piece_rows) : 0; }
  };
  // Visits the shards of u in order: broadcast (prefetching the next), fn(shard, its weight
  // buffer, whether it is this rank's own), and in backward the shard's gradients summed on
  // its rank.
  void sweep(const Unit& u, cudaStream_t stream, bool backward, const std::function<void(int, int, bool)>& fn);
  // The MLP ring: fn(shard, buffer, whether it is this rank's own shard) for the shards in ring
  // order (this rank's own first), the weights passed on to rank + 1 while each computes, and
  // in backward the gradients following their shard round the ring to its rank.
  void ring_sweep(const Unit& u, cudaStream_t stream, bool backward, const std::function<void(int, int, bool)>& fn);
  void pass_weights(const Unit& u, bool own, int from_buf, int to_buf);  // send one, receive the next
  void pass_grads(const Unit& u, int buf);  // send gradient buffer buf on, receive into ring_g_
  void table_sweep(Part table, cudaStream_t stream, bool backward, const TableFn& fn);
  void post(const Unit& u, int shard, int buf);    // the broadcast of shard into weight buffer buf
  void reduce(const Unit& u, int shard, int buf);  // the gradient buffer buf summed onto shard's rank

  std::shared_ptr<NcclGroup> side_, group_;
  std::unique_ptr<CudaTspBoundary> boundary_;
  float* tmp_f32_ = nullptr;  // the boundary's fp32 buffer
  std::vector<Unit> units_;  // [layer * 2 + part]
  Table embed_, head_;       // head_.rows 0: tied
  const float* params_ = nullptr;
  const bf16* params_bf16_ = nullptr;
  float* grads_ = nullptr;
  blocks::cuda::ModelWeights own_w_, buf_w_[2];
  blocks::cuda::ModelGrads own_g_, buf_g_[2];
  std::byte* wbuf_[2] = {nullptr, nullptr};
  float* gbuf_[2] = {nullptr, nullptr};
  float* ring_g_ = nullptr;  // the MLP ring's received gradient sums (a third gradient buffer)
  void* tmp_ = nullptr;  // the boundary's buffers
  void* mem_ = nullptr;  // the shard buffers
  std::size_t shard_bytes_ = 0;
  bool first_ = true;  // the current pass is its sweep's first
  cudaStream_t comm_ = nullptr;
  // start: the model stream's work so far; ready/free: a weight buffer's broadcast (or ring
  // receive) landed, its compute done; reduced: a gradient buffer's sum (or ring send and
  // receive) done; done: the sweep's traffic done.
  // ring: the ring's gradient sum received.
  cudaEvent_t start_ = nullptr, done_ = nullptr, ready_[2] = {}, free_[2] = {}, reduced_[2] = {}, ring_ = nullptr;
};

}  // namespace keel::parallel
