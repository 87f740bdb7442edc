#include "train/cuda_kernels.h"

namespace keel::train::cuda {
namespace {

__global__ void add_f32_kernel(const float* __restrict__ a, const float* __restrict__ b, float* out, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = a[i] + b[i];
}

}  // namespace

void add_f32(const float* a, const float* b, float* out, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const unsigned grid = ops::cuda::grid_for(n, 256);
  add_f32_kernel<<<grid < 4096 ? grid : 4096, 256, 0, stream>>>(a, b, out, n);
  KEEL_CUDA_CHECK_LAUNCH();
}

}  // namespace keel::train::cuda
