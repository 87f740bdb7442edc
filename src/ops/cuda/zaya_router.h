// ZAYA1's MLP router on the GPU: the CUDA twin of ops/zaya_router.h (EDA, RMSNorm, the
// three-layer GELU MLP, fp32 softmax with the biased top-1 selection and the skip class). The
// math and the gradient flow are the CPU op's; this file composes the existing CUDA ops
// (linear, rmsnorm, router, cast) with a few small fused kernels of its own (bias + GELU, GELU
// backward + bias gradient, the EDA backward). Per token n:
//   state = x W_down^T + b_down + gamma * prev_state       fp32 (no EDA when prev_state null)
//   u     = RMSNorm(state; w_norm, eps)                    bf16 (feeds the W_1 GEMM)
//   z1    = u W_1^T + b_1 (fp32),  h1 = GELU(z1) (bf16);  z2, h2 likewise with W_2, b_2
//   logits = h2 W_3^T (fp32);  probs, lse, idx, gates, counts: cuda::router, top_k 1, no
//   renormalization, `bias` selects only (ties to the lower class index, as the CPU op)
// GELU is the exact erf form (nn.GELU()).
//
// Dtypes: x [N, H] bf16 (the MoE stage's RMSNorm output); GEMM weights (w_down, w1, w2, w3)
// bf16 copies; b_down, gamma, w_norm, b1, b2, bias [D] / [E] fp32; state, prev_state,
// dstate_next, dprev_state [N, D] fp32; dgates [N] fp32; dx [N, H] bf16; every parameter
// gradient fp32. Counts are int32 (as cuda::router; the CPU op has int64).
// Gradients: dx and dprev_state OVERWRITTEN (dprev_state zeroed when prev_state is null),
// parameter gradients ACCUMULATED (+=); any gradient pointer may be null. The balancing bias
// and the selection carry no gradient; the gate carries the router's.
// Bias gradients (b_down, b1, b2) and dgamma are column sums with per-chunk atomicAdds: equal
// to the CPU op to fp32 rounding, not bit for bit. No host sync anywhere.
//
// The MoD skip class (class E - 1 in ZAYA1): its MoE output is 0 (ops/zaya_router.h).
// skip_forward / skip_backward write the skip tokens' rows (y = 0; dx = 0, dgates = 0) and
// leave every other row untouched, as the CPU ops do. The trainer calls them after the expert unpack, which writes every row (0 on
// the skip rows), so they land directly in the MoE stage's fp32 output y and in the expert
// path's dx / dgates with no extra buffer or pass.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/cuda/common.h"
#include "ops/cuda/gemm.h"

namespace keel::ops::cuda::zaya_router {

struct Dims {
  std::int64_t tokens = 0;  // N
  std::int64_t hidden = 0;  // H (model width)
  std::int64_t dim = 0;     // D (router width; 256 in ZAYA1)
  int classes = 0;          // E (experts + the skip class when enabled)
  float eps = 1e-5f;        // RMSNorm epsilon
  // > 0: forced-balance selection (benchmarking only; router::Options, the CPU op's rule):
  // token n takes class n mod forced_classes (the experts alone, so no skip, at classes - 1).
  int forced_classes = 0;
};

struct Weights {
  const bf16* w_down = nullptr;   // [D, H]
  const float* b_down = nullptr;  // [D]
  const float* gamma = nullptr;   // [D]; needed only with prev_state
  const float* w_norm = nullptr;  // [D]
  const bf16* w1 = nullptr;       // [D, D]
  const float* b1 = nullptr;      // [D]
  const bf16* w2 = nullptr;       // [D, D]
  const float* b2 = nullptr;      // [D]
  const bf16* w3 = nullptr;       // [E, D]
};

struct Grads {  // fp32, accumulated; null to skip
  float *w_down = nullptr, *b_down = nullptr, *gamma = nullptr, *w_norm = nullptr;
  float *w1 = nullptr, *b1 = nullptr, *w2 = nullptr, *b2 = nullptr, *w3 = nullptr;
};

// What forward writes and backward reads (caller-allocated; saved_bytes / carve_saved).
struct Saved {
  float* state = nullptr;         // [N, D] post-EDA, pre-norm: the next stage's prev_state
  float* rstd = nullptr;          // [N]
  bf16* u = nullptr;              // [N, D]
  float* z1 = nullptr;            // [N, D] pre-GELU (bias included)
  bf16* h1 = nullptr;             // [N, D]
  float* z2 = nullptr;            // [N, D]
  bf16* h2 = nullptr;             // [N, D]
  float* logits = nullptr;        // [N, E] (forward only: backward does not read it)
  float* probs = nullptr;         // [N, E]
  float* lse = nullptr;           // [N]
  float* gates = nullptr;         // [N] (top-1: [N, 1])
  std::int32_t* idx = nullptr;    // [N] chosen class
  std::int32_t* counts = nullptr; // [E] tokens per class (the bias controller's input)
  float* losses = nullptr;        // [router::loss_floats(E)] aux, z, P_e (cuda::router)
};

// Bytes for carve_saved: every region 256-byte aligned.
std::size_t saved_bytes(const Dims& d);
Saved carve_saved(const Dims& d, void* buffer);

// prev_state null: no EDA (the first MoE stage). bias [E] or null.
void forward(GemmRunner& gemm, const Dims& d, const bf16* x, const float* prev_state, const Weights& w,
             const float* bias, const Saved& s, cudaStream_t stream);

// Device scratch of backward (256-byte aligned, contents ignored, not shared while it runs).
std::size_t backward_scratch_bytes(const Dims& d);
// dgates [N]: dL/dg (MoE combine + skip path). dstate_next [N, D] or null: dL/d(state) from the
// next stage's EDA. dx [N, H] bf16, dprev_state [N, D] fp32 (overwritten; null to skip).
// d_aux: the Switch load-balancing loss's weight over all E classes, with f_e from s.counts
// (as the CPU op's without aux_counts); 0: none (ZAYA1 has none).
void backward(GemmRunner& gemm, const Dims& d, const bf16* x, const float* prev_state, const Weights& w,
              const Saved& s, const float* dgates, const float* dstate_next, bf16* dx, float* dprev_state,
              const Grads& g, void* scratch, cudaStream_t stream, float d_aux = 0.f);
// The same, with the input gradient ADDED into dx_sum [N, H] fp32 (by the last GEMM, beta = 1)
// instead of written to a bf16 dx: for a caller that sums it with the experts' dx in fp32.
void backward_add_dx(GemmRunner& gemm, const Dims& d, const bf16* x, const float* prev_state, const Weights& w,
                     const Saved& s, const float* dgates, const float* dstate_next, float* dx_sum,
                     float* dprev_state, const Grads& g, void* scratch, cudaStream_t stream, float d_aux = 0.f);

// y[n] = 0 where idx[n] == skip_class (written); other rows untouched. x [N, H] bf16,
// y [N, H] fp32, gates [N] fp32.
void skip_forward(const bf16* x, const std::int32_t* idx, const float* gates, int skip_class, float* y,
                  std::int64_t tokens, std::int64_t hidden, cudaStream_t stream);
// On skip tokens: dgates[n] = 0 (fp32) and dx[n] = 0 (bf16 or fp32) (both written: activation
// gradients); other rows untouched. dy [N, H] fp32 (the MoE output's gradient). Either output
// may be null.
void skip_backward(const bf16* x, const std::int32_t* idx, const float* gates, int skip_class, const float* dy,
                   bf16* dx, float* dgates, std::int64_t tokens, std::int64_t hidden, cudaStream_t stream);
void skip_backward(const bf16* x, const std::int32_t* idx, const float* gates, int skip_class, const float* dy,
                   float* dx, float* dgates, std::int64_t tokens, std::int64_t hidden, cudaStream_t stream);

}  // namespace keel::ops::cuda::zaya_router
