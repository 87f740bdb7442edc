// `keel bench kernels` on the GPU: CUDA events around each kernel's launches (command.h).
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "bench/kernels/command.h"
#include "bench/timing_cuda.h"
#include "common/error.h"
#include "device/cuda_check.h"
#include "device/cuda_devices.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/common.h"
#include "ops/cuda/cross_entropy.h"
#include "ops/cuda/moe.h"

namespace keel::bench {

using ops::cuda::bf16;

namespace {

const std::string kWhat = "bench kernels";

DeviceBuffer bf16_normal(std::int64_t n, float scale, std::uint32_t seed) {
  DeviceBuffer b(sizeof(bf16) * n, kWhat);
  fill_normal_bf16(b.as<bf16>(), n, scale, seed);
  return b;
}

KernelsRow attention_row(const KernelsOptions& o, const std::string& heads, cudaStream_t s) {
  namespace att = ops::cuda::attention;
  int hq = 0, hkv = 0;
  std::sscanf(heads.c_str(), "%d:%d", &hq, &hkv);
  const int B = o.batch, T = o.seq, D = o.head_dim;
  const std::int64_t nq = std::int64_t(B) * T * hq * D, nkv = std::int64_t(B) * T * hkv * D;
  DeviceBuffer q = bf16_normal(nq, 1.f, 11), k = bf16_normal(nkv, 1.f, 12), v = bf16_normal(nkv, 1.f, 13),
               dout = bf16_normal(nq, 1.f, 14);
  DeviceBuffer out(sizeof(bf16) * nq, kWhat), lse(sizeof(float) * B * hq * T, kWhat), dq(sizeof(bf16) * nq, kWhat),
      dk(sizeof(bf16) * nkv, kWhat), dv(sizeof(bf16) * nkv, kWhat),
      ws(att::backward_workspace_bytes(B, T, hq, hkv, D), kWhat);
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  KernelsRow r;
  r.kernel = "attention";
  r.shape = fmt::format("B {} T {} heads {}/{} of {}, causal", B, T, hq, hkv, D);
  auto fwd = [&] {
    att::forward(q.as<bf16>(), k.as<bf16>(), v.as<bf16>(), out.as<bf16>(), lse.as<float>(), B, T, hq, hkv, D, scale, 0,
                 s);
  };
  r.fwd_ms = median_ms(o.warmup, o.iters, s, fwd);
  r.bwd_ms = median_ms(o.warmup, o.iters, s, [&] {
    att::backward(q.as<bf16>(), k.as<bf16>(), v.as<bf16>(), out.as<bf16>(), lse.as<float>(), dout.as<bf16>(),
                  dq.as<bf16>(), dk.as<bf16>(), dv.as<bf16>(), ws.get(), B, T, hq, hkv, D, scale, 0, s);
  });
  // QK^T and PV over the causal half (T (T + 1) / 2 pairs); backward 2.5x (FlashAttention's count)
  r.fwd_flop = 4.0 * B * hq * D * (double(T) * (T + 1) / 2);
  r.bwd_flop = 2.5 * r.fwd_flop;
  return r;
}

KernelsRow experts_row(const KernelsOptions& o, cudaStream_t s) {
  namespace moe = ops::cuda::moe;
  const std::int64_t S = o.tokens, D = o.dim, F = o.ffn;
  const int E = o.experts;
  std::vector<std::int64_t> offsets(E + 1);
  for (int e = 0; e <= E; ++e) offsets[e] = S / E * e;
  const float wscale = 1.f / std::sqrt(static_cast<float>(D));
  DeviceBuffer wg = bf16_normal(E * F * D, wscale, 21), wu = bf16_normal(E * F * D, wscale, 22),
               wd = bf16_normal(E * D * F, 1.f / std::sqrt(static_cast<float>(F)), 23), xs = bf16_normal(S * D, 1.f, 24),
               dys = bf16_normal(S * D, 1.f, 25);
  DeviceBuffer hg(sizeof(bf16) * S * F, kWhat), hu(sizeof(bf16) * S * F, kWhat), act(sizeof(bf16) * S * F, kWhat),
      ys(sizeof(bf16) * S * D, kWhat), dxs(sizeof(float) * S * D, kWhat), dwg(sizeof(float) * E * F * D, kWhat),
      dwu(sizeof(float) * E * F * D, kWhat), dwd(sizeof(float) * E * D * F, kWhat),
      scratch(moe::experts_backward_scratch_bytes(S, F), kWhat);
  const moe::Weights w{wg.as<bf16>(), wu.as<bf16>(), wd.as<bf16>()};
  const moe::Saved sv{xs.as<bf16>(), hg.as<bf16>(), hu.as<bf16>(), act.as<bf16>(), ys.as<bf16>()};
  // a step's first micro-batch: the weight gradients written, not added (moe::Grads::overwrite)
  const moe::Grads dw{dwg.as<float>(), dwu.as<float>(), dwd.as<float>(), true};
  KernelsRow r;
  r.kernel = "experts";
  r.shape = fmt::format("{} tokens, {} experts of {} -> {} -> {}, top-1, balanced", S, E, D, F, D);
  r.fwd_ms = median_ms(o.warmup, o.iters, s, [&] { moe::experts_forward(offsets, w, D, F, sv, s); });
  r.bwd_ms = median_ms(o.warmup, o.iters, s, [&] {
    moe::experts_backward(offsets, w, D, F, sv, dys.as<bf16>(), scratch.get(), dxs.as<float>(), dw, s);
  });
  r.fwd_flop = 2.0 * S * D * F * 3;  // gate, up, down
  r.bwd_flop = 2 * r.fwd_flop;       // activation and weight gradients
  return r;
}

KernelsRow ce_row(const KernelsOptions& o, bool keep_logits, cudaStream_t s) {
  namespace ce = ops::cuda::cross_entropy;
  const std::int64_t N = o.tokens, D = o.dim, V = o.vocab;
  ce::Options opt;
  opt.keep_logits = keep_logits;
  opt.overwrite_dw = true;  // a step's first micro-batch (docs/gpu_training.md)
  DeviceBuffer h = bf16_normal(N * D, 1.f, 31), w = bf16_normal(V * D, 0.02f, 32);
  std::vector<std::int32_t> host_t(N);
  std::mt19937 rng(33);
  for (auto& t : host_t) t = static_cast<std::int32_t>(rng() % V);
  DeviceBuffer t(sizeof(std::int32_t) * N, kWhat), lse(sizeof(float) * N, kWhat), res(sizeof(ce::Result), kWhat),
      scratch(ce::scratch_bytes(N, D, V, opt), kWhat), dh(sizeof(bf16) * N * D, kWhat), dw(sizeof(float) * V * D, kWhat);
  KEEL_CUDA_CHECK(cudaMemcpy(t.get(), host_t.data(), sizeof(std::int32_t) * N, cudaMemcpyHostToDevice));
  auto fwd = [&] {
    ce::forward(h.as<bf16>(), w.as<bf16>(), t.as<std::int32_t>(), N, D, V, opt, lse.as<float>(), res.as<ce::Result>(),
                scratch.get(), s);
  };
  KernelsRow r;
  r.kernel = "ce";
  r.shape = fmt::format("{} tokens, {} -> {} vocab, {}", N, D, V, keep_logits ? "bf16 logits kept" : "chunked");
  r.fwd_ms = median_ms(o.warmup, o.iters, s, fwd);
  // backward turns kept logits into their gradient in place: each timed backward gets a fresh forward
  auto bwd = [&] {
    ce::backward(h.as<bf16>(), w.as<bf16>(), t.as<std::int32_t>(), lse.as<float>(), 1.f, N, D, V, opt, scratch.get(),
                 dh.as<bf16>(), dw.as<float>(), s);
  };
  r.bwd_ms = keep_logits ? median_ms(o.warmup, o.iters, s, bwd, fwd) : median_ms(o.warmup, o.iters, s, bwd);
  const ce::Result got = ce::read_result(res.as<ce::Result>(), s);
  if (!std::isfinite(got.loss) || got.valid != N)
    throw Error(fmt::format("bench kernels: the cross-entropy came out {} over {} rows", got.loss, got.valid));
  r.fwd_flop = 2.0 * N * D * V;  // the logits
  r.bwd_flop = 2 * r.fwd_flop;   // dhidden and dW (the chunked pass's recomputed logits not counted)
  return r;
}

}  // namespace

std::vector<KernelsRow> run_kernels_cuda(const KernelsOptions& o) {
  if (visible_cuda_devices() == 0) throw UsageError("bench kernels: no CUDA device is visible");
  cudaStream_t s;
  KEEL_CUDA_CHECK(cudaStreamCreate(&s));
  std::vector<KernelsRow> rows;
  for (const std::string& what : o.what) {
    if (what == "attention")
      for (const std::string& h : o.heads) rows.push_back(attention_row(o, h, s));
    if (what == "experts") rows.push_back(experts_row(o, s));
    if (what == "ce") {
      rows.push_back(ce_row(o, true, s));
      rows.push_back(ce_row(o, false, s));
    }
  }
  KEEL_CUDA_CHECK(cudaStreamSynchronize(s));
  cudaStreamDestroy(s);
  return rows;
}

}  // namespace keel::bench
