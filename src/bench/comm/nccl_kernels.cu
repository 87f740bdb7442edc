#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "bench/comm/nccl_kernels.h"
#include "device/cuda_check.h"

namespace keel::bench {
namespace {

__device__ __forceinline__ float load(const void* p, std::uint64_t i, DType t) {
  switch (t) {
    case DType::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::kFP16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ void store(void* p, std::uint64_t i, DType t, float v) {
  switch (t) {
    case DType::kBF16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    case DType::kFP16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

__global__ void fill_kernel(void* buf, std::uint64_t count, DType t, ValueSpec spec, int rank) {
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; i < count; i += stride)
    store(buf, i, t, input_value(spec, rank, i));
}

__global__ void verify_kernel(const void* buf, std::uint64_t count, DType t, ValueSpec spec, CaseGeometry geom,
                              int rank, VerifyCounters* counters) {
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  unsigned long long wrong = 0, first = ~0ull;
  for (std::uint64_t j = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; j < count; j += stride) {
    const float got = load(buf, j, t);
    const float want = expected_output(spec, geom, rank, j);
    const float diff = fabsf(got - want);
    if (!(diff <= tolerance(geom, t, want))) {  // NaN (the poison) fails too
      ++wrong;
      if (j < first) first = j;
    }
  }
  if (wrong) {
    atomicAdd(&counters->wrong, wrong);
    atomicMin(&counters->first, first);
  }
}

unsigned grid_for(std::uint64_t count) {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const std::uint64_t blocks = (count + 255) / 256;
  const std::uint64_t cap = static_cast<std::uint64_t>(sms > 0 ? sms : 1) * 16;
  return static_cast<unsigned>(blocks < cap ? (blocks ? blocks : 1) : cap);
}

}  // namespace

void launch_fill_inputs(void* buf, std::uint64_t count, DType t, const ValueSpec& spec, int rank, cudaStream_t s) {
  if (count == 0) return;
  fill_kernel<<<grid_for(count), 256, 0, s>>>(buf, count, t, spec, rank);
  KEEL_CUDA_CHECK(cudaGetLastError());
}

void launch_verify(const void* buf, std::uint64_t count, DType t, const ValueSpec& spec, const CaseGeometry& geom,
                   int rank, VerifyCounters* counters, cudaStream_t s) {
  if (count == 0) return;
  verify_kernel<<<grid_for(count), 256, 0, s>>>(buf, count, t, spec, geom, rank, counters);
  KEEL_CUDA_CHECK(cudaGetLastError());
}

}  // namespace keel::bench
