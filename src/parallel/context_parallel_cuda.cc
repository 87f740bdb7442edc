#include "parallel/context_parallel_cuda.h"

#include <fmt/format.h>

#include "common/error.h"
#include "device/cuda_check.h"
#include "device/device_buffer.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/cast.h"
#include "parallel/context_mode.h"
#include "parallel/context_parallel.h"
#include "parallel/copy_rows_cuda.h"

namespace keel::parallel {

namespace {
constexpr std::size_t kAlign = 256;
std::size_t aligned(std::size_t b) { return (b + kAlign - 1) / kAlign * kAlign; }
}  // namespace

CudaContextParallel::CudaContextParallel(std::shared_ptr<NcclGroup> group, MPI_Comm context, std::int64_t batch,
                                         std::int64_t seq, std::int64_t kv_dim)
    : group_(std::move(group)), comm_(context), batch_(batch), seq_(seq), kv_dim_(kv_dim) {
  if (!group_) fail("context parallel (cuda): no context group");
  check_context_split(seq_, size(), 1, "context parallel");
  chunk_ = seq_ / (2 * size());
  pos_ = zigzag_positions(seq_, size(), rank());
  run_start_[0] = static_cast<int>(rank() * chunk_);
  run_start_[1] = static_cast<int>((2 * size() - 1 - rank()) * chunk_);
  const std::size_t whole = static_cast<std::size_t>(batch_ * seq_ * kv_dim_);  // [B, S, w]
  const std::size_t local = whole / static_cast<std::size_t>(size());           // n = [B, S/C, w]
  const std::size_t sizes[] = {aligned(2 * local * sizeof(bf16)),  aligned(2 * whole * sizeof(bf16)),
                               aligned(whole * sizeof(bf16)),      aligned(whole * sizeof(bf16)),
                               aligned(whole * sizeof(float)),     aligned(whole * sizeof(float)),
                               aligned(2 * whole * sizeof(float)), aligned(2 * local * sizeof(float))};
  for (std::size_t s : sizes) bytes_ += s;
  if (cudaMalloc(&mem_, bytes_) != cudaSuccess)
    throw_out_of_gpu_memory("out of GPU memory: context parallelism's gathered keys and values", bytes_,
                            "lower batch.micro_batch or data.seq_length, or raise parallel.context");
  auto* at = static_cast<std::byte*>(mem_);
  send_ = reinterpret_cast<bf16*>(at), at += sizes[0];
  recv_ = reinterpret_cast<bf16*>(at), at += sizes[1];
  k_ = reinterpret_cast<bf16*>(at), at += sizes[2];
  v_ = reinterpret_cast<bf16*>(at), at += sizes[3];
  dk_ = reinterpret_cast<float*>(at), at += sizes[4];
  dv_ = reinterpret_cast<float*>(at), at += sizes[5];
  rs_send_ = reinterpret_cast<float*>(at), at += sizes[6];
  rs_recv_ = reinterpret_cast<float*>(at);
}

CudaContextParallel::~CudaContextParallel() {
  side_.synchronize();  // hops or gathers may still use the buffers below
  if (mem_) cudaFree(mem_);
  if (halo_) cudaFree(halo_);
  if (states_) cudaFree(states_);
}

void CudaContextParallel::sum(double* x, int n) const { sum_over_context(comm_, x, n); }

void CudaContextParallel::release_gather() {
  if (mem_) cudaFree(mem_);
  mem_ = nullptr;
  bytes_ = 0;
  send_ = recv_ = k_ = v_ = nullptr;
  dk_ = dv_ = rs_send_ = rs_recv_ = nullptr;
}

void CudaContextParallel::use_ring(int hq, int dh, bool softmax) {
  release_gather();
  ring_ = true;
  if (softmax) heads_scratch(ring_buffer_bytes({batch_, 2 * chunk_, hq, kv_dim_ / dh, dh}), nullptr);
}

void CudaContextParallel::use_heads(int hq, int dh, bool softmax, bool linear) {
  release_gather();
  heads_ = true;
  heads_scratch(alltoall_buffer_bytes({batch_, 2 * chunk_, hq, kv_dim_ / dh, dh}, softmax, linear), nullptr);
}

void CudaContextParallel::gather(const bf16* k, const bf16* v, std::int64_t B, std::int64_t T, std::int64_t w,
                                 cudaStream_t stream) {
  if (!mem_) fail("context parallel (cuda): the k/v gather's buffers were released (ring or all-to-all mode)");
  if (B != batch_ || T != 2 * chunk_ || w > kv_dim_)
    fail("context parallel (cuda): k, v of [{}, {}, {}] through a core of [{}, {}, {}]", B, T, w, batch_, 2 * chunk_,
         kv_dim_);
  const std::int64_t n = B * T * w, C = size();
  const std::size_t e = sizeof(bf16);
  KEEL_CUDA_CHECK(cudaMemcpyAsync(send_, k, n * e, cudaMemcpyDeviceToDevice, stream));
  KEEL_CUDA_CHECK(cudaMemcpyAsync(send_ + n, v, n * e, cudaMemcpyDeviceToDevice, stream));
  group_->all_gather(send_, recv_, 2 * n, NcclType::kBfloat16, stream);
  for (int j = 0; j < C; ++j)
    for (int s = 0; s < 2; ++s) {
      const std::int64_t c = s == 0 ? j : 2 * C - 1 - j;
      const bf16* src = recv_ + std::int64_t(j) * 2 * n + s * chunk_ * w;
      copy_rows(k_ + c * chunk_ * w, seq_ * w * e, src, T * w * e, chunk_ * w * e, B, stream);
      copy_rows(v_ + c * chunk_ * w, seq_ * w * e, src + n, T * w * e, chunk_ * w * e, B, stream);
    }
}

void CudaContextParallel::forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int B, int T,
                                  int Hq, int Hkv, int Dh, float scale, int window, cudaStream_t stream) {
  if (heads_ || ring_) {
    if (B != batch_ || T != 2 * chunk_)
      fail("context parallel (cuda): attention of [{}, {}] through a core of [{}, {}]", B, T, batch_, 2 * chunk_);
    if (ring_) return ring_forward(q, k, v, out, lse, Hq, Hkv, Dh, scale, window, stream);
    return heads_forward(q, k, v, out, lse, Hq, Hkv, Dh, scale, window, stream);
  }
  gather(k, v, B, T, std::int64_t(Hkv) * Dh, stream);
  ops::cuda::attention::forward_runs(q, k_, v_, out, lse, B, T, static_cast<int>(seq_), Hq, Hkv, Dh, scale, window,
                                     run_start_, 2, stream);
}

std::size_t CudaContextParallel::backward_workspace_bytes(int B, int T, int Hq, int Hkv, int Dh) const {
  if (ring_) return 0;  // the ring's accumulators are its own
  if (heads_)  // whole sequences of this rank's heads
    return ops::cuda::attention::backward_workspace_bytes(B, static_cast<int>(seq_), static_cast<int>(Hq / size()),
                                                          static_cast<int>(Hkv / size()), Dh);
  return ops::cuda::attention::backward_runs_workspace_bytes(B, T, static_cast<int>(seq_), Hq, Hkv, Dh);
}

void CudaContextParallel::backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse,
                                   const bf16* dout, bf16* dq, bf16* dk, bf16* dv, void* workspace, int B, int T,
                                   int Hq, int Hkv, int Dh, float scale, int window, cudaStream_t stream) {
  if (heads_ || ring_) {
    if (B != batch_ || T != 2 * chunk_)
      fail("context parallel (cuda): attention of [{}, {}] through a core of [{}, {}]", B, T, batch_, 2 * chunk_);
    if (ring_) return ring_backward(q, k, v, out, lse, dout, dq, dk, dv, Hq, Hkv, Dh, scale, window, stream);
    return heads_backward(q, k, v, out, lse, dout, dq, dk, dv, workspace, Hq, Hkv, Dh, scale, window, stream);
  }
  const std::int64_t w = std::int64_t(Hkv) * Dh, n = std::int64_t(B) * T * w, C = size();
  gather(k, v, B, T, w, stream);  // forward's gathered keys are not kept: one buffer serves every layer
  ops::cuda::attention::backward_runs(q, k_, v_, out, lse, dout, dq, dk_, dv_, workspace, B, T, static_cast<int>(seq_),
                                      Hq, Hkv, Dh, scale, window, run_start_, 2, stream);
  // the whole sequence's fp32 dk, dv in rank order, summed into the ranks holding those keys
  const std::size_t e = sizeof(float);
  for (int j = 0; j < C; ++j)
    for (int s = 0; s < 2; ++s) {
      const std::int64_t c = s == 0 ? j : 2 * C - 1 - j;
      float* dst = rs_send_ + std::int64_t(j) * 2 * n + s * chunk_ * w;
      copy_rows(dst, T * w * e, dk_ + c * chunk_ * w, seq_ * w * e, chunk_ * w * e, B, stream);
      copy_rows(dst + n, T * w * e, dv_ + c * chunk_ * w, seq_ * w * e, chunk_ * w * e, B, stream);
    }
  group_->reduce_scatter_sum(rs_send_, rs_recv_, 2 * n, NcclType::kFloat32, stream);
  ops::cuda::f32_to_bf16(rs_recv_, dk, n, stream);
  ops::cuda::f32_to_bf16(rs_recv_ + n, dv, n, stream);
}

// Runs: row b*2 is chunk r, row b*2+1 chunk 2C-1-r (context_parallel.cc has the neighbours).
void CudaContextParallel::exchange(const void* in, void* out, std::int64_t rows, std::int64_t F, std::size_t elem,
                                   NcclType type, bool backward, cudaStream_t stream) {
  const std::int64_t B = rows / 2;
  const std::size_t row = static_cast<std::size_t>(F) * elem, part = static_cast<std::size_t>(B) * row;
  if (part == 0) return;
  if (3 * part > halo_bytes_) {
    KEEL_CUDA_CHECK(keel::stream_sync(stream));  // work queued may still read the old staging
    if (halo_) cudaFree(halo_);
    halo_ = nullptr;
    halo_bytes_ = 0;
    if (cudaMalloc(&halo_, 3 * part) != cudaSuccess)
      throw_out_of_gpu_memory("out of GPU memory: context parallelism's halos", 3 * part, "lower batch.micro_batch");
    halo_bytes_ = 3 * part;
  }
  auto* first = static_cast<std::byte*>(halo_);
  std::byte *second = first + part, *got = second + part;
  const auto* src = static_cast<const std::byte*>(in);
  auto* dst = static_cast<std::byte*>(out);
  copy_rows(first, row, src, 2 * row, row, B, stream);
  copy_rows(second, row, src + row, 2 * row, row, B, stream);
  const int up = rank() + 1 < size() ? rank() + 1 : -1, down = rank() - 1;
  // One direction: send `what` to `to`, receive from `from` into got (zeros where none sends).
  const auto shift = [&](const void* what, int to, int from) {
    KEEL_CUDA_CHECK(cudaMemsetAsync(got, 0, part, stream));
    group_->group_start();
    if (to >= 0) group_->send(what, B * F, type, to, stream);
    if (from >= 0) group_->recv(got, B * F, type, from, stream);
    group_->group_end();
  };
  if (!backward) {
    shift(first, up, down);  // a first run's tail becomes the halo of the chunk after it, one rank up
    copy_rows(dst, 2 * row, got, row, row, B, stream);
    shift(second, down, up);  // a second run's tail goes one rank down; the last rank's own first precedes it
    copy_rows(dst + row, 2 * row, up < 0 ? first : got, row, row, B, stream);
  } else {
    shift(first, down, up);  // first runs' halo gradients go back down
    copy_rows(dst, 2 * row, up < 0 ? second : got, row, row, B, stream);
    shift(second, up, down);
    copy_rows(dst + row, 2 * row, got, row, row, B, stream);
  }
}

void CudaContextParallel::halo(const bf16* tails, bf16* halos, std::int64_t rows, std::int64_t F, cudaStream_t stream) {
  exchange(tails, halos, rows, F, sizeof(bf16), NcclType::kBfloat16, false, stream);
}

void CudaContextParallel::halo_backward(const float* dhalos, float* dtails, std::int64_t rows, std::int64_t F,
                                        cudaStream_t stream) {
  exchange(dhalos, dtails, rows, F, sizeof(float), NcclType::kFloat32, true, stream);
}

}  // namespace keel::parallel
