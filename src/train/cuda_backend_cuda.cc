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
// check). Everything else is enqueued on one stream.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/error.h"
#include "device/cuda_check.h"
#include "device/cuda_devices.h"
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
#include "parallel/zero1.h"
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
    if (e != cudaSuccess) {
      cudaGetLastError();
      std::size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      throw UsageError(fmt::format("out of GPU memory: the {} need {:.2f} GiB, {:.2f} GiB of {:.2f} GiB are free "
                                   "(lower batch.micro_batch or data.seq_length, or set recompute: full)",
                                   name_, capacity_ / 1073741824.0, free_b / 1073741824.0, total_b / 1073741824.0));
    }
    KEEL_CUDA_CHECK(cudaMemset(base_, 0, capacity_));
    used_ = 0;
  }
  std::size_t capacity() const { return capacity_; }

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

class CudaBackend final : public TrainBackend {
 public:
  CudaBackend(const model::ModelConfig& cfg, const ModelOptions& options, const OptimizerConfig& optimizer,
              const ParallelContext& ctx)
      : cfg_(cfg), opt_(options), adam_(optimizer.adamw), muon_(optimizer.muon.config), param_arena_("parameters"),
        grad_arena_("gradients"), state_arena_("optimizer states"), act_arena_("activations") {
    ctx.require_data_parallel_only("keel train (cuda)");
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

    layout_ = model_param_layout(cfg_);
    // Muon: the same offsets, the matrices regrouped (param_rules.h)
    if (optimizer.muon.enabled) layout_ = regroup_layout(layout_, train_group_rules(optimizer.muon));
    const std::size_t muon_ws_bytes = k::muon::workspace_bytes(layout_);
    // ZeRO-1 over the data-parallel ranks (parallel/zero1.h): optimizer state for this rank's
    // shard only; NCCL on stream_.
    if (ctx.data.size > 1) {
      dp_ = parallel::make_nccl_data_parallel_comm(ctx.data.comm, stream_);
      plan_ = parallel::plan_zero1(layout_, ctx.data.size);
      shard_ = {plan_.begin(ctx.data.rank), plan_.end(ctx.data.rank)};
    } else {
      shard_ = {0, layout_.total_floats};
    }
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
    cca_cfg_.hidden = cfg_.hidden;
    cca_cfg_.q_heads = cfg_.heads;
    cca_cfg_.kv_heads = cfg_.kv_heads;
    cca_cfg_.head_dim = cfg_.head_dim;
    cca_cfg_.conv0_width = cfg_.cca_conv_width;
    cca_cfg_.conv1_width = cfg_.cca_group_conv_width;
    load_.assign(moe_layer_ids_.size(), std::vector<std::int64_t>(classes_, 0));
    bias_.assign(moe_layer_ids_.size(), std::vector<float>(classes_, 0.f));
    for (auto& b : bias_)
      if (cfg_.router_skip_expert) b.back() = -1.f;  // ZAYA1: the skip class starts disfavoured (as the CPU model)
    map_weights();

    // parameters, gradients, states: the flat layout of the CPU model, so checkpoints move freely
    const std::size_t n = static_cast<std::size_t>(layout_.total_floats);
    // the collectives' buffers may need a padded tail (equal NCCL chunks)
    const std::size_t n_comm = dp_ ? static_cast<std::size_t>(dp_->buffer_floats(layout_.total_floats)) : n;
    const std::size_t n_shard = std::max<std::size_t>(1, static_cast<std::size_t>(shard_.second - shard_.first));
    for (int pass = 0; pass < 2; ++pass) {
      params_ = param_arena_.take<float>(n_comm);
      params_bf16_ = param_arena_.take<bf16>(n);
      bias_dev_ = param_arena_.take<float>(std::max<std::size_t>(1, moe_layer_ids_.size() * classes_));
      grads_ = grad_arena_.take<float>(n_comm);
      adam_m_ = state_arena_.take<float>(n_shard);
      adam_v_ = state_arena_.take<float>(n_shard);
      muon_ws_ = muon_ws_bytes ? state_arena_.take<std::byte>(muon_ws_bytes) : nullptr;
      plan_acts();
      if (pass == 0) {
        param_arena_.allocate();
        grad_arena_.allocate();
        state_arena_.allocate();
        act_arena_.allocate();
      }
    }
    rope_ = std::make_unique<k::rope::UploadedTable>(
        ops::rope::make_table(cfg_.head_dim, cfg_.rope_fraction, cfg_.rope_base, std::max(opt_.seq_length, cfg_.max_seq_len)));
    std::vector<std::int32_t> pos(static_cast<std::size_t>(tokens()));
    for (std::int64_t i = 0; i < tokens(); ++i) pos[i] = static_cast<std::int32_t>(i % opt_.seq_length);
    // Host-to-device copies go on stream_ and are waited for: a plain cudaMemcpy from pageable
    // memory may return before its DMA lands, and kernels on this non-blocking stream do not
    // wait for the legacy stream (the first step then reads stale weights).
    KEEL_CUDA_CHECK(cudaMemcpyAsync(positions_, pos.data(), pos.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice, stream_));
    KEEL_CUDA_CHECK(cudaStreamSynchronize(stream_));

    std::vector<float> init(n);
    init_model_parameters(cfg_, layout_, opt_.init_std, opt_.init_seed, init.data());
    upload_params(init);
  }

  ~CudaBackend() override {
    if (stream_) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
  }

  std::string device() const override { return device_name_; }
  const optim::ParamLayout& layout() const override { return layout_; }
  std::int64_t param_count() const override {
    std::int64_t c = 0;
    for (const auto& p : layout_.params) c += p.numel;
    return c;
  }
  int moe_layer_count() const override { return static_cast<int>(moe_layer_ids_.size()); }
  double flops_per_micro_batch() const override {
    return model_flops_per_micro_batch(cfg_, opt_.micro_batch, opt_.seq_length);
  }
  std::size_t memory_bytes() const override {
    return param_arena_.capacity() + grad_arena_.capacity() + state_arena_.capacity() + act_arena_.capacity();
  }

  void zero_grads() override {
    KEEL_CUDA_CHECK(cudaMemsetAsync(grads_, 0, static_cast<std::size_t>(layout_.total_floats) * sizeof(float), stream_));
  }

  LossParts forward(const std::uint32_t* tokens_host, const std::int32_t* targets_host) override {
    const std::int64_t N = tokens(), V = cfg_.vocab_size, D = cfg_.hidden;
    for (std::int64_t i = 0; i < N; ++i)
      if (tokens_host[i] >= static_cast<std::uint64_t>(V))
        fail("token id {} at position {} is outside the vocabulary ({})", tokens_host[i], i, V);
    KEEL_CUDA_CHECK(cudaMemcpyAsync(tokens_, tokens_host, N * sizeof(std::uint32_t), cudaMemcpyHostToDevice, stream_));
    KEEL_CUDA_CHECK(cudaMemcpyAsync(targets_, targets_host, N * sizeof(std::int32_t), cudaMemcpyHostToDevice, stream_));
    k::embedding::forward(tokens_, N, params_ + embed_, resid_[0], V, D, stream_);
    for (int l = 0; l < cfg_.layers; ++l) {
      if (scaled_)
        scaled_layer_forward(l, acts_for(l), resid_[l + 1], hres_[l + 1], /*count_load=*/true);
      else
        layer_forward(l, acts_for(l), resid_[l], resid_[l + 1], /*count_load=*/true);
    }
    const float* final_in = resid_[cfg_.layers];
    if (scaled_) {
      const ResScaleOffsets& F = final_scale_;
      k::residual_scale::merge_forward(resid_[cfg_.layers], hres_[cfg_.layers], params_ + F.r_bias, params_ + F.r_scale,
                                       params_ + F.h_bias, params_ + F.h_scale, final_r_, N, D, stream_);
      final_in = final_r_;
    }
    k::rmsnorm::forward(final_in, params_ + final_norm_, eps(), final_h_, final_rstd_, N, D, stream_);
    k::cross_entropy::forward(final_h_, params_bf16_ + lm_head_, targets_, N, D, V, ce_options(), ce_lse_, ce_result_,
                              ce_scratch_, stream_);
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
    cur_scale_ = loss_scale;
    const std::int64_t N = tokens(), V = cfg_.vocab_size, D = cfg_.hidden;
    k::cross_entropy::backward(final_h_, params_bf16_ + lm_head_, targets_, ce_lse_, loss_scale, N, D, V, ce_options(),
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
    k::embedding::backward(tokens_, N, dres_, grads_ + embed_, V, D, stream_);
    have_forward_ = false;
  }

  StepResult clip_and_step(double max_norm, double lr) override {
    if (dp_) return zero1_step(max_norm, lr);
    const std::int64_t n = layout_.total_floats;
    k::grad_norm::sum_squares(grads_, n, norm_ws_, sum_sq_, /*accumulate=*/false, stream_);
    k::grad_norm::clip_coefficient(sum_sq_, max_norm, coef_, norm_, stream_);
    double norm = 0;
    float coef = 1;
    KEEL_CUDA_CHECK(cudaMemcpyAsync(&norm, norm_, sizeof(double), cudaMemcpyDeviceToHost, stream_));
    KEEL_CUDA_CHECK(cudaMemcpyAsync(&coef, coef_, sizeof(float), cudaMemcpyDeviceToHost, stream_));
    KEEL_CUDA_CHECK(cudaStreamSynchronize(stream_));
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
  void update_router_bias() override {
    if (opt_.bias_update_rate != 0.0) {
      update_balancing_bias(load_, opt_.bias_update_rate, bias_);
      upload_bias();
    }
    reset_load();
  }

  std::vector<float> gradients() const override {
    std::vector<float> g(static_cast<std::size_t>(layout_.total_floats));
    KEEL_CUDA_CHECK(cudaStreamSynchronize(stream_));
    KEEL_CUDA_CHECK(cudaMemcpy(g.data(), grads_, g.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return g;
  }

  TrainState state() const override {
    TrainState s;
    const std::size_t n = static_cast<std::size_t>(layout_.total_floats);
    s.params.resize(n);
    const std::size_t k = static_cast<std::size_t>(shard_.second - shard_.first);
    s.shard_begin = shard_.first;
    s.shard_end = shard_.second;
    s.adam_m.resize(k);
    s.adam_v.resize(k);
    KEEL_CUDA_CHECK(cudaStreamSynchronize(stream_));
    KEEL_CUDA_CHECK(cudaMemcpy(s.params.data(), params_, n * sizeof(float), cudaMemcpyDeviceToHost));
    KEEL_CUDA_CHECK(cudaMemcpy(s.adam_m.data(), adam_m_, k * sizeof(float), cudaMemcpyDeviceToHost));
    KEEL_CUDA_CHECK(cudaMemcpy(s.adam_v.data(), adam_v_, k * sizeof(float), cudaMemcpyDeviceToHost));
    s.router_bias = bias_;
    s.adamw_step = adam_.step_count();
    return s;
  }

  void set_state(const TrainState& s) override {
    const std::size_t n = static_cast<std::size_t>(layout_.total_floats);
    const std::size_t k = static_cast<std::size_t>(shard_.second - shard_.first);
    if (s.params.size() != n) fail("train state holds {} parameter floats, this model has {}", s.params.size(), n);
    if (s.shard_begin != shard_.first || s.shard_end != shard_.second || s.adam_m.size() != k || s.adam_v.size() != k)
      fail("train state holds the optimizer shard [{}, {}) ({} floats), this rank's is [{}, {})", s.shard_begin,
           s.shard_end, s.adam_m.size(), shard_.first, shard_.second);
    if (s.router_bias.size() != bias_.size())
      fail("train state holds {} router biases, this model has {} MoE layers", s.router_bias.size(), bias_.size());
    for (std::size_t i = 0; i < bias_.size(); ++i)
      if (s.router_bias[i].size() != bias_[i].size()) fail("router bias {} size differs", i);
    check_state_matches_optimizers(layout_, s.adam_m.data(), s.adam_v.data(), shard_.first, shard_.second);
    upload_params(s.params);
    if (k > 0) KEEL_CUDA_CHECK(cudaMemcpyAsync(adam_m_, s.adam_m.data(), k * sizeof(float), cudaMemcpyHostToDevice, stream_));
    if (k > 0) KEEL_CUDA_CHECK(cudaMemcpyAsync(adam_v_, s.adam_v.data(), k * sizeof(float), cudaMemcpyHostToDevice, stream_));
    KEEL_CUDA_CHECK(cudaStreamSynchronize(stream_));
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
  StepResult zero1_step(double max_norm, double lr) {
    const auto [b, e] = shard_;
    dp_->reduce_scatter_sum(grads_, plan_.bounds);
    k::grad_norm::sum_squares(grads_ + b, e - b, norm_ws_, sum_sq_, /*accumulate=*/false, stream_);
    dp_->all_reduce_sum(sum_sq_, 1);
    k::grad_norm::clip_coefficient(sum_sq_, max_norm, coef_, norm_, stream_);
    double norm = 0;
    float coef = 1;
    KEEL_CUDA_CHECK(cudaMemcpyAsync(&norm, norm_, sizeof(double), cudaMemcpyDeviceToHost, stream_));
    KEEL_CUDA_CHECK(cudaMemcpyAsync(&coef, coef_, sizeof(float), cudaMemcpyDeviceToHost, stream_));
    KEEL_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (!std::isfinite(norm)) throw optim::NonFiniteGradient(fmt::format("gradient norm is {}", norm), "", norm);
    k::adamw::DeviceFlatRange r;
    r.begin = b;
    r.end = e;
    r.param = params_ + b;
    r.grad = grads_ + b;
    r.m = adam_m_;
    r.v = adam_v_;
    r.param_bf16 = params_bf16_ + b;
    adam_.step(layout_, r, lr, 1.0f, coef_, stream_);  // skips Muon parameters
    // Muon: the whole matrices of the shard, consecutive ones of a stack in one batched call
    const auto mats = parallel::muon_matrices_in(layout_, b, e);
    for (std::size_t i = 0; i < mats.size();) {
      std::size_t j = i + 1;
      while (j < mats.size() && mats[j].param == mats[i].param) ++j;
      const auto& p = layout_.params[static_cast<std::size_t>(mats[i].param)];
      const std::int64_t o = mats[i].offset;
      k::muon::matrix_step(params_ + o, grads_ + o, adam_m_ + (o - b), params_bf16_ + o, static_cast<std::int64_t>(j - i),
                           p.rows(), p.cols(), muon_.config(), lr * p.lr_scale, p.weight_decay, 1.0f, coef_, muon_ws_,
                           *gemm_, stream_);
      i = j;
    }
    dp_->all_gather(params_, plan_.bounds);
    k::f32_to_bf16(params_, params_bf16_, layout_.total_floats, stream_);
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
    g.experts = {G + W.w_gate, G + W.w_up, G + W.w_down};
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
        a.saved.h_gate = A.take<bf16>(S * FE);
        a.saved.h_up = A.take<bf16>(S * FE);
        a.saved.act = A.take<bf16>(S * FE);
        a.saved.ys = A.take<bf16>(S * D);
        a.zmoe.experts = a.saved;
      }
    }
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
    if (any_moe)
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
    ce_scratch_ = A.take<std::byte>(
        static_cast<std::size_t>(k::cross_entropy::scratch_bytes(N, D, cfg_.vocab_size, ce_options())));
    tokens_ = A.take<std::uint32_t>(N);
    targets_ = A.take<std::int32_t>(N);
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
    KEEL_CUDA_CHECK(cudaMemcpyAsync(params_, host.data(), n * sizeof(float), cudaMemcpyHostToDevice, stream_));
    k::f32_to_bf16(params_, params_bf16_, static_cast<std::int64_t>(n), stream_);
    upload_bias();
    KEEL_CUDA_CHECK(cudaStreamSynchronize(stream_));  // `host` may go once this returns
  }

  void upload_bias() {
    std::vector<float> flat;
    for (const auto& b : bias_) flat.insert(flat.end(), b.begin(), b.end());
    if (!flat.empty())
      KEEL_CUDA_CHECK(cudaMemcpyAsync(bias_dev_, flat.data(), flat.size() * sizeof(float), cudaMemcpyHostToDevice,
                                      stream_));
    KEEL_CUDA_CHECK(cudaStreamSynchronize(stream_));  // `flat` dies here
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
                             a.zmoe, zs_, y, stream_);
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
    k::moe::forward(a.plan, a.h2, a.gates, mw, D, F, a.saved, y, stream_);
  }

  // Plain pre-norm layer: x_mid = x_in + attn(n1(x_in)); x_out = x_mid + mlp(n2(x_mid)).
  void layer_forward(int l, LayerActs& a, const float* x_in, float* x_out, bool count_load) {
    const LayerWeights& W = layers_[static_cast<std::size_t>(l)];
    const std::int64_t B = opt_.micro_batch, T = opt_.seq_length, N = B * T, D = cfg_.hidden;
    const std::int64_t Hq = cfg_.heads, Dh = cfg_.head_dim, Q = Hq * Dh;
    const bf16* w16 = params_bf16_;
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
    if (l == 0)
      k::residual_scale::forward(resid_[0], P + A.h_bias, P + A.h_scale, a.x_mid, N, D, stream_);
    else
      k::residual_scale::merge_forward(resid_[l], hres_[l], P + A.r_bias, P + A.r_scale, P + A.h_bias, P + A.h_scale,
                                       a.x_mid, N, D, stream_);
    k::rmsnorm::forward(a.x_mid, P + W.attn_norm, eps(), a.h1, a.rstd1, N, D, stream_);
    attn_forward_to_out(l, a);
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
                              dh_f32_, dprev, stream_);
      return;
    }
    const int E = cfg_.experts;
    const std::int64_t F = cfg_.expert_hidden;
    k::moe::Weights mw{w16 + W.w_gate, w16 + W.w_up, w16 + W.w_down};
    k::moe::Grads mg{G + W.w_gate, G + W.w_up, G + W.w_down};
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
    // Attention block: x_mid = x_in + attn(n1(x_in)); dres_ is now dL/dx_mid.
    k::f32_to_bf16(dres_, dres_bf_, N * D, stream_);
    attn_backward(l, a, dres_bf_);
    k::rmsnorm::backward(x_in, params_ + W.attn_norm, a.rstd1, dh_bf_, dres_, G + W.attn_norm, N, D, stream_);
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
    attn_backward(l, a, dres_bf_);
    k::rmsnorm::backward(a.x_mid, P + W.attn_norm, a.rstd1, dh_bf_, dres_, G + W.attn_norm, N, D, stream_);
    if (l == 0)
      k::residual_scale::backward(resid_[0], P + A.h_bias, P + A.h_scale, dres_, dres_, G + A.h_bias, G + A.h_scale, N,
                                  D, stream_);
    else
      k::residual_scale::merge_backward(resid_[l], hres_[l], P + A.r_bias, P + A.r_scale, P + A.h_bias, P + A.h_scale,
                                        dres_, dres_, dhres_, G + A.r_bias, G + A.r_scale, G + A.h_bias,
                                        G + A.h_scale, N, D, stream_);
  }

  model::ModelConfig cfg_;
  ModelOptions opt_;
  k::adamw::DeviceAdamW adam_;
  k::muon::DeviceMuon muon_;
  std::unique_ptr<parallel::DataParallelComm> dp_;  // null on one GPU
  parallel::Zero1Plan plan_;
  std::pair<std::int64_t, std::int64_t> shard_;     // this rank's optimizer shard
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
                                                const OptimizerConfig& optimizer, const ParallelContext& ctx) {
  return std::make_unique<CudaBackend>(cfg, options, optimizer, ctx);
}

}  // namespace keel::train
