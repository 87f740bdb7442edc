#include "train/cuda_model_cuda.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>

#include "blocks/cuda/kernels.h"
#include "common/error.h"
#include "device/cuda_check.h"
#include "ops/cuda/cast.h"
#include "ops/cuda/causal_conv.h"
#include "ops/cuda/embedding.h"
#include "ops/cuda/residual_scale.h"
#include "ops/cuda/rmsnorm.h"
#include "parallel/tsp.h"

namespace keel::train {

namespace k = ops::cuda;
namespace bc = blocks::cuda;

// The saved tensors of one layer's forward (one set per layer, or one shared set with full
// recompute).
struct CudaModel::LayerActs {
  bf16 *h1 = nullptr, *h2 = nullptr;
  float *rstd1 = nullptr, *x_mid = nullptr, *rstd2 = nullptr;
  bf16* attn_out = nullptr;  // the attention block's output [N, D] (CCA, or residual scaling)
  bc::AttnSaved attn;
  bc::MlpSaved mlp;
  // TSP: the saved tensors of weight shards 1 .. D-1 (shard 0's are attn and mlp)
  std::vector<bc::AttnSaved> attn_more;
  std::vector<bc::MlpSaved> mlp_more;
  bc::AttnSaved& attn_of(int r) { return r == 0 ? attn : attn_more[static_cast<std::size_t>(r - 1)]; }
  bc::MlpSaved& mlp_of(int r) { return r == 0 ? mlp : mlp_more[static_cast<std::size_t>(r - 1)]; }
};

// The residual stream(s) and their gradients.
struct CudaModel::Stream {
  std::vector<float*> resid;      // [layers + 1] layer inputs and the final output, fp32 [N, D]
  std::vector<float*> hres;       // residual scaling: [layers + 1] the mixer output entering layer l
  std::vector<float*> eda_state;  // per MoE stage: the MLP router's EDA state [N, R]
  // dL/d EDA state, alternating between consecutive stages (under TSP only the pass that runs the
  // router's backward carries the chain)
  std::array<float*, 2> deda = {nullptr, nullptr};
  float* routing_dgates = nullptr;  // TSP: the weight shards' dL/d gates summed (bc::SharedRouting)
  float* spare = nullptr;               // full recompute: where a recomputed residual output goes
  float *final_r = nullptr, *dres = nullptr, *dhres = nullptr, *dh = nullptr;
  bf16 *dres_bf = nullptr, *dh_bf = nullptr;
};

// The final norm, the cross-entropy and the micro-batch's token ids.
struct CudaModel::Head {
  bf16* final_h = nullptr;
  float *final_rstd = nullptr, *lse = nullptr;
  k::cross_entropy::Result* result = nullptr;
  float* parts = nullptr;  // tensor parallelism: every rank's partial statistics of its vocabulary slice
  std::byte* scratch = nullptr;
  std::uint32_t* tokens = nullptr;
  std::int32_t *targets = nullptr, *positions = nullptr;
  // TSP gathering its tables: the group's token ids and targets, final hidden states (bf16) and
  // every token's lse, in rank order; an fp32 [group tokens, D] buffer (the embedding's partial
  // rows, its gathered output gradient, the head's input-gradient shares); the head's statistics
  // of every rank's tokens against this rank's rows, [rank][lse | target logit].
  std::uint32_t* tokens_all = nullptr;
  std::int32_t* targets_all = nullptr;
  bf16* hidden_all = nullptr;
  float *rows_all = nullptr, *lse_all = nullptr, *stats_out = nullptr;
};

CudaModel::CudaModel(const model::ModelConfig& cfg, const ModelOptions& options, const optim::ParamLayout& layout,
                     std::vector<bc::LayerRunners> runners, parallel::CudaTensorParallelLinear* tp,
                     parallel::CudaContextParallel* cp, std::size_t gpu_memory, cudaStream_t stream,
                     parallel::CudaTspShards* tsp)
    : cfg_(cfg), opt_(options), layout_(layout), runners_(std::move(runners)), tp_(tp), cp_(cp), tsp_(tsp),
      stream_(stream), st_(std::make_unique<Stream>()), head_(std::make_unique<Head>()) {
  validate_trainable(cfg_, opt_);
  // the attention kernels (CCA's too) need:
  if (cfg_.head_dim != 64 && cfg_.head_dim != 128)
    throw UsageError(fmt::format("model '{}': head_dim {}: the CUDA attention supports 64 and 128", cfg_.name,
                                 cfg_.head_dim));
  if (static_cast<int>(runners_.size()) != cfg_.layers)
    fail("cuda model: {} layers' runners for {} layers", runners_.size(), cfg_.layers);
  if (tsp_ && (tp_ || !cp_ || cp_->size() != tsp_->size()))
    fail("cuda model: TSP needs the context core over the tsp group and no tensor group");
  const int C = cp_ ? cp_->size() : 1;  // context parallelism (TSP): this rank's 1/C of each sequence
  const std::int64_t local_seq = opt_.seq_length / C;
  tokens_ = static_cast<std::int64_t>(opt_.micro_batch) * local_seq;
  // TSP slices the weights as tensor parallelism does, over the tsp group
  const blocks::TensorSplit split = tsp_ ? blocks::TensorSplit{tsp_->size(), tsp_->rank()}
                                         : blocks::TensorSplit{tp_ ? tp_->size() : 1, tp_ ? tp_->rank() : 0};
  shards_ = tsp_ ? tsp_->size() : 1;
  rows_ = tp_ ? tp_->rows(tokens_) : tokens_;
  vocab_local_ = cfg_.vocab_size / split.degree;
  vocab_begin_ = vocab_local_ * split.rank;
  gather_tables_ = tsp_ && parallel::tsp_gathers_tables(opt_.tsp_tables,
                                                         std::int64_t(opt_.micro_batch) * opt_.seq_length,
                                                         cfg_.vocab_size);
  if (gather_tables_) {  // the head's statistics come from each rank (its vocabulary rows)
    head_pieces_ = shards_;
  } else if (tsp_) {  // the head's statistics come piece by piece: every shard's rows in pieces (tsp_sizes)
    const std::int64_t piece = std::max<std::int64_t>(parallel::tsp_sizes(layout_, cfg_.layers).piece_rows, 1);
    head_pieces_ = static_cast<int>((vocab_local_ + piece - 1) / piece) * shards_;
  }
  if (tp_ && opt_.sequence_parallel != tp_->sequence())
    fail("cuda model: sequence parallelism {} in the options, {} in the runner", opt_.sequence_parallel, tp_->sequence());
  for (int l = 0; l < cfg_.layers; ++l) {
    moe_index_of_layer_.push_back(model::is_moe_layer(cfg_, l) ? static_cast<int>(moe_layer_ids_.size()) : -1);
    if (model::is_moe_layer(cfg_, l)) moe_layer_ids_.push_back(l);
    any_kind_ |= bc::AttnKinds::of(model::layer_attention_kind(cfg_, l));
  }
  scaled_ = cfg_.residual_scaling;
  // the CUDA CCA's limits (ops/cuda/cca.h), reported here rather than at the first step
  if (any_kind_.cca && (cfg_.cca_conv_width > k::causal_conv::kMaxWidth || cfg_.cca_group_conv_width > k::causal_conv::kMaxWidth ||
                   std::int64_t(cfg_.heads + cfg_.kv_heads) * cfg_.head_dim > 12288))
    throw UsageError(fmt::format("model '{}': the CUDA CCA takes conv widths <= {} and (heads + kv_heads) * "
                                 "head_dim <= 12288 (device: cpu trains it)",
                                 cfg_.name, k::causal_conv::kMaxWidth));
  attn_shape_ = bc::AttnShape::of(cfg_, opt_.micro_batch, local_seq, split);
  if (cp_) attn_shape_.segments = cp_->segments();
  for (int r = 0; r < shards_; ++r) {
    shard_shapes_.push_back(bc::AttnShape::of(cfg_, opt_.micro_batch, local_seq, {shards_, r}));
    shard_shapes_.back().segments = attn_shape_.segments;
  }
  mlp_shape_ = bc::MlpShape::of(cfg_, tokens_, opt_.renormalize_gates, split, opt_.forced_balance);
  // Keep the whole bf16 logits between forward and backward (no recomputed LM head) when they
  // take at most an eighth of the GPU; otherwise walk the vocabulary in ce_chunk chunks.
  // (TSP: never; the head's pieces pass one after another through the same scratch)
  ce_keep_logits_ = !tsp_ && static_cast<double>(tokens_) * vocab_local_ * 2 <= gpu_memory / 8.0;
  gemm_ = std::make_unique<k::GemmRunner>();
  layer_counts_.assign(moe_layer_ids_.size(), std::vector<std::int32_t>(static_cast<std::size_t>(classes()), 0));
  host_losses_.assign(moe_layer_ids_.size(), k::router::Losses{});
}

CudaModel::~CudaModel() = default;

CudaModel::LayerActs& CudaModel::acts_for(int l) {
  return acts_[opt_.recompute == Recompute::kFull ? 0 : static_cast<std::size_t>(l)];
}

k::cross_entropy::Slice CudaModel::vocab_slice() const { return {vocab_begin_, vocab_local_, cfg_.vocab_size}; }

k::cross_entropy::Options CudaModel::ce_options() const {
  k::cross_entropy::Options o;
  o.chunk = std::min<std::int64_t>(opt_.ce_chunk, vocab_local_);
  o.keep_logits = ce_keep_logits_;
  return o;
}

void CudaModel::carve(DeviceArena& A) {
  DeviceCarver& c = A.carver();
  // N: the rows a block reads; L: the residual stream's rows here (N / T under sequence
  // parallelism); R: the MLP router's width
  const std::int64_t N = tokens_, L = rows_, D = cfg_.hidden, R = std::max(cfg_.router_hidden, 1);
  const bool any_moe = !moe_layer_ids_.empty(), any_dense = moe_layer_ids_.size() < std::size_t(cfg_.layers);
  const bool zaya_moe = any_moe && mlp_shape_.mlp_router, full = opt_.recompute == Recompute::kFull;
  // with expert parallelism the experts' rows live at their rank (parallel/expert_parallel_cuda.h)
  bool expert_rows = true;
  for (const auto& r : runners_) expert_rows = expert_rows && r.experts == nullptr;
  Stream& st = *st_;
  const std::size_t start = c.used();
  st.resid.clear();
  for (int l = 0; l <= cfg_.layers; ++l) st.resid.push_back(c.take<float>(L * D));
  // residual scaling: hres[l] is the mixer output entering layer l (none for layer 0)
  st.hres.assign(static_cast<std::size_t>(cfg_.layers + 1), nullptr);
  if (scaled_)
    for (int l = 1; l <= cfg_.layers; ++l) st.hres[static_cast<std::size_t>(l)] = c.take<float>(L * D);
  // The MLP router's EDA state of each MoE stage: read by the next stage in forward and in
  // backward, so it lives outside the (possibly shared) layer sets.
  st.eda_state.assign(zaya_moe ? moe_layer_ids_.size() : 0, nullptr);
  for (auto& e : st.eda_state) e = c.take<float>(N * R);
  st.spare = full ? c.take<float>(L * D) : nullptr;
  const int sets = full ? 1 : cfg_.layers;
  acts_.assign(static_cast<std::size_t>(sets), LayerActs{});
  for (int i = 0; i < sets; ++i) {
    LayerActs& a = acts_[static_cast<std::size_t>(i)];
    const bool moe = sets == 1 ? any_moe : moe_index_of_layer_[static_cast<std::size_t>(i)] >= 0;
    const bool dense = sets == 1 ? any_dense : !moe;
    const bc::AttnKinds kinds = sets == 1 ? any_kind_ : bc::AttnKinds::of(model::layer_attention_kind(cfg_, i));
    const bool cca = kinds.cca;
    a.h1 = c.take<bf16>(L * D);
    a.rstd1 = c.take<float>(L);
    bc::carve(c, attn_shape_, kinds, a.attn);
    a.attn_more.assign(static_cast<std::size_t>(shards_ - 1), bc::AttnSaved{});
    for (int r = 1; r < shards_; ++r) bc::carve(c, shard_shapes_[static_cast<std::size_t>(r)], kinds, a.attn_of(r));
    // the attention block's output when it does not add into the stream inside its GEMM
    if (cca || scaled_ || tp_) a.attn_out = c.take<bf16>(L * D);
    a.x_mid = c.take<float>(L * D);
    a.h2 = c.take<bf16>(L * D);
    a.rstd2 = c.take<float>(L);
    // TSP: only this rank's own shard's pass routes (mlp_forward); the others keep no router state
    a.mlp_more.assign(static_cast<std::size_t>(shards_ - 1), bc::MlpSaved{});
    for (int r = 0; r < shards_; ++r)
      bc::carve(c, mlp_shape_, bc::MlpParts{dense, moe, expert_rows, !tsp_ || r == tsp_->rank()}, a.mlp_of(r));
  }
  saved_bytes_ = c.used() - start;
  // shared backward scratch
  st.dres = c.take<float>(L * D);
  st.dres_bf = c.take<bf16>(L * D);
  st.dh = c.take<float>(L * D);
  st.dh_bf = c.take<bf16>(N * D);  // also the routed experts' bf16 dx (N rows)
  bool dense_split = false;
  for (const auto& r : runners_) dense_split = dense_split || !r.mlp_linear->output_is_whole();
  bc::MlpScratchParts mp;
  // TSP: the routed passes after the first add into the block output through moe_out
  mp.dense = any_dense, mp.routed = any_moe, mp.backward = true, mp.residual_out = !scaled_ || tsp_;
  mp.dense_split = dense_split, mp.expert_rows = expert_rows;
  bc::carve(c, mlp_shape_, mp, mlp_scratch_);
  mlp_scratch_.dy = st.dres_bf;  // the blocks' bf16 [N, D] scratch is the model's
  mlp_scratch_.dx = st.dh_bf;
  bc::carve(c, attn_shape_, any_kind_, *runners_.front().attention, attn_scratch_);
  attn_scratch_.dh = st.dh;
  if (zaya_moe) st.deda = {c.take<float>(N * R), c.take<float>(N * R)};
  if (tsp_ && any_moe) st.routing_dgates = c.take<float>(N * std::max(cfg_.top_k, 1));
  if (scaled_) {
    st.dhres = c.take<float>(L * D);
    st.final_r = c.take<float>(L * D);
  }
  Head& h = *head_;
  h.final_h = c.take<bf16>(L * D);
  h.final_rstd = c.take<float>(L);
  h.lse = c.take<float>(N);
  h.result = c.take<k::cross_entropy::Result>(1);
  const std::size_t before_ce = c.used();
  h.scratch = c.take<std::byte>(
      static_cast<std::int64_t>(k::cross_entropy::scratch_bytes(N, D, vocab_local_, ce_options())));
  if (tp_) h.parts = c.take<float>(2 * N * tp_->size());
  if (tsp_) h.parts = c.take<float>(2 * N * head_pieces_);  // [lse | target logit] per piece
  ce_bytes_ = c.used() - before_ce;
  h.tokens = c.take<std::uint32_t>(N);
  h.targets = c.take<std::int32_t>(N);
  h.positions = c.take<std::int32_t>(N);
  if (gather_tables_) {
    const std::size_t before_tables = c.used();
    const std::int64_t all = N * shards_;
    h.tokens_all = c.take<std::uint32_t>(all);
    h.targets_all = c.take<std::int32_t>(all);
    h.hidden_all = c.take<bf16>(all * D);
    h.rows_all = c.take<float>(all * D);
    h.lse_all = c.take<float>(all);
    h.stats_out = c.take<float>(2 * all);
    tables_bytes_ = c.used() - before_tables;
  }
}

void CudaModel::bind(const Buffers& b) {
  auto f32 = [&](const optim::ParamInfo& p) { return b.params + p.offset; };
  auto b16 = [&](const optim::ParamInfo& p) { return b.params_bf16 + p.offset; };
  w_ = bc::device_weights(cfg_, layout_, f32, b16);
  g_ = bc::device_grads(cfg_, layout_, b.grads);
  bias_ = b.bias;
  if (tsp_) tsp_->bind(cfg_, layout_, b.params, b.params_bf16, b.grads);
  ropes_ = std::make_unique<bc::DeviceRopeTables>(
      blocks::make_rope_tables(cfg_, std::max(opt_.seq_length, cfg_.max_seq_len)));
  // each row's position in its sequence (context parallelism: this rank's zigzag chunks)
  std::vector<std::int32_t> pos(static_cast<std::size_t>(tokens_));
  const std::int64_t local_seq = tokens_ / opt_.micro_batch;
  for (std::int64_t i = 0; i < tokens_; ++i)
    pos[static_cast<std::size_t>(i)] =
        cp_ ? cp_->positions()[static_cast<std::size_t>(i % local_seq)] : static_cast<std::int32_t>(i % local_seq);
  // Host-to-device copies go on stream_ and are waited for: a plain cudaMemcpy from pageable
  // memory may return before its DMA lands, and kernels on this non-blocking stream do not
  // wait for the legacy stream (the first step then reads stale weights).
  KEEL_CUDA_CHECK(cudaMemcpyAsync(head_->positions, pos.data(), pos.size() * sizeof(std::int32_t),
                                  cudaMemcpyHostToDevice, stream_));
  KEEL_CUDA_CHECK(keel::stream_sync(stream_));
}

bc::AttnContext CudaModel::attn_context(int l) const {
  const bc::LayerRunners& r = runners_[static_cast<std::size_t>(l)];
  return {head_->positions, &ropes_->layer(l), model::attention_window(cfg_, l), r.attn_linear, r.attention,
          attn_scratch_.linear};
}

bc::EdaIo CudaModel::eda(int m) const {
  if (!mlp_shape_.mlp_router) return {};
  return {st_->eda_state[static_cast<std::size_t>(m)], m > 0 ? st_->eda_state[static_cast<std::size_t>(m - 1)] : nullptr};
}

LossParts CudaModel::forward(const std::uint32_t* tokens_host, const std::int32_t* targets_host,
                             parallel::StageHooks& hooks, std::vector<std::vector<std::int64_t>>& load) {
  const std::int64_t N = tokens_, V = cfg_.vocab_size, D = cfg_.hidden, L = rows_;
  const float eps = static_cast<float>(cfg_.norm_eps);
  Stream& st = *st_;
  Head& h = *head_;
  if (cp_) {  // this rank's rows of each sequence
    const std::int64_t S = opt_.seq_length, local_seq = N / opt_.micro_batch;
    host_tokens_.resize(static_cast<std::size_t>(N));
    host_targets_.resize(static_cast<std::size_t>(N));
    for (std::int64_t i = 0; i < N; ++i) {
      const std::int64_t at = i / local_seq * S + cp_->positions()[static_cast<std::size_t>(i % local_seq)];
      host_tokens_[static_cast<std::size_t>(i)] = tokens_host[at];
      host_targets_[static_cast<std::size_t>(i)] = targets_host[at];
    }
    tokens_host = host_tokens_.data();
    targets_host = host_targets_.data();
  }
  for (std::int64_t i = 0; i < N; ++i)
    if (tokens_host[i] >= static_cast<std::uint64_t>(V))
      fail("token id {} at position {} is outside the vocabulary ({})", tokens_host[i], i, V);
  KEEL_CUDA_CHECK(cudaMemcpyAsync(h.tokens, tokens_host, N * sizeof(std::uint32_t), cudaMemcpyHostToDevice, stream_));
  KEEL_CUDA_CHECK(cudaMemcpyAsync(h.targets, targets_host, N * sizeof(std::int32_t), cudaMemcpyHostToDevice, stream_));
  if (gather_tables_) {  // every rank's ids and targets, in rank order (int32 travels as its bits)
    parallel::NcclGroup& g = tsp_->group();
    g.all_gather(h.tokens, h.tokens_all, N, parallel::NcclType::kUint32, stream_);
    g.all_gather(h.targets, h.targets_all, N, parallel::NcclType::kUint32, stream_);
  }
  if (tp_) tp_->forget_prefetch();  // the saved block inputs are about to be rewritten
  hooks.forward_begin();
  hooks.before_stage(0);  // overlapped ZeRO-1: the parameters of each stage as they arrive
  mark("embedding fwd");
  embedding_forward();
  for (int l = 0; l < cfg_.layers; ++l) {
    if (scaled_)
      scaled_layer_forward(l, acts_for(l), st.resid[l + 1], st.hres[l + 1], /*count_load=*/true, hooks);
    else
      layer_forward(l, acts_for(l), st.resid[l], st.resid[l + 1], /*count_load=*/true, hooks);
  }
  hooks.before_stage(model::stage_count(cfg_.layers) - 1);
  mark("final norm + lm head + ce fwd");
  const float* final_in = st.resid[cfg_.layers];
  if (scaled_) {
    const bc::ResScale& F = w_.final_scale;
    k::residual_scale::merge_forward(st.resid[cfg_.layers], st.hres[cfg_.layers], F.r_bias, F.r_scale, F.h_bias,
                                     F.h_scale, st.final_r, L, D, stream_);
    final_in = st.final_r;
  }
  k::rmsnorm::forward(final_in, w_.final_norm, eps, h.final_h, h.final_rstd, L, D, stream_);
  head_forward();
  hooks.forward_end();
  // one sync: the loss, the router losses and the expert loads of this micro-batch
  LossParts lp;
  const k::cross_entropy::Result r = k::cross_entropy::read_result(h.result, stream_);
  lp.ce = r.loss;
  const int classes = this->classes();
  if (tsp_ && !layer_counts_.empty()) {
    // the routers saw this rank's tokens: the micro-batch's loads are the group's sums
    std::vector<double> counts;
    for (const auto& c : layer_counts_) counts.insert(counts.end(), c.begin(), c.end());
    cp_->sum(counts.data(), static_cast<int>(counts.size()));
    std::size_t at = 0;
    for (auto& c : layer_counts_)
      for (auto& x : c) x = static_cast<std::int32_t>(counts[at++]);
  }
  for (std::size_t m = 0; m < moe_layer_ids_.size(); ++m) {
    LayerActs& a = acts_for(moe_layer_ids_[m]);
    // (the MLP router's aux loss over its classes, reported and trained where its weight is
    // set; it has no z loss)
    const auto losses = opt_.recompute == Recompute::kNone || moe_layer_ids_.size() == 1
                            ? k::router::read_losses(bc::router_losses(a.mlp), stream_)
                            : host_losses_[m];
    lp.aux += losses.aux;
    if (!mlp_shape_.mlp_router) lp.z += losses.z;
    for (int e = 0; e < classes; ++e) load[m][static_cast<std::size_t>(e)] += layer_counts_[m][static_cast<std::size_t>(e)];
  }
  ce_share_ = 1.0;
  if (cp_) {
    // The micro-batch's losses on every rank of the context group: the cross-entropy over all
    // of its valid targets, the router losses' means over the ranks.
    // Gathering TSP's tables, the head's backward takes every rank's tokens: each one's share.
    const double valid = r.valid, C = cp_->size();
    std::vector<double> parts = {lp.ce * valid, valid, lp.aux, lp.z};
    if (gather_tables_) {
      parts.resize(4 + static_cast<std::size_t>(shards_), 0.0);
      parts[4 + static_cast<std::size_t>(tsp_->rank())] = valid;
    }
    cp_->sum(parts.data(), static_cast<int>(parts.size()));
    ce_share_ = parts[1] > 0 ? valid / parts[1] : 0.0;  // this rank's CE gradient weight
    valid_share_.assign(parts.begin() + 4, parts.end());
    for (double& v : valid_share_) v = parts[1] > 0 ? v / parts[1] : 0.0;
    lp.ce = parts[1] > 0 ? parts[0] / parts[1] : 0.0;
    lp.aux = parts[2] / C;
    lp.z = parts[3] / C;
  }
  lp.total = lp.ce + aux_loss_weight(cfg_, opt_) * lp.aux + opt_.z_loss_weight * lp.z;
  have_forward_ = true;
  return lp;
}

const char* CudaModel::attention_phase(bool backward) const {
  if (backward) return "attention block bwd";
  return recomputing_ ? "attention block fwd (recompute)" : "attention block fwd";
}

const char* CudaModel::mlp_phase(int l, bool backward) const {
  const bool moe = moe_index_of_layer_[static_cast<std::size_t>(l)] >= 0;
  if (backward) return moe ? "moe block bwd" : "mlp block bwd";
  if (recomputing_) return moe ? "moe block fwd (recompute)" : "mlp block fwd (recompute)";
  return moe ? "moe block fwd" : "mlp block fwd";
}

// ---- the embedding and the LM head: whole at tensor degree 1, else vocabulary-parallel ----
// (over the tensor group; under TSP every shard's rows visit this rank in pieces: tsp_cuda.h)

// resid[0] = the token rows of the table. The lookup reads the bf16 working copy, as the GEMMs
// do (bf16 mixed precision): under data parallelism the table then travels in bf16, half the
// bytes the forward waits for. Tensor parallelism: each rank looks up the tokens in its
// vocabulary rows (zeros elsewhere) and the partials are summed over the group (into this
// rank's rows under sequence parallelism). TSP: this rank's tokens in each piece, summed here.
void CudaModel::embedding_forward() {
  const std::int64_t N = tokens_, V = cfg_.vocab_size, D = cfg_.hidden;
  float* resid0 = st_->resid[0];
  if (gather_tables_) return gathered_embedding_forward();
  if (tsp_) {
    bool first = true;
    return tsp_->forward(parallel::CudaTspShards::Part::kEmbedding, stream_,
                         [&](int, std::int64_t begin, std::int64_t rows, const bf16* w, float*) {
                           float* out = first ? resid0 : tsp_->scratch_f32();
                           k::embedding::forward_bf16_table_slice(head_->tokens, N, w, out, begin, rows, V, D, stream_);
                           if (!first) bc::add_f32(resid0, out, resid0, N * D, stream_);
                           first = false;
                         });
  }
  if (!tp_) return k::embedding::forward_bf16_table(head_->tokens, N, w_.embed, resid0, V, D, stream_);
  float* partial = tp_->out(resid0, N, D);
  k::embedding::forward_bf16_table_slice(head_->tokens, N, w_.embed, partial, vocab_begin_, vocab_local_, V, D, stream_);
  tp_->exit(partial, resid0, N, D, stream_);
}

// st.dres = dL/d resid[0] (this rank's rows) into the table's gradient (this rank's vocabulary
// rows under tensor parallelism, from every token's row; under TSP each piece's, summed on the
// piece's rank).
void CudaModel::embedding_backward() {
  const std::int64_t N = tokens_, V = cfg_.vocab_size, D = cfg_.hidden;
  if (gather_tables_) return gathered_embedding_backward();
  if (tsp_)
    return tsp_->backward(parallel::CudaTspShards::Part::kEmbedding, stream_,
                          [&](int, std::int64_t begin, std::int64_t rows, const bf16*, float* g) {
                            k::embedding::backward_slice(head_->tokens, N, st_->dres, g, begin, rows, V, D, stream_);
                          });
  if (!tp_) return k::embedding::backward(head_->tokens, N, st_->dres, g_.embed, V, D, stream_);
  const float* d = tp_->exit_backward(static_cast<const float*>(st_->dres), N, D, stream_);
  k::embedding::backward_slice(head_->tokens, N, d, g_.embed, vocab_begin_, vocab_local_, V, D, stream_);
}

// The final hidden states (every token's: gathered under sequence parallelism) through the LM
// head into the loss: the whole vocabulary, or this rank's slice, whose partial statistics are
// all-gathered over the group and combined, the same on every rank; never the whole logits.
// TSP: this rank's tokens against every piece of the vocabulary, the pieces' statistics
// combined here.
void CudaModel::head_forward() {
  const std::int64_t N = tokens_, V = cfg_.vocab_size, D = cfg_.hidden;
  Head& h = *head_;
  const std::int64_t part = 2 * N;  // [lse_r | target logit_r] per rank (piece)
  if (gather_tables_) return gathered_head_forward();
  if (tsp_) {
    int piece = 0;
    tsp_->forward(parallel::CudaTspShards::Part::kHead, stream_,
                  [&](int, std::int64_t begin, std::int64_t rows, const bf16* w, float*) {
                    if (piece >= head_pieces_) fail("cuda model: more head pieces than {}", head_pieces_);
                    k::cross_entropy::slice_forward(h.final_h, w, h.targets, N, D, {begin, rows, V}, ce_options(),
                                                    h.parts + part * piece++, h.scratch, stream_);
                  });
    return k::cross_entropy::combine(h.parts, piece, h.targets, N, V, ce_options(), h.lse, h.result, stream_);
  }
  if (!tp_)
    return k::cross_entropy::forward(h.final_h, w_.lm_head, h.targets, N, D, V, ce_options(), h.lse, h.result,
                                     h.scratch, stream_);
  const bf16* hidden = tp_->enter(h.final_h, N, D, stream_);
  float* mine = h.parts + part * tp_->rank();
  k::cross_entropy::slice_forward(hidden, w_.lm_head, h.targets, N, D, vocab_slice(), ce_options(), mine, h.scratch,
                                  stream_);
  tp_->group().all_gather(mine, h.parts, part, parallel::NcclType::kFloat32, stream_);
  k::cross_entropy::combine(h.parts, tp_->size(), h.targets, N, V, ce_options(), h.lse, h.result, stream_);
}

// st.dh_bf = dL/d final_h (this rank's rows) and the LM head's gradient (this rank's slice).
void CudaModel::head_backward(float loss_scale, bool grads_fresh) {
  const std::int64_t N = tokens_, V = cfg_.vocab_size, D = cfg_.hidden;
  Stream& st = *st_;
  Head& h = *head_;
  k::cross_entropy::Options ce = ce_options();
  ce.overwrite_dw = grads_fresh;  // the LM head's gradient is written first (a tied table's scatter-add follows)
  if (tsp_) {
    bool first = true;
    tsp_->backward(parallel::CudaTspShards::Part::kHead, stream_,
                   [&](int, std::int64_t begin, std::int64_t rows, const bf16* w, float* g) {
                     float* share = first ? st.dh : tsp_->scratch_f32();
                     k::cross_entropy::slice_backward(h.final_h, w, h.targets, h.lse, loss_scale, N, D, {begin, rows, V},
                                                      ce, h.scratch, share, g, stream_);
                     if (!first) bc::add_f32(st.dh, share, st.dh, N * D, stream_);
                     first = false;
                   });
    return k::f32_to_bf16(st.dh, st.dh_bf, N * D, stream_);
  }
  if (!tp_)
    return k::cross_entropy::backward(h.final_h, w_.lm_head, h.targets, h.lse, loss_scale, N, D, V, ce, h.scratch,
                                      st.dh_bf, g_.lm_head, stream_);
  const bf16* hidden = tp_->enter(h.final_h, N, D, stream_);
  // the last layer's MLP input gathers beside the LM head's backward (saved since forward;
  // under full recompute it is recomputed first)
  if (opt_.tensor_overlap && opt_.recompute != Recompute::kFull)
    tp_->prefetch(acts_for(cfg_.layers - 1).h2, N, D, stream_);
  float* partial = tp_->dx_out(st.dh, N, D);
  k::cross_entropy::slice_backward(hidden, w_.lm_head, h.targets, h.lse, loss_scale, N, D, vocab_slice(), ce,
                                   h.scratch, partial, g_.lm_head, stream_);
  tp_->enter_backward(partial, st.dh, N, D, stream_);
  k::f32_to_bf16(st.dh, st.dh_bf, rows_ * D, stream_);
}

// ---- TSP gathering its tables (parallel.tsp_tables: gather; parallel/tsp_tables.h): the
// group's tokens meet this rank's vocabulary rows, which never travel. The group's rows are in
// rank order: rank q's tokens at [q N, (q + 1) N). Collectives on the model's stream, over the
// tsp group's communicator. ----

// resid[0] (this rank's tokens) = the sum over the group of each rank's lookup of every token in
// its rows (zeros elsewhere): a reduce-scatter.
void CudaModel::gathered_embedding_forward() {
  const std::int64_t N = tokens_, V = cfg_.vocab_size, D = cfg_.hidden;
  Head& h = *head_;
  k::embedding::forward_bf16_table_slice(h.tokens_all, N * shards_, w_.embed, h.rows_all, vocab_begin_, vocab_local_,
                                         V, D, stream_);
  tsp_->group().reduce_scatter_sum(h.rows_all, st_->resid[0], N * D, parallel::NcclType::kFloat32, stream_);
}

// Every rank's dL/d resid[0] gathered; this rank's rows take the tokens that fall in them.
void CudaModel::gathered_embedding_backward() {
  const std::int64_t N = tokens_, V = cfg_.vocab_size, D = cfg_.hidden;
  Head& h = *head_;
  tsp_->group().all_gather(st_->dres, h.rows_all, N * D, parallel::NcclType::kFloat32, stream_);
  k::embedding::backward_slice(h.tokens_all, N * shards_, h.rows_all, g_.embed, vocab_begin_, vocab_local_, V, D,
                               stream_);
}

// Every rank's final hidden states gathered; each rank's tokens scored against this rank's rows
// ([lse | target logit] of the slice, cross_entropy.h's step 1), which go to that rank (an
// all-to-all); each rank combines its tokens' statistics from every rank's rows (step 2), as the
// other layouts do.
void CudaModel::gathered_head_forward() {
  const std::int64_t N = tokens_, V = cfg_.vocab_size, D = cfg_.hidden, part = 2 * N;
  Head& h = *head_;
  parallel::NcclGroup& g = tsp_->group();
  const int me = g.rank();
  g.all_gather(h.final_h, h.hidden_all, N * D, parallel::NcclType::kBfloat16, stream_);
  for (int q = 0; q < shards_; ++q)
    k::cross_entropy::slice_forward(h.hidden_all + q * N * D, w_.lm_head, h.targets_all + q * N, N, D, vocab_slice(),
                                    ce_options(), h.stats_out + q * part, h.scratch, stream_);
  g.group_start();
  for (int q = 0; q < shards_; ++q) {
    if (q == me) continue;
    g.send(h.stats_out + q * part, part, parallel::NcclType::kFloat32, q, stream_);
    g.recv(h.parts + q * part, part, parallel::NcclType::kFloat32, q, stream_);
  }
  g.group_end();
  KEEL_CUDA_CHECK(cudaMemcpyAsync(h.parts + me * part, h.stats_out + me * part, part * sizeof(float),
                                  cudaMemcpyDeviceToDevice, stream_));
  k::cross_entropy::combine(h.parts, shards_, h.targets, N, V, ce_options(), h.lse, h.result, stream_);
}

// loss_scale: of the micro-batch's loss (every token's). Each rank's tokens through this rank's
// rows at that rank's share of the valid targets (slice_backward divides by the valid targets
// it is given); the input-gradient shares reduce-scattered to the tokens' ranks.
void CudaModel::gathered_head_backward(float loss_scale, bool grads_fresh) {
  const std::int64_t N = tokens_, D = cfg_.hidden;
  Stream& st = *st_;
  Head& h = *head_;
  parallel::NcclGroup& g = tsp_->group();
  if (static_cast<int>(valid_share_.size()) != shards_) fail("cuda model: the head's backward before its forward");
  g.all_gather(h.lse, h.lse_all, N, parallel::NcclType::kFloat32, stream_);
  k::cross_entropy::Options ce = ce_options();
  ce.overwrite_dw = grads_fresh;  // the LM head's gradient is written first (a tied table's scatter-add follows)
  for (int q = 0; q < shards_; ++q) {
    k::cross_entropy::slice_backward(h.hidden_all + q * N * D, w_.lm_head, h.targets_all + q * N, h.lse_all + q * N,
                                     static_cast<float>(loss_scale * valid_share_[static_cast<std::size_t>(q)]), N, D,
                                     vocab_slice(), ce, h.scratch, h.rows_all + q * N * D, g_.lm_head, stream_);
    ce.overwrite_dw = false;
  }
  g.reduce_scatter_sum(h.rows_all, st.dh, N * D, parallel::NcclType::kFloat32, stream_);
  k::f32_to_bf16(st.dh, st.dh_bf, N * D, stream_);
}

// A routed or dense MLP block: y = residual + mlp(a.h2) (residual null: y = mlp(a.h2)).
// Records the layer's loads when count_load.
// Under TSP once per weight shard, in the shards' ring order (this rank's own first): the first
// pass writes y (= residual + its partial), the later ones pass y as their residual (their
// partials add in); the first pass routes (its loads and losses are the layer's) and the later
// ones take its routing (no router, no host sync).
void CudaModel::mlp_forward(int l, LayerActs& a, const float* residual, float* y, bool count_load) {
  const int m = moe_index_of_layer_[static_cast<std::size_t>(l)];
  const bc::LayerRunners& r = runners_[static_cast<std::size_t>(l)];
  const float* bias = m >= 0 ? bias_ + std::int64_t(m) * classes() : nullptr;
  if (tsp_)
    tsp_->forward(l, parallel::CudaTspShards::Part::kMlp, stream_, [&](int shard, const bc::LayerWeights& w) {
      const bool routes = tsp_->first();  // this rank's own shard
      bc::mlp_forward(*gemm_, mlp_shape_, w, bias, a.h2, eda(std::max(m, 0)), routes ? residual : y, y, a.mlp_of(shard),
                      mlp_scratch_, tsp_->boundary(), r.experts_of(shard), stream_,
                      routes ? nullptr : &a.mlp_of(tsp_->rank()));
    });
  else
    bc::mlp_forward(*gemm_, mlp_shape_, w_.layers[static_cast<std::size_t>(l)], bias, a.h2, eda(std::max(m, 0)),
                    residual, y, a.mlp, mlp_scratch_, *r.mlp_linear, r.experts, stream_);
  if (m < 0 || !count_load) return;
  bc::mlp_loads(mlp_shape_, a.mlp, layer_counts_[static_cast<std::size_t>(m)].data());
  if (opt_.recompute == Recompute::kFull)
    host_losses_[static_cast<std::size_t>(m)] = k::router::read_losses(bc::router_losses(a.mlp), stream_);
}

// Plain pre-norm layer: x_mid = x_in + attn(n1(x_in)); x_out = x_mid + mlp(n2(x_mid)).
void CudaModel::layer_forward(int l, LayerActs& a, const float* x_in, float* x_out, bool count_load,
                              parallel::StageHooks& hooks) {
  const bc::LayerWeights& W = w_.layers[static_cast<std::size_t>(l)];
  const std::int64_t N = rows_, D = cfg_.hidden;  // this rank's rows of the residual stream
  const float eps = static_cast<float>(cfg_.norm_eps);
  hooks.before_stage(1 + 2 * l);
  mark(attention_phase(false));
  k::rmsnorm::forward(x_in, W.attn_norm, eps, a.h1, a.rstd1, N, D, stream_);
  KEEL_CUDA_CHECK(cudaMemcpyAsync(a.x_mid, x_in, N * D * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
  attention_forward(l, a, a.x_mid, a.attn_out);
  hooks.before_stage(2 + 2 * l);
  mark(mlp_phase(l, false));
  k::rmsnorm::forward(a.x_mid, W.mlp_norm, eps, a.h2, a.rstd2, N, D, stream_);
  mlp_forward(l, a, a.x_mid, x_out, count_load);
}

// ZAYA1 residual scaling (MoeTransformer::scaled_layer_forward): layer l takes (resid[l],
// hres[l]) (layer 0: the embedding only) and gives
//   r1 = merge_attn(r, h) (layer 0: (emb + b_h) * s_h) -> a.x_mid;  ya = attn(n1(r1)) -> a.attn_out
//   r2 = merge_mlp(r1, ya) -> r_out;  ym = mlp(n2(r2)) -> h_out (fp32)
void CudaModel::scaled_layer_forward(int l, LayerActs& a, float* r_out, float* h_out, bool count_load,
                                     parallel::StageHooks& hooks) {
  const bc::LayerWeights& W = w_.layers[static_cast<std::size_t>(l)];
  const std::int64_t N = rows_, D = cfg_.hidden;  // this rank's rows of the residual stream
  const float eps = static_cast<float>(cfg_.norm_eps);
  const bc::ResScale &A = W.attn_scale, &M = W.mlp_scale;
  Stream& st = *st_;
  hooks.before_stage(1 + 2 * l);
  mark(attention_phase(false));
  if (l == 0)
    k::residual_scale::forward(st.resid[0], A.h_bias, A.h_scale, a.x_mid, N, D, stream_);
  else
    k::residual_scale::merge_forward(st.resid[static_cast<std::size_t>(l)], st.hres[static_cast<std::size_t>(l)], A.r_bias,
                                     A.r_scale, A.h_bias, A.h_scale, a.x_mid, N, D, stream_);
  k::rmsnorm::forward(a.x_mid, W.attn_norm, eps, a.h1, a.rstd1, N, D, stream_);
  attention_forward(l, a, nullptr, a.attn_out);
  hooks.before_stage(2 + 2 * l);
  mark(mlp_phase(l, false));
  k::residual_scale::merge_forward(a.x_mid, a.attn_out, M.r_bias, M.r_scale, M.h_bias, M.h_scale, r_out, N, D, stream_);
  k::rmsnorm::forward(r_out, W.mlp_norm, eps, a.h2, a.rstd2, N, D, stream_);
  mlp_forward(l, a, nullptr, h_out, count_load);
}

void CudaModel::backward(float loss_scale, bool grads_fresh, parallel::StageHooks& hooks) {
  if (!have_forward_) fail("model: backward() without a forward()");
  cur_scale_ = loss_scale;
  const std::int64_t N = tokens_, D = cfg_.hidden, L = rows_;
  Stream& st = *st_;
  Head& h = *head_;
  mark("lm head + ce + final norm bwd");
  if (gather_tables_)
    gathered_head_backward(loss_scale, grads_fresh);  // each rank's tokens at its share
  else
    head_backward(static_cast<float>(loss_scale * ce_share_), grads_fresh);  // st.dh_bf = dL/d final_h
  KEEL_CUDA_CHECK(cudaMemsetAsync(st.dres, 0, L * D * sizeof(float), stream_));
  k::rmsnorm::backward(scaled_ ? st.final_r : st.resid[cfg_.layers], w_.final_norm, h.final_rstd, st.dh_bf, st.dres,
                       g_.final_norm, L, D, stream_);
  if (scaled_) {  // dres = dL/d resid[L], dhres = dL/d hres[L]
    const bc::ResScale& F = w_.final_scale;
    const bc::ResScaleGrads& dF = g_.final_scale;
    k::residual_scale::merge_backward(st.resid[cfg_.layers], st.hres[cfg_.layers], F.r_bias, F.r_scale, F.h_bias,
                                      F.h_scale, st.dres, st.dres, st.dhres, dF.r_bias, dF.r_scale, dF.h_bias,
                                      dF.h_scale, L, D, stream_);
  }
  hooks.grads_final(model::stage_count(cfg_.layers) - 1);
  const bool full = opt_.recompute == Recompute::kFull;
  for (int l = cfg_.layers - 1; l >= 0; --l) {
    LayerActs& a = acts_for(l);
    if (scaled_) {
      // Recompute: the residual output goes to the spare (resid[l + 1] already holds it and the
      // MLP-norm backward reads it there); the mixer output to hres[l + 1], which only layer
      // l + 1's backward read, and that has run.
      recomputing_ = true;
      if (full)
        scaled_layer_forward(l, a, st.spare, st.hres[static_cast<std::size_t>(l) + 1], /*count_load=*/false, hooks);
      recomputing_ = false;
      scaled_layer_backward(l, a, grads_fresh, hooks);
    } else {
      recomputing_ = true;
      if (full) layer_forward(l, a, st.resid[static_cast<std::size_t>(l)], st.spare, /*count_load=*/false, hooks);
      recomputing_ = false;
      layer_backward(l, a, st.resid[static_cast<std::size_t>(l)], grads_fresh, hooks);
    }
  }
  if (tp_) tp_->forget_prefetch();
  hooks.layers_done();
  mark("embedding bwd");
  if (!hooks.take_embedding_grads(h.tokens, st.dres, N)) {
    embedding_backward();
    hooks.grads_final(0);
  }
  have_forward_ = false;
}

// The MLP block's backward: dy fp32 [N, D] = dL/d(block output) -> st.dh = dL/d a.h2 (fp32).
void CudaModel::mlp_backward(int l, LayerActs& a, const float* dy, bool grads_fresh) {
  const int m = moe_index_of_layer_[static_cast<std::size_t>(l)];
  const bc::LayerRunners& r = runners_[static_cast<std::size_t>(l)];
  // shard: the weight shard's pass (0 but under TSP); own_grads: g is this rank's gradients
  const auto run = [&](int shard, const bc::LayerWeights& w, bc::LayerGrads g, bool own_grads,
                       bc::LinearRunner& linear) {
    // this rank's expert gradients are written by the step's first backward; a TSP shard buffer
    // is fresh for every pass
    g.experts.overwrite = own_grads ? grads_fresh : true;
    // The router losses' gradient terms are whole on every tensor rank, the rest of the router's
    // gradient a partial sum (summed over the group with the other partial gradients): the
    // first tensor rank adds them, once. Under TSP the passes share the first one's routing
    // (mlp_forward), and the ring's last pass (shard rank + 1) runs the router's backward once,
    // on every pass's dL/d gates summed. Context parallelism and TSP: the micro-batch's router
    // losses are the mean of the ranks'.
    const int last = tsp_ ? (tsp_->rank() + 1) % tsp_->size() : 0;
    const bool router_pass = tsp_ ? shard == last : !(tp_ && tp_->rank() != 0);
    const double own = (router_pass ? 1.0 : 0.0) / (cp_ ? cp_->size() : 1);
    // EDA chain: stage m + 1 left dL/d state_m in deda[(m + 1) % 2]; this stage writes dL/d
    // state_{m-1} into the other buffer.
    bc::EdaGrads deda;
    if (m >= 0 && mlp_shape_.mlp_router) {
      const int nmoe = static_cast<int>(moe_layer_ids_.size());
      deda.dstate_next = m + 1 < nmoe ? st_->deda[(m + 1) % 2] : nullptr;
      deda.dprev = m > 0 ? st_->deda[m % 2] : nullptr;
    }
    const bc::SharedRouting shared{tsp_ && shard == tsp_->rank(), shard == last, st_->routing_dgates};
    bc::mlp_backward(*gemm_, mlp_shape_, w, g, a.h2, eda(std::max(m, 0)), deda, a.mlp_of(shard), mlp_scratch_, dy,
                     st_->dh, static_cast<float>(own * aux_loss_weight(cfg_, opt_) * cur_scale_),
                     static_cast<float>(own * opt_.z_loss_weight * cur_scale_), linear, r.experts_of(shard), stream_,
                     tsp_ && m >= 0 ? &shared : nullptr);
  };
  if (!tsp_)
    return run(0, w_.layers[static_cast<std::size_t>(l)], g_.layers[static_cast<std::size_t>(l)], true, *r.mlp_linear);
  tsp_->backward(l, parallel::CudaTspShards::Part::kMlp, stream_,
                 [&](int shard, const bc::LayerWeights& w, const bc::LayerGrads& g) {
                   run(shard, w, g, shard == tsp_->rank(), tsp_->boundary());
                 });
}

// Under TSP once per weight shard: shard r's heads over this rank's tokens, their k and v
// gathered over the group by the context core; the first pass writes out, the later ones add
// (in bf16, as the tensor group sums its partials), and CCA's output joins add_into after the
// last (the others' add rides in the output GEMM, fp32, pass by pass).
void CudaModel::attention_forward(int l, LayerActs& a, float* add_into, bf16* out) {
  const bc::LayerWeights& W = w_.layers[static_cast<std::size_t>(l)];
  bc::AttnContext ctx = attn_context(l);
  if (!tsp_) return bc::attention_forward(*gemm_, attn_shape_, W, a.h1, ctx, a.attn, add_into, out, stream_);
  float* fused = W.cca ? nullptr : add_into;
  tsp_->forward(l, parallel::CudaTspShards::Part::kAttention, stream_, [&](int shard, const bc::LayerWeights& w) {
    ctx.linear = &tsp_->boundary();
    bc::attention_forward(*gemm_, shard_shapes_[static_cast<std::size_t>(shard)], w, a.h1, ctx, a.attn_of(shard), fused,
                          out, stream_);
  });
  if (add_into && !fused) k::add_bf16_to_f32(out, add_into, rows_ * cfg_.hidden, stream_);
}

void CudaModel::attention_backward(int l, LayerActs& a) {
  bc::AttnContext ctx = attn_context(l);
  Stream& st = *st_;
  if (!tsp_)
    return bc::attention_backward(*gemm_, attn_shape_, w_.layers[static_cast<std::size_t>(l)],
                                  g_.layers[static_cast<std::size_t>(l)], a.h1, ctx, a.attn, attn_scratch_, st.dres_bf,
                                  st.dh_bf, stream_);
  tsp_->backward(l, parallel::CudaTspShards::Part::kAttention, stream_,
                 [&](int shard, const bc::LayerWeights& w, const bc::LayerGrads& g) {
                   ctx.linear = &tsp_->boundary();
                   bc::attention_backward(*gemm_, shard_shapes_[static_cast<std::size_t>(shard)], w, g, a.h1, ctx,
                                          a.attn_of(shard), attn_scratch_, st.dres_bf, st.dh_bf, stream_);
                 });
}

// Sequence parallelism: before a block's backward, ask for the input of the block whose
// backward comes next, to gather beside this one (CudaTensorParallelLinear::prefetch_next).
// Before layer l's MLP block (next_is_attention): the layer's attention input; before its
// attention block: layer l - 1's MLP input, saved since forward (under full recompute it is
// recomputed just before its layer's backward: not yet).
void CudaModel::prefetch_inputs(int l, LayerActs& a, bool next_is_attention) {
  if (!tp_ || !tp_->sequence() || !opt_.tensor_overlap) return;
  if (next_is_attention) return tp_->prefetch_next(a.h1, tokens_, cfg_.hidden);
  if (l > 0 && opt_.recompute != Recompute::kFull) tp_->prefetch_next(acts_for(l - 1).h2, tokens_, cfg_.hidden);
}

// dres holds dL/d(layer output) on entry and dL/d(layer input) on return.
void CudaModel::layer_backward(int l, LayerActs& a, const float* x_in, bool grads_fresh, parallel::StageHooks& hooks) {
  const bc::LayerWeights& W = w_.layers[static_cast<std::size_t>(l)];
  const bc::LayerGrads& G = g_.layers[static_cast<std::size_t>(l)];
  const std::int64_t N = rows_, D = cfg_.hidden;  // this rank's rows of the residual stream
  Stream& st = *st_;
  // MLP block: out = x_mid + mlp(n2(x_mid)); st.dh collects dL/dh2.
  mark(mlp_phase(l, true));
  prefetch_inputs(l, a, /*next_is_attention=*/true);
  mlp_backward(l, a, st.dres, grads_fresh);
  k::f32_to_bf16(st.dh, st.dh_bf, N * D, stream_);
  k::rmsnorm::backward(a.x_mid, W.mlp_norm, a.rstd2, st.dh_bf, st.dres, G.mlp_norm, N, D, stream_);
  hooks.grads_final(2 + 2 * l);
  // Attention block: x_mid = x_in + attn(n1(x_in)); dres is now dL/dx_mid.
  mark(attention_phase(true));
  k::f32_to_bf16(st.dres, st.dres_bf, N * D, stream_);
  prefetch_inputs(l, a, /*next_is_attention=*/false);
  attention_backward(l, a);
  k::rmsnorm::backward(x_in, W.attn_norm, a.rstd1, st.dh_bf, st.dres, G.attn_norm, N, D, stream_);
  hooks.grads_final(1 + 2 * l);
}

// In: dres = dL/d resid[l + 1], dhres = dL/d hres[l + 1]. Out: dres = dL/d resid[l], dhres =
// dL/d hres[l] (layer 0: dres = dL/d embedding).
void CudaModel::scaled_layer_backward(int l, LayerActs& a, bool grads_fresh, parallel::StageHooks& hooks) {
  const bc::LayerWeights& W = w_.layers[static_cast<std::size_t>(l)];
  const bc::LayerGrads& G = g_.layers[static_cast<std::size_t>(l)];
  const std::int64_t N = rows_, D = cfg_.hidden;  // this rank's rows of the residual stream
  const bc::ResScale &A = W.attn_scale, &M = W.mlp_scale;
  const bc::ResScaleGrads &dA = G.attn_scale, &dM = G.mlp_scale;
  Stream& st = *st_;
  mark(mlp_phase(l, true));
  prefetch_inputs(l, a, /*next_is_attention=*/true);
  mlp_backward(l, a, st.dhres, grads_fresh);
  k::f32_to_bf16(st.dh, st.dh_bf, N * D, stream_);
  k::rmsnorm::backward(st.resid[static_cast<std::size_t>(l) + 1], W.mlp_norm, a.rstd2, st.dh_bf, st.dres, G.mlp_norm, N,
                       D, stream_);
  // dres = dL/dr2 -> dL/dr1 (so far); dres_bf = dL/d attn_out (bf16: it feeds the output GEMM)
  k::residual_scale::merge_backward(a.x_mid, a.attn_out, M.r_bias, M.r_scale, M.h_bias, M.h_scale, st.dres, st.dres,
                                    st.dres_bf, dM.r_bias, dM.r_scale, dM.h_bias, dM.h_scale, N, D, stream_);
  hooks.grads_final(2 + 2 * l);
  mark(attention_phase(true));
  prefetch_inputs(l, a, /*next_is_attention=*/false);
  attention_backward(l, a);
  k::rmsnorm::backward(a.x_mid, W.attn_norm, a.rstd1, st.dh_bf, st.dres, G.attn_norm, N, D, stream_);
  if (l == 0)
    k::residual_scale::backward(st.resid[0], A.h_bias, A.h_scale, st.dres, st.dres, dA.h_bias, dA.h_scale, N, D, stream_);
  else
    k::residual_scale::merge_backward(st.resid[static_cast<std::size_t>(l)], st.hres[static_cast<std::size_t>(l)], A.r_bias,
                                      A.r_scale, A.h_bias, A.h_scale, st.dres, st.dres, st.dhres, dA.r_bias, dA.r_scale,
                                      dA.h_bias, dA.h_scale, N, D, stream_);
  hooks.grads_final(1 + 2 * l);
}

}  // namespace keel::train
