// ZAYA1 residual scaling on the GPU: the CUDA twin of ops/residual_scale.h (same math, same
// aliasing rules), a per-channel bias and scale on a stream, y = (x + b) * s, and the merge of
// the fp32 residual r with the previous mixer's output h:
//   r_next = (r + b_r) * s_r + (h + b_h) * s_h
//
// Shapes and dtypes: x, y, r, out, dx, dr, dout [rows, dim] fp32 (the residual stream stays
// fp32, docs/gpu_training.md); h and dh [rows, dim] either bf16 (an attention block's output
// GEMM) or fp32 (the MoE combine): both overloads exist and compute in fp32. The vectors b, s,
// b_r, s_r, b_h, s_h and their gradients [dim] fp32.
// Gradients as the CPU op: dx, dr, dh OVERWRITTEN (dr too, though it is the residual stream's
// gradient: see ops/residual_scale.h); db, ds ACCUMULATED (+=). Any gradient pointer may be
// null to skip it. Saved for backward: the inputs (x, or r and h) and the
// parameters.
// Aliasing: y may alias x; out may alias r (or an fp32 h); dx may alias dy; dr may alias dout
// (in-place residual gradient); dh must not alias dout. Each element is read before it is
// written, by the same thread, so these are safe.
//
// Forward: one block per row. Backward: one pass, a thread per column over a chunk of rows,
// that reads dy (and the inputs the scale gradients need) once, writes the stream gradients and
// sums the parameter gradients; chunk partials are added with atomicAdd (plainly when one chunk
// covers all rows), so those match the CPU op to fp32 rounding, not bit for bit. rows may be 0.
// Launches only (no host sync).
#pragma once

#include <cstdint>

#include "ops/cuda/common.h"

namespace keel::ops::cuda::residual_scale {

// y = (x + b) * s.
void forward(const float* x, const float* b, const float* s, float* y, std::int64_t rows, std::int64_t dim,
             cudaStream_t stream);
// dx = dy * s;  db += sum_rows dy * s;  ds += sum_rows dy * (x + b).
void backward(const float* x, const float* b, const float* s, const float* dy, float* dx, float* db, float* ds,
              std::int64_t rows, std::int64_t dim, cudaStream_t stream);

// out = (r + b_r) * s_r + (h + b_h) * s_h.
void merge_forward(const float* r, const bf16* h, const float* b_r, const float* s_r, const float* b_h,
                   const float* s_h, float* out, std::int64_t rows, std::int64_t dim, cudaStream_t stream);
void merge_forward(const float* r, const float* h, const float* b_r, const float* s_r, const float* b_h,
                   const float* s_h, float* out, std::int64_t rows, std::int64_t dim, cudaStream_t stream);

// dr = dout * s_r, dh = dout * s_h (rounded to bf16 in the bf16 overload: it feeds the mixer's
// output-projection GEMM), and both branches' parameter gradients as in backward (from the
// fp32 dout, before any rounding).
void merge_backward(const float* r, const bf16* h, const float* b_r, const float* s_r, const float* b_h,
                    const float* s_h, const float* dout, float* dr, bf16* dh, float* db_r, float* ds_r, float* db_h,
                    float* ds_h, std::int64_t rows, std::int64_t dim, cudaStream_t stream);
void merge_backward(const float* r, const float* h, const float* b_r, const float* s_r, const float* b_h,
                    const float* s_h, const float* dout, float* dr, float* dh, float* db_r, float* ds_r, float* db_h,
                    float* ds_h, std::int64_t rows, std::int64_t dim, cudaStream_t stream);

}  // namespace keel::ops::cuda::residual_scale
