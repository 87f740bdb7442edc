// LASP-2 on GPUs: CudaContextParallel's attend_linear / attend_linear_backward
// (context_parallel_cuda.h), the twin of lasp2.cc (read that first). One NCCL all-gather of the
// runs' fp32 memory states per layer in forward, one of the initial-state gradients in backward,
// on the caller's stream; the walk over the 2C chunks is one small kernel (lasp2_kernels.h).
#include <cmath>

#include "common/error.h"
#include "device/cuda_check.h"
#include "device/device_buffer.h"
#include "ops/cuda/linear_attention.h"
#include "parallel/context_parallel_cuda.h"
#include "parallel/lasp2_kernels.h"

namespace keel::parallel {

namespace la = ops::cuda::linear_attention;

namespace {
lasp2::Decays decays_over(const la::Config& c, std::int64_t len) {
  if (c.kv_heads > lasp2::kMaxKvHeads) fail("LASP-2 (cuda): {} kv heads, at most {}", c.kv_heads, lasp2::kMaxKvHeads);
  lasp2::Decays d{};
  for (int g = 0; g < c.kv_heads; ++g) d.g[g] = static_cast<float>(std::pow(double(c.gamma(g)), double(len)));
  return d;
}
}  // namespace

// [own states | the other state buffer | C x own (the all-gather's)], `floats` each.
void CudaContextParallel::reserve_states(std::int64_t floats) {
  const std::size_t bytes = sizeof(float) * static_cast<std::size_t>(floats * (2 + size()));
  if (bytes <= state_bytes_) return;
  if (states_) cudaFree(states_);
  states_ = nullptr;
  state_bytes_ = 0;
  if (cudaMalloc(&states_, bytes) != cudaSuccess)
    throw_out_of_gpu_memory("out of GPU memory: LASP-2's gathered memory states", bytes, "lower batch.micro_batch");
  state_bytes_ = bytes;
}

float* CudaContextParallel::state_buffers(std::int64_t floats, cudaStream_t stream) {
  if (sizeof(float) * static_cast<std::size_t>(floats * (2 + size())) > state_bytes_) {
    KEEL_CUDA_CHECK(keel::stream_sync(stream));  // work queued may still read the old buffers
    reserve_states(floats);
  }
  return static_cast<float*>(states_);
}

std::size_t CudaContextParallel::linear_workspace_bytes(const la::Config& c, std::int64_t runs,
                                                        std::int64_t len) const {
  return la::workspace_bytes(c, runs, len);
}

void CudaContextParallel::attend_linear(const la::Config& c, std::int64_t runs, std::int64_t len, const bf16* q,
                                        const bf16* k, const bf16* v, float* init, bf16* out, void* workspace,
                                        cudaStream_t stream) {
  if (runs != 2 * batch_ || len != chunk_)
    fail("context parallel (cuda): linear attention over {} runs of {} tokens, expected {} of {}", runs, len,
         2 * batch_, chunk_);
  if (!init) fail("context parallel (cuda): linear attention needs the layer's initial-state buffer");
  const std::int64_t dd = std::int64_t(c.head_dim) * c.head_dim, n = runs * c.kv_heads * dd;
  float* mine = state_buffers(n, stream);
  float* gathered = mine + 2 * n;
  la::local_states(c, runs, len, k, v, mine, stream);
  group_->all_gather(mine, gathered, n, NcclType::kFloat32, stream);
  lasp2::walk(gathered, init, size(), rank(), batch_, c.kv_heads, dd, decays_over(c, len), /*reverse=*/false, stream);
  la::forward(c, runs, len, q, k, v, init, out, workspace, stream);
}

void CudaContextParallel::attend_linear_backward(const la::Config& c, std::int64_t runs, std::int64_t len,
                                                 const bf16* q, const bf16* k, const bf16* v, const float* init,
                                                 const bf16* dout, bf16* dq, bf16* dk, bf16* dv, void* workspace,
                                                 cudaStream_t stream) {
  const std::int64_t dd = std::int64_t(c.head_dim) * c.head_dim, n = runs * c.kv_heads * dd;
  float* dS = state_buffers(n, stream);
  float *dM = dS + n, *gathered = dS + 2 * n;
  la::init_gradient(c, runs, len, q, dout, dS, stream);
  group_->all_gather(dS, gathered, n, NcclType::kFloat32, stream);
  lasp2::walk(gathered, dM, size(), rank(), batch_, c.kv_heads, dd, decays_over(c, len), /*reverse=*/true, stream);
  la::backward(c, runs, len, q, k, v, init, dout, dM, dq, dk, dv, nullptr, workspace, stream);
}

}  // namespace keel::parallel
