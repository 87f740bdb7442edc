#include "parallel/zero1_overlap_cuda.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "blocks/weights.h"
#include "common/error.h"
#include "device/cuda_check.h"
#include "device/cuda_devices.h"
#include "ops/cuda/cast.h"
#include "ops/cuda/embedding.h"
#include "optim/clip.h"

namespace keel::parallel {

namespace k = ops::cuda;

std::optional<std::vector<std::int64_t>> Zero1OverlapSchedule::stages_of(const optim::ParamLayout& layout, int layers,
                                                                         std::int64_t replicated_end) {
  return overlap_stage_bounds(layout, layers, replicated_end);
}

Zero1OverlapSchedule::Zero1OverlapSchedule(Mesh& mesh, const Setup& setup, cudaStream_t compute, Zero1Profile* profile)
    : s_(setup), compute_(compute), prof_(profile) {
  const optim::ParamLayout& layout = *s_.layout;
  const Zero1OverlapOptions& o = s_.options.zero1;
  const bool bf16_reduce = s_.options.grad_reduce == GradReduceDtype::kBf16;
  rank_ = mesh.data().rank;
  ranks_ = mesh.data().size;
  expert_data_rank_ = mesh.expert_data().rank;
  // bf16 gradient reduction: a stage's gradients are rounded into a scratch as large as the
  // largest stage, reduced there and widened into the owner's fp32 shard, all on the
  // communication stream, so one scratch serves every stage in turn.
  if (bf16_reduce) reduce_scratch_floats_ = largest_stage_floats(s_.stage_bounds);
  buckets_ = plan_zero1_buckets(region_layout(layout, 0, s_.shards.replicated_end), s_.shards.replicated,
                                s_.stage_bounds, o.bucket_floats());
  const int S = static_cast<int>(s_.stage_bounds.size()) - 1;
  stage_first_bucket_.assign(static_cast<std::size_t>(S) + 1, static_cast<int>(buckets_.size()));
  for (int i = static_cast<int>(buckets_.size()) - 1; i >= 0; --i)
    stage_first_bucket_[static_cast<std::size_t>(buckets_[static_cast<std::size_t>(i)].stage)] = i;
  for (int s = S - 1; s >= 0; --s)  // empty stages start where the next one does
    stage_first_bucket_[static_cast<std::size_t>(s)] =
        std::min(stage_first_bucket_[static_cast<std::size_t>(s)], stage_first_bucket_[static_cast<std::size_t>(s) + 1]);
  pieces_.assign(buckets_.size(), {});
  for (std::size_t bi = 0; bi < buckets_.size(); ++bi)
    pieces_[bi] = broadcast_runs(buckets_[bi].begin, buckets_[bi].end, o.broadcast_bf16);
  // The deferred embedding scatter: every rank's rows go to the owners of the embedding's
  // buckets, (ranks - 1) x tokens x hidden floats into each owner, instead of the reduce of
  // the table after the whole backward.
  const std::int64_t table = s_.vocab * s_.hidden;
  const bool embed_alone = s_.embed_offset == 0 && s_.stage_bounds[1] >= table &&
                           s_.stage_bounds[1] <= (table + kZero1AlignFloats);
  defer_embed_ = embed_alone && (o.defer_embedding == 1 ||
                                 (o.defer_embedding < 0 && (ranks_ - 1) * s_.tokens * s_.hidden < table));
  for (int i = stage_first_bucket_[0]; i < stage_first_bucket_[1]; ++i) {
    const int owner = buckets_[static_cast<std::size_t>(i)].owner;
    if (std::find(embed_owners_.begin(), embed_owners_.end(), owner) == embed_owners_.end()) embed_owners_.push_back(owner);
  }
  own_embed_ = std::find(embed_owners_.begin(), embed_owners_.end(), rank_) != embed_owners_.end();
  nccl_ = mesh.nccl(GroupKind::kData);
  int least = 0, greatest = 0;
  KEEL_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  KEEL_CUDA_CHECK(cudaStreamCreateWithPriority(&comm_, cudaStreamNonBlocking, greatest));
  KEEL_CUDA_CHECK(cudaEventCreateWithFlags(&ev_ready_, cudaEventDisableTiming));
  KEEL_CUDA_CHECK(cudaEventCreateWithFlags(&ev_comm_, cudaEventDisableTiming));
  ev_arrived_.assign(static_cast<std::size_t>(S), nullptr);
  for (auto& e : ev_arrived_) KEEL_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  if (o.optimizer_stream) {
    KEEL_CUDA_CHECK(cudaStreamCreateWithFlags(&opt_stream_, cudaStreamNonBlocking));
    for (cudaEvent_t* e : {&ev_opt_go_, &ev_opt_bucket_, &ev_opt_done_})
      KEEL_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    // Muon's GEMMs there must not share the compute stream's cuBLASLt workspace
    if (s_.muon) gemm_opt_ = std::make_unique<k::GemmRunner>();
  }
  // Expert parallelism: the expert region is ZeRO-1 sharded over the expert-data group; with
  // ep = ranks that group is one rank and the region has no collectives at all.
  if (s_.shards.replicated_end < layout.total_floats && mesh.expert_data().size > 1) {
    xnccl_ = mesh.nccl(GroupKind::kExpertData);
    if (bf16_reduce)  // the expert region uses the stages' scratch
      reduce_scratch_floats_ = std::max(reduce_scratch_floats_, s_.shards.experts.bounds.back() - s_.shards.experts.bounds.front());
    const Zero1Plan& xp = s_.shards.experts;
    for (int r = 0; r < xp.ranks(); ++r)
      expert_pieces_.push_back(xp.count(r) > 0 ? broadcast_runs(xp.begin(r), xp.begin(r) + xp.count(r), o.broadcast_bf16)
                                               : std::vector<BroadcastRun>{});
  }
  expert_stage_ = s_.first_moe_layer < 0 ? -1 : 2 + 2 * s_.first_moe_layer;
}

Zero1OverlapSchedule::~Zero1OverlapSchedule() {
  if (comm_) keel::stream_sync(comm_);
  if (opt_stream_) {
    keel::stream_sync(opt_stream_);
    cudaStreamDestroy(opt_stream_);
  }
  if (comm_) cudaStreamDestroy(comm_);
  for (cudaEvent_t e : {ev_opt_go_, ev_opt_bucket_, ev_opt_done_, ev_ready_, ev_comm_})
    if (e) cudaEventDestroy(e);
  for (cudaEvent_t e : ev_arrived_) cudaEventDestroy(e);
}

void Zero1OverlapSchedule::carve(DeviceCarver& c) {
  if (!defer_embed_ || !own_embed_) return;
  gather_tokens_ = c.take<std::uint32_t>((ranks_ - 1) * s_.tokens);
  gather_rows_ = c.take<float>((ranks_ - 1) * s_.tokens * s_.hidden);
}

// The broadcast runs of [begin, end): the bf16 copy for the parameters the blocks read only in
// bf16 (when `bf16`), fp32 masters for the rest; padding between parameters rides with the run
// before it.
std::vector<Zero1OverlapSchedule::BroadcastRun> Zero1OverlapSchedule::broadcast_runs(std::int64_t begin,
                                                                                     std::int64_t end, bool bf16) {
  const optim::ParamLayout& layout = *s_.layout;
  std::vector<std::size_t> by_offset(layout.params.size());
  for (std::size_t i = 0; i < by_offset.size(); ++i) by_offset[i] = i;
  std::sort(by_offset.begin(), by_offset.end(),
            [&](std::size_t a, std::size_t b) { return layout.params[a].offset < layout.params[b].offset; });
  std::vector<BroadcastRun> runs;
  for (std::size_t i : by_offset) {
    const auto& p = layout.params[i];
    const std::int64_t lo = std::max(p.offset, begin), hi = std::min(p.offset + p.numel, end);
    if (lo >= hi) continue;
    const bool as_bf16 = bf16 && blocks::bf16_only(blocks::role_of(p.name).slot);
    if (!runs.empty() && runs.back().bf16 == as_bf16) {
      runs.back().end = hi;
    } else {
      if (!runs.empty()) runs.back().end = lo;
      runs.push_back({runs.empty() ? begin : lo, hi, as_bf16});
    }
    any_bf16_broadcast_ |= as_bf16;
  }
  if (runs.empty()) runs.push_back({begin, end, false});
  runs.back().end = end;
  return runs;
}

std::vector<ByteRange> Zero1OverlapSchedule::master_ranges(std::int64_t n) const {
  const std::size_t f = sizeof(float);
  if (!any_bf16_broadcast_ || !s_.options.zero1.shard_masters) return {{0, static_cast<std::size_t>(n) * f}};
  auto bytes = [f](std::int64_t b, std::int64_t e) {
    return ByteRange{static_cast<std::size_t>(b) * f, static_cast<std::size_t>(e) * f};
  };
  std::vector<ByteRange> r = {bytes(s_.shards.shard_begin, s_.shards.shard_end)};
  if (xnccl_) r.push_back(bytes(s_.shards.expert_begin, s_.shards.expert_end));
  else r.push_back(bytes(s_.shards.replicated_end, n));  // every expert of this rank is its own
  for (const auto* pieces : {&pieces_, &expert_pieces_})
    for (const auto& runs : *pieces)
      for (const auto& p : runs)
        if (!p.bf16) r.push_back(bytes(p.begin, p.end));
  return r;
}

void Zero1OverlapSchedule::copy_masters_to_host(float* host, std::int64_t total, float* staging,
                                                std::int64_t staging_floats) const {
  signal_comm();
  copy_shards_to_host(*nccl_, s_.shards.replicated, rank_, host, total, staging, staging_floats);
  if (xnccl_) {
    copy_shards_to_host(*xnccl_, s_.shards.experts, expert_data_rank_, host, total, staging, staging_floats);
  } else if (total > s_.shards.replicated_end) {  // every expert of this rank is its own
    KEEL_CUDA_CHECK(cudaMemcpyAsync(host + s_.shards.replicated_end, buf_.params + s_.shards.replicated_end,
                                    static_cast<std::size_t>(total - s_.shards.replicated_end) * sizeof(float),
                                    cudaMemcpyDeviceToHost, comm_));
    KEEL_CUDA_CHECK(keel::stream_sync(comm_));
  }
}

void Zero1OverlapSchedule::copy_shards_to_host(NcclGroup& group, const Zero1Plan& plan, int me, float* host,
                                               std::int64_t total, float* staging, std::int64_t staging_floats) const {
  for (int r = 0; r < plan.ranks(); ++r)
    for (std::int64_t b = plan.begin(r), end = std::min(total, plan.begin(r) + plan.count(r)); b < end;
         b += staging_floats) {
      const std::int64_t count = std::min(end - b, staging_floats);
      float* from = r == me ? buf_.params + b : staging;  // the owner sends, the others receive
      group.broadcast(from, count, NcclType::kFloat32, r, comm_);
      KEEL_CUDA_CHECK(cudaMemcpyAsync(host + b, from, static_cast<std::size_t>(count) * sizeof(float),
                                      cudaMemcpyDeviceToHost, comm_));
      KEEL_CUDA_CHECK(keel::stream_sync(comm_));  // the next piece overwrites the staging buffer
    }
}

// The communication stream continues only after what the compute stream has enqueued so far.
void Zero1OverlapSchedule::signal_comm() const {
  KEEL_CUDA_CHECK(cudaEventRecord(ev_ready_, compute_));
  KEEL_CUDA_CHECK(cudaStreamWaitEvent(comm_, ev_ready_, 0));
}

void Zero1OverlapSchedule::join() const {
  KEEL_CUDA_CHECK(cudaEventRecord(ev_comm_, comm_));
  KEEL_CUDA_CHECK(cudaStreamWaitEvent(compute_, ev_comm_, 0));
  if (opt_stream_) {
    KEEL_CUDA_CHECK(cudaEventRecord(ev_opt_done_, opt_stream_));
    KEEL_CUDA_CHECK(cudaStreamWaitEvent(compute_, ev_opt_done_, 0));
  }
  awaited_stage_ = INT_MAX;
  reduces_in_flight_ = false;
}

void Zero1OverlapSchedule::wait_optimizer() const {
  KEEL_CUDA_CHECK(cudaEventRecord(ev_opt_done_, opt_stream_));
  KEEL_CUDA_CHECK(cudaStreamWaitEvent(compute_, ev_opt_done_, 0));
}

void Zero1OverlapSchedule::new_step() {
  if (prof_) prof_->new_step();
  if (reduces_in_flight_) join();  // an abandoned step's reduces still read the gradients
  backward_calls_ = 0;
  step_backwards_ = 0;  // announced again by begin_step()
  reduces_launched_ = false;
}

void Zero1OverlapSchedule::forward_begin() {
  if (!prof_) return;
  prof_->first_forward = !prof_->forward_seen;
  if (prof_->first_forward) prof_->mark(Zero1Profile::kFwd0, compute_), prof_->forward_seen = true;
}

void Zero1OverlapSchedule::forward_end() {
  if (prof_ && prof_->first_forward) prof_->mark(Zero1Profile::kFwdEnd, compute_), prof_->first_forward = false;
}

// Before reading stage s's parameters in forward: wait for their broadcast (and the stages
// before it: one stream, offset order).
void Zero1OverlapSchedule::before_stage(int s) {
  if (s > awaited_stage_) {
    KEEL_CUDA_CHECK(cudaStreamWaitEvent(compute_, ev_arrived_[static_cast<std::size_t>(s)], 0));
    awaited_stage_ = s;
  }
  if (s == 0 && prof_ && prof_->first_forward) prof_->mark(Zero1Profile::kFwdGo, compute_);
}

// Whether this backward is the step's last on this rank, as begin_step() announced: then it
// reduces each stage's buckets as soon as their gradients are final. Without an announcement no
// backward launches reduces and the step reduces everything at the end.
void Zero1OverlapSchedule::backward_begin() {
  if (reduces_launched_)
    fail("data parallel: backward() after the step's last micro-batch ({} announced by begin_step(); their "
         "gradients are already being reduced)",
         step_backwards_);
  ++backward_calls_;
  launching_ = step_backwards_ > 0 && backward_calls_ == step_backwards_;
  if (prof_) prof_->mark(Zero1Profile::kBwd0, compute_);
}

void Zero1OverlapSchedule::backward_end() {
  if (launching_ && prof_) prof_->mark(Zero1Profile::kRedEnd, comm_);
  if (launching_) reduces_launched_ = true;
  launching_ = false;
}

// Stage s's gradients are final (on the last micro-batch): reduce its buckets to their owners
// on the communication stream. The embedding's gradient is final after the head's but for this
// micro-batch's scatter-add, which the owners do at the end from every rank's rows: with the
// deferred scatter it is reduced first, behind the whole backward.
void Zero1OverlapSchedule::grads_final(int s) {
  if (!launching_) return;
  auto launch = [this](int stage) {
    signal_comm();
    if (prof_ && !prof_->reduce_seen) prof_->mark(Zero1Profile::kRed0, comm_), prof_->reduce_seen = true;
    reduce_stage(stage);
  };
  if (s == 0 && defer_embed_) return;  // launched with the final stage
  launch(s);
  if (s == stage_count() - 1 && defer_embed_) launch(0);
}

void Zero1OverlapSchedule::layers_done() {
  if (prof_) prof_->mark(Zero1Profile::kBwdEnd, compute_);
  // the expert region's gradients are final: to their shards' owners over the expert-data group
  if (launching_ && xnccl_) {
    signal_comm();
    reduce_experts();
  }
}

void Zero1OverlapSchedule::reduce_stage(int s) {
  const int first = stage_first_bucket_[static_cast<std::size_t>(s)], end = stage_first_bucket_[static_cast<std::size_t>(s) + 1];
  if (first == end) return;
  const std::int64_t lo = buckets_[static_cast<std::size_t>(first)].begin;
  const std::int64_t hi = buckets_[static_cast<std::size_t>(end) - 1].end;
  if (buf_.grads_bf16) k::f32_to_bf16(buf_.grads + lo, buf_.grads_bf16, hi - lo, comm_);
  const bool group = s_.options.zero1.group_reduces && end - first > 1;
  if (group) nccl_->group_start();
  for (int i = first; i < end; ++i) {
    const auto& B = buckets_[static_cast<std::size_t>(i)];
    reduce_to_owner(*nccl_, lo, B.begin, B.end - B.begin, B.owner);
  }
  if (group) nccl_->group_end();
  if (buf_.grads_bf16)
    for (int i = first; i < end; ++i)
      if (const auto& B = buckets_[static_cast<std::size_t>(i)]; B.owner == rank_)
        k::bf16_to_f32(buf_.grads_bf16 + (B.begin - lo), buf_.grads + B.begin, B.end - B.begin, comm_);
  reduces_in_flight_ = true;
}

// The expert region's gradients summed into each shard's owner (expert-data group).
void Zero1OverlapSchedule::reduce_experts() {
  if (!xnccl_) return;
  const Zero1Plan& xp = s_.shards.experts;
  const std::int64_t lo = xp.bounds.front(), hi = xp.bounds.back();
  if (buf_.grads_bf16) k::f32_to_bf16(buf_.grads + lo, buf_.grads_bf16, hi - lo, comm_);
  xnccl_->group_start();
  for (int r = 0; r < xp.ranks(); ++r)
    if (xp.count(r) > 0) reduce_to_owner(*xnccl_, lo, xp.begin(r), xp.count(r), r);
  xnccl_->group_end();
  if (buf_.grads_bf16 && xp.count(expert_data_rank_) > 0)
    k::bf16_to_f32(buf_.grads_bf16 + (xp.begin(expert_data_rank_) - lo), buf_.grads + xp.begin(expert_data_rank_),
                   xp.count(expert_data_rank_), comm_);
  reduces_in_flight_ = true;
}

// The sum of the gradients [begin, begin + n) to `owner`: in place in fp32, or (bf16 reduction)
// in the scratch, whose element 0 is flat offset `scratch_at`.
void Zero1OverlapSchedule::reduce_to_owner(NcclGroup& g, std::int64_t scratch_at, std::int64_t begin, std::int64_t n,
                                           int owner) {
  if (buf_.grads_bf16)
    g.reduce_sum(buf_.grads_bf16 + (begin - scratch_at), n, NcclType::kBfloat16, owner, comm_);
  else
    g.reduce_sum(buf_.grads + begin, n, NcclType::kFloat32, owner, comm_);
}

// The last micro-batch's embedding scatter-add, deferred: every rank sends its token ids and
// dL/d(embedding output) to the embedding's owners, which add all of them after the reduce of
// the table (launched at the start of backward) has landed.
bool Zero1OverlapSchedule::take_embedding_grads(const std::uint32_t* tokens, const float* drows, std::int64_t n) {
  if (!launching_ || !defer_embed_) return false;
  const std::int64_t D = s_.hidden, V = s_.vocab;
  signal_comm();
  nccl_->group_start();
  for (int o : embed_owners_) {
    if (o == rank_) continue;
    nccl_->send(tokens, n, NcclType::kUint32, o, comm_);
    nccl_->send(drows, n * D, NcclType::kFloat32, o, comm_);
  }
  if (own_embed_) {
    std::int64_t slot = 0;
    for (int r = 0; r < ranks_; ++r) {
      if (r == rank_) continue;
      nccl_->recv(gather_tokens_ + slot * n, n, NcclType::kUint32, r, comm_);
      nccl_->recv(gather_rows_ + slot * n * D, n * D, NcclType::kFloat32, r, comm_);
      ++slot;
    }
  }
  nccl_->group_end();
  reduces_in_flight_ = true;
  if (!own_embed_) return true;
  join();
  float* table = buf_.grads + s_.embed_offset;
  k::embedding::backward(tokens, n, drows, table, V, D, compute_);
  for (std::int64_t slot = 0; slot + 1 < ranks_; ++slot)
    k::embedding::backward(gather_tokens_ + slot * n, n, gather_rows_ + slot * n * D, table, V, D, compute_);
  return true;
}

// Broadcasts bucket i from its owner on the communication stream; receivers refresh the bf16
// copy of what arrived in fp32.
void Zero1OverlapSchedule::broadcast_bucket(std::size_t i) {
  const auto& B = buckets_[i];
  nccl_->group_start();
  for (const auto& r : pieces_[i]) {
    if (r.bf16)
      nccl_->broadcast(buf_.params_bf16 + r.begin, r.end - r.begin, NcclType::kBfloat16, B.owner, comm_);
    else
      nccl_->broadcast(buf_.params + r.begin, r.end - r.begin, NcclType::kFloat32, B.owner, comm_);
  }
  nccl_->group_end();
  if (B.owner == rank_) return;
  for (const auto& r : pieces_[i])
    if (!r.bf16) k::f32_to_bf16(buf_.params + r.begin, buf_.params_bf16 + r.begin, r.end - r.begin, comm_);
}

// Every expert shard from its owner over the expert-data group, in runs as the buckets: the bf16
// copy of the experts' matrices, fp32 for anything else (receivers refresh its bf16 copy).
void Zero1OverlapSchedule::broadcast_experts() {
  if (!xnccl_) return;
  const Zero1Plan& xp = s_.shards.experts;
  xnccl_->group_start();
  for (int r = 0; r < xp.ranks(); ++r)
    for (const auto& run : expert_pieces_[static_cast<std::size_t>(r)]) {
      if (run.bf16)
        xnccl_->broadcast(buf_.params_bf16 + run.begin, run.end - run.begin, NcclType::kBfloat16, r, comm_);
      else
        xnccl_->broadcast(buf_.params + run.begin, run.end - run.begin, NcclType::kFloat32, r, comm_);
    }
  xnccl_->group_end();
  for (int r = 0; r < xp.ranks(); ++r)
    if (r != expert_data_rank_)
      for (const auto& run : expert_pieces_[static_cast<std::size_t>(r)])
        if (!run.bf16) k::f32_to_bf16(buf_.params + run.begin, buf_.params_bf16 + run.begin, run.end - run.begin, comm_);
}

// Backward has launched the reduces (or, when it could not tell the last micro-batch, they
// launch here); the compute stream waits for them, then the global norm (one scalar
// all-reduce, the one host sync); each owner updates its buckets in offset order, each
// broadcast as soon as its update is done; the next forward waits per stage.
std::pair<double, float> Zero1OverlapSchedule::step(ShardOptimizer& opt, double max_norm, k::GemmRunner& gemm) {
  const std::int64_t b = s_.shards.shard_begin, e = s_.shards.shard_end;
  if (!reduces_launched_) {
    signal_comm();
    for (int s = stage_count() - 1; s >= 0; --s) reduce_stage(s);
    reduce_experts();
  }
  reduces_launched_ = false;
  join();
  if (prof_) prof_->mark(Zero1Profile::kJoined, compute_);
  opt.sum_squares(b, e, /*accumulate=*/false, compute_);
  if (s_.shards.expert_end > s_.shards.expert_begin)  // each expert element is in one rank's shard: one sum over all ranks
    opt.sum_squares(s_.shards.expert_begin, s_.shards.expert_end, /*accumulate=*/true, compute_);
  signal_comm();
  nccl_->all_reduce_sum(opt.sum_squares_buffer(), opt.sum_squares_count(), NcclType::kFloat64, comm_);
  join();
  opt.clip(max_norm, compute_);
  if (prof_) prof_->mark(Zero1Profile::kNormed, compute_);
  const auto [norm, coef] = opt.read_norm(compute_);
  if (prof_) prof_->report(rank_, ranks_);
  if (!std::isfinite(norm)) throw optim::NonFiniteGradient(fmt::format("gradient norm is {}", norm), "", norm);
  // The shard's update runs on the optimizer stream (beside the next forward) or, without one,
  // on the compute stream; each own bucket's broadcast waits for its update.
  cudaStream_t os = opt_stream_ ? opt_stream_ : compute_;
  k::GemmRunner& og = gemm_opt_ ? *gemm_opt_ : gemm;
  cudaEvent_t ev_bucket = opt_stream_ ? ev_opt_bucket_ : ev_ready_;
  if (opt_stream_) {
    KEEL_CUDA_CHECK(cudaEventRecord(ev_opt_go_, compute_));  // the clip coefficient
    KEEL_CUDA_CHECK(cudaStreamWaitEvent(opt_stream_, ev_opt_go_, 0));
  }
  opt.begin_updates();
  if (prof_) prof_->mark(Zero1Profile::kBc0, comm_);
  for (int s = 0; s < stage_count(); ++s) {
    if (s == expert_stage_ && s_.shards.expert_end > s_.shards.expert_begin) {
      // the expert region, before the first MoE layer's stage arrives
      opt.update(s_.shards.expert_begin, s_.shards.expert_end, og, os);
      KEEL_CUDA_CHECK(cudaEventRecord(ev_bucket, os));
      KEEL_CUDA_CHECK(cudaStreamWaitEvent(comm_, ev_bucket, 0));
    }
    if (s == expert_stage_) broadcast_experts();
    for (int i = stage_first_bucket_[static_cast<std::size_t>(s)]; i < stage_first_bucket_[static_cast<std::size_t>(s) + 1]; ++i) {
      const auto& B = buckets_[static_cast<std::size_t>(i)];
      if (B.owner == rank_) {
        opt.update(B.begin, B.end, og, os);
        KEEL_CUDA_CHECK(cudaEventRecord(ev_bucket, os));  // the owner's broadcast reads the update
        KEEL_CUDA_CHECK(cudaStreamWaitEvent(comm_, ev_bucket, 0));
      }
      broadcast_bucket(static_cast<std::size_t>(i));
    }
    KEEL_CUDA_CHECK(cudaEventRecord(ev_arrived_[static_cast<std::size_t>(s)], comm_));
  }
  opt.end_updates();
  if (prof_) prof_->mark(Zero1Profile::kBcEnd, comm_), prof_->mark(Zero1Profile::kOptEnd, os);
  awaited_stage_ = -1;
  return {norm, coef};
}

}  // namespace keel::parallel
