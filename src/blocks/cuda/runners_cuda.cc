#include "blocks/cuda/runners.h"

#include "ops/cuda/attention.h"

namespace keel::blocks::cuda {

void AttentionCore::forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int B, int T, int Hq,
                            int Hkv, int Dh, float scale, int window, cudaStream_t stream) {
  ops::cuda::attention::forward(q, k, v, out, lse, B, T, Hq, Hkv, Dh, scale, window, stream);
}

std::size_t AttentionCore::backward_workspace_bytes(int B, int T, int Hq, int Hkv, int Dh) const {
  return ops::cuda::attention::backward_workspace_bytes(B, T, Hq, Hkv, Dh);
}

void AttentionCore::backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse,
                             const bf16* dout, bf16* dq, bf16* dk, bf16* dv, void* workspace, int B, int T, int Hq,
                             int Hkv, int Dh, float scale, int window, cudaStream_t stream) {
  ops::cuda::attention::backward(q, k, v, out, lse, dout, dq, dk, dv, workspace, B, T, Hq, Hkv, Dh, scale, window,
                                 stream);
}

LinearRunner& local_linear() {
  static LinearRunner r;
  return r;
}

AttentionCore& local_attention() {
  static AttentionCore a;
  return a;
}

}  // namespace keel::blocks::cuda
