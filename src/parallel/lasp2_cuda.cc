// LASP-2 on GPUs: CudaContextParallel's attend_linear / attend_linear_backward
// (context_parallel_cuda.h), the twin of lasp2.cc (read that first). One NCCL all-gather of the
// runs' fp32 memory states per layer in forward, one of the initial-state gradients in backward,
// on a side stream from begin_linear / begin_linear_backward (or the attend call itself), the
// caller's stream waiting for it at the attend call; the walk over the 2C chunks is one small
// kernel (lasp2_kernels.h).
// With the linear ring (parallel.context_mode: ring) LASP-1 instead, the twin of
// context_ring.cc: the states passed rank to rank (2C - 1 hops of NCCL send/receive), each hop
// one small kernel.
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
  if (heads_) return la::workspace_bytes(heads_config(c), batch_, seq_);  // whole sequences of this rank's heads
  return la::workspace_bytes(c, runs, len);
}

void CudaContextParallel::chain_recv(float* msg, std::int64_t n, int from, cudaStream_t stream) {
  if (from < 0) {
    KEEL_CUDA_CHECK(cudaMemsetAsync(msg, 0, sizeof(float) * static_cast<std::size_t>(n), stream));
    return;
  }
  group_->recv(msg, n, NcclType::kFloat32, from, stream);
}

void CudaContextParallel::chain_send(const float* msg, std::int64_t n, int to, cudaStream_t stream) {
  if (to >= 0) group_->send(msg, n, NcclType::kFloat32, to, stream);
}

std::int64_t CudaContextParallel::linear_states(const la::Config& c, std::int64_t runs, std::int64_t len) const {
  if (runs != 2 * batch_ || len != chunk_)
    fail("context parallel (cuda): linear attention over {} runs of {} tokens, expected {} of {}", runs, len,
         2 * batch_, chunk_);
  return runs * c.kv_heads * std::int64_t(c.head_dim) * c.head_dim;
}

// mine[0, n) -> the gathered blocks (state_buffers' third part), on the side stream once
// `stream` has written mine.
void CudaContextParallel::start_gather(float* mine, std::int64_t n, cudaStream_t stream) {
  group_->all_gather(mine, mine + 2 * n, n, NcclType::kFloat32, side_.start(stream));
  side_.end();
}

void CudaContextParallel::finish_gather(cudaStream_t stream) {
  side_.wait(stream);
  begun_ = 0;
}

// The states and their all-gather before the caller's q projection, which overlaps it.
void CudaContextParallel::begin_linear(const la::Config& c, std::int64_t runs, std::int64_t len, const bf16* k,
                                       const bf16* v, cudaStream_t stream) {
  if (heads_ || ring_) return;
  if (begun_) fail("context parallel (cuda): LASP-2's states begun twice without attend_linear between");
  const std::int64_t n = linear_states(c, runs, len);
  float* mine = state_buffers(n, stream);
  la::local_states(c, runs, len, k, v, mine, stream);
  start_gather(mine, n, stream);
  begun_ = 1;
}

void CudaContextParallel::begin_linear_backward(const la::Config& c, std::int64_t runs, std::int64_t len,
                                                const bf16* q, const bf16* dout, cudaStream_t stream) {
  if (heads_ || ring_) return;
  if (begun_) fail("context parallel (cuda): LASP-2's state gradients begun with another exchange unfinished");
  const std::int64_t n = linear_states(c, runs, len);
  float* dS = state_buffers(n, stream);
  la::init_gradient(c, runs, len, q, dout, dS, stream);
  start_gather(dS, n, stream);
  begun_ = 2;
}

void CudaContextParallel::attend_linear(const la::Config& c, std::int64_t runs, std::int64_t len, const bf16* q,
                                        const bf16* k, const bf16* v, float* init, bf16* out, void* workspace,
                                        cudaStream_t stream) {
  const std::int64_t dd = std::int64_t(c.head_dim) * c.head_dim, n = linear_states(c, runs, len);
  if (!init) fail("context parallel (cuda): linear attention needs the layer's initial-state buffer");
  if (heads_) return heads_linear(c, q, k, v, init, out, workspace, stream);
  if (!ring_) {  // LASP-2
    if (begun_ == 2) fail("context parallel (cuda): attend_linear with LASP-2's state gradients begun");
    if (!begun_) begin_linear(c, runs, len, k, v, stream);
    finish_gather(stream);
    float* gathered = static_cast<float*>(states_) + 2 * n;
    lasp2::walk(gathered, init, size(), rank(), batch_, c.kv_heads, dd, decays_over(c, len), /*reverse=*/false,
                stream);
    return la::forward(c, runs, len, q, k, v, init, out, workspace, stream);
  }
  float* mine = state_buffers(n, stream);
  la::local_states(c, runs, len, k, v, mine, stream);
  // LASP-1 (the CPU twin: context_ring.cc): first runs up the ranks, chunk r starting from the
  // state after chunk r - 1; second runs down, chunk 2C-1-r from the state after 2C-2-r (rank
  // r + 1's second run, or the last rank's own first run, already in msg).
  float* msg = mine + n;
  const int last = size() - 1;
  const lasp2::Decays d = decays_over(c, len);
  chain_recv(msg, n / 2, rank() - 1, stream);
  lasp2::hop(msg, init, mine, 0, batch_, c.kv_heads, dd, d, stream);
  chain_send(msg, n / 2, rank() < last ? rank() + 1 : -1, stream);
  if (rank() < last) chain_recv(msg, n / 2, rank() + 1, stream);
  lasp2::hop(msg, init, mine, 1, batch_, c.kv_heads, dd, d, stream);
  chain_send(msg, n / 2, rank() > 0 ? rank() - 1 : -1, stream);
  la::forward(c, runs, len, q, k, v, init, out, workspace, stream);
}

void CudaContextParallel::attend_linear_backward(const la::Config& c, std::int64_t runs, std::int64_t len,
                                                 const bf16* q, const bf16* k, const bf16* v, const float* init,
                                                 const bf16* dout, bf16* dq, bf16* dk, bf16* dv, void* workspace,
                                                 cudaStream_t stream) {
  if (heads_) return heads_linear_backward(c, q, k, v, dout, dq, dk, dv, workspace, stream);
  const std::int64_t dd = std::int64_t(c.head_dim) * c.head_dim, n = linear_states(c, runs, len);
  if (!ring_) {  // LASP-2
    if (begun_ == 1) fail("context parallel (cuda): attend_linear_backward with LASP-2's states begun");
    if (!begun_) begin_linear_backward(c, runs, len, q, dout, stream);
    finish_gather(stream);
    float *dM = static_cast<float*>(states_) + n, *gathered = static_cast<float*>(states_) + 2 * n;
    lasp2::walk(gathered, dM, size(), rank(), batch_, c.kv_heads, dd, decays_over(c, len), /*reverse=*/true, stream);
    return la::backward(c, runs, len, q, k, v, init, dout, dM, dq, dk, dv, nullptr, workspace, stream);
  }
  float* dS = state_buffers(n, stream);
  float *dM = dS + n, *gathered = dS + 2 * n;
  la::init_gradient(c, runs, len, q, dout, dS, stream);
  // The chunks in reverse: second runs up the ranks (rank 0's is the sequence's last chunk),
  // then first runs down; a run's dM is the gradient arriving after it.
  float* msg = gathered;
  const int last = size() - 1;
  const lasp2::Decays d = decays_over(c, len);
  chain_recv(msg, n / 2, rank() > 0 ? rank() - 1 : -1, stream);
  lasp2::hop(msg, dM, dS, 1, batch_, c.kv_heads, dd, d, stream);
  chain_send(msg, n / 2, rank() < last ? rank() + 1 : -1, stream);
  if (rank() < last) chain_recv(msg, n / 2, rank() + 1, stream);
  lasp2::hop(msg, dM, dS, 0, batch_, c.kv_heads, dd, d, stream);
  chain_send(msg, n / 2, rank() > 0 ? rank() - 1 : -1, stream);
  la::backward(c, runs, len, q, k, v, init, dout, dM, dq, dk, dv, nullptr, workspace, stream);
}

}  // namespace keel::parallel
