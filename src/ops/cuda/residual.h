// Residual-stream updates on the GPU: a bf16 branch output (attention or MoE block, straight
// from a GEMM) is added into the fp32 residual stream, resid += y or resid += s * y.
//
// The residual stream stays fp32 across the whole network so that many small bf16 updates do
// not lose their low bits; these adds are where the two dtypes meet. resid is updated in place
// (accumulated). Backward of an add needs no kernel of its own: the branch's gradient is the
// residual gradient itself (cast it with cast.h's f32_to_bf16 for the GEMMs; times s for the
// scaled variant). For ZAYA1's learned per-channel residual scaling see ops/residual_scale.h.
#pragma once

#include <cstdint>

#include "ops/cuda/common.h"

namespace keel::ops::cuda::residual {

// resid[i] += float(y[i]) for i in [0, n).
void add_bf16_into_f32(const bf16* y, float* resid, std::int64_t n, cudaStream_t stream);

// resid[i] += scale * float(y[i]) for i in [0, n).
void add_scaled_bf16_into_f32(const bf16* y, float scale, float* resid, std::int64_t n, cudaStream_t stream);

}  // namespace keel::ops::cuda::residual
