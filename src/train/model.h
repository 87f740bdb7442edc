// MoeTransformer: a decoder-only MoE transformer assembled from the CPU reference ops
// (src/ops), with explicit forward and backward and no autograd (docs/train.md).
//
// Per layer (pre-norm):  h = x + attn(n1(x)),  attn = GQA/MHA (Wo attn(rope(Wq .), rope(Wk .),
//                        Wv .)) or ZAYA1's CCA (ops::cca); a sliding-window layer attends to
//                        the last sliding_window tokens only, with its own RoPE table
//                        y = h + mlp(n2(h)),  mlp = dense SwiGLU or routed SwiGLU experts (linear
//                        top-k router, or ZAYA1's MLP router with EDA and the skip class)
// then a final RMSNorm and the chunked cross-entropy LM head (tied to the embedding or not).
// With residual_scaling (ZAYA1) the two `+` become scaled merges of two streams (residual r and
// mixer output h): r <- (r + b_r) * s_r + (h + b_h) * s_h before each stage, and once more
// before the final norm (docs/train.md has the exact data flow).
// Loss = CE + aux_loss_weight * sum_layers aux + z_loss_weight * sum_layers z (linear routers;
// ZAYA1's MLP router has no z loss, and its aux loss, over all its classes, is reported but
// weighted by mlp_router_aux_weight, 0 by default: its balance is the bias controller's).
//
// Memory: three arenas. Parameters in one (named regions laid out by optim::assign_groups, so
// the flat parameter buffer is the optimizer's buffer), gradients in a second with the same
// offsets, activations in a third sized once from (micro_batch, seq). With recompute = full
// only each layer's input is kept; backward re-runs the layer's forward into one shared
// workspace before its backward (gradients identical to recompute = none); with residual
// scaling both streams are kept, and the MLP routers' EDA states always are.
// Supported: attention mha/gqa/cca, dense and MoE layers (linear router, or the ZAYA1 MLP router
// with optional skip class; no shared experts), residual scaling. Anything else in the
// ModelConfig (linear attention, qk_norm, shared experts) is rejected with a one-line
// keel::UsageError.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "blocks/attention.h"
#include "blocks/mlp.h"
#include "blocks/rope_tables.h"
#include "blocks/weights.h"
#include "model/config.h"
#include "model/param_layout.h"
#include "ops/zaya_router.h"
#include "optim/param_groups.h"
#include "parallel/mesh.h"
#include "parallel/plan.h"
#include "parallel/tsp_tables.h"
#include "tensor/arena.h"
#include "tensor/tensor.h"

namespace keel::train {

enum class Recompute { kNone, kFull };
Recompute parse_recompute(const std::string& s);  // "none" | "full"
const char* to_string(Recompute r);

struct ModelOptions {
  int micro_batch = 1;  // B
  int seq_length = 0;   // T
  Recompute recompute = Recompute::kNone;
  double aux_loss_weight = 0.01;  // Switch load-balancing loss weight (per MoE layer, summed)
  // The same loss on ZAYA1's MLP router, over all its classes (skip included): 0 = none, as
  // ZAYA1 trains (its balance is the bias controller's). keel train's router.aux_loss_weight
  // sets whichever of the two the model's router takes.
  double mlp_router_aux_weight = 0.0;
  double z_loss_weight = 0.001;   // router z-loss weight
  bool renormalize_gates = true;  // gates renormalized over the top_k
  // Benchmarking only (router.forced_balance): every MoE layer routes slot j of token n to
  // expert (n * top_k + j) mod experts, whatever the router scores (never the skip class), so
  // the experts get equal loads, as Megatron's forced load balancing. The router never chooses.
  bool forced_balance = false;
  // Aux-loss-free balancing (over E + 1 classes, skip included, for the MLP router), with f_e
  // the class's share of the step's routed tokens: sign: bias_e -= rate * sign(f_e - 1/classes)
  // (DeepSeek-V3); proportional: bias_e -= rate * (f_e - 1/classes); adam: AdamW on the bias
  // with gradient f_e - 1/classes and lr = rate, betas (0.9, 0.999), eps 1e-8 (ZAYA1's
  // controller as Primus implements it; its moments are train state); pid: proportional's
  // integral term plus balance_kp times the error's change and balance_kd times its second
  // difference (ops::bias_controller; its last two errors are train state). 0 = biases fixed.
  double bias_update_rate = 0.0;
  ops::bias_controller::Rule balance_rule = ops::bias_controller::Rule::Sign;
  double balance_kp = 0.0, balance_kd = 0.0;
  // The MLP router's r x r layers and output layer start as normal(0, router_init_gain /
  // sqrt(fan_in)) (variance preserving: the first softmax depends on the token); 0: init_std,
  // as every other matrix (Hugging Face's init, whose logits are ~1e-3 and route by the bias).
  double router_init_gain = 0.0;
  double router_lr_scale = 1.0;  // the routers' learning rate over the scheduled one (scale_router_lr)
  std::int64_t ce_chunk = 8192;
  double init_std = 0.02;
  std::uint64_t init_seed = 1234;
  // Recompute the returned CE in double from the fp32 final hidden states (an extra [N, V]
  // pass): for finite-difference gradient checks, where the fp32 loss's rounding would
  // dominate. Gradients are unchanged.
  bool precise_loss = false;
  // Under tensor parallelism (the mesh's tp > 1): the residual stream, norms and residual scales
  // hold 1/tp of the tokens (Megatron's sequence parallelism; parallel/tensor_parallel.h).
  bool sequence_parallel = false;
  // GPUs, with sequence parallelism: backward's re-gather of each block's saved input runs
  // beside the block before it (parallel.tensor_overlap; parallel/tensor_parallel_cuda.h).
  // false gathers on the compute stream when the block needs it (for comparison).
  bool tensor_overlap = true;
  // Under context parallelism (the mesh's cp > 1): how the sequence mixers see the rest of the
  // sequence (parallel.context_mode; parallel/context_parallel.h): the all-gather of k, v (and
  // LASP-2's of states), the ring of k, v blocks (and LASP-1's states; CPU ranks, and on GPUs for
  // all-linear models), or heads by all-to-all (CPU ranks).
  parallel::ContextMode context_mode = parallel::ContextMode::kAllGather;
  // Under TSP: whether the vocabulary tables' rows travel or the tokens do (parallel.tsp_tables;
  // parallel/tsp_tables.h).
  parallel::TspTables tsp_tables = parallel::TspTables::kAuto;
};

struct LossParts {
  double total = 0, ce = 0, aux = 0, z = 0;  // aux and z: unweighted sums over MoE layers
};

// Throws keel::UsageError (one line naming the model) for anything keel train cannot train yet
// or for micro_batch / seq_length / ce_chunk out of range. Every backend calls it first.
void validate_trainable(const model::ModelConfig& cfg, const ModelOptions& opt);
// 6 x active matmul parameters (LM head included) x tokens + causal attention, fwd + bwd.
double model_flops_per_micro_batch(const model::ModelConfig& cfg, int micro_batch, int seq_length);

// What the balancing controller remembers besides the biases: the Adam rule's moments or the
// Pid rule's last two errors, one [classes] vector per MoE layer (empty under sign and
// proportional, which keep none), the rule that wrote them, and the number of updates so far
// (Adam's bias correction). Train state: checkpoints carry it.
struct BalanceMemory {
  std::vector<std::vector<float>> m, v;
  std::int64_t updates = 0;
  ops::bias_controller::Rule rule = ops::bias_controller::Rule::Adam;
};

// Aux-loss-free balancing from expert loads (one vector per MoE layer, summed since the last
// update), by the controller `c` (ops::bias_controller::update for each layer; ModelOptions says
// each rule). The biases stay where they are kept (`bias`); `memory` is sized on first use, and
// started again at zero when another rule wrote it. Shared by the CPU and CUDA backends.
void update_balancing_bias(const std::vector<std::vector<std::int64_t>>& load, const ops::bias_controller::Config& c,
                           std::vector<std::vector<float>>& bias, BalanceMemory& memory);
// ModelOptions' controller (rule, rate, gains).
ops::bias_controller::Config balance_config(const ModelOptions& options);
// The aux loss weight the model's routers train with: mlp_router_aux_weight for ZAYA1's MLP
// router, aux_loss_weight for the linear one.
double aux_loss_weight(const model::ModelConfig& cfg, const ModelOptions& options);

class MoeTransformer {
 public:
  // With expert parallelism (mesh.expert().size > 1) this rank holds E / ep experts of every MoE
  // layer (model::param_layout) and the tokens travel to them (parallel/expert_parallel.h).
  MoeTransformer(const model::ModelConfig& config, const ModelOptions& options, const parallel::Mesh& mesh = {});
  ~MoeTransformer();

  const model::ModelConfig& config() const { return cfg_; }
  const ModelOptions& options() const { return opt_; }
  // Names, shapes, offsets (floats) of every parameter: the optimizer's and checkpoint's view.
  const optim::ParamLayout& layout() const { return layout_; }
  float* params() const { return params_; }
  float* grads() const { return grads_; }
  std::int64_t param_floats() const { return layout_.total_floats; }
  std::int64_t param_count() const;  // without padding
  Arena& param_arena() { return *param_arena_; }
  Arena& grad_arena() { return *grad_arena_; }
  Arena& act_arena() { return *act_arena_; }
  // Tensor view of a parameter / its gradient by name (throws on an unknown name).
  Tensor param(const std::string& name) const;
  Tensor grad(const std::string& name) const;

  // Re-initializes parameters from options.init_seed (model::init_parameters) and resets the
  // router biases: 0, and -1 for the skip class (ZAYA1).
  void init_parameters();
  void zero_grads();

  // tokens: B*T input ids, targets: B*T int32 labels (-1 ignored), whole sequences. Returns the
  // loss parts of this micro-batch; keeps what backward needs. Adds the routing counts of this
  // rank's tokens to the load counters. Under context parallelism (the mesh's cp > 1) every rank
  // of the context group passes the same micro-batch, runs its zigzag chunks of each sequence
  // (parallel/context_parallel.h) and returns the whole micro-batch's losses; backward gives
  // this rank's share of the gradients (they sum over the data group, which spans cp).
  LossParts forward(const std::uint32_t* tokens, const std::int32_t* targets);
  // After forward(), for keel eval's --logprobs (tensor degree 1 only; keel::Error otherwise):
  // each of the B*T rows' log-probability of its target, log softmax(logits)[target] = logit -
  // logsumexp (0 where the target is ignored), into logprob[N]; with top_k > 0 also the top_k
  // most likely ids of every row and their log-probabilities, most likely first, into
  // top_ids[N * top_k] and top_logprob[N * top_k] (top_k <= vocab_size).
  void token_logprobs(int top_k, float* logprob, std::int32_t* top_ids, float* top_logprob) const;
  // Accumulates d(loss_scale * total loss)/d(params) into the gradient arena.
  void backward(float loss_scale = 1.0f);

  // MoE layers (in layer order): index of each in [0, layers) and its load counters, summed
  // over every forward since the last reset_load(). One counter per router class: E, plus the
  // skip class last (tokens that ran no expert) when router_skip_expert is on.
  const std::vector<int>& moe_layers() const { return moe_layer_ids_; }
  const std::vector<std::int64_t>& load(int moe_index) const { return load_[moe_index]; }
  void reset_load();
  // Replaces the counters of one MoE layer (the data-parallel sum; throws on a size mismatch).
  void set_load(int moe_index, const std::vector<std::int64_t>& counts);
  // Router selection biases, one [classes] vector per MoE layer (state, not parameters).
  std::vector<float>& router_bias(int moe_index) { return bias_[moe_index]; }
  // The balancing controller's memory (Adam's moments; see BalanceMemory).
  BalanceMemory& balance_memory() { return balance_; }
  // Aux-loss-free balancing (ModelOptions::balance_rule at bias_update_rate) from the load
  // counters; then resets them. The biases stay fixed when the rate is 0.
  void update_router_bias();

  // TSP's weight shards (parallel/tsp.h), null at tsp degree 1.
  const parallel::TspShards* tsp() const { return plan_.tsp(); }

  // FLOPs of one forward+backward of a micro-batch (6 * active matmul params * tokens +
  // attention), for MFU.
  double flops_per_micro_batch() const;

 private:
  struct LayerActs {
    Tensor h1, rstd1, x_mid, h2, rstd2;
    Tensor attn_out;  // residual scaling: the attention stage output
    std::vector<blocks::AttnSaved> attn;  // one per weight shard (TSP; else one)
    std::vector<blocks::MlpSaved> mlp;
  };
  void allocate_params();
  void plan_acts(ArenaPlanner& p);
  LayerActs& acts_for(int l) { return acts_[opt_.recompute == Recompute::kFull ? 0 : static_cast<std::size_t>(l)]; }
  blocks::AttnContext attn_context(int l) const;
  blocks::EdaIo eda(int m) const;
  // The attention sub-block: y = attn(h); backward dh (overwritten) from dy. Once, or under TSP
  // once per weight shard (parallel/tsp.h).
  void attention_forward(int l, LayerActs& a, const Tensor& h, const Tensor& y);
  void attention_backward(int l, LayerActs& a, const Tensor& h, const Tensor& dy, const Tensor& dh);
  void mlp_forward(int l, LayerActs& a, bool count_load, LossParts& lp, const Tensor& y);
  void mlp_backward(int l, LayerActs& a, const Tensor& dy, const Tensor& dh);
  void layer_forward(int l, LayerActs& a, const Tensor& x_in, const Tensor& x_out, bool count_load, LossParts& lp);
  void layer_backward(int l, LayerActs& a, const Tensor& x_in, const Tensor& dres);
  void scaled_layer_forward(int l, LayerActs& a, const Tensor& r_out, const Tensor& h_out, bool count_load,
                            LossParts& lp);
  void scaled_layer_backward(int l, LayerActs& a);
  void embed_forward();
  void embed_backward();
  float head_forward();
  void head_backward(float loss_scale);
  std::int64_t vocab_begin() const;  // the first vocabulary row this rank holds
  // The tensor group the embedding and the head split the vocabulary over, null when whole or
  // under TSP (whose tables are visited shard by shard, or gathered over: gather_tables_).
  const parallel::TensorGroup* vocab_group() const;
  // parallel.tsp_tables gather: the embedding and the head over every token of the micro-batch
  // (the group's, rank order), their rows staying here.
  void gathered_embed_forward();
  void gathered_embed_backward();
  float gathered_head_forward();
  void gathered_head_backward(float loss_scale);

  model::ModelConfig cfg_;
  ModelOptions opt_;
  parallel::Mesh mesh_;
  parallel::CpuPlan plan_;  // each layer's runners
  blocks::TensorSplit tp_;  // this rank in its tensor group
  blocks::TensorSplit vocab_;  // this rank's split of the vocabulary (tensor, or tsp under TSP)
  int shards_ = 1;          // weight shards each sub-block runs over: the tsp degree (parallel/tsp.h)
  int cp_ = 1;              // the ranks sharing each sequence (context or tsp degree): this rank holds 1/cp_ of it
  double ce_share_ = 1.0;   // this rank's share of the micro-batch's valid targets (its CE gradient weight)
  bool gather_tables_ = false;  // TSP: parallel.tsp_tables resolved to gather
  std::int64_t rows_ = 0;   // rows of the residual stream on this rank (N, or N / tp with sequence parallelism)
  optim::ParamLayout layout_;
  std::unique_ptr<Arena> param_arena_, grad_arena_, act_arena_;
  float* params_ = nullptr;
  float* grads_ = nullptr;
  blocks::RopeTables ropes_;  // each layer's rotary table (sliding layers may have their own)
  blocks::WeightViews w_, g_;  // the parameters and the gradients, by role
  blocks::AttnShape attn_shape_;  // this rank's (TSP: weight shard 0's)
  blocks::MlpShape mlp_shape_;
  std::vector<blocks::AttnShape> attn_shards_;  // per weight shard (TSP; else [attn_shape_])
  std::vector<blocks::MlpShape> mlp_shards_;
  std::vector<int> moe_layer_ids_, moe_index_of_layer_;
  std::vector<model::AttentionKind> attn_kind_;  // per layer
  std::vector<LayerActs> acts_;  // one per layer (none) or one shared workspace (full)
  std::vector<Tensor> resid_;    // [layers + 1] residual stream (layer inputs, final output)
  std::vector<Tensor> hres_;     // [layers + 1] residual scaling: mixer output into layer l (l >= 1)
  std::vector<Tensor> eda_state_;  // per MoE stage: the MLP router's EDA state [N, router_hidden]
  // dL/d EDA state, alternating between consecutive MoE stages (under TSP only the pass that runs
  // the router's backward carries the chain)
  std::array<Tensor, 2> deda_;
  Tensor routing_dgates_;  // TSP: the weight shards' dL/d gates summed (blocks::SharedRouting)
  Tensor final_r_, final_h_, final_rstd_, ce_lse_, ce_scratch_;
  // tensor parallelism: [N, D] rows of every token (embedding, head); TSP gathering its
  // tables: [group x N, D], and every token's lse
  Tensor whole_a_, whole_b_, lse_all_;
  Tensor dres_, dtmp_, dtmp2_, dtmp3_, dhres_;
  blocks::AttnScratch attn_scratch_;
  blocks::MlpScratch mlp_scratch_;
  std::vector<std::uint32_t> tokens_, tokens_all_;  // tokens_all_, targets_all_: gather_tables_'s
  std::vector<std::int32_t> targets_, targets_all_, positions_;
  std::vector<std::vector<std::int64_t>> load_;
  std::vector<std::vector<float>> bias_;
  BalanceMemory balance_;
  bool have_forward_ = false;
  float cur_scale_ = 1.0f;
};

}  // namespace keel::train
