// Cross-entropy fused with the LM head, computed over the vocabulary in chunks so the full
// [N, V] logits never exist (a 262K vocab at 16K tokens would be 17 GB in fp32).
//
// logits = hidden W^T (W is the [V, D] LM head, or the tied embedding table);
// loss = mean over non-ignored tokens of (lse_i - logits[i, target_i]).
//
// Shapes: hidden [N, D], w [V, D], targets [N] int32 (a target equal to ignore_index, e.g.
// padding, contributes no loss and no gradient; any other target outside [0, V) throws),
// lse [N] (saved by forward for backward; ignored rows get 0), scratch: scratch_floats(N, chunk)
// floats of caller-owned workspace (one [N, chunk] logits block).
//
// Forward walks the vocabulary in chunks of `chunk` columns (the last may be shorter): one GEMM
// per chunk, then an online log-sum-exp per row (running max m and sum s, rescaled by
// exp(m_old - m_new) when the max grows). Backward recomputes each chunk's logits (one GEMM),
// turns them into dlogits = (softmax - onehot) * dloss / n_valid in place, and accumulates
// dhidden += dlogits W_c and dW_c += dlogits^T hidden: two more GEMMs per chunk.
// dhidden is overwritten; dw is accumulated (+=, so a tied embedding's gradient adds up).
#pragma once

#include <cstdint>

#include "tensor/tensor.h"

namespace keel::ops::cross_entropy {

struct Options {
  std::int64_t chunk = 8192;       // vocab columns per chunk (any value >= 1; need not divide V)
  std::int32_t ignore_index = -1;  // targets equal to this are skipped
};

std::int64_t scratch_floats(std::int64_t tokens, std::int64_t chunk);
// Targets that count toward the mean.
std::int64_t valid_count(const std::int32_t* targets, std::int64_t n, const Options& o);

// Returns the mean loss over valid tokens (0 when there are none).
float forward(const Tensor& hidden, const Tensor& w, const std::int32_t* targets, const Options& o, const Tensor& lse,
              const Tensor& scratch);

// A slice of the vocabulary (the vocabulary-parallel head, parallel/vocab_parallel.h): w holds
// rows [begin, begin + w rows) of a head of `vocab` rows, and targets are ids of the whole
// vocabulary (outside [0, vocab) throws). vocab < 0: w is the whole head.
struct Slice {
  std::int64_t begin = 0, vocab = -1;
};

// The first half of forward over a slice: per row i with a valid target, the running max m[i]
// and sum[i] of exp(logit - m[i]) over the slice's columns (sum rescaled as the max grows; m
// starts at -inf, sum at 0), and target_logit[i] where the target is in the slice (untouched
// elsewhere). Ignored rows are untouched.
void slice_lse(const Tensor& hidden, const Tensor& w, const std::int32_t* targets, const Options& o, const Slice& slice,
               const Tensor& scratch, float* m, double* sum, double* target_logit);

// The second half of forward: each valid row's lse = m + log(sum) from slice_lse's running max
// and sum (over every slice of the vocabulary: several calls, or their combination over ranks)
// into lse (0 for ignored rows), and the mean loss lse - target_logit over the valid rows (0
// when none).
float finish_lse(const std::int32_t* targets, std::int64_t n, const Options& o, const float* m, const double* sum,
                 const double* target_logit, const Tensor& lse);

// dloss: upstream gradient of the mean loss (1 for the plain loss). Over a slice, lse is the
// whole vocabulary's and dhidden this slice's share of the gradient (the caller sums the slices').
void backward(const Tensor& hidden, const Tensor& w, const std::int32_t* targets, const Tensor& lse, float dloss,
              const Options& o, const Tensor& scratch, const Tensor& dhidden, const Tensor& dw, const Slice& slice = {});

}  // namespace keel::ops::cross_entropy
