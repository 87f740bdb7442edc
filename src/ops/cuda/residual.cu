#include "ops/cuda/residual.h"

#include <algorithm>

#include "common/error.h"

namespace keel::ops::cuda::residual {

namespace {

constexpr int kThreads = 256;

// Vector body of 4 elements (float4 + 8 bytes of bf16) when `vec`, element-wise tail after it.
template <bool kScaled>
__global__ void add_kernel(const bf16* __restrict__ y, float scale, float* __restrict__ resid, std::int64_t n,
                           bool vec) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t tid = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t body = vec ? n / 4 * 4 : 0;
  for (std::int64_t v = tid; v < body / 4; v += stride) {
    const __nv_bfloat162* y2 = reinterpret_cast<const __nv_bfloat162*>(y + 4 * v);
    const float2 a = __bfloat1622float2(y2[0]), b = __bfloat1622float2(y2[1]);
    float4 r = reinterpret_cast<float4*>(resid)[v];
    if constexpr (kScaled) {
      r.x += scale * a.x, r.y += scale * a.y, r.z += scale * b.x, r.w += scale * b.y;
    } else {
      r.x += a.x, r.y += a.y, r.z += b.x, r.w += b.y;
    }
    reinterpret_cast<float4*>(resid)[v] = r;
  }
  for (std::int64_t i = body + tid; i < n; i += stride) {
    const float f = __bfloat162float(y[i]);
    if constexpr (kScaled)
      resid[i] += scale * f;
    else
      resid[i] += f;
  }
}

template <bool kScaled>
void launch(const bf16* y, float scale, float* resid, std::int64_t n, cudaStream_t stream, const char* what) {
  if (n < 0) fail("residual {}: n must be >= 0, got {}", what, n);
  if (n == 0) return;
  const bool vec = reinterpret_cast<std::uintptr_t>(y) % 8 == 0 && reinterpret_cast<std::uintptr_t>(resid) % 16 == 0;
  const std::int64_t items = vec ? n / 4 + 4 : n;
  const unsigned grid = static_cast<unsigned>(std::min<std::int64_t>(grid_for(items, kThreads), 132 * 16));
  add_kernel<kScaled><<<grid, kThreads, 0, stream>>>(y, scale, resid, n, vec);
  KEEL_CUDA_CHECK_LAUNCH();
}

}  // namespace

void add_bf16_into_f32(const bf16* y, float* resid, std::int64_t n, cudaStream_t stream) {
  launch<false>(y, 1.f, resid, n, stream, "add");
}

void add_scaled_bf16_into_f32(const bf16* y, float scale, float* resid, std::int64_t n, cudaStream_t stream) {
  launch<true>(y, scale, resid, n, stream, "scaled add");
}

}  // namespace keel::ops::cuda::residual
