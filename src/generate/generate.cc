#include "generate/generate.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "ckpt/reader.h"
#include "common/error.h"
#include "ops/attention.h"
#include "ops/embedding.h"
#include "ops/linear.h"
#include "common/parallel_for.h"
#include "ops/residual_scale.h"
#include "ops/rmsnorm.h"
#include "ops/router.h"
#include "ops/swiglu.h"
#include "train/model.h"
#include "train/train_checkpoint.h"
#include "train/train_config.h"

namespace keel::generate {

// ---------------------------------------------------------------- weights

namespace {

std::string layer_attention_text(const model::ModelConfig& m) {
  std::string s;
  for (const auto k : m.layer_attention) s += fmt::format("{}{}", s.empty() ? "" : ",", model::attention_kind_name(k));
  return s;
}

// Every key of a model YAML that shapes the computation, with its parsed value (doubles in
// their shortest exact form, so equal text means equal value). The name is left out: a renamed
// copy of a model is the same model.
std::vector<std::pair<const char*, std::string>> model_key_values(const model::ModelConfig& m) {
  const auto v = [](const auto& x) { return fmt::format("{}", x); };
  return {{"vocab_size", v(m.vocab_size)},
          {"hidden", v(m.hidden)},
          {"layers", v(m.layers)},
          {"attention", model::attention_kind_name(m.attention)},
          {"heads", v(m.heads)},
          {"kv_heads", v(m.kv_heads)},
          {"head_dim", v(m.head_dim)},
          {"layer_attention", layer_attention_text(m)},
          {"cca_q_dim", v(m.cca_q_dim)},
          {"cca_k_dim", v(m.cca_k_dim)},
          {"cca_v_dim", v(m.cca_v_dim)},
          {"cca_conv_width", v(m.cca_conv_width)},
          {"cca_group_conv_width", v(m.cca_group_conv_width)},
          {"linear_chunk", v(m.linear_chunk)},
          {"qk_norm", v(m.qk_norm)},
          {"ffn_hidden", v(m.ffn_hidden)},
          {"experts", v(m.experts)},
          {"top_k", v(m.top_k)},
          {"expert_hidden", v(m.expert_hidden)},
          {"shared_experts", v(m.shared_experts)},
          {"moe_layer_interval", v(m.moe_layer_interval)},
          {"first_dense_layers", v(m.first_dense_layers)},
          {"router_hidden", v(m.router_hidden)},
          {"router_mlp_layers", v(m.router_mlp_layers)},
          {"router_skip_expert", v(m.router_skip_expert)},
          {"tied_embeddings", v(m.tied_embeddings)},
          {"residual_scaling", v(m.residual_scaling)},
          {"rope_fraction", v(m.rope_fraction)},
          {"rope_base", v(m.rope_base)},
          {"norm_eps", v(m.norm_eps)},
          {"max_seq_len", v(m.max_seq_len)}};
}

// A --model / --config given with a checkpoint that saved its own config must be that model:
// the same parameter count is not enough (another head layout has the same floats and would
// run the checkpoint's weights as a different network).
void require_same_model(const std::string& dir, const model::ModelConfig& saved, const model::ModelConfig& given) {
  const auto a = model_key_values(saved), b = model_key_values(given);
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].second != b[i].second)
      fail("checkpoint {} holds model '{}' ({} layers, hidden {}), not the model '{}' given with it: {} is {} in the "
           "checkpoint, {} given",
           dir, saved.name, saved.layers, saved.hidden, given.name, a[i].first, a[i].second, b[i].second);
}

}  // namespace

ModelWeights load_checkpoint_weights(const std::string& path, const std::optional<ModelWeights>& model) {
  // The model is described by the train config saved beside the tensors, or by the caller for
  // weights without one (imported releases).
  const ckpt::Reader reader(path);
  const nlohmann::json& st = reader.metadata().state;
  ModelWeights w;
  if (st.contains("config") && st["config"].is_string()) {
    const train::TrainConfig tc =
        train::parse_train_config(st["config"].get<std::string>(), fmt::format("checkpoint {} (saved config)", reader.dir()));
    w.config = tc.model;
    w.renormalize_gates = tc.model_options.renormalize_gates;
    if (model) require_same_model(reader.dir(), w.config, model->config);
  } else if (model) {
    w.config = model->config;
    w.renormalize_gates = model->renormalize_gates;
  } else {
    fail("checkpoint {}: no saved train config (imported weights?): name the model with --model MODEL.yaml or "
         "--config TRAIN.yaml",
         reader.dir());
  }
  train::LoadedWeights got = train::load_model_weights(reader.dir(), w.config);
  w.params = std::move(got.state.params);
  w.router_bias = std::move(got.state.router_bias);
  w.source = fmt::format("checkpoint {} ({})", got.dir, got.description);
  return w;
}

ModelWeights fresh_weights(const model::ModelConfig& config, bool renormalize_gates, double init_std,
                           std::uint64_t seed) {
  ModelWeights w;
  w.config = config;
  w.renormalize_gates = renormalize_gates;
  const optim::ParamLayout layout = model::param_layout(config);
  w.params.assign(static_cast<std::size_t>(layout.total_floats), 0.f);
  model::init_parameters(config, layout, init_std, seed, w.params.data());
  w.router_bias = model::initial_router_biases(config);
  w.source = fmt::format("fresh init (seed {})", seed);
  return w;
}

// ---------------------------------------------------------------- model

// Grow-only scratch: buffers keep their capacity across calls, so decode steps do not allocate.
struct InferenceModel::Work {
  enum Slot {
    kR, kH, kXMid, kH1, kAttnOut, kH2, kMlpOut, kQ, kK, kV, kAtt, kLse, kQk0, kCcaSaved, kRLogits, kProbs, kRLse,
    kGates, kXs, kHGate, kHUp, kAct, kYs, kRouterSaved, kEda0, kEda1, kXk, kYk, kGk, kFinal, kFinalH, kC0, kNSlots
  };
  std::vector<float> buf[kNSlots];
  std::vector<std::int32_t> idx, positions;
  std::vector<std::int64_t> counts;
  std::vector<float> scores;
  blocks::zaya::MoeActs zacts;
  Tensor get(Slot s, std::initializer_list<std::int64_t> shape) {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    if (static_cast<std::int64_t>(buf[s].size()) < n) buf[s].resize(static_cast<std::size_t>(n));
    return Tensor(buf[s].data(), shape);
  }
};

namespace {

void add_into(const Tensor& dst, const Tensor& src) {
  const std::int64_t n = dst.numel();
  for (std::int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

inline float dot(const float* a, const float* b, std::int64_t n) {
  float s = 0.f;
  for (std::int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Attention of one new query row per (sequence, head) over positions 0..len-1 of the cache
// (the new token's k/v already appended). q, out [B, Hq, Dh]; caches [B, capacity, Hkv, Dh].
void cached_attention(const Tensor& q, const std::vector<float>& kc, const std::vector<float>& vc, int capacity,
                      std::int64_t len, std::int64_t hq, std::int64_t hkv, std::int64_t dh, const Tensor& out) {
  const std::int64_t B = q.dim(0), group = hq / hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  // Threads only when a task has enough work to pay for starting them (ops/parallel.h).
  const std::int64_t min_tasks = std::max<std::int64_t>(1, 65536 / std::max<std::int64_t>(1, len * dh));
  parallel_for(B * hq, min_tasks, [&](std::int64_t lo, std::int64_t hi) {
    std::vector<float> p(static_cast<std::size_t>(len));
    for (std::int64_t bh = lo; bh < hi; ++bh) {
      const std::int64_t b = bh / hq, h = bh % hq, g = h / group;
      const float* qi = q.data() + (b * hq + h) * dh;
      const float* kb = kc.data() + (b * capacity * hkv + g) * dh;
      const float* vb = vc.data() + (b * capacity * hkv + g) * dh;
      float m = -std::numeric_limits<float>::infinity();
      for (std::int64_t j = 0; j < len; ++j) {
        p[j] = scale * dot(qi, kb + j * hkv * dh, dh);
        m = std::max(m, p[j]);
      }
      float sum = 0.f;
      for (std::int64_t j = 0; j < len; ++j) sum += (p[j] = std::exp(p[j] - m));
      float* oi = out.data() + (b * hq + h) * dh;
      std::fill(oi, oi + dh, 0.f);
      const float inv = 1.f / sum;
      for (std::int64_t j = 0; j < len; ++j) {
        const float w = p[j] * inv;
        const float* vj = vb + j * hkv * dh;
        for (std::int64_t c = 0; c < dh; ++c) oi[c] += w * vj[c];
      }
    }
  });
}

// Row t of sequence b of a [B*T, width] buffer into row `pos` of cache [B, capacity, width].
void put_row(std::vector<float>& cache, int capacity, std::int64_t b, std::int64_t pos, const float* src,
             std::int64_t width) {
  std::memcpy(cache.data() + (b * capacity + pos) * width, src, sizeof(float) * static_cast<std::size_t>(width));
}

}  // namespace

std::int64_t Cache::bytes_per_sequence() const {
  std::int64_t floats = 0;
  for (const auto& l : layers) {
    if (batch > 0 && capacity > 0) floats += static_cast<std::int64_t>(l.k.size() + l.v.size()) / (batch * capacity) * length;
    if (batch > 0) floats += static_cast<std::int64_t>(l.conv0_in.size() + l.conv1_in.size() + l.prev_v.size()) / batch;
  }
  return floats * static_cast<std::int64_t>(sizeof(float));
}

InferenceModel::InferenceModel(ModelWeights weights) : w_(std::move(weights)), work_(std::make_unique<Work>()) {
  const model::ModelConfig& cfg = w_.config;
  train::ModelOptions mo;
  mo.micro_batch = 1;
  mo.seq_length = 1;
  train::validate_trainable(cfg, mo);
  layout_ = model::param_layout(cfg);
  if (static_cast<std::int64_t>(w_.params.size()) != layout_.total_floats)
    fail("generate: model '{}' needs {} parameter floats, got {}", cfg.name, layout_.total_floats, w_.params.size());
  const int classes = cfg.experts + (cfg.router_skip_expert ? 1 : 0);
  int moe = 0;
  for (int l = 0; l < cfg.layers; ++l) {
    cca_.push_back(model::layer_attention_kind(cfg, l) == model::AttentionKind::kCca ? 1 : 0);
    moe_index_.push_back(model::is_moe_layer(cfg, l) ? moe++ : -1);
  }
  if (static_cast<int>(w_.router_bias.size()) != moe)
    fail("generate: model '{}' has {} MoE layers, got {} router bias vectors", cfg.name, moe, w_.router_bias.size());
  for (const auto& b : w_.router_bias)
    if (static_cast<int>(b.size()) != classes)
      fail("generate: router bias of {} classes, the model routes over {}", b.size(), classes);

  blocks::WeightViews views = blocks::map_weights(cfg, layout_, w_.params.data());
  lp_ = std::move(views.layers);
  embed_ = views.embed, final_norm_ = views.final_norm, lm_head_ = views.lm_head, final_scale_ = views.final_scale;

  cca_cfg_ = blocks::cca_config(cfg);
  zshape_.hidden = cfg.hidden;
  zshape_.router_hidden = cfg.router_hidden;
  zshape_.expert_hidden = cfg.expert_hidden;
  zshape_.experts = cfg.experts;
  zshape_.skip = cfg.router_skip_expert;
}

InferenceModel::~InferenceModel() = default;

Cache InferenceModel::make_cache(int batch, int capacity) const {
  const model::ModelConfig& cfg = w_.config;
  if (batch < 1 || capacity < 1) throw UsageError(fmt::format("generate: batch ({}) and positions ({}) must be >= 1", batch, capacity));
  if (cfg.max_seq_len > 0 && capacity > cfg.max_seq_len)
    throw UsageError(fmt::format("generate: prompt + new tokens = {} positions exceeds model '{}' max_seq_len {}", capacity,
                                 cfg.name, cfg.max_seq_len));
  Cache c;
  c.batch = batch;
  c.capacity = capacity;
  const std::int64_t kv = std::int64_t(cfg.kv_heads) * cfg.head_dim, C = cca_cfg_.qk_channels();
  for (int l = 0; l < cfg.layers; ++l) {
    LayerCache lc;
    lc.k.assign(static_cast<std::size_t>(std::int64_t(batch) * capacity * kv), 0.f);
    lc.v.assign(lc.k.size(), 0.f);
    if (cca_[l]) {
      const LayerParams& L = lp_[l];
      lc.conv0_in.assign(static_cast<std::size_t>(std::int64_t(batch) * (cfg.cca_conv_width - 1) * C), 0.f);
      // Before the sequence the grouped conv reads depthwise outputs of all-zero input: the bias.
      lc.conv1_in.resize(static_cast<std::size_t>(std::int64_t(batch) * (cfg.cca_group_conv_width - 1) * C));
      for (std::size_t i = 0; i < lc.conv1_in.size(); ++i) lc.conv1_in[i] = L.cca.conv0_b[static_cast<std::int64_t>(i % C)];
      lc.prev_v.assign(static_cast<std::size_t>(std::int64_t(batch) * kv / 2), 0.f);
    }
    c.layers.push_back(std::move(lc));
  }
  return c;
}

void InferenceModel::embed(const std::uint32_t* ids, std::int64_t n, const Tensor& out) {
  ops::embedding::forward(ids, n, embed_, out);
}

// Residual-scaled models: the input of layer l's attention stage (x_mid) from the streams.
void InferenceModel::attn_stage_input(int l, std::int64_t, const Tensor& r, const Tensor& h, const Tensor& x_mid) {
  const blocks::ResScale& A = lp_[l].attn_scale;
  if (l == 0)
    ops::residual_scale::forward(r, A.h_bias, A.h_scale, x_mid);
  else
    ops::residual_scale::merge_forward(r, h, A.r_bias, A.r_scale, A.h_bias, A.h_scale, x_mid);
}

// After the attention: plain layers r_out = x_mid + attn_out + mlp(n2(.)); residual-scaled
// layers r_out = merge(x_mid, attn_out), h_out = mlp(n2(r_out)).
void InferenceModel::mlp_stage(int l, std::int64_t n, const Tensor& x_mid, const Tensor& attn_out, const Tensor& r_out,
                               const Tensor& h_out) {
  const LayerParams& P = lp_[l];
  const std::int64_t D = w_.config.hidden;
  const float eps = static_cast<float>(w_.config.norm_eps);
  const Tensor h2 = work_->get(Work::kH2, {n, D});
  if (w_.config.residual_scaling) {
    const blocks::ResScale& M = P.mlp_scale;
    ops::residual_scale::merge_forward(x_mid, attn_out, M.r_bias, M.r_scale, M.h_bias, M.h_scale, r_out);
    ops::rmsnorm::forward(r_out, P.mlp_norm, eps, h2, Tensor());
    mlp(l, n, h2, h_out);
  } else {
    // x_mid already holds x + attn (prefill / decode add it); r_out = x_mid + mlp(n2(x_mid)).
    ops::rmsnorm::forward(x_mid, P.mlp_norm, eps, h2, Tensor());
    mlp(l, n, h2, r_out);
    add_into(r_out, x_mid);
  }
}

void InferenceModel::mlp(int l, std::int64_t n, const Tensor& x, const Tensor& y) {
  const LayerParams& P = lp_[l];
  const model::ModelConfig& cfg = w_.config;
  const std::int64_t D = cfg.hidden;
  Work& w = *work_;
  const int m = moe_index_[l];
  if (m < 0) {
    const std::int64_t F = cfg.ffn_hidden;
    const Tensor g = w.get(Work::kHGate, {n, F}), u = w.get(Work::kHUp, {n, F}), a = w.get(Work::kAct, {n, F});
    ops::linear::forward(x, P.w_gate, {}, g);
    ops::linear::forward(x, P.w_up, {}, u);
    ops::swiglu::forward(g, u, a);
    ops::linear::forward(a, P.w_down, {}, y);
    return;
  }
  const std::int64_t F = cfg.expert_hidden;
  if (cfg.router_hidden > 0) {
    // ZAYA1: the EDA state of stage m is read by stage m + 1 of the same tokens; two buffers
    // alternate (the state lives only within one forward).
    const std::int64_t R = cfg.router_hidden;
    const int classes = zshape_.classes();
    zshape_.tokens = n;
    const Tensor rbuf = w.get(Work::kRouterSaved, {ops::zaya_router::saved_floats(n, R, classes)});
    blocks::zaya::MoeActs& a = w.zacts;
    a.router = ops::zaya_router::carve_saved(rbuf.data(), n, R, classes);
    a.router.state = w.get(m % 2 ? Work::kEda1 : Work::kEda0, {n, R});
    const Tensor prev = m > 0 ? Tensor(w.buf[m % 2 ? Work::kEda0 : Work::kEda1].data(), {n, R}) : Tensor();
    a.experts = {w.get(Work::kXs, {n, D}), w.get(Work::kHGate, {n, F}), w.get(Work::kHUp, {n, F}),
                 w.get(Work::kAct, {n, F}), w.get(Work::kYs, {n, D})};
    blocks::zaya::MoeScratch sc;
    sc.xk = w.get(Work::kXk, {n, D});
    sc.yk = w.get(Work::kYk, {n, D});
    sc.gk = w.get(Work::kGk, {n, 1});
    const Tensor bias(w_.router_bias[m].data(), {classes});
    blocks::zaya::moe_forward(zshape_, {P.zrouter, P.experts}, x, prev, bias, static_cast<float>(cfg.norm_eps), a, sc, y);
    return;
  }
  const int E = cfg.experts, K = cfg.top_k;
  const std::int64_t S = n * K;
  const Tensor logits = w.get(Work::kRLogits, {n, E}), probs = w.get(Work::kProbs, {n, E}),
               lse = w.get(Work::kRLse, {n}), gates = w.get(Work::kGates, {n, K});
  w.idx.resize(static_cast<std::size_t>(S));
  w.counts.resize(static_cast<std::size_t>(E));
  ops::linear::forward(x, P.router, {}, logits);
  const Tensor bias(w_.router_bias[m].data(), {E});
  ops::router::forward(logits, bias, {K, w_.renormalize_gates}, probs, lse, w.idx.data(), gates, w.counts.data());
  const ops::moe::Plan plan = ops::moe::make_plan(w.idx.data(), n, K, E);
  const ops::moe::Saved saved{w.get(Work::kXs, {S, D}), w.get(Work::kHGate, {S, F}), w.get(Work::kHUp, {S, F}),
                              w.get(Work::kAct, {S, F}), w.get(Work::kYs, {S, D})};
  ops::moe::forward(plan, x, gates, P.experts, saved, y);
}

// Final merge (residual scaling), norm and LM head on n rows of the streams.
void InferenceModel::head(std::int64_t n, const Tensor& r, const Tensor& h, float* logits) {
  const model::ModelConfig& cfg = w_.config;
  const std::int64_t D = cfg.hidden, V = cfg.vocab_size;
  Tensor in = r;
  if (cfg.residual_scaling) {
    in = work_->get(Work::kFinal, {n, D});
    const blocks::ResScale& F = final_scale_;
    ops::residual_scale::merge_forward(r, h, F.r_bias, F.r_scale, F.h_bias, F.h_scale, in);
  }
  const Tensor fh = work_->get(Work::kFinalH, {n, D});
  ops::rmsnorm::forward(in, final_norm_, static_cast<float>(cfg.norm_eps), fh, Tensor());
  ops::linear::forward(fh, lm_head_, {}, Tensor(logits, {n, V}));
}

void InferenceModel::prefill(const std::uint32_t* tokens, int T, Cache& cache, std::vector<float>& logits,
                             bool all_positions) {
  const model::ModelConfig& cfg = w_.config;
  if (cache.length != 0) fail("generate: prefill needs an empty cache (it holds {} positions)", cache.length);
  if (T < 1 || T > cache.capacity) fail("generate: prefill of {} tokens into a cache of {} positions", T, cache.capacity);
  const std::int64_t B = cache.batch, N = B * T, D = cfg.hidden, V = cfg.vocab_size;
  const std::int64_t Hq = cfg.heads, Hkv = cfg.kv_heads, Dh = cfg.head_dim, Q = Hq * Dh, KV = Hkv * Dh;
  const float eps = static_cast<float>(cfg.norm_eps);
  if (rope_.max_positions < cache.capacity)
    rope_ = ops::rope::make_table(cfg.head_dim, cfg.rope_fraction, cfg.rope_base, std::max(cache.capacity, cfg.max_seq_len));
  Work& w = *work_;
  w.positions.resize(static_cast<std::size_t>(N));
  for (std::int64_t i = 0; i < N; ++i) w.positions[i] = static_cast<std::int32_t>(i % T);
  const bool scaled = cfg.residual_scaling;
  // Streams: r (the residual; plain layers: x), h (residual scaling: the mixer output).
  Tensor r = w.get(Work::kR, {N, D}), h = scaled ? w.get(Work::kH, {N, D}) : Tensor();
  embed(tokens, N, r);
  for (int l = 0; l < cfg.layers; ++l) {
    const LayerParams& P = lp_[l];
    LayerCache& lc = cache.layers[l];
    const Tensor x_mid = w.get(Work::kXMid, {N, D}), h1 = w.get(Work::kH1, {N, D}), att_out = w.get(Work::kAttnOut, {N, D});
    if (scaled)
      attn_stage_input(l, N, r, h, x_mid);
    else
      std::memcpy(x_mid.data(), r.data(), sizeof(float) * static_cast<std::size_t>(N * D));
    ops::rmsnorm::forward(x_mid, P.attn_norm, eps, h1, Tensor());
    if (cca_[l]) {
      const ops::cca::Saved s =
          ops::cca::carve_saved(cca_cfg_, B, T, w.get(Work::kCcaSaved, {ops::cca::saved_floats(cca_cfg_, B, T)}).data());
      ops::cca::forward(cca_cfg_, B, T, h1, w.positions.data(), rope_, P.cca, s, att_out);
      // Cache: attention operands k and v, and the conv / value-shift states at the end.
      const std::int64_t C = cca_cfg_.qk_channels(), W0 = cfg.cca_conv_width, W1 = cfg.cca_group_conv_width;
      const std::int64_t half = KV / 2;
      for (std::int64_t b = 0; b < B; ++b) {
        for (std::int64_t t = 0; t < T; ++t) {
          put_row(lc.k, cache.capacity, b, t, s.k.row(b * T + t), KV);
          put_row(lc.v, cache.capacity, b, t, s.v.row(b * T + t), KV);
        }
        for (std::int64_t j = 0; j < W0 - 1; ++j) {
          const std::int64_t t = T - (W0 - 1) + j;
          float* dst = lc.conv0_in.data() + (b * (W0 - 1) + j) * C;
          if (t >= 0)
            std::memcpy(dst, s.qk0.row(b * T + t), sizeof(float) * static_cast<std::size_t>(C));
          else
            std::fill(dst, dst + C, 0.f);
        }
        // c0 rows are times -(W1-1) .. T-1; the last W1-1 of them are the grouped conv's state.
        for (std::int64_t j = 0; j < W1 - 1; ++j)
          std::memcpy(lc.conv1_in.data() + (b * (W1 - 1) + j) * C, s.c0.data() + (b * (T + W1 - 1) + T + j) * C,
                      sizeof(float) * static_cast<std::size_t>(C));
        // The last token's x W_v2^T (the forward's value shift dropped it): the next token's
        // previous-token values.
        const float* x_last = h1.row(b * T + T - 1);
        for (std::int64_t i = 0; i < half; ++i)
          lc.prev_v[b * half + i] = dot(x_last, P.cca.w_v.row(half + i), D);
      }
    } else {
      const Tensor q = w.get(Work::kQ, {N, Q}), k = w.get(Work::kK, {N, KV}), v = w.get(Work::kV, {N, KV});
      ops::linear::forward(h1, P.wq, {}, q);
      ops::linear::forward(h1, P.wk, {}, k);
      ops::linear::forward(h1, P.wv, {}, v);
      ops::rope::forward(rope_, q.reshaped({N, Hq, Dh}), w.positions.data(), q.reshaped({N, Hq, Dh}));
      ops::rope::forward(rope_, k.reshaped({N, Hkv, Dh}), w.positions.data(), k.reshaped({N, Hkv, Dh}));
      const Tensor att = w.get(Work::kAtt, {B, T, Hq, Dh}), lse = w.get(Work::kLse, {B, Hq, T});
      ops::attention::forward(q.reshaped({B, T, Hq, Dh}), k.reshaped({B, T, Hkv, Dh}), v.reshaped({B, T, Hkv, Dh}),
                              1.0f / std::sqrt(static_cast<float>(Dh)), att, lse);
      ops::linear::forward(att.reshaped({N, Q}), P.wo, {}, att_out);
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t t = 0; t < T; ++t) {
          put_row(lc.k, cache.capacity, b, t, k.row(b * T + t), KV);
          put_row(lc.v, cache.capacity, b, t, v.row(b * T + t), KV);
        }
    }
    if (!scaled) add_into(x_mid, att_out);
    mlp_stage(l, N, x_mid, att_out, r, h);
  }
  cache.length = T;
  if (all_positions) {
    logits.resize(static_cast<std::size_t>(N * V));
    head(N, r, h, logits.data());
    return;
  }
  // Only the last position of each sequence feeds the next token: gather those rows.
  const Tensor rl = w.get(Work::kXMid, {B, D}), hl = scaled ? w.get(Work::kH1, {B, D}) : Tensor();
  for (std::int64_t b = 0; b < B; ++b) {
    std::memcpy(rl.row(b), r.row(b * T + T - 1), sizeof(float) * static_cast<std::size_t>(D));
    if (scaled) std::memcpy(hl.row(b), h.row(b * T + T - 1), sizeof(float) * static_cast<std::size_t>(D));
  }
  logits.resize(static_cast<std::size_t>(B * V));
  head(B, rl, hl, logits.data());
}

// mha/gqa attention of the B new tokens (x [B, D], the normed input) at position cache.length.
void InferenceModel::attn_decode(int l, Cache& cache, const Tensor& x, const Tensor& y) {
  const model::ModelConfig& cfg = w_.config;
  const LayerParams& P = lp_[l];
  LayerCache& lc = cache.layers[l];
  Work& w = *work_;
  const std::int64_t B = cache.batch, Hq = cfg.heads, Hkv = cfg.kv_heads, Dh = cfg.head_dim, Q = Hq * Dh, KV = Hkv * Dh;
  const std::int64_t pos = cache.length;
  const Tensor q = w.get(Work::kQ, {B, Q}), k = w.get(Work::kK, {B, KV}), v = w.get(Work::kV, {B, KV});
  ops::linear::forward(x, P.wq, {}, q);
  ops::linear::forward(x, P.wk, {}, k);
  ops::linear::forward(x, P.wv, {}, v);
  ops::rope::forward(rope_, q.reshaped({B, Hq, Dh}), w.positions.data(), q.reshaped({B, Hq, Dh}));
  ops::rope::forward(rope_, k.reshaped({B, Hkv, Dh}), w.positions.data(), k.reshaped({B, Hkv, Dh}));
  for (std::int64_t b = 0; b < B; ++b) {
    put_row(lc.k, cache.capacity, b, pos, k.row(b), KV);
    put_row(lc.v, cache.capacity, b, pos, v.row(b), KV);
  }
  const Tensor att = w.get(Work::kAtt, {B, Hq, Dh});
  cached_attention(q.reshaped({B, Hq, Dh}), lc.k, lc.v, cache.capacity, pos + 1, Hq, Hkv, Dh, att);
  ops::linear::forward(att.reshaped({B, Q}), P.wo, {}, y);
}

// CCA of the B new tokens at position cache.length, from the conv states and the cache
// (ops/cca.h has the equations; this is its forward restricted to the last token).
void InferenceModel::cca_decode(int l, Cache& cache, const Tensor& x, const Tensor& y) {
  const model::ModelConfig& cfg = w_.config;
  const ops::cca::Params& p = lp_[l].cca;
  LayerCache& lc = cache.layers[l];
  Work& w = *work_;
  const std::int64_t B = cache.batch, d = cfg.head_dim, nq = cfg.heads, nkv = cfg.kv_heads, G = nq / nkv;
  const std::int64_t C = cca_cfg_.qk_channels(), dq = nq * d, dk = nkv * d, half = dk / 2;
  const std::int64_t W0 = cfg.cca_conv_width, W1 = cfg.cca_group_conv_width, pos = cache.length;
  const Tensor qk0 = w.get(Work::kQk0, {B, C}), c0 = w.get(Work::kC0, {B, C}), a = w.get(Work::kAtt, {B, C});
  const Tensor q = w.get(Work::kQ, {B, dq}), k = w.get(Work::kK, {B, dk}), u = w.get(Work::kV, {B, dk});
  ops::linear::forward(x, p.w_qk, Tensor(), qk0);
  const float sqrt_d = static_cast<float>(std::sqrt(double(d)));
  const float* w0 = p.conv0_w.data();
  const float* w1 = p.conv1_w.data();
  parallel_for(B, 4, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t b = lo; b < hi; ++b) {
      float* st0 = lc.conv0_in.data() + b * (W0 - 1) * C;  // [W0-1, C] oldest first
      float* st1 = lc.conv1_in.data() + b * (W1 - 1) * C;  // [W1-1, C]
      const float* x0 = qk0.row(b);
      float* cr = c0.row(b);
      // Depthwise: tap W0-1 multiplies the current token, tap k < W0-1 state row k.
      for (std::int64_t c = 0; c < C; ++c) {
        float acc = p.conv0_b[c];
        for (std::int64_t kk = 0; kk < W0 - 1; ++kk) acc += w0[c * W0 + kk] * st0[kk * C + c];
        acc += w0[c * W0 + W0 - 1] * x0[c];
        cr[c] = acc;
      }
      // Grouped: output channel o of group g = o / d reads the group's d channels at each tap.
      float* ar = a.row(b);
      for (std::int64_t o = 0; o < C; ++o) {
        const std::int64_t g0 = (o / d) * d;
        float acc = p.conv1_b[o];
        for (std::int64_t kk = 0; kk < W1; ++kk) {
          const float* src = kk < W1 - 1 ? st1 + kk * C + g0 : cr + g0;
          const float* wr = w1 + o * d * W1;
          for (std::int64_t i = 0; i < d; ++i) acc += wr[i * W1 + kk] * src[i];
        }
        ar[o] = acc;
      }
      // Slide the states by one token.
      if (W0 > 1) {
        std::memmove(st0, st0 + C, sizeof(float) * static_cast<std::size_t>((W0 - 2) * C));
        std::memcpy(st0 + (W0 - 2) * C, x0, sizeof(float) * static_cast<std::size_t>(C));
      }
      if (W1 > 1) {
        std::memmove(st1, st1 + C, sizeof(float) * static_cast<std::size_t>((W1 - 2) * C));
        std::memcpy(st1 + (W1 - 2) * C, cr, sizeof(float) * static_cast<std::size_t>(C));
      }
      // Mixing terms (pre-conv skips), then L2 normalization, sqrt(d) and the k temperature.
      for (std::int64_t g = 0; g < nkv; ++g) {
        const float* k0 = x0 + dq + g * d;
        float* ak = ar + dq + g * d;
        for (std::int64_t i = 0; i < d; ++i) {
          double mean_q = 0;
          for (std::int64_t j = 0; j < G; ++j) mean_q += x0[(g * G + j) * d + i];
          mean_q /= double(G);
          for (std::int64_t j = 0; j < G; ++j) ar[(g * G + j) * d + i] += 0.5f * (x0[(g * G + j) * d + i] + k0[i]);
          ak[i] += static_cast<float>(0.5 * mean_q + 0.5 * k0[i]);
        }
      }
      for (std::int64_t hh = 0; hh < nq + nkv; ++hh) {
        const float* ah = ar + hh * d;
        double ss = 0;
        for (std::int64_t i = 0; i < d; ++i) ss += double(ah[i]) * ah[i];
        const float rn = static_cast<float>(1.0 / std::sqrt(ss + double(cca_cfg_.l2_eps)));
        float* out = hh < nq ? q.row(b) + hh * d : k.row(b) + (hh - nq) * d;
        const float scale = hh < nq ? sqrt_d * rn : p.temp[hh - nq] * sqrt_d * rn;
        for (std::int64_t i = 0; i < d; ++i) out[i] = ah[i] * scale;
      }
    }
  });
  ops::rope::forward(rope_, q.reshaped({B, nq, d}), w.positions.data(), q.reshaped({B, nq, d}));
  ops::rope::forward(rope_, k.reshaped({B, nkv, d}), w.positions.data(), k.reshaped({B, nkv, d}));
  // Values: [x_t W_v1^T | x_{t-1} W_v2^T]; this token's second half waits for the next one.
  ops::linear::forward(x, p.w_v, Tensor(), u);
  for (std::int64_t b = 0; b < B; ++b) {
    float* ur = u.row(b);
    float* pv = lc.prev_v.data() + b * half;
    for (std::int64_t i = 0; i < half; ++i) std::swap(ur[half + i], pv[i]);
    put_row(lc.k, cache.capacity, b, pos, k.row(b), dk);
    put_row(lc.v, cache.capacity, b, pos, ur, dk);
  }
  const Tensor att = w.get(Work::kAttnOut, {B, nq, d});
  cached_attention(q.reshaped({B, nq, d}), lc.k, lc.v, cache.capacity, pos + 1, nq, nkv, d, att);
  ops::linear::forward(att.reshaped({B, dq}), p.w_o, Tensor(), y);
}

void InferenceModel::decode(const std::uint32_t* tokens, Cache& cache, std::vector<float>& logits) {
  const model::ModelConfig& cfg = w_.config;
  if (cache.length >= cache.capacity) fail("generate: the cache is full ({} positions)", cache.capacity);
  const std::int64_t B = cache.batch, D = cfg.hidden, V = cfg.vocab_size;
  const float eps = static_cast<float>(cfg.norm_eps);
  if (rope_.max_positions < cache.capacity)
    rope_ = ops::rope::make_table(cfg.head_dim, cfg.rope_fraction, cfg.rope_base, std::max(cache.capacity, cfg.max_seq_len));
  Work& w = *work_;
  w.positions.assign(static_cast<std::size_t>(B), cache.length);
  const bool scaled = cfg.residual_scaling;
  // The attention helpers use the projection slots (kQ, kK, kV, kAtt, kQk0, kC0, kAttnOut) as
  // scratch; the attention output goes to kMlpOut, which nothing else uses while decoding.
  Tensor r = w.get(Work::kR, {B, D}), h = scaled ? w.get(Work::kH, {B, D}) : Tensor();
  embed(tokens, B, r);
  for (int l = 0; l < cfg.layers; ++l) {
    const LayerParams& P = lp_[l];
    const Tensor x_mid = w.get(Work::kXMid, {B, D}), h1 = w.get(Work::kH1, {B, D}), att_out = w.get(Work::kMlpOut, {B, D});
    if (scaled)
      attn_stage_input(l, B, r, h, x_mid);
    else
      std::memcpy(x_mid.data(), r.data(), sizeof(float) * static_cast<std::size_t>(B * D));
    ops::rmsnorm::forward(x_mid, P.attn_norm, eps, h1, Tensor());
    if (cca_[l])
      cca_decode(l, cache, h1, att_out);
    else
      attn_decode(l, cache, h1, att_out);
    if (!scaled) add_into(x_mid, att_out);
    mlp_stage(l, B, x_mid, att_out, r, h);
  }
  cache.length += 1;
  logits.resize(static_cast<std::size_t>(B * V));
  head(B, r, h, logits.data());
}

// ---------------------------------------------------------------- sampling

namespace {
std::uint64_t splitmix(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
}  // namespace

namespace {
bool all_finite(const float* z, std::int64_t n) {
  for (std::int64_t v = 0; v < n; ++v)
    if (!std::isfinite(z[v])) return false;
  return true;
}
}  // namespace

Sampler::Sampler(const SamplingOptions& options, std::uint64_t sequence) : o_(options) {
  // NaN compares false both ways: a NaN temperature would pass `< 0` and make every weight NaN.
  if (!std::isfinite(options.temperature) || options.temperature < 0)
    throw UsageError(fmt::format("generate: --temperature must be a finite number >= 0, got {}", options.temperature));
  if (options.top_k < 0) throw UsageError(fmt::format("generate: --top-k must be >= 0, got {}", options.top_k));
  std::uint64_t s = options.seed;
  state_ = splitmix(s) ^ (sequence * 0xD1B54A32D192ED03ull);
}

double Sampler::uniform() { return static_cast<double>(splitmix(state_) >> 11) * (1.0 / 9007199254740992.0); }

std::uint32_t Sampler::next(const float* logits, std::int64_t allowed_vocab) {
  if (allowed_vocab < 1) fail("sampler: no eligible token ids");
  if (!all_finite(logits, allowed_vocab)) return kNonFiniteLogits;
  if (o_.temperature <= 0.0) {
    std::int64_t best = 0;
    for (std::int64_t v = 1; v < allowed_vocab; ++v)
      if (logits[v] > logits[best]) best = v;  // ties: the lower id
    return static_cast<std::uint32_t>(best);
  }
  cand_.resize(static_cast<std::size_t>(allowed_vocab));
  for (std::int64_t v = 0; v < allowed_vocab; ++v) cand_[v] = {logits[v], static_cast<std::uint32_t>(v)};
  const auto by_logit = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  std::size_t keep = cand_.size();
  if (o_.top_k > 0 && static_cast<std::size_t>(o_.top_k) < keep) {
    keep = static_cast<std::size_t>(o_.top_k);
    std::partial_sort(cand_.begin(), cand_.begin() + static_cast<std::ptrdiff_t>(keep), cand_.end(), by_logit);
  } else {
    std::sort(cand_.begin(), cand_.end(), by_logit);
  }
  const double top = cand_[0].first;
  double total = 0;
  std::vector<double> p(keep);
  for (std::size_t i = 0; i < keep; ++i) total += (p[i] = std::exp((cand_[i].first - top) / o_.temperature));
  double u = uniform() * total;
  for (std::size_t i = 0; i < keep; ++i) {
    u -= p[i];
    if (u < 0) return cand_[i].second;
  }
  return cand_[keep - 1].second;
}

// ---------------------------------------------------------------- the loop

void Decoder::host_argmax(std::int64_t allowed, std::uint32_t* next) const {
  const std::int64_t V = config().vocab_size;
  const std::int64_t n = std::min(allowed, V);
  if (n < 1) fail("generate: no eligible token ids");
  for (int b = 0; b < batch(); ++b) {
    const float* z = greedy_logits_.data() + static_cast<std::int64_t>(b) * V;
    if (!all_finite(z, n)) {
      next[b] = kNonFiniteLogits;
      continue;
    }
    std::int64_t best = 0;
    for (std::int64_t v = 1; v < n; ++v)
      if (z[v] > z[best]) best = v;  // ties: the lower id
    next[b] = static_cast<std::uint32_t>(best);
  }
}

void Decoder::prefill_greedy(const std::uint32_t* tokens, int T, std::int64_t allowed, std::uint32_t* next) {
  prefill(tokens, T, greedy_logits_, /*all_positions=*/false);
  host_argmax(allowed, next);
}

void Decoder::decode_greedy(const std::uint32_t* tokens, std::int64_t allowed, std::uint32_t* next) {
  decode(tokens, greedy_logits_);
  host_argmax(allowed, next);
}

GenerateResult generate(InferenceModel& model, const std::vector<std::uint32_t>& prompt, const GenerateOptions& o) {
  CpuDecoder d(model);
  return generate(d, prompt, o);
}

GenerateResult generate(Decoder& model, const std::vector<std::uint32_t>& prompt, const GenerateOptions& o) {
  if (prompt.empty()) throw UsageError("generate: the prompt has no tokens");
  if (o.max_new_tokens < 1) throw UsageError(fmt::format("generate: --max-new-tokens must be >= 1, got {}", o.max_new_tokens));
  const std::int64_t V = model.config().vocab_size, allowed = o.allowed_vocab > 0 ? std::min(o.allowed_vocab, V) : V;
  const int B = o.batch, T = static_cast<int>(prompt.size());
  // In int64: T + max_new_tokens overflows an int for a huge --max-new-tokens.
  const std::int64_t positions = static_cast<std::int64_t>(prompt.size()) + o.max_new_tokens - 1;
  if (positions > std::numeric_limits<int>::max())
    throw UsageError(fmt::format("generate: prompt + new tokens = {} positions, more than a cache holds ({})", positions,
                                 std::numeric_limits<int>::max()));
  model.start(B, static_cast<int>(positions));
  std::vector<std::uint32_t> tokens;
  for (int b = 0; b < B; ++b) tokens.insert(tokens.end(), prompt.begin(), prompt.end());
  std::vector<Sampler> samplers;
  for (int b = 0; b < B; ++b) samplers.emplace_back(o.sampling, static_cast<std::uint64_t>(b));
  GenerateResult res;
  res.generated.assign(B, {});
  std::vector<float> logits;
  // Greedy: the decoder picks (on the device for the GPU decoder: no logits leave it).
  const bool greedy = o.sampling.temperature <= 0.0;
  std::vector<std::uint32_t> cur(B);
  using clock = std::chrono::steady_clock;
  auto t0 = clock::now();
  if (greedy)
    model.prefill_greedy(tokens.data(), T, allowed, cur.data());
  else
    model.prefill(tokens.data(), T, logits, /*all_positions=*/false);
  res.prefill_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  std::vector<char> done(B, 0);
  // step: which generated token this is (0: the prefill's).
  auto pick = [&](int step) {
    int live = 0;
    for (int b = 0; b < B; ++b) {
      if (!greedy) cur[b] = samplers[b].next(logits.data() + static_cast<std::int64_t>(b) * V, allowed);
      if (cur[b] == kNonFiniteLogits)
        fail("generate: logits are not finite at step {}: the model's weights are damaged or diverged", step);
      if (!done[b]) {
        res.generated[b].push_back(cur[b]);
        if (o.eos && cur[b] == *o.eos) done[b] = 1;
      }
      live += done[b] ? 0 : 1;
    }
    return live;
  };
  int live = pick(0);
  for (int step = 1; step < o.max_new_tokens && live > 0; ++step) {
    t0 = clock::now();
    if (greedy)
      model.decode_greedy(cur.data(), allowed, cur.data());
    else
      model.decode(cur.data(), logits);
    res.step_seconds.push_back(std::chrono::duration<double>(clock::now() - t0).count());
    live = pick(step);
  }
  res.cache_bytes_per_sequence = model.cache_bytes_per_sequence();
  return res;
}

}  // namespace keel::generate
