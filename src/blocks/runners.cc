#include "blocks/runners.h"

#include "ops/attention.h"

namespace keel::blocks {

void AttentionCore::forward(const Tensor& q, const Tensor& k, const Tensor& v, float scale, int window,
                            const Tensor& out, const Tensor& lse) {
  ops::attention::forward(q, k, v, scale, out, lse, window);
}

void AttentionCore::backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                             const Tensor& dout, float scale, int window, const Tensor& dq, const Tensor& dk,
                             const Tensor& dv) {
  ops::attention::backward(q, k, v, out, lse, dout, scale, dq, dk, dv, window);
}

LinearRunner& local_linear() {
  static LinearRunner r;
  return r;
}

AttentionCore& local_attention() {
  static AttentionCore a;
  return a;
}

}  // namespace keel::blocks
