// Small CUDA kernels of GPU decoding that no op of src/ops/cuda covers: positions, cache rows,
// and CCA's per-token state updates (its conv states and previous-token value half), used by the
// attention over a cache (attention_decode.h), and the greedy argmax of the decoder's driver
// (generate/cuda_decoder_cuda.cc). Included only from .cu and *_cuda.cc files.
//
// The CCA step kernels compute, for one new token per sequence, exactly what ops/cuda/cca.h's
// forward computes for the last token of a sequence (same fp32 summation orders, same bf16
// roundings: the depthwise output is bf16, as the CUDA CCA keeps c0), so prefill and decode
// agree to rounding of the GEMMs over different row counts.
#pragma once

#include <cstdint>

#include "ops/cuda/common.h"

namespace keel::blocks::cuda {

using ops::cuda::bf16;

// positions[i] = offset + i % T for i < n.
void fill_positions(std::int32_t* positions, std::int64_t n, int T, int offset, cudaStream_t stream);

// Row copies between row-strided buffers (cudaMemcpy2DAsync): `rows` rows of `width` elements
// of elem_bytes each; dst rows dst_pitch elements apart, src rows src_pitch elements apart.
void copy_rows(void* dst, std::int64_t dst_pitch, const void* src, std::int64_t src_pitch, std::int64_t width,
               std::int64_t rows, std::size_t elem_bytes, cudaStream_t stream);

// dst[b, j, :] = src[b, rows - count + j, :] when that row index is >= 0, else zeros.
// src [B, rows, width], dst [B, count, width], bf16. count may be 0.
void tail_rows(const bf16* src, std::int64_t B, std::int64_t rows, std::int64_t width, int count, bf16* dst,
               cudaStream_t stream);

// dst[r, :] = bf16(v) for r < rows: CCA's grouped-conv state before a sequence (the depthwise
// output of all-zero input is its bias).
void broadcast_row(const float* v, std::int64_t width, std::int64_t rows, bf16* dst, cudaStream_t stream);

// CCA depthwise conv of the new token: c0[b, c] = bf16(b0[c] + sum_k w0[c, k] x_k) over the
// W0 - 1 state rows (oldest first) and the new qk0 row; then the state slides by one row.
// qk0, c0 [B, C]; state0 [B, W0 - 1, C] (bf16); w0 [C, W0], b0 [C] fp32.
void cca_depthwise_step(const bf16* qk0, const float* w0, const float* b0, bf16* state0, bf16* c0, std::int64_t B,
                        std::int64_t C, int W0, cudaStream_t stream);

// CCA grouped conv of the new token (one group per head: inputs W1 - 1 state rows and the new
// c0 row), the mixing terms, the L2 normalization with sqrt(d) (and temp for k heads): q
// [B, nq d], k [B, nkv d] in bf16, before RoPE; then the grouped-conv state slides by one row.
// state1 [B, W1 - 1, C] bf16; w1 [C, d, W1], b1 [C], temp [nkv] fp32.
void cca_grouped_step(const bf16* qk0, const bf16* c0, const float* w1, const float* b1, const float* temp,
                      bf16* state1, bf16* q, bf16* k, std::int64_t B, int nq, int nkv, int d, int W1, float l2_eps,
                      cudaStream_t stream);

// CCA values of the new token at cache row `pos`: v = [u[:half] | prev], then prev = u[half:]
// (the next token's previous-token half). u [B, dk], prev [B, dk / 2], v_cache [B, capacity, dk].
void cca_value_step(const bf16* u, bf16* prev, bf16* v_cache, std::int64_t B, std::int64_t dk, std::int64_t capacity,
                    std::int64_t pos, cudaStream_t stream);

// out[r] = argmax over v < allowed of logits[r, v] (ties to the lower id) for r < rows;
// logits [rows, V] fp32. One block per row. A row with a NaN or infinite logit below `allowed`
// gives 0xFFFFFFFF (generate.h's kNonFiniteLogits).
void argmax_rows(const float* logits, std::int64_t rows, std::int64_t V, std::int64_t allowed, std::uint32_t* out,
                 cudaStream_t stream);

}  // namespace keel::blocks::cuda
