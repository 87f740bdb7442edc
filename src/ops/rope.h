// Rotary position embedding (RoPE), full or partial.
//
// Convention (rotate-half, as in HF transformers / GPT-NeoX and ZAYA1's fork): of each head's
// head_dim channels, the first R = rotary_fraction * head_dim are rotated and the rest pass
// through unchanged. Inside the rotated slice, channel i pairs with channel i + R/2 (NOT the
// interleaved (2i, 2i+1) pairing of the original paper / Meta Llama checkpoints):
//   y[i]       = x[i] cos(p * f_i) - x[i + R/2] sin(p * f_i)
//   y[i + R/2] = x[i + R/2] cos(p * f_i) + x[i] sin(p * f_i),   f_i = base^(-2i / R), i < R/2,
// where p is the token's position. ZAYA1: head_dim 128, fraction 0.5 -> R = 64.
//
// The angle table is computed once in double and stored in fp32 (Table); the CUDA version
// must use the same table (upload it) so both sides rotate by identical fp32 cos/sin.
// Backward is the inverse rotation (the transpose): rotation is orthogonal, so
//   dx[i] = dy[i] cos + dy[i + R/2] sin,  dx[i + R/2] = dy[i + R/2] cos - dy[i] sin.
// Nothing is saved for backward except the positions.
#pragma once

#include <cstdint>
#include <vector>

#include "tensor/tensor.h"

namespace keel::ops::rope {

struct Table {
  int head_dim = 0;
  int rotary_dim = 0;  // R: even, <= head_dim
  int max_positions = 0;
  std::vector<float> cos, sin;  // [max_positions, R/2]
};

// R = round(rotary_fraction * head_dim); throws keel::Error unless R is even and in (0, head_dim].
Table make_table(int head_dim, double rotary_fraction, double base, int max_positions);

// x, y [N, H, head_dim] (y may alias x: in place); positions [N], each in [0, max_positions).
void forward(const Table& t, const Tensor& x, const std::int32_t* positions, const Tensor& y);
// dy, dx [N, H, head_dim] (dx may alias dy).
void backward(const Table& t, const Tensor& dy, const std::int32_t* positions, const Tensor& dx);

}  // namespace keel::ops::rope
