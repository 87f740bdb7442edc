// The CUDA TrainBackend (docs/gpu_training.md): the model math of cuda_model_cuda.h, the
// optimizer of cuda_optimizer_cuda.h and, under data parallelism, a ZeRO-1 step, composed over
// the flat buffers this file owns.
//
// Precision: fp32 master weights, gradients and optimizer states; a bf16 copy of the weights for
// the GEMMs (refreshed by the fused AdamW and Muon steps); bf16 activations with fp32
// statistics; the residual stream and its gradient in fp32. With optimizer.muon on, the weight
// matrices step with ops/cuda/muon.h (bf16 Newton-Schulz GEMMs), the rest with AdamW; Muon's
// momentum sits in the m buffer.
//
// Memory: four device arenas, each one allocation carved by a bump pointer (device/
// device_arena.h): parameters (the bf16 copy, the router biases), gradients (and the bf16 reduce
// scratch), optimizer state (m, Muon's Newton-Schulz workspace) and activations (the model's,
// the schedule's receive buffers, the norm's scalars); plus the fp32 masters and AdamW's v, each
// a sparse buffer backing only what this rank reads. Nothing is allocated per step.
//
// Data parallelism with ZeRO-1 (docs/parallel.md): by default the collectives overlap compute
// (parallel/zero1_overlap_cuda.h: the schedule is the model's StageHooks);
// parallel.zero1.overlap: false selects the classic step (reduce-scatter after backward,
// all-gather after the update). Expert parallelism (parallel.expert): the plan
// (parallel/plan_cuda.h) gives each MoE layer its expert runner over the expert group; this
// rank's experts sit after the replicated parameters and the expert region is ZeRO-1 over the
// expert-data group (the overlapped step only). Tensor parallelism (or TSP) with data
// parallelism takes the overlapped step with AdamW (TensorParallelShards: the partial gradients
// summed over the tensor group on the shard, after the data group's reduces), the classic one
// with Muon or expert parallelism.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <string>

#include "common/error.h"
#include "device/cuda_check.h"
#include "device/cuda_devices.h"
#include "device/device_arena.h"
#include "device/device_buffer.h"
#include "device/device_canary_cuda.h"
#include "device/sparse_device_buffer.h"
#include "ops/cuda/cast.h"
#include "ops/cuda/muon.h"
#include "parallel/data_parallel_comm.h"
#include "parallel/plan_cuda.h"
#include "parallel/tensor_parallel.h"
#include "parallel/tensor_parallel_muon_cuda.h"
#include "parallel/zero1.h"
#include "parallel/zero1_overlap_cuda.h"
#include "parallel/zero1_profile_cuda.h"
#include "train/backend.h"
#include "train/cuda_model_cuda.h"
#include "train/cuda_optimizer_cuda.h"
#include "train/param_rules.h"

namespace keel::train {
namespace {

using ops::cuda::bf16;
namespace k = ops::cuda;
using parallel::Zero1Profile;

// The classic ZeRO-1 step's view of the model's progress: only parallel.zero1.profile's marks.
class ProfileHooks final : public parallel::StageHooks {
 public:
  ProfileHooks(Zero1Profile& p, cudaStream_t s) : p_(p), s_(s) {}
  void forward_begin() override {
    first_ = !p_.forward_seen;
    if (first_) p_.mark(Zero1Profile::kFwd0, s_), p_.forward_seen = true;
  }
  void before_stage(int s) override {
    if (s == 0 && first_) p_.mark(Zero1Profile::kFwdGo, s_);
  }
  void forward_end() override {
    if (first_) p_.mark(Zero1Profile::kFwdEnd, s_), first_ = false;
  }
  void layers_done() override { p_.mark(Zero1Profile::kBwdEnd, s_); }

 private:
  Zero1Profile& p_;
  cudaStream_t s_;
  bool first_ = false;
};

class CudaBackend final : public TrainBackend {
 public:
  CudaBackend(const model::ModelConfig& cfg, const ModelOptions& options, const OptimizerConfig& optimizer,
              const parallel::Mesh& mesh, const parallel::DataParallelOptions& dp)
      : cfg_(cfg), opt_(options), mesh_(mesh), param_arena_("parameters"), grad_arena_("gradients"),
        state_arena_("optimizer states"), act_arena_("activations") {
    validate(optimizer.muon);
    validate_trainable(cfg_, opt_);
    if (visible_cuda_devices() == 0) throw UsageError("device: cuda: no CUDA device is visible");
    int device = 0;
    KEEL_CUDA_CHECK(cudaGetDevice(&device));
    cudaDeviceProp prop{};
    KEEL_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    device_name_ = prop.name;
    char bus[32] = {};
    if (cudaDeviceGetPCIBusId(bus, sizeof bus, device) == cudaSuccess) {
      device_id_ = fmt::format("cuda:{} {}", device, bus);
    } else {
      (void)cudaGetLastError();  // not this run's concern: cleared, so no later check reports it
      device_id_ = fmt::format("cuda:{}", device);
    }
    KEEL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));

    // With expert parallelism this rank's experts come last (E / ep per MoE layer).
    layout_ = model::param_layout(cfg_, mesh.shape());
    // Muon: the same offsets, the matrices regrouped (param_rules.h)
    if (optimizer.muon.enabled) layout_ = regroup_layout(layout_, train_group_rules(optimizer.muon));
    scale_router_lr(layout_, opt_.router_lr_scale);
    const std::size_t muon_ws_bytes = k::muon::workspace_bytes(layout_);
    // ZeRO-1 over the data-parallel ranks (parallel/zero1.h): optimizer state for this rank's
    // shard only (plan_state_shards: with expert parallelism the replicated region over the data
    // group, the expert region over the expert-data group).
    shards_ = plan_state_shards(layout_, mesh_);
    slice_ = shards_.slice;
    const int tp = mesh_.group(parallel::GroupKind::kTensor).size, tsp = mesh_.group(parallel::GroupKind::kTsp).size;
    const parallel::GroupKind weight_kind = tsp > 1 ? parallel::GroupKind::kTsp : parallel::GroupKind::kTensor;
    const bool weight_split = tp > 1 || tsp > 1;
    if (weight_split && mesh_.data().size > 1) check_shards_alike(weight_kind);
    std::optional<std::vector<std::int64_t>> stages;
    // Tensor parallelism (or TSP) with data parallelism overlaps too: the data group reduces
    // each tensor rank's buckets during backward (the tensor ranks of a data rank cut their
    // buffers alike), and the replicated parameters' partial gradients are summed over the
    // tensor group afterwards, on the shard only (the sums commute: TensorParallelShards). Not
    // yet with Muon (its split matrices gather over the tensor group: CudaTensorParallelMuon
    // steps whole shards) or with expert parallelism's expert region.
    const char* classic = parallel::weight_split_classic_reason(weight_split, optimizer.muon.enabled,
                                                                shards_.replicated_end < layout_.total_floats);
    if (mesh_.data().size > 1 && dp.zero1.enabled && !classic) {
      stages = parallel::Zero1OverlapSchedule::stages_of(layout_, cfg_.layers, shards_.replicated_end);
      if (!stages) classic = "this layout's stages are not in offset order";
    }
    if (mesh_.data().size > 1 && dp.zero1.enabled && classic && mesh_.data().rank == 0 && mesh_.rank() == 0)
      std::fprintf(stderr, "keel: data parallel: %s; the ZeRO-1 step will not overlap communication\n", classic);
    const bool ring = opt_.context_mode == parallel::ContextMode::kRing;
    const bool heads = opt_.context_mode == parallel::ContextMode::kAllToAll;
    if (heads && mesh_.group(parallel::GroupKind::kContext).size > 1)
      parallel::check_alltoall(cfg_, mesh_.group(parallel::GroupKind::kTensor).size,
                               mesh_.group(parallel::GroupKind::kContext).size);
    if (opt_.context_mode == parallel::ContextMode::kAllToAll && tsp > 1)
      throw UsageError(fmt::format("parallel.context_mode: {} is context parallelism's; TSP gathers the k and v of "
                                   "each head shard (allgather) or passes them around the group (ring)",
                                   parallel::context_mode_name(opt_.context_mode)));
    plan_ = std::make_unique<parallel::CudaPlan>(cfg_, mesh_, opt_.micro_batch, opt_.seq_length, opt_.sequence_parallel);
    {  // the modes' buffers, for the widest layer: this tensor rank's query heads (TSP: one
       // weight shard's)
      const int hq = cfg_.heads / (mesh_.group(parallel::GroupKind::kTensor).size * tsp);
      const int linear = model::attention_layer_count(cfg_, model::AttentionKind::kLinear);
      if (ring && plan_->context())  // the k/v ring; LASP-1 for linear layers
        plan_->context()->use_ring(hq, cfg_.head_dim, linear < cfg_.layers);
      if (heads && plan_->context())  // heads by all-to-all (Ulysses)
        plan_->context()->use_heads(hq, cfg_.head_dim, linear < cfg_.layers, linear > 0);
    }
    model_ = std::make_unique<CudaModel>(cfg_, opt_, layout_, plan_->layers(), plan_->tensor(), plan_->context(),
                                         prop.totalGlobalMem, stream_, plan_->tsp());
    // TSP's step is tensor parallelism's over the tsp group (its gradients partial as under
    // sequence parallelism)
    if (plan_->weight_group()) plan_tensor_ranges();
    optimizer_ = std::make_unique<CudaOptimizer>(optimizer, layout_, slice_);
    if ((tp > 1 || tsp > 1) && optimizer.muon.enabled) {  // Muon's split matrices gather to their owners
      // ZeRO-1 over the data axis: the matrices of this rank's shards (its moments' ranges)
      std::vector<parallel::CudaTensorParallelMuon::Range> ranges;
      for (const MomentRange& r : moment_ranges(slice_)) ranges.push_back({r.begin, r.end, r.at});
      tp_muon_ = std::make_unique<parallel::CudaTensorParallelMuon>(optimizer.muon.config, layout_,
                                                                    mesh_.nccl(weight_kind), std::move(ranges));
      std::vector<bool> elsewhere(layout_.params.size());
      for (std::size_t i = 0; i < elsewhere.size(); ++i) elsewhere[i] = tp_muon_->owns(i);
      optimizer_->set_muon_elsewhere(std::move(elsewhere));
    }
    if (mesh_.data().size > 1 && dp.zero1.profile) prof_ = std::make_unique<Zero1Profile>();
    if (prof_ && !stages) profile_hooks_ = std::make_unique<ProfileHooks>(*prof_, stream_);
    if (stages) {
      parallel::Zero1OverlapSchedule::Setup su;
      su.layout = &layout_;
      su.stage_bounds = std::move(*stages);
      su.shards = {shards_.replicated_end,  shards_.replicated, shards_.experts,  slice_.shard_begin,
                   slice_.shard_end,        slice_.expert_begin, slice_.expert_end};
      su.options = dp;
      // the deferred embedding scatter adds whole-table rows: not for a vocabulary-split table
      if (weight_split) su.options.zero1.defer_embedding = 0;
      su.tokens = model_->tokens();
      su.hidden = cfg_.hidden;
      su.vocab = cfg_.vocab_size;
      su.embed_offset = offset_of("embed.weight");
      su.first_moe_layer = -1;
      for (int l = 0; l < cfg_.layers && su.first_moe_layer < 0; ++l)
        if (model::is_moe_layer(cfg_, l)) su.first_moe_layer = l;
      su.muon = muon_ws_bytes > 0;
      schedule_ = std::make_unique<parallel::Zero1OverlapSchedule>(mesh_, su, stream_, prof_.get());
    } else if (mesh_.data().size > 1) {
      dp_ = parallel::make_nccl_data_parallel_comm(mesh_.nccl(parallel::GroupKind::kData), stream_, dp.grad_reduce);
      // expert parallelism: the expert region's shards over the expert-data group
      if (shards_.replicated_end < layout_.total_floats && mesh_.expert_data().size > 1)
        expert_dp_ = parallel::make_nccl_data_parallel_comm(mesh_.nccl(parallel::GroupKind::kExpertData), stream_,
                                                            dp.grad_reduce);
    }
    bias_ = model::initial_router_biases(cfg_);  // as the CPU model
    load_.assign(static_cast<std::size_t>(model_->moe_layer_count()),
                 std::vector<std::int64_t>(static_cast<std::size_t>(model_->classes()), 0));
    plan_grad_zeroing();

    // parameters, gradients, states: the flat layout of the CPU model, so checkpoints move freely
    const std::int64_t n = layout_.total_floats;
    // the classic step's collectives may need a padded tail (equal NCCL chunks) past each region
    std::int64_t n_comm = n;
    if (dp_) n_comm = std::max(n_comm, dp_->buffer_floats(shards_.replicated_end));
    if (expert_dp_)
      n_comm = std::max(n_comm, shards_.replicated_end + expert_dp_->buffer_floats(n - shards_.replicated_end));
    const std::int64_t n_shard = std::max<std::int64_t>(1, slice_.moments());
    const std::int64_t reduce_scratch = schedule_ ? schedule_->reduce_scratch_floats() : 0;
    bf16* grads_bf16 = nullptr;
    for (int pass = 0; pass < 2; ++pass) {
      params_bf16_ = param_arena_.take<bf16>(n);
      bias_dev_ = param_arena_.take<float>(std::max<std::int64_t>(1, model_->moe_layer_count() * model_->classes()));
      grads_ = grad_arena_.take<float>(n_comm);
      const std::size_t grads_used = grad_arena_.used();
      grads_bf16 = reduce_scratch > 0 ? grad_arena_.take<bf16>(reduce_scratch) : nullptr;
      reduce_scratch_bytes_ = grad_arena_.used() - grads_used;
      adam_m_ = state_arena_.take<float>(n_shard);
      const std::size_t state_used = state_arena_.used();
      muon_ws_ = muon_ws_bytes ? state_arena_.take<std::byte>(static_cast<std::int64_t>(muon_ws_bytes)) : nullptr;
      muon_ws_bytes_ = state_arena_.used() - state_used;
      model_->carve(act_arena_);
      if (schedule_) schedule_->carve(act_arena_.carver());
      optimizer_->carve(act_arena_.carver());
      if (pass == 0) {
        param_arena_.allocate();
        grad_arena_.allocate();
        state_arena_.allocate();
        // what would shrink the activations: the ones not taken yet
        act_arena_.allocate(fmt::format("lower batch.micro_batch or data.seq_length{}, or split each sequence over "
                                        "more GPUs (parallel.context)",
                                        opt_.recompute == Recompute::kFull ? "" : ", set recompute: full"));
      }
    }
    const std::vector<ByteRange> masters =
        schedule_ ? schedule_->master_ranges(n_comm) : std::vector<ByteRange>{{0, static_cast<std::size_t>(n_comm) * sizeof(float)}};
    masters_ = std::make_unique<SparseDeviceBuffer>(static_cast<std::size_t>(n_comm) * sizeof(float), masters,
                                                    "out of GPU memory: the fp32 master weights",
                                                    "train on more GPUs or a smaller model");
    params_ = static_cast<float*>(masters_->get());
    // AdamW's v only where AdamW parameters are: Muon's matrices (most of a MoE model) have none.
    std::vector<ByteRange> v_ranges;
    for (const MomentSpan& sp : adamw_moment_spans(layout_, slice_))
      v_ranges.push_back({static_cast<std::size_t>(sp.at) * sizeof(float),
                          static_cast<std::size_t>(sp.at + sp.count) * sizeof(float)});
    adam_v_buffer_ = std::make_unique<SparseDeviceBuffer>(static_cast<std::size_t>(n_shard) * sizeof(float),
                                                          std::move(v_ranges), "out of GPU memory: AdamW's second moments",
                                                          "train on more GPUs or a smaller model");
    adam_v_ = static_cast<float*>(adam_v_buffer_->get());
    model_->bind({params_, params_bf16_, grads_, bias_dev_});
    optimizer_->bind({params_, params_bf16_, grads_, adam_m_, adam_v_, muon_ws_});
    if (schedule_) schedule_->bind({params_, params_bf16_, grads_, grads_bf16});
    if (schedule_ && plan_->weight_group())
      tp_shards_ = std::make_unique<TensorParallelShards>(*this, *plan_->weight_group());

    std::vector<float> init(static_cast<std::size_t>(n));
    model::init_parameters(cfg_, layout_, opt_.init_std, opt_.init_seed, init.data(), mesh_.shape(), mesh_.coord(),
                           opt_.router_init_gain);
    upload_params(init);
  }

  ~CudaBackend() override {
    schedule_.reset();  // its streams first: they may still read the buffers
    canary_.reset();
    if (stream_) {
      keel::stream_sync(stream_);
      cudaStreamDestroy(stream_);
    }
  }

  std::string device() const override { return device_name_; }
  std::string device_id() const override { return device_id_; }
  const optim::ParamLayout& layout() const override { return layout_; }
  std::int64_t param_count() const override { return model::global_param_count(layout_); }  // the whole model's
  int moe_layer_count() const override { return model_->moe_layer_count(); }
  double flops_per_micro_batch() const override {
    return model_flops_per_micro_batch(cfg_, opt_.micro_batch, opt_.seq_length);
  }
  std::vector<MemoryItem> memory_breakdown() const override {
    const std::size_t acts = act_arena_.capacity(), state = state_arena_.capacity();
    const std::size_t saved = model_->saved_bytes(), ce = model_->ce_bytes(), tables = model_->tables_bytes();
    return {{"fp32 master weights", masters_->backed_bytes()},
            {"bf16 weights", param_arena_.capacity()},
            {"fp32 gradients", grad_arena_.capacity() - reduce_scratch_bytes_},
            // the overlapped step's scratch, or the classic step's bf16 copy of the buffer
            {"bf16 gradient-reduce scratch", reduce_scratch_bytes_ + (dp_ ? dp_->device_bytes() : 0)},
            {"optimizer m (Muon momentum)", state - muon_ws_bytes_},
            {"AdamW v", adam_v_buffer_->backed_bytes()},
            {"Muon workspace", muon_ws_bytes_},
            {"saved activations", saved},
            {"backward scratch", acts - saved - ce - tables},
            {"cross-entropy (kept logits)", ce},
            {"expert-parallel exchange", plan_->expert_bytes()},
            {"sequence-parallel gathers", plan_->tensor_bytes()},
            {parallel::context_buffer_name(opt_.context_mode), plan_->context_bytes()},
            {"LASP-2 state gathers", plan_->lasp2_bytes()},
            {"tsp shards", plan_->tsp_bytes()},
            {"tsp table gathers", model_->tables_bytes()}};
  }

  // The SM-speed probe (device/device_canary_cuda.h) enqueued on the compute stream after the
  // step's work; what it returns is the previous call's probe (long done by then: no host wait),
  // 0 at the first.
  double device_canary_seconds(int repeats) override {
    if (!canary_) canary_ = std::make_unique<DeviceCanary>();
    return repeats <= 0 ? 0.0 : canary_->sample(repeats, stream_);
  }

  void enable_profile(int warmup) override {
    step_prof_ = std::make_unique<CudaStepProfile>(warmup);
    model_->set_profile(step_prof_.get());
  }
  ProfileReport profile_report() override { return step_prof_ ? step_prof_->report(stream_) : ProfileReport{}; }

  void zero_grads() override {
    if (step_prof_) step_prof_->step("batch + zero grads", stream_);
    grads_fresh_ = true;  // grad_overwrite_ is left for the step's first backward to write
    if (schedule_) {
      schedule_->new_step();
      if (schedule_->has_optimizer_stream()) {
        // the previous step's optimizer may still read the gradients beside this forward:
        // zeroed at the first backward (flush_zero_grads)
        zero_pending_ = true;
        return;
      }
    } else if (prof_) {
      prof_->new_step();
    }
    zero_grad_ranges(grad_zeroed_);
  }

  void begin_step(int micro_batches) override {
    if (schedule_) schedule_->begin_step(micro_batches);
  }

  LossParts forward(const std::uint32_t* tokens, const std::int32_t* targets) override {
    return model_->forward(tokens, targets, hooks(), load_);
  }

  void backward(float loss_scale) override {
    flush_zero_grads();
    if (schedule_) schedule_->backward_begin();
    else if (prof_) prof_->mark(Zero1Profile::kBwd0, stream_);
    model_->backward(loss_scale, grads_fresh_, hooks());
    if (schedule_) schedule_->backward_end();
    grads_fresh_ = false;  // grad_overwrite_ holds this backward's gradients now; later ones add
  }

  StepResult clip_and_step(double max_norm, double lr) override {
    model_->mark("grad norm + optimizer");
    flush_zero_grads();
    settle_fresh_grads();
    optimizer_->set_lr(lr);
    std::pair<double, float> r;
    if (schedule_ && tp_shards_) r = schedule_->step(*tp_shards_, max_norm, model_->gemm());
    else if (schedule_) r = schedule_->step(*optimizer_, max_norm, model_->gemm());
    else if (plan_->weight_group()) r = tensor_parallel_step(max_norm);
    else if (dp_) r = zero1_step(max_norm);
    else r = optimizer_->step_all(max_norm, model_->gemm(), stream_);
    return {r.first, static_cast<double>(r.second)};
  }

  std::vector<std::int64_t> load(int i) const override { return load_.at(static_cast<std::size_t>(i)); }
  void set_load(int i, const std::vector<std::int64_t>& counts) override {
    if (counts.size() != load_.at(static_cast<std::size_t>(i)).size()) fail("set_load: {} counts for MoE layer {}", counts.size(), i);
    load_[static_cast<std::size_t>(i)] = counts;
  }
  void reset_load() override {
    for (auto& l : load_) std::fill(l.begin(), l.end(), 0);
  }
  std::pair<std::int64_t, std::int64_t> optimizer_shard() const override { return {slice_.shard_begin, slice_.shard_end}; }
  StateSlice state_slice() const override { return slice_; }
  void update_router_bias() override {
    model_->mark("router bias + host until next step");
    if (opt_.bias_update_rate != 0.0) {
      update_balancing_bias(load_, balance_config(opt_), bias_, balance_);
      upload_bias();
    }
    reset_load();
  }

  std::vector<float> gradients() const override {
    std::vector<float> g(static_cast<std::size_t>(layout_.total_floats));
    join();
    flush_zero_grads();
    settle_fresh_grads();
    KEEL_CUDA_CHECK(keel::stream_sync(stream_));
    KEEL_CUDA_CHECK(cudaMemcpy(g.data(), grads_, g.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return g;
  }

  TrainState state() const override {
    TrainState s;
    const std::size_t n = static_cast<std::size_t>(layout_.total_floats);
    s.params.resize(n);
    const std::size_t m = static_cast<std::size_t>(slice_.moments());
    s.set_slice(slice_);
    s.adam_m.resize(m);
    s.adam_v.resize(m);
    join();
    // overlapped ZeRO-1: the fp32 masters of other ranks' shards are stale (bf16 broadcasts) or
    // not kept at all, so they come from their owners (a collective: every rank calls state()
    // together, as the trainer's checkpoint does)
    if (schedule_) {
      float* stage = static_cast<float*>(staging_.ensure(kStagingFloats * sizeof(float), stream_, "staging"));
      schedule_->copy_masters_to_host(s.params.data(), layout_.total_floats, stage, kStagingFloats);
    } else {
      KEEL_CUDA_CHECK(keel::stream_sync(stream_));
      KEEL_CUDA_CHECK(cudaMemcpy(s.params.data(), params_, n * sizeof(float), cudaMemcpyDeviceToHost));
    }
    KEEL_CUDA_CHECK(cudaMemcpy(s.adam_m.data(), adam_m_, m * sizeof(float), cudaMemcpyDeviceToHost));
    for (const MomentSpan& sp : adamw_moment_spans(layout_, slice_))  // zeros elsewhere
      KEEL_CUDA_CHECK(cudaMemcpy(s.adam_v.data() + sp.at, adam_v_ + sp.at, static_cast<std::size_t>(sp.count) * sizeof(float),
                                 cudaMemcpyDeviceToHost));
    s.router_bias = bias_;
    s.router_balance = balance_;
    s.adamw_step = optimizer_->step_count();
    return s;
  }

  // This rank's shard where it lives: the checkpoint copies it once, device to pinned host. Only
  // the shard's range is read, and the owner's fp32 masters and moments are always current
  // (other ranks' masters may be stale under bf16 broadcasts; no gather needed). Not a collective.
  CheckpointView checkpoint_view() override {
    join();  // the shard's update may still run on the optimizer stream
    KEEL_CUDA_CHECK(keel::stream_sync(stream_));
    CheckpointView v;
    v.params = params_;
    v.adam_m = adam_m_;
    v.adam_v = adam_v_;
    v.slice = slice_;
    v.on_device = true;
    v.router_bias = bias_;
    v.router_balance = balance_;
    v.adamw_step = optimizer_->step_count();
    return v;
  }

  void set_state(const TrainState& s) override {
    const std::size_t m = static_cast<std::size_t>(slice_.moments());
    std::vector<std::size_t> bias_sizes;
    for (const auto& b : bias_) bias_sizes.push_back(b.size());
    check_train_state(s, layout_, slice_, bias_sizes);
    join();  // pending broadcasts write the parameters
    upload_params(s.params);
    if (m > 0) KEEL_CUDA_CHECK(cudaMemcpyAsync(adam_m_, s.adam_m.data(), m * sizeof(float), cudaMemcpyHostToDevice, stream_));
    for (const MomentSpan& sp : adamw_moment_spans(layout_, slice_))
      KEEL_CUDA_CHECK(cudaMemcpyAsync(adam_v_ + sp.at, s.adam_v.data() + sp.at, static_cast<std::size_t>(sp.count) * sizeof(float),
                                      cudaMemcpyHostToDevice, stream_));
    KEEL_CUDA_CHECK(keel::stream_sync(stream_));
    bias_ = s.router_bias;
    balance_ = s.router_balance;
    upload_bias();
    optimizer_->set_step_count(s.adamw_step);
    reset_load();
  }

 private:
  static constexpr std::int64_t kStagingFloats = std::int64_t(32) << 20;  // 128 MiB pieces

  std::int64_t offset_of(const std::string& name) const {
    for (const auto& p : layout_.params)
      if (p.name == name) return p.offset;
    fail("cuda backend: no parameter '{}'", name);
  }
  // What the model tells: the overlapped schedule, the classic step's profile, or nobody.
  parallel::StageHooks& hooks() const {
    if (schedule_) return *schedule_;
    if (profile_hooks_) return *profile_hooks_;
    return parallel::no_stage_hooks();
  }
  void join() const {
    if (schedule_) schedule_->join();
  }

  // The classic ZeRO-1 step, all on the compute stream with one host sync for the norm:
  // reduce-scatter the gradients; the global norm from the shards' sums of squares; AdamW on the
  // shard and Muon on its whole matrices; all-gather the fp32 parameters and refresh their bf16
  // copy.
  std::pair<double, float> zero1_step(double max_norm) {
    const std::int64_t b = slice_.shard_begin, e = slice_.shard_end;
    reduce_scatter_gradients();
    if (prof_) prof_->mark(Zero1Profile::kJoined, stream_);
    optimizer_->sum_squares(b, e, /*accumulate=*/false, stream_);
    // expert parallelism: each expert element lies in one rank's expert shard of the data group
    optimizer_->sum_squares(slice_.expert_begin, slice_.expert_end, /*accumulate=*/true, stream_);
    dp_->all_reduce_sum(optimizer_->sum_squares_buffer(), 1);
    optimizer_->clip(max_norm, stream_);
    if (prof_) prof_->mark(Zero1Profile::kNormed, stream_);
    const auto [norm, coef] = optimizer_->read_norm(stream_);
    if (prof_) prof_->report(mesh_.data().rank, mesh_.data().size);
    CudaOptimizer::require_finite(norm);
    optimizer_->begin_updates();
    update_shards();
    optimizer_->end_updates();
    if (prof_) prof_->mark(Zero1Profile::kBc0, stream_);
    all_gather_parameters();
    if (prof_) prof_->mark(Zero1Profile::kBcEnd, stream_), prof_->mark(Zero1Profile::kOptEnd, stream_);
    return {norm, coef};
  }

  // The replicated parameters' partial gradients (tensor parallelism's with sequence
  // parallelism, TSP's) inside [lo, hi) summed over the group, packed into one all-reduce (the
  // tensor ranks of a data rank call it with the same range, so their packs match).
  void sum_partial_gradients(parallel::CudaTensorParallelLinear& tp, std::int64_t lo = 0,
                             std::int64_t hi = std::numeric_limits<std::int64_t>::max()) {
    std::vector<std::pair<std::int64_t, std::int64_t>> in;
    std::int64_t n = 0;
    for (const auto& [b, e] : partial_ranges_)
      if (std::max(b, lo) < std::min(e, hi)) in.emplace_back(std::max(b, lo), std::min(e, hi)), n += in.back().second - in.back().first;
    if (n == 0) return;
    float* pack = static_cast<float*>(tp_pack_.ensure(static_cast<std::size_t>(partial_floats_) * sizeof(float), stream_,
                                                      "partial-gradient pack"));
    std::int64_t at = 0;
    for (const auto& [b, e] : in) {
      KEEL_CUDA_CHECK(cudaMemcpyAsync(pack + at, grads_ + b, static_cast<std::size_t>(e - b) * sizeof(float),
                                      cudaMemcpyDeviceToDevice, stream_));
      at += e - b;
    }
    tp.all_reduce(pack, n, stream_);
    at = 0;
    for (const auto& [b, e] : in) {
      KEEL_CUDA_CHECK(cudaMemcpyAsync(grads_ + b, pack + at, static_cast<std::size_t>(e - b) * sizeof(float),
                                      cudaMemcpyDeviceToDevice, stream_));
      at += e - b;
    }
  }

  // The norm of this rank's shards in two parts: the split blocks (part 0, summed over the data
  // and the weight group) and the rest (part 1, over the data group only: alike on every tensor
  // rank). `accumulate`: add [b, e)'s sums to the parts.
  void sum_squares_parts(std::int64_t b, std::int64_t e, bool accumulate) {
    const auto sum_in = [&](int part, const std::vector<std::pair<std::int64_t, std::int64_t>>& ranges) {
      bool first = !accumulate;
      for (const auto& [rb, re] : ranges) {
        const std::int64_t lo = std::max(rb, b), hi = std::min(re, e);
        if (lo < hi) optimizer_->sum_squares_part(part, lo, hi, /*accumulate=*/!first, stream_), first = false;
      }
      if (first) optimizer_->sum_squares_part(part, 0, 0, /*accumulate=*/false, stream_);
    };
    sum_in(0, split_ranges_);
    sum_in(1, whole_ranges_);
  }

  // The clip coefficient from the two parts (sum_squares_parts, each already summed over the
  // data group): part 0 summed over the weight group too, then the two added.
  void clip_parts(parallel::CudaTensorParallelLinear& tp, double max_norm) {
    tp.group().all_reduce_sum(optimizer_->sum_squares_buffer(), 1, parallel::NcclType::kFloat64, stream_);
    optimizer_->clip_parts(max_norm, stream_);
  }

  // The overlapped ZeRO-1 step's optimizer under tensor parallelism (or TSP): the data group
  // has reduced each bucket to its owner; on the shard, the partial gradients are summed over
  // the weight group, the norm is kept in two parts, and part 0 is summed over the weight group
  // before the clip. AdamW only (the backend keeps Muon on the classic step).
  class TensorParallelShards final : public parallel::ShardOptimizer {
   public:
    TensorParallelShards(CudaBackend& b, parallel::CudaTensorParallelLinear& tp) : b_(b), tp_(tp) {}
    void sum_squares(std::int64_t begin, std::int64_t end, bool accumulate, cudaStream_t stream) override {
      if (stream != b_.stream_) fail("cuda backend: the shard's norm on another stream");
      if (!accumulate) b_.sum_partial_gradients(tp_, begin, end);
      b_.sum_squares_parts(begin, end, accumulate);
    }
    double* sum_squares_buffer() override { return b_.optimizer_->sum_squares_buffer(); }
    int sum_squares_count() const override { return 2; }
    void clip(double max_norm, cudaStream_t stream) override {
      if (stream != b_.stream_) fail("cuda backend: the shard's clip on another stream");
      b_.clip_parts(tp_, max_norm);
    }
    std::pair<double, float> read_norm(cudaStream_t stream) override { return b_.optimizer_->read_norm(stream); }
    void begin_updates() override { b_.optimizer_->begin_updates(); }
    void update(std::int64_t begin, std::int64_t end, ops::cuda::GemmRunner& gemm, cudaStream_t stream) override {
      b_.optimizer_->update(begin, end, gemm, stream);
    }
    void end_updates() override { b_.optimizer_->end_updates(); }

   private:
    CudaBackend& b_;
    parallel::CudaTensorParallelLinear& tp_;
  };

  // The classic step's collectives: the replicated region over the data group and, with expert
  // parallelism, the expert region over the expert-data group (a region of one rank stays).
  void reduce_scatter_gradients() {
    dp_->reduce_scatter_sum(grads_, shards_.replicated.bounds);
    if (expert_dp_) expert_dp_->reduce_scatter_sum(grads_, shards_.experts.bounds);
  }
  void all_gather_parameters() {
    dp_->all_gather(params_, shards_.replicated.bounds);
    if (expert_dp_) expert_dp_->all_gather(params_, shards_.experts.bounds);
    k::f32_to_bf16(params_, params_bf16_, layout_.total_floats, stream_);
  }
  // AdamW and Muon's whole matrices on this rank's shards (moment_ranges: the replicated
  // region's, the expert region's)
  void update_shards() {
    for (const MomentRange& r : moment_ranges(slice_))
      if (r.end > r.begin) optimizer_->update(r.begin, r.end, model_->gemm(), stream_);
  }

  // Tensor parallelism (one tensor group, or TSP's tsp group), with data parallelism ZeRO-1 over
  // the data axis, as the CPU backend's step (cpu_backend.cc). The replicated parameters' partial
  // gradients summed over the tensor group (parallel::tp_partial_gradient); with data
  // parallelism the gradients reduce-scattered over the data group (the shard bounds are alike on
  // the tensor ranks: check_shards_alike); the norm in two parts, this rank's shards' blocks of
  // the split parameters (summed over the data and the tensor group) and of the others (over the
  // data group only: they are the same on every tensor rank); AdamW on the shards (without data
  // parallelism the whole buffer), Muon's split matrices gathered over the tensor group to their
  // owners (CudaTensorParallelMuon over the shards' ranges), the rest whole; with data
  // parallelism the fp32 parameters all-gathered over the data group.
  std::pair<double, float> tensor_parallel_step(double max_norm) {
    parallel::CudaTensorParallelLinear& tp = *plan_->weight_group();
    sum_partial_gradients(tp);
    if (dp_) reduce_scatter_gradients();
    bool first = true;
    for (const MomentRange& sh : moment_ranges(slice_)) sum_squares_parts(sh.begin, sh.end, !first), first = false;
    if (dp_) dp_->all_reduce_sum(optimizer_->sum_squares_buffer(), 2);
    clip_parts(tp, max_norm);
    const auto [norm, coef] = optimizer_->read_norm(stream_);
    CudaOptimizer::require_finite(norm);
    optimizer_->begin_updates();
    update_shards();
    if (tp_muon_)
      tp_muon_->step(params_, grads_, adam_m_, params_bf16_, optimizer_->lr(), optimizer_->clip_coefficient(),
                     model_->gemm(), stream_);
    optimizer_->end_updates();
    if (dp_) all_gather_parameters();
    return {norm, coef};
  }

  // The tensor ranks of a data rank step the same shard (the Muon matrices of CudaTensorParallelMuon
  // are exchanged within it): their layouts, and so their ZeRO-1 cuts, must be alike.
  void check_shards_alike(parallel::GroupKind weight_kind) const {
    const parallel::Group& g = mesh_.group(weight_kind);
    std::int64_t mine[4] = {slice_.shard_begin, -slice_.shard_begin, slice_.shard_end, -slice_.shard_end}, most[4];
    MPI_Allreduce(mine, most, 4, MPI_INT64_T, MPI_MAX, g.comm);
    if (most[0] != -most[1] || most[2] != -most[3])
      throw UsageError(fmt::format("parallel.{} {} with {} data ranks: the tensor ranks' ZeRO-1 shards differ (their "
                                   "blocks are not the same size); choose widths that the {} degree divides",
                                   weight_kind == parallel::GroupKind::kTsp ? "tsp" : "tensor", g.size,
                                   mesh_.data().size, weight_kind == parallel::GroupKind::kTsp ? "tsp" : "tensor"));
  }

  // The flat ranges [begin, end) of the tensor-parallel step: the parameters split over the
  // tensor axis, the others, and of those the ones whose gradient is a partial sum here.
  void plan_tensor_ranges() {
    auto add = [](std::vector<std::pair<std::int64_t, std::int64_t>>& v, std::int64_t b, std::int64_t e) {
      if (!v.empty() && v.back().second == b) v.back().second = e;
      else v.emplace_back(b, e);
    };
    std::vector<const optim::ParamInfo*> by_offset;
    for (const auto& p : layout_.params) by_offset.push_back(&p);
    std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
    for (const auto* p : by_offset) {
      const std::int64_t b = p->offset, e = p->offset + p->numel;
      if (p->placement.splits(mesh::Axis::kTensor)) {
        add(split_ranges_, b, e);
      } else {
        add(whole_ranges_, b, e);
        if (parallel::tp_partial_gradient(*p, opt_.sequence_parallel || plan_->tsp()))
          add(partial_ranges_, b, e), partial_floats_ += e - b;
      }
    }
  }

  // The gradients' zeroing deferred by zero_grads(): after the optimizer stream is done with them.
  void flush_zero_grads() const {
    if (!zero_pending_) return;
    schedule_->wait_optimizer();
    zero_grad_ranges(grad_zeroed_);
    zero_pending_ = false;
  }
  // A step's gradients start at zero. The expert blocks and the LM head (grad_overwrite_) are
  // not cleared by zero_grads(): the step's first backward writes them, which saves a memset of
  // most of a MoE model's gradients and the weight-gradient GEMMs' read of them. Everything else
  // (grad_zeroed_) is cleared by zero_grads() (or, deferred, by flush_zero_grads()).
  //
  // Before gradients are read with no backward since zero_grads(): the blocks no backward wrote.
  void settle_fresh_grads() const {
    if (!grads_fresh_) return;
    zero_grad_ranges(grad_overwrite_);
    grads_fresh_ = false;
  }
  void zero_grad_ranges(const std::vector<std::pair<std::int64_t, std::int64_t>>& ranges) const {
    for (const auto& [b, e] : ranges)
      KEEL_CUDA_CHECK(cudaMemsetAsync(grads_ + b, 0, static_cast<std::size_t>(e - b) * sizeof(float), stream_));
  }
  // The MoE expert stacks and the LM head (or the tied table it reads): every backward writes
  // or zeroes all of them (moe::Grads::overwrite, cross_entropy::Options::overwrite_dw). Then
  // the rest of [0, total_floats). Both merged into ranges.
  void plan_grad_zeroing() {
    const std::int64_t lm_head = offset_of(cfg_.tied_embeddings ? "embed.weight" : "lm_head.weight");
    grad_overwrite_.clear();
    for (const auto& p : layout_.params)
      if (p.placement.splits(mesh::Axis::kExpert) || p.offset == lm_head) grad_overwrite_.emplace_back(p.offset, p.offset + p.numel);
    std::sort(grad_overwrite_.begin(), grad_overwrite_.end());
    std::vector<std::pair<std::int64_t, std::int64_t>> merged;
    for (const auto& r : grad_overwrite_)
      if (!merged.empty() && merged.back().second == r.first) merged.back().second = r.second;
      else merged.push_back(r);
    grad_overwrite_ = merged;
    grad_zeroed_.clear();
    std::int64_t at = 0;
    for (const auto& [b, e] : grad_overwrite_) {
      if (b > at) grad_zeroed_.emplace_back(at, b);
      at = e;
    }
    if (layout_.total_floats > at) grad_zeroed_.emplace_back(at, layout_.total_floats);
  }

  void upload_params(const std::vector<float>& host) {
    const std::size_t n = static_cast<std::size_t>(layout_.total_floats);
    if (masters_->whole()) {
      KEEL_CUDA_CHECK(cudaMemcpyAsync(params_, host.data(), n * sizeof(float), cudaMemcpyHostToDevice, stream_));
      k::f32_to_bf16(params_, params_bf16_, static_cast<std::int64_t>(n), stream_);
    } else {
      // Through a staging buffer in pieces: every element's bf16 copy, the fp32 masters only
      // where this rank keeps them.
      const std::size_t piece = static_cast<std::size_t>(kStagingFloats);
      float* stage = static_cast<float*>(staging_.ensure(piece * sizeof(float), stream_, "staging"));
      for (std::size_t b = 0; b < n; b += piece) {
        const std::size_t e = std::min(n, b + piece);
        KEEL_CUDA_CHECK(cudaMemcpyAsync(stage, host.data() + b, (e - b) * sizeof(float), cudaMemcpyHostToDevice, stream_));
        k::f32_to_bf16(stage, params_bf16_ + b, static_cast<std::int64_t>(e - b), stream_);
        for (const ByteRange& r : masters_->backed()) {
          const std::size_t lo = std::max(b, r.begin / sizeof(float)), hi = std::min(e, r.end / sizeof(float));
          if (lo < hi)
            KEEL_CUDA_CHECK(cudaMemcpyAsync(params_ + lo, stage + (lo - b), (hi - lo) * sizeof(float),
                                            cudaMemcpyDeviceToDevice, stream_));
        }
        KEEL_CUDA_CHECK(keel::stream_sync(stream_));  // the next piece overwrites the staging buffer
      }
    }
    upload_bias();
    KEEL_CUDA_CHECK(keel::stream_sync(stream_));  // `host` may go once this returns
  }

  void upload_bias() {
    std::vector<float> flat;
    for (const auto& b : bias_) flat.insert(flat.end(), b.begin(), b.end());
    if (!flat.empty())
      KEEL_CUDA_CHECK(cudaMemcpyAsync(bias_dev_, flat.data(), flat.size() * sizeof(float), cudaMemcpyHostToDevice, stream_));
    KEEL_CUDA_CHECK(keel::stream_sync(stream_));  // `flat` dies here
  }

  model::ModelConfig cfg_;
  ModelOptions opt_;
  parallel::Mesh mesh_;
  std::string device_name_;
  std::string device_id_;  // "cuda:N <PCI bus id>" (device_id())
  cudaStream_t stream_ = nullptr;
  optim::ParamLayout layout_;
  StateShards shards_;
  StateSlice slice_;  // this rank's optimizer shard, its experts and their shard
  std::unique_ptr<parallel::CudaPlan> plan_;
  std::unique_ptr<CudaModel> model_;
  std::unique_ptr<CudaOptimizer> optimizer_;
  std::unique_ptr<parallel::CudaTensorParallelMuon> tp_muon_;  // tensor parallelism with Muon
  std::unique_ptr<Zero1Profile> prof_;                         // parallel.zero1.profile
  std::unique_ptr<CudaStepProfile> step_prof_;                 // kernels.profile
  std::unique_ptr<ProfileHooks> profile_hooks_;                // its marks in the classic step
  std::unique_ptr<parallel::Zero1OverlapSchedule> schedule_;   // the overlapped ZeRO-1 step
  std::unique_ptr<TensorParallelShards> tp_shards_;            // its optimizer under tensor parallelism
  std::unique_ptr<parallel::DataParallelComm> dp_;             // the classic ZeRO-1 step
  std::unique_ptr<parallel::DataParallelComm> expert_dp_;      // its expert region (expert parallelism)
  DeviceArena param_arena_, grad_arena_, state_arena_, act_arena_;
  std::unique_ptr<SparseDeviceBuffer> masters_;        // the fp32 masters (params_)
  std::unique_ptr<SparseDeviceBuffer> adam_v_buffer_;  // adam_v_: adamw_moment_spans() backed
  mutable GrowingDeviceBuffer staging_{"out of GPU memory: the ", "train on more GPUs or a smaller model"};
  float *params_ = nullptr, *grads_ = nullptr, *adam_m_ = nullptr, *adam_v_ = nullptr, *bias_dev_ = nullptr;
  bf16* params_bf16_ = nullptr;
  std::byte* muon_ws_ = nullptr;  // Newton-Schulz workspace of the largest Muon parameter (null: no Muon)
  // What parts of the arenas hold (memory_breakdown()), in bytes as taken.
  std::size_t reduce_scratch_bytes_ = 0, muon_ws_bytes_ = 0;
  std::vector<std::vector<std::int64_t>> load_;
  std::vector<std::vector<float>> bias_;
  BalanceMemory balance_;
  // gradient ranges [begin, end): written by a step's first backward / zeroed by zero_grads()
  std::vector<std::pair<std::int64_t, std::int64_t>> grad_overwrite_, grad_zeroed_;
  // tensor parallelism: split / whole / partial-gradient ranges, and the partial gradients' pack
  std::vector<std::pair<std::int64_t, std::int64_t>> split_ranges_, whole_ranges_, partial_ranges_;
  std::int64_t partial_floats_ = 0;
  GrowingDeviceBuffer tp_pack_{"out of GPU memory: the ", "train on more GPUs or a smaller model"};
  std::unique_ptr<DeviceCanary> canary_;  // device_canary_seconds
  mutable bool grads_fresh_ = false;   // zero_grads() ran, no backward since: grad_overwrite_ holds stale values
  mutable bool zero_pending_ = false;  // zero_grads() deferred to the first backward
};

}  // namespace

std::unique_ptr<TrainBackend> make_cuda_backend(const model::ModelConfig& cfg, const ModelOptions& options,
                                                const OptimizerConfig& optimizer, const parallel::Mesh& mesh,
                                                const parallel::DataParallelOptions& dp) {
  return std::make_unique<CudaBackend>(cfg, options, optimizer, mesh, dp);
}

}  // namespace keel::train
