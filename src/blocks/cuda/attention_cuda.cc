#include "blocks/cuda/attention.h"

#include <cmath>

#include "blocks/weights.h"
#include "ops/cuda/cast.h"
#include "ops/cuda/linear.h"

namespace keel::blocks::cuda {

namespace k = ops::cuda;

namespace {
// CCA's config for this layer: the shape's, with the layer's window.
k::cca::Config layer_cca(const AttnShape& s, const AttnContext& p) {
  k::cca::Config cc = s.cca;
  cc.window = p.window;
  return cc;
}
}  // namespace

void carve(DeviceCarver& c, const AttnShape& s, bool softmax, bool cca, AttnSaved& a) {
  const std::int64_t N = s.tokens(), Q = s.q_dim(), KV = s.kv_dim();
  if (softmax) {
    a.q = c.take<bf16>(N * Q);
    a.k = c.take<bf16>(N * KV);
    a.v = c.take<bf16>(N * KV);
    a.att = c.take<bf16>(N * Q);
    a.lse = c.take<float>(s.batch * s.heads * s.seq);
  }
  if (cca) {
    std::byte* buf = c.take<std::byte>(static_cast<std::int64_t>(k::cca::saved_bytes(s.cca, s.batch, s.seq)));
    if (buf) a.cca = k::cca::carve_saved(s.cca, s.batch, s.seq, buf);
  }
}

void carve(DeviceCarver& c, const AttnShape& s, bool softmax, bool cca, const AttentionCore& core, AttnScratch& sc) {
  const std::int64_t N = s.tokens(), Q = s.q_dim(), KV = s.kv_dim();
  if (softmax) {
    sc.datt = c.take<bf16>(N * Q);
    sc.dq = c.take<bf16>(N * Q);
    sc.dk = c.take<bf16>(N * KV);
    sc.dv = c.take<bf16>(N * KV);
    sc.attn = c.take<std::byte>(static_cast<std::int64_t>(
        core.backward_workspace_bytes(static_cast<int>(s.batch), static_cast<int>(s.seq), s.heads, s.kv_heads, s.head_dim)));
  }
  if (cca) sc.cca = c.take<std::byte>(static_cast<std::int64_t>(k::cca::backward_scratch_bytes(s.cca, s.batch, s.seq)));
}

void attention_forward(k::GemmRunner& gemm, const AttnShape& s, const LayerWeights& w, const bf16* h,
                       const AttnContext& p, const AttnSaved& a, float* add_into, bf16* out, cudaStream_t stream) {
  const std::int64_t N = s.tokens(), D = s.hidden, Q = s.q_dim(), KV = s.kv_dim();
  const bf16* x = p.linear->enter(h, N, D, stream);
  if (w.cca) {
    k::cca::forward(gemm, layer_cca(s, p), s.batch, s.seq, x, p.pos, *p.rope, w.cca_w, a.cca, out, stream);
    p.linear->exit(out, N, D, stream);
    if (add_into) k::add_bf16_to_f32(out, add_into, N * D, stream);
    return;
  }
  k::linear::forward(gemm, x, w.wq, a.q, N, D, Q, stream);
  k::linear::forward(gemm, x, w.wk, a.k, N, D, KV, stream);
  k::linear::forward(gemm, x, w.wv, a.v, N, D, KV, stream);
  k::rope::forward(*p.rope, a.q, p.pos, N, s.heads, stream);
  k::rope::forward(*p.rope, a.k, p.pos, N, s.kv_heads, stream);
  p.core->forward(a.q, a.k, a.v, a.att, a.lse, static_cast<int>(s.batch), static_cast<int>(s.seq), s.heads, s.kv_heads,
                  s.head_dim, s.scale(), p.window, stream);
  if (add_into && p.linear->output_is_whole()) {
    // add_into += att Wo^T: the residual add rides in the GEMM (fp32 C, beta = 1)
    k::GemmDesc d;
    d.m = N, d.n = D, d.k = Q, d.trans_b = true, d.c_type = k::GemmOut::kFp32, d.beta = 1.f;
    gemm.run(d, a.att, w.wo, add_into, stream);
    return;
  }
  k::linear::forward(gemm, a.att, w.wo, out, N, Q, D, stream);
  p.linear->exit(out, N, D, stream);
  if (add_into) k::add_bf16_to_f32(out, add_into, N * D, stream);
}

void attention_backward(k::GemmRunner& gemm, const AttnShape& s, const LayerWeights& w, const LayerGrads& g,
                        const bf16* h, const AttnContext& p, const AttnSaved& a, const AttnScratch& sc, const bf16* dy,
                        bf16* dh, cudaStream_t stream) {
  const std::int64_t N = s.tokens(), D = s.hidden, Q = s.q_dim(), KV = s.kv_dim();
  const bf16* x = p.linear->enter(h, N, D, stream);  // the rows forward's projections read
  const bf16* g_out = p.linear->exit_backward(dy, N, D, stream);
  if (w.cca) {
    k::cca::backward(gemm, layer_cca(s, p), s.batch, s.seq, x, p.pos, *p.rope, w.cca_w, a.cca, g_out, dh, g.cca, sc.cca,
                     stream);
    return;
  }
  k::linear::backward(gemm, a.att, w.wo, g_out, sc.datt, g.wo, N, Q, D, stream);
  p.core->backward(a.q, a.k, a.v, a.att, a.lse, sc.datt, sc.dq, sc.dk, sc.dv, sc.attn, static_cast<int>(s.batch),
                   static_cast<int>(s.seq), s.heads, s.kv_heads, s.head_dim, s.scale(), p.window, stream);
  k::rope::backward(*p.rope, sc.dq, p.pos, N, s.heads, stream);
  k::rope::backward(*p.rope, sc.dk, p.pos, N, s.kv_heads, stream);
  k::linear::backward(gemm, x, w.wq, sc.dq, nullptr, g.wq, N, D, Q, stream);
  k::linear::backward(gemm, x, w.wk, sc.dk, nullptr, g.wk, N, D, KV, stream);
  k::linear::backward(gemm, x, w.wv, sc.dv, nullptr, g.wv, N, D, KV, stream);
  // dh = dq Wq + dk Wk + dv Wv, summed in fp32, then rounded once
  auto dgemm = [&](std::int64_t kk, const bf16* da, const bf16* wt, float beta) {
    k::GemmDesc d;
    d.m = N, d.n = D, d.k = kk, d.c_type = k::GemmOut::kFp32, d.beta = beta;
    gemm.run(d, da, wt, sc.dh, stream);
  };
  dgemm(Q, sc.dq, w.wq, 0.f);
  dgemm(KV, sc.dk, w.wk, 1.f);
  dgemm(KV, sc.dv, w.wv, 1.f);
  p.linear->enter_backward(sc.dh, N, D, stream);
  k::f32_to_bf16(sc.dh, dh, N * D, stream);
}

}  // namespace keel::blocks::cuda
