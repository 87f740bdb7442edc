// ZAYA1 residual scaling: a per-channel learned bias and scale on a stream, (x + b) * s, and the
// merge of the two scaled streams (the residual r and the previous mixer's output h):
//   r_next = (r + b_r) * s_r + (h + b_h) * s_h          (init b = 0, s = 1)
// Source: Zyphra transformers fork, modeling_zaya.py `ResidualScaling` and the decoder layers'
// forward (res_scale, then residual = hidden_states + residual). Stage 0 has no residual: it
// scales the embedding only (use `forward`), and after the last stage one more merge precedes
// the final RMSNorm. The residual stream is kept in fp32 (these ops are fp32 throughout).
//
// Shapes: x, y, r, h, out [N, D]; b, s and the four merge vectors [D].
// Gradients (see linear.h): dx, dr, dh overwritten; db, ds accumulated (+=). Any may be empty.
// dr is the residual stream's gradient but is still overwritten: the merge continues the stream
// (it does not branch off it like a norm), and in backward it is that gradient's first writer,
// in place over dout; the norms that read r then add their share (docs/ops.md).
// Saved for backward: the inputs (x, or r and h) and the parameters. Nothing else.
#pragma once

#include "tensor/tensor.h"

namespace keel::ops::residual_scale {

// y = (x + b) * s. y may alias x.
void forward(const Tensor& x, const Tensor& b, const Tensor& s, const Tensor& y);
// dx = dy * s;  db += sum_n dy * s;  ds += sum_n dy * (x + b). dx may alias dy.
void backward(const Tensor& x, const Tensor& b, const Tensor& s, const Tensor& dy, const Tensor& dx, const Tensor& db,
              const Tensor& ds);

// out = (r + b_r) * s_r + (h + b_h) * s_h. out may alias r or h.
void merge_forward(const Tensor& r, const Tensor& h, const Tensor& b_r, const Tensor& s_r, const Tensor& b_h,
                   const Tensor& s_h, const Tensor& out);
// The two branches of merge_forward: dr = dout * s_r, dh = dout * s_h, and the parameter
// gradients of each branch as in backward. dr may alias dout (the h branch runs first); dh
// must not.
void merge_backward(const Tensor& r, const Tensor& h, const Tensor& b_r, const Tensor& s_r, const Tensor& b_h,
                    const Tensor& s_h, const Tensor& dout, const Tensor& dr, const Tensor& dh, const Tensor& db_r,
                    const Tensor& ds_r, const Tensor& db_h, const Tensor& ds_h);

}  // namespace keel::ops::residual_scale
