// Element-type conversions between the bf16 activations and the fp32 statistics/gradients of
// the CUDA ops, plus the in-place matrix scale the GEMM seam needs when k == 0.
//
// All pointers are device pointers; every function launches on `stream` and returns without
// synchronizing the host. Any n >= 0 is accepted, including counts that are not a multiple of
// the vector width and pointers that are not vector-aligned (the misaligned head and the tail
// are converted element by element; the body uses 16-byte loads when both sides allow it).
// Rounding fp32 -> bf16 is round-to-nearest-even, the same as __float2bfloat16.
#pragma once

#include <cstdint>

#include "ops/cuda/common.h"

namespace keel::ops::cuda {

// out[i] = bf16(in[i]) for i in [0, n). `out` is overwritten.
void f32_to_bf16(const float* in, bf16* out, std::int64_t n, cudaStream_t stream);

// out[i] = float(in[i]) for i in [0, n) (exact). `out` is overwritten.
void bf16_to_f32(const bf16* in, float* out, std::int64_t n, cudaStream_t stream);

// acc[i] += float(in[i]) for i in [0, n): folds a bf16 gradient into an fp32 accumulator.
void add_bf16_to_f32(const bf16* in, float* acc, std::int64_t n, cudaStream_t stream);

// c = beta * c in place for `batch` row-major [rows, cols] matrices with leading dimension ld
// (>= cols) whose starts are `stride` elements apart. beta == 0 writes exact zeros, so NaN or
// Inf left in c by an earlier buffer use does not survive (the BLAS convention). This is the
// whole GEMM when k == 0 (GemmRunner).
void scale_matrix_f32(float* c, std::int64_t rows, std::int64_t cols, std::int64_t ld, int batch, std::int64_t stride,
                      float beta, cudaStream_t stream);
void scale_matrix_bf16(bf16* c, std::int64_t rows, std::int64_t cols, std::int64_t ld, int batch, std::int64_t stride,
                       float beta, cudaStream_t stream);

}  // namespace keel::ops::cuda
