#include "generate/generate.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "blocks/attention.h"
#include "blocks/mlp.h"
#include "blocks/runners.h"
#include "ckpt/reader.h"
#include "common/error.h"
#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/residual_scale.h"
#include "ops/rmsnorm.h"
#include "tensor/arena.h"
#include "train/model.h"
#include "train/train_checkpoint.h"
#include "train/train_config.h"

namespace keel::generate {

// ---------------------------------------------------------------- weights

namespace {

// A --model / --config given with a checkpoint that saved its own config must be that model:
// the same parameter count is not enough (another head layout has the same floats and would
// run the checkpoint's weights as a different network).
void require_same_model(const std::string& dir, const model::ModelConfig& saved, const model::ModelConfig& given) {
  const auto a = model::model_key_values(saved), b = model::model_key_values(given);
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

// The activations of one call over N = B x T tokens, carved from one grow-only Arena for the
// (B, T, head rows) of the call: re-carved when that shape changes, reallocated only when it
// needs more, so decode steps do not allocate.
struct InferenceModel::Work {
  std::unique_ptr<Arena> arena;
  std::int64_t planned[3] = {-1, -1, -1};  // B, T, head rows
  std::vector<std::int32_t> positions;     // [N]
  blocks::AttnShape attn;                  // (B, T)
  blocks::MlpShape mlp;                    // N tokens
  // Streams: r (the residual; plain layers: x), h (residual scaling: the mixer output).
  Tensor r, h, x_mid, h1, attn_out, h2;    // [N, D]
  blocks::AttnSaved attn_saved;            // prefill: the block's saved set; decode (T = 1): its scratch
  blocks::MlpSaved mlp_saved;
  blocks::MlpScratch mlp_scratch;
  Tensor eda[2];                           // ZAYA1: the EDA states of consecutive MoE stages [N, R]
  Tensor final_in, final_h;                // [head rows, D]
  Tensor rl, hl;                           // [B, D] each sequence's last position (prefill)
};

std::int64_t Cache::bytes_per_sequence() const {
  std::int64_t floats = 0;
  for (const auto& l : layers) {
    if (batch > 0 && capacity > 0) floats += static_cast<std::int64_t>(l.k.size() + l.v.size()) / (batch * capacity) * length;
    if (batch > 0)
      floats += static_cast<std::int64_t>(l.conv0_in.size() + l.conv1_in.size() + l.prev_v.size() + l.state.size()) / batch;
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
    kind_.push_back(model::layer_attention_kind(cfg, l));
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
  const blocks::AttnShape s = blocks::AttnShape::of(cfg, batch, 1);
  for (int l = 0; l < cfg.layers; ++l) c.layers.push_back(blocks::make_layer_cache(s, kind_[l], lp_[l], capacity));
  return c;
}

void InferenceModel::plan(ArenaPlanner& p, std::int64_t B, std::int64_t T, std::int64_t head_rows) {
  const model::ModelConfig& cfg = w_.config;
  const std::int64_t N = B * T, D = cfg.hidden, R = std::max(cfg.router_hidden, 1);
  Work& w = *work_;
  bool any_moe = false, any_dense = false;
  blocks::AttnKinds any_kind;
  for (int l = 0; l < cfg.layers; ++l) {
    (moe_index_[l] >= 0 ? any_moe : any_dense) = true;
    any_kind |= blocks::AttnKinds::of(kind_[l]);
  }
  w.attn = blocks::AttnShape::of(cfg, B, T);
  w.mlp = blocks::MlpShape::of(cfg, N, w_.renormalize_gates);
  w.r = p.tensor("r", {N, D});
  w.h = cfg.residual_scaling ? p.tensor("h", {N, D}) : Tensor();
  w.x_mid = p.tensor("x_mid", {N, D});
  w.h1 = p.tensor("h1", {N, D});
  w.attn_out = p.tensor("attn_out", {N, D});
  w.h2 = p.tensor("h2", {N, D});
  blocks::carve(p, "attn.", w.attn, any_kind, w.attn_saved);
  blocks::carve(p, "mlp.", w.mlp, any_dense, any_moe, w.mlp_saved);
  blocks::carve(p, w.mlp, any_dense, any_moe, /*backward=*/false, w.mlp_scratch);
  w.eda[0] = w.eda[1] = Tensor();
  if (any_moe && w.mlp.mlp_router) {
    w.eda[0] = p.tensor("eda.0", {N, R});
    w.eda[1] = p.tensor("eda.1", {N, R});
  }
  w.final_in = cfg.residual_scaling ? p.tensor("final_in", {head_rows, D}) : Tensor();
  w.final_h = p.tensor("final_h", {head_rows, D});
  w.rl = p.tensor("rl", {B, D});
  w.hl = cfg.residual_scaling ? p.tensor("hl", {B, D}) : Tensor();
}

InferenceModel::Work& InferenceModel::prepare(std::int64_t B, std::int64_t T, std::int64_t head_rows, int capacity,
                                              int first_position) {
  const model::ModelConfig& cfg = w_.config;
  if (ropes_.max_positions() < capacity) ropes_ = blocks::make_rope_tables(cfg, std::max(capacity, cfg.max_seq_len));
  Work& w = *work_;
  if (B != w.planned[0] || T != w.planned[1] || head_rows != w.planned[2]) {
    ArenaPlanner sizing;
    plan(sizing, B, T, head_rows);
    if (!w.arena || w.arena->capacity() < sizing.counted())
      w.arena = std::make_unique<Arena>("generate activations", sizing.counted());
    else
      w.arena->reset();
    ArenaPlanner real(w.arena.get());
    plan(real, B, T, head_rows);
    w.planned[0] = B, w.planned[1] = T, w.planned[2] = head_rows;
  }
  w.positions.resize(static_cast<std::size_t>(B * T));
  for (std::int64_t i = 0; i < B * T; ++i) w.positions[i] = static_cast<std::int32_t>(first_position + i % T);
  return w;
}

void InferenceModel::embed(const std::uint32_t* ids, std::int64_t n, const Tensor& out) {
  ops::embedding::forward(ids, n, embed_, out);
}

// Layer l's attention-stage input: x_mid (residual scaling: the merge of the streams r, h
// entering the layer; plain layers: r) and h1 = n1(x_mid).
void InferenceModel::attn_input(int l, Work& w) {
  const LayerParams& P = lp_[l];
  if (w_.config.residual_scaling) {
    const blocks::ResScale& A = P.attn_scale;
    if (l == 0)
      ops::residual_scale::forward(w.r, A.h_bias, A.h_scale, w.x_mid);
    else
      ops::residual_scale::merge_forward(w.r, w.h, A.r_bias, A.r_scale, A.h_bias, A.h_scale, w.x_mid);
  } else {
    std::memcpy(w.x_mid.data(), w.r.data(), sizeof(float) * static_cast<std::size_t>(w.r.numel()));
  }
  ops::rmsnorm::forward(w.x_mid, P.attn_norm, static_cast<float>(w_.config.norm_eps), w.h1, Tensor());
}

// After the attention (attn_out): plain layers x_mid += attn_out, r = x_mid + mlp(n2(x_mid));
// residual scaling r = merge(x_mid, attn_out), h = mlp(n2(r)).
void InferenceModel::mlp_stage(int l, Work& w) {
  const LayerParams& P = lp_[l];
  const float eps = static_cast<float>(w_.config.norm_eps);
  if (w_.config.residual_scaling) {
    const blocks::ResScale& M = P.mlp_scale;
    ops::residual_scale::merge_forward(w.x_mid, w.attn_out, M.r_bias, M.r_scale, M.h_bias, M.h_scale, w.r);
    ops::rmsnorm::forward(w.r, P.mlp_norm, eps, w.h2, Tensor());
    mlp(l, w, w.h);
  } else {
    add_into(w.x_mid, w.attn_out);
    ops::rmsnorm::forward(w.x_mid, P.mlp_norm, eps, w.h2, Tensor());
    mlp(l, w, w.r);
    add_into(w.r, w.x_mid);
  }
}

// y = mlp(h2): the MLP block (dense, linear-router or ZAYA1 MoE). ZAYA1's EDA state of stage m
// is read by stage m + 1 of the same tokens: two buffers alternate (the state lives only within
// one forward).
void InferenceModel::mlp(int l, Work& w, const Tensor& y) {
  const int m = moe_index_[l];
  const Tensor bias = m >= 0 ? Tensor(w_.router_bias[m].data(), {w.mlp.classes()}) : Tensor();
  blocks::EdaIo eda;
  if (m >= 0 && w.mlp.mlp_router) eda = {w.eda[m % 2], m > 0 ? w.eda[(m - 1) % 2] : Tensor()};
  blocks::mlp_forward(w.mlp, lp_[l], bias, w.h2, eda, w.mlp_saved, w.mlp_scratch, y, blocks::local_linear(),
                      /*experts=*/nullptr, /*load=*/nullptr, /*losses=*/nullptr);
}

// Final merge (residual scaling), norm and LM head on n rows of the streams.
void InferenceModel::head(std::int64_t n, const Tensor& r, const Tensor& h, float* logits) {
  const model::ModelConfig& cfg = w_.config;
  const std::int64_t D = cfg.hidden, V = cfg.vocab_size;
  Work& w = *work_;
  Tensor in = r;
  if (cfg.residual_scaling) {
    in = w.final_in.reshaped({n, D});
    const blocks::ResScale& F = final_scale_;
    ops::residual_scale::merge_forward(r, h, F.r_bias, F.r_scale, F.h_bias, F.h_scale, in);
  }
  const Tensor fh = w.final_h.reshaped({n, D});
  ops::rmsnorm::forward(in, final_norm_, static_cast<float>(cfg.norm_eps), fh, Tensor());
  ops::linear::forward(fh, lm_head_, {}, Tensor(logits, {n, V}));
}

void InferenceModel::prefill(const std::uint32_t* tokens, int T, Cache& cache, std::vector<float>& logits,
                             bool all_positions) {
  const model::ModelConfig& cfg = w_.config;
  if (cache.length != 0) fail("generate: prefill needs an empty cache (it holds {} positions)", cache.length);
  if (T < 1 || T > cache.capacity) fail("generate: prefill of {} tokens into a cache of {} positions", T, cache.capacity);
  const std::int64_t B = cache.batch, N = B * T, D = cfg.hidden, V = cfg.vocab_size;
  Work& w = prepare(B, T, all_positions ? N : B, cache.capacity, 0);
  // The training ops over the whole prompt (attention.h's block: ops::attention / ops::cca),
  // then the caches from what they computed.
  blocks::AttnContext ctx;
  ctx.pos = w.positions.data();
  embed(tokens, N, w.r);
  for (int l = 0; l < cfg.layers; ++l) {
    const LayerParams& P = lp_[l];
    ctx.rope = &ropes_.layer(l);
    ctx.window = model::attention_window(cfg, l);
    attn_input(l, w);
    blocks::attention_forward(w.attn, P, kind_[l], w.h1, ctx, w.attn_saved, w.attn_out);
    blocks::fill_cache(w.attn, P, kind_[l], w.h1, w.attn_saved, cache.capacity, cache.layers[l]);
    mlp_stage(l, w);
  }
  cache.length = T;
  if (all_positions) {
    logits.resize(static_cast<std::size_t>(N * V));
    head(N, w.r, w.h, logits.data());
    return;
  }
  // Only the last position of each sequence feeds the next token: gather those rows.
  const bool scaled = cfg.residual_scaling;
  for (std::int64_t b = 0; b < B; ++b) {
    std::memcpy(w.rl.row(b), w.r.row(b * T + T - 1), sizeof(float) * static_cast<std::size_t>(D));
    if (scaled) std::memcpy(w.hl.row(b), w.h.row(b * T + T - 1), sizeof(float) * static_cast<std::size_t>(D));
  }
  logits.resize(static_cast<std::size_t>(B * V));
  head(B, w.rl, w.hl, logits.data());
}

void InferenceModel::decode(const std::uint32_t* tokens, Cache& cache, std::vector<float>& logits) {
  const model::ModelConfig& cfg = w_.config;
  if (cache.length >= cache.capacity) fail("generate: the cache is full ({} positions)", cache.capacity);
  const std::int64_t B = cache.batch, V = cfg.vocab_size;
  Work& w = prepare(B, 1, B, cache.capacity, cache.length);
  embed(tokens, B, w.r);
  for (int l = 0; l < cfg.layers; ++l) {
    attn_input(l, w);
    blocks::attention_decode(w.attn, lp_[l], kind_[l], w.h1, w.positions.data(), ropes_.layer(l),
                             model::attention_window(cfg, l), cache.capacity, cache.length, cache.layers[l],
                             w.attn_saved, w.attn_out);
    mlp_stage(l, w);
  }
  cache.length += 1;
  logits.resize(static_cast<std::size_t>(B * V));
  head(B, w.r, w.h, logits.data());
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
