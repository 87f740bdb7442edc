#include "train/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string_view>

#include "common/error.h"
#include "ops/attention.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/residual_scale.h"
#include "ops/rmsnorm.h"
#include "ops/router.h"
#include "ops/swiglu.h"
#include "parallel/plan.h"

namespace keel::train {

Recompute parse_recompute(const std::string& s) {
  if (s == "none") return Recompute::kNone;
  if (s == "full") return Recompute::kFull;
  throw UsageError(fmt::format("recompute: unknown mode '{}' (choose none or full)", s));
}
const char* to_string(Recompute r) { return r == Recompute::kFull ? "full" : "none"; }

struct MoeTransformer::LayerActs {
  Tensor h1, rstd1, q, k, v, att, lse, x_mid, h2, rstd2;
  Tensor attn_out;                                   // residual scaling: the attention stage output
  ops::cca::Saved cca;                               // CCA
  Tensor g, u, a;                                    // dense
  Tensor rlogits, probs, rlse, gates, y;             // moe, linear router
  std::int32_t* idx = nullptr;
  std::int64_t* counts = nullptr;
  ops::moe::Plan plan;
  ops::moe::Saved saved;
  zaya::MoeActs zmoe;                                // moe, MLP router (saved.* shared with it)
  // backward scratch (shared by every layer; only the pointers are copied)
  Tensor dq, dk, dv, datt, dg, du, da, dgates, dlogits, moe_scratch;
};

namespace {

void add_into(const Tensor& dst, const Tensor& src) {
  const std::int64_t n = dst.numel();
  float* d = dst.data();
  const float* s = src.data();
  for (std::int64_t i = 0; i < n; ++i) d[i] += s[i];
}

// Parameter-name suffix -> slot of a ResScale.
Tensor* res_scale_slot(zaya::ResScale& r, const std::string& what) {
  if (what == "h_scale") return &r.h_scale;
  if (what == "h_bias") return &r.h_bias;
  if (what == "r_scale") return &r.r_scale;
  if (what == "r_bias") return &r.r_bias;
  return nullptr;
}

}  // namespace

void validate_trainable(const model::ModelConfig& cfg, const ModelOptions& opt) {
  model::validate(cfg);
  const std::string who = fmt::format("model '{}'", cfg.name);
  bool any_cca = false;
  for (int l = 0; l < cfg.layers; ++l) {
    const auto k = model::layer_attention_kind(cfg, l);
    any_cca |= k == model::AttentionKind::kCca;
    if (k == model::AttentionKind::kLinear)
      throw UsageError(fmt::format("{}: layer {} uses attention 'linear': keel train supports mha, gqa and cca so "
                                   "far (linear attention comes later)",
                                   who, l));
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
  // attention scores and values: 2 GEMMs of T x T x Dh per head and layer, causal half, x3
  // (fwd + bwd): 6 * layers * T * (Hq * Dh) per token
  const double attn = 3.0 * 2.0 * 2.0 * Hq * Dh * seq_length * 0.5 * tokens * cfg.layers;
  return 6.0 * active * tokens + attn;
}

MoeTransformer::MoeTransformer(const model::ModelConfig& config, const ModelOptions& options, const parallel::Mesh& mesh)
    : cfg_(config), opt_(options), mesh_(mesh) {
  parallel::check_plan(cfg_, mesh_.shape());
  validate_trainable(cfg_, opt_);
  for (int l = 0; l < cfg_.layers; ++l) {
    cca_layer_.push_back(model::layer_attention_kind(cfg_, l) == model::AttentionKind::kCca ? 1 : 0);
    if (model::is_moe_layer(cfg_, l)) {
      moe_index_of_layer_.push_back(static_cast<int>(moe_layer_ids_.size()));
      moe_layer_ids_.push_back(l);
    } else {
      moe_index_of_layer_.push_back(-1);
    }
  }
  cca_cfg_ = cca_config(cfg_);
  zshape_.tokens = static_cast<std::int64_t>(opt_.micro_batch) * opt_.seq_length;
  zshape_.hidden = cfg_.hidden;
  zshape_.router_hidden = cfg_.router_hidden;
  zshape_.expert_hidden = cfg_.expert_hidden;
  zshape_.experts = cfg_.experts;
  zshape_.skip = cfg_.router_skip_expert;
  const int classes = zshape_.classes();
  load_.assign(moe_layer_ids_.size(), std::vector<std::int64_t>(classes, 0));
  bias_.assign(moe_layer_ids_.size(), std::vector<float>(classes, 0.f));
  rope_ = ops::rope::make_table(cfg_.head_dim, cfg_.rope_fraction, cfg_.rope_base,
                                std::max(opt_.seq_length, cfg_.max_seq_len));
  // Expert parallelism: this rank holds E / ep experts of every MoE layer; tokens travel to them.
  if (mesh_.expert().size > 1)
    for (std::size_t m = 0; m < moe_layer_ids_.size(); ++m)
      ep_.push_back(std::make_unique<parallel::ExpertParallelMoe>(mesh_.expert().comm, cfg_.experts));
  allocate_params();
  const std::size_t act_bytes = plan_acts(nullptr);
  act_arena_ = std::make_unique<Arena>("activations", act_bytes);
  plan_acts(act_arena_.get());
  const std::int64_t n = static_cast<std::int64_t>(opt_.micro_batch) * opt_.seq_length;
  positions_.resize(n);
  for (std::int64_t i = 0; i < n; ++i) positions_[i] = static_cast<std::int32_t>(i % opt_.seq_length);
  init_parameters();
}

namespace {

Tensor param_view(float* base, const optim::ParamInfo& p) {
  const auto& s = p.shape;
  float* d = base + p.offset;
  if (s.size() == 1) return Tensor(d, {s[0]});
  if (s.size() == 2) return Tensor(d, {s[0], s[1]});
  return Tensor(d, {s[0], s[1], s[2]});
}

}  // namespace

WeightViews map_weights(const model::ModelConfig& cfg, const optim::ParamLayout& layout, float* base) {
  WeightViews w;
  w.layers.assign(static_cast<std::size_t>(cfg.layers), LayerWeights{});
  for (const auto& p : layout.params) {
    const Tensor t = param_view(base, p);
    if (p.name == "embed.weight") { w.embed = t; continue; }
    if (p.name == "final_norm.weight") { w.final_norm = t; continue; }
    if (p.name == "lm_head.weight") { w.lm_head = t; continue; }
    if (p.name.starts_with("final_res_scale.")) {
      Tensor* slot = res_scale_slot(w.final_scale, p.name.substr(16));
      if (!slot) fail("model: unmapped parameter '{}'", p.name);
      *slot = t;
      continue;
    }
    const auto dot = p.name.find('.', 7);
    const int l = std::stoi(p.name.substr(7, dot - 7));
    const std::string rest = p.name.substr(dot + 1);
    LayerWeights& L = w.layers[static_cast<std::size_t>(l)];
    if (rest == "attn_norm.weight") L.attn_norm = t;
    else if (rest == "attn.wq") L.wq = t;
    else if (rest == "attn.wk") L.wk = t;
    else if (rest == "attn.wv") L.wv = t;
    else if (rest == "attn.wo") L.wo = t;
    else if (rest == "mlp_norm.weight") L.mlp_norm = t;
    else if (rest == "moe.router") L.router = t, L.moe = true;
    else if (rest == "moe.w_gate") L.experts.w_gate = t, L.moe = true;
    else if (rest == "moe.w_up") L.experts.w_up = t;
    else if (rest == "moe.w_down") L.experts.w_down = t;
    else if (rest == "mlp.w_gate") L.w_gate = t;
    else if (rest == "mlp.w_up") L.w_up = t;
    else if (rest == "mlp.w_down") L.w_down = t;
    else if (rest == "attn.cca.w_qk") L.cca.w_qk = t;
    else if (rest == "attn.cca.w_v") L.cca.w_v = t;
    else if (rest == "attn.cca.conv0.weight") L.cca.conv0_w = t;
    else if (rest == "attn.cca.conv0.bias") L.cca.conv0_b = t;
    else if (rest == "attn.cca.conv1.weight") L.cca.conv1_w = t;
    else if (rest == "attn.cca.conv1.bias") L.cca.conv1_b = t;
    else if (rest == "attn.cca.temp") L.cca.temp = t;
    else if (rest == "attn.cca.wo") L.cca.w_o = t;
    else if (rest == "moe.router.down.weight") L.zrouter.w_down = t;
    else if (rest == "moe.router.down.bias") L.zrouter.b_down = t;
    else if (rest == "moe.router.eda_scale") L.zrouter.gamma = t;
    else if (rest == "moe.router.norm.weight") L.zrouter.w_norm = t;
    else if (rest == "moe.router.mlp1.weight") L.zrouter.w1 = t;
    else if (rest == "moe.router.mlp1.bias") L.zrouter.b1 = t;
    else if (rest == "moe.router.mlp2.weight") L.zrouter.w2 = t;
    else if (rest == "moe.router.mlp2.bias") L.zrouter.b2 = t;
    else if (rest == "moe.router.out.weight") L.zrouter.w3 = t;
    else if (rest.starts_with("res_scale.attn.") && res_scale_slot(L.attn_scale, rest.substr(15)))
      *res_scale_slot(L.attn_scale, rest.substr(15)) = t;
    else if (rest.starts_with("res_scale.mlp.") && res_scale_slot(L.mlp_scale, rest.substr(14)))
      *res_scale_slot(L.mlp_scale, rest.substr(14)) = t;
    else fail("model: unmapped parameter '{}'", p.name);
  }
  if (cfg.tied_embeddings) w.lm_head = w.embed;
  return w;
}

MoeTransformer::~MoeTransformer() = default;

void MoeTransformer::allocate_params() {
  layout_ = model::param_layout(cfg_, mesh_.shape());
  const std::size_t bytes = static_cast<std::size_t>(layout_.total_floats) * sizeof(float);
  param_arena_ = std::make_unique<Arena>("parameters", Arena::footprint(bytes));
  grad_arena_ = std::make_unique<Arena>("gradients", Arena::footprint(bytes));
  params_ = param_arena_->allocate<float>("flat", static_cast<std::size_t>(layout_.total_floats));
  grads_ = grad_arena_->allocate<float>("flat", static_cast<std::size_t>(layout_.total_floats));

  auto take = [](WeightViews v, std::vector<LayerParams>& layers, Tensor& embed, Tensor& fnorm, Tensor& head,
                 zaya::ResScale& fscale) {
    layers = std::move(v.layers);
    embed = v.embed, fnorm = v.final_norm, head = v.lm_head, fscale = v.final_scale;
  };
  take(map_weights(cfg_, layout_, params_), lp_, embed_, final_norm_, lm_head_, final_scale_);
  take(map_weights(cfg_, layout_, grads_), lg_, d_embed_, d_final_norm_, d_lm_head_, d_final_scale_);
}

std::size_t MoeTransformer::plan_acts(Arena* arena) {
  std::size_t total = 0;
  auto T = [&](const std::string& what, std::initializer_list<std::int64_t> shape) -> Tensor {
    std::int64_t n = 1;
    for (auto s : shape) n *= s;
    if (!arena) {
      total += Arena::footprint(static_cast<std::size_t>(n) * sizeof(float));
      return {};
    }
    return arena->tensor(what, shape);
  };
  auto raw = [&](const std::string& what, std::size_t bytes) -> void* {
    if (!arena) {
      total += Arena::footprint(bytes);
      return nullptr;
    }
    return arena->allocate_bytes(what, bytes);
  };
  const std::int64_t B = opt_.micro_batch, S = opt_.seq_length, N = B * S, D = cfg_.hidden, V = cfg_.vocab_size;
  const std::int64_t Hq = cfg_.heads, Hkv = cfg_.kv_heads, Dh = cfg_.head_dim;
  const std::int64_t E = std::max(cfg_.experts, 1), K = std::max(cfg_.top_k, 1), FE = std::max(cfg_.expert_hidden, 1);
  const std::int64_t FD = std::max(cfg_.ffn_hidden, 1), SL = N * K;
  const std::int64_t R = std::max(cfg_.router_hidden, 1), classes = zshape_.classes();
  const bool any_moe = !moe_layer_ids_.empty(), any_dense = moe_layer_ids_.size() < std::size_t(cfg_.layers);
  const bool mlp_router = cfg_.router_hidden > 0, scaled = cfg_.residual_scaling;
  const bool any_cca = std::count(cca_layer_.begin(), cca_layer_.end(), 1) > 0;
  const bool any_softmax = std::count(cca_layer_.begin(), cca_layer_.end(), 0) > 0;

  resid_.clear();
  for (int l = 0; l <= cfg_.layers; ++l) resid_.push_back(T(fmt::format("resid.{}", l), {N, D}));
  // Residual scaling keeps two streams: hres_[l] is the mixer output entering layer l (none
  // for layer 0, whose stream is the embedding in resid_[0]).
  hres_.assign(cfg_.layers + 1, Tensor());
  if (scaled)
    for (int l = 1; l <= cfg_.layers; ++l) hres_[l] = T(fmt::format("hres.{}", l), {N, D});
  // The MLP router's EDA state of each MoE stage: read by the next stage in forward and in
  // backward, so it lives outside the (possibly shared) layer workspaces.
  eda_state_.clear();
  if (mlp_router)
    for (std::size_t m = 0; m < moe_layer_ids_.size(); ++m) eda_state_.push_back(T(fmt::format("eda_state.{}", m), {N, R}));
  const int sets = opt_.recompute == Recompute::kFull ? 1 : cfg_.layers;
  std::vector<LayerActs> acts(sets);
  for (int i = 0; i < sets; ++i) {
    LayerActs& a = acts[i];
    const std::string p = fmt::format("layer.{}.", i);
    // with recompute none, layer i's set only needs its own attention and MLP kinds
    const bool moe = sets == 1 ? any_moe : moe_index_of_layer_[i] >= 0;
    const bool dense = sets == 1 ? any_dense : !moe;
    const bool cca = sets == 1 ? any_cca : cca_layer_[i] != 0;
    const bool softmax = sets == 1 ? any_softmax : cca_layer_[i] == 0;
    a.h1 = T(p + "h1", {N, D});
    a.rstd1 = T(p + "rstd1", {N});
    if (softmax) {
      a.q = T(p + "q", {B, S, Hq, Dh});
      a.k = T(p + "k", {B, S, Hkv, Dh});
      a.v = T(p + "v", {B, S, Hkv, Dh});
      a.att = T(p + "att", {B, S, Hq, Dh});
      a.lse = T(p + "lse", {B, Hq, S});
    }
    if (cca) {
      const Tensor buf = T(p + "cca_saved", {ops::cca::saved_floats(cca_cfg_, B, S)});
      if (arena) a.cca = ops::cca::carve_saved(cca_cfg_, B, S, buf.data());
    }
    a.x_mid = T(p + "x_mid", {N, D});
    if (scaled) a.attn_out = T(p + "attn_out", {N, D});
    a.h2 = T(p + "h2", {N, D});
    a.rstd2 = T(p + "rstd2", {N});
    if (dense) {
      a.g = T(p + "g", {N, FD});
      a.u = T(p + "u", {N, FD});
      a.a = T(p + "a", {N, FD});
    }
    if (moe && !mlp_router) {
      a.rlogits = T(p + "router_logits", {N, E});
      a.probs = T(p + "router_probs", {N, E});
      a.rlse = T(p + "router_lse", {N});
      a.gates = T(p + "gates", {N, K});
      a.y = T(p + "moe_out", {N, D});
      a.idx = static_cast<std::int32_t*>(raw(p + "expert_idx", SL * sizeof(std::int32_t)));
      a.counts = static_cast<std::int64_t*>(raw(p + "counts", E * sizeof(std::int64_t)));
    }
    if (moe && mlp_router) {
      // The router's `state` view in this buffer goes unused: forward points it at eda_state_.
      const Tensor buf = T(p + "router_saved", {ops::zaya_router::saved_floats(N, R, classes)});
      if (arena) a.zmoe.router = ops::zaya_router::carve_saved(buf.data(), N, R, classes);
    }
    if (moe) {
      a.saved.xs = T(p + "xs", {SL, D});
      a.saved.h_gate = T(p + "h_gate", {SL, FE});
      a.saved.h_up = T(p + "h_up", {SL, FE});
      a.saved.act = T(p + "act", {SL, FE});
      a.saved.ys = T(p + "ys", {SL, D});
      a.zmoe.experts = a.saved;
    }
  }
  // Backward scratch, shared by all layers.
  LayerActs s;
  if (any_softmax) {
    s.dq = T("bwd.dq", {B, S, Hq, Dh});
    s.dk = T("bwd.dk", {B, S, Hkv, Dh});
    s.dv = T("bwd.dv", {B, S, Hkv, Dh});
    s.datt = T("bwd.datt", {B, S, Hq, Dh});
  }
  if (any_dense) {
    s.dg = T("bwd.dg", {N, FD});
    s.du = T("bwd.du", {N, FD});
    s.da = T("bwd.da", {N, FD});
  }
  if (any_moe) {
    if (!mlp_router) {
      s.dgates = T("bwd.dgates", {N, K});
      s.dlogits = T("bwd.dlogits", {N, E});
    }
    s.moe_scratch = T("bwd.moe_scratch", {ops::moe::backward_scratch_floats(SL, D, FE)});
  }
  for (auto& a : acts) {
    a.dq = s.dq, a.dk = s.dk, a.dv = s.dv, a.datt = s.datt, a.dg = s.dg, a.du = s.du, a.da = s.da;
    a.dgates = s.dgates, a.dlogits = s.dlogits, a.moe_scratch = s.moe_scratch;
  }
  if (any_cca) cca_scratch_ = T("bwd.cca_scratch", {ops::cca::backward_scratch_floats(cca_cfg_, B, S)});
  if (any_moe && mlp_router) {
    zs_.xk = T("moe.xk", {N, D});
    zs_.yk = T("moe.yk", {N, D});
    zs_.dyk = T("bwd.moe.dyk", {N, D});
    zs_.dxk = T("bwd.moe.dxk", {N, D});
    zs_.dx_router = T("bwd.moe.dx_router", {N, D});
    zs_.gk = T("moe.gk", {N, 1});
    zs_.dgk = T("bwd.moe.dgk", {N, 1});
    zs_.dgates = T("bwd.moe.dgates", {N, 1});
    zs_.router = T("bwd.moe.router_scratch", {ops::zaya_router::backward_scratch_floats(N, R, classes)});
    zs_.experts = s.moe_scratch;
    deda_[0] = T("bwd.deda.0", {N, R});
    deda_[1] = T("bwd.deda.1", {N, R});
  }
  dres_ = T("bwd.dres", {N, D});
  dtmp_ = T("bwd.dtmp", {N, D});
  dtmp2_ = T("bwd.dtmp2", {N, D});
  if (scaled) {
    dhres_ = T("bwd.dhres", {N, D});
    dtmp3_ = T("bwd.dtmp3", {N, D});
    final_r_ = T("final_r", {N, D});
  }
  final_h_ = T("final_h", {N, D});
  final_rstd_ = T("final_rstd", {N});
  ce_lse_ = T("ce_lse", {N});
  const std::int64_t chunk = std::min<std::int64_t>(opt_.ce_chunk, V);
  ce_scratch_ = T("ce_scratch", {ops::cross_entropy::scratch_floats(N, chunk)});
  if (arena) acts_ = std::move(acts);
  return total;
}

std::int64_t MoeTransformer::param_count() const {  // the whole model's, whatever this rank holds
  return model::global_param_count(layout_);
}

Tensor MoeTransformer::param(const std::string& name) const {
  for (const auto& p : layout_.params)
    if (p.name == name) return param_view(params_, p);
  fail("model: no parameter '{}'", name);
}

Tensor MoeTransformer::grad(const std::string& name) const {
  const Tensor p = param(name);
  const std::int64_t off = p.data() - params_;
  return p.ndim() == 1   ? Tensor(grads_ + off, {p.dim(0)})
         : p.ndim() == 2 ? Tensor(grads_ + off, {p.dim(0), p.dim(1)})
                         : Tensor(grads_ + off, {p.dim(0), p.dim(1), p.dim(2)});
}

void MoeTransformer::init_parameters() {
  model::init_parameters(cfg_, layout_, opt_.init_std, opt_.init_seed, params_, mesh_.shape(), mesh_.coord());
  bias_ = model::initial_router_biases(cfg_);
  reset_load();
}

ops::cca::Config cca_config(const model::ModelConfig& cfg) {
  ops::cca::Config c;
  c.hidden = cfg.hidden;
  c.q_heads = cfg.heads;
  c.kv_heads = cfg.kv_heads;
  c.head_dim = cfg.head_dim;
  c.conv0_width = cfg.cca_conv_width;
  c.conv1_width = cfg.cca_group_conv_width;
  return c;
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

void update_balancing_bias(const std::vector<std::vector<std::int64_t>>& load, double rate,
                           std::vector<std::vector<float>>& bias) {
  for (std::size_t m = 0; m < load.size(); ++m) {
    double mean = 0;
    for (auto c : load[m]) mean += static_cast<double>(c);
    mean /= static_cast<double>(load[m].size());
    for (std::size_t e = 0; e < load[m].size(); ++e) {
      const double d = mean - static_cast<double>(load[m][e]);
      const float sgn = d > 0 ? 1.f : (d < 0 ? -1.f : 0.f);
      bias[m][e] += static_cast<float>(rate) * sgn;
    }
  }
}

void MoeTransformer::update_router_bias() {
  if (opt_.bias_update_rate != 0.0) update_balancing_bias(load_, opt_.bias_update_rate, bias_);
  reset_load();
}

// ---- attention sub-block: y = attn(a.h1) ----

void MoeTransformer::attn_forward(int l, LayerActs& a, const Tensor& y) {
  const LayerParams& P = lp_[l];
  const std::int64_t N = a.h1.dim(0);
  if (cca_layer_[l]) {
    ops::cca::forward(cca_cfg_, opt_.micro_batch, opt_.seq_length, a.h1, positions_.data(), rope_, P.cca, a.cca, y);
    return;
  }
  const Tensor q2 = a.q.reshaped({N, a.q.numel() / N}), k2 = a.k.reshaped({N, a.k.numel() / N}),
               v2 = a.v.reshaped({N, a.v.numel() / N});
  ops::linear::forward(a.h1, P.wq, {}, q2);
  ops::linear::forward(a.h1, P.wk, {}, k2);
  ops::linear::forward(a.h1, P.wv, {}, v2);
  const Tensor q3 = a.q.reshaped({N, cfg_.heads, cfg_.head_dim}), k3 = a.k.reshaped({N, cfg_.kv_heads, cfg_.head_dim});
  ops::rope::forward(rope_, q3, positions_.data(), q3);
  ops::rope::forward(rope_, k3, positions_.data(), k3);
  const float scale = 1.0f / std::sqrt(static_cast<float>(cfg_.head_dim));
  ops::attention::forward(a.q, a.k, a.v, scale, a.att, a.lse);
  ops::linear::forward(a.att.reshaped({N, a.att.numel() / N}), P.wo, {}, y);
}

// dy: dL/dy; dh (overwritten): dL/d a.h1; scratch [N, D].
void MoeTransformer::attn_backward(int l, LayerActs& a, const Tensor& dy, const Tensor& dh, const Tensor& scratch) {
  const LayerParams& P = lp_[l];
  LayerParams& G = lg_[l];
  const std::int64_t N = a.h1.dim(0);
  if (cca_layer_[l]) {
    ops::cca::backward(cca_cfg_, opt_.micro_batch, opt_.seq_length, a.h1, positions_.data(), rope_, P.cca, a.cca, dy,
                       dh, G.cca, cca_scratch_);
    return;
  }
  const Tensor datt2 = a.datt.reshaped({N, a.datt.numel() / N});
  ops::linear::backward(a.att.reshaped({N, a.att.numel() / N}), P.wo, dy, datt2, G.wo, {});
  const float scale = 1.0f / std::sqrt(static_cast<float>(cfg_.head_dim));
  ops::attention::backward(a.q, a.k, a.v, a.att, a.lse, a.datt, scale, a.dq, a.dk, a.dv);
  const Tensor dq3 = a.dq.reshaped({N, cfg_.heads, cfg_.head_dim}), dk3 = a.dk.reshaped({N, cfg_.kv_heads, cfg_.head_dim});
  ops::rope::backward(rope_, dq3, positions_.data(), dq3);
  ops::rope::backward(rope_, dk3, positions_.data(), dk3);
  ops::linear::backward(a.h1, P.wq, a.dq.reshaped({N, a.dq.numel() / N}), dh, G.wq, {});
  ops::linear::backward(a.h1, P.wk, a.dk.reshaped({N, a.dk.numel() / N}), scratch, G.wk, {});
  add_into(dh, scratch);
  ops::linear::backward(a.h1, P.wv, a.dv.reshaped({N, a.dv.numel() / N}), scratch, G.wv, {});
  add_into(dh, scratch);
}

// ---- MLP sub-block: y = mlp(a.h2) (dense SwiGLU, or routed experts) ----

zaya::MoeParams MoeTransformer::zaya_moe_params(const LayerParams& L, int m) const {
  return {L.zrouter, L.experts, ep_.empty() ? nullptr : ep_[static_cast<std::size_t>(m)].get()};
}

void MoeTransformer::mlp_forward(int l, LayerActs& a, bool count_load, LossParts& lp, const Tensor& y) {
  const LayerParams& P = lp_[l];
  const std::int64_t N = a.h2.dim(0);
  const int m = moe_index_of_layer_[l];
  if (m < 0) {
    ops::linear::forward(a.h2, P.w_gate, {}, a.g);
    ops::linear::forward(a.h2, P.w_up, {}, a.u);
    ops::swiglu::forward(a.g, a.u, a.a);
    ops::linear::forward(a.a, P.w_down, {}, y);
  } else if (cfg_.router_hidden > 0) {
    // ZAYA1 router: no aux or z loss (balancing is the bias controller's job).
    a.zmoe.router.state = eda_state_[m];
    const Tensor prev = m > 0 ? eda_state_[m - 1] : Tensor();
    const Tensor bias(bias_[m].data(), {zshape_.classes()});
    zaya::moe_forward(zshape_, zaya_moe_params(P, m), a.h2, prev, bias, static_cast<float>(cfg_.norm_eps), a.zmoe, zs_, y);
    if (count_load)
      for (int e = 0; e < zshape_.classes(); ++e) load_[m][e] += a.zmoe.router.counts[e];
  } else {
    ops::linear::forward(a.h2, P.router, {}, a.rlogits);
    ops::router::Options ro{cfg_.top_k, opt_.renormalize_gates};
    const Tensor bias(bias_[m].data(), {cfg_.experts});
    const auto losses = ops::router::forward(a.rlogits, bias, ro, a.probs, a.rlse, a.idx, a.gates, a.counts);
    lp.aux += losses.aux;
    lp.z += losses.z;
    if (count_load)
      for (int e = 0; e < cfg_.experts; ++e) load_[m][e] += a.counts[e];
    a.plan = ops::moe::make_plan(a.idx, N, cfg_.top_k, cfg_.experts);
    if (!ep_.empty())
      ep_[static_cast<std::size_t>(m)]->forward(a.plan, a.h2, a.gates, P.experts, y);
    else
      ops::moe::forward(a.plan, a.h2, a.gates, P.experts, a.saved, y);
  }
}

// dy: dL/dy; dh (overwritten): dL/d a.h2; scratch [N, D].
void MoeTransformer::mlp_backward(int l, LayerActs& a, const Tensor& dy, const Tensor& dh, const Tensor& scratch) {
  const LayerParams& P = lp_[l];
  LayerParams& G = lg_[l];
  const int m = moe_index_of_layer_[l];
  if (m < 0) {
    ops::linear::backward(a.a, P.w_down, dy, a.da, G.w_down, {});
    ops::swiglu::backward(a.g, a.u, a.da, a.dg, a.du);
    ops::linear::backward(a.h2, P.w_gate, a.dg, dh, G.w_gate, {});
    ops::linear::backward(a.h2, P.w_up, a.du, scratch, G.w_up, {});
    add_into(dh, scratch);
  } else if (cfg_.router_hidden > 0) {
    // EDA chain: stage m + 1 left dL/d state_m in deda_[(m + 1) % 2]; this stage writes
    // dL/d state_{m-1} into the other buffer.
    const int nmoe = static_cast<int>(moe_layer_ids_.size());
    const Tensor prev = m > 0 ? eda_state_[m - 1] : Tensor();
    const Tensor dnext = m + 1 < nmoe ? deda_[(m + 1) % 2] : Tensor();
    const Tensor dprev = m > 0 ? deda_[m % 2] : Tensor();
    zaya::moe_backward(zshape_, zaya_moe_params(P, m), zaya_moe_params(G, m), a.h2, prev, a.zmoe, zs_, dy, dnext, dh, dprev);
  } else {
    ops::router::Options ro{cfg_.top_k, opt_.renormalize_gates};
    if (!ep_.empty())
      ep_[static_cast<std::size_t>(m)]->backward(dy, P.experts, dh, a.dgates, G.experts);
    else
      ops::moe::backward(a.plan, a.h2, a.gates, P.experts, a.saved, dy, a.moe_scratch, dh, a.dgates, G.experts);
    ops::router::backward(a.probs, a.rlse, a.idx, a.gates, a.counts, ro, a.dgates,
                          static_cast<float>(opt_.aux_loss_weight * cur_scale_), static_cast<float>(opt_.z_loss_weight * cur_scale_),
                          a.dlogits);
    ops::linear::backward(a.h2, P.router, a.dlogits, scratch, G.router, {});
    add_into(dh, scratch);
  }
}

// ---- plain pre-norm layer: x_mid = x + attn(n1(x)); y = x_mid + mlp(n2(x_mid)) ----

void MoeTransformer::layer_forward(int l, LayerActs& a, const Tensor& x_in, const Tensor& x_out, bool count_load,
                                   LossParts& lp) {
  const LayerParams& P = lp_[l];
  const float eps = static_cast<float>(cfg_.norm_eps);
  ops::rmsnorm::forward(x_in, P.attn_norm, eps, a.h1, a.rstd1);
  attn_forward(l, a, a.x_mid);
  add_into(a.x_mid, x_in);
  ops::rmsnorm::forward(a.x_mid, P.mlp_norm, eps, a.h2, a.rstd2);
  mlp_forward(l, a, count_load, lp, x_out);
  add_into(x_out, a.x_mid);
}

void MoeTransformer::layer_backward(int l, LayerActs& a, const Tensor& x_in, const Tensor& dres) {
  const LayerParams& P = lp_[l];
  LayerParams& G = lg_[l];
  // MLP block: y = x_mid + mlp(n2(x_mid)); dres holds dL/dy.
  mlp_backward(l, a, dres, dtmp_, dtmp2_);
  ops::rmsnorm::backward(a.x_mid, P.mlp_norm, a.rstd2, dtmp_, dres, G.mlp_norm);  // adds: dres now dL/dx_mid
  // Attention block: x_mid = x_in + attn(n1(x_in)).
  attn_backward(l, a, dres, dtmp_, dtmp2_);
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
  const LayerParams& P = lp_[l];
  const float eps = static_cast<float>(cfg_.norm_eps);
  const zaya::ResScale& A = P.attn_scale;
  const zaya::ResScale& M = P.mlp_scale;
  if (l == 0)
    ops::residual_scale::forward(resid_[0], A.h_bias, A.h_scale, a.x_mid);
  else
    ops::residual_scale::merge_forward(resid_[l], hres_[l], A.r_bias, A.r_scale, A.h_bias, A.h_scale, a.x_mid);
  ops::rmsnorm::forward(a.x_mid, P.attn_norm, eps, a.h1, a.rstd1);
  attn_forward(l, a, a.attn_out);
  ops::residual_scale::merge_forward(a.x_mid, a.attn_out, M.r_bias, M.r_scale, M.h_bias, M.h_scale, r_out);
  ops::rmsnorm::forward(r_out, P.mlp_norm, eps, a.h2, a.rstd2);
  mlp_forward(l, a, count_load, lp, h_out);
}

// In: dres_ = dL/d resid_[l + 1], dhres_ = dL/d hres_[l + 1]. Out: dres_ = dL/d resid_[l],
// dhres_ = dL/d hres_[l] (layer 0: dres_ = dL/d embedding).
void MoeTransformer::scaled_layer_backward(int l, LayerActs& a) {
  const LayerParams& P = lp_[l];
  LayerParams& G = lg_[l];
  const zaya::ResScale &A = P.attn_scale, &M = P.mlp_scale, &dA = G.attn_scale, &dM = G.mlp_scale;
  mlp_backward(l, a, dhres_, dtmp3_, dtmp_);                                         // dtmp3 = dL/dh2
  ops::rmsnorm::backward(resid_[l + 1], P.mlp_norm, a.rstd2, dtmp3_, dres_, G.mlp_norm);  // adds: dres = dL/dr2
  ops::residual_scale::merge_backward(a.x_mid, a.attn_out, M.r_bias, M.r_scale, M.h_bias, M.h_scale, dres_, dres_,
                                      dtmp3_, dM.r_bias, dM.r_scale, dM.h_bias, dM.h_scale);  // dres = dL/dr1 (so far)
  attn_backward(l, a, dtmp3_, dtmp_, dtmp2_);                                         // dtmp = dL/dh1
  ops::rmsnorm::backward(a.x_mid, P.attn_norm, a.rstd1, dtmp_, dres_, G.attn_norm);   // adds: dres = dL/dr1
  if (l == 0)
    ops::residual_scale::backward(resid_[0], A.h_bias, A.h_scale, dres_, dres_, dA.h_bias, dA.h_scale);
  else
    ops::residual_scale::merge_backward(resid_[l], hres_[l], A.r_bias, A.r_scale, A.h_bias, A.h_scale, dres_, dres_,
                                        dhres_, dA.r_bias, dA.r_scale, dA.h_bias, dA.h_scale);
}

LossParts MoeTransformer::forward(const std::uint32_t* tokens, const std::int32_t* targets) {
  const std::int64_t N = static_cast<std::int64_t>(opt_.micro_batch) * opt_.seq_length;
  tokens_.assign(tokens, tokens + N);
  targets_.assign(targets, targets + N);
  LossParts lp;
  ops::embedding::forward(tokens_.data(), N, embed_, resid_[0]);
  const bool scaled = cfg_.residual_scaling;
  for (int l = 0; l < cfg_.layers; ++l) {
    LayerActs& a = acts_[opt_.recompute == Recompute::kFull ? 0 : l];
    if (scaled)
      scaled_layer_forward(l, a, resid_[l + 1], hres_[l + 1], /*count_load=*/true, lp);
    else
      layer_forward(l, a, resid_[l], resid_[l + 1], /*count_load=*/true, lp);
  }
  Tensor final_in = resid_[cfg_.layers];
  if (scaled) {
    const zaya::ResScale& F = final_scale_;
    ops::residual_scale::merge_forward(resid_[cfg_.layers], hres_[cfg_.layers], F.r_bias, F.r_scale, F.h_bias,
                                       F.h_scale, final_r_);
    final_in = final_r_;
  }
  ops::rmsnorm::forward(final_in, final_norm_, static_cast<float>(cfg_.norm_eps), final_h_, final_rstd_);
  ops::cross_entropy::Options co;
  co.chunk = std::min<std::int64_t>(opt_.ce_chunk, cfg_.vocab_size);
  lp.ce = ops::cross_entropy::forward(final_h_, lm_head_, targets_.data(), co, ce_lse_, ce_scratch_);
  if (opt_.precise_loss) {
    const std::int64_t V = cfg_.vocab_size, D = cfg_.hidden;
    std::vector<double> z(static_cast<std::size_t>(V));
    double sum = 0;
    std::int64_t valid = 0;
    for (std::int64_t i = 0; i < N; ++i) {
      if (targets_[i] == co.ignore_index) continue;
      const float* h = final_h_.row(i);
      double m = -1e300;
      for (std::int64_t v = 0; v < V; ++v) {
        double acc = 0;
        const float* w = lm_head_.row(v);
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
  lp.total = lp.ce + opt_.aux_loss_weight * lp.aux + opt_.z_loss_weight * lp.z;
  have_forward_ = true;
  return lp;
}

void MoeTransformer::backward(float loss_scale) {
  if (!have_forward_) fail("model: backward() without a forward()");
  cur_scale_ = loss_scale;
  const std::int64_t N = static_cast<std::int64_t>(opt_.micro_batch) * opt_.seq_length;
  const bool scaled = cfg_.residual_scaling, full = opt_.recompute == Recompute::kFull;
  ops::cross_entropy::Options co;
  co.chunk = std::min<std::int64_t>(opt_.ce_chunk, cfg_.vocab_size);
  ops::cross_entropy::backward(final_h_, lm_head_, targets_.data(), ce_lse_, loss_scale, co, ce_scratch_, dtmp_, d_lm_head_);
  // rmsnorm adds its dx into the residual gradient; the final norm is its first writer in this
  // micro-batch, so clear what the previous backward left there (as the CUDA backend does).
  dres_.zero();
  ops::rmsnorm::backward(scaled ? final_r_ : resid_[cfg_.layers], final_norm_, final_rstd_, dtmp_, dres_, d_final_norm_);
  if (scaled) {
    const zaya::ResScale &F = final_scale_, &dF = d_final_scale_;
    ops::residual_scale::merge_backward(resid_[cfg_.layers], hres_[cfg_.layers], F.r_bias, F.r_scale, F.h_bias,
                                        F.h_scale, dres_, dres_, dhres_, dF.r_bias, dF.r_scale, dF.h_bias, dF.h_scale);
  }
  for (int l = cfg_.layers - 1; l >= 0; --l) {
    LayerActs& a = acts_[full ? 0 : l];
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
  ops::embedding::backward(tokens_.data(), N, dres_, d_embed_);
  have_forward_ = false;
}

double MoeTransformer::flops_per_micro_batch() const {
  return model_flops_per_micro_batch(cfg_, opt_.micro_batch, opt_.seq_length);
}

}  // namespace keel::train
