// Shared pieces of the CUDA ops (src/ops/cuda): the element types and launch helpers.
//
// Conventions of every CUDA op (docs/gpu_training.md has the whole contract):
//  - Pointers are device pointers; shapes are passed as explicit extents (row-major, contiguous
//    unless a leading dimension says otherwise); every launch takes a cudaStream_t and never
//    synchronizes the host unless its header says so.
//  - Activations are bf16, statistics (norm rstd, softmax lse, router probabilities) fp32.
//    Gradients follow the one convention of docs/ops.md (Gradient convention), exactly as the
//    CPU reference ops in src/ops: parameter gradients fp32 and accumulated (+=), activation
//    gradients overwritten, except rmsnorm's dx, which adds into the fp32 residual-stream
//    gradient. Two ops can also write a parameter gradient, on request
//    (moe::Grads::overwrite, cross_entropy::Options::overwrite_dw; docs/gpu_training.md).
//  - Included only from .cu files and *_cuda.cc / *_cuda_test.cc: a CPU-only build never sees it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>

#include "device/cuda_check.h"

namespace keel::ops::cuda {

using bf16 = __nv_bfloat16;

// The calling thread's T for its current device, made on first use there: cuBLASLt handles,
// streams and workspaces belong to one device, and one thread's work never waits on another's.
template <class T>
T& for_thread_and_device() {
  thread_local std::map<int, std::unique_ptr<T>> objects;
  int device = 0;
  KEEL_CUDA_CHECK(cudaGetDevice(&device));
  std::unique_ptr<T>& object = objects[device];
  if (!object) object = std::make_unique<T>();
  return *object;
}

// Whether p (a null p too) sits on a multiple of `bytes`: the vector-access paths' test.
inline bool aligned_to(const void* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

// Blocks of `threads` covering n items, at least one.
inline unsigned grid_for(std::int64_t n, int threads) {
  const std::int64_t g = (n + threads - 1) / threads;
  return static_cast<unsigned>(g < 1 ? 1 : g);
}

// Blocks for a grid-stride elementwise kernel of `threads`-thread blocks over n items, capped
// at 65536 (the loop covers the rest).
inline unsigned elementwise_grid(std::int64_t n, int threads) {
  const unsigned g = grid_for(n, threads);
  return g < (1u << 16) ? g : (1u << 16);
}

// The launch of a per-column reduction over `rows` (parameter gradients of a [rows, cols]
// activation): col_threads columns per block across, and enough chunks of at least 32 rows
// down for about target_blocks blocks; each block sums `chunk` rows of its columns.
struct ColumnSplit {
  dim3 grid;
  std::int64_t chunk;
};
inline ColumnSplit column_split(std::int64_t rows, std::int64_t cols, int col_threads, int target_blocks) {
  const std::int64_t col_blocks = (cols + col_threads - 1) / col_threads;
  const std::int64_t want = target_blocks / col_blocks > 1 ? target_blocks / col_blocks : 1;
  std::int64_t chunks = (rows + 31) / 32;
  if (want < chunks) chunks = want;
  if (chunks > 65535) chunks = 65535;
  if (chunks < 1) chunks = 1;
  std::int64_t chunk = (rows + chunks - 1) / chunks;
  if (chunk < 1) chunk = 1;
  return {dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>((rows + chunk - 1) / chunk)), chunk};
}

#if defined(__CUDACC__)
template <typename T>
__device__ inline T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum of one value per thread over a block of kThreads threads, returned to every thread.
// Fixed order (warp sums, then warp 0 over them): deterministic.
template <int kThreads, typename T>
__device__ T block_sum_all(T v) {
  __shared__ T part[kThreads / 32];
  __shared__ T total;
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    T w = threadIdx.x < kThreads / 32 ? part[threadIdx.x] : T(0);
    w = warp_sum(w);
    if (threadIdx.x == 0) total = w;
  }
  __syncthreads();
  return total;
}

// The same sum, valid in thread 0 only, adding the warp sums in warp order on that thread.
template <int kThreads, typename T>
__device__ T block_sum_to_thread0(T v) {
  __shared__ T warp_sums[kThreads / 32];
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  T total = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
  return total;
}

// kN bf16 values (8 or 4) at p, aligned to 2 * kN bytes, to or from floats in one vector access.
template <int kN>
__device__ inline void load_bf16(const bf16* p, float* out) {
  static_assert(kN == 8 || kN == 4, "8 or 4 bf16 values");
  __nv_bfloat162 h[kN / 2];
  if constexpr (kN == 8)
    *reinterpret_cast<uint4*>(h) = *reinterpret_cast<const uint4*>(p);
  else
    *reinterpret_cast<uint2*>(h) = *reinterpret_cast<const uint2*>(p);
#pragma unroll
  for (int k = 0; k < kN / 2; ++k) {
    const float2 f = __bfloat1622float2(h[k]);
    out[2 * k] = f.x;
    out[2 * k + 1] = f.y;
  }
}
template <int kN>
__device__ inline void store_bf16(bf16* p, const float* v) {
  static_assert(kN == 8 || kN == 4, "8 or 4 bf16 values");
  __nv_bfloat162 h[kN / 2];
#pragma unroll
  for (int k = 0; k < kN / 2; ++k) h[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
  if constexpr (kN == 8)
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(h);
  else
    *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(h);
}

// An optimizer step's gradient scale: the host's, times the device's when there is one (the
// clip coefficient grad_norm.h writes, NaN for a non-finite gradient norm). adamw.h and muon.h
// skip the step when it is not finite.
__device__ inline float effective_grad_scale(float host_scale, const float* device_scale) {
  return device_scale ? __fmul_rn(host_scale, *device_scale) : host_scale;
}
#endif

// Checks the last launch (a bad configuration shows up here, not at the next sync).
#define KEEL_CUDA_CHECK_LAUNCH() KEEL_CUDA_CHECK(cudaGetLastError())

}  // namespace keel::ops::cuda
