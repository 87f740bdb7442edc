// RMSNorm with a learned per-channel scale: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps).
// Statistics are fp32 (ZAYA1 computes its norms in fp32; the CUDA versions must too).
//
// Shapes: x, y [N, D]; w [D]; rstd [N] (saved for backward; may be empty if unneeded).
// Backward needs x, w and rstd. dx is ACCUMULATED (+=): x is the residual stream, which also
// reaches the loss through the skip connection, so the caller passes the stream's gradient, which
// already holds that share (zero it first where nothing else has written it). This is the
// residual-stream exception of docs/ops.md (Gradient convention); the CUDA twin does the same.
// dw is accumulated too, as every parameter gradient. dx must not alias x or dy.
#pragma once

#include "tensor/tensor.h"

namespace keel::ops::rmsnorm {

void forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y, const Tensor& rstd);

// With xhat = x * rstd and g = dy * w:
//   dx += rstd * (g - xhat * mean_d(g * xhat)),  dw += sum_n dy * xhat.
// Either gradient may be empty to skip it.
void backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, const Tensor& dx, const Tensor& dw);

}  // namespace keel::ops::rmsnorm
