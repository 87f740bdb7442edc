#include "ops/cuda/sequence_split.h"

#include "ops/cuda/attention.h"
#include "ops/cuda/linear_attention.h"

namespace keel::ops::cuda {

void SequenceSplit::halo(const bf16* tails, bf16* halos, std::int64_t rows, std::int64_t F, cudaStream_t stream) {
  if (rows * F > 0) KEEL_CUDA_CHECK(cudaMemsetAsync(halos, 0, sizeof(bf16) * static_cast<std::size_t>(rows * F), stream));
}

void SequenceSplit::halo_backward(const float* dhalos, float* dtails, std::int64_t rows, std::int64_t F,
                                  cudaStream_t stream) {
  if (rows * F > 0) KEEL_CUDA_CHECK(cudaMemsetAsync(dtails, 0, sizeof(float) * static_cast<std::size_t>(rows * F), stream));
}

void SequenceSplit::forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int B, int T, int Hq,
                            int Hkv, int Dh, float scale, int window, cudaStream_t stream) {
  attention::forward(q, k, v, out, lse, B, T, Hq, Hkv, Dh, scale, window, stream);
}

std::size_t SequenceSplit::backward_workspace_bytes(int B, int T, int Hq, int Hkv, int Dh) const {
  return attention::backward_workspace_bytes(B, T, Hq, Hkv, Dh);
}

void SequenceSplit::backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse,
                             const bf16* dout, bf16* dq, bf16* dk, bf16* dv, void* workspace, int B, int T, int Hq,
                             int Hkv, int Dh, float scale, int window, cudaStream_t stream) {
  attention::backward(q, k, v, out, lse, dout, dq, dk, dv, workspace, B, T, Hq, Hkv, Dh, scale, window, stream);
}

std::size_t SequenceSplit::linear_workspace_bytes(const linear_attention::Config& c, std::int64_t runs,
                                                  std::int64_t len) const {
  return linear_attention::workspace_bytes(c, runs, len);
}

void SequenceSplit::attend_linear(const linear_attention::Config& c, std::int64_t runs, std::int64_t len,
                                  const bf16* q, const bf16* k, const bf16* v, float* init, bf16* out, void* workspace,
                                  cudaStream_t stream) {
  if (init)  // whole sequences start from zeros
    KEEL_CUDA_CHECK(cudaMemsetAsync(
        init, 0, sizeof(float) * static_cast<std::size_t>(runs * c.kv_heads * c.head_dim * c.head_dim), stream));
  linear_attention::forward(c, runs, len, q, k, v, nullptr, out, workspace, stream);
}

void SequenceSplit::attend_linear_backward(const linear_attention::Config& c, std::int64_t runs, std::int64_t len,
                                           const bf16* q, const bf16* k, const bf16* v, const float* init,
                                           const bf16* dout, bf16* dq, bf16* dk, bf16* dv, void* workspace,
                                           cudaStream_t stream) {
  linear_attention::backward(c, runs, len, q, k, v, nullptr, dout, nullptr, dq, dk, dv, nullptr, workspace, stream);
}

SequenceSplit& whole_sequences() {
  static SequenceSplit s;
  return s;
}

}  // namespace keel::ops::cuda
