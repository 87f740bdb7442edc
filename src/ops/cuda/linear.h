// CUDA linear layer without bias: y = x W^T, the nn.Linear convention (W is [out, in]); the
// same math as src/ops/linear.h with an empty bias, on bf16 operands with fp32 accumulation.
//
// Shapes (row-major, contiguous): x [n, in] bf16, w [out, in] bf16, y/dy [n, out] bf16,
// dx [n, in] bf16, dw [out, in] fp32. n is tokens (B*T flattened).
// Gradient convention (docs/ops.md): dx is OVERWRITTEN; dw is ACCUMULATED (+=) in fp32, so
// micro-batches and tied weights sum into one gradient buffer. Either may be null to skip computing it.
// Saved for backward: x and w. Nothing else.
// Every call is three or fewer GEMMs on `stream` through `gemm`; none synchronizes the host.
// Bad extents (negative) throw keel::Error.
#pragma once

#include <cstdint>

#include "ops/cuda/common.h"
#include "ops/cuda/gemm.h"

namespace keel::ops::cuda::linear {

// y [n, out] = x [n, in] W^T, rounded to bf16. y is overwritten.
void forward(GemmRunner& gemm, const bf16* x, const bf16* w, bf16* y, std::int64_t n, std::int64_t in,
             std::int64_t out, cudaStream_t stream);

// The same product kept in fp32 (no bf16 rounding of y): for the router logits, whose softmax
// and top-k want full precision. y is overwritten.
void forward_f32(GemmRunner& gemm, const bf16* x, const bf16* w, float* y, std::int64_t n, std::int64_t in,
                 std::int64_t out, cudaStream_t stream);

// dy [n, out] -> dx [n, in] = dy W (overwritten; zeros when out == 0) and
// dw [out, in] += dy^T x (fp32; untouched when n == 0).
void backward(GemmRunner& gemm, const bf16* x, const bf16* w, const bf16* dy, bf16* dx, float* dw, std::int64_t n,
              std::int64_t in, std::int64_t out, cudaStream_t stream);

}  // namespace keel::ops::cuda::linear
