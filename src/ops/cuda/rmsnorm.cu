#include "ops/cuda/rmsnorm.h"

#include <algorithm>

#include "common/error.h"

namespace keel::ops::cuda::rmsnorm {

namespace {

constexpr int kWarpsPerBlock = 4;  // rows per block in the row kernels
constexpr int kDwThreads = 256;    // columns per block in the dw kernel
constexpr int kDwTargetBlocks = 528;  // ~4 blocks per SM on an H100 (132 SMs)

__device__ inline float4 load_bf16x4(const bf16* p) {
  const __nv_bfloat162* q = reinterpret_cast<const __nv_bfloat162*>(p);
  const float2 a = __bfloat1622float2(q[0]), b = __bfloat1622float2(q[1]);
  return make_float4(a.x, a.y, b.x, b.y);
}

// kVec: dim % 4 == 0 and x, w 16-byte aligned, y 8-byte aligned.
template <bool kVec>
__global__ void forward_kernel(const float* __restrict__ x, const float* __restrict__ w, float eps, bf16* __restrict__ y,
                               float* __restrict__ rstd, std::int64_t rows, std::int64_t dim) {
  const int lane = threadIdx.x % 32;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const float* xr = x + row * dim;
  bf16* yr = y + row * dim;
  float ss = 0.f;
  if constexpr (kVec) {
    for (std::int64_t j = lane; j < dim / 4; j += 32) {
      const float4 v = reinterpret_cast<const float4*>(xr)[j];
      ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
  } else {
    for (std::int64_t j = lane; j < dim; j += 32) ss += xr[j] * xr[j];
  }
  ss = warp_sum(ss);
  const float r = 1.f / sqrtf(ss / static_cast<float>(dim) + eps);
  if (rstd && lane == 0) rstd[row] = r;
  if constexpr (kVec) {
    for (std::int64_t j = lane; j < dim / 4; j += 32) {
      const float4 v = reinterpret_cast<const float4*>(xr)[j];
      const float4 g = reinterpret_cast<const float4*>(w)[j];
      __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(yr + 4 * j);
      out[0] = __floats2bfloat162_rn(v.x * r * g.x, v.y * r * g.y);
      out[1] = __floats2bfloat162_rn(v.z * r * g.z, v.w * r * g.w);
    }
  } else {
    for (std::int64_t j = lane; j < dim; j += 32) yr[j] = __float2bfloat16(xr[j] * r * w[j]);
  }
}

// kVec: dim % 4 == 0, x, w, dx 16-byte aligned, dy 8-byte aligned.
template <bool kVec>
__global__ void backward_dx_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                   const float* __restrict__ rstd, const bf16* __restrict__ dy, float* __restrict__ dx,
                                   std::int64_t rows, std::int64_t dim) {
  const int lane = threadIdx.x % 32;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const float* xr = x + row * dim;
  const bf16* dyr = dy + row * dim;
  float* dxr = dx + row * dim;
  const float r = rstd[row];
  float dot = 0.f;  // sum_d (dy * w) * x; times r below
  if constexpr (kVec) {
    for (std::int64_t j = lane; j < dim / 4; j += 32) {
      const float4 v = reinterpret_cast<const float4*>(xr)[j];
      const float4 g = reinterpret_cast<const float4*>(w)[j];
      const float4 d = load_bf16x4(dyr + 4 * j);
      dot += d.x * g.x * v.x + d.y * g.y * v.y + d.z * g.z * v.z + d.w * g.w * v.w;
    }
  } else {
    for (std::int64_t j = lane; j < dim; j += 32) dot += __bfloat162float(dyr[j]) * w[j] * xr[j];
  }
  const float m = warp_sum(dot) * r / static_cast<float>(dim);
  if constexpr (kVec) {
    for (std::int64_t j = lane; j < dim / 4; j += 32) {
      const float4 v = reinterpret_cast<const float4*>(xr)[j];
      const float4 g = reinterpret_cast<const float4*>(w)[j];
      const float4 d = load_bf16x4(dyr + 4 * j);
      float4 acc = reinterpret_cast<float4*>(dxr)[j];
      acc.x += r * (d.x * g.x - v.x * r * m);
      acc.y += r * (d.y * g.y - v.y * r * m);
      acc.z += r * (d.z * g.z - v.z * r * m);
      acc.w += r * (d.w * g.w - v.w * r * m);
      reinterpret_cast<float4*>(dxr)[j] = acc;
    }
  } else {
    for (std::int64_t j = lane; j < dim; j += 32)
      dxr[j] += r * (__bfloat162float(dyr[j]) * w[j] - xr[j] * r * m);
  }
}

// Thread = column, block y = a chunk of rows; the partial over the chunk is added into dw
// (plainly when there is one chunk, so small problems stay deterministic).
__global__ void backward_dw_kernel(const float* __restrict__ x, const float* __restrict__ rstd,
                                   const bf16* __restrict__ dy, float* __restrict__ dw, std::int64_t rows,
                                   std::int64_t dim, std::int64_t chunk) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= dim) return;
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.y) * chunk;
  const std::int64_t end = begin + chunk < rows ? begin + chunk : rows;
  float acc = 0.f;
  for (std::int64_t i = begin; i < end; ++i) acc += __bfloat162float(dy[i * dim + j]) * x[i * dim + j] * rstd[i];
  if (gridDim.y == 1)
    dw[j] += acc;
  else
    atomicAdd(dw + j, acc);
}


void check_args(std::int64_t rows, std::int64_t dim, const char* what) {
  if (rows < 0 || dim <= 0) fail("rmsnorm {}: need rows >= 0 and dim > 0, got rows {}, dim {}", what, rows, dim);
  if ((rows + kWarpsPerBlock - 1) / kWarpsPerBlock > 0x7fffffff) fail("rmsnorm {}: too many rows ({})", what, rows);
}

}  // namespace

void forward(const float* x, const float* w, float eps, bf16* y, float* rstd, std::int64_t rows, std::int64_t dim,
             cudaStream_t stream) {
  check_args(rows, dim, "forward");
  if (rows == 0) return;
  const unsigned grid = grid_for(rows, kWarpsPerBlock);
  const bool vec = dim % 4 == 0 && aligned_to(x, 16) && aligned_to(w, 16) && aligned_to(y, 8);
  if (vec)
    forward_kernel<true><<<grid, 32 * kWarpsPerBlock, 0, stream>>>(x, w, eps, y, rstd, rows, dim);
  else
    forward_kernel<false><<<grid, 32 * kWarpsPerBlock, 0, stream>>>(x, w, eps, y, rstd, rows, dim);
  KEEL_CUDA_CHECK_LAUNCH();
}

void backward(const float* x, const float* w, const float* rstd, const bf16* dy, float* dx, float* dw,
              std::int64_t rows, std::int64_t dim, cudaStream_t stream) {
  check_args(rows, dim, "backward");
  if (rows == 0) return;
  if (dx) {
    const unsigned grid = grid_for(rows, kWarpsPerBlock);
    const bool vec =
        dim % 4 == 0 && aligned_to(x, 16) && aligned_to(w, 16) && aligned_to(dx, 16) && aligned_to(dy, 8);
    if (vec)
      backward_dx_kernel<true><<<grid, 32 * kWarpsPerBlock, 0, stream>>>(x, w, rstd, dy, dx, rows, dim);
    else
      backward_dx_kernel<false><<<grid, 32 * kWarpsPerBlock, 0, stream>>>(x, w, rstd, dy, dx, rows, dim);
    KEEL_CUDA_CHECK_LAUNCH();
  }
  if (dw) {
    const std::int64_t col_blocks = (dim + kDwThreads - 1) / kDwThreads;
    // Enough row chunks to fill the GPU, but at least 32 rows each so the atomics stay few.
    const std::int64_t want_chunks = std::max<std::int64_t>(1, kDwTargetBlocks / col_blocks);
    const std::int64_t chunks = std::min<std::int64_t>({want_chunks, (rows + 31) / 32, 65535});
    const std::int64_t chunk = (rows + chunks - 1) / chunks;
    const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>((rows + chunk - 1) / chunk));
    backward_dw_kernel<<<grid, kDwThreads, 0, stream>>>(x, rstd, dy, dw, rows, dim, chunk);
    KEEL_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace keel::ops::cuda::rmsnorm
