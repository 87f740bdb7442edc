// The overlapped ZeRO-1 step on GPUs (docs/parallel.md, "Overlap"): the data-parallel schedule
// a training model informs through StageHooks (stage_hooks.h). CUDA builds only.
//
// The flat buffer is cut into buckets (zero1_buckets.h) inside stages and inside one rank's
// shard. During the last micro-batch's backward, as each stage's gradients become final
// (grads_final), the compute stream records an event, the communication stream waits on it and
// reduces (ncclReduce to the owner) the stage's buckets. The embedding's own scatter-add of
// that micro-batch can be deferred: its buckets are reduced at the start of backward and the
// owners add every rank's (token, dL/dx) rows at the end (take_embedding_grads), when that moves
// fewer floats. After the norm, each owner updates its buckets in offset order on an optimizer
// stream and broadcasts each one as soon as it is updated (the bf16 copy for matrices only
// GEMMs read, fp32 for the rest), and the next forward waits per stage for its parameters
// (before_stage) while the update of the rank's own shard runs beside it. With expert
// parallelism the expert region (after the replicated one) is ZeRO-1 over the expert-data group:
// reduced after the layers' backward (layers_done), updated and broadcast before the first MoE
// layer's stage.
//
// The switches are parallel.zero1.* (zero1_buckets.h); `profile` prints each step's device
// timeline from the first and last rank.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "device/device_arena.h"
#include "device/sparse_device_buffer.h"
#include "ops/cuda/common.h"
#include "ops/cuda/gemm.h"
#include "optim/param_groups.h"
#include "parallel/mesh.h"
#include "parallel/stage_hooks.h"
#include "parallel/zero1.h"
#include "parallel/zero1_buckets.h"
#include "parallel/zero1_profile_cuda.h"

namespace keel::parallel {

// What the step needs of the optimizer, over the ranges of the flat buffer this rank owns.
class ShardOptimizer {
 public:
  virtual ~ShardOptimizer() = default;
  // The sum of squares of the gradients in [begin, end) into the step's device accumulator (a
  // double at sum_squares_buffer()), added to it with `accumulate`.
  virtual void sum_squares(std::int64_t begin, std::int64_t end, bool accumulate, cudaStream_t stream) = 0;
  virtual double* sum_squares_buffer() = 0;
  // How many doubles at sum_squares_buffer() the data group sums (a norm kept in parts, each
  // reduced over its own groups before clip() adds them: tensor parallelism's).
  virtual int sum_squares_count() const { return 1; }
  // The global norm and clip coefficient from the (summed) accumulator, on the device; then both
  // on the host (read_norm: the step's one sync; the caller checks that the norm is finite).
  virtual void clip(double max_norm, cudaStream_t stream) = 0;
  virtual std::pair<double, float> read_norm(cudaStream_t stream) = 0;
  // The updates of one step: begin, then any number of update() calls (each at the same
  // optimizer step), then end. update: AdamW on the AdamW parameters and Muon on the whole
  // matrices inside [begin, end), with the step's clip coefficient.
  virtual void begin_updates() = 0;
  virtual void update(std::int64_t begin, std::int64_t end, ops::cuda::GemmRunner& gemm, cudaStream_t stream) = 0;
  virtual void end_updates() = 0;
};

// How this rank's optimizer state is cut (train::plan_state_shards).
struct Zero1Shards {
  std::int64_t replicated_end = 0;        // the expert region (if any) is [replicated_end, total)
  Zero1Plan replicated, experts;          // over the data group, over the expert-data group
  std::int64_t shard_begin = 0, shard_end = 0, expert_begin = 0, expert_end = 0;  // this rank's
};

class Zero1OverlapSchedule final : public StageHooks {
 public:
  using bf16 = ops::cuda::bf16;
  // The stage bounds of `layout` (overlap_stage_bounds), or nothing when its stages are not in
  // offset order (the step cannot overlap; the backend falls back to the classic step).
  static std::optional<std::vector<std::int64_t>> stages_of(const optim::ParamLayout& layout, int layers,
                                                            std::int64_t replicated_end);

  struct Setup {
    const optim::ParamLayout* layout = nullptr;
    std::vector<std::int64_t> stage_bounds;  // stages_of()
    Zero1Shards shards;
    DataParallelOptions options;
    std::int64_t tokens = 0, hidden = 0, vocab = 0;  // the micro-batch and the embedding table
    std::int64_t embed_offset = 0;                    // where the embedding starts in the flat buffer
    int first_moe_layer = -1;                         // the expert region is updated before its stage
    bool muon = false;                                // Muon matrices: the optimizer stream needs its own GEMM runner
  };
  // Collective over the mesh's data group (and expert-data group): builds the NCCL
  // communicators through the mesh, the streams and the events. profile: parallel.zero1.profile's
  // timeline (null: none).
  Zero1OverlapSchedule(Mesh& mesh, const Setup& setup, cudaStream_t compute, Zero1Profile* profile);
  ~Zero1OverlapSchedule() override;
  Zero1OverlapSchedule(const Zero1OverlapSchedule&) = delete;
  Zero1OverlapSchedule& operator=(const Zero1OverlapSchedule&) = delete;

  // Floats of the bf16 gradient-reduce scratch the backend keeps beside the gradients (0: fp32
  // reduction): the largest stage, or the expert region when it is reduced.
  std::int64_t reduce_scratch_floats() const { return reduce_scratch_floats_; }
  // The deferred embedding scatter's receive buffers (owners only), from the activation arena.
  void carve(DeviceCarver& c);
  struct Buffers {
    float* params = nullptr;         // fp32 masters (master_ranges() backed)
    bf16* params_bf16 = nullptr;
    float* grads = nullptr;
    bf16* grads_bf16 = nullptr;      // the reduce scratch (reduce_scratch_floats())
  };
  void bind(const Buffers& b) { buf_ = b; }
  // The fp32 masters this rank keeps (bytes of a buffer of n floats): its own shards and what
  // travels in fp32; every master when they all travel in fp32 or shard_masters is off.
  std::vector<ByteRange> master_ranges(std::int64_t n) const;
  // A collective over the data (and expert-data) group: every master to `host`, each shard from
  // its owner, through `staging` (device, staging_floats floats).
  void copy_masters_to_host(float* host, std::int64_t total, float* staging, std::int64_t staging_floats) const;

  // ---- the step protocol ----
  bool has_optimizer_stream() const { return opt_stream_ != nullptr; }
  // zero_grads(): the previous step's reduces must be done before gradients are cleared.
  void new_step();
  // The compute stream continues only after the optimizer stream's work (the gradients it reads).
  void wait_optimizer() const;
  void begin_step(int micro_batches) { step_backwards_ = micro_batches; }
  // Backward begins: whether this is the step's last (it then reduces as stages finish).
  void backward_begin();
  void backward_end();
  // The step after the last backward: the remaining reduces, the norm, the updates of this rank's
  // buckets and their broadcasts. Returns the norm and the clip coefficient.
  std::pair<double, float> step(ShardOptimizer& opt, double max_norm, ops::cuda::GemmRunner& gemm);
  // The compute stream continues only after everything enqueued on the communication and
  // optimizer streams (before reading the gradients, the masters or the moments).
  void join() const;

  // StageHooks
  void forward_begin() override;
  void forward_end() override;
  void before_stage(int s) override;
  void grads_final(int s) override;
  void layers_done() override;
  bool take_embedding_grads(const std::uint32_t* tokens, const float* drows, std::int64_t n) override;

 private:
  struct BroadcastRun {
    std::int64_t begin = 0, end = 0;
    bool bf16 = false;  // the bf16 copy travels (GEMM-only matrices), else the fp32 masters
  };
  std::vector<BroadcastRun> broadcast_runs(std::int64_t begin, std::int64_t end, bool bf16);
  void signal_comm() const;
  void reduce_stage(int s);
  void reduce_experts();
  void reduce_to_owner(NcclGroup& g, std::int64_t scratch_at, std::int64_t begin, std::int64_t n, int owner);
  void broadcast_bucket(std::size_t i);
  void broadcast_experts();
  void copy_shards_to_host(NcclGroup& group, const Zero1Plan& plan, int me, float* host, std::int64_t total,
                           float* staging, std::int64_t staging_floats) const;
  int stage_count() const { return static_cast<int>(stage_first_bucket_.size()) - 1; }

  Setup s_;
  Buffers buf_;
  int rank_ = 0, ranks_ = 1, expert_data_rank_ = 0;
  std::shared_ptr<NcclGroup> nccl_, xnccl_;  // data group; expert-data group (when it has several ranks)
  cudaStream_t compute_ = nullptr, comm_ = nullptr, opt_stream_ = nullptr;
  cudaEvent_t ev_ready_ = nullptr, ev_comm_ = nullptr, ev_opt_go_ = nullptr, ev_opt_bucket_ = nullptr,
              ev_opt_done_ = nullptr;
  std::vector<cudaEvent_t> ev_arrived_;              // per stage: its parameters have arrived
  std::vector<Zero1Bucket> buckets_;
  std::vector<int> stage_first_bucket_;              // stage s: buckets [first[s], first[s + 1])
  std::vector<std::vector<BroadcastRun>> pieces_;    // per bucket
  std::vector<std::vector<BroadcastRun>> expert_pieces_;  // per expert-data rank: its expert shard
  bool any_bf16_broadcast_ = false;
  std::int64_t reduce_scratch_floats_ = 0;
  std::unique_ptr<ops::cuda::GemmRunner> gemm_opt_;  // Muon's GEMMs on the optimizer stream
  bool defer_embed_ = false, own_embed_ = false;
  std::vector<int> embed_owners_;
  std::uint32_t* gather_tokens_ = nullptr;  // owners: (ranks - 1) x [N]
  float* gather_rows_ = nullptr;            // owners: (ranks - 1) x [N, D]
  int expert_stage_ = -1;                   // the stage the expert region's update precedes
  int backward_calls_ = 0, step_backwards_ = 0;
  bool launching_ = false, reduces_launched_ = false;
  mutable bool reduces_in_flight_ = false;
  mutable int awaited_stage_ = INT_MAX;  // forward waits for stages above this
  Zero1Profile* prof_ = nullptr;
};

}  // namespace keel::parallel
