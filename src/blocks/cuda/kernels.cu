#include "blocks/cuda/kernels.h"

namespace keel::blocks::cuda {
namespace {

constexpr int kThreads = 256;

unsigned capped_grid(std::int64_t n) {
  const unsigned g = ops::cuda::grid_for(n, kThreads);
  return g < 4096 ? g : 4096;
}

__global__ void add_f32_kernel(const float* __restrict__ a, const float* __restrict__ b, float* out, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = a[i] + b[i];
}

__global__ void add_bf16_kernel(const bf16* __restrict__ a, const bf16* __restrict__ b, bf16* out, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = __float2bfloat16(__bfloat162float(a[i]) + __bfloat162float(b[i]));
}

// One block walks the tokens in chunks of blockDim.x: a ballot gives each kept token its rank in
// its warp, warp 0 scans the warp totals, and `base` carries the running count between chunks,
// so the packed order is the token order (as the CPU's compaction in zaya_layers.cc).
constexpr int kPackThreads = 1024;

__global__ void pack_routed_kernel(const std::int32_t* __restrict__ idx, std::int64_t n, int experts,
                                   std::int32_t* __restrict__ kept, std::int32_t* __restrict__ kept_idx,
                                   std::int32_t* __restrict__ pos, std::int32_t* __restrict__ count) {
  __shared__ int warp_incl[kPackThreads / 32];
  __shared__ int base;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (threadIdx.x == 0) base = 0;
  __syncthreads();
  for (std::int64_t start = 0; start < n; start += blockDim.x) {
    const std::int64_t i = start + threadIdx.x;
    const int e = i < n ? idx[i] : experts;
    const bool keep = i < n && e >= 0 && e < experts;
    const unsigned ballot = __ballot_sync(0xffffffffu, keep);
    const int rank = __popc(ballot & ((1u << lane) - 1u));
    if (lane == 0) warp_incl[warp] = __popc(ballot);
    __syncthreads();
    if (warp == 0) {
      int v = lane < warps ? warp_incl[lane] : 0;
      for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += t;
      }
      if (lane < warps) warp_incl[lane] = v;
    }
    __syncthreads();
    const int slot = base + (warp == 0 ? 0 : warp_incl[warp - 1]) + rank;
    if (i < n) {
      pos[i] = keep ? slot : -1;
      if (keep) {
        kept[slot] = static_cast<std::int32_t>(i);
        kept_idx[slot] = e;
      }
    }
    __syncthreads();  // every thread has read `base` and warp_incl
    if (threadIdx.x == 0) base += warp_incl[warps - 1];
    __syncthreads();
  }
  if (threadIdx.x == 0) *count = base;
}

template <typename T>
__global__ void gather_rows_kernel(const T* __restrict__ src, const std::int32_t* __restrict__ rows,
                                   std::int64_t count, std::int64_t width, T* __restrict__ dst) {
  const std::int64_t total = count * width, stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const std::int64_t r = i / width, c = i - r * width;
    dst[i] = src[static_cast<std::int64_t>(rows[r]) * width + c];
  }
}

__global__ void unpack_rows_kernel(const float* __restrict__ src, const std::int32_t* __restrict__ pos,
                                   std::int64_t n_rows, std::int64_t width, float* __restrict__ dst) {
  const std::int64_t total = n_rows * width, stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const std::int64_t r = i / width, c = i - r * width;
    const std::int32_t p = pos[r];
    dst[i] = p >= 0 ? src[static_cast<std::int64_t>(p) * width + c] : 0.f;
  }
}

__global__ void unpack_moe_dx_kernel(const bf16* __restrict__ dxk, const std::int32_t* __restrict__ pos,
                                     std::int64_t n_rows, std::int64_t width, float* __restrict__ dx) {
  const std::int64_t total = n_rows * width, stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const std::int64_t r = i / width, c = i - r * width;
    const std::int32_t p = pos[r];
    dx[i] = p >= 0 ? __bfloat162float(dxk[static_cast<std::int64_t>(p) * width + c]) : 0.f;
  }
}

}  // namespace

void add_f32(const float* a, const float* b, float* out, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  add_f32_kernel<<<capped_grid(n), kThreads, 0, stream>>>(a, b, out, n);
  KEEL_CUDA_CHECK_LAUNCH();
}

void add_bf16(const bf16* a, const bf16* b, bf16* out, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  add_bf16_kernel<<<capped_grid(n), kThreads, 0, stream>>>(a, b, out, n);
  KEEL_CUDA_CHECK_LAUNCH();
}

void pack_routed(const std::int32_t* idx, std::int64_t n, int experts, std::int32_t* kept, std::int32_t* kept_idx,
                 std::int32_t* pos, std::int32_t* count, cudaStream_t stream) {
  pack_routed_kernel<<<1, kPackThreads, 0, stream>>>(idx, n, experts, kept, kept_idx, pos, count);
  KEEL_CUDA_CHECK_LAUNCH();
}

void gather_rows(const bf16* src, const std::int32_t* rows, std::int64_t count, std::int64_t width, bf16* dst,
                 cudaStream_t stream) {
  if (count <= 0 || width <= 0) return;
  gather_rows_kernel<<<capped_grid(count * width), kThreads, 0, stream>>>(src, rows, count, width, dst);
  KEEL_CUDA_CHECK_LAUNCH();
}

void gather_rows(const float* src, const std::int32_t* rows, std::int64_t count, std::int64_t width, float* dst,
                 cudaStream_t stream) {
  if (count <= 0 || width <= 0) return;
  gather_rows_kernel<<<capped_grid(count * width), kThreads, 0, stream>>>(src, rows, count, width, dst);
  KEEL_CUDA_CHECK_LAUNCH();
}

void unpack_rows(const float* src, const std::int32_t* pos, std::int64_t n_rows, std::int64_t width, float* dst,
                 cudaStream_t stream) {
  if (n_rows <= 0 || width <= 0) return;
  unpack_rows_kernel<<<capped_grid(n_rows * width), kThreads, 0, stream>>>(src, pos, n_rows, width, dst);
  KEEL_CUDA_CHECK_LAUNCH();
}

void unpack_moe_dx(const bf16* dxk, const std::int32_t* pos, std::int64_t n_rows, std::int64_t width, float* dx,
                   cudaStream_t stream) {
  if (n_rows <= 0 || width <= 0) return;
  unpack_moe_dx_kernel<<<capped_grid(n_rows * width), kThreads, 0, stream>>>(dxk, pos, n_rows, width, dx);
  KEEL_CUDA_CHECK_LAUNCH();
}

}  // namespace keel::blocks::cuda
