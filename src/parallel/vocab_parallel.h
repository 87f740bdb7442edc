// Vocabulary-parallel token embedding and LM-head cross-entropy on CPU ranks (Megatron-style
// tensor parallelism): the [V, D] table (embedding, LM head, or one tied table) is split by rows
// over a tensor-parallel group of T ranks; rank r holds rows [vocab_begin, vocab_begin + V_local),
// V_local = w_local.dim(0) (normally V / T and vocab_begin = r V / T).
//
// Embedding: forward writes this rank's partial lookup (the rows of the tokens it holds, zeros
// for the others); the caller sums the partials over the group (all-reduce, or reduce-scatter
// under sequence parallelism). Backward takes the full output gradient (the same on every rank)
// and accumulates into this rank's rows only. Neither communicates.
//
// Cross-entropy: hidden [N, D] is the same on every rank (all-gathered by the caller under
// sequence parallelism). Each rank computes its local logits hidden w_local^T in chunks of
// o.chunk columns, never [N, V] and never gathering logits, with an online per-row max m_r and
// sum s_r = sum_j exp(l_j - m_r) over its slice (as ops::cross_entropy does over the whole
// vocabulary). Forward then makes two all-reduces over `comm`: the row max M = max_r m_r (MAX,
// N floats), then one SUM of [2N + 1] doubles holding per row s_r exp(m_r - M) and the target
// logit (non-zero only on the rank that owns the target), plus V_local (so a group whose slices
// do not add up to `vocab` throws on every rank). lse = M + log(sum), saved for backward.
// Backward needs no communication: with the global lse saved, softmax_ij = exp(l_ij - lse_i) is
// local to the rank holding column j, so each rank turns its recomputed local logits into
// dlogits = (softmax - onehot) dloss / n_valid and applies the two GEMMs of its slice.
// dhidden_partial is OVERWRITTEN with this slice's share dlogits_local w_local; the caller sums it
// over the group (all-reduce, or reduce-scatter under sequence parallelism). dw_local is
// ACCUMULATED (+=, as ops::cross_entropy's dw). Either gradient view may be empty to skip it.
//
// Targets are global ids; ignore_index rows contribute no loss and no gradient (lse 0); any
// other target outside [0, vocab) throws keel::Error naming it (on every rank, before any
// collective, since the targets are the same everywhere). scratch: at least
// ops::cross_entropy::scratch_floats(N, min(o.chunk, V_local)) floats. Results equal
// ops::cross_entropy over the whole table to fp32 rounding (the sums are grouped differently).
#pragma once

#include <mpi.h>

#include <cstdint>

#include "ops/cross_entropy.h"
#include "tensor/tensor.h"

namespace keel::parallel {

// out [n, D] (overwritten): w_local[tokens[i] - vocab_begin] for tokens in this rank's rows,
// zeros otherwise. Token ids >= vocab throw keel::Error naming the position.
void vocab_embedding_forward(const std::uint32_t* tokens, std::int64_t n, const Tensor& w_local, std::int64_t vocab_begin,
                             std::int64_t vocab, const Tensor& out);

// dout [n, D]: the full output gradient. dw_local[tokens[i] - vocab_begin] += dout[i] for tokens
// in this rank's rows (sequential over tokens, as ops::embedding::backward).
void vocab_embedding_backward(const std::uint32_t* tokens, std::int64_t n, const Tensor& dout, std::int64_t vocab_begin,
                              std::int64_t vocab, const Tensor& dw_local);

// Returns the mean loss over valid tokens, the same on every rank of comm (0 when none is valid).
// lse [N] is written. Collective over comm (none when no target is valid).
float vocab_ce_forward(const Tensor& hidden, const Tensor& w_local, std::int64_t vocab_begin, std::int64_t vocab,
                       const std::int32_t* targets, const ops::cross_entropy::Options& o, const Tensor& lse,
                       const Tensor& scratch, MPI_Comm comm);

// dloss: upstream gradient of the mean loss (1 for the plain loss). Local: no communication.
void vocab_ce_backward(const Tensor& hidden, const Tensor& w_local, std::int64_t vocab_begin, std::int64_t vocab,
                       const std::int32_t* targets, const Tensor& lse, float dloss, const ops::cross_entropy::Options& o,
                       const Tensor& scratch, const Tensor& dhidden_partial, const Tensor& dw_local);

}  // namespace keel::parallel
