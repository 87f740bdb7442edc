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

}  // namespace keel::ops::cuda::cross_entropy
