// Global gradient-norm clipping on the GPU without host syncs: the CUDA twin of
// optim/clip.h (torch's clip_grad_norm_): norm = sqrt(sum of g^2) accumulated in fp64,
// coefficient = min(1, max_norm / (norm + 1e-6)) (1 when max_norm <= 0).
//
// The flow of one step: sum_squares() over every gradient buffer this rank holds (accumulate
// = true after the first), all-reduce the fp64 sum across data-parallel ranks when sharded,
// clip_coefficient() on the device, then either pass the coefficient as AdamW's
// device_grad_scale (adamw.h; fused, one pass less) or scale_inplace() the gradients. Nothing
// here synchronizes the host; read *norm whenever the trainer syncs anyway (logging).
//
// Determinism: sum_squares uses a fixed grid for a given n and a fixed-order two-stage
// reduction (per-block fp64 partials into `workspace`, then one block sums them), so the same
// gradients give the same bits on every run. It matches optim::sum_squares to fp64 rounding.
//
// Non-finite gradients: the CPU path throws before touching anything; here the norm comes out
// inf/NaN, the coefficient is written as NaN, and both scale_inplace() and AdamW's device
// scale treat a non-finite scale as "do not apply" (gradients, parameters and states are left
// untouched). The trainer sees the non-finite *norm at its next sync and skips the step.
#pragma once

#include <cstdint>

#include "ops/cuda/common.h"

namespace keel::ops::cuda::grad_norm {

// fp64 elements the `workspace` of sum_squares must hold (per concurrent call).
inline constexpr int kWorkspaceDoubles = 1024;

// *sum_sq = sum_i double(g[i])^2 (or += when accumulate), i in [0, n). g fp32, sum_sq and
// workspace fp64, all device pointers. n may be 0 (writes 0, or adds nothing).
void sum_squares(const float* g, std::int64_t n, double* workspace, double* sum_sq, bool accumulate,
                 cudaStream_t stream);

// From the (all-reduced) sum of squares: *norm = sqrt(*sum_sq) (norm may be null) and
// *coef = float(min(1, max_norm / (norm + 1e-6))), 1 when max_norm <= 0, NaN when the norm is
// not finite. One thread; device pointers. parts > 1: the sum is sum_sq[0] + ... +
// sum_sq[parts - 1] (partial sums reduced over different groups).
void clip_coefficient(const double* sum_sq, double max_norm, float* coef, double* norm, cudaStream_t stream,
                      int parts = 1);

// g[i] *= *device_scale for i in [0, n); left untouched when the scale is not finite.
void scale_inplace(float* g, std::int64_t n, const float* device_scale, cudaStream_t stream);

}  // namespace keel::ops::cuda::grad_norm
