// `keel bench linattn` on the GPU: CUDA events around the op's launches (command.h).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "bench/linattn/command.h"
#include "bench/timing_cuda.h"
#include "common/error.h"
#include "device/cuda_check.h"
#include "device/cuda_devices.h"
#include "ops/cuda/common.h"
#include "ops/cuda/linear_attention.h"

namespace keel::bench {

namespace la = ops::cuda::linear_attention;
using ops::cuda::bf16;

std::vector<LinattnRow> run_linattn_cuda(const LinattnOptions& o) {
  if (visible_cuda_devices() == 0) throw UsageError("bench linattn: no CUDA device is visible");
  la::Config c;
  c.heads = o.heads, c.kv_heads = o.kv_heads, c.head_dim = o.head_dim, c.chunk = la::kChunk;
  if (o.decay) c.decay = ops::linear_attention::retnet_decay(0, o.kv_heads);
  cudaStream_t s;
  KEEL_CUDA_CHECK(cudaStreamCreate(&s));
  std::vector<LinattnRow> rows;
  for (const std::int64_t T : o.seqs) {
    const std::int64_t N = o.batch * T, Q = std::int64_t(o.heads) * o.head_dim, KV = std::int64_t(o.kv_heads) * o.head_dim;
    const std::string w = "bench linattn";
    DeviceBuffer q(sizeof(bf16) * N * Q, w), k(sizeof(bf16) * N * KV, w), v(sizeof(bf16) * N * KV, w),
        out(sizeof(bf16) * N * Q, w), dout(sizeof(bf16) * N * Q, w), dq(sizeof(bf16) * N * Q, w),
        dk(sizeof(bf16) * N * KV, w), dv(sizeof(bf16) * N * KV, w), ws(la::workspace_bytes(c, o.batch, T), w);
    // q, k scaled so q.k is O(1) per pair (the layer normalizes the outputs anyway)
    const float qk = 1.0f / std::sqrt(static_cast<float>(o.head_dim));
    fill_normal_bf16(q.as<bf16>(), N * Q, qk, 1);
    fill_normal_bf16(k.as<bf16>(), N * KV, qk, 2);
    fill_normal_bf16(v.as<bf16>(), N * KV, 1.f, 3);
    fill_normal_bf16(dout.as<bf16>(), N * Q, 1.f, 4);
    LinattnRow r;
    r.seq = T;
    auto fwd = [&] {
      la::forward(c, o.batch, T, q.as<bf16>(), k.as<bf16>(), v.as<bf16>(), nullptr, out.as<bf16>(), ws.get(), s);
    };
    r.fwd_ms = median_ms(o.warmup, o.iters, s, fwd);
    r.fwd_bwd_ms = median_ms(o.warmup, o.iters, s, [&] {
      fwd();
      la::backward(c, o.batch, T, q.as<bf16>(), k.as<bf16>(), v.as<bf16>(), nullptr, dout.as<bf16>(), nullptr,
                   dq.as<bf16>(), dk.as<bf16>(), dv.as<bf16>(), nullptr, ws.get(), s);
    });
    // docs/size.md: heads x (4 d^2 + 2 d chunk) per token forward; backward twice that
    const double d = o.head_dim;
    const double flops = 3.0 * o.heads * (4 * d * d + 2 * d * std::min<double>(la::kChunk, T)) * static_cast<double>(N);
    r.tflops_fwd_bwd = flops / (r.fwd_bwd_ms * 1e-3) / 1e12;
    rows.push_back(r);
  }
  cudaStreamDestroy(s);
  return rows;
}

}  // namespace keel::bench
