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

// kVec: param, grad, m, v 16-byte aligned (and param_bf16 8-byte aligned when present): float4
// body, element-wise tail.
template <bool kVec>
__global__ void update_kernel(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ m,
                              float* __restrict__ v, bf16* __restrict__ param_bf16, std::int64_t n, Scalars s,
                              const float* __restrict__ device_grad_scale) {
  float scale = s.grad_scale;
  if (device_grad_scale) {
    scale = __fmul_rn(scale, *device_grad_scale);
    if (!isfinite(scale)) return;  // a non-finite norm: the step is not applied (see adamw.h)
  }
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t tid = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  std::int64_t body = 0;
  if constexpr (kVec) {
    body = n / 4 * 4;
    for (std::int64_t q = tid; q < n / 4; q += stride) {
      float4 p4 = reinterpret_cast<float4*>(param)[q];
      const float4 g4 = reinterpret_cast<const float4*>(grad)[q];
      float4 m4 = reinterpret_cast<float4*>(m)[q];
      float4 v4 = reinterpret_cast<float4*>(v)[q];
      update_one(p4.x, g4.x, m4.x, v4.x, s, scale);
      update_one(p4.y, g4.y, m4.y, v4.y, s, scale);
      update_one(p4.z, g4.z, m4.z, v4.z, s, scale);
      update_one(p4.w, g4.w, m4.w, v4.w, s, scale);
      reinterpret_cast<float4*>(param)[q] = p4;
      reinterpret_cast<float4*>(m)[q] = m4;
      reinterpret_cast<float4*>(v)[q] = v4;
      if (param_bf16) {
        __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(param_bf16 + 4 * q);
        out[0] = __floats2bfloat162_rn(p4.x, p4.y);
        out[1] = __floats2bfloat162_rn(p4.z, p4.w);
      }
    }
  }
  for (std::int64_t i = body + tid; i < n; i += stride) {
    float p = param[i], mi = m[i], vi = v[i];
    update_one(p, grad[i], mi, vi, s, scale);
    param[i] = p;
    m[i] = mi;
    v[i] = vi;
    if (param_bf16) param_bf16[i] = __float2bfloat16(p);
  }
}

bool aligned(const void* p, int bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

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
  const bool vec = aligned(param, 16) && aligned(grad, 16) && aligned(m, 16) && aligned(v, 16) &&
                   (!param_bf16 || aligned(param_bf16, 8));
  const std::int64_t items = vec ? n / 4 + 4 : n;
  const unsigned grid = static_cast<unsigned>(std::min<std::int64_t>(grid_for(items, kThreads), 132 * 8));
  if (vec)
    update_kernel<true><<<grid, kThreads, 0, stream>>>(param, grad, m, v, param_bf16, n, s, device_grad_scale);
  else
    update_kernel<false><<<grid, kThreads, 0, stream>>>(param, grad, m, v, param_bf16, n, s, device_grad_scale);
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
