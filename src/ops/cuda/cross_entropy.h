// Cross-entropy fused with the LM head on the GPU: the CUDA twin of ops/cross_entropy.h. The
// [N, V] logits never exist; the vocabulary is walked in chunks of `chunk` columns (the last
// may be shorter; V need not be a multiple).
//
// logits = hidden W^T (W the [V, D] LM head or the tied embedding table);
// loss = mean over valid rows of (lse_i - logits[i, target_i]).
//
// Forward: per chunk one GEMM (bf16 x bf16 -> fp32 [N, chunk] scratch), then one block per row
// folds the chunk into a running max m and sum s (rescaled by exp(m_old - m_new) when the max
// grows) in a single pass of 16-byte loads, and picks up the target logit when it falls in the
// chunk; a last single-block pass
// writes lse and the loss (fixed-order reductions: deterministic, no float atomics).
// Backward: per chunk recompute the logits (one GEMM), write
//   dlogits = (softmax - onehot) * dloss / n_valid   as bf16 (the GEMM operand), then
//   dhidden_fp32 (+)= dlogits W_c   (fp32 accumulator in scratch; beta 0 on the first chunk)
//   dW_c += dlogits^T hidden        (fp32, beta 1)
// and finally cast dhidden to bf16. n_valid is counted on the device (no host sync).
//
// Valid rows: target != ignore_index and in [0, V). A target outside [0, V) that is not
// ignore_index cannot throw from the device: it is treated like an ignored row and counted in
// Result::bad_targets, and read_result throws on it.
//
// Shapes and dtypes: hidden [N, D] bf16; w [V, D] bf16; targets [N] int32; lse [N] fp32
// (written by forward, read by backward; ignored rows get 0); result: one device Result;
// dhidden [N, D] bf16 OVERWRITTEN; dw [V, D] fp32 ACCUMULATED (+=, so a tied embedding's
// gradient adds up), or written with Options::overwrite_dw; either may be null. Both passes use
// scratch_bytes(...) of device scratch (contents need not survive between them). Saved for
// backward: hidden, w, targets, lse.
//
// Vocabulary slices (Megatron-style tensor parallelism; the CPU twin is
// parallel/vocab_parallel.h): rank r of T holds w_local [V_local, D], rows [begin, begin +
// V_local) of the [V, D] head (normally begin = r V / T); hidden [N, D] and the global targets
// are the same on every rank. Three steps, the communication between them the caller's:
//   1. slice_forward: the chunked (or keep_logits) pass above over this slice's V_local
//      columns only, writing part [2N] fp32 = [lse_r (N) | target_logit_r (N)]: per row
//      lse_r = log sum over the slice of exp(l_ij) (-inf for an empty slice) and the target
//      logit where the global target falls in the slice, else 0; rows that do not count
//      (ignore_index, or a target outside [0, V)) get 0 | 0.
//   2. the caller all-gathers the parts in rank order into parts [T][2N] (ncclAllGather of 2N
//      floats per rank), then combine: per valid row lse = M + log sum_r exp(lse_r - M), M =
//      max_r lse_r, and the Result (loss = mean of lse - sum_r target_logit_r, valid,
//      bad_targets) as forward's. Fixed-order reductions in one block: every rank gets the same
//      bits. lse of rows that do not count is 0.
//   3. slice_backward with that global lse: dlogits = (softmax - onehot) dloss / n_valid over
//      the slice's columns (softmax_ij = exp(l_ij - lse_i); the onehot only where the target is
//      in the slice; n_valid counted on the device from the global targets), then dw_local
//      (+)= dlogits^T hidden and this slice's share dhidden_f32 [N, D] fp32 = dlogits w_local
//      (OVERWRITTEN; the caller sums the ranks' shares in fp32: all-reduce or reduce-scatter).
// A slice covering the whole vocabulary (begin 0, V_local = V, T = 1) gives forward's lse,
// Result and gradients to fp32 rounding (the lse is regrouped, dhidden not rounded to bf16).
// Nothing checks that the ranks' slices tile the vocabulary: that is the caller's layout.
// Alignment: none beyond the whole-vocabulary ops'. begin and V_local may be any values (the
// GEMMs take any operand offset; the row kernels use 16-byte loads only where every row of
// their block is 16-byte aligned, e.g. the kept [N, V_local] bf16 logits when V_local % 8 ==
// 0, and element loads otherwise).
#pragma once

#include <cstdint>

#include "ops/cuda/common.h"

namespace keel::ops::cuda::cross_entropy {

struct Options {
  std::int64_t chunk = 16384;      // vocab columns per chunk (>= 1; need not divide V)
  std::int32_t ignore_index = -1;  // targets equal to this are skipped
  // Keep the whole [N, V] logits in bf16 (scratch grows to N * V * 2 bytes) instead of
  // chunking: one GEMM per pass instead of one per chunk, and backward turns the kept logits
  // into dlogits in place instead of recomputing them (a third less LM-head work). The
  // statistics then come from the bf16 logits, as under PyTorch's autocast.
  bool keep_logits = false;
  // backward writes dw (=, zeros when there are no tokens) instead of adding to it: a step's
  // first micro-batch then needs no memset of the [V, D] gradient before (docs/gpu_training.md).
  // One of the two sanctioned exceptions to "parameter gradients are accumulated" (docs/ops.md).
  bool overwrite_dw = false;
};

// Lives on the device; forward overwrites it.
struct Result {
  float loss;                 // mean over valid rows (0 when there are none)
  std::int32_t valid;         // rows counted in the mean
  std::int32_t bad_targets;   // targets outside [0, V) other than ignore_index (skipped)
};

// Device scratch for forward and backward: the fp32 and bf16 [N, min(chunk, V)] logit blocks
// (or, with keep_logits, the bf16 [N, V] logits, which must survive from forward to backward),
// an fp32 [N, D] dhidden accumulator and O(N) row statistics.
std::int64_t scratch_bytes(std::int64_t tokens, std::int64_t d, std::int64_t vocab, const Options& o);

// No host sync. tokens may be 0 (loss 0).
void forward(const bf16* hidden, const bf16* w, const std::int32_t* targets, std::int64_t tokens, std::int64_t d,
             std::int64_t vocab, const Options& o, float* lse, Result* result, void* scratch, cudaStream_t stream);

// Copies the Result to the host. SYNCHRONIZES `stream`. Throws keel::Error when some target was
// outside the vocabulary.
Result read_result(const Result* result, cudaStream_t stream);

// dloss: upstream gradient of the mean loss (1 for the plain loss). No host sync.
void backward(const bf16* hidden, const bf16* w, const std::int32_t* targets, const float* lse, float dloss,
              std::int64_t tokens, std::int64_t d, std::int64_t vocab, const Options& o, void* scratch, bf16* dhidden,
              float* dw, cudaStream_t stream);

// ---------------------------------------------------------------- vocabulary slices

// w_local holds rows [begin, begin + rows) of a head of `vocab` rows (targets are ids of the
// whole vocabulary). 0 <= begin, 0 <= rows, begin + rows <= vocab, else keel::Error.
struct Slice {
  std::int64_t begin = 0;  // the vocabulary id of w_local's first row
  std::int64_t rows = 0;   // V_local (may be 0: that rank's part is -inf | 0, its shares zero)
  std::int64_t vocab = 0;  // V
};

// Device scratch for slice_forward and slice_backward: the layout of scratch_bytes over V_local
// columns (fp32 and bf16 [N, min(chunk, V_local)] blocks, or with keep_logits the bf16 [N,
// V_local] logits, which must survive from slice_forward to slice_backward; combine does not
// touch the scratch) and O(N) row statistics, without the fp32 [N, D] dhidden accumulator.
// scratch_bytes(N, D, V_local, o) is never smaller, so that buffer works too.
std::int64_t slice_scratch_bytes(std::int64_t tokens, std::int64_t vocab_local, const Options& o);

// hidden [N, D] bf16, w_local [V_local, D] bf16, targets [N] int32 (global ids) -> part [2N]
// fp32 = [lse_r (N) | target_logit_r (N)] (layout above). No host sync. tokens may be 0.
void slice_forward(const bf16* hidden, const bf16* w_local, const std::int32_t* targets, std::int64_t tokens,
                   std::int64_t d, const Slice& slice, const Options& o, float* part, void* scratch,
                   cudaStream_t stream);

// parts [ranks][2N] fp32: the slice_forward parts of the ranks, in rank order (all-gathered).
// Writes lse [N] (the global log-sum-exp, 0 on rows that do not count) and *result (overwritten;
// bad_targets counts targets outside [0, vocab) other than ignore_index, and read_result throws
// on them as for forward). Only o.ignore_index is used. No host sync. tokens may be 0.
void combine(const float* parts, std::int64_t ranks, const std::int32_t* targets, std::int64_t tokens,
             std::int64_t vocab, const Options& o, float* lse, Result* result, cudaStream_t stream);

// lse [N]: combine's (global). dhidden_f32 [N, D] fp32: this slice's share, OVERWRITTEN (zeros
// on an empty slice); dw_local [V_local, D] fp32: ACCUMULATED, or written with overwrite_dw;
// either may be null. dloss as for backward. No host sync.
void slice_backward(const bf16* hidden, const bf16* w_local, const std::int32_t* targets, const float* lse, float dloss,
                    std::int64_t tokens, std::int64_t d, const Slice& slice, const Options& o, void* scratch,
                    float* dhidden_f32, float* dw_local, cudaStream_t stream);

}  // namespace keel::ops::cuda::cross_entropy
