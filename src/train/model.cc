#include "train/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include "common/error.h"
#include "ops/attention.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/router.h"
#include "ops/swiglu.h"

namespace keel::train {

Recompute parse_recompute(const std::string& s) {
  if (s == "none") return Recompute::kNone;
  if (s == "full") return Recompute::kFull;
  throw UsageError(fmt::format("recompute: unknown mode '{}' (choose none or full)", s));
}
const char* to_string(Recompute r) { return r == Recompute::kFull ? "full" : "none"; }

struct MoeTransformer::LayerParams {
  Tensor attn_norm, wq, wk, wv, wo, mlp_norm;
  bool moe = false;
  Tensor w_gate, w_up, w_down;  // dense [F, D], [F, D], [D, F]
  Tensor router;                // [E, D]
  ops::moe::Weights experts;
};

struct MoeTransformer::LayerActs {
  Tensor h1, rstd1, q, k, v, att, lse, x_mid, h2, rstd2;
  Tensor g, u, a;                                    // dense
  Tensor rlogits, probs, rlse, gates, y;             // moe
  std::int32_t* idx = nullptr;
  std::int64_t* counts = nullptr;
  ops::moe::Plan plan;
  ops::moe::Saved saved;
  // backward scratch (shared by every layer; only the pointers are copied)
  Tensor dq, dk, dv, datt, dg, du, da, dgates, dlogits, moe_scratch;
};

namespace {

// Deterministic normal draws (splitmix64 + Box-Muller), the same on every platform.
struct Rng {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
  double normal() { return std::sqrt(-2.0 * std::log(uniform())) * std::cos(6.283185307179586 * uniform()); }
};

void add_into(const Tensor& dst, const Tensor& src) {
  const std::int64_t n = dst.numel();
  float* d = dst.data();
  const float* s = src.data();
  for (std::int64_t i = 0; i < n; ++i) d[i] += s[i];
}

std::vector<optim::GroupRule> adamw_rules() {
  std::vector<optim::GroupRule> r(3);
  r[0].group = "embeddings";
  r[0].include = "*embed*|*lm_head*";
  r[0].min_ndim = 2;
  r[1].group = "vectors";
  r[1].max_ndim = 1;
  r[1].weight_decay = false;
  r[2].group = "matrices";
  r[2].exclude = "*embed*|*lm_head*";
  r[2].min_ndim = 2;
  return r;
}

}  // namespace

void validate_trainable(const model::ModelConfig& cfg, const ModelOptions& opt) {
  model::validate(cfg);
  const std::string who = fmt::format("model '{}'", cfg.name);
  for (int l = 0; l < cfg.layers; ++l) {
    const auto k = model::layer_attention_kind(cfg, l);
    if (k != model::AttentionKind::kMha && k != model::AttentionKind::kGqa)
      throw UsageError(fmt::format("{}: layer {} uses attention '{}': keel train supports only mha and gqa so far "
                                   "(CCA and linear attention come later)",
                                   who, l, model::attention_kind_name(k)));
  }
  auto reject = [&](bool bad, const char* what) {
    if (bad) throw UsageError(fmt::format("{}: {} is not supported by keel train yet", who, what));
  };
  reject(cfg.router_hidden > 0, "an MLP router (router_hidden > 0)");
  reject(cfg.router_skip_expert, "router_skip_expert");
  reject(cfg.shared_experts > 0, "shared_experts");
  reject(cfg.residual_scaling, "residual_scaling");
  reject(cfg.qk_norm, "qk_norm");
  if (opt.micro_batch < 1 || opt.seq_length < 1)
    throw UsageError(fmt::format("{}: micro_batch ({}) and seq_length ({}) must be >= 1", who, opt.micro_batch, opt.seq_length));
  if (cfg.max_seq_len > 0 && opt.seq_length > cfg.max_seq_len)
    throw UsageError(fmt::format("{}: seq_length {} exceeds max_seq_len {}", who, opt.seq_length, cfg.max_seq_len));
  if (opt.ce_chunk < 1) throw UsageError("ce_chunk must be >= 1");
}

optim::ParamLayout model_param_layout(const model::ModelConfig& cfg) {
  const std::int64_t D = cfg.hidden, V = cfg.vocab_size, Dh = cfg.head_dim;
  const std::int64_t Q = std::int64_t(cfg.heads) * Dh, KV = std::int64_t(cfg.kv_heads) * Dh;
  std::vector<optim::ParamSpec> specs;
  specs.push_back({"embed.weight", {V, D}});
  for (int l = 0; l < cfg.layers; ++l) {
    const std::string p = fmt::format("layers.{}.", l);
    specs.push_back({p + "attn_norm.weight", {D}});
    specs.push_back({p + "attn.wq", {Q, D}});
    specs.push_back({p + "attn.wk", {KV, D}});
    specs.push_back({p + "attn.wv", {KV, D}});
    specs.push_back({p + "attn.wo", {D, Q}});
    specs.push_back({p + "mlp_norm.weight", {D}});
    if (model::is_moe_layer(cfg, l)) {
      const std::int64_t E = cfg.experts, F = cfg.expert_hidden;
      specs.push_back({p + "moe.router", {E, D}});
      specs.push_back({p + "moe.w_gate", {E, F, D}});
      specs.push_back({p + "moe.w_up", {E, F, D}});
      specs.push_back({p + "moe.w_down", {E, D, F}});
    } else {
      const std::int64_t F = cfg.ffn_hidden;
      if (F <= 0) throw UsageError(fmt::format("model '{}': dense layer {} needs ffn_hidden > 0", cfg.name, l));
      specs.push_back({p + "mlp.w_gate", {F, D}});
      specs.push_back({p + "mlp.w_up", {F, D}});
      specs.push_back({p + "mlp.w_down", {D, F}});
    }
  }
  specs.push_back({"final_norm.weight", {D}});
  if (!cfg.tied_embeddings) specs.push_back({"lm_head.weight", {V, D}});
  return optim::assign_groups(specs, adamw_rules());
}

void init_model_parameters(const model::ModelConfig& cfg, const optim::ParamLayout& layout, double init_std,
                           std::uint64_t seed, float* params) {
  Rng rng{seed};
  const double out_scale = 1.0 / std::sqrt(2.0 * cfg.layers);
  std::memset(params, 0, static_cast<std::size_t>(layout.total_floats) * sizeof(float));
  for (const auto& p : layout.params) {
    float* d = params + p.offset;
    if (p.ndim() == 1) {
      std::fill(d, d + p.numel, 1.0f);
      continue;
    }
    const bool out_proj = p.name.ends_with(".wo") || p.name.ends_with("w_down");
    const double std = init_std * (out_proj ? out_scale : 1.0);
    for (std::int64_t i = 0; i < p.numel; ++i) d[i] = static_cast<float>(std * rng.normal());
  }
}

double model_flops_per_micro_batch(const model::ModelConfig& cfg, int micro_batch, int seq_length) {
  const double tokens = static_cast<double>(micro_batch) * seq_length;
  const double D = cfg.hidden, Dh = cfg.head_dim, Hq = cfg.heads, Hkv = cfg.kv_heads;
  double active = 0;
  for (int l = 0; l < cfg.layers; ++l) {
    active += D * Dh * (2 * Hq + 2 * Hkv);
    if (model::is_moe_layer(cfg, l))
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

MoeTransformer::MoeTransformer(const model::ModelConfig& config, const ModelOptions& options, const ParallelContext& ctx)
    : cfg_(config), opt_(options), ctx_(ctx) {
  ctx_.require_single("model");
  validate_trainable(cfg_, opt_);
  for (int l = 0; l < cfg_.layers; ++l) {
    if (model::is_moe_layer(cfg_, l)) {
      moe_index_of_layer_.push_back(static_cast<int>(moe_layer_ids_.size()));
      moe_layer_ids_.push_back(l);
    } else {
      moe_index_of_layer_.push_back(-1);
    }
  }
  load_.assign(moe_layer_ids_.size(), std::vector<std::int64_t>(cfg_.experts, 0));
  bias_.assign(moe_layer_ids_.size(), std::vector<float>(cfg_.experts, 0.f));
  rope_ = ops::rope::make_table(cfg_.head_dim, cfg_.rope_fraction, cfg_.rope_base,
                                std::max(opt_.seq_length, cfg_.max_seq_len));
  allocate_params();
  const std::size_t act_bytes = plan_acts(nullptr);
  act_arena_ = std::make_unique<Arena>("activations", act_bytes);
  plan_acts(act_arena_.get());
  const std::int64_t n = static_cast<std::int64_t>(opt_.micro_batch) * opt_.seq_length;
  positions_.resize(n);
  for (std::int64_t i = 0; i < n; ++i) positions_[i] = static_cast<std::int32_t>(i % opt_.seq_length);
  init_parameters();
}

MoeTransformer::~MoeTransformer() = default;

void MoeTransformer::allocate_params() {
  layout_ = model_param_layout(cfg_);
  const std::size_t bytes = static_cast<std::size_t>(layout_.total_floats) * sizeof(float);
  param_arena_ = std::make_unique<Arena>("parameters", Arena::footprint(bytes));
  grad_arena_ = std::make_unique<Arena>("gradients", Arena::footprint(bytes));
  params_ = param_arena_->allocate<float>("flat", static_cast<std::size_t>(layout_.total_floats));
  grads_ = grad_arena_->allocate<float>("flat", static_cast<std::size_t>(layout_.total_floats));

  auto view = [](float* base, const optim::ParamInfo& p) {
    const auto& s = p.shape;
    float* d = base + p.offset;
    if (s.size() == 1) return Tensor(d, {s[0]});
    if (s.size() == 2) return Tensor(d, {s[0], s[1]});
    return Tensor(d, {s[0], s[1], s[2]});
  };
  auto fill = [&](float* base, std::vector<LayerParams>& out, Tensor& embed, Tensor& fnorm, Tensor& head) {
    out.assign(cfg_.layers, LayerParams{});
    for (const auto& p : layout_.params) {
      const Tensor t = view(base, p);
      if (p.name == "embed.weight") { embed = t; continue; }
      if (p.name == "final_norm.weight") { fnorm = t; continue; }
      if (p.name == "lm_head.weight") { head = t; continue; }
      const auto dot = p.name.find('.', 7);
      const int l = std::stoi(p.name.substr(7, dot - 7));
      const std::string rest = p.name.substr(dot + 1);
      LayerParams& L = out[l];
      if (rest == "attn_norm.weight") L.attn_norm = t;
      else if (rest == "attn.wq") L.wq = t;
      else if (rest == "attn.wk") L.wk = t;
      else if (rest == "attn.wv") L.wv = t;
      else if (rest == "attn.wo") L.wo = t;
      else if (rest == "mlp_norm.weight") L.mlp_norm = t;
      else if (rest == "moe.router") L.router = t, L.moe = true;
      else if (rest == "moe.w_gate") L.experts.w_gate = t;
      else if (rest == "moe.w_up") L.experts.w_up = t;
      else if (rest == "moe.w_down") L.experts.w_down = t;
      else if (rest == "mlp.w_gate") L.w_gate = t;
      else if (rest == "mlp.w_up") L.w_up = t;
      else if (rest == "mlp.w_down") L.w_down = t;
    }
    if (cfg_.tied_embeddings) head = embed;
  };
  fill(params_, lp_, embed_, final_norm_, lm_head_);
  fill(grads_, lg_, d_embed_, d_final_norm_, d_lm_head_);
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
  const bool any_moe = !moe_layer_ids_.empty(), any_dense = moe_layer_ids_.size() < std::size_t(cfg_.layers);

  resid_.clear();
  for (int l = 0; l <= cfg_.layers; ++l) resid_.push_back(T(fmt::format("resid.{}", l), {N, D}));
  const int sets = opt_.recompute == Recompute::kFull ? 1 : cfg_.layers;
  std::vector<LayerActs> acts(sets);
  for (int i = 0; i < sets; ++i) {
    LayerActs& a = acts[i];
    const std::string p = fmt::format("layer.{}.", i);
    // with recompute none, layer i's set only needs its own MLP kind
    const bool moe = sets == 1 ? any_moe : moe_index_of_layer_[i] >= 0;
    const bool dense = sets == 1 ? any_dense : !moe;
    a.h1 = T(p + "h1", {N, D});
    a.rstd1 = T(p + "rstd1", {N});
    a.q = T(p + "q", {B, S, Hq, Dh});
    a.k = T(p + "k", {B, S, Hkv, Dh});
    a.v = T(p + "v", {B, S, Hkv, Dh});
    a.att = T(p + "att", {B, S, Hq, Dh});
    a.lse = T(p + "lse", {B, Hq, S});
    a.x_mid = T(p + "x_mid", {N, D});
    a.h2 = T(p + "h2", {N, D});
    a.rstd2 = T(p + "rstd2", {N});
    if (dense) {
      a.g = T(p + "g", {N, FD});
      a.u = T(p + "u", {N, FD});
      a.a = T(p + "a", {N, FD});
    }
    if (moe) {
      a.rlogits = T(p + "router_logits", {N, E});
      a.probs = T(p + "router_probs", {N, E});
      a.rlse = T(p + "router_lse", {N});
      a.gates = T(p + "gates", {N, K});
      a.y = T(p + "moe_out", {N, D});
      a.idx = static_cast<std::int32_t*>(raw(p + "expert_idx", SL * sizeof(std::int32_t)));
      a.counts = static_cast<std::int64_t*>(raw(p + "counts", E * sizeof(std::int64_t)));
      a.saved.xs = T(p + "xs", {SL, D});
      a.saved.h_gate = T(p + "h_gate", {SL, FE});
      a.saved.h_up = T(p + "h_up", {SL, FE});
      a.saved.act = T(p + "act", {SL, FE});
      a.saved.ys = T(p + "ys", {SL, D});
    }
  }
  // Backward scratch, shared by all layers.
  LayerActs s;
  s.dq = T("bwd.dq", {B, S, Hq, Dh});
  s.dk = T("bwd.dk", {B, S, Hkv, Dh});
  s.dv = T("bwd.dv", {B, S, Hkv, Dh});
  s.datt = T("bwd.datt", {B, S, Hq, Dh});
  if (any_dense) {
    s.dg = T("bwd.dg", {N, FD});
    s.du = T("bwd.du", {N, FD});
    s.da = T("bwd.da", {N, FD});
  }
  if (any_moe) {
    s.dgates = T("bwd.dgates", {N, K});
    s.dlogits = T("bwd.dlogits", {N, E});
    s.moe_scratch = T("bwd.moe_scratch", {ops::moe::backward_scratch_floats(SL, D, FE)});
  }
  for (auto& a : acts) {
    a.dq = s.dq, a.dk = s.dk, a.dv = s.dv, a.datt = s.datt, a.dg = s.dg, a.du = s.du, a.da = s.da;
    a.dgates = s.dgates, a.dlogits = s.dlogits, a.moe_scratch = s.moe_scratch;
  }
  dres_ = T("bwd.dres", {N, D});
  dtmp_ = T("bwd.dtmp", {N, D});
  dtmp2_ = T("bwd.dtmp2", {N, D});
  final_h_ = T("final_h", {N, D});
  final_rstd_ = T("final_rstd", {N});
  ce_lse_ = T("ce_lse", {N});
  const std::int64_t chunk = std::min<std::int64_t>(opt_.ce_chunk, V);
  ce_scratch_ = T("ce_scratch", {ops::cross_entropy::scratch_floats(N, chunk)});
  if (arena) acts_ = std::move(acts);
  return total;
}

std::int64_t MoeTransformer::param_count() const {
  std::int64_t n = 0;
  for (const auto& p : layout_.params) n += p.numel;
  return n;
}

Tensor MoeTransformer::param(const std::string& name) const {
  for (const auto& p : layout_.params)
    if (p.name == name) {
      const auto& s = p.shape;
      float* d = params_ + p.offset;
      return s.size() == 1 ? Tensor(d, {s[0]}) : s.size() == 2 ? Tensor(d, {s[0], s[1]}) : Tensor(d, {s[0], s[1], s[2]});
    }
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
  init_model_parameters(cfg_, layout_, opt_.init_std, opt_.init_seed, params_);
  for (auto& b : bias_) std::fill(b.begin(), b.end(), 0.f);
  reset_load();
}

void MoeTransformer::zero_grads() { grad_arena_->zero_used(); }

void MoeTransformer::reset_load() {
  for (auto& l : load_) std::fill(l.begin(), l.end(), 0);
}

void MoeTransformer::update_router_bias() {
  if (opt_.bias_update_rate != 0.0) {
    for (std::size_t m = 0; m < load_.size(); ++m) {
      double mean = 0;
      for (auto c : load_[m]) mean += static_cast<double>(c);
      mean /= static_cast<double>(load_[m].size());
      for (std::size_t e = 0; e < load_[m].size(); ++e) {
        const double d = mean - static_cast<double>(load_[m][e]);
        const float sgn = d > 0 ? 1.f : (d < 0 ? -1.f : 0.f);
        bias_[m][e] += static_cast<float>(opt_.bias_update_rate) * sgn;
      }
    }
  }
  reset_load();
}

void MoeTransformer::layer_forward(int l, LayerActs& a, const Tensor& x_in, const Tensor& x_out, bool count_load,
                                   LossParts& lp) {
  const LayerParams& P = lp_[l];
  const std::int64_t N = x_in.dim(0), D = cfg_.hidden;
  const float eps = static_cast<float>(cfg_.norm_eps);
  ops::rmsnorm::forward(x_in, P.attn_norm, eps, a.h1, a.rstd1);
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
  ops::linear::forward(a.att.reshaped({N, a.att.numel() / N}), P.wo, {}, a.x_mid);
  add_into(a.x_mid, x_in);
  ops::rmsnorm::forward(a.x_mid, P.mlp_norm, eps, a.h2, a.rstd2);
  const int m = moe_index_of_layer_[l];
  if (m < 0) {
    ops::linear::forward(a.h2, P.w_gate, {}, a.g);
    ops::linear::forward(a.h2, P.w_up, {}, a.u);
    ops::swiglu::forward(a.g, a.u, a.a);
    ops::linear::forward(a.a, P.w_down, {}, x_out);
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
    ops::moe::forward(a.plan, a.h2, a.gates, P.experts, a.saved, x_out);
  }
  (void)D;
  add_into(x_out, a.x_mid);
}

LossParts MoeTransformer::forward(const std::uint32_t* tokens, const std::int32_t* targets) {
  const std::int64_t N = static_cast<std::int64_t>(opt_.micro_batch) * opt_.seq_length;
  tokens_.assign(tokens, tokens + N);
  targets_.assign(targets, targets + N);
  LossParts lp;
  ops::embedding::forward(tokens_.data(), N, embed_, resid_[0]);
  for (int l = 0; l < cfg_.layers; ++l) {
    LayerActs& a = acts_[opt_.recompute == Recompute::kFull ? 0 : l];
    layer_forward(l, a, resid_[l], resid_[l + 1], /*count_load=*/true, lp);
  }
  ops::rmsnorm::forward(resid_[cfg_.layers], final_norm_, static_cast<float>(cfg_.norm_eps), final_h_, final_rstd_);
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

void MoeTransformer::layer_backward(int l, LayerActs& a, const Tensor& x_in, const Tensor& dres) {
  const LayerParams& P = lp_[l];
  LayerParams& G = lg_[l];
  const std::int64_t N = x_in.dim(0);
  const int m = moe_index_of_layer_[l];
  // MLP block: y = x_mid + mlp(n2(x_mid)); dres holds dL/dy.
  if (m < 0) {
    ops::linear::backward(a.a, P.w_down, dres, a.da, G.w_down, {});
    ops::swiglu::backward(a.g, a.u, a.da, a.dg, a.du);
    ops::linear::backward(a.h2, P.w_gate, a.dg, dtmp_, G.w_gate, {});
    ops::linear::backward(a.h2, P.w_up, a.du, dtmp2_, G.w_up, {});
    add_into(dtmp_, dtmp2_);
  } else {
    ops::router::Options ro{cfg_.top_k, opt_.renormalize_gates};
    ops::moe::backward(a.plan, a.h2, a.gates, P.experts, a.saved, dres, a.moe_scratch, dtmp_, a.dgates, G.experts);
    ops::router::backward(a.probs, a.rlse, a.idx, a.gates, a.counts, ro, a.dgates,
                          static_cast<float>(opt_.aux_loss_weight * cur_scale_), static_cast<float>(opt_.z_loss_weight * cur_scale_),
                          a.dlogits);
    ops::linear::backward(a.h2, P.router, a.dlogits, dtmp2_, G.router, {});
    add_into(dtmp_, dtmp2_);
  }
  ops::rmsnorm::backward(a.x_mid, P.mlp_norm, a.rstd2, dtmp_, dtmp2_, G.mlp_norm);
  add_into(dres, dtmp2_);  // dres now dL/dx_mid
  // Attention block: x_mid = x_in + Wo attn(...).
  const Tensor datt2 = a.datt.reshaped({N, a.datt.numel() / N});
  ops::linear::backward(a.att.reshaped({N, a.att.numel() / N}), P.wo, dres, datt2, G.wo, {});
  const float scale = 1.0f / std::sqrt(static_cast<float>(cfg_.head_dim));
  ops::attention::backward(a.q, a.k, a.v, a.att, a.lse, a.datt, scale, a.dq, a.dk, a.dv);
  const Tensor dq3 = a.dq.reshaped({N, cfg_.heads, cfg_.head_dim}), dk3 = a.dk.reshaped({N, cfg_.kv_heads, cfg_.head_dim});
  ops::rope::backward(rope_, dq3, positions_.data(), dq3);
  ops::rope::backward(rope_, dk3, positions_.data(), dk3);
  ops::linear::backward(a.h1, P.wq, a.dq.reshaped({N, a.dq.numel() / N}), dtmp_, G.wq, {});
  ops::linear::backward(a.h1, P.wk, a.dk.reshaped({N, a.dk.numel() / N}), dtmp2_, G.wk, {});
  add_into(dtmp_, dtmp2_);
  ops::linear::backward(a.h1, P.wv, a.dv.reshaped({N, a.dv.numel() / N}), dtmp2_, G.wv, {});
  add_into(dtmp_, dtmp2_);
  ops::rmsnorm::backward(x_in, P.attn_norm, a.rstd1, dtmp_, dtmp2_, G.attn_norm);
  add_into(dres, dtmp2_);  // dres now dL/dx_in
}

void MoeTransformer::backward(float loss_scale) {
  if (!have_forward_) fail("model: backward() without a forward()");
  cur_scale_ = loss_scale;
  const std::int64_t N = static_cast<std::int64_t>(opt_.micro_batch) * opt_.seq_length;
  ops::cross_entropy::Options co;
  co.chunk = std::min<std::int64_t>(opt_.ce_chunk, cfg_.vocab_size);
  ops::cross_entropy::backward(final_h_, lm_head_, targets_.data(), ce_lse_, loss_scale, co, ce_scratch_, dtmp_, d_lm_head_);
  ops::rmsnorm::backward(resid_[cfg_.layers], final_norm_, final_rstd_, dtmp_, dres_, d_final_norm_);
  for (int l = cfg_.layers - 1; l >= 0; --l) {
    LayerActs& a = acts_[opt_.recompute == Recompute::kFull ? 0 : l];
    if (opt_.recompute == Recompute::kFull) {
      LossParts ignored;
      layer_forward(l, a, resid_[l], dtmp_, /*count_load=*/false, ignored);  // output not needed again
    }
    layer_backward(l, a, resid_[l], dres_);
  }
  ops::embedding::backward(tokens_.data(), N, dres_, d_embed_);
  have_forward_ = false;
}

double MoeTransformer::flops_per_micro_batch() const {
  return model_flops_per_micro_batch(cfg_, opt_.micro_batch, opt_.seq_length);
}

}  // namespace keel::train
