// RMSNorm on the GPU: the CUDA twin of ops/rmsnorm.h, y = x * rstd * w with
// rstd = 1 / sqrt(mean(x^2) + eps), statistics in fp32.
//
// Shapes and dtypes: x [rows, dim] fp32 (the residual stream), w [dim] fp32, y [rows, dim] bf16
// (it feeds a GEMM), rstd [rows] fp32 (saved for backward; may be null when not needed),
// dy [rows, dim] bf16, dx [rows, dim] fp32, dw [dim] fp32. Saved for backward: x (the residual
// stream itself), rstd; w is the parameter.
//
// dx and dw are ACCUMULATED (+=), as in ops/rmsnorm.h (docs/ops.md, Gradient convention: the
// residual-stream exception): dx is the fp32 residual-stream gradient, which already holds the
// share that flows past the norm through the skip connection, so the norm adds its share to it
// (no extra buffer or add pass). dw is accumulated as every parameter gradient.
//
// One warp per row (float4 loads when dim % 4 == 0 and the pointers allow it). dw is reduced
// per block over a chunk of rows in registers and the per-chunk partials are added with one
// atomicAdd per (chunk, column), so dw matches the CPU op to fp32 rounding, not bit for bit.
#pragma once

#include <cstdint>

#include "ops/cuda/common.h"

namespace keel::ops::cuda::rmsnorm {

// y overwritten, rstd overwritten (skipped when null). rows may be 0.
void forward(const float* x, const float* w, float eps, bf16* y, float* rstd, std::int64_t rows, std::int64_t dim,
             cudaStream_t stream);

// With xhat = x * rstd and g = dy * w:
//   dx += rstd * (g - xhat * mean_d(g * xhat))   (accumulated, see above; skipped when null)
//   dw += sum_rows dy * xhat                      (accumulated; skipped when null)
void backward(const float* x, const float* w, const float* rstd, const bf16* dy, float* dx, float* dw,
              std::int64_t rows, std::int64_t dim, cudaStream_t stream);

}  // namespace keel::ops::cuda::rmsnorm
