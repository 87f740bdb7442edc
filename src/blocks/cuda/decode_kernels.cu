#include "blocks/cuda/decode_kernels.h"

#include <cmath>

#include "common/error.h"

namespace keel::blocks::cuda {

namespace {

using ops::cuda::elementwise_grid;
using ops::cuda::warp_sum;

constexpr int kThreads = 256;

__global__ void fill_positions_kernel(std::int32_t* pos, std::int64_t n, int T, int offset) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    pos[i] = offset + static_cast<std::int32_t>(i % T);
}

__global__ void tail_rows_kernel(const bf16* __restrict__ src, std::int64_t B, std::int64_t rows, std::int64_t width,
                                 int count, bf16* __restrict__ dst) {
  const std::int64_t total = B * count * width;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t c = e % width, j = (e / width) % count, b = e / (width * count);
    const std::int64_t r = rows - count + j;
    dst[e] = r >= 0 ? src[(b * rows + r) * width + c] : __float2bfloat16(0.f);
  }
}

__global__ void broadcast_row_kernel(const float* __restrict__ v, std::int64_t width, std::int64_t rows,
                                     bf16* __restrict__ dst) {
  const std::int64_t total = rows * width;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    dst[e] = __float2bfloat16(v[e % width]);
}

// As causal_conv's depthwise_forward_kernel for the last output row: acc = b, then the taps in
// time order (state rows oldest first, the new row last).
__global__ void depthwise_step_kernel(const bf16* __restrict__ qk0, const float* __restrict__ w,
                                      const float* __restrict__ bias, bf16* __restrict__ state, bf16* __restrict__ c0,
                                      std::int64_t B, std::int64_t C, int W) {
  const std::int64_t total = B * C;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t c = e % C, b = e / C;
    bf16* st = state + b * (W - 1) * C + c;
    const bf16 x = qk0[e];
    float acc = bias[c];
    for (int k = 0; k < W - 1; ++k) acc += w[c * W + k] * __bfloat162float(st[k * C]);
    acc += w[c * W + W - 1] * __bfloat162float(x);
    c0[e] = __float2bfloat16(acc);
    for (int k = 0; k + 1 < W - 1; ++k) st[k * C] = st[(k + 1) * C];
    if (W > 1) st[(W - 2) * C] = x;
  }
}

// One block of d threads per (sequence, head); thread o computes output channel h d + o. The
// math of prefill's grouped conv (causal_conv's grouped_forward_gemm: weights rounded to bf16,
// fp32 sums; the GEMM's summation order is its own) followed by cca's mix_norm_kernel (mixing
// terms, the per-head norm summed by one warp as there).
__global__ void grouped_step_kernel(const bf16* __restrict__ qk0, const bf16* __restrict__ c0,
                                    const float* __restrict__ w1, const float* __restrict__ b1,
                                    const float* __restrict__ temp, bf16* __restrict__ state, bf16* __restrict__ q,
                                    bf16* __restrict__ k, int nq, int nkv, int d, int W1, float l2_eps, float sqrt_d) {
  extern __shared__ float sm[];
  float* src = sm;           // [W1][d]: state rows, then the new c0 row (this head's channels)
  float* a_s = sm + W1 * d;  // [d]
  __shared__ float rn_s;
  const std::int64_t b = blockIdx.x;
  const int h = blockIdx.y, o = threadIdx.x;
  const int G = nq / nkv, dq = nq * d, C = (nq + nkv) * d, ch = h * d + o;
  bf16* st = state + b * (W1 - 1) * C;
  for (int kk = 0; kk < W1 - 1; ++kk) src[kk * d + o] = __bfloat162float(st[kk * C + ch]);
  const bf16 cnew = c0[b * C + ch];
  src[(W1 - 1) * d + o] = __bfloat162float(cnew);
  __syncthreads();
  for (int kk = 0; kk + 1 < W1 - 1; ++kk) st[kk * C + ch] = __float2bfloat16(src[(kk + 1) * d + o]);  // exact
  if (W1 > 1) st[(W1 - 2) * C + ch] = cnew;
  const float* wr = w1 + static_cast<std::int64_t>(ch) * d * W1;
  float acc = 0.f;
  for (int kk = 0; kk < W1; ++kk)
    for (int i = 0; i < d; ++i) acc += src[kk * d + i] * __bfloat162float(__float2bfloat16(wr[i * W1 + kk]));
  float v = acc + b1[ch];
  const bf16* a0 = qk0 + b * C;
  int g;
  if (h < nq) {
    g = h / G;
    v += 0.5f * (__bfloat162float(a0[ch]) + __bfloat162float(a0[dq + g * d + o]));
  } else {
    g = h - nq;
    float mean_q = 0.f;
    for (int j = 0; j < G; ++j) mean_q += __bfloat162float(a0[(g * G + j) * d + o]);
    v += 0.5f * (mean_q / static_cast<float>(G)) + 0.5f * __bfloat162float(a0[ch]);
  }
  a_s[o] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += 32) ss += a_s[i] * a_s[i];
    ss = warp_sum(ss);
    if (threadIdx.x == 0) rn_s = 1.f / sqrtf(ss + l2_eps);
  }
  __syncthreads();
  const float rn = rn_s;
  if (h < nq)
    q[b * dq + h * d + o] = __float2bfloat16(v * (sqrt_d * rn));
  else
    k[b * (nkv * d) + g * d + o] = __float2bfloat16(v * (temp[g] * sqrt_d * rn));
}

__global__ void value_step_kernel(const bf16* __restrict__ u, bf16* __restrict__ prev, bf16* __restrict__ vc,
                                  std::int64_t B, std::int64_t dk, std::int64_t capacity, std::int64_t pos) {
  const std::int64_t half = dk / 2, total = B * dk;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t b = e / dk, c = e % dk;
    bf16* row = vc + (b * capacity + pos) * dk;
    if (c < half) {
      row[c] = u[e];
    } else {
      bf16* p = prev + b * half + (c - half);
      row[c] = *p;
      *p = u[e];
    }
  }
}

constexpr int kArgmaxThreads = 256;

// generate.h's kNonFiniteLogits: the id a row of non-finite logits gives.
constexpr std::uint32_t kNonFiniteId = 0xFFFFFFFFu;

// Each thread scans a stride of the row keeping its first maximum; the block then reduces
// (value, id) pairs preferring the larger value, then the lower id.
__global__ void argmax_kernel(const float* __restrict__ logits, std::int64_t V, std::int64_t allowed,
                              std::uint32_t* __restrict__ out) {
  __shared__ float best_v[kArgmaxThreads];
  __shared__ std::int64_t best_i[kArgmaxThreads];
  const float* z = logits + static_cast<std::int64_t>(blockIdx.x) * V;
  float bv = -INFINITY;
  std::int64_t bi = -1;
  bool finite = true;
  for (std::int64_t v = threadIdx.x; v < allowed; v += blockDim.x) {
    finite = finite && isfinite(z[v]);
    if (bi < 0 || z[v] > bv) bv = z[v], bi = v;
  }
  // A NaN never compares greater, so without this check a damaged row would quietly give a token.
  const bool row_finite = !__syncthreads_or(!finite);
  best_v[threadIdx.x] = bv;
  best_i[threadIdx.x] = bi;
  __syncthreads();
  for (int s = kArgmaxThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      const float ov = best_v[threadIdx.x + s];
      const std::int64_t oi = best_i[threadIdx.x + s];
      const std::int64_t mi = best_i[threadIdx.x];
      if (oi >= 0 && (mi < 0 || ov > best_v[threadIdx.x] || (ov == best_v[threadIdx.x] && oi < mi))) {
        best_v[threadIdx.x] = ov;
        best_i[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0)
    out[blockIdx.x] = !row_finite ? kNonFiniteId : static_cast<std::uint32_t>(best_i[0] < 0 ? 0 : best_i[0]);
}

}  // namespace

void argmax_rows(const float* logits, std::int64_t rows, std::int64_t V, std::int64_t allowed, std::uint32_t* out,
                 cudaStream_t stream) {
  if (rows <= 0) return;
  if (allowed < 1 || allowed > V) fail("argmax_rows: allowed {} outside [1, {}]", allowed, V);
  argmax_kernel<<<static_cast<unsigned>(rows), kArgmaxThreads, 0, stream>>>(logits, V, allowed, out);
  KEEL_CUDA_CHECK_LAUNCH();
}

void fill_positions(std::int32_t* positions, std::int64_t n, int T, int offset, cudaStream_t stream) {
  if (n <= 0) return;
  if (T < 1) fail("fill_positions: T must be >= 1, got {}", T);
  fill_positions_kernel<<<elementwise_grid(n, kThreads), kThreads, 0, stream>>>(positions, n, T, offset);
  KEEL_CUDA_CHECK_LAUNCH();
}

void copy_rows(void* dst, std::int64_t dst_pitch, const void* src, std::int64_t src_pitch, std::int64_t width,
               std::int64_t rows, std::size_t elem_bytes, cudaStream_t stream) {
  if (rows <= 0 || width <= 0) return;
  KEEL_CUDA_CHECK(cudaMemcpy2DAsync(dst, static_cast<std::size_t>(dst_pitch) * elem_bytes, src,
                                    static_cast<std::size_t>(src_pitch) * elem_bytes,
                                    static_cast<std::size_t>(width) * elem_bytes, static_cast<std::size_t>(rows),
                                    cudaMemcpyDeviceToDevice, stream));
}

void tail_rows(const bf16* src, std::int64_t B, std::int64_t rows, std::int64_t width, int count, bf16* dst,
               cudaStream_t stream) {
  const std::int64_t total = B * count * width;
  if (total <= 0) return;
  tail_rows_kernel<<<elementwise_grid(total, kThreads), kThreads, 0, stream>>>(src, B, rows, width, count, dst);
  KEEL_CUDA_CHECK_LAUNCH();
}

void broadcast_row(const float* v, std::int64_t width, std::int64_t rows, bf16* dst, cudaStream_t stream) {
  const std::int64_t total = rows * width;
  if (total <= 0) return;
  broadcast_row_kernel<<<elementwise_grid(total, kThreads), kThreads, 0, stream>>>(v, width, rows, dst);
  KEEL_CUDA_CHECK_LAUNCH();
}

void cca_depthwise_step(const bf16* qk0, const float* w0, const float* b0, bf16* state0, bf16* c0, std::int64_t B,
                        std::int64_t C, int W0, cudaStream_t stream) {
  if (W0 < 1) fail("cca_depthwise_step: width {}", W0);
  const std::int64_t total = B * C;
  if (total <= 0) return;
  depthwise_step_kernel<<<elementwise_grid(total, kThreads), kThreads, 0, stream>>>(qk0, w0, b0, state0, c0, B, C, W0);
  KEEL_CUDA_CHECK_LAUNCH();
}

void cca_grouped_step(const bf16* qk0, const bf16* c0, const float* w1, const float* b1, const float* temp,
                      bf16* state1, bf16* q, bf16* k, std::int64_t B, int nq, int nkv, int d, int W1, float l2_eps,
                      cudaStream_t stream) {
  if (W1 < 1 || d < 32 || d > 1024 || d % 32 || nkv < 1 || nq % nkv)
    fail("cca_grouped_step: unsupported extents (d {}, W1 {}, nq {}, nkv {})", d, W1, nq, nkv);
  if (B <= 0) return;
  const std::size_t smem = static_cast<std::size_t>(W1 + 1) * d * sizeof(float);
  const float sqrt_d = static_cast<float>(std::sqrt(double(d)));
  grouped_step_kernel<<<dim3(static_cast<unsigned>(B), static_cast<unsigned>(nq + nkv)), d, smem, stream>>>(
      qk0, c0, w1, b1, temp, state1, q, k, nq, nkv, d, W1, l2_eps, sqrt_d);
  KEEL_CUDA_CHECK_LAUNCH();
}

void cca_value_step(const bf16* u, bf16* prev, bf16* v_cache, std::int64_t B, std::int64_t dk, std::int64_t capacity,
                    std::int64_t pos, cudaStream_t stream) {
  const std::int64_t total = B * dk;
  if (total <= 0) return;
  value_step_kernel<<<elementwise_grid(total, kThreads), kThreads, 0, stream>>>(u, prev, v_cache, B, dk, capacity, pos);
  KEEL_CUDA_CHECK_LAUNCH();
}

}  // namespace keel::blocks::cuda
