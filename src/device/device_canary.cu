#include "device/device_canary_cuda.h"

#include <algorithm>

#include "device/cuda_check.h"

namespace keel {

namespace {

constexpr int kThreads = 256;
constexpr int kChains = 8;                  // independent FMA chains per thread
constexpr std::int64_t kIterations = 16384;  // 16 cycles each on one SM: ~130 us at 1.98 GHz

__device__ inline unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void __launch_bounds__(kThreads) canary_kernel(std::int64_t iterations, unsigned long long* fastest) {
  __syncthreads();  // every thread of the block is resident
  const unsigned long long start = global_ns();
  float x[kChains];
#pragma unroll
  for (int j = 0; j < kChains; ++j) x[j] = 1e-3f * static_cast<float>(threadIdx.x + j);
  for (std::int64_t i = 0; i < iterations; ++i) {
#pragma unroll
    for (int j = 0; j < kChains; ++j) x[j] = fmaf(x[j], 0.999f, 1e-3f);
  }
  float sum = 0;
#pragma unroll
  for (int j = 0; j < kChains; ++j) sum += x[j];
  __syncthreads();  // every thread has finished
  if (threadIdx.x == 0) {
    // sum is finite and below 2: the branch never adds, but keeps the loop from being dropped
    const unsigned long long took = global_ns() - start + (sum > 1e30f ? 1 : 0);
    atomicMin(fastest, took);
  }
}

}  // namespace

DeviceCanary::DeviceCanary() {
  int device = 0, sms = 0, per_block = 0;
  KEEL_CUDA_CHECK(cudaGetDevice(&device));
  KEEL_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  KEEL_CUDA_CHECK(cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  blocks_ = sms;
  shared_bytes_ = per_block;
  KEEL_CUDA_CHECK(
      cudaFuncSetAttribute(canary_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes_));
  KEEL_CUDA_CHECK(cudaMalloc(&fastest_, sizeof(*fastest_)));
  KEEL_CUDA_CHECK(cudaMallocHost(&host_, sizeof(*host_)));
  KEEL_CUDA_CHECK(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming));
}

DeviceCanary::~DeviceCanary() {
  if (copied_) {
    cudaEventSynchronize(copied_);
    cudaEventDestroy(copied_);
  }
  cudaFree(fastest_);
  cudaFreeHost(host_);
}

double DeviceCanary::sample(int repeats, cudaStream_t stream) {
  const double last = wait();
  KEEL_CUDA_CHECK(cudaMemsetAsync(fastest_, 0xff, sizeof(*fastest_), stream));
  // the dynamic shared memory is not used: asking for all a block may have keeps any other block
  // that uses shared memory off the SM while the probe's block runs
  canary_kernel<<<blocks_, kThreads, shared_bytes_, stream>>>(kIterations * std::max(repeats, 1), fastest_);
  KEEL_CUDA_CHECK(cudaGetLastError());
  KEEL_CUDA_CHECK(cudaMemcpyAsync(host_, fastest_, sizeof(*host_), cudaMemcpyDeviceToHost, stream));
  KEEL_CUDA_CHECK(cudaEventRecord(copied_, stream));
  pending_ = true;
  return last;
}

double DeviceCanary::wait() {
  if (!pending_) return 0;
  KEEL_CUDA_CHECK(cudaEventSynchronize(copied_));
  pending_ = false;
  return static_cast<double>(*host_) * 1e-9;
}

}  // namespace keel
