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

void SequenceSplit::attend_linear(const linear_attention::Config& c, std::int64_t runs, const Tensor& q,
                                  const Tensor& k, const Tensor& v, const Tensor& init, const Tensor& out) {
  if (!init.empty()) init.zero();  // whole sequences start from zeros
  linear_attention::forward(c, runs, q.rows() / runs, q, k, v, init, out);
}

void SequenceSplit::attend_linear_backward(const linear_attention::Config& c, std::int64_t runs, const Tensor& q,
                                           const Tensor& k, const Tensor& v, const Tensor& init, const Tensor& dout,
                                           const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  linear_attention::backward(c, runs, q.rows() / runs, q, k, v, init, dout, {}, dq, dk, dv, {});
}

SequenceSplit& whole_sequences() {
  static SequenceSplit s;
  return s;
}

}  // namespace keel::ops
