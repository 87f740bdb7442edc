#include "ops/cuda/grad_norm.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"

namespace keel::ops::cuda::grad_norm {

namespace {

constexpr int kThreads = 256;
static_assert(kWorkspaceDoubles == 4 * kThreads, "the final reduction has 4 partials per thread");

// Stage 1: block b sums the squares of its grid-stride share into partials[b]. kVec: g is
// 16-byte aligned (float4 body, element-wise tail).
template <bool kVec>
__global__ void partial_kernel(const float* __restrict__ g, std::int64_t n, double* __restrict__ partials) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t tid = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  double acc = 0;  // each fp32 square is exact in fp64
  std::int64_t body = 0;
  if constexpr (kVec) {
    body = n / 4 * 4;
    for (std::int64_t q = tid; q < n / 4; q += stride) {
      const float4 x = reinterpret_cast<const float4*>(g)[q];
      acc += static_cast<double>(x.x) * x.x + static_cast<double>(x.y) * x.y + static_cast<double>(x.z) * x.z +
             static_cast<double>(x.w) * x.w;
    }
  }
  for (std::int64_t i = body + tid; i < n; i += stride) acc += static_cast<double>(g[i]) * g[i];
  const double total = block_sum_to_thread0<kThreads>(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// Stage 2: one block sums `count` partials in a fixed order.
__global__ void final_kernel(const double* __restrict__ partials, int count, double* sum_sq, bool accumulate) {
  double acc = 0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
  const double total = block_sum_to_thread0<kThreads>(acc);
  if (threadIdx.x == 0) *sum_sq = accumulate ? *sum_sq + total : total;
}

__global__ void coefficient_kernel(const double* sum_sq, int parts, double max_norm, float* coef, double* norm_out) {
  double total = 0;
  for (int i = 0; i < parts; ++i) total += sum_sq[i];
  const double norm = sqrt(total);
  if (norm_out) *norm_out = norm;
  if (!isfinite(norm)) {
    *coef = __int_as_float(0x7fc00000);  // NaN: "do not apply"
  } else if (!(max_norm > 0)) {
    *coef = 1.f;
  } else {
    const double c = max_norm / (norm + 1e-6);
    *coef = static_cast<float>(c < 1.0 ? c : 1.0);
  }
}

template <bool kVec>
__global__ void scale_kernel(float* __restrict__ g, std::int64_t n, const float* __restrict__ device_scale) {
  const float s = *device_scale;
  if (!isfinite(s)) return;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t tid = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  std::int64_t body = 0;
  if constexpr (kVec) {
    body = n / 4 * 4;
    for (std::int64_t q = tid; q < n / 4; q += stride) {
      float4 x = reinterpret_cast<float4*>(g)[q];
      x.x *= s, x.y *= s, x.z *= s, x.w *= s;
      reinterpret_cast<float4*>(g)[q] = x;
    }
  }
  for (std::int64_t i = body + tid; i < n; i += stride) g[i] *= s;
}


}  // namespace

void sum_squares(const float* g, std::int64_t n, double* workspace, double* sum_sq, bool accumulate,
                 cudaStream_t stream) {
  if (n < 0) fail("grad_norm: element count must be >= 0, got {}", n);
  const bool vec = aligned_to(g, 16);
  // The grid depends only on n (and alignment), so the summation order is fixed for a buffer.
  const std::int64_t items = vec ? n / 4 + 4 : n;
  const int blocks = static_cast<int>(std::min<std::int64_t>(grid_for(items, kThreads), kWorkspaceDoubles));
  if (n > 0) {
    if (vec)
      partial_kernel<true><<<blocks, kThreads, 0, stream>>>(g, n, workspace);
    else
      partial_kernel<false><<<blocks, kThreads, 0, stream>>>(g, n, workspace);
    KEEL_CUDA_CHECK_LAUNCH();
  }
  final_kernel<<<1, kThreads, 0, stream>>>(workspace, n > 0 ? blocks : 0, sum_sq, accumulate);
  KEEL_CUDA_CHECK_LAUNCH();
}

void clip_coefficient(const double* sum_sq, double max_norm, float* coef, double* norm, cudaStream_t stream, int parts) {
  if (std::isnan(max_norm)) fail("grad_norm: max_norm is NaN");
  if (parts < 1) fail("grad_norm: {} parts of the sum of squares", parts);
  coefficient_kernel<<<1, 1, 0, stream>>>(sum_sq, parts, max_norm, coef, norm);
  KEEL_CUDA_CHECK_LAUNCH();
}

void scale_inplace(float* g, std::int64_t n, const float* device_scale, cudaStream_t stream) {
  if (n < 0) fail("grad_norm: element count must be >= 0, got {}", n);
  if (n == 0) return;
  const bool vec = aligned_to(g, 16);
  const std::int64_t items = vec ? n / 4 + 4 : n;
  const unsigned grid = static_cast<unsigned>(std::min<std::int64_t>(grid_for(items, kThreads), 132 * 8));
  if (vec)
    scale_kernel<true><<<grid, kThreads, 0, stream>>>(g, n, device_scale);
  else
    scale_kernel<false><<<grid, kThreads, 0, stream>>>(g, n, device_scale);
  KEEL_CUDA_CHECK_LAUNCH();
}

}  // namespace keel::ops::cuda::grad_norm
