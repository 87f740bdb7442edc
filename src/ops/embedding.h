// Token embedding lookup: out[i] = table[ids[i]]. With tied embeddings the same table is the
// LM head of cross_entropy.h; both backward passes accumulate into one dtable.
//
// Shapes: ids [N] (uint32 token ids, each < V; throws keel::Error naming the position
// otherwise), table [V, D], out [N, D]. Backward needs only ids.
#pragma once

#include <cstdint>

#include "tensor/tensor.h"

namespace keel::ops::embedding {

void forward(const std::uint32_t* ids, std::int64_t n, const Tensor& table, const Tensor& out);

// Scatter-add: dtable[ids[i]] += dout[i] (accumulated; repeated ids add up). Sequential over
// tokens so the summation order is fixed (the CUDA version may use atomics; it must match to
// fp32 rounding, not bit for bit).
void backward(const std::uint32_t* ids, std::int64_t n, const Tensor& dout, const Tensor& dtable);

}  // namespace keel::ops::embedding
