#include "ops/cuda/decode_attention.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"

namespace keel::ops::cuda::decode_attention {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxHeads = 8;       // query heads of one group per block
constexpr int kMaxSplits = 32;     // key splits per (sequence, head)
constexpr int kTargetBlocks = 264; // about two blocks per SM on an H100 (fixed: deterministic)
constexpr std::int64_t kMinKeys = 64;  // keys per split at least

struct Split {
  int splits;
  std::int64_t chunk;
};

Split split_for(int B, int Hq, int Hkv, std::int64_t keys) {
  const int G = Hq / Hkv, hchunks = (G + kMaxHeads - 1) / kMaxHeads;
  const std::int64_t base = static_cast<std::int64_t>(B) * Hkv * hchunks;
  std::int64_t s = std::max<std::int64_t>(1, kTargetBlocks / std::max<std::int64_t>(base, 1));
  s = std::min<std::int64_t>(s, kMaxSplits);
  s = std::min<std::int64_t>(s, (keys + kMinKeys - 1) / kMinKeys);
  s = std::max<std::int64_t>(s, 1);
  const std::int64_t chunk = (keys + s - 1) / s;
  return {static_cast<int>((keys + chunk - 1) / chunk), chunk};
}

// blockIdx.x = (b * Hkv + g) * hchunks + hc, blockIdx.y = key split of the keys first..length-1.
// kE = Dh / 32 channels per lane (lane l holds channels [l kE, (l + 1) kE) of every row).
template <int kE>
__global__ void __launch_bounds__(kThreads) decode_kernel(const bf16* __restrict__ q, const bf16* __restrict__ kc,
                                                          const bf16* __restrict__ vc, bf16* __restrict__ out,
                                                          float* __restrict__ part, int Hq, int Hkv, int hchunks,
                                                          std::int64_t capacity, std::int64_t first,
                                                          std::int64_t length, std::int64_t chunk, int splits,
                                                          float scale) {
  constexpr int Dh = 32 * kE;
  __shared__ float m_s[kWarps][kMaxHeads], l_s[kWarps][kMaxHeads];
  __shared__ float acc_s[kWarps][kMaxHeads][Dh];
  const int G = Hq / Hkv;
  const int hc = blockIdx.x % hchunks, bg = blockIdx.x / hchunks, g = bg % Hkv, b = bg / Hkv;
  const int h0 = g * G + hc * kMaxHeads, nh = min(kMaxHeads, G - hc * kMaxHeads);
  const int split = blockIdx.y;
  const std::int64_t j0 = first + static_cast<std::int64_t>(split) * chunk;
  const std::int64_t j1 = min(length, j0 + chunk);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  float qr[kMaxHeads][kE], acc[kMaxHeads][kE], m[kMaxHeads], l[kMaxHeads];
#pragma unroll
  for (int h = 0; h < kMaxHeads; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      acc[h][e] = 0.f;
      qr[h][e] = h < nh ? __bfloat162float(q[(static_cast<std::int64_t>(b) * Hq + h0 + h) * Dh + lane * kE + e]) : 0.f;
    }
  }
  for (std::int64_t j = j0 + warp; j < j1; j += kWarps) {
    const std::int64_t row = ((static_cast<std::int64_t>(b) * capacity + j) * Hkv + g) * Dh + lane * kE;
    float kf[kE], vf[kE];
#pragma unroll
    for (int e = 0; e < kE; e += 2) {
      const float2 k2 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(kc + row + e));
      const float2 v2 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(vc + row + e));
      kf[e] = k2.x, kf[e + 1] = k2.y, vf[e] = v2.x, vf[e + 1] = v2.y;
    }
#pragma unroll
    for (int h = 0; h < kMaxHeads; ++h) {
      if (h >= nh) break;  // uniform over the block
      float s = 0.f;
#pragma unroll
      for (int e = 0; e < kE; ++e) s += qr[h][e] * kf[e];
      s = warp_sum(s) * scale;
      const float mn = fmaxf(m[h], s);
      const float corr = expf(m[h] - mn), p = expf(s - mn);
      l[h] = l[h] * corr + p;
#pragma unroll
      for (int e = 0; e < kE; ++e) acc[h][e] = acc[h][e] * corr + p * vf[e];
      m[h] = mn;
    }
  }
#pragma unroll
  for (int h = 0; h < kMaxHeads; ++h) {
    if (lane == 0) m_s[warp][h] = m[h], l_s[warp][h] = l[h];
#pragma unroll
    for (int e = 0; e < kE; ++e) acc_s[warp][h][lane * kE + e] = acc[h][e];
  }
  __syncthreads();
  // Merge the warps (a warp that saw no key has m = -inf and contributes 0).
  for (int idx = threadIdx.x; idx < nh * Dh; idx += kThreads) {
    const int h = idx / Dh, c = idx % Dh;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, m_s[w][h]);
    float L = 0.f, A = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      if (m_s[w][h] == -INFINITY) continue;
      const float f = expf(m_s[w][h] - M);
      L += l_s[w][h] * f;
      A += acc_s[w][h][c] * f;
    }
    const std::int64_t bh = static_cast<std::int64_t>(b) * Hq + h0 + h;
    if (splits == 1) {
      out[bh * Dh + c] = __float2bfloat16(A / L);
    } else {
      float* p = part + (bh * splits + split) * (Dh + 2);
      p[c] = A;
      if (c == 0) p[Dh] = M, p[Dh + 1] = L;
    }
  }
}

// One block of Dh threads per (sequence, query head): merges the splits' partials.
__global__ void combine_kernel(const float* __restrict__ part, bf16* __restrict__ out, int splits, int Dh) {
  const std::int64_t bh = blockIdx.x;
  const int c = threadIdx.x;
  const float* p = part + bh * splits * (Dh + 2);
  float M = -INFINITY;
  for (int s = 0; s < splits; ++s) M = fmaxf(M, p[s * (Dh + 2) + Dh]);
  float L = 0.f, A = 0.f;
  for (int s = 0; s < splits; ++s) {
    const float f = expf(p[s * (Dh + 2) + Dh] - M);
    L += p[s * (Dh + 2) + Dh + 1] * f;
    A += p[s * (Dh + 2) + c] * f;
  }
  out[bh * Dh + c] = __float2bfloat16(A / L);
}

void check(int B, int Hq, int Hkv, int Dh) {
  if (Dh != 64 && Dh != 128) fail("decode attention: head_dim {} (supported: 64, 128)", Dh);
  if (B < 0 || Hq <= 0 || Hkv <= 0 || Hq % Hkv)
    fail("decode attention: need B >= 0, Hq, Hkv > 0 and Hq % Hkv == 0 (got B {}, Hq {}, Hkv {})", B, Hq, Hkv);
}

}  // namespace

std::size_t workspace_bytes(int B, int Hq, int Dh) {
  return static_cast<std::size_t>(B) * Hq * kMaxSplits * (Dh + 2) * sizeof(float);
}

int key_splits(int B, int Hq, int Hkv, std::int64_t keys) {
  check(B, Hq, Hkv, 64);
  return split_for(B, Hq, Hkv, std::max<std::int64_t>(keys, 1)).splits;
}

void forward(const bf16* q, const bf16* k_cache, const bf16* v_cache, bf16* out, int B, int Hq, int Hkv, int Dh,
             std::int64_t capacity, std::int64_t length, float scale, int window, void* workspace,
             cudaStream_t stream) {
  check(B, Hq, Hkv, Dh);
  if (length < 1 || length > capacity)
    fail("decode attention: length {} must be in [1, capacity {}]", length, capacity);
  if (window < 0) fail("decode attention: window {} must be >= 0 (0: every cached position)", window);
  if (B == 0) return;
  // The keys the query attends: the last `window` positions, or all of them.
  const std::int64_t first = window > 0 && length > window ? length - window : 0;
  const Split sp = split_for(B, Hq, Hkv, length - first);
  if (sp.splits > 1 && !workspace) fail("decode attention: {} key splits need a workspace", sp.splits);
  const int G = Hq / Hkv, hchunks = (G + kMaxHeads - 1) / kMaxHeads;
  const dim3 grid(static_cast<unsigned>(static_cast<std::int64_t>(B) * Hkv * hchunks), static_cast<unsigned>(sp.splits));
  float* part = static_cast<float*>(workspace);
  if (Dh == 64)
    decode_kernel<2><<<grid, kThreads, 0, stream>>>(q, k_cache, v_cache, out, part, Hq, Hkv, hchunks, capacity, first,
                                                    length, sp.chunk, sp.splits, scale);
  else
    decode_kernel<4><<<grid, kThreads, 0, stream>>>(q, k_cache, v_cache, out, part, Hq, Hkv, hchunks, capacity, first,
                                                    length, sp.chunk, sp.splits, scale);
  KEEL_CUDA_CHECK_LAUNCH();
  if (sp.splits > 1) {
    combine_kernel<<<static_cast<unsigned>(static_cast<std::int64_t>(B) * Hq), Dh, 0, stream>>>(part, out, sp.splits,
                                                                                                Dh);
    KEEL_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace keel::ops::cuda::decode_attention
