// Dropless MoE on the GPU: the CUDA twin of ops/moe.h (dispatch plan, grouped SwiGLU experts,
// gated combine) with the same math and the same slot order.
//
// Dispatch plan (make_plan): the S = N * top_k routed slots a = n * top_k + k are
// counting-sorted by expert, stable in a (the CPU order), so expert e owns the contiguous rows
// [offsets[e], offsets[e + 1]) of the sorted buffers: source[slot] = a, position[a] = slot.
// On the device: one block counts and scans (E is small), then one block per expert assigns
// its slots in increasing a (ballot prefix sums), so the result is deterministic and equal to
// the CPU plan.
//
// !!! make_plan SYNCHRONIZES the stream once !!!  The expert GEMM loop needs every expert's row
// range on the host (one GEMM per expert, sized by its load), so make_plan copies the E + 1
// offsets down with one small blocking copy and keeps them in Plan::host_offsets; forward and
// backward reuse them and never sync. (It also reports expert indices outside [0, E) there.)
//
// Per expert e on its rows xs_e (nn.Linear convention, weights [out, in]; GemmRunner GEMMs):
//   h_gate = xs_e W_gate[e]^T, h_up = xs_e W_up[e]^T   [cnt, F] bf16 (fp32 accumulation)
//   act    = silu(h_gate) * h_up                      [cnt, F] bf16
//   ys_e   = act W_down[e]^T                          [cnt, D] bf16
// Each expert's chain (its GEMMs and SwiGLU rows) runs on one of a few side streams forked
// from and joined back to the caller's stream (one expert's GEMMs fill well under one wave of
// the GPU); experts write disjoint rows and weight-gradient blocks, so the results are the same
// as one after another (ops::set_moe_lanes(1), kernels.moe_lanes: 1 in keel train's config, runs
// them so, on the caller's stream; 2..8 sets the number of side streams, default 4). Callers see one stream: work they queue after the call
// runs after all of it.
// Combine: y[n] = sum_k gates[n, k] * ys[position[n * top_k + k]], summed in fp32 in k order.
// y is fp32 and OVERWRITTEN: it is the block output that the fp32 residual stream (and the
// ZAYA1 residual merge, ops/residual_scale.h) consumes, so it is not rounded to bf16.
// An expert with no tokens launches nothing and gets no gradient (no zero-size GEMMs).
//
// Backward (the CPU formula): dgates[n, k] = dy[n] . ys[slot]; dys[slot] = gates[n, k] dy[n]
// (bf16, a GEMM operand); per expert dW_down += dys^T act, dact = dys W_down (fp32),
// dh_gate, dh_up = swiglu backward (bf16), dW_gate += dh_gate^T xs, dW_up += dh_up^T xs,
// dxs = dh_gate W_gate + dh_up W_up (fp32); dx[n] = sum_k dxs[slot of (n, k)] -> bf16.
//
// Shapes and dtypes: x, dx [N, D] bf16; y, dy [N, D] fp32; gates, dgates [N, top_k] fp32;
// W_gate, W_up [E, F, D] and W_down [E, D, F] bf16; their gradients fp32. Saved (caller
// allocated, written by forward, read by backward): xs [S, D], h_gate, h_up, act [S, F],
// ys [S, D], all bf16, plus the Plan. dx, dgates overwritten; weight gradients ACCUMULATED
// (+=, beta = 1 GEMMs on each expert's block), or written with Grads::overwrite. Any gradient
// pointer may be null to skip it.
// Backward needs backward_scratch_bytes(S, D, F) bytes of device scratch.
#pragma once

#include <cstdint>
#include <vector>

#include "ops/cuda/common.h"

namespace keel::ops::cuda::moe {

struct Plan {
  std::int64_t tokens = 0;
  int top_k = 0, experts = 0;
  std::int32_t* offsets = nullptr;   // device [E + 1] exclusive prefix sum of the loads
  std::int32_t* source = nullptr;    // device [S] sorted slot -> a = n * top_k + k
  std::int32_t* position = nullptr;  // device [S] a -> sorted slot
  std::vector<std::int64_t> host_offsets;  // [E + 1] host copy of offsets
  // Device [tokens] or null (row t): the row of x, y, dy and dx that planned token t reads and
  // writes. Set by the caller after make_plan when the planned tokens are a subset of a larger
  // [rows, D] tensor (ZAYA1's tokens left after the skip class), so dispatch reads and combine
  // writes that tensor in place with no packing copy; rows it does not name are neither read
  // nor written. Gates and dgates stay indexed by the planned token ([tokens, top_k]).
  const std::int32_t* rows = nullptr;
  std::int64_t slots() const { return tokens * top_k; }
  std::int64_t count(int e) const { return host_offsets[e + 1] - host_offsets[e]; }
};

// int32s of the device workspace a Plan points into (offsets, an error slot, source, position).
std::int64_t plan_ints(std::int64_t slots, int experts);

// expert_idx [N * top_k] int32 on the device (router::forward's output). The Plan points into
// `workspace` (plan_ints(S, E) int32s), which must outlive it. SYNCHRONIZES `stream` once (see
// above); throws keel::Error on an expert index outside [0, E). With device_tokens (an int32
// on the device, written by earlier work on `stream`) only its first min(*device_tokens,
// tokens) tokens are planned and Plan::tokens says how many: a count the host would otherwise
// need a sync of its own to learn (ZAYA1's tokens left after the skip class).
Plan make_plan(const std::int32_t* expert_idx, std::int64_t tokens, int top_k, int experts, std::int32_t* workspace,
               cudaStream_t stream, const std::int32_t* device_tokens = nullptr);

struct Weights {
  const bf16* w_gate = nullptr;  // [E, F, D]
  const bf16* w_up = nullptr;    // [E, F, D]
  const bf16* w_down = nullptr;  // [E, D, F]
};

struct Grads {
  float* w_gate = nullptr;  // [E, F, D], accumulated; null to skip
  float* w_up = nullptr;
  float* w_down = nullptr;  // [E, D, F]
  // One of the two sanctioned exceptions to "parameter gradients are accumulated" (docs/ops.md).
  // false: the backward ADDS each expert's gradient (micro-batches sum into one buffer). true:
  // it WRITES them (beta = 0 GEMMs; experts without rows get zeros), so a step's first
  // micro-batch needs no memset of these [E, F, D] blocks beforehand and its weight-gradient
  // GEMMs do not read them: most of a MoE model's parameters (docs/gpu_training.md).
  bool overwrite = false;
};

// Zeroes dw's blocks of `experts` experts (what an overwriting backward leaves for experts that
// got no rows). Null blocks are skipped. No host sync.
void zero_expert_grads(const Grads& dw, int experts, std::int64_t d, std::int64_t f, cudaStream_t stream);

struct Saved {
  bf16* xs = nullptr;                                   // [S, D] tokens in expert order
  bf16* h_gate = nullptr, *h_up = nullptr, *act = nullptr;  // [S, F]
  bf16* ys = nullptr;                                   // [S, D] expert outputs before gating
};

// d: model width D; f: expert hidden width F. y overwritten (fp32). No host sync.
void forward(const Plan& plan, const bf16* x, const float* gates, const Weights& w, std::int64_t d, std::int64_t f,
             const Saved& saved, float* y, cudaStream_t stream);

std::int64_t backward_scratch_bytes(std::int64_t slots, std::int64_t d, std::int64_t f);

// dy fp32 [N, D]. dx (bf16) and dgates overwritten, dweights accumulated; any may be null.
// (x itself is not needed: the saved xs holds its rows in expert order.) No host sync.
void backward(const Plan& plan, const float* gates, const Weights& w, std::int64_t d, std::int64_t f,
              const Saved& saved, const float* dy, void* scratch, bf16* dx, float* dgates, const Grads& dweights,
              cudaStream_t stream);
// The same with dx in fp32 (overwritten, not rounded to bf16): for a caller that sums dx into an
// fp32 gradient anyway.
void backward_f32(const Plan& plan, const float* gates, const Weights& w, std::int64_t d, std::int64_t f,
                  const Saved& saved, const float* dy, void* scratch, float* dx, float* dgates, const Grads& dweights,
                  cudaStream_t stream);

// ---- The pieces forward() and backward() are made of. Expert parallelism
// (parallel/expert_parallel_cuda.h) runs them with all-to-alls between: dispatch and combine at
// the tokens' rank, the expert MLPs at the experts' rank. No host sync. ----

// Dispatch: xs[slot] = x[source[slot] / top_k], [S, D] in expert order.
void dispatch_rows(const Plan& plan, const bf16* x, std::int64_t d, bf16* xs, cudaStream_t stream);

// The SwiGLU MLPs of experts 0..offsets.size() - 2 of `w` on expert-major rows: expert e owns
// rows [offsets[e], offsets[e + 1]) of sv.xs (host offsets, offsets[0] = 0); writes sv.h_gate,
// sv.h_up, sv.act and sv.ys on those rows. Experts without rows launch nothing.
void experts_forward(const std::vector<std::int64_t>& offsets, const Weights& w, std::int64_t d, std::int64_t f,
                     const Saved& sv, cudaStream_t stream);

// Combine: y[n] = sum_k gates[n, k] ys[position[n top_k + k]] (fp32, overwritten).
void combine(const Plan& plan, const bf16* ys, const float* gates, std::int64_t d, float* y, cudaStream_t stream);

// dgates[n, k] = dy[n] . ys[slot] (dgates may be null); dys[slot] = gates[n, k] dy[n] (bf16).
void combine_backward(const Plan& plan, const bf16* ys, const float* gates, std::int64_t d, const float* dy,
                      bf16* dys, float* dgates, cudaStream_t stream);

// Bytes of scratch experts_backward needs for `rows` rows.
std::int64_t experts_backward_scratch_bytes(std::int64_t rows, std::int64_t f);

// The experts' backward on the rows of experts_forward: dys [rows, D] bf16 in; weight gradients
// accumulated, or written with dw.overwrite (any may be null); dxs [rows, D] fp32 overwritten
// (null to skip).
void experts_backward(const std::vector<std::int64_t>& offsets, const Weights& w, std::int64_t d, std::int64_t f,
                      const Saved& sv, const bf16* dys, void* scratch, float* dxs, const Grads& dw,
                      cudaStream_t stream);

// dx[n] = sum_k dxs[position[n top_k + k]] -> bf16 or fp32 (overwritten).
void combine_dx(const Plan& plan, const float* dxs, std::int64_t d, bf16* dx, cudaStream_t stream);
void combine_dx(const Plan& plan, const float* dxs, std::int64_t d, float* dx, cudaStream_t stream);

// Where a routed layer's experts run when they are not all on this GPU (callers without a runner
// call forward() and backward() above): spread over an expert-parallel group of GPUs (parallel/
// expert_parallel_cuda.h). One object per MoE layer when it keeps state between forward and
// backward. Same arguments as forward() and backward(); `w` and `dw` hold the experts this GPU
// has (all E, or E / P), the plan routes over all E.
class ExpertRunner {
 public:
  virtual ~ExpertRunner() = default;
  virtual void forward(const Plan& plan, const bf16* x, const float* gates, const Weights& w, std::int64_t d,
                       std::int64_t f, const Saved& saved, float* y, cudaStream_t stream) = 0;
  virtual void backward(const Plan& plan, const float* gates, const Weights& w, std::int64_t d, std::int64_t f,
                        const Saved& saved, const float* dy, void* scratch, bf16* dx, float* dgates,
                        const Grads& dweights, cudaStream_t stream) = 0;
  // True when every rank of a group must call forward() and backward() together, even with no
  // tokens (an empty plan from make_plan with tokens = 0).
  virtual bool collective() const { return false; }
};

}  // namespace keel::ops::cuda::moe
