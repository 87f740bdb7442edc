// The GPU decoder of generate/cuda_decoder.h: weights, caches and every activation on one GPU,
// one stream, the CUDA ops of src/ops/cuda. The data flow is InferenceModel's (generate.cc)
// and the GPU training forward's (train/cuda_backend_cuda.cc): plain layers keep one fp32
// residual stream r (x_mid = r + attn, r = x_mid + mlp), residual-scaled (ZAYA1) layers two
// (r and the previous mixer output h, merged before each stage and before the final norm).
//
// Memory: the weights (one bf16 copy of the flat parameter buffer, plus fp32 copies of the 1-D
// parameters and conv weights), the caches (one allocation per start()), and one activation
// buffer carved for the (batch, tokens) of the call, grown when a larger call comes and reused
// otherwise, so decode steps allocate nothing.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <unordered_map>

#include "common/error.h"
#include "device/cuda_check.h"
#include "device/cuda_devices.h"
#include "device/device_buffer.h"
#include "generate/cuda_decoder.h"
#include "blocks/cuda/decode_kernels.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/cast.h"
#include "ops/cuda/causal_conv.h"
#include "ops/cuda/cca.h"
#include "ops/cuda/decode_attention.h"
#include "ops/cuda/embedding.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/linear.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/residual_scale.h"
#include "ops/cuda/rmsnorm.h"
#include "ops/cuda/rope.h"
#include "ops/cuda/router.h"
#include "ops/cuda/swiglu.h"
#include "ops/cuda/zaya_router.h"
#include "ops/rope.h"
#include "blocks/cuda/kernels.h"
#include "blocks/cuda/zaya_moe.h"
#include "train/model.h"

namespace keel::generate {
namespace {

using ops::cuda::bf16;
namespace k = ops::cuda;
namespace dk = blocks::cuda;

static_assert(k::causal_conv::kMaxWidth == 8 && k::router::kMaxTopK == 16,
              "cuda_decoder_unsupported() (cuda_decoder.cc) states these limits");

// The decoder's device allocations: grow-only, exact sizes; out of memory names what to lower.
GrowingDeviceBuffer decoder_buffer() {
  return GrowingDeviceBuffer("generate: out of GPU memory: the ", "lower --batch, the prompt or --max-new-tokens");
}

// Carves 256-byte-aligned regions from a base (a sizing pass when the base is null).
class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<std::byte*>(base)) {}
  template <typename T>
  T* take(std::int64_t count) {
    const std::size_t bytes = (static_cast<std::size_t>(std::max<std::int64_t>(count, 0)) * sizeof(T) + 255) / 256 * 256;
    T* p = base_ ? reinterpret_cast<T*>(base_ + used_) : nullptr;
    used_ += bytes;
    return p;
  }
  std::size_t used() const { return used_; }

 private:
  std::byte* base_;
  std::size_t used_ = 0;
};

struct ResScaleDev {
  const float *h_scale = nullptr, *h_bias = nullptr, *r_scale = nullptr, *r_bias = nullptr;
};

struct LayerDev {
  bool cca = false;
  int moe = -1;  // MoE stage index or -1
  const float *attn_norm = nullptr, *mlp_norm = nullptr;
  const bf16 *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr;  // mha/gqa
  k::cca::Weights cw;                                                      // CCA
  const bf16 *w_gate = nullptr, *w_up = nullptr, *w_down = nullptr;       // dense
  const bf16* router = nullptr;                                            // linear router [E, D]
  k::moe::Weights experts;
  blocks::cuda::zaya::Weights zw;  // MLP router + experts
  ResScaleDev attn_scale, mlp_scale;
};

struct LayerCacheDev {
  bf16 *k = nullptr, *v = nullptr;        // [B, capacity, kv_heads * head_dim]
  bf16 *st0 = nullptr, *st1 = nullptr;    // CCA: [B, W0 - 1, C], [B, W1 - 1, C]
  bf16* prev_v = nullptr;                 // CCA: [B, kv_heads * head_dim / 2]
};

// The activations of one call over N = B * T tokens.
struct Acts {
  std::uint32_t* tokens = nullptr;
  std::int32_t* positions = nullptr;
  float *r = nullptr, *h = nullptr, *x_mid = nullptr, *y = nullptr;
  bf16 *h1 = nullptr, *h2 = nullptr, *attn_out = nullptr;
  bf16 *q = nullptr, *k = nullptr, *v = nullptr, *att = nullptr;  // mha/gqa
  float* lse = nullptr;
  void* cca_saved = nullptr;  // cca::saved_bytes(B, T): prefill's saved set, decode's scratch
  bf16* last_x = nullptr;     // [B, D] the last prompt token's normed input (CCA prev_v)
  bf16 *g = nullptr, *u = nullptr, *a = nullptr;  // dense
  float *rlogits = nullptr, *probs = nullptr, *rlse = nullptr, *gates = nullptr, *losses = nullptr;
  std::int32_t *idx = nullptr, *counts = nullptr, *plan_ws = nullptr;
  k::moe::Saved msaved;
  void* zsaved = nullptr;  // zaya_router::saved_bytes
  std::int32_t *kept = nullptr, *kept_idx = nullptr, *zpos = nullptr, *zcount = nullptr;
  float* eda[2] = {nullptr, nullptr};
  blocks::cuda::zaya::Scratch zs;
  void* dattn_ws = nullptr;
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
      moe_index_.push_back(model::is_moe_layer(cfg_, l) ? moe++ : -1);
      const bool cca = model::layer_attention_kind(cfg_, l) == model::AttentionKind::kCca;
      any_cca_ |= cca;
      any_softmax_ |= !cca;
    }
    classes_ = cfg_.experts + (cfg_.router_skip_expert ? 1 : 0);
    if (static_cast<int>(w.router_bias.size()) != moe)
      fail("generate: model '{}' has {} MoE layers, got {} router bias vectors", cfg_.name, moe, w.router_bias.size());
    for (const auto& b : w.router_bias)
      if (static_cast<int>(b.size()) != classes_)
        fail("generate: router bias of {} classes, the model routes over {}", b.size(), classes_);
    mlp_router_ = cfg_.router_hidden > 0;
    scaled_ = cfg_.residual_scaling;
    cca_cfg_ = blocks::cca_config(cfg_);
    zshape_.hidden = cfg_.hidden;
    zshape_.router_hidden = cfg_.router_hidden;
    zshape_.expert_hidden = cfg_.expert_hidden;
    zshape_.experts = cfg_.experts;
    zshape_.skip = cfg_.router_skip_expert;
    zshape_.eps = eps();

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
    if (!rope_ || rope_->view().max_positions < positions)
      rope_ = std::make_unique<k::rope::UploadedTable>(
          ops::rope::make_table(cfg_.head_dim, cfg_.rope_fraction, cfg_.rope_base, positions));
    batch_ = batch;
    capacity_ = capacity;
    length_ = 0;
    const std::int64_t B = batch, KV = kv(), C = cca_cfg_.qk_channels(), W0 = cfg_.cca_conv_width,
                       W1 = cfg_.cca_group_conv_width;
    auto carve = [&](Carver& c) {
      caches_.assign(static_cast<std::size_t>(cfg_.layers), LayerCacheDev{});
      for (int l = 0; l < cfg_.layers; ++l) {
        LayerCacheDev& lc = caches_[static_cast<std::size_t>(l)];
        lc.k = c.take<bf16>(B * capacity * KV);
        lc.v = c.take<bf16>(B * capacity * KV);
        if (layers_[static_cast<std::size_t>(l)].cca) {
          lc.st0 = c.take<bf16>(B * (W0 - 1) * C);
          lc.st1 = c.take<bf16>(B * (W1 - 1) * C);
          lc.prev_v = c.take<bf16>(B * KV / 2);
        }
      }
    };
    Carver sizing(nullptr);
    carve(sizing);
    Carver real(cache_buf_.ensure(sizing.used(), stream_, "caches"));
    carve(real);
    // Empty caches: the depthwise conv reads zeros before the sequence, the grouped conv the
    // depthwise output of zeros (its bias, in bf16 as the CUDA CCA's c0), the value shift zeros.
    for (int l = 0; l < cfg_.layers; ++l) {
      const LayerDev& L = layers_[static_cast<std::size_t>(l)];
      LayerCacheDev& lc = caches_[static_cast<std::size_t>(l)];
      if (!L.cca) continue;
      if (W0 > 1) KEEL_CUDA_CHECK(cudaMemsetAsync(lc.st0, 0, B * (W0 - 1) * C * sizeof(bf16), stream_));
      dk::broadcast_row(L.cw.conv0_b, C, B * (W1 - 1), lc.st1, stream_);
      KEEL_CUDA_CHECK(cudaMemsetAsync(lc.prev_v, 0, B * KV / 2 * sizeof(bf16), stream_));
    }
  }

  void prefill(const std::uint32_t* tokens, int T, std::vector<float>& logits, bool all_positions) override {
    if (batch_ == 0) fail("generate: prefill before start()");
    if (length_ != 0) fail("generate: prefill needs an empty cache (it holds {} positions)", length_);
    if (T < 1 || T > capacity_) fail("generate: prefill of {} tokens into a cache of {} positions", T, capacity_);
    run(tokens, T, /*prefill=*/true, all_positions);
    fetch_logits(all_positions ? std::int64_t(batch_) * T : batch_, logits);
  }

  void decode(const std::uint32_t* tokens, std::vector<float>& logits) override {
    check_decode();
    run(tokens, 1, /*prefill=*/false, /*all_positions=*/false);
    fetch_logits(batch_, logits);
  }

  void prefill_greedy(const std::uint32_t* tokens, int T, std::int64_t allowed, std::uint32_t* next) override {
    if (batch_ == 0) fail("generate: prefill before start()");
    if (length_ != 0) fail("generate: prefill needs an empty cache (it holds {} positions)", length_);
    if (T < 1 || T > capacity_) fail("generate: prefill of {} tokens into a cache of {} positions", T, capacity_);
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
    const std::int64_t C = cca_cfg_.qk_channels();
    for (const LayerDev& L : layers_) {
      elems += 2 * kv() * length_;
      if (L.cca) elems += (cfg_.cca_conv_width - 1 + cfg_.cca_group_conv_width - 1) * C + kv() / 2;
    }
    return elems * static_cast<std::int64_t>(sizeof(bf16));
  }

 private:
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
    dk::argmax_rows(acts_.logits, batch_, V, std::min(allowed, V), acts_.next, stream_);
    KEEL_CUDA_CHECK(cudaMemcpyAsync(next, acts_.next, batch_ * sizeof(std::uint32_t), cudaMemcpyDeviceToHost, stream_));
    KEEL_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  float eps() const { return static_cast<float>(cfg_.norm_eps); }
  std::int64_t kv() const { return std::int64_t(cfg_.kv_heads) * cfg_.head_dim; }
  std::int64_t qdim() const { return std::int64_t(cfg_.heads) * cfg_.head_dim; }

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

    // Device views by role, from the host views' offsets.
    float* base = const_cast<float*>(w.params.data());
    const blocks::WeightViews v = blocks::map_weights(cfg_, layout, base);
    auto b16 = [&](const Tensor& t) -> const bf16* { return t.empty() ? nullptr : w16_ + (t.data() - base); };
    auto f32v = [&](const Tensor& t) -> const float* {
      if (t.empty()) return nullptr;
      auto it = f32_offset.find(t.data() - base);
      if (it == f32_offset.end()) fail("generate: no fp32 device copy of a parameter at offset {}", t.data() - base);
      return f32 + it->second;
    };
    auto res = [&](const blocks::ResScale& s) {
      return ResScaleDev{f32v(s.h_scale), f32v(s.h_bias), f32v(s.r_scale), f32v(s.r_bias)};
    };
    embed_ = b16(v.embed);
    lm_head_ = b16(v.lm_head);
    final_norm_ = f32v(v.final_norm);
    final_scale_ = res(v.final_scale);
    layers_.assign(static_cast<std::size_t>(cfg_.layers), LayerDev{});
    for (int l = 0; l < cfg_.layers; ++l) {
      const blocks::LayerWeights& P = v.layers[static_cast<std::size_t>(l)];
      LayerDev& L = layers_[static_cast<std::size_t>(l)];
      L.cca = model::layer_attention_kind(cfg_, l) == model::AttentionKind::kCca;
      L.moe = moe_index_[static_cast<std::size_t>(l)];
      L.attn_norm = f32v(P.attn_norm);
      L.mlp_norm = f32v(P.mlp_norm);
      L.wq = b16(P.wq), L.wk = b16(P.wk), L.wv = b16(P.wv), L.wo = b16(P.wo);
      if (L.cca)
        L.cw = {b16(P.cca.w_qk), b16(P.cca.w_v),     f32v(P.cca.conv0_w), f32v(P.cca.conv0_b),
                f32v(P.cca.conv1_w), f32v(P.cca.conv1_b), f32v(P.cca.temp),    b16(P.cca.w_o)};
      L.w_gate = b16(P.w_gate), L.w_up = b16(P.w_up), L.w_down = b16(P.w_down);
      L.router = b16(P.router);
      L.experts = {b16(P.experts.w_gate), b16(P.experts.w_up), b16(P.experts.w_down)};
      if (L.moe >= 0 && mlp_router_) {
        const ops::zaya_router::Params& z = P.zrouter;
        L.zw.router = {b16(z.w_down), f32v(z.b_down), f32v(z.gamma), f32v(z.w_norm), b16(z.w1),
                       f32v(z.b1),    b16(z.w2),      f32v(z.b2),    b16(z.w3)};
        L.zw.experts = L.experts;
      }
      L.attn_scale = res(P.attn_scale);
      L.mlp_scale = res(P.mlp_scale);
    }
  }

  // ------------------------------------------------------------ activations

  void plan(Carver& c, std::int64_t B, std::int64_t T, std::int64_t head_rows) {
    const std::int64_t N = B * T, D = cfg_.hidden, Q = qdim(), KV = kv(), V = cfg_.vocab_size;
    const std::int64_t E = std::max(cfg_.experts, 1), K = std::max(cfg_.top_k, 1);
    const std::int64_t FE = std::max(cfg_.expert_hidden, 1), FD = std::max(cfg_.ffn_hidden, 1);
    const std::int64_t S = N * K, R = std::max(cfg_.router_hidden, 1);
    const bool any_moe = !moe_index_.empty() && *std::max_element(moe_index_.begin(), moe_index_.end()) >= 0;
    bool any_dense = false;
    for (int m : moe_index_) any_dense |= m < 0;
    Acts& a = acts_;
    a = Acts{};
    a.tokens = c.take<std::uint32_t>(N);
    a.positions = c.take<std::int32_t>(N);
    a.r = c.take<float>(N * D);
    if (scaled_) {
      a.h = c.take<float>(N * D);
      a.x_mid = c.take<float>(N * D);
    }
    a.y = c.take<float>(N * D);
    a.h1 = c.take<bf16>(N * D);
    a.h2 = c.take<bf16>(N * D);
    a.attn_out = c.take<bf16>(N * D);
    if (any_softmax_) {
      a.q = c.take<bf16>(N * Q);
      a.k = c.take<bf16>(N * KV);
      a.v = c.take<bf16>(N * KV);
      a.att = c.take<bf16>(N * Q);
      a.lse = c.take<float>(B * cfg_.heads * T);
    }
    if (any_cca_) {
      a.cca_saved = c.take<std::byte>(static_cast<std::int64_t>(k::cca::saved_bytes(cca_cfg_, B, T)));
      a.last_x = c.take<bf16>(B * D);
    }
    if (any_dense) {
      a.g = c.take<bf16>(N * FD);
      a.u = c.take<bf16>(N * FD);
      a.a = c.take<bf16>(N * FD);
    }
    if (any_moe && !mlp_router_) {
      a.rlogits = c.take<float>(N * E);
      a.probs = c.take<float>(N * E);
      a.rlse = c.take<float>(N);
      a.gates = c.take<float>(N * K);
      a.losses = c.take<float>(k::router::loss_floats(E));
      a.idx = c.take<std::int32_t>(S);
      a.counts = c.take<std::int32_t>(E);
      a.plan_ws = c.take<std::int32_t>(k::moe::plan_ints(S, static_cast<int>(E)));
    }
    if (any_moe && mlp_router_) {
      blocks::cuda::zaya::Shape zs = zshape_;
      zs.tokens = N;
      a.zsaved = c.take<std::byte>(static_cast<std::int64_t>(k::zaya_router::saved_bytes(zs.router_dims())));
      a.kept = c.take<std::int32_t>(N);
      a.kept_idx = c.take<std::int32_t>(N);
      a.zpos = c.take<std::int32_t>(N);
      a.zcount = c.take<std::int32_t>(1);
      a.plan_ws = c.take<std::int32_t>(k::moe::plan_ints(N, static_cast<int>(E)));
      a.eda[0] = c.take<float>(N * R);
      a.eda[1] = c.take<float>(N * R);
      a.zs.xk = c.take<bf16>(N * D);
      a.zs.yk = c.take<float>(N * D);
      a.zs.gk = c.take<float>(N);
    }
    if (any_moe) {
      a.msaved.xs = c.take<bf16>(S * D);
      a.msaved.h_gate = c.take<bf16>(S * FE);
      a.msaved.h_up = c.take<bf16>(S * FE);
      a.msaved.act = c.take<bf16>(S * FE);
      a.msaved.ys = c.take<bf16>(S * D);
    }
    a.dattn_ws = c.take<std::byte>(static_cast<std::int64_t>(
        k::decode_attention::workspace_bytes(static_cast<int>(B), cfg_.heads, cfg_.head_dim)));
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
    Carver sizing(nullptr);
    plan(sizing, B, T, head_rows);
    Carver real(act_buf_.ensure(sizing.used(), stream_, "activations"));
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
    dk::fill_positions(a.positions, N, T, prefill ? 0 : length_, stream_);
    k::embedding::forward_bf16_table(a.tokens, N, embed_, a.r, V, D, stream_);
    for (int l = 0; l < cfg_.layers; ++l) {
      const LayerDev& L = layers_[static_cast<std::size_t>(l)];
      float* x_mid = scaled_ ? a.x_mid : a.r;  // plain layers add into the residual stream in place
      if (scaled_) {
        const ResScaleDev& A = L.attn_scale;
        if (l == 0)
          k::residual_scale::forward(a.r, A.h_bias, A.h_scale, x_mid, N, D, stream_);
        else
          k::residual_scale::merge_forward(a.r, a.h, A.r_bias, A.r_scale, A.h_bias, A.h_scale, x_mid, N, D, stream_);
      }
      k::rmsnorm::forward(x_mid, L.attn_norm, eps(), a.h1, nullptr, N, D, stream_);
      // Plain mha/gqa layers add the output projection into x_mid in its GEMM (fp32, beta 1),
      // as the training path; the others leave the block output in attn_out (bf16).
      float* add_into = !scaled_ && !L.cca ? x_mid : nullptr;
      if (L.cca)
        prefill ? cca_prefill(l, T) : cca_decode(l);
      else
        prefill ? attn_prefill(l, T, add_into) : attn_decode(l, add_into);
      if (scaled_) {
        const ResScaleDev& M = L.mlp_scale;
        k::residual_scale::merge_forward(x_mid, a.attn_out, M.r_bias, M.r_scale, M.h_bias, M.h_scale, a.r, N, D,
                                         stream_);
        k::rmsnorm::forward(a.r, L.mlp_norm, eps(), a.h2, nullptr, N, D, stream_);
        mlp(l, N, a.h2, a.h, /*accumulate=*/false);
      } else {
        if (L.cca) k::add_bf16_to_f32(a.attn_out, x_mid, N * D, stream_);
        k::rmsnorm::forward(x_mid, L.mlp_norm, eps(), a.h2, nullptr, N, D, stream_);
        mlp(l, N, a.h2, a.r, /*accumulate=*/true);
      }
    }
    length_ += T;
    head(T, all_positions);
  }

  void gemm(std::int64_t m, std::int64_t n, std::int64_t kk, const bf16* a, const bf16* b, float* c, float beta) {
    k::GemmDesc d;
    d.m = m, d.n = n, d.k = kk, d.trans_b = true, d.c_type = k::GemmOut::kFp32, d.beta = beta;
    gemm_->run(d, a, b, c, stream_);
  }

  // mha/gqa over the prompt: the training ops, then k and v into cache rows 0..T-1.
  void attn_prefill(int l, int T, float* add_into) {
    const LayerDev& L = layers_[static_cast<std::size_t>(l)];
    LayerCacheDev& lc = caches_[static_cast<std::size_t>(l)];
    Acts& a = acts_;
    const std::int64_t B = batch_, N = B * T, D = cfg_.hidden, Q = qdim(), KV = kv();
    const int Hq = cfg_.heads, Hkv = cfg_.kv_heads, Dh = cfg_.head_dim;
    k::linear::forward(*gemm_, a.h1, L.wq, a.q, N, D, Q, stream_);
    k::linear::forward(*gemm_, a.h1, L.wk, a.k, N, D, KV, stream_);
    k::linear::forward(*gemm_, a.h1, L.wv, a.v, N, D, KV, stream_);
    k::rope::forward(rope_->view(), a.q, a.positions, N, Hq, stream_);
    k::rope::forward(rope_->view(), a.k, a.positions, N, Hkv, stream_);
    k::attention::forward(a.q, a.k, a.v, a.att, a.lse, static_cast<int>(B), T, Hq, Hkv, Dh,
                          1.0f / std::sqrt(static_cast<float>(Dh)), stream_);
    dk::copy_rows(lc.k, capacity_ * KV, a.k, T * KV, T * KV, B, sizeof(bf16), stream_);
    dk::copy_rows(lc.v, capacity_ * KV, a.v, T * KV, T * KV, B, sizeof(bf16), stream_);
    out_projection(L.wo, a.att, N, Q, add_into);
  }

  // mha/gqa of one new token per sequence at position length_.
  void attn_decode(int l, float* add_into) {
    const LayerDev& L = layers_[static_cast<std::size_t>(l)];
    LayerCacheDev& lc = caches_[static_cast<std::size_t>(l)];
    Acts& a = acts_;
    const std::int64_t B = batch_, D = cfg_.hidden, Q = qdim(), KV = kv();
    const int Hq = cfg_.heads, Hkv = cfg_.kv_heads, Dh = cfg_.head_dim;
    k::linear::forward(*gemm_, a.h1, L.wq, a.q, B, D, Q, stream_);
    k::linear::forward(*gemm_, a.h1, L.wk, a.k, B, D, KV, stream_);
    k::linear::forward(*gemm_, a.h1, L.wv, a.v, B, D, KV, stream_);
    k::rope::forward(rope_->view(), a.q, a.positions, B, Hq, stream_);
    k::rope::forward(rope_->view(), a.k, a.positions, B, Hkv, stream_);
    dk::copy_rows(lc.k + length_ * KV, capacity_ * KV, a.k, KV, KV, B, sizeof(bf16), stream_);
    dk::copy_rows(lc.v + length_ * KV, capacity_ * KV, a.v, KV, KV, B, sizeof(bf16), stream_);
    k::decode_attention::forward(a.q, lc.k, lc.v, a.att, static_cast<int>(B), Hq, Hkv, Dh, capacity_, length_ + 1,
                                 1.0f / std::sqrt(static_cast<float>(Dh)), a.dattn_ws, stream_);
    out_projection(L.wo, a.att, B, Q, add_into);
  }

  void out_projection(const bf16* wo, const bf16* att, std::int64_t n, std::int64_t Q, float* add_into) {
    if (add_into)
      gemm(n, cfg_.hidden, Q, att, wo, add_into, 1.f);
    else
      k::linear::forward(*gemm_, att, wo, acts_.attn_out, n, Q, cfg_.hidden, stream_);
  }

  // CCA over the prompt: cca::forward, then the caches from what it saved: k and v rows, the
  // last W0 - 1 conv inputs and W1 - 1 depthwise outputs, and the last token's x W_v2^T.
  void cca_prefill(int l, int T) {
    const LayerDev& L = layers_[static_cast<std::size_t>(l)];
    LayerCacheDev& lc = caches_[static_cast<std::size_t>(l)];
    Acts& a = acts_;
    const std::int64_t B = batch_, D = cfg_.hidden, KV = kv(), C = cca_cfg_.qk_channels(), half = KV / 2;
    const int W0 = cfg_.cca_conv_width, W1 = cfg_.cca_group_conv_width;
    const k::cca::Saved s = k::cca::carve_saved(cca_cfg_, B, T, a.cca_saved);
    k::cca::forward(*gemm_, cca_cfg_, B, T, a.h1, a.positions, rope_->view(), L.cw, s, a.attn_out, stream_);
    dk::copy_rows(lc.k, capacity_ * KV, s.k, T * KV, T * KV, B, sizeof(bf16), stream_);
    dk::copy_rows(lc.v, capacity_ * KV, s.v, T * KV, T * KV, B, sizeof(bf16), stream_);
    dk::tail_rows(s.qk0, B, T, C, W0 - 1, lc.st0, stream_);
    dk::tail_rows(s.c0, B, T + W1 - 1, C, W1 - 1, lc.st1, stream_);
    dk::copy_rows(a.last_x, D, a.h1 + (T - 1) * D, T * D, D, B, sizeof(bf16), stream_);
    k::linear::forward(*gemm_, a.last_x, L.cw.w_v + half * D, lc.prev_v, B, D, half, stream_);
  }

  // CCA of one new token per sequence: ops/cuda/cca.h's forward for the last token, with the
  // conv and value-shift states standing in for the earlier tokens. The cca Saved regions
  // (carved for T = 1) are the scratch.
  void cca_decode(int l) {
    const LayerDev& L = layers_[static_cast<std::size_t>(l)];
    LayerCacheDev& lc = caches_[static_cast<std::size_t>(l)];
    Acts& a = acts_;
    const std::int64_t B = batch_, D = cfg_.hidden, KV = kv(), C = cca_cfg_.qk_channels(), dq = qdim();
    const int nq = cfg_.heads, nkv = cfg_.kv_heads, d = cfg_.head_dim;
    const k::cca::Saved s = k::cca::carve_saved(cca_cfg_, B, 1, a.cca_saved);
    k::linear::forward(*gemm_, a.h1, L.cw.w_qk, s.qk0, B, D, C, stream_);
    dk::cca_depthwise_step(s.qk0, L.cw.conv0_w, L.cw.conv0_b, lc.st0, s.c0, B, C, cfg_.cca_conv_width, stream_);
    dk::cca_grouped_step(s.qk0, s.c0, L.cw.conv1_w, L.cw.conv1_b, L.cw.temp, lc.st1, s.q, s.k, B, nq, nkv, d,
                         cfg_.cca_group_conv_width, cca_cfg_.l2_eps, stream_);
    k::rope::forward(rope_->view(), s.q, a.positions, B, nq, stream_);
    k::rope::forward(rope_->view(), s.k, a.positions, B, nkv, stream_);
    // u = x W_v^T into s.att (free until the attention writes it; KV <= dq).
    k::linear::forward(*gemm_, a.h1, L.cw.w_v, s.att, B, D, KV, stream_);
    dk::copy_rows(lc.k + length_ * KV, capacity_ * KV, s.k, KV, KV, B, sizeof(bf16), stream_);
    dk::cca_value_step(s.att, lc.prev_v, lc.v, B, KV, capacity_, length_, stream_);
    k::decode_attention::forward(s.q, lc.k, lc.v, s.att, static_cast<int>(B), nq, nkv, d, capacity_, length_ + 1,
                                 1.0f / std::sqrt(static_cast<float>(d)), a.dattn_ws, stream_);
    k::linear::forward(*gemm_, s.att, L.cw.w_o, a.attn_out, B, dq, D, stream_);
  }

  // y = mlp(x) (accumulate: y += mlp(x)), fp32 [n, D].
  void mlp(int l, std::int64_t n, const bf16* x, float* y, bool accumulate) {
    const LayerDev& L = layers_[static_cast<std::size_t>(l)];
    Acts& a = acts_;
    const std::int64_t D = cfg_.hidden;
    if (L.moe < 0) {
      const std::int64_t F = cfg_.ffn_hidden;
      k::linear::forward(*gemm_, x, L.w_gate, a.g, n, D, F, stream_);
      k::linear::forward(*gemm_, x, L.w_up, a.u, n, D, F, stream_);
      k::swiglu::forward(a.g, a.u, a.a, n * F, stream_);
      gemm(n, D, F, a.a, L.w_down, y, accumulate ? 1.f : 0.f);
      return;
    }
    float* out = accumulate ? a.y : y;
    const int m = L.moe;
    if (mlp_router_) {
      blocks::cuda::zaya::Shape zs = zshape_;
      zs.tokens = n;
      blocks::cuda::zaya::Acts za;
      za.router = k::zaya_router::carve_saved(zs.router_dims(), a.zsaved);
      za.router.state = a.eda[m % 2];
      za.kept = a.kept, za.kept_idx = a.kept_idx, za.pos = a.zpos, za.count = a.zcount, za.plan_ws = a.plan_ws;
      za.experts = a.msaved;
      const float* prev = m > 0 ? a.eda[(m - 1) % 2] : nullptr;
      blocks::cuda::zaya::moe_forward(*gemm_, zs, L.zw, x, prev, bias_ + std::int64_t(m) * classes_, za, a.zs, out,
                                    stream_);
    } else {
      const int E = cfg_.experts, K = cfg_.top_k;
      k::linear::forward_f32(*gemm_, x, L.router, a.rlogits, n, D, E, stream_);
      k::router::forward(a.rlogits, bias_ + std::int64_t(m) * E, n, E, {K, renormalize_}, a.probs, a.rlse, a.idx,
                         a.gates, a.counts, a.losses, stream_);
      const k::moe::Plan plan = k::moe::make_plan(a.idx, n, K, E, a.plan_ws, stream_);  // syncs
      k::moe::forward(plan, x, a.gates, L.experts, D, cfg_.expert_hidden, a.msaved, out, stream_);
    }
    if (accumulate) blocks::cuda::add_f32(y, a.y, y, n * D, stream_);
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
      dk::copy_rows(a.rl, D, a.r + (T - 1) * D, T * D, D, B, sizeof(float), stream_);
      r = a.rl;
      if (scaled_) {
        dk::copy_rows(a.hl, D, a.h + (T - 1) * D, T * D, D, B, sizeof(float), stream_);
        h = a.hl;
      }
    }
    const float* in = r;
    if (scaled_) {
      const ResScaleDev& F = final_scale_;
      k::residual_scale::merge_forward(r, h, F.r_bias, F.r_scale, F.h_bias, F.h_scale, a.final_r, rows, D, stream_);
      in = a.final_r;
    }
    k::rmsnorm::forward(in, final_norm_, eps(), a.fh, nullptr, rows, D, stream_);
    k::linear::forward_f32(*gemm_, a.fh, lm_head_, a.logits, rows, D, V, stream_);
  }

  model::ModelConfig cfg_;
  bool renormalize_ = true;
  std::string gpu_name_;
  std::vector<int> moe_index_;
  bool any_cca_ = false, any_softmax_ = false, mlp_router_ = false, scaled_ = false;
  int classes_ = 0;
  k::cca::Config cca_cfg_;
  blocks::cuda::zaya::Shape zshape_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<k::GemmRunner> gemm_;
  std::unique_ptr<k::rope::UploadedTable> rope_;

  GrowingDeviceBuffer w16_buf_ = decoder_buffer(), f32_buf_ = decoder_buffer(), bias_buf_ = decoder_buffer(),
      cache_buf_ = decoder_buffer(), act_buf_ = decoder_buffer();
  std::size_t weight_bytes_ = 0;
  bf16* w16_ = nullptr;
  float* bias_ = nullptr;
  const bf16 *embed_ = nullptr, *lm_head_ = nullptr;
  const float* final_norm_ = nullptr;
  ResScaleDev final_scale_;
  std::vector<LayerDev> layers_;

  int batch_ = 0, capacity_ = 0, length_ = 0;
  std::vector<LayerCacheDev> caches_;
  Acts acts_;
  std::int64_t planned_[3] = {-1, -1, -1};
};

}  // namespace

std::unique_ptr<Decoder> make_cuda_decoder(ModelWeights weights) {
  return std::make_unique<CudaDecoder>(std::move(weights));
}

}  // namespace keel::generate
