// Causal linear attention on the GPU: decode's step, the feature map and the per-head norm
// (ops/cuda/linear_attention.h).
#include "ops/cuda/linear_attention_common.cuh"

namespace keel::ops::cuda::linear_attention {

using namespace detail;  // linear_attention_common.cuh

namespace {

// One block per (sequence, kv head); a thread per state column b: M[a][b] = gamma M[a][b] +
// k[a] v[b] (rounded as the CPU op: product and sum separately), then out_h[b] = sum_a q_h[a] M[a][b]
// for the group's query heads (reading back its own column).
__global__ void step_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                            float* __restrict__ state, bf16* __restrict__ out, int Hq, int Hkv, int d, int group,
                            const Gammas gm) {
  const std::int64_t task = blockIdx.x, b = task / Hkv;
  const int g = static_cast<int>(task % Hkv);
  const float gamma = gm.gamma[g];
  float* M = state + task * d * d;
  const bf16* kr = k + (b * Hkv + g) * d;
  const bf16* vr = v + (b * Hkv + g) * d;
  for (int col = threadIdx.x; col < d; col += blockDim.x) {
    const float vb = __bfloat162float(vr[col]);
    for (int a = 0; a < d; ++a) {
      float m = M[a * d + col];
      if (gamma != 1.f) m = __fmul_rn(m, gamma);
      M[a * d + col] = __fadd_rn(m, __fmul_rn(__bfloat162float(kr[a]), vb));
    }
    for (int hh = 0; hh < group; ++hh) {
      const bf16* qr = q + (b * Hq + static_cast<std::int64_t>(g) * group + hh) * d;
      float o = 0.f;
      for (int a = 0; a < d; ++a) o += __bfloat162float(qr[a]) * M[a * d + col];
      out[(b * Hq + static_cast<std::int64_t>(g) * group + hh) * d + col] = __float2bfloat16(o);
    }
  }
}

__global__ void elu1_forward_kernel(const bf16* x, bf16* y, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float a = __bfloat162float(x[i]);
    y[i] = __float2bfloat16(a > 0.f ? a + 1.f : expf(a));
  }
}

__global__ void elu1_backward_kernel(const bf16* y, const bf16* dy, bf16* dx, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float a = __bfloat162float(y[i]);
    dx[i] = __float2bfloat16(__bfloat162float(dy[i]) * (a > 1.f ? 1.f : a));
  }
}

constexpr int kNormWarps = 8;  // rows per block, a warp each

// y may alias x: a lane rereads and rewrites only its own elements.
__global__ void norm_forward_kernel(const bf16* x, std::int64_t M, int d, float eps, bf16* y, float* rstd) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kNormWarps + threadIdx.x / 32;
  if (row >= M) return;  // whole warps
  const int lane = threadIdx.x & 31;
  const bf16* xr = x + row * d;
  bf16* yr = y + row * d;
  float ss = 0.f;
  for (int j = lane; j < d; j += 32) {
    const float a = __bfloat162float(xr[j]);
    ss += a * a;
  }
  ss = warp_sum(ss);
  const float rs = 1.0f / sqrtf(ss / static_cast<float>(d) + eps);
  if (lane == 0) rstd[row] = rs;
  for (int j = lane; j < d; j += 32) yr[j] = __float2bfloat16(__bfloat162float(xr[j]) * rs);
}

// dx may alias dy, as above.
__global__ void norm_backward_kernel(const bf16* y, const float* rstd, const bf16* dy, bf16* dx, std::int64_t M, int d) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kNormWarps + threadIdx.x / 32;
  if (row >= M) return;
  const int lane = threadIdx.x & 31;
  const bf16* yr = y + row * d;
  const bf16* gr = dy + row * d;
  bf16* xr = dx + row * d;
  float dot = 0.f;
  for (int j = lane; j < d; j += 32) dot += __bfloat162float(gr[j]) * __bfloat162float(yr[j]);
  const float m = warp_sum(dot) / static_cast<float>(d), rs = rstd[row];
  for (int j = lane; j < d; j += 32)
    xr[j] = __float2bfloat16(rs * (__bfloat162float(gr[j]) - __bfloat162float(yr[j]) * m));
}

}  // namespace

void step(const Config& c, std::int64_t B, const bf16* q, const bf16* k, const bf16* v, float* state, bf16* out,
          cudaStream_t stream) {
  const Dims s = check(c, B, 1);
  if (B == 0) return;
  step_kernel<<<static_cast<unsigned>(B * s.Hkv), 128, 0, stream>>>(q, k, v, state, out, s.Hq, s.Hkv, s.d, s.group,
                                                                     gammas_of(c));
  KEEL_CUDA_CHECK_LAUNCH();
}

void feature_forward(Feature f, const bf16* x, bf16* y, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  if (f == Feature::kIdentity) {
    if (x != y) KEEL_CUDA_CHECK(cudaMemcpyAsync(y, x, sizeof(bf16) * n, cudaMemcpyDeviceToDevice, stream));
    return;
  }
  elu1_forward_kernel<<<elementwise_grid(n, 256), 256, 0, stream>>>(x, y, n);
  KEEL_CUDA_CHECK_LAUNCH();
}

void feature_backward(Feature f, const bf16* y, const bf16* dy, bf16* dx, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  if (f == Feature::kIdentity) {
    if (dy != dx) KEEL_CUDA_CHECK(cudaMemcpyAsync(dx, dy, sizeof(bf16) * n, cudaMemcpyDeviceToDevice, stream));
    return;
  }
  elu1_backward_kernel<<<elementwise_grid(n, 256), 256, 0, stream>>>(y, dy, dx, n);
  KEEL_CUDA_CHECK_LAUNCH();
}

void norm_forward(const bf16* x, std::int64_t M, int d, float eps, bf16* y, float* rstd, cudaStream_t stream) {
  if (d < 1) fail("linear attention norm (CUDA): width {} must be >= 1", d);
  if (M <= 0) return;
  norm_forward_kernel<<<grid_for(M, kNormWarps), 32 * kNormWarps, 0, stream>>>(x, M, d, eps, y, rstd);
  KEEL_CUDA_CHECK_LAUNCH();
}

void norm_backward(const bf16* y, const float* rstd, const bf16* dy, bf16* dx, std::int64_t M, int d,
                   cudaStream_t stream) {
  if (d < 1) fail("linear attention norm (CUDA): width {} must be >= 1", d);
  if (M <= 0) return;
  norm_backward_kernel<<<grid_for(M, kNormWarps), 32 * kNormWarps, 0, stream>>>(y, rstd, dy, dx, M, d);
  KEEL_CUDA_CHECK_LAUNCH();
}

}  // namespace keel::ops::cuda::linear_attention
