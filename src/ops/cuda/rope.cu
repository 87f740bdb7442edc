#include "ops/cuda/rope.h"

#include <algorithm>

#include "common/error.h"

namespace keel::ops::cuda::rope {

namespace {

constexpr int kThreads = 256;

// One thread per rotated pair (token, head, k < half). sign = +1 forward, -1 inverse.
__global__ void rotate_kernel(bf16* x, const std::int32_t* __restrict__ positions, const float* __restrict__ cos_t,
                              const float* __restrict__ sin_t, std::int64_t n, std::int64_t heads, int head_dim,
                              int half, int max_positions, float sign) {
  const std::int64_t total = n * heads * half;
  for (std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = idx / half;  // token * heads + head
    const int k = static_cast<int>(idx - row * half);
    const std::int32_t pos = positions[row / heads];
    if (pos < 0 || pos >= max_positions) continue;
    const float c = cos_t[static_cast<std::int64_t>(pos) * half + k];
    const float s = sign * sin_t[static_cast<std::int64_t>(pos) * half + k];
    bf16* xr = x + row * head_dim;
    const float a = __bfloat162float(xr[k]), b = __bfloat162float(xr[k + half]);
    // Unfused multiply-adds: the same fp32 roundings as the CPU reference.
    xr[k] = __float2bfloat16(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
    xr[k + half] = __float2bfloat16(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
  }
}

void rotate(const DeviceTable& t, bf16* x, const std::int32_t* positions, std::int64_t n, std::int64_t heads,
            cudaStream_t stream, float sign, const char* what) {
  if (t.rotary_dim <= 0 || t.rotary_dim % 2 || t.rotary_dim > t.head_dim || t.max_positions <= 0 || !t.cos || !t.sin)
    fail("rope {}: bad device table (head_dim {}, rotary_dim {}, max_positions {})", what, t.head_dim, t.rotary_dim,
         t.max_positions);
  if (n < 0 || heads <= 0) fail("rope {}: need n >= 0 and heads > 0, got n {}, heads {}", what, n, heads);
  const int half = t.rotary_dim / 2;
  const std::int64_t total = n * heads * half;
  if (total == 0) return;
  const std::int64_t max_grid = 132 * 32;  // grid-stride beyond this
  const std::int64_t grid = std::min<std::int64_t>(grid_for(total, kThreads), max_grid);
  rotate_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(x, positions, t.cos, t.sin, n, heads, t.head_dim,
                                                                      half, t.max_positions, sign);
  KEEL_CUDA_CHECK_LAUNCH();
}

}  // namespace

UploadedTable::UploadedTable(const ops::rope::Table& t) {
  const std::size_t count = t.cos.size();
  if (count != static_cast<std::size_t>(t.max_positions) * (t.rotary_dim / 2) || t.sin.size() != count || count == 0)
    fail("rope: table of {} cos / {} sin values does not match max_positions {} x rotary_dim / 2 = {}", t.cos.size(),
         t.sin.size(), t.max_positions, t.rotary_dim / 2);
  try {
    KEEL_CUDA_CHECK(cudaMalloc(&cos_, count * sizeof(float)));
    KEEL_CUDA_CHECK(cudaMalloc(&sin_, count * sizeof(float)));
    KEEL_CUDA_CHECK(cudaMemcpy(cos_, t.cos.data(), count * sizeof(float), cudaMemcpyHostToDevice));
    KEEL_CUDA_CHECK(cudaMemcpy(sin_, t.sin.data(), count * sizeof(float), cudaMemcpyHostToDevice));
    // pageable copies may return before the DMA lands; kernels on non-blocking streams would
    // not wait for it
    KEEL_CUDA_CHECK(cudaDeviceSynchronize());
  } catch (...) {
    if (cos_) cudaFree(cos_);
    if (sin_) cudaFree(sin_);
    throw;
  }
  view_ = DeviceTable{cos_, sin_, t.head_dim, t.rotary_dim, t.max_positions};
}

UploadedTable::~UploadedTable() {
  if (cos_) cudaFree(cos_);
  if (sin_) cudaFree(sin_);
}

void forward(const DeviceTable& t, bf16* x, const std::int32_t* positions, std::int64_t n, std::int64_t heads,
             cudaStream_t stream) {
  rotate(t, x, positions, n, heads, stream, 1.f, "forward");
}

void backward(const DeviceTable& t, bf16* g, const std::int32_t* positions, std::int64_t n, std::int64_t heads,
              cudaStream_t stream) {
  rotate(t, g, positions, n, heads, stream, -1.f, "backward");
}

}  // namespace keel::ops::cuda::rope
