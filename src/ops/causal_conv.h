// Causal 1-D convolutions over the time axis of token-major activations, per sequence (no
// reads across the B sequences of a batch): the two convolutions of ZAYA1's CCA
// (modeling_zaya.py `CCA.conv_qk`: a depthwise nn.Conv1d then a grouped nn.Conv1d, both with
// bias, on the input left-padded by (W0 - 1) + (W1 - 1) zeros). Weights use PyTorch's Conv1d
// layouts so checkpoints load as they are; a conv is a cross-correlation, so tap W-1
// multiplies the current token and tap 0 the oldest one.
//
// Time indexing. Both ops see activations as [B, T, C] (token b * T + t, channel c). Input
// times before 0 are zeros. `extra` / `lead` let two convs compose exactly as the reference's
// single up-front padding does: there, the depthwise output exists also at the W1 - 1 times
// before 0 (where it equals the bias plus taps on real tokens), and the grouped conv reads them.
//
// depthwise: x [B, T, C], w [C, W], b [C] or empty, y [B, T + extra, C]. Row j of y is time
//   t = j - extra:   y[j, c] = b[c] + sum_{k<W} w[c, k] * x[t - (W-1) + k, c].
// grouped:   x [B, T + lead, C] (row i is time i - lead), w [C, Cg, W] with groups G = C / Cg
//   (output channel o, in group g = o / Cg, reads input channels g*Cg .. g*Cg + Cg - 1),
//   b [C] or empty, y [B, T, C]:
//   y[t, o] = b[o] + sum_{k<W} sum_{i<Cg} w[o, i, k] * x[row t + lead - (W-1) + k, g*Cg + i],
//   where a row below 0 reads zero.
// CCA: depthwise with extra = W1 - 1, then grouped with lead = W1 - 1 (W0 = W1 = 2 in ZAYA1,
// C = 1280, Cg = 128: one dense 128 x 128 mix per head and tap).
//
// Halo (depthwise, optional): halo [B, extra + W - 1, C] holds the input at times
//   -(extra + W - 1) .. -1 (row h is time h - (extra + W - 1)) instead of zeros: the last tokens
//   before a run of a sequence split into runs (ops/sequence_split.h). Empty: zeros. Backward's
//   dhalo (same shape, overwritten) is those inputs' gradient.
//
// Gradients: dx (and dhalo) overwritten, dw and db accumulated (+=); any may be empty. Saved for
// backward: x, w (and the halo) only.
#pragma once

#include "tensor/tensor.h"

namespace keel::ops::causal_conv {

void depthwise_forward(const Tensor& x, const Tensor& w, const Tensor& b, int extra, const Tensor& y,
                       const Tensor& halo = Tensor());
void depthwise_backward(const Tensor& x, const Tensor& w, int extra, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                        const Tensor& db, const Tensor& halo = Tensor(), const Tensor& dhalo = Tensor());

void grouped_forward(const Tensor& x, const Tensor& w, const Tensor& b, int lead, const Tensor& y);
void grouped_backward(const Tensor& x, const Tensor& w, int lead, const Tensor& dy, const Tensor& dx, const Tensor& dw,
                      const Tensor& db);

}  // namespace keel::ops::causal_conv
