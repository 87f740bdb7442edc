// The model math of GPU training: MoeTransformer's layer graph (train/model.h) over flat device
// buffers, built from the GPU blocks (blocks/cuda/attention.h, blocks/cuda/mlp.h) with the
// runners the plan gives each layer. It owns the activations (every layer's saved tensors, the
// shared backward scratch, the cross-entropy's buffers), not the parameters, gradients or
// optimizer state: the backend (cuda_backend_cuda.cc) allocates those and binds them. It tells
// a data-parallel schedule where it is through parallel::StageHooks (before each stage's
// parameters are read in forward, when each stage's gradients are final in backward); it never
// communicates itself. CUDA builds only.
//
// Per layer (plain pre-norm): x_mid = x + attn(n1(x)), y = x_mid + mlp(n2(x_mid)); with ZAYA1's
// residual scaling two streams (r, h) merged before each stage and before the final norm
// (MoeTransformer::scaled_layer_forward). Precision: bf16 GEMM operands, fp32 accumulation, the
// residual stream(s) and their gradients fp32. Host syncs: one per MoE layer in forward (the
// dispatch plan), one at the end of forward (the loss and the loads).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "blocks/cuda/attention.h"
#include "blocks/cuda/mlp.h"
#include "blocks/cuda/rope_tables.h"
#include "blocks/cuda/runners.h"
#include "blocks/cuda/weights.h"
#include "device/device_arena.h"
#include "model/config.h"
#include "ops/cuda/cross_entropy.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/router.h"
#include "parallel/context_parallel_cuda.h"
#include "parallel/stage_hooks.h"
#include "parallel/tensor_parallel_cuda.h"
#include "parallel/tsp_cuda.h"
#include "train/model.h"
#include "train/step_profile_cuda.h"

namespace keel::train {

class CudaModel {
 public:
  using bf16 = ops::cuda::bf16;

  // The flat buffers the backend owns: fp32 parameters (every one the blocks read in fp32 must be
  // backed), their bf16 copy, the gradients, and the router selection biases ([moe][classes]).
  struct Buffers {
    const float* params = nullptr;
    const bf16* params_bf16 = nullptr;
    float* grads = nullptr;
    const float* bias = nullptr;
  };

  // runners: one per layer, from the plan (parallel/plan_cuda.h); tp: the plan's tensor-parallel
  // boundary (null at tensor degree 1), which the embedding and the LM head use too (vocabulary
  // parallel); cp: the plan's context-parallel core (null at context degree 1): this rank runs
  // its zigzag chunks of each sequence and the losses are reduced over the context group.
  // tsp: the plan's TSP shards (null at tsp degree 1; cp is then the core over the tsp group):
  // each layer's attention and MLP run once per weight shard, the tables' rows visit in pieces.
  // gpu_memory: the device's bytes, which decide whether the bf16 logits are
  // kept between forward and backward.
  CudaModel(const model::ModelConfig& cfg, const ModelOptions& options, const optim::ParamLayout& layout,
            std::vector<blocks::cuda::LayerRunners> runners, parallel::CudaTensorParallelLinear* tp,
            parallel::CudaContextParallel* cp, std::size_t gpu_memory, cudaStream_t stream,
            parallel::CudaTspShards* tsp = nullptr);
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  // Takes every activation region from `acts` (a sizing pass before acts.allocate(), then the
  // real one): the layers' saved tensors first (saved_bytes()), then the shared scratch.
  void carve(DeviceArena& acts);
  // After the real carve: the flat buffers (pointers stay valid) and the positions' upload.
  void bind(const Buffers& b);

  // tokens, targets: micro_batch x seq_length on the host (whole sequences). Adds each MoE
  // layer's routing counts (E experts, + the skip class) of this rank's tokens into load[m].
  // Under context parallelism the returned losses are the micro-batch's, the same on every rank
  // of the context group (the linear router's aux loss: the mean of the ranks', each over its
  // own tokens).
  LossParts forward(const std::uint32_t* tokens, const std::int32_t* targets, parallel::StageHooks& hooks,
                    std::vector<std::vector<std::int64_t>>& load);
  // d(loss_scale x the last forward's loss) into the gradients: accumulated, or written for the
  // blocks a step's first backward writes (grads_fresh: the expert stacks and the LM head).
  void backward(float loss_scale, bool grads_fresh, parallel::StageHooks& hooks);

  // kernels.profile: the phases of forward and backward are marked on `p` (null: none).
  void set_profile(CudaStepProfile* p) { prof_ = p; }
  void mark(const char* phase) const {
    if (prof_) prof_->mark(phase, stream_);
  }

  std::int64_t tokens() const { return tokens_; }  // the rows a block reads (this rank's tokens)
  std::int64_t rows() const { return rows_; }  // the residual stream's rows here (tokens / T under sequence parallelism)
  int moe_layer_count() const { return static_cast<int>(moe_layer_ids_.size()); }
  int classes() const { return mlp_shape_.classes(); }
  bool keeps_logits() const { return ce_keep_logits_; }
  ops::cuda::GemmRunner& gemm() { return *gemm_; }
  std::size_t saved_bytes() const { return saved_bytes_; }  // the layers' saved activations
  std::size_t ce_bytes() const { return ce_bytes_; }        // the cross-entropy's scratch (kept logits)
  std::size_t tables_bytes() const { return tables_bytes_; }  // TSP gathering its tables: their exchange buffers

 private:
  struct LayerActs;
  struct Stream;
  struct Head;
  LayerActs& acts_for(int l);
  void prefetch_inputs(int l, LayerActs& a, bool next_is_attention);
  // kernels.profile's phase names (string literals) of layer l's two blocks
  const char* attention_phase(bool backward) const;
  const char* mlp_phase(int l, bool backward) const;
  blocks::cuda::AttnContext attn_context(int l) const;
  blocks::cuda::EdaIo eda(int m) const;
  ops::cuda::cross_entropy::Options ce_options() const;
  ops::cuda::cross_entropy::Slice vocab_slice() const;  // this rank's rows of the LM head
  // Each asks for its two stages' parameters (1 + 2l, 2 + 2l) before it reads them.
  void layer_forward(int l, LayerActs& a, const float* x_in, float* x_out, bool count_load, parallel::StageHooks& hooks);
  void scaled_layer_forward(int l, LayerActs& a, float* r_out, float* h_out, bool count_load,
                            parallel::StageHooks& hooks);
  void embedding_forward();
  void embedding_backward();
  void head_forward();
  void head_backward(float loss_scale, bool grads_fresh);
  // parallel.tsp_tables gather: the embedding and the head over the group's tokens (rank order),
  // this rank's vocabulary rows staying here (parallel/tsp_tables.h).
  void gathered_embedding_forward();
  void gathered_embedding_backward();
  void gathered_head_forward();
  void gathered_head_backward(float loss_scale, bool grads_fresh);
  void mlp_forward(int l, LayerActs& a, const float* residual, float* y, bool count_load);
  void mlp_backward(int l, LayerActs& a, const float* dy, bool grads_fresh);
  // The attention block of layer l: out (and add_into, when given, += out) from a.h1; backward
  // from st.dres_bf into st.dh_bf. Under TSP once per weight shard.
  void attention_forward(int l, LayerActs& a, float* add_into, bf16* out);
  void attention_backward(int l, LayerActs& a);
  void layer_backward(int l, LayerActs& a, const float* x_in, bool grads_fresh, parallel::StageHooks& hooks);
  void scaled_layer_backward(int l, LayerActs& a, bool grads_fresh, parallel::StageHooks& hooks);

  model::ModelConfig cfg_;
  ModelOptions opt_;
  const optim::ParamLayout& layout_;
  std::vector<blocks::cuda::LayerRunners> runners_;
  parallel::CudaTensorParallelLinear* tp_ = nullptr;
  parallel::CudaContextParallel* cp_ = nullptr;
  parallel::CudaTspShards* tsp_ = nullptr;
  int shards_ = 1;       // the weight shards each sub-block runs over (tsp degree)
  int head_pieces_ = 0;  // TSP: the LM head's pieces (every shard's)
  std::vector<blocks::cuda::AttnShape> shard_shapes_;  // TSP: shard r's heads
  double ce_share_ = 1.0;  // context parallelism: this rank's share of the micro-batch's valid targets
  bool gather_tables_ = false;       // TSP: parallel.tsp_tables resolved to gather
  std::vector<double> valid_share_;  // gather_tables_: each rank's share of the micro-batch's valid targets
  std::vector<std::uint32_t> host_tokens_;  // context parallelism: this rank's rows of the micro-batch
  std::vector<std::int32_t> host_targets_;
  cudaStream_t stream_;
  std::unique_ptr<ops::cuda::GemmRunner> gemm_;
  std::unique_ptr<blocks::cuda::DeviceRopeTables> ropes_;  // each layer's rotary table
  std::int64_t tokens_ = 0, rows_ = 0;
  std::int64_t vocab_begin_ = 0, vocab_local_ = 0;  // this rank's rows of the embedding and LM head
  bool ce_keep_logits_ = false, scaled_ = false;
  blocks::AttnKinds any_kind_;  // the attention kinds of the layers
  blocks::cuda::AttnShape attn_shape_;
  blocks::cuda::MlpShape mlp_shape_;
  std::vector<int> moe_layer_ids_, moe_index_of_layer_;
  blocks::cuda::ModelWeights w_;
  blocks::cuda::ModelGrads g_;
  const float* bias_ = nullptr;
  std::vector<LayerActs> acts_;  // one per layer, or one shared set with full recompute
  std::unique_ptr<Stream> st_;   // residual streams and their gradients
  std::unique_ptr<Head> head_;   // final norm, cross-entropy, token ids
  blocks::cuda::AttnScratch attn_scratch_;
  blocks::cuda::MlpScratch mlp_scratch_;
  std::vector<std::vector<std::int32_t>> layer_counts_;  // per MoE layer: this micro-batch's loads
  std::vector<ops::cuda::router::Losses> host_losses_;  // full recompute: read in forward
  std::size_t saved_bytes_ = 0, ce_bytes_ = 0, tables_bytes_ = 0;
  bool have_forward_ = false;
  float cur_scale_ = 1.0f;
  CudaStepProfile* prof_ = nullptr;
  bool recomputing_ = false;  // full recompute's forward inside backward (its own phases)
};

}  // namespace keel::train
