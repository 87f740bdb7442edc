// Helpers for the CUDA op tests: device arrays, bf16 round trips, fresh random inputs, and
// dtype-aware comparisons against the CPU reference ops.
// Every *_cuda_test.cc starts with KEEL_REQUIRE_GPU() so it skips cleanly where no GPU is
// visible (CI builds the CUDA code but has no GPU).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "device/cuda_check.h"
#include "device/cuda_devices.h"

#define KEEL_REQUIRE_GPU() \
  do {                     \
    if (::keel::visible_cuda_devices() == 0) GTEST_SKIP() << "no CUDA device visible"; \
  } while (0)

namespace keel::test {

// An owning device allocation of n elements of T (zero-filled so unwritten memory is visible
// as a failure of the caller's own poisoning, not as garbage).
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(std::size_t n) : n_(n) {
    if (n_) {
      KEEL_CUDA_CHECK(cudaMalloc(&p_, n_ * sizeof(T)));
      KEEL_CUDA_CHECK(cudaMemset(p_, 0, n_ * sizeof(T)));
    }
  }
  ~DeviceArray() { if (p_) cudaFree(p_); }
  DeviceArray(DeviceArray&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; o.n_ = 0; }
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const { return p_; }
  std::size_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

inline float bf16_round(float x) { return __bfloat162float(__float2bfloat16(x)); }

// Host floats -> device (as T: float or __nv_bfloat16).
template <typename T>
DeviceArray<T> to_device(const std::vector<float>& h) {
  DeviceArray<T> d(h.size());
  std::vector<T> tmp(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) tmp[i] = static_cast<T>(h[i]);
  if (!h.empty()) KEEL_CUDA_CHECK(cudaMemcpy(d.get(), tmp.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
template <>
inline DeviceArray<__nv_bfloat16> to_device<__nv_bfloat16>(const std::vector<float>& h) {
  DeviceArray<__nv_bfloat16> d(h.size());
  std::vector<__nv_bfloat16> tmp(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) tmp[i] = __float2bfloat16(h[i]);
  if (!h.empty())
    KEEL_CUDA_CHECK(cudaMemcpy(d.get(), tmp.data(), h.size() * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
  return d;
}

template <typename T>
std::vector<float> to_host(const DeviceArray<T>& d) {
  KEEL_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<T> tmp(d.size());
  if (d.size()) KEEL_CUDA_CHECK(cudaMemcpy(tmp.data(), d.get(), d.size() * sizeof(T), cudaMemcpyDeviceToHost));
  std::vector<float> h(d.size());
  for (std::size_t i = 0; i < d.size(); ++i) h[i] = static_cast<float>(tmp[i]);
  return h;
}
template <>
inline std::vector<float> to_host<__nv_bfloat16>(const DeviceArray<__nv_bfloat16>& d) {
  KEEL_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<__nv_bfloat16> tmp(d.size());
  if (d.size())
    KEEL_CUDA_CHECK(cudaMemcpy(tmp.data(), d.get(), d.size() * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost));
  std::vector<float> h(d.size());
  for (std::size_t i = 0; i < d.size(); ++i) h[i] = __bfloat162float(tmp[i]);
  return h;
}

// Fresh random inputs: uniform in [lo, hi), seeded per test so failures reproduce. Never zeros.
inline std::vector<float> random_vector(std::size_t n, std::uint64_t seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

// Rounds every element to bf16 (so the CPU reference sees exactly the GPU's inputs).
inline std::vector<float> rounded_bf16(std::vector<float> v) {
  for (auto& x : v) x = bf16_round(x);
  return v;
}

// Element-wise |got - want| <= atol + rtol * |want|; reports the worst element and how many
// fail. Use rtol ~ 1e-2 for bf16 outputs (8 mantissa bits), ~1e-5 for fp32 elementwise.
inline ::testing::AssertionResult all_close(const std::vector<float>& got, const std::vector<float>& want, float rtol,
                                            float atol, const std::string& what = "") {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << what << ": size " << got.size() << " != " << want.size();
  std::size_t bad = 0, worst = 0;
  double worst_excess = -1;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    const double tol = atol + rtol * std::fabs(static_cast<double>(want[i]));
    const double excess = std::isfinite(got[i]) ? err - tol : 1e30;
    if (excess > 0) ++bad;
    if (excess > worst_excess) worst_excess = excess, worst = i;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << got.size() << " elements off; worst at "
                                       << worst << ": got " << got[worst] << ", want " << want[worst] << " (rtol "
                                       << rtol << ", atol " << atol << ")";
}

// int32 host values -> device, and back (the device copy synchronizes first).
inline DeviceArray<std::int32_t> ints_to_device(const std::vector<std::int32_t>& h) {
  DeviceArray<std::int32_t> d(h.size());
  if (!h.empty()) KEEL_CUDA_CHECK(cudaMemcpy(d.get(), h.data(), h.size() * 4, cudaMemcpyHostToDevice));
  return d;
}
inline std::vector<std::int32_t> ints_to_host(const std::int32_t* d, std::size_t n) {
  KEEL_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<std::int32_t> h(n);
  if (n) KEEL_CUDA_CHECK(cudaMemcpy(h.data(), d, n * 4, cudaMemcpyDeviceToHost));
  return h;
}

// a - b elementwise (e.g. an accumulated gradient minus its starting value).
inline std::vector<float> minus(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> r(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) r[i] = a[i] - b[i];
  return r;
}

// ||got - want|| / ||want||, the error measure for bf16 paths; a non-finite element of got
// counts as an infinite error.
inline double norm_rel_err(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    num += std::isfinite(got[i]) ? d * d : 1e30;
    den += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// The same over [begin, begin + n) of two flat buffers (one parameter of a flat parameter or
// gradient buffer); where want is all zero, the absolute ||got||.
inline double norm_rel_err(const std::vector<float>& got, const std::vector<float>& want, std::int64_t begin,
                           std::int64_t n) {
  double num = 0, den = 0;
  for (std::int64_t i = begin; i < begin + n; ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d;
    den += static_cast<double>(want[i]) * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Raw copies of any element type (no conversion), for ids, positions and the ops' own dtypes.
template <typename T>
DeviceArray<T> upload_raw(const std::vector<T>& h) {
  DeviceArray<T> d(h.size());
  if (!h.empty()) KEEL_CUDA_CHECK(cudaMemcpy(d.get(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <typename T>
std::vector<T> download_raw(const T* d, std::size_t n) {
  KEEL_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<T> h(n);
  if (n) KEEL_CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

inline std::vector<float> download_f32(const float* d, std::size_t n) { return download_raw(d, n); }
inline std::vector<float> download_bf16(const __nv_bfloat16* d, std::size_t n) {
  const auto raw = download_raw(d, n);
  std::vector<float> h(n);
  for (std::size_t i = 0; i < n; ++i) h[i] = __bfloat162float(raw[i]);
  return h;
}

// norm_rel_err, also printed so the log documents the measured gap.
inline double logged_rel_err(const char* what, const std::vector<float>& got, const std::vector<float>& want) {
  const double e = norm_rel_err(got, want);
  std::printf("    %-14s norm-relative error %.2e\n", what, e);
  return e;
}

}  // namespace keel::test
