// Small elementwise kernels the GPU training backend needs between ops (CUDA only).
#pragma once

#include <cstdint>

#include "ops/cuda/common.h"

namespace keel::train::cuda {

// out = a + b (fp32, n elements; out may alias a or b).
void add_f32(const float* a, const float* b, float* out, std::int64_t n, cudaStream_t stream);

}  // namespace keel::train::cuda
