// Token embedding lookup on the GPU: the CUDA twin of ops/embedding.h (same math).
//
// Shapes and dtypes: ids [n] uint32 (device), table [V, D] fp32 master weights (or a bf16 copy
// of them), out [n, D] fp32 (the residual stream stays fp32), dout [n, D] fp32, dtable [V, D]
// fp32. Backward needs only the ids. `out` is overwritten; dtable is ACCUMULATED (+=, repeated
// ids add up through atomicAdd, so the summation order is not fixed: results match the CPU op
// to fp32 rounding, not bit for bit).
//
// Out-of-range ids (id >= V): the ids live on the device, so they are checked there instead
// of by a host pass that would need a copy and a sync. A bad id is never used as an address:
// forward writes a zero row for it and backward skips it. When `bad_id` is not null the first
// bad (lowest position) token is recorded there as (position << 32 | id), so the caller can
// check it once per step with throw_if_bad_id() at a point where it synchronizes anyway.
// Callers that validated the ids on the host pass bad_id = nullptr.
//
// Vocabulary slices (tensor parallelism; the CPU twin is parallel/vocab_parallel.h): a rank's
// table_local [V_local, D] holds rows [vocab_begin, vocab_begin + V_local) of the vocabulary of
// `vocab` ids (row r is id vocab_begin + r; V_local may be 0). The slice forward writes the row of
// each id in the slice and a zero row for every other id, so the partials of the ranks whose
// slices cover the vocabulary sum to the whole lookup exactly (the caller's all-reduce or
// reduce-scatter); the slice backward accumulates only ids in the slice into dtable_local (the
// caller passes the full dout, the same on every rank). Ids >= vocab are bad ids exactly as
// above (a zero row, skipped, recorded in bad_id on every rank). No alignment needs beyond the
// whole-table ops': table_local is a table of its own (the vector path wants D % 4 == 0 and
// table_local 8-byte aligned, else it falls back to element loads).
#pragma once

#include <cstdint>

#include "ops/cuda/common.h"

namespace keel::ops::cuda::embedding {

// The value of a bad-id record that holds no bad id.
inline constexpr unsigned long long kNoBadId = ~0ull;

// Sets *bad_id = kNoBadId (asynchronously, on stream).
void reset_bad_id(unsigned long long* bad_id, cudaStream_t stream);

// Synchronizes `stream`, reads *bad_id and throws keel::Error naming the first position whose
// id is outside the vocabulary of `vocab` when one was recorded.
void throw_if_bad_id(const unsigned long long* bad_id, std::int64_t vocab, cudaStream_t stream);

// out[i, :] = table[ids[i], :]. n may be 0; n must be < 2^32 (the bad-id record packs it).
void forward(const std::uint32_t* ids, std::int64_t n, const float* table, float* out, std::int64_t vocab,
             std::int64_t dim, cudaStream_t stream, unsigned long long* bad_id = nullptr);

// The same reading a bf16 copy of the table (out[i, :] = float(table[ids[i], :]), exact).
void forward_bf16_table(const std::uint32_t* ids, std::int64_t n, const bf16* table, float* out, std::int64_t vocab,
                        std::int64_t dim, cudaStream_t stream, unsigned long long* bad_id = nullptr);

// dtable[ids[i], :] += dout[i, :] (accumulated; atomics).
void backward(const std::uint32_t* ids, std::int64_t n, const float* dout, float* dtable, std::int64_t vocab,
              std::int64_t dim, cudaStream_t stream, unsigned long long* bad_id = nullptr);

// Slice forward: out[i, :] = table_local[ids[i] - vocab_begin, :] for ids in [vocab_begin,
// vocab_begin + vocab_local), zeros otherwise (out [n, dim] fp32, overwritten). Throws
// keel::Error unless 0 <= vocab_begin and vocab_begin + vocab_local <= vocab.
void forward_bf16_table_slice(const std::uint32_t* ids, std::int64_t n, const bf16* table_local, float* out,
                              std::int64_t vocab_begin, std::int64_t vocab_local, std::int64_t vocab, std::int64_t dim,
                              cudaStream_t stream, unsigned long long* bad_id = nullptr);

// Slice backward: dtable_local[ids[i] - vocab_begin, :] += dout[i, :] for ids in the slice only
// (dtable_local [vocab_local, dim] fp32, accumulated; atomics).
void backward_slice(const std::uint32_t* ids, std::int64_t n, const float* dout, float* dtable_local,
                    std::int64_t vocab_begin, std::int64_t vocab_local, std::int64_t vocab, std::int64_t dim,
                    cudaStream_t stream, unsigned long long* bad_id = nullptr);

}  // namespace keel::ops::cuda::embedding
