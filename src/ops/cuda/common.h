// Shared pieces of the CUDA ops (src/ops/cuda): the element types and launch helpers.
//
// Conventions of every CUDA op (docs/gpu_training.md has the whole contract):
//  - Pointers are device pointers; shapes are passed as explicit extents (row-major, contiguous
//    unless a leading dimension says otherwise); every launch takes a cudaStream_t and never
//    synchronizes the host unless its header says so.
//  - Activations are bf16, statistics (norm rstd, softmax lse, router probabilities) fp32,
//    parameter gradients fp32 and accumulated (+=), activation gradients overwritten, exactly
//    as the CPU reference ops in src/ops document.
//  - Included only from .cu files and *_cuda.cc / *_cuda_test.cc: a CPU-only build never sees it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "device/cuda_check.h"

namespace keel::ops::cuda {

using bf16 = __nv_bfloat16;

// Blocks of `threads` covering n items, at least one.
inline unsigned grid_for(std::int64_t n, int threads) {
  const std::int64_t g = (n + threads - 1) / threads;
  return static_cast<unsigned>(g < 1 ? 1 : g);
}

// Checks the last launch (a bad configuration shows up here, not at the next sync).
#define KEEL_CUDA_CHECK_LAUNCH() KEEL_CUDA_CHECK(cudaGetLastError())

}  // namespace keel::ops::cuda
