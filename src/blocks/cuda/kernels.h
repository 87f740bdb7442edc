// Small kernels the GPU blocks need between ops (CUDA only): elementwise adds, and the row
// packing around the dropless experts for ZAYA1's MLP router, whose skip class must not reach
// ops/cuda/moe.h (make_plan accepts expert indices in [0, E) only).
#pragma once

#include <cstdint>

#include "ops/cuda/common.h"

namespace keel::blocks::cuda {

using ops::cuda::bf16;

// out = a + b (fp32, n elements; out may alias a or b).
void add_f32(const float* a, const float* b, float* out, std::int64_t n, cudaStream_t stream);
// out = bf16(float(a) + float(b)) (n elements; out may alias a or b).
void add_bf16(const bf16* a, const bf16* b, bf16* out, std::int64_t n, cudaStream_t stream);

// Packs the tokens routed to an expert (idx[n] < experts; every other class is the skip class):
// kept[0, nk) their rows in increasing order, kept_idx[0, nk) their expert, pos[n] the packed row
// of token n or -1 when skipped, and *count = nk (device int). All int32, device; n <= 2^31 - 1.
// One block (a sequential scan over n: fine for a micro-batch's tokens). No host sync.
void pack_routed(const std::int32_t* idx, std::int64_t n, int experts, std::int32_t* kept, std::int32_t* kept_idx,
                 std::int32_t* pos, std::int32_t* count, cudaStream_t stream);

// dst[i, :] = src[rows[i], :] for i < count; rows [count] int32; width columns per row.
void gather_rows(const bf16* src, const std::int32_t* rows, std::int64_t count, std::int64_t width, bf16* dst,
                 cudaStream_t stream);
void gather_rows(const float* src, const std::int32_t* rows, std::int64_t count, std::int64_t width, float* dst,
                 cudaStream_t stream);

// dst[n, :] = pos[n] >= 0 ? src[pos[n], :] : 0 for n < n_rows (dst overwritten on every row).
void unpack_rows(const float* src, const std::int32_t* pos, std::int64_t n_rows, std::int64_t width, float* dst,
                 cudaStream_t stream);

// The gradient of the MoE stage's input through the experts, fp32: dx[n, :] = pos[n] >= 0 ?
// dxk[pos[n], :] (the experts' packed bf16 dx) : 0 (a skipped token's MoE output is 0). dx
// overwritten on every row.
void unpack_moe_dx(const bf16* dxk, const std::int32_t* pos, std::int64_t n_rows, std::int64_t width, float* dx,
                   cudaStream_t stream);

}  // namespace keel::blocks::cuda
