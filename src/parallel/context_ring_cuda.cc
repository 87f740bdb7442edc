// Ring attention for context parallelism on GPUs (parallel.context_mode: ring): the GPU twin of
// context_ring.cc's softmax half (read that first), CudaContextParallel's ring mode. The linear
// layers' ring (LASP-1) is in lasp2_cuda.cc.
//
// Forward: this rank's k, v (its two zigzag chunks) are laid out chunk by chunk ([2][B][L][w],
// so each chunk is a plain [B, L, Hkv, Dh] tensor) and travel around the context group, one NCCL
// send to rank + 1 and receive from rank - 1 per step on a side stream while the compute stream
// attends to the block it holds: each of its query runs against each of the block's chunks that
// is not in the run's future (attention::forward_block at the chunk's offset, its output in fp32;
// the diagonal chunk causally), merged in fp32 by log-sum-exp (attention::merge_block). Step 0 (its own
// block) starts the running (out, lse) from the two diagonal chunks. C - 1 hops.
// Backward: the blocks travel again with fp32 dk, dv accumulators; each rank adds its queries'
// share (attention::backward_block, with the final out and lse) into the block's accumulators
// and into its fp32 dq, then passes the accumulators on; after C hops every block is home with
// the whole group's dk, dv. The k, v hop runs while the block is computed; the accumulators'
// once this rank has added its share.
// Memory: two blocks (k, v bf16; in backward also dk, dv fp32) and the fp32 running out (or dq),
// against the all-gather's whole-sequence k, v. Scratch: the core's on-demand buffer.
#include <fmt/format.h>

#include <utility>

#include "common/error.h"
#include "device/cuda_check.h"
#include "device/device_arena.h"
#include "device/device_buffer.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/cast.h"
#include "parallel/context_mode.h"
#include "parallel/context_parallel_cuda.h"
#include "parallel/copy_rows_cuda.h"

namespace keel::parallel {

namespace att = ops::cuda::attention;

namespace {
// x [B, T = 2L, w] (elem bytes) <-> chunk-major [2][B][L][w].
void to_chunks(const void* x, void* chunks, std::int64_t B, std::int64_t L, std::int64_t w, std::size_t e,
               cudaStream_t stream) {
  for (int c = 0; c < 2; ++c)
    copy_rows(static_cast<std::byte*>(chunks) + c * B * L * w * e, L * w * e,
              static_cast<const std::byte*>(x) + c * L * w * e, 2 * L * w * e, L * w * e, B, stream);
}
void from_chunks(const void* chunks, void* x, std::int64_t B, std::int64_t L, std::int64_t w, std::size_t e,
                 cudaStream_t stream) {
  for (int c = 0; c < 2; ++c)
    copy_rows(static_cast<std::byte*>(x) + c * L * w * e, 2 * L * w * e,
              static_cast<const std::byte*>(chunks) + c * B * L * w * e, L * w * e, L * w * e, B, stream);
}
}  // namespace

void CudaContextParallel::ring_post(const void* send, void* recv, std::int64_t count, NcclType type,
                                    cudaStream_t stream) {
  // the hop reads `send` and overwrites `recv`: only once the compute stream's earlier work on
  // them (the previous step's) is done
  const cudaStream_t side = side_.start(stream);
  const int C = size();
  group_->group_start();
  group_->send(send, count, type, (rank() + 1) % C, side);
  group_->recv(recv, count, type, (rank() + C - 1) % C, side);
  group_->group_end();
  side_.end();
}

void CudaContextParallel::ring_forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int Hq,
                                       int Hkv, int Dh, float scale, int window, cudaStream_t stream) {
  const int C = size(), B = static_cast<int>(batch_), L = static_cast<int>(chunk_), T = 2 * L;
  const std::int64_t w = std::int64_t(Hkv) * Dh, n = B * T * w, nq = std::int64_t(B) * T * Hq * Dh,
                     nl = std::int64_t(B) * Hq * T;
  const std::size_t bytes = ring_forward_bytes({B, T, Hq, Hkv, Dh});
  DeviceCarver cv(heads_scratch(bytes, stream), bytes);  // in context_mode.h's order
  bf16* blocks[2] = {cv.take<bf16>(2 * n), cv.take<bf16>(2 * n)};  // [k | v], chunk-major
  float* acc = cv.take<float>(nq);
  float* acc_lse = cv.take<float>(nl);
  float* blk = cv.take<float>(nq);  // a block's output, fp32 (never rounded before the merge)
  float* blk_lse = cv.take<float>(nl);

  to_chunks(k, blocks[0], B, L, w, sizeof(bf16), stream);
  to_chunks(v, blocks[0] + n, B, L, w, sizeof(bf16), stream);
  const std::int64_t run_q = std::int64_t(L) * Hq * Dh;  // a run's first row in q, out
  const int mine[2] = {rank(), 2 * C - 1 - rank()};     // the chunks of this rank's query runs
  int cur = 0;
  for (int s = 0; s < C; ++s) {
    const int src = (rank() - s + C) % C;
    if (s + 1 < C) ring_post(blocks[cur], blocks[1 - cur], 2 * n, NcclType::kBfloat16, stream);
    const bf16* kb = blocks[cur];
    const bf16* vb = blocks[cur] + n;
    const int theirs[2] = {src, 2 * C - 1 - src};
    if (s == 0) {  // the running (out, lse) start from each run's diagonal chunk
      for (int r = 0; r < 2; ++r)
        att::forward_block(q + r * run_q, kb + r * B * L * w, vb + r * B * L * w, blk + r * run_q, blk_lse + r * L, B, T,
                           L, 0, L, Hq, Hkv, Dh, scale, window, stream);
      KEEL_CUDA_CHECK(cudaMemcpyAsync(acc, blk, sizeof(float) * nq, cudaMemcpyDeviceToDevice, stream));
      KEEL_CUDA_CHECK(cudaMemcpyAsync(acc_lse, blk_lse, sizeof(float) * nl, cudaMemcpyDeviceToDevice, stream));
    }
    for (int c = 0; c < 2; ++c)
      for (int r = 0; r < 2; ++r) {
        if (mine[r] <= theirs[c]) continue;  // the diagonal (done above) or the run's future
        const int p0 = (mine[r] - theirs[c]) * L;
        if (window > 0 && p0 - window >= L - 1) continue;  // wholly before every row's window
        att::forward_block(q + r * run_q, kb + c * B * L * w, vb + c * B * L * w, blk + r * run_q, blk_lse + r * L, B,
                           T, L, p0, L, Hq, Hkv, Dh, scale, window, stream);
        att::merge_block(blk + r * run_q, blk_lse + r * L, acc + r * run_q, acc_lse + r * L, B, T, L, Hq, Dh, stream);
      }
    if (s + 1 < C) {
      side_.wait(stream);
      cur = 1 - cur;
    }
  }
  ops::cuda::f32_to_bf16(acc, out, nq, stream);
  KEEL_CUDA_CHECK(cudaMemcpyAsync(lse, acc_lse, sizeof(float) * nl, cudaMemcpyDeviceToDevice, stream));
}

void CudaContextParallel::ring_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse,
                                        const bf16* dout, bf16* dq, bf16* dk, bf16* dv, int Hq, int Hkv, int Dh,
                                        float scale, int window, cudaStream_t stream) {
  const int C = size(), B = static_cast<int>(batch_), L = static_cast<int>(chunk_), T = 2 * L;
  const std::int64_t w = std::int64_t(Hkv) * Dh, n = B * T * w, nq = std::int64_t(B) * T * Hq * Dh,
                     nl = std::int64_t(B) * Hq * T;
  // a block: [k | v] bf16, then [dk | dv] fp32, each chunk-major
  const std::size_t bytes = ring_backward_bytes({B, T, Hq, Hkv, Dh});
  DeviceCarver cv(heads_scratch(bytes, stream), bytes);  // in context_mode.h's order
  bf16* kvs[2];
  float* accs[2];
  for (int i = 0; i < 2; ++i) kvs[i] = cv.take<bf16>(2 * n), accs[i] = cv.take<float>(2 * n);
  float* dq_acc = cv.take<float>(nq);
  float* d_row = cv.take<float>(nl);
  bf16* tmp = cv.take<bf16>(n);

  to_chunks(k, kvs[0], B, L, w, sizeof(bf16), stream);
  to_chunks(v, kvs[0] + n, B, L, w, sizeof(bf16), stream);
  KEEL_CUDA_CHECK(cudaMemsetAsync(accs[0], 0, sizeof(float) * 2 * n, stream));
  KEEL_CUDA_CHECK(cudaMemsetAsync(dq_acc, 0, sizeof(float) * nq, stream));
  att::dot_rows(dout, out, d_row, B, T, Hq, Dh, stream);
  const std::int64_t run_q = std::int64_t(L) * Hq * Dh;
  const int mine[2] = {rank(), 2 * C - 1 - rank()};
  int cur = 0;
  for (int s = 0; s < C; ++s) {
    const int src = (rank() - s + C) % C;
    if (s + 1 < C) ring_post(kvs[cur], kvs[1 - cur], 2 * n, NcclType::kBfloat16, stream);  // the next block's k, v
    const int theirs[2] = {src, 2 * C - 1 - src};
    for (int c = 0; c < 2; ++c)
      for (int r = 0; r < 2; ++r) {
        if (mine[r] < theirs[c]) continue;  // the run's future
        const int p0 = (mine[r] - theirs[c]) * L;
        if (window > 0 && p0 - window >= L - 1) continue;
        const std::int64_t chunk = std::int64_t(c) * B * L * w;
        att::backward_block(q + r * run_q, kvs[cur] + chunk, kvs[cur] + n + chunk, dout + r * run_q, lse + r * L,
                            d_row + r * L, dq_acc + r * run_q, accs[cur] + chunk, accs[cur] + n + chunk, B, T, L, p0, L,
                            Hq, Hkv, Dh, scale, window, stream);
      }
    ring_post(accs[cur], accs[1 - cur], 2 * n, NcclType::kFloat32, stream);  // this rank's share added: pass it on
    side_.wait(stream);
    cur = 1 - cur;
  }
  // after C hops of the accumulators, accs[cur] is this rank's own block with every rank's share
  ops::cuda::f32_to_bf16(dq_acc, dq, nq, stream);
  ops::cuda::f32_to_bf16(accs[cur], tmp, n, stream);
  from_chunks(tmp, dk, B, L, w, sizeof(bf16), stream);
  ops::cuda::f32_to_bf16(accs[cur] + n, tmp, n, stream);
  from_chunks(tmp, dv, B, L, w, sizeof(bf16), stream);
}

}  // namespace keel::parallel
