#include "blocks/cuda/attention_decode.h"

#include "blocks/cuda/decode_kernels.h"
#include "device/cuda_check.h"
#include "ops/cuda/cast.h"
#include "ops/cuda/decode_attention.h"
#include "ops/cuda/linear.h"
#include "ops/cuda/linear_attention.h"

namespace keel::blocks::cuda {

namespace k = ops::cuda;

namespace {

// The output projection of the attention of n rows: added into add_into in the GEMM (fp32 C,
// beta = 1), or written to out (bf16).
void out_projection(k::GemmRunner& gemm, const AttnShape& s, const bf16* wo, const bf16* att, std::int64_t n,
                    float* add_into, bf16* out, cudaStream_t stream) {
  const std::int64_t D = s.hidden, Q = s.q_dim();
  if (add_into) {
    k::GemmDesc d;
    d.m = n, d.n = D, d.k = Q, d.trans_b = true, d.c_type = k::GemmOut::kFp32, d.beta = 1.f;
    gemm.run(d, att, wo, add_into, stream);
  } else {
    k::linear::forward(gemm, att, wo, out, n, Q, D, stream);
  }
}

// mha/gqa of one new token per sequence at position `length`.
void mha_decode(k::GemmRunner& gemm, const AttnShape& s, const LayerWeights& w, const bf16* h, const std::int32_t* pos,
                const k::rope::DeviceTable& rope, int window, std::int64_t capacity, std::int64_t length,
                const LayerCache& lc, const AttnSaved& a, const CacheScratch& sc, float* add_into, bf16* out,
                cudaStream_t stream) {
  const std::int64_t B = s.batch, D = s.hidden, Q = s.q_dim(), KV = s.kv_dim();
  k::linear::forward(gemm, h, w.wq, a.q, B, D, Q, stream);
  k::linear::forward(gemm, h, w.wk, a.k, B, D, KV, stream);
  k::linear::forward(gemm, h, w.wv, a.v, B, D, KV, stream);
  k::rope::forward(rope, a.q, pos, B, s.heads, stream);
  k::rope::forward(rope, a.k, pos, B, s.kv_heads, stream);
  copy_rows(lc.k + length * KV, capacity * KV, a.k, KV, KV, B, sizeof(bf16), stream);
  copy_rows(lc.v + length * KV, capacity * KV, a.v, KV, KV, B, sizeof(bf16), stream);
  k::decode_attention::forward(a.q, lc.k, lc.v, a.att, static_cast<int>(B), s.heads, s.kv_heads, s.head_dim, capacity,
                               length + 1, s.scale(), window, sc.attn_ws, stream);
  out_projection(gemm, s, w.wo, a.att, B, add_into, out, stream);
}

// CCA of one new token per sequence: ops/cuda/cca.h's forward for the last token, with the conv
// and value-shift states standing in for the earlier tokens. The cca Saved regions (carved for
// T = 1) are the scratch.
void cca_decode(k::GemmRunner& gemm, const AttnShape& s, const LayerWeights& w, const bf16* h, const std::int32_t* pos,
                const k::rope::DeviceTable& rope, int window, std::int64_t capacity, std::int64_t length,
                const LayerCache& lc, const AttnSaved& a, const CacheScratch& sc, float* add_into, bf16* out,
                cudaStream_t stream) {
  const std::int64_t B = s.batch, D = s.hidden, KV = s.kv_dim(), C = s.cca.qk_channels(), dq = s.q_dim();
  const int nq = s.heads, nkv = s.kv_heads, d = s.head_dim;
  const k::cca::Saved& c = a.cca;
  const k::cca::Weights& cw = w.cca_w;
  k::linear::forward(gemm, h, cw.w_qk, c.qk0, B, D, C, stream);
  cca_depthwise_step(c.qk0, cw.conv0_w, cw.conv0_b, lc.st0, c.c0, B, C, s.cca.conv0_width, stream);
  cca_grouped_step(c.qk0, c.c0, cw.conv1_w, cw.conv1_b, cw.temp, lc.st1, c.q, c.k, B, nq, nkv, d, s.cca.conv1_width,
                   s.cca.l2_eps, stream);
  k::rope::forward(rope, c.q, pos, B, nq, stream);
  k::rope::forward(rope, c.k, pos, B, nkv, stream);
  // u = x W_v^T into c.att (free until the attention writes it; KV <= dq).
  k::linear::forward(gemm, h, cw.w_v, c.att, B, D, KV, stream);
  copy_rows(lc.k + length * KV, capacity * KV, c.k, KV, KV, B, sizeof(bf16), stream);
  cca_value_step(c.att, lc.prev_v, lc.v, B, KV, capacity, length, stream);
  k::decode_attention::forward(c.q, lc.k, lc.v, c.att, static_cast<int>(B), nq, nkv, d, capacity, length + 1,
                               s.scale(), window, sc.attn_ws, stream);
  k::linear::forward(gemm, c.att, cw.w_o, out, B, dq, D, stream);
  if (add_into) k::add_bf16_to_f32(out, add_into, B * D, stream);
}

// Linear attention of one new token per sequence: the state advanced by it, the output
// normalized per head, the output projection (blocks/attention_decode.cc's linear_decode).
void linear_decode(k::GemmRunner& gemm, const AttnShape& s, const LayerWeights& w, const bf16* h, const LayerCache& lc,
                   const AttnSaved& a, float* add_into, bf16* out, cudaStream_t stream) {
  namespace la = k::linear_attention;
  const std::int64_t B = s.batch, D = s.hidden, Q = s.q_dim(), KV = s.kv_dim();
  k::linear::forward(gemm, h, w.wq, a.q, B, D, Q, stream);
  k::linear::forward(gemm, h, w.wk, a.k, B, D, KV, stream);
  k::linear::forward(gemm, h, w.wv, a.v, B, D, KV, stream);
  la::feature_forward(s.feature, a.q, a.q, B * Q, stream);
  la::feature_forward(s.feature, a.k, a.k, B * KV, stream);
  la::step(s.linear, B, a.q, a.k, a.v, lc.state, a.att, stream);
  la::norm_forward(a.att, B * s.heads, s.head_dim, s.eps, a.att, a.rstd, stream);
  out_projection(gemm, s, w.wo, a.att, B, add_into, out, stream);
}

}  // namespace

void carve(DeviceCarver& c, const AttnShape& s, const LayerWeights& w, std::int64_t capacity, LayerCache& lc) {
  const std::int64_t B = s.batch, KV = s.kv_dim(), C = s.cca.qk_channels();
  const bool cca = w.cca;
  lc = LayerCache{};
  if (w.linear) {
    lc.state = c.take<float>(B * KV * s.head_dim);
    return;
  }
  lc.k = c.take<bf16>(B * capacity * KV);
  lc.v = c.take<bf16>(B * capacity * KV);
  if (cca) {
    lc.st0 = c.take<bf16>(B * (s.cca.conv0_width - 1) * C);
    lc.st1 = c.take<bf16>(B * (s.cca.conv1_width - 1) * C);
    lc.prev_v = c.take<bf16>(B * KV / 2);
  }
}

void reset_cache(const AttnShape& s, const LayerWeights& w, const LayerCache& lc, cudaStream_t stream) {
  if (w.linear)
    KEEL_CUDA_CHECK(cudaMemsetAsync(lc.state, 0, sizeof(float) * s.batch * s.kv_dim() * s.head_dim, stream));
  if (!w.cca) return;
  const std::int64_t B = s.batch, KV = s.kv_dim(), C = s.cca.qk_channels();
  const std::int64_t W0 = s.cca.conv0_width, W1 = s.cca.conv1_width;
  if (W0 > 1) KEEL_CUDA_CHECK(cudaMemsetAsync(lc.st0, 0, B * (W0 - 1) * C * sizeof(bf16), stream));
  broadcast_row(w.cca_w.conv0_b, C, B * (W1 - 1), lc.st1, stream);
  KEEL_CUDA_CHECK(cudaMemsetAsync(lc.prev_v, 0, B * KV / 2 * sizeof(bf16), stream));
}

void carve(DeviceCarver& c, const AttnShape& s, AttnKinds kinds, CacheScratch& sc) {
  if (kinds.cca) sc.last_x = c.take<bf16>(s.batch * s.hidden);
  if (kinds.linear)
    sc.linear_ws = c.take<std::byte>(
        static_cast<std::int64_t>(k::linear_attention::workspace_bytes(s.linear, s.batch, s.seq)));
  sc.attn_ws = c.take<std::byte>(static_cast<std::int64_t>(
      k::decode_attention::workspace_bytes(static_cast<int>(s.batch), s.heads, s.head_dim)));
}

void fill_cache(k::GemmRunner& gemm, const AttnShape& s, const LayerWeights& w, const bf16* h, const AttnSaved& a,
                std::int64_t capacity, const LayerCache& lc, const CacheScratch& sc, cudaStream_t stream) {
  const std::int64_t B = s.batch, T = s.seq, D = s.hidden, KV = s.kv_dim();
  if (w.linear) {  // the prompt's state (forward's k, v are feature-mapped)
    k::linear_attention::local_states(s.linear, B, T, a.k, a.v, lc.state, stream);
    return;
  }
  if (!w.cca) {
    copy_rows(lc.k, capacity * KV, a.k, T * KV, T * KV, B, sizeof(bf16), stream);
    copy_rows(lc.v, capacity * KV, a.v, T * KV, T * KV, B, sizeof(bf16), stream);
    return;
  }
  const std::int64_t C = s.cca.qk_channels(), half = KV / 2;
  const int W0 = s.cca.conv0_width, W1 = s.cca.conv1_width;
  const k::cca::Saved& c = a.cca;
  copy_rows(lc.k, capacity * KV, c.k, T * KV, T * KV, B, sizeof(bf16), stream);
  copy_rows(lc.v, capacity * KV, c.v, T * KV, T * KV, B, sizeof(bf16), stream);
  tail_rows(c.qk0, B, T, C, W0 - 1, lc.st0, stream);
  tail_rows(c.c0, B, T + W1 - 1, C, W1 - 1, lc.st1, stream);
  copy_rows(sc.last_x, D, h + (T - 1) * D, T * D, D, B, sizeof(bf16), stream);
  k::linear::forward(gemm, sc.last_x, w.cca_w.w_v + half * D, lc.prev_v, B, D, half, stream);
}

void attention_decode(k::GemmRunner& gemm, const AttnShape& s, const LayerWeights& w, const bf16* h,
                      const std::int32_t* pos, const k::rope::DeviceTable& rope, int window, std::int64_t capacity,
                      std::int64_t length, const LayerCache& lc, const AttnSaved& a, const CacheScratch& sc,
                      float* add_into, bf16* out, cudaStream_t stream) {
  if (w.linear)
    linear_decode(gemm, s, w, h, lc, a, add_into, out, stream);
  else if (w.cca)
    cca_decode(gemm, s, w, h, pos, rope, window, capacity, length, lc, a, sc, add_into, out, stream);
  else
    mha_decode(gemm, s, w, h, pos, rope, window, capacity, length, lc, a, sc, add_into, out, stream);
}

}  // namespace keel::blocks::cuda
