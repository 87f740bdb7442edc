#include "ops/cuda/cca.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/causal_conv.h"
#include "ops/cuda/linear.h"
#include "ops/cuda/sequence_split.h"

namespace keel::ops::cuda::cca {

namespace {

constexpr int kThreads = 256;
constexpr int kTokenThreads = 128;  // one block per token in the per-token kernels (4 warps)
constexpr std::size_t kAlign = 256;
constexpr std::int64_t kMaxChannels = 12288;  // C fp32 values of one token in shared memory (48 KiB)

std::size_t round_up(std::size_t b) { return (b + kAlign - 1) / kAlign * kAlign; }

// Per token (one block): a = conv + mixing terms (written over qk, saved), then per head
// rn = (|a|^2 + eps)^-1/2 and q = sqrt(d) rn a, k = temp sqrt(d) rn a in bf16.
__global__ void mix_norm_kernel(const bf16* __restrict__ qk0, float* __restrict__ qk, const float* __restrict__ temp,
                                float* __restrict__ rnorm, bf16* __restrict__ q, bf16* __restrict__ k, int nq,
                                int nkv, int d, float l2_eps, float sqrt_d) {
  extern __shared__ float a_s[];
  const std::int64_t n = blockIdx.x;
  const int G = nq / nkv, dq = nq * d, dk = nkv * d, C = dq + dk;
  const bf16* a0 = qk0 + n * C;
  float* a = qk + n * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float v = a[c];
    if (c < dq) {
      const int h = c / d, i = c % d, g = h / G;
      v += 0.5f * (__bfloat162float(a0[c]) + __bfloat162float(a0[dq + g * d + i]));
    } else {
      const int g = (c - dq) / d, i = (c - dq) % d;
      float mean_q = 0.f;
      for (int j = 0; j < G; ++j) mean_q += __bfloat162float(a0[(g * G + j) * d + i]);
      v += 0.5f * (mean_q / static_cast<float>(G)) + 0.5f * __bfloat162float(a0[c]);
    }
    a[c] = v;
    a_s[c] = v;
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int h = warp; h < nq + nkv; h += warps) {
    const float* ah = a_s + h * d;
    float ss = 0.f;
    for (int i = lane; i < d; i += 32) ss += ah[i] * ah[i];
    ss = warp_sum(ss);
    const float rn = 1.f / sqrtf(ss + l2_eps);
    if (lane == 0) rnorm[n * (nq + nkv) + h] = rn;
    const float scale = h < nq ? sqrt_d * rn : temp[h - nq] * sqrt_d * rn;
    bf16* out = h < nq ? q + n * dq + h * d : k + n * dk + (h - nq) * d;
    for (int i = lane; i < d; i += 32) out[i] = __float2bfloat16(ah[i] * scale);
  }
}

// Backward of the normalization, per token: g = dq / dk (after the inverse RoPE), c = sqrt(d)
// (times temp for k): da = c (rn g - a rn^3 (a.g)) into dqk (fp32, overwritten), and the
// per-token temperature partial sqrt(d) rn (a.g) into tpart [N, nkv].
__global__ void norm_backward_kernel(const float* __restrict__ qk, const float* __restrict__ rnorm,
                                     const float* __restrict__ temp, const bf16* __restrict__ dq,
                                     const bf16* __restrict__ dk, float* __restrict__ dqk, float* __restrict__ tpart,
                                     int nq, int nkv, int d, float sqrt_d) {
  const std::int64_t n = blockIdx.x;
  const int dqw = nq * d, dkw = nkv * d, C = dqw + dkw;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int h = warp; h < nq + nkv; h += warps) {
    const float* ah = qk + n * C + h * d;
    const bf16* gh = h < nq ? dq + n * dqw + h * d : dk + n * dkw + (h - nq) * d;
    const float rn = rnorm[n * (nq + nkv) + h];
    float ag = 0.f;
    for (int i = lane; i < d; i += 32) ag += ah[i] * __bfloat162float(gh[i]);
    ag = warp_sum(ag);
    const float cc = h < nq ? sqrt_d : sqrt_d * temp[h - nq];
    const float r3ag = rn * rn * rn * ag;
    float* out = dqk + n * C + h * d;
    for (int i = lane; i < d; i += 32) out[i] = cc * (rn * __bfloat162float(gh[i]) - ah[i] * r3ag);
    if (h >= nq && lane == 0) tpart[n * nkv + (h - nq)] = sqrt_d * rn * ag;
  }
}

// dtemp[g] += sum_n tpart[n, g]: one block per kv head, fixed order (deterministic).
__global__ void temp_reduce_kernel(const float* __restrict__ tpart, float* __restrict__ dtemp, std::int64_t N,
                                   int nkv) {
  __shared__ float part[kThreads / 32];
  const int g = blockIdx.x;
  float acc = 0.f;
  for (std::int64_t n = threadIdx.x; n < N; n += blockDim.x) acc += tpart[n * nkv + g];
  acc = warp_sum(acc);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) s += part[w];
    dtemp[g] += s;
  }
}

// Per token (one block): the depthwise conv's dx from dc0 (as causal_conv's depthwise_dx_kernel,
// with To = T + extra rows per sequence of dc0) plus the mixing terms' direct path, written as
// bf16 for the W_qk GEMMs: dq0[h] += dA_q[h]/2 + dA_k[h/G]/(2G);  dk0[g] += sum_j dA_q[gG+j]/2 +
// dA_k[g]/2. One pass instead of an fp32 dx written and read back. With a split, T is a run's
// L tokens and dtails [runs, F] (not null) adds, in fp32 before the rounding, the next run's
// gradient of this run's last hh rows (dtails' first hh * C floats).
__global__ void conv_dx_mix_backward_kernel(const float* __restrict__ dqk, const float* __restrict__ dc0,
                                            const float* __restrict__ w0, bf16* __restrict__ dqk0, std::int64_t T,
                                            int extra, int W0, int nq, int nkv, int d, const float* __restrict__ dtails,
                                            std::int64_t F, std::int64_t hh) {
  const int G = nq / nkv, dq = nq * d, C = dq + nkv * d;
  const std::int64_t n = blockIdx.x, bi = n / T, s = n % T, To = T + extra;
  const float* ga = dqk + n * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float v = 0.f;
    for (int k = 0; k < W0; ++k) {
      const std::int64_t j = s + (W0 - 1) - k + extra;  // the dc0 row fed by this token through tap k
      if (j < To) v += w0[c * W0 + k] * dc0[(bi * To + j) * C + c];
    }
    if (c < dq) {
      const int h = c / d, i = c % d, g = h / G;
      v += 0.5f * ga[c] + 0.5f * ga[dq + g * d + i] / static_cast<float>(G);
    } else {
      const int g = (c - dq) / d, i = (c - dq) % d;
      float sum_q = 0.f;
      for (int j = 0; j < G; ++j) sum_q += ga[(g * G + j) * d + i];
      v += 0.5f * sum_q + 0.5f * ga[c];
    }
    if (dtails && s >= T - hh) v += dtails[bi * F + (s - (T - hh)) * C + c];
    dqk0[n * C + c] = __float2bfloat16(v);
  }
}

// v[n] = [u[n, :half] | u[n-1, half:]] with zeros at t = 0 of each sequence (u [N, 2 half]).
// v[n] = u[n] outside the shifted columns [lo, hi), u[n-1] inside them (zeros at t = 0): the
// previous token's projection (Config::shift_begin / shift_end; the whole model's second half).
// T: tokens per sequence, or per run with a split, whose halo (not null: halos [runs, F], the
// u row at column offset hoff) stands in for the zeros at a run's first token.
__global__ void value_shift_kernel(const bf16* __restrict__ u, bf16* __restrict__ v, std::int64_t N, std::int64_t T,
                                   std::int64_t width, std::int64_t lo, std::int64_t hi,
                                   const bf16* __restrict__ halo, std::int64_t F, std::int64_t hoff) {
  const std::int64_t total = N * width;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t n = e / width, col = e % width;
    if (col < lo || col >= hi)
      v[e] = u[e];
    else
      v[e] = n % T != 0 ? u[e - width] : halo ? halo[(n / T) * F + hoff + (col - lo)] : __float2bfloat16(0.f);
  }
}

// The transpose: du[n] = dv[n] outside [lo, hi), dv[n+1] inside (zeros at t = T-1; with a split,
// T a run's tokens and dtails not null: the next run's gradient of this run's last u row,
// dtails [runs, F] at column offset toff).
__global__ void value_unshift_kernel(const bf16* __restrict__ dv, bf16* __restrict__ du, std::int64_t N,
                                     std::int64_t T, std::int64_t width, std::int64_t lo, std::int64_t hi,
                                     const float* __restrict__ dtails, std::int64_t F, std::int64_t toff) {
  const std::int64_t total = N * width;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t n = e / width, col = e % width;
    if (col < lo || col >= hi)
      du[e] = dv[e];
    else
      du[e] = n % T != T - 1          ? dv[e + width]
              : dtails ? __float2bfloat16(dtails[(n / T) * F + toff + (col - lo)])
                       : __float2bfloat16(0.f);
  }
}

// Each run's tail, tails [R, F] bf16: its last hh rows of qk0 [N, C], then its last row's shifted
// columns [lo, lo + F - hh C) of u [N, dk] (runs of L tokens).
__global__ void pack_tails_kernel(const bf16* __restrict__ qk0, const bf16* __restrict__ u, bf16* __restrict__ tails,
                                  std::int64_t R, std::int64_t L, std::int64_t C, std::int64_t hh, std::int64_t dk,
                                  std::int64_t lo, std::int64_t F) {
  const std::int64_t total = R * F, q = hh * C;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = e / F, j = e % F;
    tails[e] = j < q ? qk0[(r * L + L - hh) * C + j] : u[(r * L + L - 1) * dk + lo + (j - q)];
  }
}

// The halos' value part of the gradient: dhalos[r, q + j] = dv[run r's first token, lo + j]
// (q = hh C, j < F - q), fp32.
__global__ void halo_value_grad_kernel(const bf16* __restrict__ dv, float* __restrict__ dhalos, std::int64_t R,
                                       std::int64_t L, std::int64_t dk, std::int64_t lo, std::int64_t q,
                                       std::int64_t F) {
  const std::int64_t width = F - q, total = R * width;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = e / width, j = e % width;
    dhalos[r * F + q + j] = __bfloat162float(dv[(r * L) * dk + lo + j]);
  }
}

struct Dims {
  std::int64_t N, H, d, nq, nkv, C, dq, dk, W0, W1;
  // The attention's query and kv heads (Config::attend_q: a part of the query heads and their kv
  // head; else nq, nkv), its output's columns, and the rows of att / datt, which also hold the
  // value projection u [N, dk] before the attention (forward) and after it (backward).
  std::int64_t na, nka, da, att_cols;
  // The runs the convolutions and the value shift see (R = B, L = T without a split), the
  // depthwise output's rows per run, the halo's qk0 rows and its floats (0 without a split).
  std::int64_t R, L, Tc0, hh, F;
};

// Config::attend_q0 / attend_q: a range of query heads inside one kv group (ops/cca.h), or all.
void set_attended(const Config& c, Dims& d) {
  if (c.attend_q != 0 || c.attend_q0 != 0) {
    const std::int64_t G = c.q_heads / c.kv_heads, last = c.attend_q0 + c.attend_q - 1;
    if (c.attend_q < 1 || c.attend_q0 < 0 || last >= c.q_heads || (c.attends_part() && c.attend_q0 / G != last / G))
      fail("cuda cca: attended query heads [{}, {}) must lie inside one kv group of {} query heads (of {})",
           c.attend_q0, c.attend_q0 + c.attend_q, G, c.q_heads);
  }
  d.na = c.att_heads(), d.nka = c.att_kv_heads(), d.da = d.na * c.head_dim;
  d.att_cols = std::max(d.da, std::int64_t(c.kv_heads) * c.head_dim);
}

// Attending a part: columns [c0, c0 + w) of n rows of `from` (row length ld) into `to` (rows of
// w), or back from `to` into those columns (back). bf16.
void copy_columns(bf16* from, std::int64_t ld, std::int64_t c0, std::int64_t w, bf16* to, std::int64_t n, bool back,
                  cudaStream_t stream) {
  if (n == 0) return;
  const std::size_t e = sizeof(bf16);
  if (back)
    KEEL_CUDA_CHECK(cudaMemcpy2DAsync(from + c0, ld * e, to, w * e, w * e, n, cudaMemcpyDeviceToDevice, stream));
  else
    KEEL_CUDA_CHECK(cudaMemcpy2DAsync(to, w * e, from + c0, ld * e, w * e, n, cudaMemcpyDeviceToDevice, stream));
}

Dims check(const Config& c, std::int64_t B, std::int64_t T, const rope::DeviceTable& rt) {
  if (c.hidden <= 0 || c.q_heads <= 0 || c.kv_heads <= 0 || c.q_heads % c.kv_heads)
    fail("cuda cca: need positive sizes and q_heads % kv_heads == 0 (got q {}, kv {})", c.q_heads, c.kv_heads);
  if (c.head_dim != 64 && c.head_dim != 128) fail("cuda cca: head_dim {} (the attention kernel takes 64 or 128)", c.head_dim);
  if ((c.kv_heads * c.head_dim) % 2) fail("cuda cca: kv_heads * head_dim must be even (two value halves)");
  if (c.shift_begin() < 0 || c.shift_begin() > c.shift_end() || c.shift_end() > c.kv_heads * c.head_dim)
    fail("cuda cca: the shifted value columns [{}, {}) are outside [0, {})", c.shift_begin(), c.shift_end(),
         c.kv_heads * c.head_dim);
  if (c.conv0_width < 1 || c.conv1_width < 1 || c.conv0_width > causal_conv::kMaxWidth ||
      c.conv1_width > causal_conv::kMaxWidth)
    fail("cuda cca: conv widths must be in [1, {}], got {} and {}", causal_conv::kMaxWidth, c.conv0_width,
         c.conv1_width);
  if (c.qk_channels() > kMaxChannels) fail("cuda cca: {} q/k channels exceed {}", c.qk_channels(), kMaxChannels);
  if (B < 0 || T < 0) fail("cuda cca: B and T must be >= 0, got {} and {}", B, T);
  if (B * T > 0x7fffffff) fail("cuda cca: {} tokens exceed the grid", B * T);
  if (rt.head_dim != c.head_dim) fail("cuda cca: rope table head_dim {} != head_dim {}", rt.head_dim, c.head_dim);
  Dims d;
  d.N = B * T, d.H = c.hidden, d.d = c.head_dim, d.nq = c.q_heads, d.nkv = c.kv_heads, d.C = c.qk_channels();
  d.dq = d.nq * d.d, d.dk = d.nkv * d.d, d.W0 = c.conv0_width, d.W1 = c.conv1_width;
  d.R = B, d.L = T, d.Tc0 = T + c.conv1_width - 1, d.hh = (c.conv0_width - 1) + (c.conv1_width - 1), d.F = 0;
  set_attended(c, d);
  return d;
}

// A split's runs (segments > 0): B * S runs of L = T / S tokens, each at least the halo's hh rows
// long. segments 0: whole sequences (R = B, L = T, no halo).
void apply_runs(const Config& c, std::int64_t B, std::int64_t T, int segments, Dims& d) {
  if (segments < 0) fail("cuda cca: segments must be >= 0, got {}", segments);
  if (segments == 0) return;
  if (T % segments)
    fail("cuda cca: a sequence split into {} runs needs the rank's tokens per sequence ({}) divisible by {}",
         segments, T, segments);
  const std::int64_t L = T / segments;
  if (T > 0 && L < d.hh)
    fail("cuda cca: runs of {} tokens ({} per sequence in {} runs) are shorter than the conv halo (W0-1)+(W1-1) = {}",
         L, T, segments, d.hh);
  d.R = B * segments, d.L = L, d.Tc0 = L + c.conv1_width - 1, d.F = ops::cca::halo_floats(c);
}

// Dims of a call with `segments` runs per sequence (the checks above, then apply_runs).
Dims check(const Config& c, std::int64_t B, std::int64_t T, const rope::DeviceTable& rt, int segments) {
  Dims d = check(c, B, T, rt);
  apply_runs(c, B, T, segments, d);
  return d;
}

// The runs' extents for saved_bytes / carve_saved (which, as before, check no more than the
// split's: the config is checked by forward).
Dims layout_dims(const Config& c, std::int64_t B, std::int64_t T, int segments) {
  Dims d{};
  d.C = c.qk_channels();
  set_attended(c, d);
  d.R = B, d.L = T, d.Tc0 = T + c.conv1_width - 1, d.hh = (c.conv0_width - 1) + (c.conv1_width - 1), d.F = 0;
  apply_runs(c, B, T, segments, d);
  return d;
}

int split_segments(const SequenceSplit* split) {
  if (!split) return 0;
  const int S = split->segments();
  if (S < 1) fail("cuda cca: the sequence split has {} segments (need >= 1)", S);
  return S;
}

struct Scratch {
  bf16* datt;   // [N, att_cols]: [N, da]; after the attention backward, du [N, dk] (the unshifted value grad)
  bf16 *dqa, *dka, *dva;  // attending a part: the attended heads' gradients [N, da], [N, d], [N, d]
  bf16* dq;     // [N, dq]
  bf16* dk;     // [N, dk]
  bf16* dv;     // [N, dk]
  float* dqk;   // [N, C]
  float* tpart; // [N, nkv]
  float* dc0;   // [R, L + W1 - 1, C]
  bf16* dqk0b;  // [N, C] conv + mixing path, bf16 for the GEMMs
  void* conv_ws; // the grouped conv backward's
  void* attn_ws;
  float* dhalos; // [R, F] with a split: the halos' gradient
  float* dtails; // [R, F] with a split: the tails' gradient (split->halo_backward)
};

std::size_t scratch_layout(const Config& c, std::int64_t B, std::int64_t T, const Dims& d, void* base, Scratch* s) {
  char* p = static_cast<char*>(base);
  std::size_t off = 0;
  auto take = [&](std::size_t bytes) {
    char* r = p ? p + off : nullptr;
    off += round_up(bytes);
    return r;
  };
  const std::size_t N = static_cast<std::size_t>(d.N);
  Scratch t;
  t.datt = reinterpret_cast<bf16*>(take(N * d.att_cols * 2));
  const bool part = c.attends_part();
  t.dqa = part ? reinterpret_cast<bf16*>(take(N * d.da * 2)) : nullptr;
  t.dka = part ? reinterpret_cast<bf16*>(take(N * d.d * 2)) : nullptr;
  t.dva = part ? reinterpret_cast<bf16*>(take(N * d.d * 2)) : nullptr;
  t.dq = reinterpret_cast<bf16*>(take(N * d.dq * 2));
  t.dk = reinterpret_cast<bf16*>(take(N * d.dk * 2));
  t.dv = reinterpret_cast<bf16*>(take(N * d.dk * 2));
  t.dqk = reinterpret_cast<float*>(take(N * d.C * 4));
  t.tpart = reinterpret_cast<float*>(take(N * d.nkv * 4));
  t.dc0 = reinterpret_cast<float*>(take(static_cast<std::size_t>(d.R * d.Tc0 * d.C) * 4));
  t.dqk0b = reinterpret_cast<bf16*>(take(N * d.C * 2));
  t.conv_ws = take(d.N > 0 ? causal_conv::grouped_backward_gemm_scratch_bytes(d.R, d.L, d.C, d.d, int(d.W1)) : 0);
  t.attn_ws = take(d.N > 0 ? attention::backward_workspace_bytes(int(B), int(T), int(d.na), int(d.nka), int(d.d)) : 0);
  t.dhalos = reinterpret_cast<float*>(take(static_cast<std::size_t>(d.R * d.F) * 4));  // F = 0 without a split
  t.dtails = reinterpret_cast<float*>(take(static_cast<std::size_t>(d.R * d.F) * 4));
  if (s) *s = t;
  return off;
}

}  // namespace

std::size_t saved_bytes(const Config& c, std::int64_t B, std::int64_t T, int segments) {
  const Dims d = layout_dims(c, B, T, segments);
  const std::int64_t N = B * T, C = c.qk_channels(), dq = c.q_heads * c.head_dim, dk = c.kv_heads * c.head_dim;
  const std::size_t Tc0 = static_cast<std::size_t>(d.R * d.Tc0);
  const std::size_t part = c.attends_part() ? round_up(N * d.da * 2) + 2 * round_up(N * c.head_dim * 2) : 0;
  return round_up(N * C * 2) + round_up(Tc0 * C * 2) + round_up(N * C * 4) + round_up(N * (c.q_heads + c.kv_heads) * 4) +
         round_up(N * dq * 2) + 2 * round_up(N * dk * 2) + round_up(N * d.att_cols * 2) + round_up(B * d.na * T * 4) +
         round_up(c.conv1_width * C * c.head_dim * 2) + (segments > 0 ? round_up(d.R * d.F * 2) : 0) + part;
}

Saved carve_saved(const Config& c, std::int64_t B, std::int64_t T, void* buffer, int segments) {
  const Dims d = layout_dims(c, B, T, segments);
  const std::int64_t N = B * T, C = c.qk_channels(), dq = c.q_heads * c.head_dim, dk = c.kv_heads * c.head_dim;
  char* p = static_cast<char*>(buffer);
  auto take = [&p](std::size_t bytes) {
    char* r = p;
    p += round_up(bytes);
    return r;
  };
  Saved s;
  s.qk0 = reinterpret_cast<bf16*>(take(N * C * 2));
  s.c0 = reinterpret_cast<bf16*>(take(static_cast<std::size_t>(d.R * d.Tc0) * C * 2));
  s.qk = reinterpret_cast<float*>(take(N * C * 4));
  s.rnorm = reinterpret_cast<float*>(take(N * (c.q_heads + c.kv_heads) * 4));
  s.q = reinterpret_cast<bf16*>(take(N * dq * 2));
  s.k = reinterpret_cast<bf16*>(take(N * dk * 2));
  s.v = reinterpret_cast<bf16*>(take(N * dk * 2));
  s.att = reinterpret_cast<bf16*>(take(N * d.att_cols * 2));
  s.lse = reinterpret_cast<float*>(take(B * d.na * T * 4));
  s.conv1_wt = reinterpret_cast<bf16*>(take(c.conv1_width * C * c.head_dim * 2));
  if (segments > 0) s.halo = reinterpret_cast<bf16*>(take(static_cast<std::size_t>(d.R * d.F) * 2));
  if (c.attends_part()) {
    s.qa = reinterpret_cast<bf16*>(take(N * d.da * 2));
    s.ka = reinterpret_cast<bf16*>(take(N * c.head_dim * 2));
    s.va = reinterpret_cast<bf16*>(take(N * c.head_dim * 2));
  }
  return s;
}

void forward(GemmRunner& gemm, const Config& c, std::int64_t B, std::int64_t T, const bf16* x,
             const std::int32_t* positions, const rope::DeviceTable& rt, const Weights& w, const Saved& s, bf16* y,
             cudaStream_t stream, SequenceSplit* split) {
  const Dims d = check(c, B, T, rt, split_segments(split));
  if (split && d.F > 0 && !s.halo) fail("cuda cca: a split needs Saved::halo (carve_saved with the split's segments)");
  if (d.N == 0) return;
  const float sqrt_d = static_cast<float>(std::sqrt(double(d.d)));
  const int extra = static_cast<int>(d.W1 - 1);
  const std::int64_t lo = c.shift_begin(), hc = d.hh * d.C;  // hc: the halo's qk0 floats

  // 1. W_qk projection and the two causal convolutions (conv output lands in qk, fp32); the
  //    grouped conv on tensor cores, its weights re-laid out in bf16 (kept for backward).
  linear::forward(gemm, x, w.w_qk, s.qk0, d.N, d.H, d.C, stream);
  if (!split) {
    causal_conv::depthwise_forward(s.qk0, w.conv0_w, w.conv0_b, extra, s.c0, B, T, d.C, int(d.W0), stream);
  } else {
    // With a split: u = x W_v^T into att first (free until step 5; dk <= dq), then each run's
    // tail (its last hh rows of qk0, its last row's shifted columns of u) packed into qk (free
    // until the grouped conv; R F bf16 <= N C fp32 since L >= hh), the halo exchange into
    // s.halo, and the depthwise conv per run reading its halo (rows F apart).
    linear::forward(gemm, x, w.w_v, s.att, d.N, d.H, d.dk, stream);
    if (d.F > 0) {
      bf16* tails = reinterpret_cast<bf16*>(s.qk);
      pack_tails_kernel<<<elementwise_grid(d.R * d.F, kThreads), kThreads, 0, stream>>>(s.qk0, s.att, tails, d.R, d.L,
                                                                                       d.C, d.hh, d.dk, lo, d.F);
      KEEL_CUDA_CHECK_LAUNCH();
      split->halo(tails, s.halo, d.R, d.F, stream);
    }
    causal_conv::depthwise_forward(s.qk0, w.conv0_w, w.conv0_b, extra, s.c0, d.R, d.L, d.C, int(d.W0), stream, s.halo,
                                   d.F);
  }
  causal_conv::grouped_weights_bf16(w.conv1_w, s.conv1_wt, d.C, d.d, int(d.W1), stream);
  causal_conv::grouped_forward_gemm(gemm, s.c0, s.conv1_wt, w.conv1_b, s.qk, d.R, d.L, d.C, d.d, int(d.W1), stream);

  // 2. Mixing terms, L2 normalization, sqrt(d), temperature -> q, k (bf16).
  mix_norm_kernel<<<static_cast<unsigned>(d.N), kTokenThreads, static_cast<std::size_t>(d.C) * sizeof(float), stream>>>(
      s.qk0, s.qk, w.temp, s.rnorm, s.q, s.k, int(d.nq), int(d.nkv), int(d.d), c.l2_eps, sqrt_d);
  KEEL_CUDA_CHECK_LAUNCH();

  // 3. Partial RoPE in place.
  rope::forward(rt, s.q, positions, d.N, d.nq, stream);
  rope::forward(rt, s.k, positions, d.N, d.nkv, stream);

  // 4. Values: u = x W_v^T into att (free until step 5; dk <= dq; a split's was made in 1), then
  //    the shifted copy, per run (a split's runs' first tokens read their halo's u row).
  if (!split) linear::forward(gemm, x, w.w_v, s.att, d.N, d.H, d.dk, stream);
  value_shift_kernel<<<elementwise_grid(d.N * d.dk, kThreads), kThreads, 0, stream>>>(
      s.att, s.v, d.N, d.L, d.dk, lo, c.shift_end(), split ? s.halo : nullptr, d.F, hc);
  KEEL_CUDA_CHECK_LAUNCH();

  // 5. Causal GQA attention (the layer's window; a split's over its whole sequences) of the
  //    attended query heads, and the output projection.
  const bool part = c.attends_part();
  if (part) {
    copy_columns(s.q, d.dq, c.attend_q0 * d.d, d.da, s.qa, d.N, false, stream);
    copy_columns(s.k, d.dk, c.att_kv0() * d.d, d.d, s.ka, d.N, false, stream);
    copy_columns(s.v, d.dk, c.att_kv0() * d.d, d.d, s.va, d.N, false, stream);
  }
  const bf16 *q = part ? s.qa : s.q, *k = part ? s.ka : s.k, *v = part ? s.va : s.v;
  if (split)
    split->forward(q, k, v, s.att, s.lse, int(B), int(T), int(d.na), int(d.nka), int(d.d), 1.f / sqrt_d, c.window,
                   stream);
  else
    attention::forward(q, k, v, s.att, s.lse, int(B), int(T), int(d.na), int(d.nka), int(d.d), 1.f / sqrt_d, c.window,
                       stream);
  linear::forward(gemm, s.att, w.w_o, y, d.N, d.da, d.H, stream);
}

std::size_t backward_scratch_bytes(const Config& c, std::int64_t B, std::int64_t T, int segments) {
  rope::DeviceTable rt;
  rt.head_dim = static_cast<int>(c.head_dim);
  const Dims d = check(c, B, T, rt, segments);
  return scratch_layout(c, B, T, d, nullptr, nullptr);
}

void backward(GemmRunner& gemm, const Config& c, std::int64_t B, std::int64_t T, const bf16* x,
              const std::int32_t* positions, const rope::DeviceTable& rt, const Weights& w, const Saved& s,
              const bf16* dy, bf16* dx, const Grads& g, void* scratch, cudaStream_t stream, SequenceSplit* split) {
  const Dims d = check(c, B, T, rt, split_segments(split));
  if (split && d.F > 0 && !s.halo) fail("cuda cca: a split needs Saved::halo (carve_saved with the split's segments)");
  if (d.N == 0) return;
  if (split) {
    const std::size_t need = split->backward_workspace_bytes(int(B), int(T), int(d.na), int(d.nka), int(d.d)),
                      have = attention::backward_workspace_bytes(int(B), int(T), int(d.na), int(d.nka), int(d.d));
    if (need > have)
      fail("cuda cca backward: the split's attention workspace ({} bytes) exceeds the scratch's ({} bytes, "
           "attention::backward_workspace_bytes)", need, have);
  }
  Scratch k;
  scratch_layout(c, B, T, d, scratch, &k);
  const float sqrt_d = static_cast<float>(std::sqrt(double(d.d)));
  const int extra = static_cast<int>(d.W1 - 1);
  const std::int64_t lo = c.shift_begin(), hc = d.hh * d.C;

  // 5. Output projection and attention (of the attended query heads: the others' q, k and v
  //    gradients are 0 here; they reach the loss only through the k mixing, in 1.).
  linear::backward(gemm, s.att, w.w_o, dy, k.datt, g.w_o, d.N, d.da, d.H, stream);
  const bool part = c.attends_part();
  const bf16 *q = part ? s.qa : s.q, *kk = part ? s.ka : s.k, *v = part ? s.va : s.v;
  bf16 *dqa = part ? k.dqa : k.dq, *dka = part ? k.dka : k.dk, *dva = part ? k.dva : k.dv;
  if (split)
    split->backward(q, kk, v, s.att, s.lse, k.datt, dqa, dka, dva, k.attn_ws, int(B), int(T), int(d.na), int(d.nka),
                    int(d.d), 1.f / sqrt_d, c.window, stream);
  else
    attention::backward(q, kk, v, s.att, s.lse, k.datt, dqa, dka, dva, k.attn_ws, int(B), int(T), int(d.na),
                        int(d.nka), int(d.d), 1.f / sqrt_d, c.window, stream);
  if (part) {
    KEEL_CUDA_CHECK(cudaMemsetAsync(k.dq, 0, static_cast<std::size_t>(d.N * d.dq) * sizeof(bf16), stream));
    KEEL_CUDA_CHECK(cudaMemsetAsync(k.dk, 0, static_cast<std::size_t>(d.N * d.dk) * sizeof(bf16), stream));
    KEEL_CUDA_CHECK(cudaMemsetAsync(k.dv, 0, static_cast<std::size_t>(d.N * d.dk) * sizeof(bf16), stream));
    copy_columns(k.dq, d.dq, c.attend_q0 * d.d, d.da, k.dqa, d.N, true, stream);
    copy_columns(k.dk, d.dk, c.att_kv0() * d.d, d.d, k.dka, d.N, true, stream);
    copy_columns(k.dv, d.dk, c.att_kv0() * d.d, d.d, k.dva, d.N, true, stream);
  }

  // 4. Values: undo the shift into du (datt's memory, free now). Its GEMMs run last, once the
  //    W_qk dgrad has overwritten dx, so the W_v dgrad can add into dx (beta = 1). With a split
  //    a run's first token's shifted dv is its halo's gradient (into dhalos now), and the
  //    unshift waits for the halo exchange (1.), which brings each run's last token its part.
  bf16* du = k.datt;
  if (!split) {
    value_unshift_kernel<<<elementwise_grid(d.N * d.dk, kThreads), kThreads, 0, stream>>>(
        k.dv, du, d.N, T, d.dk, lo, c.shift_end(), nullptr, 0, 0);
    KEEL_CUDA_CHECK_LAUNCH();
  } else if (d.F > hc) {
    halo_value_grad_kernel<<<elementwise_grid(d.R * (d.F - hc), kThreads), kThreads, 0, stream>>>(
        k.dv, k.dhalos, d.R, d.L, d.dk, lo, hc, d.F);
    KEEL_CUDA_CHECK_LAUNCH();
  }

  // 3. RoPE: inverse rotation in place.
  rope::backward(rt, k.dq, positions, d.N, d.nq, stream);
  rope::backward(rt, k.dk, positions, d.N, d.nkv, stream);

  // 2. Normalization (+ temperature).
  norm_backward_kernel<<<static_cast<unsigned>(d.N), kTokenThreads, 0, stream>>>(
      s.qk, s.rnorm, w.temp, k.dq, k.dk, k.dqk, k.tpart, int(d.nq), int(d.nkv), int(d.d), sqrt_d);
  KEEL_CUDA_CHECK_LAUNCH();
  if (g.temp) {
    temp_reduce_kernel<<<static_cast<unsigned>(d.nkv), kThreads, 0, stream>>>(k.tpart, g.temp, d.N, int(d.nkv));
    KEEL_CUDA_CHECK_LAUNCH();
  }

  // 1. Convolutions, the mixing terms' direct path, then W_qk. With a split: the depthwise conv
  //    per run also gives its halo's gradient (dhalos' qk0 part, rows F apart); ONE
  //    halo_backward sends dhalos to the runs that gave them, and dtails joins their last hh rows
  //    of dqk0 (in fp32, before the rounding) and their last row's shifted du columns.
  causal_conv::grouped_backward_gemm(gemm, s.c0, s.conv1_wt, k.dqk, k.dc0, g.conv1_w, g.conv1_b, d.R, d.L, d.C, d.d,
                                     int(d.W1), k.conv_ws, stream);
  const float* dtails = nullptr;
  if (!split) {
    causal_conv::depthwise_backward(s.qk0, w.conv0_w, extra, k.dc0, nullptr, g.conv0_w, g.conv0_b, B, T, d.C,
                                    int(d.W0), stream);
  } else {
    causal_conv::depthwise_backward(s.qk0, w.conv0_w, extra, k.dc0, nullptr, g.conv0_w, g.conv0_b, d.R, d.L, d.C,
                                    int(d.W0), stream, s.halo, k.dhalos, d.F);
    if (d.F > 0) {
      split->halo_backward(k.dhalos, k.dtails, d.R, d.F, stream);
      dtails = k.dtails;
    }
    value_unshift_kernel<<<elementwise_grid(d.N * d.dk, kThreads), kThreads, 0, stream>>>(
        k.dv, du, d.N, d.L, d.dk, lo, c.shift_end(), dtails, d.F, hc);
    KEEL_CUDA_CHECK_LAUNCH();
  }
  conv_dx_mix_backward_kernel<<<static_cast<unsigned>(d.N), kThreads, 0, stream>>>(
      k.dqk, k.dc0, w.conv0_w, k.dqk0b, d.L, extra, int(d.W0), int(d.nq), int(d.nkv), int(d.d), dtails, d.F, d.hh);
  KEEL_CUDA_CHECK_LAUNCH();
  linear::backward(gemm, x, w.w_qk, k.dqk0b, dx, g.w_qk, d.N, d.H, d.C, stream);

  // The value path: dW_v += du^T x, and dx += du W_v (bf16 C, beta = 1: one rounding of the sum).
  linear::backward(gemm, x, w.w_v, du, nullptr, g.w_v, d.N, d.H, d.dk, stream);
  if (dx) {
    GemmDesc gd;
    gd.m = d.N, gd.n = d.H, gd.k = d.dk;
    gd.beta = 1.f;
    gemm.run(gd, du, w.w_v, dx, stream);
  }
}

}  // namespace keel::ops::cuda::cca
