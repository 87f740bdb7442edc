#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>

#include "common/hash.h"
#include "bench/gemm/gemm_kernels.h"

namespace keel::bench {
namespace {


__device__ __forceinline__ void store(void* p, std::uint64_t i, int storage, float v) {
  switch (storage) {
    case kStoreBF16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    case kStoreFP16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    case kStoreFP8E4M3: static_cast<__nv_fp8_e4m3*>(p)[i] = __nv_fp8_e4m3(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

__device__ __forceinline__ float load(const void* p, std::uint64_t i, int storage) {
  switch (storage) {
    case kStoreBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case kStoreFP16: return __half2float(static_cast<const __half*>(p)[i]);
    case kStoreFP8E4M3: return static_cast<float>(static_cast<const __nv_fp8_e4m3*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__global__ void fill_kernel(void* p, std::uint64_t count, int storage, std::uint64_t seed) {
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  const std::uint64_t key = keel::splitmix64(seed);
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const std::uint64_t h = keel::splitmix64(key ^ i);
    const float v = static_cast<float>(h >> 40) * 0x1p-23f - 1.0f;  // [-1, 1)
    store(p, i, storage, v);
  }
}

__global__ void poison_kernel(void* p, std::uint64_t count, int storage) {
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    store(p, i, storage, NAN);
}

__global__ void nonfinite_kernel(const void* p, std::uint64_t count, int storage, unsigned long long* counter) {
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  unsigned long long bad = 0;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    bad += !isfinite(load(p, i, storage));
  if (bad) atomicAdd(counter, bad);
}

__global__ void gather_kernel(const void* A, const void* B, const void* C, int in_storage, int out_storage,
                              bool a_trans, bool b_trans, std::int64_t m, std::int64_t n, std::int64_t k,
                              const std::int64_t* pos, float* a_out, float* b_out, float* c_out) {
  const int s = blockIdx.x;
  const std::int64_t b = pos[3 * s], i = pos[3 * s + 1], j = pos[3 * s + 2];
  const std::uint64_t a_base = static_cast<std::uint64_t>(b) * m * k, b_base = static_cast<std::uint64_t>(b) * k * n;
  for (std::int64_t q = threadIdx.x; q < k; q += blockDim.x) {
    const std::uint64_t ai = a_base + (a_trans ? q * m + i : i * k + q);  // A stored [k x m] or [m x k]
    const std::uint64_t bi = b_base + (b_trans ? j * k + q : q * n + j);  // B stored [n x k] or [k x n]
    a_out[static_cast<std::uint64_t>(s) * k + q] = load(A, ai, in_storage);
    b_out[static_cast<std::uint64_t>(s) * k + q] = load(B, bi, in_storage);
  }
  if (threadIdx.x == 0) c_out[s] = load(C, static_cast<std::uint64_t>(b) * m * n + i * n + j, out_storage);
}

__global__ void spin_kernel(std::uint64_t ns) {
  std::uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

int grid_for(std::uint64_t count) {
  const std::uint64_t blocks = (count + 255) / 256;
  return static_cast<int>(blocks < 1 ? 1 : blocks > 8192 ? 8192 : blocks);
}

}  // namespace

void launch_gemm_fill(void* p, std::uint64_t count, int storage, std::uint64_t seed, cudaStream_t s) {
  fill_kernel<<<grid_for(count), 256, 0, s>>>(p, count, storage, seed);
}

void launch_gemm_poison(void* p, std::uint64_t count, int storage, cudaStream_t s) {
  poison_kernel<<<grid_for(count), 256, 0, s>>>(p, count, storage);
}

void launch_gemm_count_nonfinite(const void* p, std::uint64_t count, int storage, unsigned long long* counter,
                                 cudaStream_t s) {
  nonfinite_kernel<<<grid_for(count), 256, 0, s>>>(p, count, storage, counter);
}

void launch_gemm_gather(const void* A, const void* B, const void* C, int in_storage, int out_storage, bool a_trans,
                        bool b_trans, std::int64_t m, std::int64_t n, std::int64_t k, const std::int64_t* pos,
                        int samples, float* a_out, float* b_out, float* c_out, cudaStream_t s) {
  gather_kernel<<<samples, 256, 0, s>>>(A, B, C, in_storage, out_storage, a_trans, b_trans, m, n, k, pos, a_out,
                                        b_out, c_out);
}

void launch_spin(std::uint64_t ns, cudaStream_t s) { spin_kernel<<<1, 1, 0, s>>>(ns); }

}  // namespace keel::bench
