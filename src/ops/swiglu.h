// SwiGLU activation: out = silu(gate) * up, silu(g) = g * sigmoid(g). Elementwise; the two
// projections producing gate and up are linear ops (or the grouped expert GEMMs in moe.h).
//
// Shapes: gate, up, out all [N, F] (any equal shapes work: the op is elementwise).
// Backward needs gate and up (out is not needed). dgate, dup are overwritten.
#pragma once

#include "tensor/tensor.h"

namespace keel::ops::swiglu {

void forward(const Tensor& gate, const Tensor& up, const Tensor& out);

// dgate = dout * up * silu'(gate), silu'(g) = s * (1 + g * (1 - s)), s = sigmoid(g);
// dup = dout * silu(gate).
void backward(const Tensor& gate, const Tensor& up, const Tensor& dout, const Tensor& dgate, const Tensor& dup);

// Raw-pointer kernels over n contiguous elements (used by the MoE expert blocks).
void forward_n(const float* gate, const float* up, float* out, std::int64_t n);
void backward_n(const float* gate, const float* up, const float* dout, float* dgate, float* dup, std::int64_t n);

}  // namespace keel::ops::swiglu
