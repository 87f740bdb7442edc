// The GPU decoder of generate/cuda_decoder.h: weights, caches and every activation on one GPU,
// one stream. The data flow is InferenceModel's (generate.cc) and the GPU training forward's
// (train/cuda_model_cuda.cc), over the same blocks (src/blocks/cuda: the attention and MLP
// blocks, the device weights by role; attention_decode.h for the caches and the per-token
// attention): plain layers keep one fp32 residual stream r (x_mid = r + attn, r = x_mid + mlp),
// residual-scaled (ZAYA1) layers two (r and the previous mixer output h, merged before each
// stage and before the final norm). This file is the driver: weights upload, caches per batch,
// the layer loop, the head, the logits or greedy picks.
//
// Memory: the weights (one bf16 copy of the flat parameter buffer, plus fp32 copies of the 1-D
// parameters and conv weights), the caches (one allocation per start()), and one activation
// buffer carved for the (batch, tokens) of the call, grown when a larger call comes and reused
// otherwise, so decode steps allocate nothing.
#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <unordered_map>

#include "blocks/cuda/attention.h"
#include "blocks/cuda/attention_decode.h"
#include "blocks/cuda/decode_kernels.h"
#include "blocks/cuda/mlp.h"
#include "blocks/cuda/rope_tables.h"
#include "blocks/cuda/runners.h"
#include "blocks/cuda/weights.h"
#include "blocks/weights.h"
#include "common/error.h"
#include "device/cuda_check.h"
#include "device/cuda_devices.h"
#include "device/device_arena.h"
#include "device/device_buffer.h"
#include "generate/cuda_decoder.h"
#include "ops/cuda/cast.h"
#include "ops/cuda/causal_conv.h"
#include "ops/cuda/embedding.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/linear.h"
#include "ops/cuda/residual_scale.h"
#include "ops/cuda/rmsnorm.h"
#include "ops/cuda/router.h"
#include "train/model.h"

namespace keel::generate {
namespace {

using ops::cuda::bf16;
namespace k = ops::cuda;
namespace bc = blocks::cuda;

static_assert(k::causal_conv::kMaxWidth == 8 && k::router::kMaxTopK == 16,
              "cuda_decoder_unsupported() (cuda_decoder.cc) states these limits");

// The decoder's device allocations: grow-only, exact sizes; out of memory names what to lower.
GrowingDeviceBuffer decoder_buffer() {
  return GrowingDeviceBuffer("generate: out of GPU memory: the ", "lower --batch, the prompt or --max-new-tokens");
}

// The activations of one call over N = B * T tokens.
struct Acts {
  std::uint32_t* tokens = nullptr;
  std::int32_t* positions = nullptr;
  float *r = nullptr, *h = nullptr, *x_mid = nullptr;
  bf16 *h1 = nullptr, *h2 = nullptr, *attn_out = nullptr;
  bc::AttnSaved attn;      // prefill: the attention block's saved set; decode (T = 1): its scratch
  bc::CacheScratch cache;  // the cache fills' and the decode attention's scratch
  bc::MlpSaved mlp;        // the MLP block's forward scratch
  bc::MlpScratch mlp_scratch;
  float* eda[2] = {nullptr, nullptr};  // ZAYA1: the EDA states of consecutive MoE stages [N, R]
  float *final_r = nullptr, *rl = nullptr, *hl = nullptr, *logits = nullptr;
  bf16* fh = nullptr;
  std::uint32_t* next = nullptr;  // [B] greedy picks
};

class CudaDecoder final : public Decoder {
 public:
  explicit CudaDecoder(ModelWeights w) : cfg_(w.config), renormalize_(w.renormalize_gates) {
    train::ModelOptions mo;
    mo.micro_batch = 1;
    mo.seq_length = 1;
    train::validate_trainable(cfg_, mo);
    if (const std::string why = cuda_decoder_unsupported(cfg_); !why.empty())
      throw UsageError(fmt::format("generate: model '{}' on --device cuda: {} (use --device cpu)", cfg_.name, why));
    if (visible_cuda_devices() == 0) throw UsageError("generate: --device cuda: no CUDA device is visible");
    int dev = 0;
    KEEL_CUDA_CHECK(cudaGetDevice(&dev));
    cudaDeviceProp prop{};
    KEEL_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    gpu_name_ = prop.name;
    const optim::ParamLayout layout = model::param_layout(cfg_);
    if (static_cast<std::int64_t>(w.params.size()) != layout.total_floats)
      fail("generate: model '{}' needs {} parameter floats, got {}", cfg_.name, layout.total_floats, w.params.size());
    int moe = 0;
    for (int l = 0; l < cfg_.layers; ++l) {
      const bool routed = model::is_moe_layer(cfg_, l);
      moe += routed ? 1 : 0;
      any_moe_ |= routed;
      any_dense_ |= !routed;
      any_kind_ |= bc::AttnKinds::of(model::layer_attention_kind(cfg_, l));
    }
    classes_ = cfg_.experts + (cfg_.router_skip_expert ? 1 : 0);
    if (static_cast<int>(w.router_bias.size()) != moe)
      fail("generate: model '{}' has {} MoE layers, got {} router bias vectors", cfg_.name, moe, w.router_bias.size());
    for (const auto& b : w.router_bias)
      if (static_cast<int>(b.size()) != classes_)
        fail("generate: router bias of {} classes, the model routes over {}", b.size(), classes_);
    mlp_router_ = cfg_.router_hidden > 0;
    scaled_ = cfg_.residual_scaling;

    KEEL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    gemm_ = std::make_unique<k::GemmRunner>();
    upload(w, layout);
    w.params.clear();
    w.params.shrink_to_fit();
  }

  ~CudaDecoder() override {
    if (stream_) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
  }

  const model::ModelConfig& config() const override { return cfg_; }
  std::string device() const override {
    return fmt::format("cuda: {} (bf16 weights {:.1f} MiB, bf16 caches)", gpu_name_, weight_bytes_ / 1048576.0);
  }
  int batch() const override { return batch_; }
  int length() const override { return length_; }

  void start(int batch, int capacity) override {
    if (batch < 1 || capacity < 1)
      throw UsageError(fmt::format("generate: batch ({}) and positions ({}) must be >= 1", batch, capacity));
    if (cfg_.max_seq_len > 0 && capacity > cfg_.max_seq_len)
      throw UsageError(fmt::format("generate: prompt + new tokens = {} positions exceeds model '{}' max_seq_len {}",
                                   capacity, cfg_.name, cfg_.max_seq_len));
    const int positions = std::max(capacity, cfg_.max_seq_len);
    if (!ropes_ || ropes_->max_positions() < positions)
      ropes_ = std::make_unique<bc::DeviceRopeTables>(blocks::make_rope_tables(cfg_, positions));
    batch_ = batch;
    capacity_ = capacity;
    length_ = 0;
    const bc::AttnShape s = bc::AttnShape::of(cfg_, batch, 1);
    auto carve = [&](DeviceCarver& c) {
      caches_.assign(static_cast<std::size_t>(cfg_.layers), bc::LayerCache{});
      for (int l = 0; l < cfg_.layers; ++l)
        bc::carve(c, s, layer(l), capacity, caches_[static_cast<std::size_t>(l)]);
    };
    DeviceCarver sizing;
    carve(sizing);
    DeviceCarver real(cache_buf_.ensure(sizing.used(), stream_, "caches"), sizing.used());
    carve(real);
    for (int l = 0; l < cfg_.layers; ++l) bc::reset_cache(s, layer(l), caches_[static_cast<std::size_t>(l)], stream_);
  }

  void prefill(const std::uint32_t* tokens, int T, std::vector<float>& logits, bool all_positions) override {
    check_prefill(T);
    run(tokens, T, /*prefill=*/true, all_positions);
    fetch_logits(all_positions ? std::int64_t(batch_) * T : batch_, logits);
  }

  void decode(const std::uint32_t* tokens, std::vector<float>& logits) override {
    check_decode();
    run(tokens, 1, /*prefill=*/false, /*all_positions=*/false);
    fetch_logits(batch_, logits);
  }

  void prefill_greedy(const std::uint32_t* tokens, int T, std::int64_t allowed, std::uint32_t* next) override {
    check_prefill(T);
    run(tokens, T, /*prefill=*/true, /*all_positions=*/false);
    fetch_argmax(allowed, next);
  }

  void decode_greedy(const std::uint32_t* tokens, std::int64_t allowed, std::uint32_t* next) override {
    check_decode();
    run(tokens, 1, /*prefill=*/false, /*all_positions=*/false);
    fetch_argmax(allowed, next);
  }

  std::int64_t cache_bytes_per_sequence() const override {
    std::int64_t elems = 0;
    const std::int64_t C = blocks::cca_config(cfg_).qk_channels(), kv = std::int64_t(cfg_.kv_heads) * cfg_.head_dim;
    for (const bc::LayerWeights& L : w_.layers) {
      if (L.linear) {  // the fp32 state: 2 bf16 elements per float
        elems += 2 * kv * cfg_.head_dim;
        continue;
      }
      elems += 2 * kv * length_;
      if (L.cca) elems += (cfg_.cca_conv_width - 1 + cfg_.cca_group_conv_width - 1) * C + kv / 2;
    }
    return elems * static_cast<std::int64_t>(sizeof(bf16));
  }

 private:
  const bc::LayerWeights& layer(int l) const { return w_.layers[static_cast<std::size_t>(l)]; }

  void check_prefill(int T) const {
    if (batch_ == 0) fail("generate: prefill before start()");
    if (length_ != 0) fail("generate: prefill needs an empty cache (it holds {} positions)", length_);
    if (T < 1 || T > capacity_) fail("generate: prefill of {} tokens into a cache of {} positions", T, capacity_);
  }

  void check_decode() const {
    if (batch_ == 0) fail("generate: decode before start()");
    if (length_ >= capacity_) fail("generate: the cache is full ({} positions)", capacity_);
  }

  // The logits of the last call ([rows, V] on the device) to the host: the sync ending a call.
  void fetch_logits(std::int64_t rows, std::vector<float>& logits) {
    logits.resize(static_cast<std::size_t>(rows * cfg_.vocab_size));
    KEEL_CUDA_CHECK(cudaMemcpyAsync(logits.data(), acts_.logits, logits.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                    stream_));
    KEEL_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  // Greedy: each sequence's argmax on the device, B ids to the host.
  void fetch_argmax(std::int64_t allowed, std::uint32_t* next) {
    const std::int64_t V = cfg_.vocab_size;
    bc::argmax_rows(acts_.logits, batch_, V, std::min(allowed, V), acts_.next, stream_);
    KEEL_CUDA_CHECK(cudaMemcpyAsync(next, acts_.next, batch_ * sizeof(std::uint32_t), cudaMemcpyDeviceToHost, stream_));
    KEEL_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  float eps() const { return static_cast<float>(cfg_.norm_eps); }

  // ------------------------------------------------------------ weights

  void upload(const ModelWeights& w, const optim::ParamLayout& layout) {
    const std::int64_t n = layout.total_floats;
    // The bf16 copy of everything (matrices, embedding; the small parameters come along),
    // converted on the device in chunks through an fp32 staging buffer.
    w16_ = static_cast<bf16*>(w16_buf_.ensure(static_cast<std::size_t>(n) * sizeof(bf16), stream_, "weights"));
    {
      const std::int64_t chunk = std::min<std::int64_t>(n, std::int64_t(1) << 24);
      GrowingDeviceBuffer staging = decoder_buffer();
      float* st = static_cast<float*>(staging.ensure(static_cast<std::size_t>(chunk) * sizeof(float), stream_, "weights"));
      for (std::int64_t off = 0; off < n; off += chunk) {
        const std::int64_t m = std::min(chunk, n - off);
        KEEL_CUDA_CHECK(cudaMemcpyAsync(st, w.params.data() + off, m * sizeof(float), cudaMemcpyHostToDevice, stream_));
        k::f32_to_bf16(st, w16_ + off, m, stream_);
        KEEL_CUDA_CHECK(cudaStreamSynchronize(stream_));
      }
    }
    // fp32 copies where the training path reads fp32: 1-D parameters (norms, biases, residual
    // scales, EDA scales, temperatures) and the CCA conv weights.
    std::unordered_map<std::int64_t, std::int64_t> f32_offset;
    std::int64_t f32_floats = 0;
    for (const auto& p : layout.params)
      if (p.ndim() == 1 || p.name.find(".conv") != std::string::npos) {
        f32_offset[p.offset] = f32_floats;
        f32_floats += (p.numel + 63) / 64 * 64;
      }
    float* f32 = static_cast<float*>(f32_buf_.ensure(static_cast<std::size_t>(std::max<std::int64_t>(f32_floats, 1)) *
                                                         sizeof(float), stream_, "weights"));
    for (const auto& p : layout.params) {
      auto it = f32_offset.find(p.offset);
      if (it != f32_offset.end())
        KEEL_CUDA_CHECK(cudaMemcpy(f32 + it->second, w.params.data() + p.offset, p.numel * sizeof(float),
                                   cudaMemcpyHostToDevice));
    }
    // Router selection biases, [moe][classes].
    std::vector<float> flat;
    for (const auto& b : w.router_bias) flat.insert(flat.end(), b.begin(), b.end());
    bias_ = static_cast<float*>(bias_buf_.ensure(std::max<std::size_t>(flat.size(), 1) * sizeof(float), stream_, "weights"));
    if (!flat.empty())
      KEEL_CUDA_CHECK(cudaMemcpy(bias_, flat.data(), flat.size() * sizeof(float), cudaMemcpyHostToDevice));
    // pageable cudaMemcpy may return before its DMA lands, and kernels on a non-blocking stream
    // do not wait for the legacy stream: the uploads finish before the first step
    KEEL_CUDA_CHECK(cudaDeviceSynchronize());
    weight_bytes_ = w16_buf_.capacity() + f32_buf_.capacity() + bias_buf_.capacity();

    // Device views by role (the one role map of blocks/weights.h): GEMM operands from the bf16
    // copy, the rest from the fp32 copies.
    const bc::Bf16At b16 = [&](const optim::ParamInfo& p) -> const bf16* { return w16_ + p.offset; };
    const bc::F32At f32v = [&](const optim::ParamInfo& p) -> const float* {
      auto it = f32_offset.find(p.offset);
      if (it == f32_offset.end()) fail("generate: no fp32 device copy of parameter '{}'", p.name);
      return f32 + it->second;
    };
    w_ = bc::device_weights(cfg_, layout, f32v, b16);
  }

  // ------------------------------------------------------------ activations

  void plan(DeviceCarver& c, std::int64_t B, std::int64_t T, std::int64_t head_rows) {
    const std::int64_t N = B * T, D = cfg_.hidden, V = cfg_.vocab_size, R = std::max(cfg_.router_hidden, 1);
    attn_shape_ = bc::AttnShape::of(cfg_, B, T);
    mlp_shape_ = bc::MlpShape::of(cfg_, N, renormalize_);
    Acts& a = acts_;
    a = Acts{};
    a.tokens = c.take<std::uint32_t>(N);
    a.positions = c.take<std::int32_t>(N);
    a.r = c.take<float>(N * D);
    if (scaled_) {
      a.h = c.take<float>(N * D);
      a.x_mid = c.take<float>(N * D);
    }
    a.h1 = c.take<bf16>(N * D);
    a.h2 = c.take<bf16>(N * D);
    a.attn_out = c.take<bf16>(N * D);
    bc::carve(c, attn_shape_, any_kind_, a.attn);
    bc::carve(c, attn_shape_, any_kind_, a.cache);
    bc::carve(c, mlp_shape_, bc::MlpParts{any_dense_, any_moe_}, a.mlp);
    bc::MlpScratchParts mp;
    mp.dense = any_dense_;
    mp.routed = any_moe_;
    mp.residual_out = !scaled_;  // plain layers: r = r + mlp(x)
    bc::carve(c, mlp_shape_, mp, a.mlp_scratch);
    if (any_moe_ && mlp_router_) {
      a.eda[0] = c.take<float>(N * R);
      a.eda[1] = c.take<float>(N * R);
    }
    if (scaled_) {
      a.final_r = c.take<float>(head_rows * D);
      a.hl = c.take<float>(B * D);
    }
    a.rl = c.take<float>(B * D);
    a.fh = c.take<bf16>(head_rows * D);
    a.logits = c.take<float>(head_rows * V);
    a.next = c.take<std::uint32_t>(B);
  }

  void carve(std::int64_t B, std::int64_t T, std::int64_t head_rows) {
    if (B == planned_[0] && T == planned_[1] && head_rows == planned_[2]) return;
    DeviceCarver sizing;
    plan(sizing, B, T, head_rows);
    DeviceCarver real(act_buf_.ensure(sizing.used(), stream_, "activations"), sizing.used());
    plan(real, B, T, head_rows);
    planned_[0] = B, planned_[1] = T, planned_[2] = head_rows;
  }

  // ------------------------------------------------------------ forward

  // The forward of T tokens per sequence (prefill: from position 0; decode: T = 1 at length_),
  // leaving the logits of every position (all_positions) or each sequence's last on the device.
  void run(const std::uint32_t* tokens_host, int T, bool prefill, bool all_positions) {
    const std::int64_t B = batch_, N = B * T, D = cfg_.hidden, V = cfg_.vocab_size;
    for (std::int64_t i = 0; i < N; ++i)
      if (tokens_host[i] >= static_cast<std::uint64_t>(V))
        fail("generate: token id {} at position {} is outside the vocabulary ({})", tokens_host[i], i, V);
    const std::int64_t head_rows = all_positions ? N : B;
    carve(B, T, head_rows);
    Acts& a = acts_;
    KEEL_CUDA_CHECK(cudaMemcpyAsync(a.tokens, tokens_host, N * sizeof(std::uint32_t), cudaMemcpyHostToDevice, stream_));
    bc::fill_positions(a.positions, N, T, prefill ? 0 : length_, stream_);
    k::embedding::forward_bf16_table(a.tokens, N, w_.embed, a.r, V, D, stream_);
    bc::AttnContext ctx;
    ctx.pos = a.positions;
    ctx.linear_workspace = a.cache.linear_ws;  // linear layers' prefill
    for (int l = 0; l < cfg_.layers; ++l) {
      const bc::LayerWeights& L = layer(l);
      const bc::LayerCache& lc = caches_[static_cast<std::size_t>(l)];
      ctx.rope = &ropes_->layer(l);
      ctx.window = model::attention_window(cfg_, l);
      float* x_mid = scaled_ ? a.x_mid : a.r;  // plain layers add into the residual stream in place
      if (scaled_) {
        const bc::ResScale& A = L.attn_scale;
        if (l == 0)
          k::residual_scale::forward(a.r, A.h_bias, A.h_scale, x_mid, N, D, stream_);
        else
          k::residual_scale::merge_forward(a.r, a.h, A.r_bias, A.r_scale, A.h_bias, A.h_scale, x_mid, N, D, stream_);
      }
      k::rmsnorm::forward(x_mid, L.attn_norm, eps(), a.h1, nullptr, N, D, stream_);
      // Plain layers add the block output into x_mid: mha/gqa in the output projection's GEMM
      // (fp32, beta 1), as the training path, CCA from attn_out (bf16) after it; residual-scaled
      // layers merge attn_out below.
      float* add_into = scaled_ ? nullptr : x_mid;
      if (prefill) {
        // The training block over the prompt, then the caches from what it computed; CCA's add
        // comes after the cache fills.
        bc::attention_forward(*gemm_, attn_shape_, L, a.h1, ctx, a.attn, L.cca ? nullptr : add_into, a.attn_out,
                              stream_);
        bc::fill_cache(*gemm_, attn_shape_, L, a.h1, a.attn, capacity_, lc, a.cache, stream_);
        if (L.cca && add_into) k::add_bf16_to_f32(a.attn_out, add_into, N * D, stream_);
      } else {
        bc::attention_decode(*gemm_, attn_shape_, L, a.h1, a.positions, *ctx.rope, ctx.window, capacity_, length_, lc,
                             a.attn, a.cache, add_into, a.attn_out, stream_);
      }
      if (scaled_) {
        const bc::ResScale& M = L.mlp_scale;
        k::residual_scale::merge_forward(x_mid, a.attn_out, M.r_bias, M.r_scale, M.h_bias, M.h_scale, a.r, N, D,
                                         stream_);
        k::rmsnorm::forward(a.r, L.mlp_norm, eps(), a.h2, nullptr, N, D, stream_);
        mlp(l, /*residual=*/nullptr, a.h);
      } else {
        k::rmsnorm::forward(x_mid, L.mlp_norm, eps(), a.h2, nullptr, N, D, stream_);
        mlp(l, /*residual=*/a.r, a.r);
      }
    }
    length_ += T;
    head(T, all_positions);
  }

  // y = residual + mlp(h2) (residual == y: in place), or y = mlp(h2) without one; fp32 [N, D].
  void mlp(int l, const float* residual, float* y) {
    const bc::LayerWeights& L = layer(l);
    Acts& a = acts_;
    const int m = L.moe;
    const float* bias = m >= 0 ? bias_ + std::int64_t(m) * classes_ : nullptr;
    // ZAYA1: the EDA state of stage m is read by stage m + 1 of the same tokens; two buffers
    // alternate (the state lives only within one forward).
    bc::EdaIo eda;
    if (m >= 0 && mlp_router_) eda = {a.eda[m % 2], m > 0 ? a.eda[(m - 1) % 2] : nullptr};
    bc::mlp_forward(*gemm_, mlp_shape_, L, bias, a.h2, eda, residual, y, a.mlp, a.mlp_scratch, bc::local_linear(),
                    /*experts=*/nullptr, stream_);
  }

  // Final merge, norm and LM head over every position (all_positions) or each sequence's
  // last, into acts_.logits.
  void head(int T, bool all_positions) {
    Acts& a = acts_;
    const std::int64_t B = batch_, D = cfg_.hidden, V = cfg_.vocab_size;
    const std::int64_t rows = all_positions ? B * T : B;
    const float* r = a.r;
    const float* h = a.h;
    if (!all_positions && T > 1) {
      bc::copy_rows(a.rl, D, a.r + (T - 1) * D, T * D, D, B, sizeof(float), stream_);
      r = a.rl;
      if (scaled_) {
        bc::copy_rows(a.hl, D, a.h + (T - 1) * D, T * D, D, B, sizeof(float), stream_);
        h = a.hl;
      }
    }
    const float* in = r;
    if (scaled_) {
      const bc::ResScale& F = w_.final_scale;
      k::residual_scale::merge_forward(r, h, F.r_bias, F.r_scale, F.h_bias, F.h_scale, a.final_r, rows, D, stream_);
      in = a.final_r;
    }
    k::rmsnorm::forward(in, w_.final_norm, eps(), a.fh, nullptr, rows, D, stream_);
    k::linear::forward_f32(*gemm_, a.fh, w_.lm_head, a.logits, rows, D, V, stream_);
  }

  model::ModelConfig cfg_;
  bool renormalize_ = true;
  std::string gpu_name_;
  bc::AttnKinds any_kind_;
  bool any_moe_ = false, any_dense_ = false, mlp_router_ = false,
       scaled_ = false;
  int classes_ = 0;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<k::GemmRunner> gemm_;
  std::unique_ptr<bc::DeviceRopeTables> ropes_;  // each layer's rotary table

  GrowingDeviceBuffer w16_buf_ = decoder_buffer(), f32_buf_ = decoder_buffer(), bias_buf_ = decoder_buffer(),
      cache_buf_ = decoder_buffer(), act_buf_ = decoder_buffer();
  std::size_t weight_bytes_ = 0;
  bf16* w16_ = nullptr;
  float* bias_ = nullptr;
  bc::ModelWeights w_;

  int batch_ = 0, capacity_ = 0, length_ = 0;
  std::vector<bc::LayerCache> caches_;
  bc::AttnShape attn_shape_;  // of the planned call
  bc::MlpShape mlp_shape_;
  Acts acts_;
  std::int64_t planned_[3] = {-1, -1, -1};
};

}  // namespace

std::unique_ptr<Decoder> make_cuda_decoder(ModelWeights weights) {
  return std::make_unique<CudaDecoder>(std::move(weights));
}

}  // namespace keel::generate
