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

}  // namespace keel::ops::cuda::embedding
