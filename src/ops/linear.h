// Linear layer: y = x W^T (+ b), the nn.Linear convention (W is [out, in]).
//
// Shapes: x [N, in], W [out, in], b [out] or empty, y [N, out]. N is tokens (B*T flattened).
// Gradient convention (every op in src/ops and its CUDA twin; docs/ops.md, Gradient convention):
// activation gradients (dx) are OVERWRITTEN; parameter gradients (dW, db) are ACCUMULATED (+=),
// so micro-batches and tied weights sum into one gradient buffer. The one exception is the
// gradient an op adds into the residual stream (rmsnorm's dx, rmsnorm.h). Here: any gradient
// view may be empty to skip computing it.
// Saved for backward: x (the input) and W. Nothing else.
#pragma once

#include "tensor/tensor.h"

namespace keel::ops::linear {

void forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y);

// dy [N, out] -> dx [N, in] (overwritten), dw [out, in] (+=), db [out] (+=).
void backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx, const Tensor& dw,
              const Tensor& db);

}  // namespace keel::ops::linear
