#include "ops/cuda/adamw.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"

namespace keel::ops::cuda::adamw {

namespace {

constexpr int kThreads = 256;

// The per-call scalars, each computed in double and rounded once, as optim::adamw_update does.
struct Scalars {
  float b1, b2, one_b1, one_b2, keep, step_size, inv_sqrt_bc2, eps, grad_scale;
};

Scalars make_scalars(const Hyper& h, std::int64_t t, float grad_scale) {
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(t));
  Scalars s;
  s.b1 = static_cast<float>(h.beta1);
  s.b2 = static_cast<float>(h.beta2);
  s.one_b1 = static_cast<float>(1.0 - h.beta1);
  s.one_b2 = static_cast<float>(1.0 - h.beta2);
  s.keep = static_cast<float>(1.0 - h.lr * h.weight_decay);
  s.step_size = static_cast<float>(h.lr / bc1);
  s.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  s.eps = static_cast<float>(h.eps);
  s.grad_scale = grad_scale;
  return s;
}

// Explicitly rounded operations: nvcc would otherwise contract a * b + c into one FMA and the
// result would no longer be the CPU optimizer's.
__device__ inline float update_one(float& p, float grad, float& m, float& v, const Scalars& s, float scale) {
  const float g = __fmul_rn(scale, grad);
  const float mi = __fadd_rn(__fmul_rn(s.b1, m), __fmul_rn(s.one_b1, g));
  const float vi = __fadd_rn(__fmul_rn(s.b2, v), __fmul_rn(s.one_b2, __fmul_rn(g, g)));
  m = mi;
  v = vi;
  const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(vi), s.inv_sqrt_bc2), s.eps);
  p = __fsub_rn(__fmul_rn(p, s.keep), __fdiv_rn(__fmul_rn(s.step_size, mi), denom));
  return p;
}

// The vector path: param, grad, m, v 16-byte aligned (param_bf16 8-byte aligned when present).
// One launch covers the whole range, kVecPerThread float4s per thread, all of a thread's loads
// issued before any math: AdamW reads 16 and writes 14 bytes per element, so it is bound by
// HBM bandwidth and wants many bytes in flight (the one-shot shape that does best in
// bench/mem). On an H200 this runs at about 3.7 TB/s, 3% above the grid-stride loop it
// replaced (docs/PERFORMANCE.md). param, grad, m and v are touched once per step, so they are
// loaded and stored evict-first (ld/st.global.cs) and leave L2 to what the next forward reads;
// the bf16 copy is stored plainly. Elements [0, 4 n4); the < 4 left go to update_tail_kernel.
constexpr int kVecThreads = 256;
constexpr int kVecPerThread = 2;

__global__ void update_vec_kernel(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ m,
                                  float* __restrict__ v, bf16* __restrict__ param_bf16, std::int64_t n4, Scalars s,
                                  const float* __restrict__ device_grad_scale) {
  const float scale = effective_grad_scale(s.grad_scale, device_grad_scale);
  if (!isfinite(scale)) return;  // a non-finite norm: the step is not applied (see adamw.h)
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * (kVecThreads * kVecPerThread) + threadIdx.x;
  float4 p4[kVecPerThread], g4[kVecPerThread], m4[kVecPerThread], v4[kVecPerThread];
#pragma unroll
  for (int j = 0; j < kVecPerThread; ++j) {
    const std::int64_t q = first + j * kVecThreads;
    if (q < n4) {
      p4[j] = __ldcs(reinterpret_cast<const float4*>(param) + q);
      g4[j] = __ldcs(reinterpret_cast<const float4*>(grad) + q);
      m4[j] = __ldcs(reinterpret_cast<const float4*>(m) + q);
      v4[j] = __ldcs(reinterpret_cast<const float4*>(v) + q);
    }
  }
#pragma unroll
  for (int j = 0; j < kVecPerThread; ++j) {
    const std::int64_t q = first + j * kVecThreads;
    if (q >= n4) continue;
    update_one(p4[j].x, g4[j].x, m4[j].x, v4[j].x, s, scale);
    update_one(p4[j].y, g4[j].y, m4[j].y, v4[j].y, s, scale);
    update_one(p4[j].z, g4[j].z, m4[j].z, v4[j].z, s, scale);
    update_one(p4[j].w, g4[j].w, m4[j].w, v4[j].w, s, scale);
    __stcs(reinterpret_cast<float4*>(param) + q, p4[j]);
    __stcs(reinterpret_cast<float4*>(m) + q, m4[j]);
    __stcs(reinterpret_cast<float4*>(v) + q, v4[j]);
    if (param_bf16) {
      __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(param_bf16 + 4 * q);
      out[0] = __floats2bfloat162_rn(p4[j].x, p4[j].y);
      out[1] = __floats2bfloat162_rn(p4[j].z, p4[j].w);
    }
  }
}

// Elements [begin, n) one at a time, grid-stride: the unaligned path (begin = 0) and the < 4
// elements past the vector body.
__global__ void update_tail_kernel(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ m,
                                   float* __restrict__ v, bf16* __restrict__ param_bf16, std::int64_t begin,
                                   std::int64_t n, Scalars s, const float* __restrict__ device_grad_scale) {
  const float scale = effective_grad_scale(s.grad_scale, device_grad_scale);
  if (!isfinite(scale)) return;  // a non-finite norm: the step is not applied (see adamw.h)
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = begin + static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float p = param[i], mi = m[i], vi = v[i];
    update_one(p, grad[i], mi, vi, s, scale);
    param[i] = p;
    m[i] = mi;
    v[i] = vi;
    if (param_bf16) param_bf16[i] = __float2bfloat16(p);
  }
}


}  // namespace

void update(float* param, const float* grad, float* m, float* v, bf16* param_bf16, std::int64_t n, const Hyper& h,
            std::int64_t t, float grad_scale, const float* device_grad_scale, cudaStream_t stream) {
  if (t < 1) fail("adamw: step must be >= 1, got {}", t);
  if (n < 0) fail("adamw: element count must be >= 0, got {}", n);
  if (!(std::isfinite(h.lr) && h.lr >= 0)) fail("adamw: lr must be finite and >= 0, got {}", h.lr);
  if (!std::isfinite(grad_scale)) fail("adamw: grad_scale is not finite ({})", grad_scale);
  optim::validate(optim::AdamWConfig{h.beta1, h.beta2, h.eps, h.weight_decay});
  if (n == 0) return;
  const Scalars s = make_scalars(h, t, grad_scale);
  const bool vec = aligned_to(param, 16) && aligned_to(grad, 16) && aligned_to(m, 16) && aligned_to(v, 16) &&
                   (!param_bf16 || aligned_to(param_bf16, 8));
  const std::int64_t n4 = vec ? n / 4 : 0;
  if (n4 > 0) {
    const std::int64_t per_block = kVecThreads * kVecPerThread;
    update_vec_kernel<<<static_cast<unsigned>((n4 + per_block - 1) / per_block), kVecThreads, 0, stream>>>(
        param, grad, m, v, param_bf16, n4, s, device_grad_scale);
    KEEL_CUDA_CHECK_LAUNCH();
  }
  const std::int64_t rest = n - 4 * n4;
  if (rest == 0) return;
  const unsigned grid = static_cast<unsigned>(std::min<std::int64_t>(grid_for(rest, kThreads), 132 * 8));
  update_tail_kernel<<<grid, kThreads, 0, stream>>>(param, grad, m, v, param_bf16, 4 * n4, n, s, device_grad_scale);
  KEEL_CUDA_CHECK_LAUNCH();
}

DeviceAdamW::DeviceAdamW(const optim::AdamWConfig& c) : c_(c) { optim::validate(c_); }

void DeviceAdamW::set_step_count(std::int64_t t) {
  if (t < 0) fail("adamw: step count must be >= 0, got {}", t);
  t_ = t;
}

void DeviceAdamW::step(const optim::ParamLayout& layout, const DeviceFlatRange& r, double lr, float grad_scale,
                       const float* device_grad_scale, cudaStream_t stream) {
  if (r.begin < 0 || r.end < r.begin || r.end > layout.total_floats)
    fail("adamw: range [{}, {}) is outside the flat buffer of {} floats", r.begin, r.end, layout.total_floats);
  if (!(std::isfinite(lr) && lr >= 0)) fail("adamw: lr must be finite and >= 0, got {}", lr);
  if (!std::isfinite(grad_scale)) fail("adamw: grad_scale is not finite ({})", grad_scale);
  ++t_;
  for (const auto& p : layout.params) {
    if (p.optimizer != optim::OptimizerKind::kAdamW) continue;
    const std::int64_t b = std::max(p.offset, r.begin), e = std::min(p.offset + p.numel, r.end);
    if (b >= e) continue;
    const std::int64_t k = b - r.begin;
    // The same double expressions as optim::adamw_update: lr * lr_scale, then lr * wd.
    const Hyper h{lr * p.lr_scale, c_.beta1, c_.beta2, c_.eps, p.weight_decay ? c_.weight_decay : 0.0};
    update(r.param + k, r.grad + k, r.m + k, r.v + k, r.param_bf16 ? r.param_bf16 + k : nullptr, e - b, h, t_,
           grad_scale, device_grad_scale, stream);
  }
}

}  // namespace keel::ops::cuda::adamw
