#include "train/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string_view>

#include "common/error.h"
#include "common/parallel_for.h"
#include "model/flops.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/residual_scale.h"
#include "ops/rmsnorm.h"
#include "parallel/plan.h"
#include "parallel/vocab_parallel.h"

namespace keel::train {

Recompute parse_recompute(const std::string& s) {
  if (s == "none") return Recompute::kNone;
  if (s == "full") return Recompute::kFull;
  throw UsageError(fmt::format("recompute: unknown mode '{}' (choose none or full)", s));
}
const char* to_string(Recompute r) { return r == Recompute::kFull ? "full" : "none"; }


void validate_trainable(const model::ModelConfig& cfg, const ModelOptions& opt) {
  model::validate(cfg);
  const std::string who = fmt::format("model '{}'", cfg.name);
  bool any_cca = false;
  for (int l = 0; l < cfg.layers; ++l) {
    const auto k = model::layer_attention_kind(cfg, l);
    any_cca |= k == model::AttentionKind::kCca;
  }
  // CCA: the value projection is kv_heads heads of head_dim (current- and previous-token halves).
  if (any_cca && cfg.cca_v_dim != cfg.kv_heads * cfg.head_dim)
    throw UsageError(fmt::format("{}: keel train's CCA needs cca_v_dim ({}) == kv_heads*head_dim ({})", who,
                                 cfg.cca_v_dim, cfg.kv_heads * cfg.head_dim));
  auto reject = [&](bool bad, const char* what) {
    if (bad) throw UsageError(fmt::format("{}: {} is not supported by keel train yet", who, what));
  };
  if (cfg.experts > 0 && cfg.router_hidden > 0) {
    // ops::zaya_router is ZAYA1's router exactly: down-projection, 2 hidden GELU layers, output.
    if (cfg.router_mlp_layers != 3)
      throw UsageError(fmt::format("{}: router_mlp_layers {}: keel train's MLP router has exactly 3 layers (ZAYA1)",
                                   who, cfg.router_mlp_layers));
    if (cfg.top_k != 1)
      throw UsageError(fmt::format("{}: top_k {} with an MLP router: keel train's MLP router is top-1 (ZAYA1)", who,
                                   cfg.top_k));
  }
  reject(cfg.router_skip_expert && cfg.router_hidden == 0, "router_skip_expert without an MLP router (router_hidden > 0)");
  reject(cfg.shared_experts > 0, "shared_experts");
  reject(cfg.qk_norm, "qk_norm");
  if (opt.micro_batch < 1 || opt.seq_length < 1)
    throw UsageError(fmt::format("{}: micro_batch ({}) and seq_length ({}) must be >= 1", who, opt.micro_batch, opt.seq_length));
  if (cfg.max_seq_len > 0 && opt.seq_length > cfg.max_seq_len)
    throw UsageError(fmt::format("{}: seq_length {} exceeds max_seq_len {}", who, opt.seq_length, cfg.max_seq_len));
  if (opt.ce_chunk < 1) throw UsageError("ce_chunk must be >= 1");
}

double model_flops_per_micro_batch(const model::ModelConfig& cfg, int micro_batch, int seq_length) {
  const double tokens = static_cast<double>(micro_batch) * seq_length;
  const double D = cfg.hidden, Dh = cfg.head_dim, Hq = cfg.heads, Hkv = cfg.kv_heads;
  double active = 0;
  for (int l = 0; l < cfg.layers; ++l) {
    active += D * Dh * (2 * Hq + 2 * Hkv);
    if (model::layer_attention_kind(cfg, l) == model::AttentionKind::kCca)  // + both convs (per-token MACs)
      active += (Hq + Hkv) * Dh * (cfg.cca_conv_width + Dh * cfg.cca_group_conv_width);
    if (model::is_moe_layer(cfg, l) && cfg.router_hidden > 0) {
      const double R = cfg.router_hidden, classes = cfg.experts + (cfg.router_skip_expert ? 1 : 0);
      // skip-routed tokens run no expert: counted as routed (an upper bound)
      active += D * R + 2 * R * R + R * classes + 3.0 * D * cfg.expert_hidden * cfg.top_k;
    } else if (model::is_moe_layer(cfg, l))
      active += D * cfg.experts + 3.0 * D * cfg.expert_hidden * cfg.top_k;
    else
      active += 3.0 * D * cfg.ffn_hidden;
  }
  active += D * static_cast<double>(cfg.vocab_size);  // LM head
  // attention scores and values: 2 GEMMs of Dh per head and attended key (model::attended_keys:
  // the causal half of T, or of a sliding layer's window), x3 (fwd + bwd): 12 * Hq * Dh * keys
  // per token and layer
  // Linear-attention layers instead: the d x d state update and readout and the causal
  // intra-chunk products, Hq * (4 Dh^2 + 2 Dh min(chunk, T)) per token (model/flops.cc), x3.
  double keys = 0, linear = 0;
  for (int l = 0; l < cfg.layers; ++l) {
    if (model::layer_attention_kind(cfg, l) == model::AttentionKind::kLinear)
      linear += Hq * (4 * Dh * Dh + 2 * Dh * std::min<double>(cfg.linear_chunk, seq_length));
    else
      keys += model::attended_keys(cfg, l, seq_length);
  }
  const double attn = 3.0 * 2.0 * 2.0 * Hq * Dh * keys * tokens + 3.0 * linear * tokens;
  return 6.0 * active * tokens + attn;
}

MoeTransformer::MoeTransformer(const model::ModelConfig& config, const ModelOptions& options, const parallel::Mesh& mesh)
    : cfg_(config),
      opt_(options),
      mesh_(mesh),
      plan_(cfg_, mesh_, options.micro_batch, options.seq_length, options.sequence_parallel, options.context_mode) {
  validate_trainable(cfg_, opt_);
  tp_ = {mesh_.group(parallel::GroupKind::kTensor).size, mesh_.group(parallel::GroupKind::kTensor).rank};
  const parallel::Group& tsp = mesh_.group(parallel::GroupKind::kTsp);
  const parallel::Group& seq_group = tsp.size > 1 ? tsp : mesh_.group(parallel::GroupKind::kContext);
  shards_ = tsp.size;
  cp_ = seq_group.size;
  vocab_ = shards_ > 1 ? blocks::TensorSplit{tsp.size, tsp.rank} : tp_;
  gather_tables_ = shards_ > 1 && parallel::tsp_gathers_tables(opt_.tsp_tables,
                                                               std::int64_t(opt_.micro_batch) * opt_.seq_length,
                                                               cfg_.vocab_size);
  if (opt_.precise_loss && (vocab_.degree > 1 || cp_ > 1))
    fail("model: precise_loss needs the whole LM head and whole sequences (tensor, tsp and context degree 1)");
  for (int l = 0; l < cfg_.layers; ++l) {
    attn_kind_.push_back(model::layer_attention_kind(cfg_, l));
    if (model::is_moe_layer(cfg_, l)) {
      moe_index_of_layer_.push_back(static_cast<int>(moe_layer_ids_.size()));
      moe_layer_ids_.push_back(l);
    } else {
      moe_index_of_layer_.push_back(-1);
    }
  }
  // n: this rank's tokens of the micro-batch (all of them, or 1/cp of each sequence)
  const std::int64_t local_seq = opt_.seq_length / cp_, n = std::int64_t(opt_.micro_batch) * local_seq;
  rows_ = opt_.sequence_parallel ? n / tp_.degree : n;
  // Each weight shard's block shapes: this rank's slices, or under TSP shard r's (its heads and
  // columns; CCA's value shift and the kv heads a shard reads depend on r).
  for (int r = 0; r < shards_; ++r) {
    const blocks::TensorSplit split = shards_ > 1 ? blocks::TensorSplit{shards_, r} : tp_;
    attn_shards_.push_back(blocks::AttnShape::of(cfg_, opt_.micro_batch, local_seq, split));
    if (cp_ > 1) attn_shards_.back().segments = plan_.context()->segments();
    mlp_shards_.push_back(blocks::MlpShape::of(cfg_, n, opt_.renormalize_gates, split, opt_.forced_balance));
  }
  attn_shape_ = attn_shards_[0];
  mlp_shape_ = mlp_shards_[0];
  const int classes = mlp_shape_.classes();
  load_.assign(moe_layer_ids_.size(), std::vector<std::int64_t>(classes, 0));
  bias_.assign(moe_layer_ids_.size(), std::vector<float>(classes, 0.f));
  ropes_ = blocks::make_rope_tables(cfg_, std::max(opt_.seq_length, cfg_.max_seq_len));
  allocate_params();
  ArenaPlanner sizing;
  plan_acts(sizing);
  act_arena_ = std::make_unique<Arena>("activations", sizing.counted());
  ArenaPlanner real(act_arena_.get());
  plan_acts(real);
  // each row's position in its sequence (context parallelism: this rank's zigzag chunks)
  const std::vector<std::int32_t> seq_pos = parallel::zigzag_positions(opt_.seq_length, cp_, seq_group.rank);
  positions_.resize(n);
  for (std::int64_t i = 0; i < n; ++i) positions_[i] = seq_pos[static_cast<std::size_t>(i % local_seq)];
  if (shards_ > 1) plan_.tsp()->bind(layout_, w_, g_);
  init_parameters();
}

MoeTransformer::~MoeTransformer() = default;

void MoeTransformer::allocate_params() {
  layout_ = model::param_layout(cfg_, mesh_.shape());
  const std::size_t bytes = static_cast<std::size_t>(layout_.total_floats) * sizeof(float);
  param_arena_ = std::make_unique<Arena>("parameters", Arena::footprint(bytes));
  grad_arena_ = std::make_unique<Arena>("gradients", Arena::footprint(bytes));
  params_ = param_arena_->allocate<float>("flat", static_cast<std::size_t>(layout_.total_floats));
  grads_ = grad_arena_->allocate<float>("flat", static_cast<std::size_t>(layout_.total_floats));
  w_ = blocks::map_weights(cfg_, layout_, params_);
  g_ = blocks::map_weights(cfg_, layout_, grads_);
}

void MoeTransformer::plan_acts(ArenaPlanner& p) {
  // N: the tokens a block reads; L: the rows of the residual stream, norms and residual scales
  // this rank holds (N / tp under sequence parallelism); Vl: its vocabulary rows.
  const std::int64_t B = opt_.micro_batch, N = B * (opt_.seq_length / cp_), L = rows_, D = cfg_.hidden;
  const std::int64_t Vl = cfg_.vocab_size / vocab_.degree;
  const std::int64_t R = std::max(cfg_.router_hidden, 1);
  const bool any_moe = !moe_layer_ids_.empty(), any_dense = moe_layer_ids_.size() < std::size_t(cfg_.layers);
  const bool mlp_router = mlp_shape_.mlp_router, scaled = cfg_.residual_scaling;
  blocks::AttnKinds any_kind;
  for (const model::AttentionKind k : attn_kind_) any_kind |= blocks::AttnKinds::of(k);

  resid_.clear();
  for (int l = 0; l <= cfg_.layers; ++l) resid_.push_back(p.tensor(fmt::format("resid.{}", l), {L, D}));
  // Residual scaling keeps two streams: hres_[l] is the mixer output entering layer l (none
  // for layer 0, whose stream is the embedding in resid_[0]).
  hres_.assign(cfg_.layers + 1, Tensor());
  if (scaled)
    for (int l = 1; l <= cfg_.layers; ++l) hres_[l] = p.tensor(fmt::format("hres.{}", l), {L, D});
  // The MLP router's EDA state of each MoE stage: read by the next stage in forward and in
  // backward, so it lives outside the (possibly shared) layer workspaces.
  eda_state_.clear();
  if (mlp_router)
    for (std::size_t m = 0; m < moe_layer_ids_.size(); ++m) eda_state_.push_back(p.tensor(fmt::format("eda_state.{}", m), {N, R}));
  const int sets = opt_.recompute == Recompute::kFull ? 1 : cfg_.layers;
  acts_.assign(static_cast<std::size_t>(sets), LayerActs{});
  for (int i = 0; i < sets; ++i) {
    LayerActs& a = acts_[static_cast<std::size_t>(i)];
    const std::string pre = fmt::format("layer.{}.", i);
    // with recompute none, layer i's set only needs its own attention and MLP kinds
    const bool moe = sets == 1 ? any_moe : moe_index_of_layer_[i] >= 0;
    const bool dense = sets == 1 ? any_dense : !moe;
    const blocks::AttnKinds kinds = sets == 1 ? any_kind : blocks::AttnKinds::of(attn_kind_[std::size_t(i)]);
    a.h1 = p.tensor(pre + "h1", {L, D});
    a.rstd1 = p.tensor(pre + "rstd1", {L});
    a.attn.assign(static_cast<std::size_t>(shards_), {});
    a.mlp.assign(static_cast<std::size_t>(shards_), {});
    for (int r = 0; r < shards_; ++r) {
      const std::string at = shards_ > 1 ? fmt::format("{}shard.{}.", pre, r) : pre;
      blocks::carve(p, at, attn_shards_[std::size_t(r)], kinds, a.attn[std::size_t(r)]);
    }
    a.x_mid = p.tensor(pre + "x_mid", {L, D});
    if (scaled) a.attn_out = p.tensor(pre + "attn_out", {L, D});
    a.h2 = p.tensor(pre + "h2", {L, D});
    a.rstd2 = p.tensor(pre + "rstd2", {L});
    for (int r = 0; r < shards_; ++r) {
      const std::string at = shards_ > 1 ? fmt::format("{}shard.{}.", pre, r) : pre;
      // TSP: only this rank's own shard's pass routes (mlp_forward); the others keep no router state
      blocks::carve(p, at, mlp_shards_[std::size_t(r)], dense, moe, a.mlp[std::size_t(r)],
                    shards_ == 1 || r == plan_.tsp()->rank());
    }
  }
  // Backward scratch, shared by all layers.
  // (TSP: the shard needing the most; CCA's halos depend on the value heads a shard holds)
  std::size_t widest = 0;
  const auto cca_need = [&](const blocks::AttnShape& sh) {
    return any_kind.cca ? ops::cca::backward_scratch_floats(sh.cca, sh.batch, sh.seq, sh.segments) : 0;
  };
  for (std::size_t r = 1; r < attn_shards_.size(); ++r)
    if (cca_need(attn_shards_[r]) > cca_need(attn_shards_[widest])) widest = r;
  blocks::carve(p, attn_shards_[widest], any_kind, attn_scratch_);
  blocks::carve(p, mlp_shape_, any_dense, any_moe, /*backward=*/true, mlp_scratch_);
  if (any_moe && mlp_router)
    for (int i = 0; i < 2; ++i) deda_[std::size_t(i)] = p.tensor(fmt::format("bwd.deda.{}", i), {N, R});
  // TSP: every weight shard's dL/d gates, summed for the router's one backward (blocks::SharedRouting)
  if (any_moe && shards_ > 1) routing_dgates_ = p.tensor("bwd.routing_dgates", {N * std::max(cfg_.top_k, 1)});
  dres_ = p.tensor("bwd.dres", {L, D});
  dtmp_ = p.tensor("bwd.dtmp", {L, D});
  dtmp2_ = p.tensor("bwd.dtmp2", {N, D});  // the blocks' [N, D] scratch
  attn_scratch_.tmp = mlp_scratch_.tmp = dtmp2_;
  if (scaled) {
    dhres_ = p.tensor("bwd.dhres", {L, D});
    dtmp3_ = p.tensor("bwd.dtmp3", {L, D});
    final_r_ = p.tensor("final_r", {L, D});
  }
  final_h_ = p.tensor("final_h", {L, D});
  final_rstd_ = p.tensor("final_rstd", {L});
  // the vocabulary-parallel embedding and head: every token's rows (TSP gathering its tables:
  // the group's tokens)
  const std::int64_t whole = gather_tables_ ? N * shards_ : N;
  if (tp_.degree > 1 || gather_tables_) {
    whole_a_ = p.tensor("tp.whole_a", {whole, D});
    whole_b_ = p.tensor("tp.whole_b", {whole, D});
  }
  if (gather_tables_) lse_all_ = p.tensor("tsp.lse_all", {whole});
  ce_lse_ = p.tensor("ce_lse", {N});
  const std::int64_t chunk = std::min<std::int64_t>(opt_.ce_chunk, Vl);
  ce_scratch_ = p.tensor("ce_scratch", {ops::cross_entropy::scratch_floats(whole, chunk)});
}

std::int64_t MoeTransformer::param_count() const {  // the whole model's, whatever this rank holds
  return model::global_param_count(layout_);
}

Tensor MoeTransformer::param(const std::string& name) const {
  for (const auto& p : layout_.params)
    if (p.name == name) return blocks::param_view(params_, p);
  fail("model: no parameter '{}'", name);
}

Tensor MoeTransformer::grad(const std::string& name) const {
  for (const auto& p : layout_.params)
    if (p.name == name) return blocks::param_view(grads_, p);
  fail("model: no parameter '{}'", name);
}

void MoeTransformer::init_parameters() {
  model::init_parameters(cfg_, layout_, opt_.init_std, opt_.init_seed, params_, mesh_.shape(), mesh_.coord(),
                         opt_.router_init_gain);
  bias_ = model::initial_router_biases(cfg_);
  reset_load();
}

void MoeTransformer::zero_grads() { grad_arena_->zero_used(); }

void MoeTransformer::set_load(int moe_index, const std::vector<std::int64_t>& counts) {
  auto& l = load_.at(static_cast<std::size_t>(moe_index));
  if (counts.size() != l.size()) fail("set_load: {} counts for MoE layer {} of {} classes", counts.size(), moe_index, l.size());
  l = counts;
}

void MoeTransformer::reset_load() {
  for (auto& l : load_) std::fill(l.begin(), l.end(), 0);
}

double aux_loss_weight(const model::ModelConfig& cfg, const ModelOptions& options) {
  return cfg.router_mlp_layers > 0 ? options.mlp_router_aux_weight : options.aux_loss_weight;
}

ops::bias_controller::Config balance_config(const ModelOptions& options) {
  ops::bias_controller::Config c;
  c.rule = options.balance_rule;
  c.lr = options.bias_update_rate;
  c.kp = options.balance_kp;
  c.kd = options.balance_kd;
  return c;
}

void update_balancing_bias(const std::vector<std::vector<std::int64_t>>& load, const ops::bias_controller::Config& c,
                           std::vector<std::vector<float>>& bias, BalanceMemory& memory) {
  if (bias.size() != load.size()) fail("update_balancing_bias: {} bias vectors for {} MoE layers", bias.size(), load.size());
  const bool keeps = c.rule == ops::bias_controller::Rule::Adam || c.rule == ops::bias_controller::Rule::Pid;
  // First use, a state saved under another rule (or sized for other layers): start at zero.
  if (keeps && (memory.m.size() != load.size() || memory.rule != c.rule)) {
    memory.m.assign(load.size(), {});
    memory.v.assign(load.size(), {});
    for (std::size_t i = 0; i < load.size(); ++i) memory.m[i].assign(load[i].size(), 0.f), memory.v[i].assign(load[i].size(), 0.f);
    memory.updates = 0;
    memory.rule = c.rule;
  }
  bool counted = false;
  for (std::size_t i = 0; i < load.size(); ++i) {
    if (bias[i].size() != load[i].size()) fail("update_balancing_bias: MoE layer {} has {} biases for {} classes", i, bias[i].size(), load[i].size());
    ops::bias_controller::State s;
    s.bias = bias[i];
    s.m = keeps ? memory.m[i] : std::vector<float>(bias[i].size(), 0.f);
    s.v = keeps ? memory.v[i] : s.m;
    s.step = memory.updates;
    ops::bias_controller::State next = ops::bias_controller::update(c, s, load[i].data());
    counted |= next.step != s.step;
    bias[i] = std::move(next.bias);
    if (keeps) memory.m[i] = std::move(next.m), memory.v[i] = std::move(next.v);
  }
  if (keeps && counted) ++memory.updates;  // the others keep no memory
}

void MoeTransformer::update_router_bias() {
  if (opt_.bias_update_rate != 0.0) update_balancing_bias(load_, balance_config(opt_), bias_, balance_);
  reset_load();
}

blocks::AttnContext MoeTransformer::attn_context(int l) const {
  const blocks::LayerRunners& r = plan_.layers()[static_cast<std::size_t>(l)];
  return {positions_.data(), &ropes_.layer(l), model::attention_window(cfg_, l), r.attn_linear, r.attention};
}

blocks::EdaIo MoeTransformer::eda(int m) const {
  if (m < 0 || !mlp_shape_.mlp_router) return {};
  return {eda_state_[static_cast<std::size_t>(m)], m > 0 ? eda_state_[static_cast<std::size_t>(m - 1)] : Tensor()};
}

// ---- the MLP sub-block: y = mlp(a.h2) (dense SwiGLU, or routed experts) ----

void MoeTransformer::mlp_forward(int l, LayerActs& a, bool count_load, LossParts& lp, const Tensor& y) {
  const int m = moe_index_of_layer_[static_cast<std::size_t>(l)];
  const blocks::LayerRunners& runners = plan_.layers()[static_cast<std::size_t>(l)];
  const Tensor bias = m >= 0 ? Tensor(bias_[static_cast<std::size_t>(m)].data(), {mlp_shape_.classes()}) : Tensor();
  // Under TSP the router runs once, in the first pass (the ring starts with this rank's own
  // shard): it counts the load and the router losses, and the later passes take its routing.
  const int own = shards_ > 1 ? plan_.tsp()->rank() : 0;
  const auto run = [&](int r, const blocks::LayerWeights& w, blocks::LinearRunner& linear) {
    const bool routes = r == own;
    blocks::RouterLosses losses;
    std::int64_t* load = routes && count_load && m >= 0 ? load_[static_cast<std::size_t>(m)].data() : nullptr;
    blocks::mlp_forward(mlp_shards_[std::size_t(r)], w, bias, a.h2, eda(m), a.mlp[std::size_t(r)], mlp_scratch_, y,
                        linear, plan_.experts(l, r), load, &losses, *runners.tokens,
                        routes ? nullptr : &a.mlp[std::size_t(own)]);
    if (routes) lp.aux += losses.aux, lp.z += losses.z;
  };
  if (shards_ == 1) return run(0, w_.layers[static_cast<std::size_t>(l)], *runners.mlp_linear);
  plan_.tsp()->forward(l, parallel::TspShards::Part::kMlp, run);
}

// dy: dL/dy; dh (overwritten): dL/d a.h2.
void MoeTransformer::mlp_backward(int l, LayerActs& a, const Tensor& dy, const Tensor& dh) {
  const int m = moe_index_of_layer_[static_cast<std::size_t>(l)];
  const blocks::LayerRunners& runners = plan_.layers()[static_cast<std::size_t>(l)];
  // Under TSP the passes share the first one's routing (mlp_forward): the ring's last pass (shard
  // rank + 1) runs the router's backward once, on every pass's dL/d gates summed.
  const int own = shards_ > 1 ? plan_.tsp()->rank() : 0, last = shards_ > 1 ? (own + 1) % shards_ : 0;
  const auto run = [&](int r, const blocks::LayerWeights& w, blocks::LayerWeights& g, blocks::LinearRunner& linear) {
    // The router losses' gradients are whole on every tensor rank, the rest of the router's
    // partial: the first rank adds them (reduce_partial_gradients sums the router's gradients);
    // under TSP the pass that runs the router's backward. Under context parallelism and TSP the
    // micro-batch's router losses are the mean of the ranks'.
    const bool router_pass = shards_ > 1 ? r == last : tp_.rank == 0;
    const float scale = router_pass ? 1.f / static_cast<float>(cp_) : 0.f;
    // EDA chain: stage m + 1 left dL/d state_m in deda_[(m + 1) % 2]; this stage writes
    // dL/d state_{m-1} into the other buffer.
    blocks::EdaGrads deda;
    if (m >= 0 && mlp_shape_.mlp_router) {
      const int nmoe = static_cast<int>(moe_layer_ids_.size());
      if (m + 1 < nmoe) deda.dstate_next = deda_[(m + 1) % 2];
      if (m > 0) deda.dprev = deda_[m % 2];
    }
    const blocks::SharedRouting shared{r == own, r == last, routing_dgates_};
    blocks::mlp_backward(mlp_shards_[std::size_t(r)], w, g, a.h2, eda(m), deda, a.mlp[std::size_t(r)], mlp_scratch_, dy,
                         dh, static_cast<float>(aux_loss_weight(cfg_, opt_) * cur_scale_ * scale),
                         static_cast<float>(opt_.z_loss_weight * cur_scale_ * scale), linear, plan_.experts(l, r),
                         *runners.tokens, shards_ > 1 && m >= 0 ? &shared : nullptr);
  };
  if (shards_ == 1)
    return run(0, w_.layers[static_cast<std::size_t>(l)], g_.layers[static_cast<std::size_t>(l)], *runners.mlp_linear);
  plan_.tsp()->backward(l, parallel::TspShards::Part::kMlp, run);
}

void MoeTransformer::attention_forward(int l, LayerActs& a, const Tensor& h, const Tensor& y) {
  const model::AttentionKind kind = attn_kind_[std::size_t(l)];
  blocks::AttnContext c = attn_context(l);
  if (shards_ == 1)
    return blocks::attention_forward(attn_shape_, w_.layers[static_cast<std::size_t>(l)], kind, h, c, a.attn[0], y);
  plan_.tsp()->forward(l, parallel::TspShards::Part::kAttention,
                       [&](int r, const blocks::LayerWeights& w, blocks::LinearRunner& boundary) {
                         c.linear = &boundary;
                         blocks::attention_forward(attn_shards_[std::size_t(r)], w, kind, h, c, a.attn[std::size_t(r)], y);
                       });
}

void MoeTransformer::attention_backward(int l, LayerActs& a, const Tensor& h, const Tensor& dy, const Tensor& dh) {
  const model::AttentionKind kind = attn_kind_[std::size_t(l)];
  blocks::AttnContext c = attn_context(l);
  if (shards_ == 1)
    return blocks::attention_backward(attn_shape_, w_.layers[static_cast<std::size_t>(l)],
                                      g_.layers[static_cast<std::size_t>(l)], kind, h, c, a.attn[0], attn_scratch_, dy, dh);
  plan_.tsp()->backward(l, parallel::TspShards::Part::kAttention,
                        [&](int r, const blocks::LayerWeights& w, blocks::LayerWeights& g, blocks::LinearRunner& boundary) {
                          c.linear = &boundary;
                          blocks::attention_backward(attn_shards_[std::size_t(r)], w, g, kind, h, c,
                                                     a.attn[std::size_t(r)], attn_scratch_, dy, dh);
                        });
}

// ---- plain pre-norm layer: x_mid = x + attn(n1(x)); y = x_mid + mlp(n2(x_mid)) ----

void MoeTransformer::layer_forward(int l, LayerActs& a, const Tensor& x_in, const Tensor& x_out, bool count_load,
                                   LossParts& lp) {
  const blocks::LayerWeights& P = w_.layers[static_cast<std::size_t>(l)];
  const float eps = static_cast<float>(cfg_.norm_eps);
  ops::rmsnorm::forward(x_in, P.attn_norm, eps, a.h1, a.rstd1);
  attention_forward(l, a, a.h1, a.x_mid);
  add_into(a.x_mid, x_in);
  ops::rmsnorm::forward(a.x_mid, P.mlp_norm, eps, a.h2, a.rstd2);
  mlp_forward(l, a, count_load, lp, x_out);
  add_into(x_out, a.x_mid);
}

void MoeTransformer::layer_backward(int l, LayerActs& a, const Tensor& x_in, const Tensor& dres) {
  const blocks::LayerWeights& P = w_.layers[static_cast<std::size_t>(l)];
  blocks::LayerWeights& G = g_.layers[static_cast<std::size_t>(l)];
  // MLP block: y = x_mid + mlp(n2(x_mid)); dres holds dL/dy.
  mlp_backward(l, a, dres, dtmp_);
  ops::rmsnorm::backward(a.x_mid, P.mlp_norm, a.rstd2, dtmp_, dres, G.mlp_norm);  // adds: dres now dL/dx_mid
  // Attention block: x_mid = x_in + attn(n1(x_in)).
  attention_backward(l, a, a.h1, dres, dtmp_);
  ops::rmsnorm::backward(x_in, P.attn_norm, a.rstd1, dtmp_, dres, G.attn_norm);  // adds: dres now dL/dx_in
}

// ---- ZAYA1 residual scaling: two streams (r, h) between stages ----
// layer l takes (resid_[l], hres_[l]) (layer 0: the embedding in resid_[0] only) and gives
//   r1 = merge_attn(r, h)   (layer 0: (emb + b_h) * s_h)      -> a.x_mid
//   ya = attn(n1(r1))                                        -> a.attn_out
//   r2 = merge_mlp(r1, ya)                                   -> r_out (resid_[l + 1])
//   ym = mlp(n2(r2))                                         -> h_out (hres_[l + 1])
// merge(r, h) = (r + r_bias) * r_scale + (h + h_bias) * h_scale (ops::residual_scale).

void MoeTransformer::scaled_layer_forward(int l, LayerActs& a, const Tensor& r_out, const Tensor& h_out, bool count_load,
                                          LossParts& lp) {
  const blocks::LayerWeights& P = w_.layers[static_cast<std::size_t>(l)];
  const float eps = static_cast<float>(cfg_.norm_eps);
  const blocks::ResScale &A = P.attn_scale, &M = P.mlp_scale;
  if (l == 0)
    ops::residual_scale::forward(resid_[0], A.h_bias, A.h_scale, a.x_mid);
  else
    ops::residual_scale::merge_forward(resid_[l], hres_[l], A.r_bias, A.r_scale, A.h_bias, A.h_scale, a.x_mid);
  ops::rmsnorm::forward(a.x_mid, P.attn_norm, eps, a.h1, a.rstd1);
  attention_forward(l, a, a.h1, a.attn_out);
  ops::residual_scale::merge_forward(a.x_mid, a.attn_out, M.r_bias, M.r_scale, M.h_bias, M.h_scale, r_out);
  ops::rmsnorm::forward(r_out, P.mlp_norm, eps, a.h2, a.rstd2);
  mlp_forward(l, a, count_load, lp, h_out);
}

// In: dres_ = dL/d resid_[l + 1], dhres_ = dL/d hres_[l + 1]. Out: dres_ = dL/d resid_[l],
// dhres_ = dL/d hres_[l] (layer 0: dres_ = dL/d embedding).
void MoeTransformer::scaled_layer_backward(int l, LayerActs& a) {
  const blocks::LayerWeights& P = w_.layers[static_cast<std::size_t>(l)];
  blocks::LayerWeights& G = g_.layers[static_cast<std::size_t>(l)];
  const blocks::ResScale &A = P.attn_scale, &M = P.mlp_scale, &dA = G.attn_scale, &dM = G.mlp_scale;
  mlp_backward(l, a, dhres_, dtmp3_);                                                 // dtmp3 = dL/dh2
  ops::rmsnorm::backward(resid_[l + 1], P.mlp_norm, a.rstd2, dtmp3_, dres_, G.mlp_norm);  // adds: dres = dL/dr2
  ops::residual_scale::merge_backward(a.x_mid, a.attn_out, M.r_bias, M.r_scale, M.h_bias, M.h_scale, dres_, dres_,
                                      dtmp3_, dM.r_bias, dM.r_scale, dM.h_bias, dM.h_scale);  // dres = dL/dr1 (so far)
  attention_backward(l, a, a.h1, dtmp3_, dtmp_);                                       // dtmp = dL/dh1
  ops::rmsnorm::backward(a.x_mid, P.attn_norm, a.rstd1, dtmp_, dres_, G.attn_norm);   // adds: dres = dL/dr1
  if (l == 0)
    ops::residual_scale::backward(resid_[0], A.h_bias, A.h_scale, dres_, dres_, dA.h_bias, dA.h_scale);
  else
    ops::residual_scale::merge_backward(resid_[l], hres_[l], A.r_bias, A.r_scale, A.h_bias, A.h_scale, dres_, dres_,
                                        dhres_, dA.r_bias, dA.r_scale, dA.h_bias, dA.h_scale);
}

LossParts MoeTransformer::forward(const std::uint32_t* tokens, const std::int32_t* targets) {
  const std::int64_t S = opt_.seq_length, local_seq = S / cp_, N = opt_.micro_batch * local_seq;
  tokens_.resize(static_cast<std::size_t>(N));
  targets_.resize(static_cast<std::size_t>(N));
  for (std::int64_t i = 0; i < N; ++i) {  // this rank's rows of each sequence (all of them at cp 1)
    const std::int64_t at = i / local_seq * S + positions_[static_cast<std::size_t>(i)];
    tokens_[static_cast<std::size_t>(i)] = tokens[at];
    targets_[static_cast<std::size_t>(i)] = targets[at];
  }
  if (gather_tables_) {  // every rank's rows, in rank order (the tables' gathers use this order)
    const MPI_Comm comm = plan_.tsp()->group().comm();
    tokens_all_.resize(tokens_.size() * static_cast<std::size_t>(shards_));
    targets_all_.resize(targets_.size() * static_cast<std::size_t>(shards_));
    MPI_Allgather(tokens_.data(), static_cast<int>(N), MPI_UINT32_T, tokens_all_.data(), static_cast<int>(N),
                  MPI_UINT32_T, comm);
    MPI_Allgather(targets_.data(), static_cast<int>(N), MPI_INT32_T, targets_all_.data(), static_cast<int>(N),
                  MPI_INT32_T, comm);
  }
  // Under TSP the routers see this rank's tokens only: the micro-batch's loads are the group's
  // sums (data parallelism sums them further, as for every scheme).
  std::vector<std::vector<std::int64_t>> load_before;
  if (shards_ > 1) load_before = load_;
  LossParts lp;
  embed_forward();
  const bool scaled = cfg_.residual_scaling;
  for (int l = 0; l < cfg_.layers; ++l) {
    LayerActs& a = acts_for(l);
    if (scaled)
      scaled_layer_forward(l, a, resid_[l + 1], hres_[l + 1], /*count_load=*/true, lp);
    else
      layer_forward(l, a, resid_[l], resid_[l + 1], /*count_load=*/true, lp);
  }
  if (shards_ > 1)
    for (std::size_t m = 0; m < load_.size(); ++m) {
      std::vector<std::int64_t> delta(load_[m].size());
      for (std::size_t e = 0; e < delta.size(); ++e) delta[e] = load_[m][e] - load_before[m][e];
      plan_.context()->sum(delta.data(), static_cast<int>(delta.size()));
      for (std::size_t e = 0; e < delta.size(); ++e) load_[m][e] = load_before[m][e] + delta[e];
    }
  Tensor final_in = resid_[cfg_.layers];
  if (scaled) {
    const blocks::ResScale& F = w_.final_scale;
    ops::residual_scale::merge_forward(resid_[cfg_.layers], hres_[cfg_.layers], F.r_bias, F.r_scale, F.h_bias,
                                       F.h_scale, final_r_);
    final_in = final_r_;
  }
  ops::rmsnorm::forward(final_in, w_.final_norm, static_cast<float>(cfg_.norm_eps), final_h_, final_rstd_);
  lp.ce = head_forward();
  if (opt_.precise_loss) {
    const std::int64_t V = cfg_.vocab_size, D = cfg_.hidden;
    std::vector<double> z(static_cast<std::size_t>(V));
    double sum = 0;
    std::int64_t valid = 0;
    for (std::int64_t i = 0; i < N; ++i) {
      if (targets_[i] == ops::cross_entropy::Options{}.ignore_index) continue;
      const float* h = final_h_.row(i);
      double m = -1e300;
      for (std::int64_t v = 0; v < V; ++v) {
        double acc = 0;
        const float* w = w_.lm_head.row(v);
        for (std::int64_t d = 0; d < D; ++d) acc += double(h[d]) * w[d];
        z[v] = acc;
        m = std::max(m, acc);
      }
      double se = 0;
      for (std::int64_t v = 0; v < V; ++v) se += std::exp(z[v] - m);
      sum += m + std::log(se) - z[targets_[i]];
      ++valid;
    }
    lp.ce = valid > 0 ? sum / static_cast<double>(valid) : 0.0;
  }
  ce_share_ = 1.0;
  if (cp_ > 1) {
    // The micro-batch's losses on every rank of the context group: the cross-entropy over all
    // of its valid targets, the router losses' means over the ranks (aux: router::aux_loss).
    const std::int32_t ignore = ops::cross_entropy::Options{}.ignore_index;
    const double valid = static_cast<double>(N - std::count(targets_.begin(), targets_.end(), ignore));
    double parts[4] = {lp.ce * valid, valid, lp.aux, lp.z};
    plan_.context()->sum(parts, 4);
    ce_share_ = parts[1] > 0 ? valid / parts[1] : 0.0;  // this rank's CE gradient weight
    lp.ce = parts[1] > 0 ? parts[0] / parts[1] : 0.0;
    lp.aux = parts[2] / cp_;
    lp.z = parts[3] / cp_;
  }
  lp.total = lp.ce + aux_loss_weight(cfg_, opt_) * lp.aux + opt_.z_loss_weight * lp.z;
  have_forward_ = true;
  return lp;
}

void MoeTransformer::token_logprobs(int top_k, float* logprob, std::int32_t* top_ids, float* top_logprob) const {
  if (!have_forward_) fail("model: token_logprobs before a forward");
  if (vocab_.degree != 1 || cp_ != 1)
    fail("model: per-token log-probabilities need the whole LM head and whole sequences (tensor, tsp and context "
         "degree 1)");
  const std::int64_t V = cfg_.vocab_size, D = cfg_.hidden, N = static_cast<std::int64_t>(targets_.size());
  if (top_k < 0 || top_k > V) fail("model: top_k {} outside [0, vocab {}]", top_k, V);
  const auto logit = [&](std::int64_t i, std::int64_t v) {
    const float* h = final_h_.row(i);
    const float* w = w_.lm_head.row(v);
    double acc = 0;
    for (std::int64_t d = 0; d < D; ++d) acc += double(h[d]) * w[d];
    return acc;
  };
  const std::int32_t ignore = ops::cross_entropy::Options{}.ignore_index;
  parallel_for(N, 16, [&](std::int64_t lo, std::int64_t hi) {
    std::vector<double> z(top_k > 0 ? static_cast<std::size_t>(V) : 0);
    std::vector<std::int32_t> ids(z.size());
    for (std::int64_t i = lo; i < hi; ++i) {
      if (top_k == 0) {  // the head's logsumexp (ce_lse_: 0 at ignored rows)
        logprob[i] = targets_[i] == ignore ? 0.f : static_cast<float>(logit(i, targets_[i]) - ce_lse_.data()[i]);
        continue;
      }
      double m = -1e300, se = 0;
      for (std::int64_t v = 0; v < V; ++v) z[v] = logit(i, v), ids[v] = static_cast<std::int32_t>(v), m = std::max(m, z[v]);
      for (std::int64_t v = 0; v < V; ++v) se += std::exp(z[v] - m);
      const double lse = m + std::log(se);
      logprob[i] = targets_[i] == ignore ? 0.f : static_cast<float>(z[targets_[i]] - lse);
      std::partial_sort(ids.begin(), ids.begin() + top_k, ids.end(), [&](std::int32_t a, std::int32_t b) {
        return z[a] > z[b] || (z[a] == z[b] && a < b);
      });
      for (int k = 0; k < top_k; ++k) {
        top_ids[i * top_k + k] = ids[k];
        top_logprob[i * top_k + k] = static_cast<float>(z[ids[k]] - lse);
      }
    }
  });
}

void MoeTransformer::backward(float loss_scale) {
  if (!have_forward_) fail("model: backward() without a forward()");
  cur_scale_ = loss_scale;
  const bool scaled = cfg_.residual_scaling, full = opt_.recompute == Recompute::kFull;
  // (gathering TSP's tables, the head's backward takes every token of the micro-batch: the
  // mean's whole gradient)
  head_backward(static_cast<float>(loss_scale * (gather_tables_ ? 1.0 : ce_share_)));  // dtmp_ = dL/d final_h_
  // rmsnorm adds its dx into the residual gradient; the final norm is its first writer in this
  // micro-batch, so clear what the previous backward left there (as the CUDA backend does).
  dres_.zero();
  ops::rmsnorm::backward(scaled ? final_r_ : resid_[cfg_.layers], w_.final_norm, final_rstd_, dtmp_, dres_, g_.final_norm);
  if (scaled) {
    const blocks::ResScale &F = w_.final_scale, &dF = g_.final_scale;
    ops::residual_scale::merge_backward(resid_[cfg_.layers], hres_[cfg_.layers], F.r_bias, F.r_scale, F.h_bias,
                                        F.h_scale, dres_, dres_, dhres_, dF.r_bias, dF.r_scale, dF.h_bias, dF.h_scale);
  }
  for (int l = cfg_.layers - 1; l >= 0; --l) {
    LayerActs& a = acts_for(l);
    LossParts ignored;
    if (scaled) {
      // Recompute rewrites resid_[l + 1] with the identical values (rmsnorm backward reads
      // it); the MLP output is not needed again.
      if (full) scaled_layer_forward(l, a, resid_[l + 1], dtmp_, /*count_load=*/false, ignored);
      scaled_layer_backward(l, a);
    } else {
      if (full) layer_forward(l, a, resid_[l], dtmp_, /*count_load=*/false, ignored);  // output not needed again
      layer_backward(l, a, resid_[l], dres_);
    }
  }
  embed_backward();
  have_forward_ = false;
}

namespace {

// The LM head's cross-entropy options: ce_chunk columns at a time over this rank's vocabulary rows.
ops::cross_entropy::Options head_options(const ModelOptions& opt, const model::ModelConfig& cfg,
                                         const blocks::TensorSplit& vocab) {
  ops::cross_entropy::Options co;
  co.chunk = std::min<std::int64_t>(opt.ce_chunk, cfg.vocab_size / vocab.degree);
  return co;
}

}  // namespace

// ---- the embedding and the LM head: whole, vocabulary-parallel over the tensor group, or
// under TSP visited shard by shard (each rank's rows of the table broadcast in turn) ----

const parallel::TensorGroup* MoeTransformer::vocab_group() const {
  return tp_.degree > 1 ? &plan_.tensor()->group() : nullptr;
}

void MoeTransformer::embed_forward() {
  const std::int64_t N = static_cast<std::int64_t>(tokens_.size());
  if (gather_tables_) return gathered_embed_forward();
  if (shards_ > 1) {  // each piece's rows of this rank's tokens (zeros elsewhere), summed here
    bool first_piece = true;
    plan_.tsp()->forward(parallel::TspShards::Part::kEmbedding, [&](int, std::int64_t first, const Tensor& rows) {
      const Tensor out = first_piece ? resid_[0] : dtmp_;
      parallel::vocab_embedding_forward(tokens_.data(), N, rows, first, cfg_.vocab_size, out);
      if (!first_piece) add_into(resid_[0], dtmp_);
      first_piece = false;
    });
    return;
  }
  const parallel::TensorGroup* group = vocab_group();
  if (!group) return ops::embedding::forward(tokens_.data(), N, w_.embed, resid_[0]);
  // Every token's row from the rank holding it, zeros elsewhere, summed over the group.
  parallel::vocab_embedding_forward(tokens_.data(), N, w_.embed, vocab_begin(), cfg_.vocab_size, whole_a_);
  if (opt_.sequence_parallel) {
    group->reduce_scatter(whole_a_.data(), resid_[0].data(), resid_[0].numel());
  } else {
    group->all_reduce(whole_a_.data(), whole_a_.numel());
    std::memcpy(resid_[0].data(), whole_a_.data(), sizeof(float) * static_cast<std::size_t>(whole_a_.numel()));
  }
}

// dres_: dL/d the embedding output (this rank's rows).
void MoeTransformer::embed_backward() {
  const std::int64_t N = static_cast<std::int64_t>(tokens_.size());
  if (gather_tables_) return gathered_embed_backward();
  if (shards_ > 1) {  // each piece's rows get this rank's tokens' gradients, summed on their rank
    plan_.tsp()->backward(parallel::TspShards::Part::kEmbedding,
                          [&](int, std::int64_t first, const Tensor&, const Tensor& grad) {
                            parallel::vocab_embedding_backward(tokens_.data(), N, dres_, first, cfg_.vocab_size, grad);
                          });
    return;
  }
  const parallel::TensorGroup* group = vocab_group();
  if (!group) return ops::embedding::backward(tokens_.data(), N, dres_, g_.embed);
  Tensor d = dres_;
  if (opt_.sequence_parallel) {
    group->all_gather(dres_.data(), whole_b_.data(), dres_.numel());
    d = whole_b_;
  }
  parallel::vocab_embedding_backward(tokens_.data(), N, d, vocab_begin(), cfg_.vocab_size, g_.embed);
}

float MoeTransformer::head_forward() {
  const ops::cross_entropy::Options co = head_options(opt_, cfg_, vocab_);
  if (gather_tables_) return gathered_head_forward();
  if (shards_ > 1) {
    // This rank's tokens against each shard's rows of the head: the running max and sum of
    // every row carry over the shards (slice_lse), as over one table's chunks.
    const std::int64_t N = final_h_.dim(0);
    std::vector<float> m(static_cast<std::size_t>(N), -std::numeric_limits<float>::infinity());
    std::vector<double> sum(static_cast<std::size_t>(N), 0.0), target(static_cast<std::size_t>(N), 0.0);
    plan_.tsp()->forward(parallel::TspShards::Part::kHead, [&](int, std::int64_t first, const Tensor& rows) {
      ops::cross_entropy::slice_lse(final_h_, rows, targets_.data(), co, {first, cfg_.vocab_size}, ce_scratch_, m.data(),
                                    sum.data(), target.data());
    });
    // this rank's mean: forward() takes the group's
    return ops::cross_entropy::finish_lse(targets_.data(), N, co, m.data(), sum.data(), target.data(), ce_lse_);
  }
  const parallel::TensorGroup* group = vocab_group();
  if (!group) return ops::cross_entropy::forward(final_h_, w_.lm_head, targets_.data(), co, ce_lse_, ce_scratch_);
  Tensor h = final_h_;
  if (opt_.sequence_parallel) {  // every token's final hidden state: the head splits the vocabulary
    group->all_gather(final_h_.data(), whole_a_.data(), final_h_.numel());
    h = whole_a_;
  }
  return parallel::vocab_ce_forward(h, w_.lm_head, vocab_begin(), cfg_.vocab_size, targets_.data(), co, ce_lse_,
                                    ce_scratch_, group->comm());
}

// dtmp_ (overwritten): dL/d final_h_ (this rank's rows).
void MoeTransformer::head_backward(float loss_scale) {
  const ops::cross_entropy::Options co = head_options(opt_, cfg_, vocab_);
  if (gather_tables_) return gathered_head_backward(loss_scale);
  if (shards_ > 1) {  // each piece's share of dL/d final_h_ added here, its rows' gradients summed on their rank
    bool first_piece = true;
    plan_.tsp()->backward(parallel::TspShards::Part::kHead,
                          [&](int, std::int64_t first, const Tensor& rows, const Tensor& grad) {
                            const Tensor dh = first_piece ? dtmp_ : dtmp2_;
                            ops::cross_entropy::backward(final_h_, rows, targets_.data(), ce_lse_, loss_scale, co,
                                                         ce_scratch_, dh, grad, {first, cfg_.vocab_size});
                            if (!first_piece) add_into(dtmp_, dtmp2_);
                            first_piece = false;
                          });
    return;
  }
  const parallel::TensorGroup* group = vocab_group();
  if (!group)
    return ops::cross_entropy::backward(final_h_, w_.lm_head, targets_.data(), ce_lse_, loss_scale, co, ce_scratch_,
                                        dtmp_, g_.lm_head);
  const Tensor h = opt_.sequence_parallel ? whole_a_ : final_h_;  // gathered by head_forward
  parallel::vocab_ce_backward(h, w_.lm_head, vocab_begin(), cfg_.vocab_size, targets_.data(), ce_lse_, loss_scale, co,
                              ce_scratch_, whole_b_, g_.lm_head);
  if (opt_.sequence_parallel) {
    group->reduce_scatter(whole_b_.data(), dtmp_.data(), dtmp_.numel());
  } else {
    group->all_reduce(whole_b_.data(), whole_b_.numel());
    std::memcpy(dtmp_.data(), whole_b_.data(), sizeof(float) * static_cast<std::size_t>(whole_b_.numel()));
  }
}

// ---- TSP gathering its tables (parallel.tsp_tables: gather): the group's tokens meet this
// rank's rows, as under tensor + sequence parallelism; the rows never travel ----

void MoeTransformer::gathered_embed_forward() {
  const parallel::TensorGroup& group = plan_.tsp()->group();
  const std::int64_t all = static_cast<std::int64_t>(tokens_all_.size());
  parallel::vocab_embedding_forward(tokens_all_.data(), all, w_.embed, vocab_begin(), cfg_.vocab_size, whole_a_);
  group.reduce_scatter(whole_a_.data(), resid_[0].data(), resid_[0].numel());  // this rank's tokens' rows
}

void MoeTransformer::gathered_embed_backward() {
  const parallel::TensorGroup& group = plan_.tsp()->group();
  const std::int64_t all = static_cast<std::int64_t>(tokens_all_.size());
  group.all_gather(dres_.data(), whole_b_.data(), dres_.numel());
  parallel::vocab_embedding_backward(tokens_all_.data(), all, whole_b_, vocab_begin(), cfg_.vocab_size, g_.embed);
}

// The micro-batch's mean loss (the same on every rank of the group); ce_lse_ gets this rank's
// tokens' rows of lse_all_.
float MoeTransformer::gathered_head_forward() {
  const ops::cross_entropy::Options co = head_options(opt_, cfg_, vocab_);
  const parallel::TensorGroup& group = plan_.tsp()->group();
  group.all_gather(final_h_.data(), whole_a_.data(), final_h_.numel());
  const float loss = parallel::vocab_ce_forward(whole_a_, w_.lm_head, vocab_begin(), cfg_.vocab_size,
                                                targets_all_.data(), co, lse_all_, ce_scratch_, group.comm());
  const std::int64_t n = ce_lse_.numel();
  std::memcpy(ce_lse_.data(), lse_all_.data() + n * group.rank(), sizeof(float) * static_cast<std::size_t>(n));
  return loss;
}

// loss_scale: the micro-batch's mean loss's (every token's share of it is in the gradient).
void MoeTransformer::gathered_head_backward(float loss_scale) {
  const ops::cross_entropy::Options co = head_options(opt_, cfg_, vocab_);
  const parallel::TensorGroup& group = plan_.tsp()->group();
  parallel::vocab_ce_backward(whole_a_, w_.lm_head, vocab_begin(), cfg_.vocab_size, targets_all_.data(), lse_all_,
                              loss_scale, co, ce_scratch_, whole_b_, g_.lm_head);
  group.reduce_scatter(whole_b_.data(), dtmp_.data(), dtmp_.numel());
}

std::int64_t MoeTransformer::vocab_begin() const { return cfg_.vocab_size / vocab_.degree * vocab_.rank; }

double MoeTransformer::flops_per_micro_batch() const {
  return model_flops_per_micro_batch(cfg_, opt_.micro_batch, opt_.seq_length);
}

}  // namespace keel::train
