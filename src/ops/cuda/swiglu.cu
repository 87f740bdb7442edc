#include "ops/cuda/swiglu.h"

#include <algorithm>

#include "common/error.h"

namespace keel::ops::cuda::swiglu {

namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // bf16 per 16-byte access

__device__ inline float sigmoid(float g) { return 1.f / (1.f + expf(-g)); }

__device__ inline void forward_one(const bf16* gate, const bf16* up, bf16* out, std::int64_t i) {
  const float g = __bfloat162float(gate[i]);
  out[i] = __float2bfloat16(g * sigmoid(g) * __bfloat162float(up[i]));
}

__device__ inline void backward_one(const bf16* gate, const bf16* up, const bf16* dout, bf16* dgate, bf16* dup,
                                    std::int64_t i) {
  const float g = __bfloat162float(gate[i]), u = __bfloat162float(up[i]), d = __bfloat162float(dout[i]);
  const float s = sigmoid(g);
  if (dup) dup[i] = __float2bfloat16(d * g * s);
  if (dgate) dgate[i] = __float2bfloat16(d * u * s * (1.f + g * (1.f - s)));
}

// Vector body (when `vec`) over the first n / kVec * kVec elements, element-wise tail after it.
__global__ void forward_kernel(const bf16* gate, const bf16* up, bf16* out, std::int64_t n, bool vec) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t tid = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t body = vec ? n / kVec * kVec : 0;
  for (std::int64_t v = tid; v < body / kVec; v += stride) {
    uint4 graw = reinterpret_cast<const uint4*>(gate)[v];
    uint4 uraw = reinterpret_cast<const uint4*>(up)[v];
    uint4 oraw;
    const bf16* g8 = reinterpret_cast<const bf16*>(&graw);
    const bf16* u8 = reinterpret_cast<const bf16*>(&uraw);
    bf16* o8 = reinterpret_cast<bf16*>(&oraw);
#pragma unroll
    for (int e = 0; e < kVec; ++e) forward_one(g8, u8, o8, e);
    reinterpret_cast<uint4*>(out)[v] = oraw;
  }
  for (std::int64_t i = body + tid; i < n; i += stride) forward_one(gate, up, out, i);
}

__global__ void backward_kernel(const bf16* gate, const bf16* up, const bf16* dout, bf16* dgate, bf16* dup,
                                std::int64_t n, bool vec) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t tid = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t body = vec ? n / kVec * kVec : 0;
  for (std::int64_t v = tid; v < body / kVec; v += stride) {
    uint4 graw = reinterpret_cast<const uint4*>(gate)[v];
    uint4 uraw = reinterpret_cast<const uint4*>(up)[v];
    uint4 draw = reinterpret_cast<const uint4*>(dout)[v];
    uint4 dgraw, duraw;
#pragma unroll
    for (int e = 0; e < kVec; ++e)
      backward_one(reinterpret_cast<const bf16*>(&graw), reinterpret_cast<const bf16*>(&uraw),
                   reinterpret_cast<const bf16*>(&draw), reinterpret_cast<bf16*>(&dgraw),
                   reinterpret_cast<bf16*>(&duraw), e);
    if (dgate) reinterpret_cast<uint4*>(dgate)[v] = dgraw;
    if (dup) reinterpret_cast<uint4*>(dup)[v] = duraw;
  }
  for (std::int64_t i = body + tid; i < n; i += stride) backward_one(gate, up, dout, dgate, dup, i);
}


unsigned grid_of(std::int64_t items) {
  return static_cast<unsigned>(std::min<std::int64_t>(grid_for(items, kThreads), 132 * 16));
}

}  // namespace

void forward(const bf16* gate, const bf16* up, bf16* out, std::int64_t n, cudaStream_t stream) {
  if (n < 0) fail("swiglu forward: n must be >= 0, got {}", n);
  if (n == 0) return;
  const bool vec = aligned_to(gate, 16) && aligned_to(up, 16) && aligned_to(out, 16);
  forward_kernel<<<grid_of(vec ? n / kVec + kVec : n), kThreads, 0, stream>>>(gate, up, out, n, vec);
  KEEL_CUDA_CHECK_LAUNCH();
}

void backward(const bf16* gate, const bf16* up, const bf16* dout, bf16* dgate, bf16* dup, std::int64_t n,
              cudaStream_t stream) {
  if (n < 0) fail("swiglu backward: n must be >= 0, got {}", n);
  if (n == 0 || (!dgate && !dup)) return;
  const bool vec = aligned_to(gate, 16) && aligned_to(up, 16) && aligned_to(dout, 16) &&
                   (!dgate || aligned_to(dgate, 16)) && (!dup || aligned_to(dup, 16));
  backward_kernel<<<grid_of(vec ? n / kVec + kVec : n), kThreads, 0, stream>>>(gate, up, dout, dgate, dup, n, vec);
  KEEL_CUDA_CHECK_LAUNCH();
}

}  // namespace keel::ops::cuda::swiglu
