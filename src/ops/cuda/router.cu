#include "ops/cuda/router.h"

#include <cmath>

#include "common/error.h"

namespace keel::ops::cuda::router {

namespace {

constexpr int kWarpsPerBlock = 8;  // tokens per block in the row kernels
constexpr int kReduceThreads = 256;

__device__ inline float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The CPU selection order: a higher score wins; equal scores go to the lower index.
__device__ inline bool ranks_before(float sa, int ia, float sb, int ib) { return sa > sb || (sa == sb && ia < ib); }

__global__ void forward_kernel(const float* __restrict__ logits, const float* __restrict__ bias, std::int64_t tokens,
                               int experts, int top_k, bool renormalize, int forced, float* __restrict__ probs,
                               float* __restrict__ lse, std::int32_t* __restrict__ expert_idx,
                               float* __restrict__ gates, std::int32_t* __restrict__ counts) {
  const int lane = threadIdx.x % 32;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= tokens) return;
  const float* l = logits + row * experts;
  float* p = probs + row * experts;
  float m = -INFINITY;
  for (int j = lane; j < experts; j += 32) m = fmaxf(m, l[j]);
  m = warp_max(m);
  float s = 0.f;
  for (int j = lane; j < experts; j += 32) s += expf(l[j] - m);
  s = warp_sum(s);
  const float lz = m + logf(s);
  if (lane == 0) lse[row] = lz;
  // Each lane keeps the probabilities it wrote (re-read below by the same lane only).
  for (int j = lane; j < experts; j += 32) p[j] = expf(l[j] - lz);

  int chosen[kMaxTopK];
  float chosen_p[kMaxTopK];
  for (int k = 0; forced > 0 && k < top_k; ++k) {  // forced balance: the slot's class (the CPU rule)
    chosen[k] = static_cast<int>((row * top_k + k) % forced);
    chosen_p[k] = expf(l[chosen[k]] - lz);  // p[chosen[k]], recomputed (another lane wrote it)
  }
  for (int k = 0; forced == 0 && k < top_k; ++k) {
    // Sentinel index `experts`: any real candidate ranks before it, even at -inf.
    float best_s = -INFINITY, best_p = 0.f;
    int best_i = experts;
    for (int j = lane; j < experts; j += 32) {
      bool taken = false;
      for (int c = 0; c < k; ++c) taken |= chosen[c] == j;
      if (taken) continue;
      const float pj = p[j];
      float sc = pj + (bias ? bias[j] : 0.f);
      if (sc != sc) sc = -INFINITY;  // a NaN score must not leave the sentinel in place
      if (ranks_before(sc, j, best_s, best_i)) best_s = sc, best_i = j, best_p = pj;
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float os = __shfl_xor_sync(0xffffffffu, best_s, o);
      const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
      const float op = __shfl_xor_sync(0xffffffffu, best_p, o);
      if (ranks_before(os, oi, best_s, best_i)) best_s = os, best_i = oi, best_p = op;
    }
    chosen[k] = best_i;
    chosen_p[k] = best_p;
  }
  if (lane == 0) {
    float norm = 1.f;
    if (renormalize) {
      float t = 0.f;
      for (int k = 0; k < top_k; ++k) t += chosen_p[k];
      norm = 1.f / t;
    }
    for (int k = 0; k < top_k; ++k) {
      expert_idx[row * top_k + k] = chosen[k];
      gates[row * top_k + k] = chosen_p[k] * norm;
      atomicAdd(&counts[chosen[k]], 1);
    }
  }
}

// Blocks 0..E-1: P_e = mean_n p[n, e] into losses[2 + e]. Block E: z = mean_n lse^2.
__global__ void column_means_kernel(const float* __restrict__ probs, const float* __restrict__ lse,
                                    std::int64_t tokens, int experts, float* __restrict__ losses) {
  const int e = blockIdx.x;
  float acc = 0.f;
  if (e < experts) {
    for (std::int64_t n = threadIdx.x; n < tokens; n += blockDim.x) acc += probs[n * experts + e];
  } else {
    for (std::int64_t n = threadIdx.x; n < tokens; n += blockDim.x) acc += lse[n] * lse[n];
  }
  acc = block_sum_all<kReduceThreads>(acc);
  if (threadIdx.x == 0) {
    const float mean = tokens > 0 ? acc / static_cast<float>(tokens) : 0.f;
    if (e < experts) losses[2 + e] = mean;
    else losses[1] = mean;
  }
}

// One warp: aux = E * sum_e counts[e] / (N k) * P_e.
__global__ void aux_kernel(const std::int32_t* __restrict__ counts, std::int64_t tokens, int experts, int top_k,
                           float* __restrict__ losses) {
  const double slots = static_cast<double>(tokens) * top_k;
  double acc = 0.0;
  if (slots > 0)
    for (int e = threadIdx.x; e < experts; e += 32) acc += counts[e] / slots * losses[2 + e];
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (threadIdx.x == 0) losses[0] = static_cast<float>(experts * acc);
}

__global__ void backward_kernel(const float* __restrict__ probs, const float* __restrict__ lse,
                                const std::int32_t* __restrict__ expert_idx, const float* __restrict__ gates,
                                const std::int32_t* __restrict__ counts, std::int64_t tokens, int experts, int top_k,
                                bool renormalize, const float* __restrict__ dgates, float d_aux, float d_z,
                                float* __restrict__ dlogits) {
  const int lane = threadIdx.x % 32;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= tokens) return;
  const float* p = probs + row * experts;
  const std::int32_t* idx = expert_idx + row * top_k;
  // d aux / d p[n, e] = d_aux * E * f_e / N, the same for every token.
  const float aux_scale = static_cast<float>(d_aux * double(experts) / (double(tokens) * top_k) / double(tokens));
  const float zscale = static_cast<float>(2.0 * d_z / double(tokens));
  // Renormalized gates: dp[e_j] += (dg_j - dot) / sel.
  float sel = 0.f, dot = 0.f;
  if (dgates && renormalize) {
    for (int k = 0; k < top_k; ++k) {
      sel += p[idx[k]];
      dot += dgates[row * top_k + k] * gates[row * top_k + k];
    }
  }
  auto dp_of = [&](int j) {
    float dp = aux_scale * static_cast<float>(counts[j]);
    if (dgates) {
      for (int k = 0; k < top_k; ++k)
        if (idx[k] == j) {
          const float dg = dgates[row * top_k + k];
          dp += renormalize ? (dg - dot) / sel : dg;
        }
    }
    return dp;
  };
  float pdp = 0.f;
  for (int j = lane; j < experts; j += 32) pdp += p[j] * dp_of(j);
  pdp = warp_sum(pdp);
  const float zl = zscale * lse[row];
  float* dl = dlogits + row * experts;
  for (int j = lane; j < experts; j += 32) dl[j] = p[j] * (dp_of(j) - pdp) + zl * p[j];
}

void check_common(std::int64_t tokens, int experts, const Options& o) {
  if (tokens < 0) fail("cuda router: tokens must be >= 0, got {}", tokens);
  if (experts < 1) fail("cuda router: need at least one expert, got {}", experts);
  if (o.top_k < 1 || o.top_k > experts || o.top_k > kMaxTopK)
    fail("cuda router: top_k {} must be in [1, {}]", o.top_k, experts < kMaxTopK ? experts : kMaxTopK);
  if (o.forced_classes < 0 || o.forced_classes > experts || (o.forced_classes > 0 && o.top_k > o.forced_classes))
    fail("cuda router: forced_classes {} must be 0 or in [top_k {}, {} experts]", o.forced_classes, o.top_k, experts);
  if (tokens * o.top_k > INT32_MAX) fail("cuda router: {} tokens x top_k {} overflow the int32 slot index", tokens, o.top_k);
}

}  // namespace

void forward(const float* logits, const float* bias, std::int64_t tokens, int experts, const Options& o, float* probs,
             float* lse, std::int32_t* expert_idx, float* gates, std::int32_t* counts, float* losses,
             cudaStream_t stream) {
  check_common(tokens, experts, o);
  if (!counts || !losses) fail("cuda router: counts and losses must not be null");
  KEEL_CUDA_CHECK(cudaMemsetAsync(counts, 0, sizeof(std::int32_t) * experts, stream));
  if (tokens > 0) {
    if (!logits || !probs || !lse || !expert_idx || !gates) fail("cuda router: a forward pointer is null");
    forward_kernel<<<grid_for(tokens, kWarpsPerBlock), kWarpsPerBlock * 32, 0, stream>>>(
        logits, bias, tokens, experts, o.top_k, o.renormalize, o.forced_classes, probs, lse, expert_idx, gates, counts);
    KEEL_CUDA_CHECK_LAUNCH();
  }
  column_means_kernel<<<experts + 1, kReduceThreads, 0, stream>>>(probs, lse, tokens, experts, losses);
  KEEL_CUDA_CHECK_LAUNCH();
  aux_kernel<<<1, 32, 0, stream>>>(counts, tokens, experts, o.top_k, losses);
  KEEL_CUDA_CHECK_LAUNCH();
}

void backward(const float* probs, const float* lse, const std::int32_t* expert_idx, const float* gates,
              const std::int32_t* counts, std::int64_t tokens, int experts, const Options& o, const float* dgates,
              float d_aux, float d_z, float* dlogits, cudaStream_t stream) {
  check_common(tokens, experts, o);
  if (tokens == 0) return;
  if (!probs || !lse || !expert_idx || !gates || !counts || !dlogits) fail("cuda router: a backward pointer is null");
  backward_kernel<<<grid_for(tokens, kWarpsPerBlock), kWarpsPerBlock * 32, 0, stream>>>(
      probs, lse, expert_idx, gates, counts, tokens, experts, o.top_k, o.renormalize, dgates, d_aux, d_z, dlogits);
  KEEL_CUDA_CHECK_LAUNCH();
}

Losses read_losses(const float* losses, cudaStream_t stream) {
  float h[2];
  KEEL_CUDA_CHECK(cudaMemcpyAsync(h, losses, sizeof(h), cudaMemcpyDeviceToHost, stream));
  KEEL_CUDA_CHECK(keel::stream_sync(stream));
  return Losses{h[0], h[1]};
}

}  // namespace keel::ops::cuda::router
