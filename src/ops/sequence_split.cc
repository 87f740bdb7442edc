#include "ops/sequence_split.h"

#include "common/error.h"
#include "ops/attention.h"

namespace keel::ops {

void SequenceSplit::halo(const Tensor& tails, const Tensor& halos) {
  require_shape(halos, {tails.dim(0), tails.dim(1)}, "sequence split halos");
  halos.zero();
}

void SequenceSplit::halo_backward(const Tensor& dhalos, const Tensor& dtails) {
  require_shape(dtails, {dhalos.dim(0), dhalos.dim(1)}, "sequence split dtails");
  dtails.zero();
}

void SequenceSplit::attend(const Tensor& q, const Tensor& k, const Tensor& v, float scale, int window,
                           const Tensor& out, const Tensor& lse) {
  attention::forward(q, k, v, scale, out, lse, window);
}

void SequenceSplit::attend_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                    const Tensor& lse, const Tensor& dout, float scale, int window, const Tensor& dq,
                                    const Tensor& dk, const Tensor& dv) {
  attention::backward(q, k, v, out, lse, dout, scale, dq, dk, dv, window);
}

SequenceSplit& whole_sequences() {
  static SequenceSplit s;
  return s;
}

}  // namespace keel::ops
