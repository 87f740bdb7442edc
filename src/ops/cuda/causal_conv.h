// Causal 1-D convolutions over time on the GPU: the CUDA twin of ops/causal_conv.h (ZAYA1's CCA
// `conv_qk`: a depthwise conv, then a grouped conv with one group per head, both with bias, on
// a single up-front left padding that `extra` / `lead` reproduce exactly; the header of the CPU
// op has the indexing). Same math, same weight layouts (PyTorch Conv1d), per sequence.
//
// Shapes and dtypes (B sequences of T tokens, C channels; weights and biases fp32, as the
// parameters are):
//   depthwise: x [B, T, C] bf16 (the W_qk GEMM output), w [C, W] fp32, b [C] fp32 or null,
//              y [B, T + extra, C] bf16 (it is saved, and is the grouped conv's input).
//   grouped:   x [B, T + W - 1, C] bf16, w [C, Cg, W] fp32 (re-laid out in bf16 for the GEMMs,
//              below), b [C] fp32 or null, y [B, T, C] fp32 (CCA adds the mixing terms and
//              L2-normalizes it in fp32).
//   backward:  dy fp32 (the shape of y), dx fp32 (the shape of x), dw, db fp32.
// Gradients: dx OVERWRITTEN; dw, db ACCUMULATED (+=); any may be null. Widths W in
// [1, kMaxWidth]; extra >= 0. B or T == 0 runs nothing. Launches only.
//
// Halo (depthwise, optional; the CPU op's): halo [B, P, C] bf16 with P = extra + W - 1 holds
// the inputs at times -P .. -1 (row h is time h - P) instead of zeros: the tokens before a run of
// a split sequence (ops/cuda/sequence_split.h). Backward's dhalo (fp32, same layout,
// OVERWRITTEN) is their gradient, and dw reads the halo. halo_stride: elements from one
// sequence's halo (and dhalo) to the next; 0 = P * C (packed), larger for halos inside wider
// rows (CCA's [runs, F] halos). Null halo: zeros, exactly the results without one.
//
// The depthwise conv runs on CUDA cores in fp32: one block per row for it and its dx, and for
// its dw and db threads over channels with row chunks summed by atomicAdd, so dw and db match
// the CPU op to fp32 rounding, not bit for bit.
//
// The grouped conv runs on tensor cores: per tap k the conv is one GEMM per head,
// y_h[t] += x_h[t + k] W_k,h^T (Cg x Cg), run as a strided batch over the heads through the
// GEMM seam with bf16 operands and fp32 accumulation and output. The weights are re-laid out
// tap-major in bf16 first (grouped_weights_bf16: [C, Cg, W] fp32 -> [W, C, Cg]), and backward
// rounds dy to bf16 (the GEMM operand), so it agrees with the CPU op to bf16 rounding
// (norm-relative ~1e-3). It takes only CCA's layout, lead = W - 1 (the CPU op's `lead`): with
// W - 1 rows of padding between sequences, a zero-padded copy of dy lets dx and dw run one GEMM
// per tap over all sequences at once (the padding rows contribute zeros), and the forward runs
// one per tap and sequence.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/cuda/common.h"
#include "ops/cuda/gemm.h"

namespace keel::ops::cuda::causal_conv {

inline constexpr int kMaxWidth = 8;

void depthwise_forward(const bf16* x, const float* w, const float* b, int extra, bf16* y, std::int64_t B,
                       std::int64_t T, std::int64_t C, int W, cudaStream_t stream, const bf16* halo = nullptr,
                       std::int64_t halo_stride = 0);
// dy [B, T + extra, C] -> dx [B, T, C] and dhalo [B, P, C] (overwritten), dw [C, W] and db [C] (+=).
void depthwise_backward(const bf16* x, const float* w, int extra, const float* dy, float* dx, float* dw, float* db,
                        std::int64_t B, std::int64_t T, std::int64_t C, int W, cudaStream_t stream,
                        const bf16* halo = nullptr, float* dhalo = nullptr, std::int64_t halo_stride = 0);

// The grouped conv (header comment). wt [W, C, Cg] bf16 from
// grouped_weights_bf16 (forward makes it; backward reuses it).
void grouped_weights_bf16(const float* w, bf16* wt, std::int64_t C, std::int64_t Cg, int W, cudaStream_t stream);
// x [B, T + W - 1, C] bf16 -> y [B, T, C] fp32 (overwritten; b added when not null).
void grouped_forward_gemm(GemmRunner& gemm, const bf16* x, const bf16* wt, const float* b, float* y, std::int64_t B,
                          std::int64_t T, std::int64_t C, std::int64_t Cg, int W, cudaStream_t stream);
// Device scratch of grouped_backward_gemm (256-byte aligned regions; contents ignored).
std::size_t grouped_backward_gemm_scratch_bytes(std::int64_t B, std::int64_t T, std::int64_t C, std::int64_t Cg,
                                                int W);
// dy [B, T, C] fp32 -> dx [B, T + W - 1, C] fp32 (overwritten), dw [C, Cg, W] and db [C] (+=).
void grouped_backward_gemm(GemmRunner& gemm, const bf16* x, const bf16* wt, const float* dy, float* dx, float* dw,
                           float* db, std::int64_t B, std::int64_t T, std::int64_t C, std::int64_t Cg, int W,
                           void* scratch, cudaStream_t stream);

}  // namespace keel::ops::cuda::causal_conv
