// What the GPU op benchmarks (bench linattn, bench kernels) share: device buffers that free
// themselves, random bf16 fills from a seed, and the median of CUDA-event timings. Included only
// from *_cuda.cc files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/error.h"
#include "device/cuda_check.h"

namespace keel::bench {

// `what` names the benchmark in the out-of-memory line.
class DeviceBuffer {
 public:
  DeviceBuffer(std::size_t bytes, const std::string& what) {
    if (cudaMalloc(&p_, std::max<std::size_t>(bytes, 256)) != cudaSuccess) {
      cudaGetLastError();
      throw UsageError(fmt::format("{}: out of GPU memory ({} bytes)", what, bytes));
    }
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  void* get() const { return p_; }

 private:
  void* p_ = nullptr;
};

// n bf16 values drawn from N(0, scale^2) with `seed`.
inline void fill_normal_bf16(__nv_bfloat16* d, std::int64_t n, float scale, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.f, scale);
  std::vector<__nv_bfloat16> h(static_cast<std::size_t>(n));
  for (auto& x : h) x = __float2bfloat16(g(rng));
  KEEL_CUDA_CHECK(cudaMemcpy(d, h.data(), sizeof(__nv_bfloat16) * h.size(), cudaMemcpyHostToDevice));
}

// The median over `iters` runs of fn() (after `warmup` untimed ones), between two events on s;
// prep() is enqueued before each run's first event (untimed: the inputs a run consumes).
template <class Fn, class Prep>
double median_ms(int warmup, int iters, cudaStream_t s, Fn&& fn, Prep&& prep) {
  cudaEvent_t a, b;
  KEEL_CUDA_CHECK(cudaEventCreate(&a));
  KEEL_CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) prep(), fn();
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    prep();
    KEEL_CUDA_CHECK(cudaEventRecord(a, s));
    fn();
    KEEL_CUDA_CHECK(cudaEventRecord(b, s));
    KEEL_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    KEEL_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

template <class Fn>
double median_ms(int warmup, int iters, cudaStream_t s, Fn&& fn) {
  return median_ms(warmup, iters, s, fn, [] {});
}

}  // namespace keel::bench
