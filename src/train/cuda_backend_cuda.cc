// The CUDA TrainBackend: the MoE transformer of model.h on one GPU, with the ops of
// src/ops/cuda (docs/gpu_training.md): mha/gqa or ZAYA1's CCA attention, dense, linear-router
// or ZAYA1 MLP-router MoE stages (EDA, skip class: cuda_zaya_layers_cuda.h), plain residual
// adds or ZAYA1's residual scaling (two streams, as MoeTransformer::scaled_layer_forward).
//
// Precision: fp32 master weights, gradients and optimizer states; a bf16 copy of the weights for
// the GEMMs (refreshed by the fused AdamW and Muon steps); bf16 activations with fp32
// statistics; the residual stream and its gradient in fp32. GEMMs accumulate in fp32
// (cuBLASLt). With optimizer.muon on, the weight matrices step with ops/cuda/muon.h (bf16
// Newton-Schulz GEMMs), the rest with AdamW; Muon's momentum sits in the m buffer.
//
// Memory: four device arenas, each one allocation carved by a bump pointer: parameters
// (fp32 master + bf16 copy), gradients, optimizer state (m, v, Muon's Newton-Schulz workspace)
// and activations (every layer's
// saved tensors, the shared backward scratch and the op workspaces). Nothing is allocated per
// step.
//
// Host synchronization per micro-batch: one per MoE layer in forward (the dispatch plan's
// per-expert counts drive the expert GEMM loop, moe.h; two with ZAYA1's skip class, whose
// packed token count comes first), one at the end of forward to read the
// loss, and one per optimizer step to read the gradient norm (logging and the non-finite
// check). Everything else is enqueued on one stream (and, with data parallelism, a second one
// for the collectives).
//
// Data parallelism with ZeRO-1 (docs/parallel.md): by default the collectives overlap compute.
// The flat buffer is cut into buckets (parallel/zero1_buckets.h) inside stages (the embedding,
// each layer's attention part and MLP part, the final norm / head) and inside one rank's shard.
// During the last micro-batch's backward, as each stage's gradients become final, the compute
// stream records an event, the communication stream waits on it and reduces (ncclReduce to the
// owner) the stage's buckets; the trainer announces the step's micro-batches (begin_step()), so
// the backend knows which backward is the last. The embedding's own
// scatter-add of that micro-batch is deferred: its buckets are reduced at the start of backward
// and the owners add every rank's (token, dL/dx) rows at the end, when that moves fewer floats.
// After the norm, each owner updates its buckets in offset order on an optimizer stream and
// broadcasts each one as soon as it is updated (the bf16 copy for matrices only GEMMs read,
// fp32 for the rest), and the next forward waits per stage for its parameters while the
// update of the rank's own shard runs beside it. parallel.zero1.overlap: false selects the
// classic step (reduce-scatter after backward, all-gather after the update); the other switches
// are in parallel/zero1_buckets.h.
//
// Expert parallelism (parallel.expert, parallel/expert_parallel_cuda.h): each MoE layer's
// experts run through a CudaExpertParallelMoe (NCCL send/recv of token rows over the expert
// group); this rank's experts sit after the replicated parameters, the buckets and stages above
// cover the replicated region only, and the expert region is ZeRO-1 over the expert-data group
// (see setup_expert_parallel).
#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/error.h"
#include "device/cuda_check.h"
#include "device/cuda_devices.h"
#include "device/device_buffer.h"
#include "device/sparse_device_buffer.h"
#include "ops/cuda/adamw.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/cast.h"
#include "ops/cuda/causal_conv.h"
#include "ops/cuda/cca.h"
#include "ops/cuda/cross_entropy.h"
#include "ops/cuda/embedding.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/grad_norm.h"
#include "ops/cuda/linear.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/muon.h"
#include "ops/cuda/residual_scale.h"
#include "ops/cuda/rmsnorm.h"
#include "ops/cuda/rope.h"
#include "ops/cuda/router.h"
#include "ops/cuda/swiglu.h"
#include "ops/cuda/zaya_router.h"
#include "ops/rope.h"
#include "optim/clip.h"
#include "parallel/data_parallel_comm.h"
#include "parallel/expert_parallel_cuda.h"
#include "parallel/nccl_group.h"
#include "parallel/plan.h"
#include "parallel/zero1.h"
#include "parallel/zero1_buckets.h"
#include "train/backend.h"
#include "train/cuda_kernels.h"
#include "train/cuda_zaya_layers_cuda.h"
#include "train/param_rules.h"

namespace keel::train {
namespace {

using ops::cuda::bf16;
namespace k = ops::cuda;

// One cudaMalloc carved into 256-byte-aligned regions; the sizing pass (base == nullptr)
// only counts bytes, so every arena is allocated once at its exact size.
class DeviceArena {
 public:
  explicit DeviceArena(std::string name) : name_(std::move(name)) {}
  ~DeviceArena() {
    if (base_) cudaFree(base_);
  }
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  template <typename T>
  T* take(std::size_t count) {
    const std::size_t bytes = (count * sizeof(T) + 255) / 256 * 256;
    std::byte* p = base_ ? base_ + used_ : nullptr;
    used_ += bytes;
    if (base_ && used_ > capacity_) fail("device arena '{}' overflow ({} > {} bytes)", name_, used_, capacity_);
    return reinterpret_cast<T*>(p);
  }
  // Ends the sizing pass: allocates what was counted and starts handing out real pointers.
  void allocate() {
    capacity_ = std::max<std::size_t>(used_, 256);
    const cudaError_t e = cudaMalloc(&base_, capacity_);
    if (e != cudaSuccess)
      throw_out_of_gpu_memory("out of GPU memory: the " + name_, capacity_,
                              "lower batch.micro_batch or data.seq_length, or set recompute: full");
    KEEL_CUDA_CHECK(cudaMemset(base_, 0, capacity_));
    used_ = 0;
  }
  std::size_t capacity() const { return capacity_; }
  std::size_t used() const { return used_; }  // bytes taken so far (in either pass)

 private:
  std::string name_;
  std::byte* base_ = nullptr;
  std::size_t used_ = 0, capacity_ = 0;
};

// Offsets (floats) of one residual-scaling stage's vectors: (r + r_bias) * r_scale +
// (h + h_bias) * h_scale; layer 0's attention stage has only the h pair.
struct ResScaleOffsets {
  std::int64_t h_scale = -1, h_bias = -1, r_scale = -1, r_bias = -1;
};

struct LayerWeights {
  // Offsets into the flat buffers: fp32 master / gradient views, and the bf16 GEMM operands.
  std::int64_t attn_norm = -1, wq = -1, wk = -1, wv = -1, wo = -1, mlp_norm = -1;
  std::int64_t w_gate = -1, w_up = -1, w_down = -1, router = -1;  // dense [F,D] or experts [E,F,D]
  bool moe = false;
  bool cca = false;  // CCA attention (ops/cuda/cca.h)
  std::int64_t cca_w_qk = -1, cca_w_v = -1, conv0_w = -1, conv0_b = -1, conv1_w = -1, conv1_b = -1, cca_temp = -1,
               cca_wo = -1;
  // ZAYA1 MLP router (eda_scale -1 on the first MoE stage)
  std::int64_t zr_down_w = -1, zr_down_b = -1, zr_eda = -1, zr_norm = -1, zr_w1 = -1, zr_b1 = -1, zr_w2 = -1,
               zr_b2 = -1, zr_out = -1;
  ResScaleOffsets attn_scale, mlp_scale;
};

// The saved tensors of one layer's forward (one set per layer, or one shared set with full
// recompute).
struct LayerActs {
  bf16 *h1 = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *att = nullptr, *h2 = nullptr;
  float *rstd1 = nullptr, *lse = nullptr, *x_mid = nullptr, *rstd2 = nullptr;
  k::cca::Saved cca;          // CCA layers
  bf16* attn_out = nullptr;   // the attention block's output [N, D] (CCA, or residual scaling)
  bf16 *g = nullptr, *u = nullptr, *a = nullptr;  // dense
  float *rlogits = nullptr, *probs = nullptr, *rlse = nullptr, *gates = nullptr, *losses = nullptr;  // moe
  std::int32_t *idx = nullptr, *counts = nullptr, *plan_ws = nullptr;
  k::moe::Saved saved;
  k::moe::Plan plan;
  cuda_zaya::Acts zmoe;  // MLP-router MoE (its experts' Saved is `saved`)
};

// parallel.zero1.profile (data parallel): a per-step timeline from device events, printed to stderr
// by the first and last rank after each step's norm (docs/parallel.md). Two sets of events,
// alternating by step, so the previous step's tail (optimizer, broadcasts) reads beside the
// current step's forward and backward.
struct Profile {
  enum Mark { kFwd0, kFwdGo, kFwdEnd, kBwd0, kBwdEnd, kRed0, kRedEnd, kJoined, kNormed, kBc0, kBcEnd, kOptEnd, kMarks };
  cudaEvent_t ev[2][kMarks] = {};
  bool rec[2][kMarks] = {};
  long step = 0;
  bool forward_seen = false, reduce_seen = false;

  Profile() {
    for (auto& set : ev)
      for (auto& e : set) KEEL_CUDA_CHECK(cudaEventCreate(&e));
  }
  ~Profile() {
    for (auto& set : ev)
      for (auto& e : set) cudaEventDestroy(e);
  }
  void new_step() {
    ++step;
    forward_seen = reduce_seen = false;
    for (bool& r : rec[step % 2]) r = false;
  }
  void mark(Mark m, cudaStream_t s) {
    KEEL_CUDA_CHECK(cudaEventRecord(ev[step % 2][m], s));
    rec[step % 2][m] = true;
  }
  // ms from a to b (set p), or NaN when either was not recorded
  double ms(int pa, Mark a, int pb, Mark b) const {
    if (!rec[pa][a] || !rec[pb][b]) return std::nan("");
    float t = 0;
    return cudaEventElapsedTime(&t, ev[pa][a], ev[pb][b]) == cudaSuccess ? t : std::nan("");
  }
  void report(int rank, int ranks) const {
    if (rank != 0 && rank != ranks - 1) return;
    const int c = static_cast<int>(step % 2), p = 1 - c;
    std::fprintf(stderr,
                 "dp profile rank %d step %ld: period %.2f | fwd wait %.2f fwd %.2f bwd %.2f tail %.2f norm %.2f | "
                 "reduces %.2f, end %.2f after bwd | prev: opt %.2f bcast %.2f, ends %.2f after fwd go, opt->fwd %.2f ms\n",
                 rank, step, ms(p, kFwd0, c, kFwd0), ms(c, kFwd0, c, kFwdGo), ms(c, kFwdGo, c, kFwdEnd),
                 ms(c, kBwd0, c, kBwdEnd), ms(c, kBwdEnd, c, kJoined), ms(c, kJoined, c, kNormed),
                 ms(c, kRed0, c, kRedEnd), ms(c, kBwdEnd, c, kRedEnd), ms(p, kNormed, p, kOptEnd), ms(p, kBc0, p, kBcEnd),
                 ms(c, kFwdGo, p, kBcEnd), ms(p, kOptEnd, c, kFwd0));
  }
};

class CudaBackend final : public TrainBackend {
 public:
  CudaBackend(const model::ModelConfig& cfg, const ModelOptions& options, const OptimizerConfig& optimizer,
              const parallel::Mesh& mesh, const parallel::DataParallelOptions& dp)
      : cfg_(cfg), opt_(options), adam_(optimizer.adamw), muon_(optimizer.muon.config), param_arena_("parameters"),
        grad_arena_("gradients"), state_arena_("optimizer states"), act_arena_("activations") {
    validate(optimizer.muon);
    validate_trainable(cfg_, opt_);
    if (visible_cuda_devices() == 0) throw UsageError("device: cuda: no CUDA device is visible");
    KEEL_CUDA_CHECK(cudaGetDevice(&device_));
    cudaDeviceProp prop{};
    KEEL_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
    device_name_ = prop.name;
    // validate_trainable() leaves mha, gqa and cca; the attention kernel (CCA's too) needs:
    if (cfg_.head_dim != 64 && cfg_.head_dim != 128)
      throw UsageError(fmt::format("model '{}': head_dim {}: the CUDA attention supports 64 and 128", cfg_.name,
                                   cfg_.head_dim));
    KEEL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    // Keep the whole bf16 logits between forward and backward (no recomputed LM head) when they
    // take at most an eighth of the GPU; otherwise walk the vocabulary in ce_chunk chunks.
    ce_keep_logits_ = static_cast<double>(tokens()) * cfg_.vocab_size * 2 <= prop.totalGlobalMem / 8.0;
    gemm_ = std::make_unique<k::GemmRunner>();

    // With expert parallelism this rank's experts come last (E / ep per MoE layer).
    parallel::check_plan(cfg_, mesh.shape());
    mesh_ = mesh;
    dp_options_ = dp;
    layout_ = model::param_layout(cfg_, mesh.shape());
    // Muon: the same offsets, the matrices regrouped (param_rules.h)
    if (optimizer.muon.enabled) layout_ = regroup_layout(layout_, train_group_rules(optimizer.muon));
    const std::size_t muon_ws_bytes = k::muon::workspace_bytes(layout_);
    // ZeRO-1 over the data-parallel ranks (parallel/zero1.h): optimizer state for this rank's
    // shard only, as on CPU ranks (plan_state_shards: with expert parallelism the replicated
    // region over the data group, the expert region over the expert-data group); the collectives
    // are set up below (setup_data_parallel, setup_expert_parallel).
    const StateShards shards = plan_state_shards(layout_, mesh);
    replicated_end_ = shards.replicated_end;
    plan_ = shards.replicated;
    expert_plan_ = shards.experts;
    slice_ = shards.slice;
    shard_ = {slice_.shard_begin, slice_.shard_end};
    expert_data_rank_ = mesh.expert_data().rank;
    for (int l = 0; l < cfg_.layers; ++l) {
      moe_index_of_layer_.push_back(model::is_moe_layer(cfg_, l) ? static_cast<int>(moe_layer_ids_.size()) : -1);
      if (model::is_moe_layer(cfg_, l)) moe_layer_ids_.push_back(l);
      const bool cca = model::layer_attention_kind(cfg_, l) == model::AttentionKind::kCca;
      any_cca_ |= cca;
      any_softmax_ |= !cca;
    }
    mlp_router_ = cfg_.router_hidden > 0;
    scaled_ = cfg_.residual_scaling;
    zshape_.tokens = tokens();
    zshape_.hidden = cfg_.hidden;
    zshape_.router_hidden = cfg_.router_hidden;
    zshape_.expert_hidden = cfg_.expert_hidden;
    zshape_.experts = cfg_.experts;
    zshape_.skip = cfg_.router_skip_expert;
    zshape_.eps = eps();
    classes_ = mlp_router_ ? zshape_.classes() : cfg_.experts;
    // the CUDA CCA's limits (ops/cuda/cca.h), reported here rather than at the first step
    if (any_cca_ && (cfg_.cca_conv_width > k::causal_conv::kMaxWidth ||
                     cfg_.cca_group_conv_width > k::causal_conv::kMaxWidth ||
                     std::int64_t(cfg_.heads + cfg_.kv_heads) * cfg_.head_dim > 12288))
      throw UsageError(fmt::format("model '{}': the CUDA CCA takes conv widths <= {} and (heads + kv_heads) * "
                                   "head_dim <= 12288 (device: cpu trains it)",
                                   cfg_.name, k::causal_conv::kMaxWidth));
    cca_cfg_ = cca_config(cfg_);
    load_.assign(moe_layer_ids_.size(), std::vector<std::int64_t>(classes_, 0));
    bias_ = model::initial_router_biases(cfg_);  // as the CPU model
    map_weights();
    plan_grad_zeroing();
    if (mesh.data().size > 1) setup_data_parallel();
    if (mesh.expert().size > 1) setup_expert_parallel();

    // parameters, gradients, states: the flat layout of the CPU model, so checkpoints move freely
    const std::size_t n = static_cast<std::size_t>(layout_.total_floats);
    // the collectives' buffers may need a padded tail (equal NCCL chunks)
    const std::size_t n_comm = dp_ ? static_cast<std::size_t>(dp_->buffer_floats(layout_.total_floats)) : n;
    const std::size_t n_shard = std::max<std::size_t>(1, static_cast<std::size_t>(slice_.moments()));
    for (int pass = 0; pass < 2; ++pass) {
      params_bf16_ = param_arena_.take<bf16>(n);
      bias_dev_ = param_arena_.take<float>(std::max<std::size_t>(1, moe_layer_ids_.size() * classes_));
      grads_ = grad_arena_.take<float>(n_comm);
      const std::size_t grads_used = grad_arena_.used();
      grads_bf16_ =
          reduce_scratch_floats_ > 0 ? grad_arena_.take<bf16>(static_cast<std::size_t>(reduce_scratch_floats_)) : nullptr;
      reduce_scratch_bytes_ = grad_arena_.used() - grads_used;
      adam_m_ = state_arena_.take<float>(n_shard);
      const std::size_t state_used = state_arena_.used();
      muon_ws_ = muon_ws_bytes ? state_arena_.take<std::byte>(muon_ws_bytes) : nullptr;
      muon_ws_bytes_ = state_arena_.used() - state_used;
      plan_acts();
      if (pass == 0) {
        param_arena_.allocate();
        grad_arena_.allocate();
        state_arena_.allocate();
        act_arena_.allocate();
      }
    }
    masters_ = std::make_unique<SparseDeviceBuffer>(n_comm * sizeof(float), master_ranges(n_comm),
                                                    "out of GPU memory: the fp32 master weights",
                                                    "train on more GPUs or a smaller model");
    params_ = static_cast<float*>(masters_->get());
    // AdamW's v only where AdamW parameters are: Muon's matrices (most of a MoE model) have none.
    std::vector<ByteRange> v_ranges;
    for (const MomentSpan& sp : adamw_moment_spans(layout_, slice_))
      v_ranges.push_back({static_cast<std::size_t>(sp.at) * sizeof(float),
                          static_cast<std::size_t>(sp.at + sp.count) * sizeof(float)});
    adam_v_buffer_ = std::make_unique<SparseDeviceBuffer>(n_shard * sizeof(float), std::move(v_ranges),
                                                          "out of GPU memory: AdamW's second moments",
                                                          "train on more GPUs or a smaller model");
    adam_v_ = static_cast<float*>(adam_v_buffer_->get());
    rope_ = std::make_unique<k::rope::UploadedTable>(
        ops::rope::make_table(cfg_.head_dim, cfg_.rope_fraction, cfg_.rope_base, std::max(opt_.seq_length, cfg_.max_seq_len)));
    std::vector<std::int32_t> pos(static_cast<std::size_t>(tokens()));
    for (std::int64_t i = 0; i < tokens(); ++i) pos[i] = static_cast<std::int32_t>(i % opt_.seq_length);
    // Host-to-device copies go on stream_ and are waited for: a plain cudaMemcpy from pageable
    // memory may return before its DMA lands, and kernels on this non-blocking stream do not
    // wait for the legacy stream (the first step then reads stale weights).
    KEEL_CUDA_CHECK(cudaMemcpyAsync(positions_, pos.data(), pos.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice, stream_));
    KEEL_CUDA_CHECK(keel::stream_sync(stream_));

    std::vector<float> init(n);
    mesh::Shape experts;
    experts.dp = experts.ep = slice_.expert_parallel;
    mesh::Coord at;
    at.ep = slice_.expert_rank;
    model::init_parameters(cfg_, layout_, opt_.init_std, opt_.init_seed, init.data(), experts, at);
    upload_params(init);
  }

  ~CudaBackend() override {
    if (comm_stream_) keel::stream_sync(comm_stream_);
    if (stream_) {
      keel::stream_sync(stream_);
      cudaStreamDestroy(stream_);
    }
    if (opt_stream_) {
      keel::stream_sync(opt_stream_);
      cudaStreamDestroy(opt_stream_);
    }
    if (comm_stream_) cudaStreamDestroy(comm_stream_);
    for (cudaEvent_t e : {ev_opt_go_, ev_opt_bucket_, ev_opt_done_})
      if (e) cudaEventDestroy(e);
    for (cudaEvent_t e : ev_arrived_) cudaEventDestroy(e);
    if (ev_ready_) cudaEventDestroy(ev_ready_);
    if (ev_comm_) cudaEventDestroy(ev_comm_);
  }

  std::string device() const override { return device_name_; }
  const optim::ParamLayout& layout() const override { return layout_; }
  std::int64_t param_count() const override { return model::global_param_count(layout_); }  // the whole model's
  int moe_layer_count() const override { return static_cast<int>(moe_layer_ids_.size()); }
  double flops_per_micro_batch() const override {
    return model_flops_per_micro_batch(cfg_, opt_.micro_batch, opt_.seq_length);
  }
  std::vector<MemoryItem> memory_breakdown() const override {
    std::size_t ep = ep_group_ ? ep_group_->device_bytes() : 0;
    for (const auto& l : ep_layers_) ep += l->device_bytes();
    const std::size_t acts = act_arena_.capacity(), state = state_arena_.capacity();
    return {{"fp32 master weights", masters_->backed_bytes()},
            {"bf16 weights", param_arena_.capacity()},
            {"fp32 gradients", grad_arena_.capacity() - reduce_scratch_bytes_},
            // the overlapped step's scratch, or the classic step's bf16 copy of the buffer
            {"bf16 gradient-reduce scratch", reduce_scratch_bytes_ + (dp_ ? dp_->device_bytes() : 0)},
            {"optimizer m (Muon momentum)", state - muon_ws_bytes_},
            {"AdamW v", adam_v_buffer_->backed_bytes()},
            {"Muon workspace", muon_ws_bytes_},
            {"saved activations", saved_act_bytes_},
            {"backward scratch", acts - saved_act_bytes_ - ce_scratch_bytes_},
            {"cross-entropy (kept logits)", ce_scratch_bytes_},
            {"expert-parallel exchange", ep}};
  }

  void zero_grads() override {
    if (prof_) prof_->new_step();
    grads_fresh_ = true;  // grad_overwrite_ is left for the step's first backward to write
    if (overlap_) {
      if (reduces_in_flight_) join_comm();  // an abandoned step's reduces still read grads_
      backward_calls_ = 0;
      step_backwards_ = 0;  // announced again by begin_step()
      reduces_launched_ = false;
      if (opt_stream_) {
        // the previous step's optimizer may still read the gradients beside this forward:
        // zeroed at the first backward (flush_zero_grads)
        zero_pending_ = true;
        return;
      }
    }
    zero_grad_ranges(grad_zeroed_);
  }

  LossParts forward(const std::uint32_t* tokens_host, const std::int32_t* targets_host) override {
    const std::int64_t N = tokens(), V = cfg_.vocab_size, D = cfg_.hidden;
    for (std::int64_t i = 0; i < N; ++i)
      if (tokens_host[i] >= static_cast<std::uint64_t>(V))
        fail("token id {} at position {} is outside the vocabulary ({})", tokens_host[i], i, V);
    KEEL_CUDA_CHECK(cudaMemcpyAsync(tokens_, tokens_host, N * sizeof(std::uint32_t), cudaMemcpyHostToDevice, stream_));
    KEEL_CUDA_CHECK(cudaMemcpyAsync(targets_, targets_host, N * sizeof(std::int32_t), cudaMemcpyHostToDevice, stream_));
    const bool first_forward = prof_ && !prof_->forward_seen;
    if (first_forward) prof_->mark(Profile::kFwd0, stream_), prof_->forward_seen = true;
    await_stage(0);  // overlapped ZeRO-1: the parameters of each stage as they arrive
    if (first_forward) prof_->mark(Profile::kFwdGo, stream_);
    // The lookup reads the bf16 working copy, as the GEMMs do (bf16 mixed precision): under
    // data parallelism the table then travels in bf16, half the bytes the forward waits for.
    k::embedding::forward_bf16_table(tokens_, N, params_bf16_ + embed_, resid_[0], V, D, stream_);
    for (int l = 0; l < cfg_.layers; ++l) {
      if (scaled_)
        scaled_layer_forward(l, acts_for(l), resid_[l + 1], hres_[l + 1], /*count_load=*/true);
      else
        layer_forward(l, acts_for(l), resid_[l], resid_[l + 1], /*count_load=*/true);
    }
    const float* final_in = resid_[cfg_.layers];
    await_stage(final_stage());
    if (scaled_) {
      const ResScaleOffsets& F = final_scale_;
      k::residual_scale::merge_forward(resid_[cfg_.layers], hres_[cfg_.layers], params_ + F.r_bias, params_ + F.r_scale,
                                       params_ + F.h_bias, params_ + F.h_scale, final_r_, N, D, stream_);
      final_in = final_r_;
    }
    k::rmsnorm::forward(final_in, params_ + final_norm_, eps(), final_h_, final_rstd_, N, D, stream_);
    k::cross_entropy::forward(final_h_, params_bf16_ + lm_head_, targets_, N, D, V, ce_options(), ce_lse_, ce_result_,
                              ce_scratch_, stream_);
    if (first_forward) prof_->mark(Profile::kFwdEnd, stream_);
    // one sync: the loss, the router losses and the expert loads of this micro-batch
    LossParts lp;
    const k::cross_entropy::Result r = k::cross_entropy::read_result(ce_result_, stream_);
    lp.ce = r.loss;
    for (std::size_t m = 0; m < moe_layer_ids_.size(); ++m) {
      LayerActs& a = acts_for(moe_layer_ids_[m]);
      if (mlp_router_) {
        // the MLP router has no aux or z loss (its balance is the bias controller's)
      } else if (opt_.recompute == Recompute::kNone || moe_layer_ids_.size() == 1) {
        const auto losses = k::router::read_losses(a.losses, stream_);
        lp.aux += losses.aux;
        lp.z += losses.z;
      } else {
        lp.aux += host_losses_[m].aux;
        lp.z += host_losses_[m].z;
      }
      for (int e = 0; e < classes_; ++e) load_[m][e] += layer_counts_[m][e];
    }
    lp.total = lp.ce + opt_.aux_loss_weight * lp.aux + opt_.z_loss_weight * lp.z;
    have_forward_ = true;
    return lp;
  }

  void backward(float loss_scale) override {
    if (!have_forward_) fail("model: backward() without a forward()");
    // overlapped ZeRO-1: the last micro-batch of the step reduces each stage's buckets as soon
    // as its gradients are final (grads_ready)
    flush_zero_grads();
    launching_ = overlap_ && last_micro_batch();
    if (prof_) prof_->mark(Profile::kBwd0, stream_);
    cur_scale_ = loss_scale;
    const std::int64_t N = tokens(), V = cfg_.vocab_size, D = cfg_.hidden;
    k::cross_entropy::Options ce = ce_options();
    ce.overwrite_dw = grads_fresh_;  // the LM head's gradient is written first (a tied table's scatter-add follows)
    k::cross_entropy::backward(final_h_, params_bf16_ + lm_head_, targets_, ce_lse_, loss_scale, N, D, V, ce,
                               ce_scratch_, dh_bf_, grads_ + lm_head_, stream_);
    KEEL_CUDA_CHECK(cudaMemsetAsync(dres_, 0, N * D * sizeof(float), stream_));
    k::rmsnorm::backward(scaled_ ? final_r_ : resid_[cfg_.layers], params_ + final_norm_, final_rstd_, dh_bf_, dres_,
                         grads_ + final_norm_, N, D, stream_);
    if (scaled_) {  // dres_ = dL/d resid_[L], dhres_ = dL/d hres_[L]
      const ResScaleOffsets& F = final_scale_;
      k::residual_scale::merge_backward(resid_[cfg_.layers], hres_[cfg_.layers], params_ + F.r_bias,
                                        params_ + F.r_scale, params_ + F.h_bias, params_ + F.h_scale, dres_, dres_,
                                        dhres_, grads_ + F.r_bias, grads_ + F.r_scale, grads_ + F.h_bias,
                                        grads_ + F.h_scale, N, D, stream_);
    }
    grads_ready(final_stage());
    // The embedding's gradient is final now but for this micro-batch's scatter-add, which the
    // owners do at the end from every rank's rows: reduce it first, behind the whole backward.
    const bool defer = launching_ && defer_embed_;
    if (defer) grads_ready(0);
    for (int l = cfg_.layers - 1; l >= 0; --l) {
      LayerActs& a = acts_for(l);
      const bool full = opt_.recompute == Recompute::kFull;
      if (scaled_) {
        // Recompute: the residual output goes to the spare (resid_[l + 1] already holds it and
        // the MLP-norm backward reads it there); the mixer output to hres_[l + 1], which only
        // layer l + 1's backward read, and that has run.
        if (full) scaled_layer_forward(l, a, spare_resid_, hres_[l + 1], /*count_load=*/false);
        scaled_layer_backward(l, a);
      } else {
        if (full) layer_forward(l, a, resid_[l], spare_resid_, /*count_load=*/false);
        layer_backward(l, a, resid_[l]);
      }
    }
    if (prof_) prof_->mark(Profile::kBwdEnd, stream_);
    // the expert region's gradients are final: to their shards' owners over the expert-data group
    if (launching_ && xnccl_) {
      signal_comm();
      reduce_experts(comm_stream_);
    }
    if (defer) {
      gather_embedding_gradients();
    } else {
      k::embedding::backward(tokens_, N, dres_, grads_ + embed_, V, D, stream_);
      grads_ready(0);
    }
    if (launching_ && prof_) prof_->mark(Profile::kRedEnd, comm_stream_);
    if (launching_) reduces_launched_ = true;
    launching_ = false;
    have_forward_ = false;
    grads_fresh_ = false;  // grad_overwrite_ holds this backward's gradients now; later ones add
  }

  StepResult clip_and_step(double max_norm, double lr) override {
    flush_zero_grads();
    settle_fresh_grads();
    if (overlap_) return overlapped_zero1_step(max_norm, lr);
    if (dp_) return zero1_step(max_norm, lr);
    const std::int64_t n = layout_.total_floats;
    k::grad_norm::sum_squares(grads_, n, norm_ws_, sum_sq_, /*accumulate=*/false, stream_);
    k::grad_norm::clip_coefficient(sum_sq_, max_norm, coef_, norm_, stream_);
    double norm = 0;
    float coef = 1;
    KEEL_CUDA_CHECK(cudaMemcpyAsync(&norm, norm_, sizeof(double), cudaMemcpyDeviceToHost, stream_));
    KEEL_CUDA_CHECK(cudaMemcpyAsync(&coef, coef_, sizeof(float), cudaMemcpyDeviceToHost, stream_));
    KEEL_CUDA_CHECK(keel::stream_sync(stream_));
    if (!std::isfinite(norm))
      throw optim::NonFiniteGradient(fmt::format("gradient norm is {}", norm), "", norm);
    k::adamw::DeviceFlatRange r;
    r.begin = 0;
    r.end = n;
    r.param = params_;
    r.grad = grads_;
    r.m = adam_m_;
    r.v = adam_v_;
    r.param_bf16 = params_bf16_;
    adam_.step(layout_, r, lr, 1.0f, coef_, stream_);  // skips Muon parameters
    // Muon on the matrices: the same device-side clip coefficient as gradient scale
    if (muon_ws_) muon_.step(layout_, params_, grads_, adam_m_, params_bf16_, lr, 1.0f, coef_, muon_ws_, *gemm_, stream_);
    return {norm, static_cast<double>(coef)};
  }

  std::vector<std::int64_t> load(int i) const override { return load_.at(static_cast<std::size_t>(i)); }
  void set_load(int i, const std::vector<std::int64_t>& counts) override {
    if (counts.size() != load_.at(static_cast<std::size_t>(i)).size()) fail("set_load: {} counts for MoE layer {}", counts.size(), i);
    load_[static_cast<std::size_t>(i)] = counts;
  }
  void reset_load() override {
    for (auto& l : load_) std::fill(l.begin(), l.end(), 0);
  }
  std::pair<std::int64_t, std::int64_t> optimizer_shard() const override { return shard_; }
  StateSlice state_slice() const override { return slice_; }
  void update_router_bias() override {
    if (opt_.bias_update_rate != 0.0) {
      update_balancing_bias(load_, opt_.bias_update_rate, bias_);
      upload_bias();
    }
    reset_load();
  }

  std::vector<float> gradients() const override {
    std::vector<float> g(static_cast<std::size_t>(layout_.total_floats));
    join_comm();
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
    const std::size_t k = static_cast<std::size_t>(slice_.moments());
    s.set_slice(slice_);
    s.adam_m.resize(k);
    s.adam_v.resize(k);
    join_comm();
    // overlapped ZeRO-1: the fp32 masters of other ranks' shards are stale (bf16 broadcasts) or
    // not kept at all, so they come from their owners (a collective: every rank calls state()
    // together, as the trainer's checkpoint does)
    if (overlap_) {
      copy_masters_to_host(s.params.data());
    } else {
      KEEL_CUDA_CHECK(keel::stream_sync(stream_));
      KEEL_CUDA_CHECK(cudaMemcpy(s.params.data(), params_, n * sizeof(float), cudaMemcpyDeviceToHost));
    }
    KEEL_CUDA_CHECK(cudaMemcpy(s.adam_m.data(), adam_m_, k * sizeof(float), cudaMemcpyDeviceToHost));
    for (const MomentSpan& sp : adamw_moment_spans(layout_, slice_))  // zeros elsewhere
      KEEL_CUDA_CHECK(cudaMemcpy(s.adam_v.data() + sp.at, adam_v_ + sp.at, static_cast<std::size_t>(sp.count) * sizeof(float),
                                 cudaMemcpyDeviceToHost));
    s.router_bias = bias_;
    s.adamw_step = adam_.step_count();
    return s;
  }

  // This rank's shard where it lives: the checkpoint copies it once, device to pinned host. Only
  // the shard's range is read, and the owner's fp32 masters and moments are always current
  // (other ranks' masters may be stale under bf16 broadcasts; no gather needed). Not a collective.
  CheckpointView checkpoint_view() override {
    join_comm();  // the shard's update may still run on the optimizer stream
    KEEL_CUDA_CHECK(keel::stream_sync(stream_));
    CheckpointView v;
    v.params = params_;
    v.adam_m = adam_m_;
    v.adam_v = adam_v_;
    v.slice = slice_;
    v.on_device = true;
    v.router_bias = bias_;
    v.adamw_step = adam_.step_count();
    return v;
  }

  void set_state(const TrainState& s) override {
    const std::size_t k = static_cast<std::size_t>(slice_.moments());
    std::vector<std::size_t> bias_sizes;
    for (const auto& b : bias_) bias_sizes.push_back(b.size());
    check_train_state(s, layout_, slice_, bias_sizes);
    join_comm();  // pending broadcasts write the parameters
    upload_params(s.params);
    if (k > 0) KEEL_CUDA_CHECK(cudaMemcpyAsync(adam_m_, s.adam_m.data(), k * sizeof(float), cudaMemcpyHostToDevice, stream_));
    for (const MomentSpan& sp : adamw_moment_spans(layout_, slice_))
      KEEL_CUDA_CHECK(cudaMemcpyAsync(adam_v_ + sp.at, s.adam_v.data() + sp.at, static_cast<std::size_t>(sp.count) * sizeof(float),
                                      cudaMemcpyHostToDevice, stream_));
    KEEL_CUDA_CHECK(keel::stream_sync(stream_));
    bias_ = s.router_bias;
    upload_bias();
    adam_.set_step_count(s.adamw_step);
    reset_load();
  }

 private:
  // ZeRO-1 (parallel/zero1.h), all on stream_ with one host sync for the norm, as the 1-GPU
  // step: reduce-scatter the gradients; the global norm from the shards' sums of squares;
  // AdamW on the shard and Muon on its whole matrices; all-gather the fp32 parameters and
  // refresh their bf16 copy.
  // The step's one host sync: the global norm and clip coefficient the device computed. Throws
  // optim::NonFiniteGradient (nothing updated yet) when the norm is not finite.
  std::pair<double, float> read_norm() {
    double norm = 0;
    float coef = 1;
    KEEL_CUDA_CHECK(cudaMemcpyAsync(&norm, norm_, sizeof(double), cudaMemcpyDeviceToHost, stream_));
    KEEL_CUDA_CHECK(cudaMemcpyAsync(&coef, coef_, sizeof(float), cudaMemcpyDeviceToHost, stream_));
    KEEL_CUDA_CHECK(keel::stream_sync(stream_));
    if (prof_) prof_->report(dp_rank_, dp_size_);
    if (!std::isfinite(norm)) throw optim::NonFiniteGradient(fmt::format("gradient norm is {}", norm), "", norm);
    return {norm, coef};
  }

  StepResult zero1_step(double max_norm, double lr) {
    const auto [b, e] = shard_;
    dp_->reduce_scatter_sum(grads_, plan_.bounds);
    if (prof_) prof_->mark(Profile::kJoined, stream_);
    k::grad_norm::sum_squares(grads_ + b, e - b, norm_ws_, sum_sq_, /*accumulate=*/false, stream_);
    dp_->all_reduce_sum(sum_sq_, 1);
    k::grad_norm::clip_coefficient(sum_sq_, max_norm, coef_, norm_, stream_);
    if (prof_) prof_->mark(Profile::kNormed, stream_);
    const auto [norm, coef] = read_norm();
    k::adamw::DeviceFlatRange r;
    r.begin = b;
    r.end = e;
    r.param = params_ + b;
    r.grad = grads_ + b;
    r.m = adam_m_;
    r.v = adam_v_;
    r.param_bf16 = params_bf16_ + b;
    adam_.step(layout_, r, lr, 1.0f, coef_, stream_);  // skips Muon parameters
    muon_step_range(b, e, lr, *gemm_, stream_);
    if (prof_) prof_->mark(Profile::kBc0, stream_);
    dp_->all_gather(params_, plan_.bounds);
    k::f32_to_bf16(params_, params_bf16_, layout_.total_floats, stream_);
    if (prof_) prof_->mark(Profile::kBcEnd, stream_), prof_->mark(Profile::kOptEnd, stream_);
    return {norm, static_cast<double>(coef)};
  }

  // Muon on the whole matrices inside [begin, end) of this rank's shard, consecutive ones of a
  // stack in one batched call (momentum at shard-local offsets).
  void muon_step_range(std::int64_t begin, std::int64_t end, double lr, k::GemmRunner& gemm, cudaStream_t stream) {
    const auto mats = parallel::muon_matrices_in(layout_, begin, end);
    for (std::size_t i = 0; i < mats.size();) {
      std::size_t j = i + 1;
      while (j < mats.size() && mats[j].param == mats[i].param) ++j;
      const auto& p = layout_.params[static_cast<std::size_t>(mats[i].param)];
      const std::int64_t o = mats[i].offset;
      k::muon::matrix_step(params_ + o, grads_ + o, adam_m_ + moment_index(o), params_bf16_ + o, static_cast<std::int64_t>(j - i),
                           p.rows(), p.cols(), muon_.config(), lr * p.lr_scale, p.weight_decay, 1.0f, coef_, muon_ws_,
                           gemm, stream);
      i = j;
    }
  }

  // Where the moments of flat offset o sit in adam_m_ / adam_v_: the replicated shard's first,
  // then (expert parallelism) the expert shard's.
  std::int64_t moment_index(std::int64_t o) const {
    if (o >= replicated_end_ && slice_.expert_end > slice_.expert_begin)
      return (shard_.second - shard_.first) + (o - slice_.expert_begin);
    return o - shard_.first;
  }

  // ---- expert parallelism (parallel/expert_parallel_cuda.h) ----
  //
  // The MoE layers run their experts through one CudaExpertParallelMoe each (NCCL send/recv
  // over the expert group). The expert region of the flat buffer (this rank's E / ep experts of
  // every MoE layer, after the replicated parameters) is ZeRO-1 sharded over the expert-data
  // group: its gradients are reduced to the shard owners at the end of the last backward, the
  // owners update their shard on the optimizer stream, and broadcast it (fp32) before the
  // first MoE layer's stage arrives. With ep = ranks the expert-data group is one rank: no
  // expert collectives at all.
  void setup_expert_parallel() {
    if (!overlap_)
      throw UsageError("keel train (cuda): expert parallelism needs the overlapped ZeRO-1 step (parallel.zero1.overlap: "
                       "false and layouts whose stages are not in offset order are not supported)");
    ep_group_ = std::make_shared<parallel::CudaExpertParallelGroup>(
        mesh_.expert().comm, mesh_.nccl(parallel::GroupKind::kExpert), cfg_.experts);
    for (std::size_t m = 0; m < moe_layer_ids_.size(); ++m)
      ep_layers_.push_back(std::make_unique<parallel::CudaExpertParallelMoe>(ep_group_));
    if (mesh_.expert_data().size > 1) {
      xnccl_ = mesh_.nccl(parallel::GroupKind::kExpertData);
      if (dp_options_.grad_reduce == parallel::GradReduceDtype::kBf16)  // the expert region uses the stages' scratch
        reduce_scratch_floats_ = std::max(reduce_scratch_floats_, expert_plan_.bounds.back() - expert_plan_.bounds.front());
      const bool bf16 = dp_options_.zero1.broadcast_bf16;
      for (int r = 0; r < expert_plan_.ranks(); ++r)
        expert_pieces_.push_back(expert_plan_.count(r) > 0 ? broadcast_runs(expert_plan_.begin(r),
                                                                            expert_plan_.begin(r) + expert_plan_.count(r), bf16)
                                                           : std::vector<BroadcastRun>{});
    }
    expert_stage_ = moe_layer_ids_.empty() ? -1 : 2 + 2 * moe_layer_ids_.front();
  }
  k::moe::ExpertRunner* expert_runner(int m) const {
    return ep_layers_.empty() ? nullptr : ep_layers_[static_cast<std::size_t>(m)].get();
  }
  // The expert region's gradients summed into each shard's owner (expert-data group).
  void reduce_experts(cudaStream_t stream) {
    if (!xnccl_) return;
    const std::int64_t lo = expert_plan_.bounds.front(), hi = expert_plan_.bounds.back();
    if (grads_bf16_) k::f32_to_bf16(grads_ + lo, grads_bf16_, hi - lo, stream);
    xnccl_->group_start();
    for (int r = 0; r < expert_plan_.ranks(); ++r)
      if (expert_plan_.count(r) > 0) reduce_to_owner(*xnccl_, lo, expert_plan_.begin(r), expert_plan_.count(r), r, stream);
    xnccl_->group_end();
    if (grads_bf16_ && expert_plan_.count(expert_data_rank_) > 0)
      widen_reduced(lo, expert_plan_.begin(expert_data_rank_), expert_plan_.count(expert_data_rank_), stream);
    reduces_in_flight_ = true;
  }
  // The sum of the gradients [begin, begin + n) to `owner`: in place in fp32, or (bf16 reduction)
  // in the scratch, whose element 0 is flat offset `scratch_at`.
  void reduce_to_owner(parallel::NcclGroup& g, std::int64_t scratch_at, std::int64_t begin, std::int64_t n, int owner,
                       cudaStream_t stream) {
    if (grads_bf16_)
      g.reduce_sum(grads_bf16_ + (begin - scratch_at), n, parallel::NcclType::kBfloat16, owner, stream);
    else
      g.reduce_sum(grads_ + begin, n, parallel::NcclType::kFloat32, owner, stream);
  }
  // The owner's reduced bf16 sums back into its fp32 gradients.
  void widen_reduced(std::int64_t scratch_at, std::int64_t begin, std::int64_t n, cudaStream_t stream) {
    k::bf16_to_f32(grads_bf16_ + (begin - scratch_at), grads_ + begin, n, stream);
  }
  // AdamW and Muon on this rank's expert shard (its moments follow the replicated shard's).
  void update_experts(double lr, k::GemmRunner& gemm, cudaStream_t stream) {
    const std::int64_t xb = slice_.expert_begin, xe = slice_.expert_end, sk = shard_.second - shard_.first;
    if (xe <= xb) return;
    k::adamw::DeviceFlatRange r;
    r.begin = xb;
    r.end = xe;
    r.param = params_ + xb;
    r.grad = grads_ + xb;
    r.m = adam_m_ + sk;
    r.v = adam_v_ + sk;
    r.param_bf16 = params_bf16_ + xb;
    adam_.step(layout_, r, lr, 1.0f, coef_, stream);  // skips Muon parameters
    muon_step_range(xb, xe, lr, gemm, stream);
  }
  // Every expert shard from its owner over the expert-data group, in runs as the buckets: the
  // bf16 copy of the experts' matrices, fp32 for anything else (receivers refresh its bf16 copy).
  void broadcast_experts(cudaStream_t stream) {
    if (!xnccl_) return;
    xnccl_->group_start();
    for (int r = 0; r < expert_plan_.ranks(); ++r)
      for (const auto& run : expert_pieces_[static_cast<std::size_t>(r)]) {
        if (run.bf16)
          xnccl_->broadcast(params_bf16_ + run.begin, run.end - run.begin, parallel::NcclType::kBfloat16, r, stream);
        else
          xnccl_->broadcast(params_ + run.begin, run.end - run.begin, parallel::NcclType::kFloat32, r, stream);
      }
    xnccl_->group_end();
    for (int r = 0; r < expert_plan_.ranks(); ++r)
      if (r != expert_data_rank_)
        for (const auto& run : expert_pieces_[static_cast<std::size_t>(r)])
          if (!run.bf16) k::f32_to_bf16(params_ + run.begin, params_bf16_ + run.begin, run.end - run.begin, stream);
  }

  // ---- overlapped ZeRO-1 (docs/parallel.md) ----
  //
  // Stages (model::param_stage(), parallel::overlap_stage_bounds()), in forward order: 0 the embedding, 1 + 2l
  // layer l's attention part, 2 + 2l its MLP part, 2 layers + 1 the rest (final norm, head).
  int stage_count() const { return model::stage_count(cfg_.layers); }
  int final_stage() const { return stage_count() - 1; }

  // The parameters the GEMMs and the embedding lookup read only through the bf16 copy: their
  // fp32 masters need not be broadcast. Everything else (norms, biases, scales, convs) travels
  // in fp32.
  std::vector<bool> bf16_only_params() const {
    std::vector<std::int64_t> offs = {embed_};
    for (const LayerWeights& W : layers_)
      for (std::int64_t o : {W.wq, W.wk, W.wv, W.wo, W.w_gate, W.w_up, W.w_down, W.router, W.cca_w_qk, W.cca_w_v,
                             W.cca_wo, W.zr_down_w, W.zr_w1, W.zr_w2, W.zr_out})
        if (o >= 0) offs.push_back(o);
    if (!cfg_.tied_embeddings && lm_head_ >= 0 && lm_head_ != embed_) offs.push_back(lm_head_);
    std::vector<bool> out(layout_.params.size(), false);
    for (std::size_t i = 0; i < layout_.params.size(); ++i)
      out[i] = std::find(offs.begin(), offs.end(), layout_.params[i].offset) != offs.end();
    return out;
  }

  struct BroadcastRun {
    std::int64_t begin = 0, end = 0;
    bool bf16 = false;  // the bf16 copy travels (GEMM-only matrices), else the fp32 masters
  };
  // The broadcast runs of [begin, end): the bf16 copy for GEMM-only matrices (when `bf16`), fp32
  // masters for the rest; padding between parameters rides with the run before it.
  std::vector<BroadcastRun> broadcast_runs(std::int64_t begin, std::int64_t end, bool bf16) {
    const std::vector<bool> bf16_only = bf16_only_params();
    std::vector<std::size_t> by_offset(layout_.params.size());
    for (std::size_t i = 0; i < by_offset.size(); ++i) by_offset[i] = i;
    std::sort(by_offset.begin(), by_offset.end(),
              [&](std::size_t a, std::size_t b) { return layout_.params[a].offset < layout_.params[b].offset; });
    std::vector<BroadcastRun> runs;
    for (std::size_t i : by_offset) {
      const auto& p = layout_.params[i];
      const std::int64_t lo = std::max(p.offset, begin), hi = std::min(p.offset + p.numel, end);
      if (lo >= hi) continue;
      const bool as_bf16 = bf16 && bf16_only[i];
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

  void setup_data_parallel() {
    dp_rank_ = mesh_.data().rank;
    dp_size_ = mesh_.data().size;
    const parallel::Zero1OverlapOptions& o = dp_options_.zero1;
    if (o.profile) prof_ = std::make_unique<Profile>();
    std::optional<std::vector<std::int64_t>> stages = parallel::overlap_stage_bounds(layout_, cfg_.layers, replicated_end_);
    overlap_ = o.enabled && stages.has_value();
    if (!overlap_) {
      if (o.enabled && dp_rank_ == 0)
        std::fprintf(stderr, "keel: data parallel: this layout's stages are not in offset order; the ZeRO-1 step "
                             "will not overlap communication\n");
      dp_ = parallel::make_nccl_data_parallel_comm(mesh_.nccl(parallel::GroupKind::kData), stream_, dp_options_.grad_reduce);
      return;
    }
    stage_bounds_ = std::move(*stages);
    // bf16 gradient reduction: a stage's gradients are rounded into a scratch as large as the
    // largest stage, reduced there and widened into the owner's fp32 shard, all on the
    // communication stream, so one scratch serves every stage in turn.
    if (dp_options_.grad_reduce == parallel::GradReduceDtype::kBf16)
      reduce_scratch_floats_ = std::max(reduce_scratch_floats_, parallel::largest_stage_floats(stage_bounds_));
    group_reduces_ = o.group_reduces;
    shard_masters_ = o.shard_masters;
    buckets_ = parallel::plan_zero1_buckets(parallel::region_layout(layout_, 0, replicated_end_), plan_, stage_bounds_,
                                            o.bucket_floats());
    const int S = stage_count();
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
    const std::int64_t table = std::int64_t(cfg_.vocab_size) * cfg_.hidden;
    const bool embed_alone = embed_ == 0 && stage_bounds_[1] >= table &&
                             stage_bounds_[1] <= (table + parallel::kZero1AlignFloats);
    defer_embed_ = embed_alone && (o.defer_embedding == 1 ||
                                   (o.defer_embedding < 0 && (dp_size_ - 1) * tokens() * cfg_.hidden < table));
    for (int i = stage_first_bucket_[0]; i < stage_first_bucket_[1]; ++i) {
      const int owner = buckets_[static_cast<std::size_t>(i)].owner;
      if (std::find(embed_owners_.begin(), embed_owners_.end(), owner) == embed_owners_.end())
        embed_owners_.push_back(owner);
    }
    own_embed_ = std::find(embed_owners_.begin(), embed_owners_.end(), dp_rank_) != embed_owners_.end();
    nccl_ = mesh_.nccl(parallel::GroupKind::kData);
    int least = 0, greatest = 0;
    KEEL_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    KEEL_CUDA_CHECK(cudaStreamCreateWithPriority(&comm_stream_, cudaStreamNonBlocking, greatest));
    KEEL_CUDA_CHECK(cudaEventCreateWithFlags(&ev_ready_, cudaEventDisableTiming));
    KEEL_CUDA_CHECK(cudaEventCreateWithFlags(&ev_comm_, cudaEventDisableTiming));
    ev_arrived_.assign(static_cast<std::size_t>(S), nullptr);
    for (auto& e : ev_arrived_) KEEL_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    if (o.optimizer_stream) {
      KEEL_CUDA_CHECK(cudaStreamCreateWithFlags(&opt_stream_, cudaStreamNonBlocking));
      for (cudaEvent_t* e : {&ev_opt_go_, &ev_opt_bucket_, &ev_opt_done_})
        KEEL_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
      // Muon's GEMMs there must not share the compute stream's cuBLASLt workspace
      if (k::muon::workspace_bytes(layout_) > 0) gemm_opt_ = std::make_unique<k::GemmRunner>();
    }
  }

  // The communication stream continues only after what the compute stream has enqueued so far.
  void signal_comm() const {
    KEEL_CUDA_CHECK(cudaEventRecord(ev_ready_, stream_));
    KEEL_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, ev_ready_, 0));
  }
  // The compute stream continues only after everything enqueued on the communication stream.
  void join_comm() const {
    if (!overlap_) return;
    KEEL_CUDA_CHECK(cudaEventRecord(ev_comm_, comm_stream_));
    KEEL_CUDA_CHECK(cudaStreamWaitEvent(stream_, ev_comm_, 0));
    if (opt_stream_) {
      KEEL_CUDA_CHECK(cudaEventRecord(ev_opt_done_, opt_stream_));
      KEEL_CUDA_CHECK(cudaStreamWaitEvent(stream_, ev_opt_done_, 0));
    }
    awaited_stage_ = INT_MAX;
    reduces_in_flight_ = false;
  }
  // The gradients' zeroing deferred by zero_grads(): after the optimizer stream is done with them.
  void flush_zero_grads() const {
    if (!zero_pending_) return;
    KEEL_CUDA_CHECK(cudaEventRecord(ev_opt_done_, opt_stream_));
    KEEL_CUDA_CHECK(cudaStreamWaitEvent(stream_, ev_opt_done_, 0));
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
    grad_overwrite_.clear();
    for (const auto& p : layout_.params)
      if (p.placement.splits(mesh::Axis::kExpert) || p.offset == lm_head_)
        grad_overwrite_.emplace_back(p.offset, p.offset + p.numel);
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
  // Before reading stage s's parameters in forward: wait for their broadcast (and the stages
  // before it: one stream, offset order).
  void await_stage(int s) {
    if (s <= awaited_stage_) return;
    KEEL_CUDA_CHECK(cudaStreamWaitEvent(stream_, ev_arrived_[static_cast<std::size_t>(s)], 0));
    awaited_stage_ = s;
  }

  void begin_step(int micro_batches) override { step_backwards_ = micro_batches; }

  // Whether this backward is the step's last on this rank, as begin_step() announced. Without
  // an announcement no backward launches reduces and the step reduces everything at the end.
  bool last_micro_batch() {
    if (reduces_launched_)
      fail("data parallel: backward() after the step's last micro-batch ({} announced by begin_step(); their "
           "gradients are already being reduced)",
           step_backwards_);
    ++backward_calls_;
    return step_backwards_ > 0 && backward_calls_ == step_backwards_;
  }

  // Stage s's gradients are final (on the last micro-batch): reduce its buckets to their owners
  // on the communication stream.
  void grads_ready(int s) {
    if (!launching_) return;
    signal_comm();
    if (prof_ && !prof_->reduce_seen) prof_->mark(Profile::kRed0, comm_stream_), prof_->reduce_seen = true;
    reduce_stage(s);
  }
  void reduce_stage(int s) {
    const int first = stage_first_bucket_[static_cast<std::size_t>(s)], end = stage_first_bucket_[static_cast<std::size_t>(s) + 1];
    if (first == end) return;
    const std::int64_t lo = buckets_[static_cast<std::size_t>(first)].begin;
    const std::int64_t hi = buckets_[static_cast<std::size_t>(end) - 1].end;
    if (grads_bf16_) k::f32_to_bf16(grads_ + lo, grads_bf16_, hi - lo, comm_stream_);
    const bool group = group_reduces_ && end - first > 1;
    if (group) nccl_->group_start();
    for (int i = first; i < end; ++i) {
      const auto& B = buckets_[static_cast<std::size_t>(i)];
      reduce_to_owner(*nccl_, lo, B.begin, B.end - B.begin, B.owner, comm_stream_);
    }
    if (group) nccl_->group_end();
    if (grads_bf16_)
      for (int i = first; i < end; ++i)
        if (const auto& B = buckets_[static_cast<std::size_t>(i)]; B.owner == dp_rank_)
          widen_reduced(lo, B.begin, B.end - B.begin, comm_stream_);
    reduces_in_flight_ = true;
  }

  // The last micro-batch's embedding scatter-add, deferred: every rank sends its token ids and
  // dL/d(embedding output) to the embedding's owners, which add all of them after the reduce of
  // the table (launched at the start of backward) has landed.
  void gather_embedding_gradients() {
    const std::int64_t N = tokens(), D = cfg_.hidden, V = cfg_.vocab_size;
    signal_comm();
    nccl_->group_start();
    for (int o : embed_owners_) {
      if (o == dp_rank_) continue;
      nccl_->send(tokens_, N, parallel::NcclType::kUint32, o, comm_stream_);
      nccl_->send(dres_, N * D, parallel::NcclType::kFloat32, o, comm_stream_);
    }
    if (own_embed_) {
      std::int64_t slot = 0;
      for (int r = 0; r < dp_size_; ++r) {
        if (r == dp_rank_) continue;
        nccl_->recv(gather_tokens_ + slot * N, N, parallel::NcclType::kUint32, r, comm_stream_);
        nccl_->recv(gather_dres_ + slot * N * D, N * D, parallel::NcclType::kFloat32, r, comm_stream_);
        ++slot;
      }
    }
    nccl_->group_end();
    reduces_in_flight_ = true;
    if (!own_embed_) return;
    join_comm();
    k::embedding::backward(tokens_, N, dres_, grads_ + embed_, V, D, stream_);
    for (std::int64_t slot = 0; slot + 1 < dp_size_; ++slot)
      k::embedding::backward(gather_tokens_ + slot * N, N, gather_dres_ + slot * N * D, grads_ + embed_, V, D, stream_);
  }

  // Broadcasts bucket i from its owner on the communication stream; receivers refresh the bf16
  // copy of what arrived in fp32.
  void broadcast_bucket(std::size_t i) {
    const auto& B = buckets_[i];
    nccl_->group_start();
    for (const auto& r : pieces_[i]) {
      if (r.bf16)
        nccl_->broadcast(params_bf16_ + r.begin, r.end - r.begin, parallel::NcclType::kBfloat16, B.owner, comm_stream_);
      else
        nccl_->broadcast(params_ + r.begin, r.end - r.begin, parallel::NcclType::kFloat32, B.owner, comm_stream_);
    }
    nccl_->group_end();
    if (buckets_[i].owner == dp_rank_) return;
    for (const auto& r : pieces_[i])
      if (!r.bf16) k::f32_to_bf16(params_ + r.begin, params_bf16_ + r.begin, r.end - r.begin, comm_stream_);
  }

  // The overlapped ZeRO-1 step. Backward has launched the reduces (or, when it could not tell
  // the last micro-batch, they launch here); the compute stream waits for them, then the global
  // norm (one scalar all-reduce, the one host sync); each owner updates its buckets in offset
  // order, each broadcast as soon as its update is done; the next forward waits per stage.
  StepResult overlapped_zero1_step(double max_norm, double lr) {
    const auto [b, e] = shard_;
    if (!reduces_launched_) {
      signal_comm();
      for (int s = stage_count() - 1; s >= 0; --s) reduce_stage(s);
      reduce_experts(comm_stream_);
    }
    reduces_launched_ = false;
    join_comm();
    if (prof_) prof_->mark(Profile::kJoined, stream_);
    k::grad_norm::sum_squares(grads_ + b, e - b, norm_ws_, sum_sq_, /*accumulate=*/false, stream_);
    if (slice_.expert_end > slice_.expert_begin)  // each expert element is in one rank's shard: one sum over all ranks
      k::grad_norm::sum_squares(grads_ + slice_.expert_begin, slice_.expert_end - slice_.expert_begin, norm_ws_,
                                sum_sq_, /*accumulate=*/true, stream_);
    signal_comm();
    nccl_->all_reduce_sum(sum_sq_, 1, parallel::NcclType::kFloat64, comm_stream_);
    join_comm();
    k::grad_norm::clip_coefficient(sum_sq_, max_norm, coef_, norm_, stream_);
    if (prof_) prof_->mark(Profile::kNormed, stream_);
    const auto [norm, coef] = read_norm();
    // The shard's update runs on the optimizer stream (beside the next forward) or, without one,
    // on the compute stream; each own bucket's broadcast waits for its update.
    cudaStream_t os = opt_stream_ ? opt_stream_ : stream_;
    k::GemmRunner& og = gemm_opt_ ? *gemm_opt_ : *gemm_;
    cudaEvent_t ev_bucket = opt_stream_ ? ev_opt_bucket_ : ev_ready_;
    if (opt_stream_) {
      KEEL_CUDA_CHECK(cudaEventRecord(ev_opt_go_, stream_));  // the clip coefficient
      KEEL_CUDA_CHECK(cudaStreamWaitEvent(opt_stream_, ev_opt_go_, 0));
    }
    // AdamW counts one step per call: every bucket's call runs at the same step t0 + 1.
    const std::int64_t t0 = adam_.step_count();
    if (prof_) prof_->mark(Profile::kBc0, comm_stream_);
    for (int s = 0; s < stage_count(); ++s) {
      if (s == expert_stage_) {  // the expert region, before the first MoE layer's stage arrives
        adam_.set_step_count(t0);
        update_experts(lr, og, os);
        KEEL_CUDA_CHECK(cudaEventRecord(ev_bucket, os));
        KEEL_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, ev_bucket, 0));
        broadcast_experts(comm_stream_);
      }
      for (int i = stage_first_bucket_[static_cast<std::size_t>(s)]; i < stage_first_bucket_[static_cast<std::size_t>(s) + 1]; ++i) {
        const auto& B = buckets_[static_cast<std::size_t>(i)];
        if (B.owner == dp_rank_) {
          adam_.set_step_count(t0);
          k::adamw::DeviceFlatRange r;
          r.begin = B.begin;
          r.end = B.end;
          r.param = params_ + B.begin;
          r.grad = grads_ + B.begin;
          r.m = adam_m_ + (B.begin - b);
          r.v = adam_v_ + (B.begin - b);
          r.param_bf16 = params_bf16_ + B.begin;
          adam_.step(layout_, r, lr, 1.0f, coef_, os);  // skips Muon parameters
          muon_step_range(B.begin, B.end, lr, og, os);
          KEEL_CUDA_CHECK(cudaEventRecord(ev_bucket, os));  // the owner's broadcast reads the update
          KEEL_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, ev_bucket, 0));
        }
        broadcast_bucket(static_cast<std::size_t>(i));
      }
      KEEL_CUDA_CHECK(cudaEventRecord(ev_arrived_[static_cast<std::size_t>(s)], comm_stream_));
    }
    adam_.set_step_count(t0 + 1);
    if (prof_) prof_->mark(Profile::kBcEnd, comm_stream_), prof_->mark(Profile::kOptEnd, os);
    awaited_stage_ = -1;
    return {norm, static_cast<double>(coef)};
  }

  std::int64_t tokens() const { return static_cast<std::int64_t>(opt_.micro_batch) * opt_.seq_length; }
  float eps() const { return static_cast<float>(cfg_.norm_eps); }
  k::cross_entropy::Options ce_options() const {
    k::cross_entropy::Options o;
    o.chunk = std::min<std::int64_t>(opt_.ce_chunk, cfg_.vocab_size);
    o.keep_logits = ce_keep_logits_;
    return o;
  }
  LayerActs& acts_for(int l) { return acts_[opt_.recompute == Recompute::kFull ? 0 : static_cast<std::size_t>(l)]; }

  void map_weights() {
    layers_.assign(static_cast<std::size_t>(cfg_.layers), LayerWeights{});
    for (const auto& p : layout_.params) {
      if (p.name == "embed.weight") { embed_ = p.offset; continue; }
      if (p.name == "final_norm.weight") { final_norm_ = p.offset; continue; }
      if (p.name == "lm_head.weight") { lm_head_ = p.offset; continue; }
      if (p.name.starts_with("final_res_scale.")) {
        if (!set_res_scale(final_scale_, p.name.substr(16), p.offset)) fail("cuda backend: unmapped parameter '{}'", p.name);
        continue;
      }
      const auto dot = p.name.find('.', 7);
      const int l = std::stoi(p.name.substr(7, dot - 7));
      const std::string rest = p.name.substr(dot + 1);
      LayerWeights& w = layers_[static_cast<std::size_t>(l)];
      if (rest == "attn_norm.weight") w.attn_norm = p.offset;
      else if (rest == "attn.wq") w.wq = p.offset;
      else if (rest == "attn.wk") w.wk = p.offset;
      else if (rest == "attn.wv") w.wv = p.offset;
      else if (rest == "attn.wo") w.wo = p.offset;
      else if (rest == "mlp_norm.weight") w.mlp_norm = p.offset;
      else if (rest == "moe.router") w.router = p.offset, w.moe = true;
      else if (rest == "moe.w_gate" || rest == "mlp.w_gate") w.w_gate = p.offset;
      else if (rest == "moe.w_up" || rest == "mlp.w_up") w.w_up = p.offset;
      else if (rest == "moe.w_down" || rest == "mlp.w_down") w.w_down = p.offset;
      else if (rest == "attn.cca.w_qk") w.cca_w_qk = p.offset, w.cca = true;
      else if (rest == "attn.cca.w_v") w.cca_w_v = p.offset;
      else if (rest == "attn.cca.conv0.weight") w.conv0_w = p.offset;
      else if (rest == "attn.cca.conv0.bias") w.conv0_b = p.offset;
      else if (rest == "attn.cca.conv1.weight") w.conv1_w = p.offset;
      else if (rest == "attn.cca.conv1.bias") w.conv1_b = p.offset;
      else if (rest == "attn.cca.temp") w.cca_temp = p.offset;
      else if (rest == "attn.cca.wo") w.cca_wo = p.offset;
      else if (rest == "moe.router.down.weight") w.zr_down_w = p.offset, w.moe = true;
      else if (rest == "moe.router.down.bias") w.zr_down_b = p.offset;
      else if (rest == "moe.router.eda_scale") w.zr_eda = p.offset;
      else if (rest == "moe.router.norm.weight") w.zr_norm = p.offset;
      else if (rest == "moe.router.mlp1.weight") w.zr_w1 = p.offset;
      else if (rest == "moe.router.mlp1.bias") w.zr_b1 = p.offset;
      else if (rest == "moe.router.mlp2.weight") w.zr_w2 = p.offset;
      else if (rest == "moe.router.mlp2.bias") w.zr_b2 = p.offset;
      else if (rest == "moe.router.out.weight") w.zr_out = p.offset;
      else if (rest.starts_with("res_scale.attn.") && set_res_scale(w.attn_scale, rest.substr(15), p.offset)) {
      } else if (rest.starts_with("res_scale.mlp.") && set_res_scale(w.mlp_scale, rest.substr(14), p.offset)) {
      } else fail("cuda backend: unmapped parameter '{}'", p.name);
    }
    if (cfg_.tied_embeddings) lm_head_ = embed_;
  }

  static bool set_res_scale(ResScaleOffsets& r, const std::string& what, std::int64_t offset) {
    if (what == "h_scale") r.h_scale = offset;
    else if (what == "h_bias") r.h_bias = offset;
    else if (what == "r_scale") r.r_scale = offset;
    else if (what == "r_bias") r.r_bias = offset;
    else return false;
    return true;
  }

  cuda_zaya::Weights zaya_weights(const LayerWeights& W) const {
    const bf16* w16 = params_bf16_;
    cuda_zaya::Weights z;
    z.router.w_down = w16 + W.zr_down_w;
    z.router.b_down = params_ + W.zr_down_b;
    z.router.gamma = W.zr_eda >= 0 ? params_ + W.zr_eda : nullptr;
    z.router.w_norm = params_ + W.zr_norm;
    z.router.w1 = w16 + W.zr_w1;
    z.router.b1 = params_ + W.zr_b1;
    z.router.w2 = w16 + W.zr_w2;
    z.router.b2 = params_ + W.zr_b2;
    z.router.w3 = w16 + W.zr_out;
    z.experts = {w16 + W.w_gate, w16 + W.w_up, w16 + W.w_down};
    return z;
  }

  cuda_zaya::Grads zaya_grads(const LayerWeights& W) const {
    float* G = grads_;
    cuda_zaya::Grads g;
    g.router.w_down = G + W.zr_down_w;
    g.router.b_down = G + W.zr_down_b;
    g.router.gamma = W.zr_eda >= 0 ? G + W.zr_eda : nullptr;
    g.router.w_norm = G + W.zr_norm;
    g.router.w1 = G + W.zr_w1;
    g.router.b1 = G + W.zr_b1;
    g.router.w2 = G + W.zr_w2;
    g.router.b2 = G + W.zr_b2;
    g.router.w3 = G + W.zr_out;
    g.experts = {G + W.w_gate, G + W.w_up, G + W.w_down, /*overwrite=*/grads_fresh_};
    return g;
  }

  k::cca::Weights cca_weights(const LayerWeights& W) const {
    const bf16* w16 = params_bf16_;
    return {w16 + W.cca_w_qk, w16 + W.cca_w_v, params_ + W.conv0_w, params_ + W.conv0_b,
            params_ + W.conv1_w, params_ + W.conv1_b, params_ + W.cca_temp, w16 + W.cca_wo};
  }

  k::cca::Grads cca_grads(const LayerWeights& W) const {
    float* G = grads_;
    return {G + W.cca_w_qk, G + W.cca_w_v, G + W.conv0_w, G + W.conv0_b, G + W.conv1_w, G + W.conv1_b,
            G + W.cca_temp, G + W.cca_wo};
  }

  // Carves every activation and workspace out of act_arena_ (sizing pass when unallocated).
  void plan_acts() {
    const std::int64_t B = opt_.micro_batch, T = opt_.seq_length, N = B * T, D = cfg_.hidden;
    const std::int64_t Hq = cfg_.heads, Hkv = cfg_.kv_heads, Dh = cfg_.head_dim, Q = Hq * Dh, KV = Hkv * Dh;
    const std::int64_t E = std::max(cfg_.experts, 1), K = std::max(cfg_.top_k, 1), FE = std::max(cfg_.expert_hidden, 1);
    const std::int64_t FD = std::max(cfg_.ffn_hidden, 1), S = N * K, R = std::max(cfg_.router_hidden, 1);
    const bool any_moe = !moe_layer_ids_.empty(), any_dense = moe_layer_ids_.size() < std::size_t(cfg_.layers);
    const bool zaya_moe = any_moe && mlp_router_;
    const bool ep = slice_.expert_parallel > 1;
    DeviceArena& A = act_arena_;
    resid_.clear();
    for (int l = 0; l <= cfg_.layers; ++l) resid_.push_back(A.take<float>(N * D));
    // residual scaling: hres_[l] is the mixer output entering layer l (none for layer 0)
    hres_.assign(static_cast<std::size_t>(cfg_.layers + 1), nullptr);
    if (scaled_)
      for (int l = 1; l <= cfg_.layers; ++l) hres_[l] = A.take<float>(N * D);
    // The MLP router's EDA state of each MoE stage: read by the next stage in forward and in
    // backward, so it lives outside the (possibly shared) layer sets.
    eda_state_.assign(zaya_moe ? moe_layer_ids_.size() : 0, nullptr);
    for (auto& e : eda_state_) e = A.take<float>(N * R);
    spare_resid_ = opt_.recompute == Recompute::kFull ? A.take<float>(N * D) : nullptr;
    const int sets = opt_.recompute == Recompute::kFull ? 1 : cfg_.layers;
    acts_.assign(static_cast<std::size_t>(sets), LayerActs{});
    const k::zaya_router::Dims zdims = zshape_.router_dims();
    for (int i = 0; i < sets; ++i) {
      LayerActs& a = acts_[static_cast<std::size_t>(i)];
      const bool moe = sets == 1 ? any_moe : moe_index_of_layer_[i] >= 0;
      const bool dense = sets == 1 ? any_dense : !moe;
      const bool cca = sets == 1 ? any_cca_ : layers_[static_cast<std::size_t>(i)].cca;
      const bool softmax = sets == 1 ? any_softmax_ : !cca;
      a.h1 = A.take<bf16>(N * D);
      a.rstd1 = A.take<float>(N);
      if (softmax) {
        a.q = A.take<bf16>(N * Q);
        a.k = A.take<bf16>(N * KV);
        a.v = A.take<bf16>(N * KV);
        a.att = A.take<bf16>(N * Q);
        a.lse = A.take<float>(B * Hq * T);
      }
      if (cca) {
        std::byte* buf = A.take<std::byte>(k::cca::saved_bytes(cca_cfg_, B, T));
        if (buf) a.cca = k::cca::carve_saved(cca_cfg_, B, T, buf);
      }
      if (cca || scaled_) a.attn_out = A.take<bf16>(N * D);
      a.x_mid = A.take<float>(N * D);
      a.h2 = A.take<bf16>(N * D);
      a.rstd2 = A.take<float>(N);
      if (dense) {
        a.g = A.take<bf16>(N * FD);
        a.u = A.take<bf16>(N * FD);
        a.a = A.take<bf16>(N * FD);
      }
      if (moe && mlp_router_) {
        // the router's `state` region goes unused: forward points it at eda_state_
        std::byte* buf = A.take<std::byte>(k::zaya_router::saved_bytes(zdims));
        if (buf) a.zmoe.router = k::zaya_router::carve_saved(zdims, buf);
        a.zmoe.kept = A.take<std::int32_t>(N);
        a.zmoe.kept_idx = A.take<std::int32_t>(N);
        a.zmoe.pos = A.take<std::int32_t>(N);
        a.zmoe.count = A.take<std::int32_t>(1);
        a.zmoe.plan_ws = A.take<std::int32_t>(k::moe::plan_ints(N, static_cast<int>(E)));
      }
      if (moe && !mlp_router_) {
        a.rlogits = A.take<float>(N * E);
        a.probs = A.take<float>(N * E);
        a.rlse = A.take<float>(N);
        a.gates = A.take<float>(N * K);
        a.losses = A.take<float>(k::router::loss_floats(E));
        a.idx = A.take<std::int32_t>(S);
        a.counts = A.take<std::int32_t>(E);
        a.plan_ws = A.take<std::int32_t>(k::moe::plan_ints(S, static_cast<int>(E)));
      }
      if (moe) {
        a.saved.xs = A.take<bf16>(S * D);
        if (!ep) {  // with expert parallelism the experts' rows live at their rank (expert_parallel_cuda.h)
          a.saved.h_gate = A.take<bf16>(S * FE);
          a.saved.h_up = A.take<bf16>(S * FE);
          a.saved.act = A.take<bf16>(S * FE);
        }
        a.saved.ys = A.take<bf16>(S * D);
        a.zmoe.experts = a.saved;
      }
    }
    saved_act_bytes_ = A.used();
    // shared backward scratch
    dres_ = A.take<float>(N * D);
    dres_bf_ = A.take<bf16>(N * D);
    dh_f32_ = A.take<float>(N * D);
    dh_bf_ = A.take<bf16>(N * D);
    moe_y_ = any_moe && !scaled_ ? A.take<float>(N * D) : nullptr;
    if (any_softmax_) {
      datt_ = A.take<bf16>(N * Q);
      dq_ = A.take<bf16>(N * Q);
      dk_ = A.take<bf16>(N * KV);
      dv_ = A.take<bf16>(N * KV);
    }
    if (any_dense) {
      dg_ = A.take<bf16>(N * FD);
      du_ = A.take<bf16>(N * FD);
      da_ = A.take<bf16>(N * FD);
    }
    if (any_moe && !mlp_router_) {
      dgates_ = A.take<float>(N * K);
      dlogits_ = A.take<float>(N * E);
      dlogits_bf_ = A.take<bf16>(N * E);
    }
    if (any_moe && !ep)
      moe_scratch_ = A.take<std::byte>(static_cast<std::size_t>(k::moe::backward_scratch_bytes(S, D, FE)));
    if (zaya_moe) {
      zs_.xk = A.take<bf16>(N * D);
      zs_.dxk = A.take<bf16>(N * D);
      zs_.yk = A.take<float>(N * D);
      zs_.dyk = A.take<float>(N * D);
      zs_.gk = A.take<float>(N);
      zs_.dgk = A.take<float>(N);
      zs_.dgates = A.take<float>(N);
      zs_.router = A.take<std::byte>(k::zaya_router::backward_scratch_bytes(zdims));
      zs_.experts = moe_scratch_;
      deda_[0] = A.take<float>(N * R);
      deda_[1] = A.take<float>(N * R);
    }
    if (any_softmax_)
      attn_ws_ = A.take<std::byte>(k::attention::backward_workspace_bytes(static_cast<int>(B), static_cast<int>(T),
                                                                            static_cast<int>(Hq), static_cast<int>(Hkv),
                                                                            static_cast<int>(Dh)));
    if (any_cca_) cca_scratch_ = A.take<std::byte>(k::cca::backward_scratch_bytes(cca_cfg_, B, T));
    if (scaled_) {
      dhres_ = A.take<float>(N * D);
      final_r_ = A.take<float>(N * D);
    }
    final_h_ = A.take<bf16>(N * D);
    final_rstd_ = A.take<float>(N);
    ce_lse_ = A.take<float>(N);
    ce_result_ = A.take<k::cross_entropy::Result>(1);
    const std::size_t before_ce = A.used();
    ce_scratch_ = A.take<std::byte>(
        static_cast<std::size_t>(k::cross_entropy::scratch_bytes(N, D, cfg_.vocab_size, ce_options())));
    ce_scratch_bytes_ = A.used() - before_ce;
    tokens_ = A.take<std::uint32_t>(N);
    targets_ = A.take<std::int32_t>(N);
    if (overlap_ && defer_embed_ && own_embed_) {
      gather_tokens_ = A.take<std::uint32_t>((dp_size_ - 1) * N);
      gather_dres_ = A.take<float>((dp_size_ - 1) * N * D);
    }
    positions_ = A.take<std::int32_t>(N);
    norm_ws_ = A.take<double>(k::grad_norm::kWorkspaceDoubles);
    sum_sq_ = A.take<double>(1);
    norm_ = A.take<double>(1);
    coef_ = A.take<float>(1);
    layer_counts_.assign(moe_layer_ids_.size(), std::vector<std::int32_t>(static_cast<std::size_t>(classes_), 0));
    host_losses_.assign(moe_layer_ids_.size(), k::router::Losses{});
  }

  void upload_params(const std::vector<float>& host) {
    const std::size_t n = static_cast<std::size_t>(layout_.total_floats);
    if (masters_->whole()) {
      KEEL_CUDA_CHECK(cudaMemcpyAsync(params_, host.data(), n * sizeof(float), cudaMemcpyHostToDevice, stream_));
      k::f32_to_bf16(params_, params_bf16_, static_cast<std::int64_t>(n), stream_);
    } else {
      // Through a staging buffer in pieces: every element's bf16 copy, the fp32 masters only
      // where this rank keeps them.
      float* stage = static_cast<float*>(staging_.ensure(kStagingFloats * sizeof(float), stream_, "staging"));
      for (std::size_t b = 0; b < n; b += kStagingFloats) {
        const std::size_t e = std::min(n, b + kStagingFloats);
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

  // The fp32 masters this rank keeps. Under the overlapped ZeRO-1 step with bf16 broadcasts:
  // its own shards (of the replicated region, and of the expert region over the expert-data
  // group) and what travels in fp32 (norms, biases, scales, convs: every forward reads those in
  // fp32); the GEMM matrices and the embedding are read through the bf16 copy only, so other
  // ranks' masters of those are never needed. Otherwise all of them (the classic step
  // all-gathers them in fp32). parallel.zero1.shard_masters: false keeps all of them anyway.
  std::vector<ByteRange> master_ranges(std::size_t n_comm) const {
    const std::size_t f = sizeof(float);
    if (!overlap_ || !any_bf16_broadcast_ || !shard_masters_) return {{0, n_comm * f}};
    auto bytes = [f](std::int64_t b, std::int64_t e) {
      return ByteRange{static_cast<std::size_t>(b) * f, static_cast<std::size_t>(e) * f};
    };
    std::vector<ByteRange> r = {bytes(shard_.first, shard_.second)};
    if (xnccl_) r.push_back(bytes(slice_.expert_begin, slice_.expert_end));
    else r.push_back(bytes(replicated_end_, static_cast<std::int64_t>(n_comm)));  // every expert of this rank is its own
    for (const auto* pieces : {&pieces_, &expert_pieces_})
      for (const auto& runs : *pieces)
        for (const auto& p : runs)
          if (!p.bf16) r.push_back(bytes(p.begin, p.end));
    return r;
  }

  // state() when this rank keeps only some fp32 masters: each owner broadcasts its shards piece
  // by piece through the staging buffer and every rank copies them out. A collective over the
  // data-parallel group (and the expert-data group).
  void copy_masters_to_host(float* host) const {
    signal_comm();
    copy_shards_to_host(*nccl_, plan_, dp_rank_, host);
    if (xnccl_) {
      copy_shards_to_host(*xnccl_, expert_plan_, expert_data_rank_, host);
    } else if (layout_.total_floats > replicated_end_) {  // every expert of this rank is its own
      KEEL_CUDA_CHECK(cudaMemcpyAsync(host + replicated_end_, params_ + replicated_end_,
                                      static_cast<std::size_t>(layout_.total_floats - replicated_end_) * sizeof(float),
                                      cudaMemcpyDeviceToHost, comm_stream_));
      KEEL_CUDA_CHECK(keel::stream_sync(comm_stream_));
    }
  }
  void copy_shards_to_host(parallel::NcclGroup& group, const parallel::Zero1Plan& plan, int me, float* host) const {
    const std::int64_t n = layout_.total_floats;
    float* stage = static_cast<float*>(staging_.ensure(kStagingFloats * sizeof(float), comm_stream_, "staging"));
    for (int r = 0; r < plan.ranks(); ++r)
      for (std::int64_t b = plan.begin(r), end = std::min(n, plan.begin(r) + plan.count(r)); b < end;
           b += static_cast<std::int64_t>(kStagingFloats)) {
        const std::int64_t count = std::min<std::int64_t>(end - b, static_cast<std::int64_t>(kStagingFloats));
        float* from = r == me ? params_ + b : stage;  // the owner sends, the others receive
        group.broadcast(from, count, parallel::NcclType::kFloat32, r, comm_stream_);
        KEEL_CUDA_CHECK(cudaMemcpyAsync(host + b, from, static_cast<std::size_t>(count) * sizeof(float),
                                        cudaMemcpyDeviceToHost, comm_stream_));
        KEEL_CUDA_CHECK(keel::stream_sync(comm_stream_));  // the next piece overwrites the staging buffer
      }
  }

  void upload_bias() {
    std::vector<float> flat;
    for (const auto& b : bias_) flat.insert(flat.end(), b.begin(), b.end());
    if (!flat.empty())
      KEEL_CUDA_CHECK(cudaMemcpyAsync(bias_dev_, flat.data(), flat.size() * sizeof(float), cudaMemcpyHostToDevice,
                                      stream_));
    KEEL_CUDA_CHECK(keel::stream_sync(stream_));  // `flat` dies here
  }

  // C[m, n] (+)= A[m, k] B[n, k]^T or the other GEMMs of a linear layer, through the seam.
  void gemm(std::int64_t m, std::int64_t n, std::int64_t kk, bool ta, bool tb, const bf16* a, const bf16* b, void* c,
            bool f32_out, float beta) {
    k::GemmDesc d;
    d.m = m, d.n = n, d.k = kk, d.trans_a = ta, d.trans_b = tb;
    d.c_type = f32_out ? k::GemmOut::kFp32 : k::GemmOut::kBf16;
    d.beta = beta;
    gemm_->run(d, a, b, c, stream_);
  }

  // q, k, v projections, RoPE and flash attention of a mha/gqa layer: a.h1 -> a.att.
  void softmax_attend(int l, LayerActs& a) {
    const LayerWeights& W = layers_[static_cast<std::size_t>(l)];
    const std::int64_t B = opt_.micro_batch, T = opt_.seq_length, N = B * T, D = cfg_.hidden;
    const std::int64_t Hq = cfg_.heads, Hkv = cfg_.kv_heads, Dh = cfg_.head_dim, Q = Hq * Dh, KV = Hkv * Dh;
    const bf16* w16 = params_bf16_;
    k::linear::forward(*gemm_, a.h1, w16 + W.wq, a.q, N, D, Q, stream_);
    k::linear::forward(*gemm_, a.h1, w16 + W.wk, a.k, N, D, KV, stream_);
    k::linear::forward(*gemm_, a.h1, w16 + W.wv, a.v, N, D, KV, stream_);
    k::rope::forward(rope_->view(), a.q, positions_, N, Hq, stream_);
    k::rope::forward(rope_->view(), a.k, positions_, N, Hkv, stream_);
    const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
    k::attention::forward(a.q, a.k, a.v, a.att, a.lse, static_cast<int>(B), static_cast<int>(T), static_cast<int>(Hq),
                          static_cast<int>(Hkv), static_cast<int>(Dh), scale, stream_);
  }

  // The attention block's output into a.attn_out (bf16): CCA, or mha/gqa with the output GEMM.
  void attn_forward_to_out(int l, LayerActs& a) {
    const LayerWeights& W = layers_[static_cast<std::size_t>(l)];
    const std::int64_t N = tokens(), D = cfg_.hidden, Q = std::int64_t(cfg_.heads) * cfg_.head_dim;
    if (W.cca) {
      k::cca::forward(*gemm_, cca_cfg_, opt_.micro_batch, opt_.seq_length, a.h1, positions_, rope_->view(),
                      cca_weights(W), a.cca, a.attn_out, stream_);
      return;
    }
    softmax_attend(l, a);
    k::linear::forward(*gemm_, a.att, params_bf16_ + W.wo, a.attn_out, N, Q, D, stream_);
  }

  // A routed MLP block (linear top-k router or ZAYA1's MLP router): y = mlp(a.h2), fp32 [N, D]
  // overwritten. Records the layer's loads when count_load.
  void moe_forward(int l, LayerActs& a, bool count_load, float* y) {
    const LayerWeights& W = layers_[static_cast<std::size_t>(l)];
    const std::int64_t N = tokens(), D = cfg_.hidden;
    const bf16* w16 = params_bf16_;
    const int m = moe_index_of_layer_[l];
    const int E = cfg_.experts;
    const std::int64_t F = cfg_.expert_hidden;
    auto& counts = layer_counts_[static_cast<std::size_t>(m)];
    if (mlp_router_) {
      a.zmoe.router.state = eda_state_[static_cast<std::size_t>(m)];
      const float* prev = m > 0 ? eda_state_[static_cast<std::size_t>(m - 1)] : nullptr;
      cuda_zaya::moe_forward(*gemm_, zshape_, zaya_weights(W), a.h2, prev, bias_dev_ + std::int64_t(m) * classes_,
                             a.zmoe, zs_, y, stream_, expert_runner(m));
      if (count_load) {
        for (int e = 0; e < E; ++e) counts[e] = a.zmoe.nk > 0 ? static_cast<std::int32_t>(a.zmoe.plan.count(e)) : 0;
        if (zshape_.skip) counts[E] = static_cast<std::int32_t>(N - a.zmoe.nk);
      }
      return;
    }
    k::linear::forward_f32(*gemm_, a.h2, w16 + W.router, a.rlogits, N, D, E, stream_);
    k::router::Options ro{cfg_.top_k, opt_.renormalize_gates};
    k::router::forward(a.rlogits, bias_dev_ + static_cast<std::int64_t>(m) * E, N, E, ro, a.probs, a.rlse, a.idx,
                       a.gates, a.counts, a.losses, stream_);
    a.plan = k::moe::make_plan(a.idx, N, cfg_.top_k, E, a.plan_ws, stream_);  // syncs: host expert offsets
    if (count_load) {
      for (int e = 0; e < E; ++e) counts[e] = static_cast<std::int32_t>(a.plan.count(e));
      if (opt_.recompute == Recompute::kFull) host_losses_[static_cast<std::size_t>(m)] = k::router::read_losses(a.losses, stream_);
    }
    k::moe::Weights mw{w16 + W.w_gate, w16 + W.w_up, w16 + W.w_down};
    if (k::moe::ExpertRunner* ep = expert_runner(m)) ep->forward(a.plan, a.h2, a.gates, mw, D, F, a.saved, y, stream_);
    else k::moe::forward(a.plan, a.h2, a.gates, mw, D, F, a.saved, y, stream_);
  }

  // Plain pre-norm layer: x_mid = x_in + attn(n1(x_in)); x_out = x_mid + mlp(n2(x_mid)).
  void layer_forward(int l, LayerActs& a, const float* x_in, float* x_out, bool count_load) {
    const LayerWeights& W = layers_[static_cast<std::size_t>(l)];
    const std::int64_t B = opt_.micro_batch, T = opt_.seq_length, N = B * T, D = cfg_.hidden;
    const std::int64_t Hq = cfg_.heads, Dh = cfg_.head_dim, Q = Hq * Dh;
    const bf16* w16 = params_bf16_;
    await_stage(1 + 2 * l);
    k::rmsnorm::forward(x_in, params_ + W.attn_norm, eps(), a.h1, a.rstd1, N, D, stream_);
    KEEL_CUDA_CHECK(cudaMemcpyAsync(a.x_mid, x_in, N * D * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    if (W.cca) {
      attn_forward_to_out(l, a);
      k::add_bf16_to_f32(a.attn_out, a.x_mid, N * D, stream_);
    } else {
      softmax_attend(l, a);
      // x_mid = x_in + att Wo^T: the residual add rides in the GEMM (fp32 C, beta = 1)
      gemm(N, D, Q, false, true, a.att, w16 + W.wo, a.x_mid, true, 1.f);
    }
    await_stage(2 + 2 * l);
    k::rmsnorm::forward(a.x_mid, params_ + W.mlp_norm, eps(), a.h2, a.rstd2, N, D, stream_);
    const int m = moe_index_of_layer_[l];
    if (m < 0) {
      const std::int64_t F = cfg_.ffn_hidden;
      k::linear::forward(*gemm_, a.h2, w16 + W.w_gate, a.g, N, D, F, stream_);
      k::linear::forward(*gemm_, a.h2, w16 + W.w_up, a.u, N, D, F, stream_);
      k::swiglu::forward(a.g, a.u, a.a, N * F, stream_);
      KEEL_CUDA_CHECK(cudaMemcpyAsync(x_out, a.x_mid, N * D * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
      gemm(N, D, F, false, true, a.a, w16 + W.w_down, x_out, true, 1.f);
      return;
    }
    moe_forward(l, a, count_load, moe_y_);
    cuda::add_f32(a.x_mid, moe_y_, x_out, N * D, stream_);
  }

  // ZAYA1 residual scaling (MoeTransformer::scaled_layer_forward): layer l takes (resid_[l],
  // hres_[l]) (layer 0: the embedding only) and gives
  //   r1 = merge_attn(r, h) (layer 0: (emb + b_h) * s_h) -> a.x_mid;  ya = attn(n1(r1)) -> a.attn_out
  //   r2 = merge_mlp(r1, ya) -> r_out;  ym = mlp(n2(r2)) -> h_out (fp32)
  void scaled_layer_forward(int l, LayerActs& a, float* r_out, float* h_out, bool count_load) {
    const LayerWeights& W = layers_[static_cast<std::size_t>(l)];
    const std::int64_t N = tokens(), D = cfg_.hidden;
    const ResScaleOffsets &A = W.attn_scale, &M = W.mlp_scale;
    const float* P = params_;
    await_stage(1 + 2 * l);
    if (l == 0)
      k::residual_scale::forward(resid_[0], P + A.h_bias, P + A.h_scale, a.x_mid, N, D, stream_);
    else
      k::residual_scale::merge_forward(resid_[l], hres_[l], P + A.r_bias, P + A.r_scale, P + A.h_bias, P + A.h_scale,
                                       a.x_mid, N, D, stream_);
    k::rmsnorm::forward(a.x_mid, P + W.attn_norm, eps(), a.h1, a.rstd1, N, D, stream_);
    attn_forward_to_out(l, a);
    await_stage(2 + 2 * l);
    k::residual_scale::merge_forward(a.x_mid, a.attn_out, P + M.r_bias, P + M.r_scale, P + M.h_bias, P + M.h_scale,
                                     r_out, N, D, stream_);
    k::rmsnorm::forward(r_out, P + W.mlp_norm, eps(), a.h2, a.rstd2, N, D, stream_);
    if (moe_index_of_layer_[l] >= 0) {
      moe_forward(l, a, count_load, h_out);
      return;
    }
    const std::int64_t F = cfg_.ffn_hidden;
    const bf16* w16 = params_bf16_;
    k::linear::forward(*gemm_, a.h2, w16 + W.w_gate, a.g, N, D, F, stream_);
    k::linear::forward(*gemm_, a.h2, w16 + W.w_up, a.u, N, D, F, stream_);
    k::swiglu::forward(a.g, a.u, a.a, N * F, stream_);
    gemm(N, D, F, false, true, a.a, w16 + W.w_down, h_out, true, 0.f);
  }

  // MLP block backward: dy [N, D] fp32 = dL/d(block output) -> dh_f32_ = dL/d a.h2 (overwritten).
  // Uses dres_bf_ and dh_bf_ as scratch.
  void mlp_backward(int l, LayerActs& a, const float* dy) {
    const LayerWeights& W = layers_[static_cast<std::size_t>(l)];
    const std::int64_t N = tokens(), D = cfg_.hidden;
    const bf16* w16 = params_bf16_;
    float* G = grads_;
    const int m = moe_index_of_layer_[l];
    if (m < 0) {
      const std::int64_t F = cfg_.ffn_hidden;
      k::f32_to_bf16(dy, dres_bf_, N * D, stream_);
      k::linear::backward(*gemm_, a.a, w16 + W.w_down, dres_bf_, da_, G + W.w_down, N, F, D, stream_);
      k::swiglu::backward(a.g, a.u, da_, dg_, du_, N * F, stream_);
      k::linear::backward(*gemm_, a.h2, w16 + W.w_gate, dg_, nullptr, G + W.w_gate, N, D, F, stream_);
      k::linear::backward(*gemm_, a.h2, w16 + W.w_up, du_, nullptr, G + W.w_up, N, D, F, stream_);
      gemm(N, D, F, false, false, dg_, w16 + W.w_gate, dh_f32_, true, 0.f);
      gemm(N, D, F, false, false, du_, w16 + W.w_up, dh_f32_, true, 1.f);
      return;
    }
    if (mlp_router_) {
      // EDA chain: stage m + 1 left dL/d state_m in deda_[(m + 1) % 2]; this stage writes
      // dL/d state_{m-1} into the other buffer.
      const int nmoe = static_cast<int>(moe_layer_ids_.size());
      const float* prev = m > 0 ? eda_state_[static_cast<std::size_t>(m - 1)] : nullptr;
      const float* dnext = m + 1 < nmoe ? deda_[(m + 1) % 2] : nullptr;
      float* dprev = m > 0 ? deda_[m % 2] : nullptr;
      cuda_zaya::moe_backward(*gemm_, zshape_, zaya_weights(W), zaya_grads(W), a.h2, prev, a.zmoe, zs_, dy, dnext,
                              dh_f32_, dprev, stream_, expert_runner(m));
      return;
    }
    const int E = cfg_.experts;
    const std::int64_t F = cfg_.expert_hidden;
    k::moe::Weights mw{w16 + W.w_gate, w16 + W.w_up, w16 + W.w_down};
    k::moe::Grads mg{G + W.w_gate, G + W.w_up, G + W.w_down, /*overwrite=*/grads_fresh_};
    if (k::moe::ExpertRunner* ep = expert_runner(m))
      ep->backward(a.plan, a.gates, mw, D, F, a.saved, dy, moe_scratch_, dh_bf_, dgates_, mg, stream_);
    else
      k::moe::backward(a.plan, a.gates, mw, D, F, a.saved, dy, moe_scratch_, dh_bf_, dgates_, mg, stream_);
    k::router::Options ro{cfg_.top_k, opt_.renormalize_gates};
    k::router::backward(a.probs, a.rlse, a.idx, a.gates, a.counts, N, E, ro, dgates_,
                        static_cast<float>(opt_.aux_loss_weight * cur_scale_),
                        static_cast<float>(opt_.z_loss_weight * cur_scale_), dlogits_, stream_);
    k::f32_to_bf16(dlogits_, dlogits_bf_, N * E, stream_);
    k::bf16_to_f32(dh_bf_, dh_f32_, N * D, stream_);
    gemm(N, D, E, false, false, dlogits_bf_, w16 + W.router, dh_f32_, true, 1.f);
    k::linear::backward(*gemm_, a.h2, w16 + W.router, dlogits_bf_, nullptr, G + W.router, N, D, E, stream_);
  }

  // Attention block backward: dy [N, D] bf16 = dL/d(block output) -> dh_bf_ = dL/d a.h1.
  void attn_backward(int l, LayerActs& a, const bf16* dy) {
    const LayerWeights& W = layers_[static_cast<std::size_t>(l)];
    const std::int64_t B = opt_.micro_batch, T = opt_.seq_length, N = B * T, D = cfg_.hidden;
    const std::int64_t Hq = cfg_.heads, Hkv = cfg_.kv_heads, Dh = cfg_.head_dim, Q = Hq * Dh, KV = Hkv * Dh;
    const bf16* w16 = params_bf16_;
    float* G = grads_;
    if (W.cca) {
      k::cca::backward(*gemm_, cca_cfg_, B, T, a.h1, positions_, rope_->view(), cca_weights(W), a.cca, dy, dh_bf_,
                       cca_grads(W), cca_scratch_, stream_);
      return;
    }
    k::linear::backward(*gemm_, a.att, w16 + W.wo, dy, datt_, G + W.wo, N, Q, D, stream_);
    const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));
    k::attention::backward(a.q, a.k, a.v, a.att, a.lse, datt_, dq_, dk_, dv_, attn_ws_, static_cast<int>(B),
                           static_cast<int>(T), static_cast<int>(Hq), static_cast<int>(Hkv), static_cast<int>(Dh), scale,
                           stream_);
    k::rope::backward(rope_->view(), dq_, positions_, N, Hq, stream_);
    k::rope::backward(rope_->view(), dk_, positions_, N, Hkv, stream_);
    k::linear::backward(*gemm_, a.h1, w16 + W.wq, dq_, nullptr, G + W.wq, N, D, Q, stream_);
    k::linear::backward(*gemm_, a.h1, w16 + W.wk, dk_, nullptr, G + W.wk, N, D, KV, stream_);
    k::linear::backward(*gemm_, a.h1, w16 + W.wv, dv_, nullptr, G + W.wv, N, D, KV, stream_);
    gemm(N, D, Q, false, false, dq_, w16 + W.wq, dh_f32_, true, 0.f);
    gemm(N, D, KV, false, false, dk_, w16 + W.wk, dh_f32_, true, 1.f);
    gemm(N, D, KV, false, false, dv_, w16 + W.wv, dh_f32_, true, 1.f);
    k::f32_to_bf16(dh_f32_, dh_bf_, N * D, stream_);
  }

  // dres_ holds dL/d(layer output) on entry and dL/d(layer input) on return.
  void layer_backward(int l, LayerActs& a, const float* x_in) {
    const LayerWeights& W = layers_[static_cast<std::size_t>(l)];
    const std::int64_t N = tokens(), D = cfg_.hidden;
    float* G = grads_;
    // MLP block: out = x_mid + mlp(n2(x_mid)); dh_f32_ collects dL/dh2.
    mlp_backward(l, a, dres_);
    k::f32_to_bf16(dh_f32_, dh_bf_, N * D, stream_);
    k::rmsnorm::backward(a.x_mid, params_ + W.mlp_norm, a.rstd2, dh_bf_, dres_, G + W.mlp_norm, N, D, stream_);
    grads_ready(2 + 2 * l);
    // Attention block: x_mid = x_in + attn(n1(x_in)); dres_ is now dL/dx_mid.
    k::f32_to_bf16(dres_, dres_bf_, N * D, stream_);
    attn_backward(l, a, dres_bf_);
    k::rmsnorm::backward(x_in, params_ + W.attn_norm, a.rstd1, dh_bf_, dres_, G + W.attn_norm, N, D, stream_);
    grads_ready(1 + 2 * l);
  }

  // In: dres_ = dL/d resid_[l + 1], dhres_ = dL/d hres_[l + 1]. Out: dres_ = dL/d resid_[l],
  // dhres_ = dL/d hres_[l] (layer 0: dres_ = dL/d embedding).
  void scaled_layer_backward(int l, LayerActs& a) {
    const LayerWeights& W = layers_[static_cast<std::size_t>(l)];
    const std::int64_t N = tokens(), D = cfg_.hidden;
    const ResScaleOffsets &A = W.attn_scale, &M = W.mlp_scale;
    const float* P = params_;
    float* G = grads_;
    mlp_backward(l, a, dhres_);
    k::f32_to_bf16(dh_f32_, dh_bf_, N * D, stream_);
    k::rmsnorm::backward(resid_[l + 1], P + W.mlp_norm, a.rstd2, dh_bf_, dres_, G + W.mlp_norm, N, D, stream_);
    // dres_ = dL/dr2 -> dL/dr1 (so far); dres_bf_ = dL/d attn_out (bf16: it feeds the output GEMM)
    k::residual_scale::merge_backward(a.x_mid, a.attn_out, P + M.r_bias, P + M.r_scale, P + M.h_bias, P + M.h_scale,
                                      dres_, dres_, dres_bf_, G + M.r_bias, G + M.r_scale, G + M.h_bias, G + M.h_scale,
                                      N, D, stream_);
    grads_ready(2 + 2 * l);
    attn_backward(l, a, dres_bf_);
    k::rmsnorm::backward(a.x_mid, P + W.attn_norm, a.rstd1, dh_bf_, dres_, G + W.attn_norm, N, D, stream_);
    if (l == 0)
      k::residual_scale::backward(resid_[0], P + A.h_bias, P + A.h_scale, dres_, dres_, G + A.h_bias, G + A.h_scale, N,
                                  D, stream_);
    else
      k::residual_scale::merge_backward(resid_[l], hres_[l], P + A.r_bias, P + A.r_scale, P + A.h_bias, P + A.h_scale,
                                        dres_, dres_, dhres_, G + A.r_bias, G + A.r_scale, G + A.h_bias,
                                        G + A.h_scale, N, D, stream_);
    grads_ready(1 + 2 * l);
  }

  model::ModelConfig cfg_;
  ModelOptions opt_;
  k::adamw::DeviceAdamW adam_;
  k::muon::DeviceMuon muon_;
  std::unique_ptr<parallel::DataParallelComm> dp_;  // the classic ZeRO-1 step (null on one GPU or overlapped)
  parallel::Zero1Plan plan_;
  // overlapped ZeRO-1
  bool overlap_ = false;
  int dp_rank_ = 0, dp_size_ = 1;
  parallel::Mesh mesh_;
  parallel::DataParallelOptions dp_options_;
  std::shared_ptr<parallel::NcclGroup> nccl_;
  cudaStream_t comm_stream_ = nullptr;
  cudaEvent_t ev_ready_ = nullptr, ev_comm_ = nullptr;  // re-recorded: each waited on right after it is recorded
  std::vector<cudaEvent_t> ev_arrived_;                 // per stage: its parameters have arrived
  std::vector<std::int64_t> stage_bounds_;
  std::vector<parallel::Zero1Bucket> buckets_;
  std::int64_t reduce_scratch_floats_ = 0;  // bf16 gradient reduction: the scratch's size (0: fp32 reduction)
  bf16* grads_bf16_ = nullptr;              // ... the scratch (grad arena), used on comm_stream_ only
  std::vector<int> stage_first_bucket_;                 // stage s: buckets [first[s], first[s + 1])
  std::vector<std::vector<BroadcastRun>> pieces_;       // per bucket
  std::vector<std::vector<BroadcastRun>> expert_pieces_;  // per expert-data rank: its expert shard
  bool any_bf16_broadcast_ = false;
  bool shard_masters_ = true;                    // parallel.zero1.shard_masters
  std::unique_ptr<SparseDeviceBuffer> masters_;  // the fp32 masters (params_): master_ranges() backed
  std::unique_ptr<SparseDeviceBuffer> adam_v_buffer_;  // adam_v_: adamw_moment_spans() backed
  // What parts of the arenas hold (memory_breakdown()), in bytes as taken.
  std::size_t reduce_scratch_bytes_ = 0, muon_ws_bytes_ = 0, saved_act_bytes_ = 0, ce_scratch_bytes_ = 0;
  static constexpr std::size_t kStagingFloats = std::size_t(32) << 20;  // 128 MiB pieces
  mutable GrowingDeviceBuffer staging_{"out of GPU memory: the ", "train on more GPUs or a smaller model"};
  bool group_reduces_ = false;
  cudaStream_t opt_stream_ = nullptr;                   // the shard's optimizer (null: on stream_)
  cudaEvent_t ev_opt_go_ = nullptr, ev_opt_bucket_ = nullptr, ev_opt_done_ = nullptr;
  std::unique_ptr<k::GemmRunner> gemm_opt_;             // Muon's GEMMs on opt_stream_
  mutable bool zero_pending_ = false;                   // zero_grads() deferred to the first backward
  // gradient ranges [begin, end): written by a step's first backward / zeroed by zero_grads()
  std::vector<std::pair<std::int64_t, std::int64_t>> grad_overwrite_, grad_zeroed_;
  mutable bool grads_fresh_ = false;  // zero_grads() ran, no backward since: grad_overwrite_ holds stale values
  bool defer_embed_ = false, own_embed_ = false;
  std::vector<int> embed_owners_;
  float* gather_dres_ = nullptr;                        // owners: (ranks - 1) x [N, D]
  std::uint32_t* gather_tokens_ = nullptr;              // owners: (ranks - 1) x [N]
  int backward_calls_ = 0;
  int step_backwards_ = 0;  // backward() calls this step, from begin_step() (0: not announced)
  bool launching_ = false, reduces_launched_ = false;
  mutable bool reduces_in_flight_ = false;
  mutable int awaited_stage_ = INT_MAX;                 // forward waits for stages above this
  std::unique_ptr<Profile> prof_;                       // parallel.zero1.profile
  std::pair<std::int64_t, std::int64_t> shard_;     // this rank's optimizer shard
  // expert parallelism: the replicated region is [0, replicated_end_) (all of it without)
  std::int64_t replicated_end_ = 0;
  StateSlice slice_;                                // shard_ + this rank's experts and their shard
  parallel::Zero1Plan expert_plan_;                 // the expert region's shards over expert_data
  int expert_data_rank_ = 0;
  int expert_stage_ = -1;                           // the stage the expert region's update precedes
  std::shared_ptr<parallel::NcclGroup> xnccl_;      // over expert_data, when it has several ranks
  std::shared_ptr<parallel::CudaExpertParallelGroup> ep_group_;
  std::vector<std::unique_ptr<parallel::CudaExpertParallelMoe>> ep_layers_;  // per MoE layer
  DeviceArena param_arena_, grad_arena_, state_arena_, act_arena_;
  int device_ = 0;
  std::string device_name_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<k::GemmRunner> gemm_;
  std::unique_ptr<k::rope::UploadedTable> rope_;
  optim::ParamLayout layout_;
  std::vector<int> moe_layer_ids_, moe_index_of_layer_;
  std::vector<LayerWeights> layers_;
  std::int64_t embed_ = -1, final_norm_ = -1, lm_head_ = -1;
  std::vector<std::vector<std::int64_t>> load_;
  std::vector<std::vector<std::int32_t>> layer_counts_;
  std::vector<k::router::Losses> host_losses_;
  std::vector<std::vector<float>> bias_;
  bool any_cca_ = false, any_softmax_ = false, mlp_router_ = false, scaled_ = false;
  int classes_ = 0;                      // router classes per MoE layer (experts, + skip)
  k::cca::Config cca_cfg_;
  cuda_zaya::Shape zshape_;
  ResScaleOffsets final_scale_;          // residual scaling before the final norm
  bool have_forward_ = false;
  bool ce_keep_logits_ = false;
  float cur_scale_ = 1.0f;

  float *params_ = nullptr, *grads_ = nullptr, *adam_m_ = nullptr, *adam_v_ = nullptr, *bias_dev_ = nullptr;
  bf16* params_bf16_ = nullptr;
  std::vector<float*> resid_;
  std::vector<float*> hres_;       // residual scaling: [layers + 1] mixer output entering layer l (fp32)
  std::vector<float*> eda_state_;  // per MoE stage: the MLP router's EDA state [N, R]
  float* deda_[2] = {nullptr, nullptr};  // dL/d EDA state, alternating between consecutive stages
  float *dhres_ = nullptr, *final_r_ = nullptr;
  cuda_zaya::Scratch zs_;
  std::byte* cca_scratch_ = nullptr;
  float* spare_resid_ = nullptr;
  std::vector<LayerActs> acts_;
  float *dres_ = nullptr, *dh_f32_ = nullptr, *moe_y_ = nullptr, *dgates_ = nullptr, *dlogits_ = nullptr;
  bf16 *dres_bf_ = nullptr, *dh_bf_ = nullptr, *datt_ = nullptr, *dq_ = nullptr, *dk_ = nullptr, *dv_ = nullptr;
  bf16 *dg_ = nullptr, *du_ = nullptr, *da_ = nullptr, *dlogits_bf_ = nullptr;
  std::byte *moe_scratch_ = nullptr, *attn_ws_ = nullptr, *ce_scratch_ = nullptr;
  std::byte* muon_ws_ = nullptr;  // Newton-Schulz workspace of the largest Muon parameter (null: no Muon)
  bf16* final_h_ = nullptr;
  float *final_rstd_ = nullptr, *ce_lse_ = nullptr;
  k::cross_entropy::Result* ce_result_ = nullptr;
  std::uint32_t* tokens_ = nullptr;
  std::int32_t *targets_ = nullptr, *positions_ = nullptr;
  double *norm_ws_ = nullptr, *sum_sq_ = nullptr, *norm_ = nullptr;
  float* coef_ = nullptr;
};

}  // namespace

std::unique_ptr<TrainBackend> make_cuda_backend(const model::ModelConfig& cfg, const ModelOptions& options,
                                                const OptimizerConfig& optimizer, const parallel::Mesh& mesh,
                                                const parallel::DataParallelOptions& dp) {
  return std::make_unique<CudaBackend>(cfg, options, optimizer, mesh, dp);
}

}  // namespace keel::train
