// SwiGLU on the GPU: the CUDA twin of ops/swiglu.h, out = silu(gate) * up with
// silu(g) = g * sigmoid(g), elementwise over n values.
//
// Dtypes: gate, up, out, dout, dgate, dup all bf16 (they sit between GEMMs); the math is fp32
// and each output is rounded once to bf16. Backward needs gate and up (recomputes the sigmoid);
// dgate and dup are overwritten and either may be null (skipped). dgate/dup may alias gate/up
// (each element is read before it is written). 16-byte vector loads when all pointers allow.
#pragma once

#include <cstdint>

#include "ops/cuda/common.h"

namespace keel::ops::cuda::swiglu {

void forward(const bf16* gate, const bf16* up, bf16* out, std::int64_t n, cudaStream_t stream);

// dgate = dout * up * silu'(gate), silu'(g) = s * (1 + g * (1 - s)), s = sigmoid(g);
// dup = dout * silu(gate).
void backward(const bf16* gate, const bf16* up, const bf16* dout, bf16* dgate, bf16* dup, std::int64_t n,
              cudaStream_t stream);

}  // namespace keel::ops::cuda::swiglu
