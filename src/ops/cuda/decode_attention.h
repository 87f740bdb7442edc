// Attention of one new query per sequence against a key/value cache on the GPU: the decode step
// of incremental generation (keel generate --device cuda, docs/generate.md). The math is the
// last row of ops/attention.h's causal attention: for query head h of sequence b, with kv head
// g = h / (Hq / Hkv) and the cache positions j < length (with a sliding window W > 0 only the
// last W of them, length - W <= j < length: a sliding layer's query at position length - 1),
//   s_j = scale * q[b, h] . k[b, j, g],  p = softmax(s),  out[b, h] = sum_j p_j v[b, j, g].
//
// Shapes and dtypes (row-major, contiguous):
//   q, out      [B, Hq, Dh]             bf16 (one token per sequence: the projection rows)
//   k, v caches [B, capacity, Hkv, Dh]  bf16 (rows 0..length-1, or the window's, are read; the
//                                       rest never)
// Scores, softmax and the weighted sum of values are fp32; only the output is rounded (once)
// to bf16. Supported: Dh = 64 or 128, Hq % Hkv == 0, 1 <= length <= capacity. Anything else
// throws keel::Error before launching. out is overwritten.
//
// Work split (flash-decoding): one block per (sequence, kv head, chunk of up to 8 of its query
// heads, key split); the block's 4 warps stride over the split's keys, each keeping an online
// softmax per query head in registers (a lane holds Dh/32 channels), so each key/value row is
// read once for all query heads of its group. The warps merge through shared memory; with one
// split the block writes out directly, with several (small B * Hkv, long caches) each split
// writes fp32 partials (max, sum, unnormalized output) to `workspace` and a second kernel
// merges them. The split count depends only on (B, Hq, Hkv, length), not on the device, so
// results are deterministic. Launches only; no host sync.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/cuda/common.h"

namespace keel::ops::cuda::decode_attention {

// Bytes of device workspace forward needs for any length (256-byte aligned by the caller's
// allocator; contents ignored).
std::size_t workspace_bytes(int B, int Hq, int Dh);

// Splits of the key range forward uses for these extents (1 = no workspace traffic), `keys`
// the keys attended (length, or with a window min(length, window)); exposed for tests.
int key_splits(int B, int Hq, int Hkv, std::int64_t keys);

// window: 0 = every cached position, W > 0 = the last W.
void forward(const bf16* q, const bf16* k_cache, const bf16* v_cache, bf16* out, int B, int Hq, int Hkv, int Dh,
             std::int64_t capacity, std::int64_t length, float scale, int window, void* workspace,
             cudaStream_t stream);

}  // namespace keel::ops::cuda::decode_attention
