// Head-sharded context parallelism on GPUs (parallel.context_mode: alltoall): the GPU twin of
// context_alltoall.cc (read that first), CudaContextParallel's heads mode. Each all-to-all is one
// NCCL group of a send and a receive per rank; packing and unpacking are strided copies
// (cudaMemcpy2DAsync), no kernels. Rank j of the context group holds, between the exchanges,
// query heads [j Hq/C, (j+1) Hq/C) and kv heads [j Hkv/C, (j+1) Hkv/C) of whole sequences, in
// sequence order; the plain kernels (ops/cuda/attention.h, ops/cuda/linear_attention.h) run on
// them unchanged. Buffers: the send and receive staging and the whole-sequence tensors of one
// layer (about 6 x q + 4 x kv + lse in backward), grown on demand.
#include <fmt/format.h>

#include <algorithm>

#include "common/error.h"
#include "device/cuda_check.h"
#include "device/device_arena.h"
#include "device/device_buffer.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/linear_attention.h"
#include "parallel/context_mode.h"
#include "parallel/context_parallel_cuda.h"
#include "parallel/copy_rows_cuda.h"

namespace keel::parallel {

namespace la = ops::cuda::linear_attention;

namespace {
const auto aligned = &context_aligned;  // the regions' alignment (context_mode.h)

// The scratch in context_mode.h's order: the send and receive staging (the local q's size each,
// the largest send; to_heads and from_heads use it), then the regions the caller takes.
DeviceCarver past_staging(std::byte* base, std::size_t bytes, std::int64_t nq) {
  DeviceCarver cv(base, bytes);
  cv.take<__nv_bfloat16>(nq);
  cv.take<__nv_bfloat16>(nq);
  return cv;
}
}  // namespace

std::int64_t CudaContextParallel::heads_of(std::int64_t H, const char* what) const {
  if (H % size() != 0)
    fail("context parallel (cuda, alltoall): {} {} do not split over the {} context ranks (parallel.context_mode: "
         "alltoall needs every layer's heads to divide by the context degree)",
         H, what, size());
  return H / size();
}

std::byte* CudaContextParallel::heads_scratch(std::size_t bytes, cudaStream_t stream) {
  return static_cast<std::byte*>(scratch_.ensure(bytes, stream, ring_ ? "ring blocks" : "all-to-all buffers"));
}

void CudaContextParallel::all_to_all(const void* send, void* recv, std::int64_t per_rank, NcclType type,
                                     std::size_t elem, cudaStream_t stream) {
  const auto* s = static_cast<const std::byte*>(send);
  auto* r = static_cast<std::byte*>(recv);
  const std::size_t block = elem * static_cast<std::size_t>(per_rank);
  group_->group_start();
  for (int j = 0; j < size(); ++j) {
    group_->send(s + j * block, per_rank, type, j, stream);
    group_->recv(r + j * block, per_rank, type, j, stream);
  }
  group_->group_end();
}

// The staging sits at the start of the scratch: [send | receive], each the local tensor's size.
void CudaContextParallel::to_heads(const void* x, std::int64_t H, std::int64_t w, std::size_t e, NcclType type,
                                   void* whole, cudaStream_t stream) {
  const std::int64_t B = batch_, T = 2 * chunk_, C = size(), h = heads_of(H, "heads"), row = h * w, per = B * T * row;
  auto* send = static_cast<std::byte*>(scratch_.get());
  std::byte* recv = send + aligned(e * static_cast<std::size_t>(per * C));
  const auto* src = static_cast<const std::byte*>(x);
  auto* dst = static_cast<std::byte*>(whole);
  for (int j = 0; j < C; ++j)  // rank j's heads of this rank's rows
    copy_rows(send + j * per * e, row * e, src + j * row * e, H * w * e, row * e, B * T, stream);
  all_to_all(send, recv, per, type, e, stream);
  for (int i = 0; i < C; ++i)  // rank i's two chunks of each sequence, of this rank's heads, at their places
    for (int s = 0; s < 2; ++s) {
      const std::int64_t c = s == 0 ? i : 2 * C - 1 - i;
      copy_rows(dst + c * chunk_ * row * e, seq_ * row * e, recv + (i * per + s * chunk_ * row) * e, T * row * e,
                chunk_ * row * e, B, stream);
    }
}

void CudaContextParallel::from_heads(const void* whole, std::int64_t H, std::int64_t w, std::size_t e, NcclType type,
                                     void* x, cudaStream_t stream) {
  const std::int64_t B = batch_, T = 2 * chunk_, C = size(), h = heads_of(H, "heads"), row = h * w, per = B * T * row;
  auto* send = static_cast<std::byte*>(scratch_.get());
  std::byte* recv = send + aligned(e * static_cast<std::size_t>(per * C));
  const auto* src = static_cast<const std::byte*>(whole);
  auto* dst = static_cast<std::byte*>(x);
  for (int i = 0; i < C; ++i)  // rank i's rows of this rank's heads
    for (int s = 0; s < 2; ++s) {
      const std::int64_t c = s == 0 ? i : 2 * C - 1 - i;
      copy_rows(send + (i * per + s * chunk_ * row) * e, T * row * e, src + c * chunk_ * row * e, seq_ * row * e,
                chunk_ * row * e, B, stream);
    }
  all_to_all(send, recv, per, type, e, stream);
  for (int j = 0; j < C; ++j)  // rank j's heads of this rank's rows
    copy_rows(dst + j * row * e, H * w * e, recv + j * per * e, row * e, row * e, B * T, stream);
}

void CudaContextParallel::lse_to_heads(const float* lse, std::int64_t H, float* whole, cudaStream_t stream) {
  const std::int64_t B = batch_, T = 2 * chunk_, C = size(), h = heads_of(H, "query heads"), per = B * h * T;
  const std::size_t e = sizeof(float);
  auto* send = static_cast<float*>(scratch_.get());
  float* recv = send + aligned(e * static_cast<std::size_t>(per * C)) / e;
  for (int j = 0; j < C; ++j)  // [B, h, T] of rank j's heads
    copy_rows(send + j * per, h * T * e, lse + j * h * T, H * T * e, h * T * e, B, stream);
  all_to_all(send, recv, per, NcclType::kFloat32, e, stream);
  for (int i = 0; i < C; ++i)
    for (int s = 0; s < 2; ++s) {
      const std::int64_t c = s == 0 ? i : 2 * C - 1 - i;
      copy_rows(whole + c * chunk_, seq_ * e, recv + i * per + s * chunk_, T * e, chunk_ * e, B * h, stream);
    }
}

void CudaContextParallel::lse_from_heads(const float* whole, std::int64_t H, float* lse, cudaStream_t stream) {
  const std::int64_t B = batch_, T = 2 * chunk_, C = size(), h = heads_of(H, "query heads"), per = B * h * T;
  const std::size_t e = sizeof(float);
  auto* send = static_cast<float*>(scratch_.get());
  float* recv = send + aligned(e * static_cast<std::size_t>(per * C)) / e;
  for (int i = 0; i < C; ++i)
    for (int s = 0; s < 2; ++s) {
      const std::int64_t c = s == 0 ? i : 2 * C - 1 - i;
      copy_rows(send + i * per + s * chunk_, T * e, whole + c * chunk_, seq_ * e, chunk_ * e, B * h, stream);
    }
  all_to_all(send, recv, per, NcclType::kFloat32, e, stream);
  for (int j = 0; j < C; ++j)
    copy_rows(lse + j * h * T, H * T * e, recv + j * per, h * T * e, h * T * e, B, stream);
}

void CudaContextParallel::heads_forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int Hq,
                                        int Hkv, int Dh, float scale, int window, cudaStream_t stream) {
  const std::int64_t hq = heads_of(Hq, "query heads"), hkv = heads_of(Hkv, "kv heads");
  const std::int64_t nq = batch_ * seq_ * hq * Dh, nkv = batch_ * seq_ * hkv * Dh, nl = batch_ * hq * seq_;
  const std::size_t bytes = alltoall_forward_bytes({batch_, 2 * chunk_, Hq, Hkv, Dh});
  DeviceCarver cv = past_staging(heads_scratch(bytes, stream), bytes, nq);
  bf16 *Q = cv.take<bf16>(nq), *O = cv.take<bf16>(nq), *K = cv.take<bf16>(nkv), *V = cv.take<bf16>(nkv);
  float* L = cv.take<float>(nl);
  const NcclType b16 = NcclType::kBfloat16;
  to_heads(q, Hq, Dh, sizeof(bf16), b16, Q, stream);
  to_heads(k, Hkv, Dh, sizeof(bf16), b16, K, stream);
  to_heads(v, Hkv, Dh, sizeof(bf16), b16, V, stream);
  ops::cuda::attention::forward(Q, K, V, O, L, static_cast<int>(batch_), static_cast<int>(seq_), static_cast<int>(hq),
                                static_cast<int>(hkv), Dh, scale, window, stream);
  from_heads(O, Hq, Dh, sizeof(bf16), b16, out, stream);
  lse_from_heads(L, Hq, lse, stream);
}

void CudaContextParallel::heads_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out,
                                         const float* lse, const bf16* dout, bf16* dq, bf16* dk, bf16* dv,
                                         void* workspace, int Hq, int Hkv, int Dh, float scale, int window,
                                         cudaStream_t stream) {
  const std::int64_t hq = heads_of(Hq, "query heads"), hkv = heads_of(Hkv, "kv heads");
  const std::int64_t nq = batch_ * seq_ * hq * Dh, nkv = batch_ * seq_ * hkv * Dh, nl = batch_ * hq * seq_;
  const std::size_t bytes = alltoall_backward_bytes({batch_, 2 * chunk_, Hq, Hkv, Dh});
  DeviceCarver cv = past_staging(heads_scratch(bytes, stream), bytes, nq);
  bf16 *Q = cv.take<bf16>(nq), *O = cv.take<bf16>(nq), *D = cv.take<bf16>(nq), *dQ = cv.take<bf16>(nq);
  bf16 *K = cv.take<bf16>(nkv), *V = cv.take<bf16>(nkv), *dK = cv.take<bf16>(nkv), *dV = cv.take<bf16>(nkv);
  float* L = cv.take<float>(nl);
  const NcclType b16 = NcclType::kBfloat16;
  to_heads(q, Hq, Dh, sizeof(bf16), b16, Q, stream);
  to_heads(k, Hkv, Dh, sizeof(bf16), b16, K, stream);
  to_heads(v, Hkv, Dh, sizeof(bf16), b16, V, stream);
  to_heads(out, Hq, Dh, sizeof(bf16), b16, O, stream);
  to_heads(dout, Hq, Dh, sizeof(bf16), b16, D, stream);
  lse_to_heads(lse, Hq, L, stream);
  ops::cuda::attention::backward(Q, K, V, O, L, D, dQ, dK, dV, workspace, static_cast<int>(batch_),
                                 static_cast<int>(seq_), static_cast<int>(hq), static_cast<int>(hkv), Dh, scale, window,
                                 stream);
  from_heads(dQ, Hq, Dh, sizeof(bf16), b16, dq, stream);
  from_heads(dK, Hkv, Dh, sizeof(bf16), b16, dk, stream);
  from_heads(dV, Hkv, Dh, sizeof(bf16), b16, dv, stream);
}

// The linear-attention config of this rank's heads: 1/C of the query and kv heads, their decays.
la::Config CudaContextParallel::heads_config(const la::Config& c) const {
  la::Config h = c;
  h.heads = static_cast<int>(heads_of(c.heads, "query heads"));
  h.kv_heads = static_cast<int>(heads_of(c.kv_heads, "kv heads"));
  if (!c.decay.empty())
    h.decay.assign(c.decay.begin() + std::int64_t(rank()) * h.kv_heads,
                   c.decay.begin() + std::int64_t(rank() + 1) * h.kv_heads);
  return h;
}

void CudaContextParallel::heads_linear(const la::Config& c, const bf16* q, const bf16* k, const bf16* v, float* init,
                                       bf16* out, void* workspace, cudaStream_t stream) {
  const la::Config h = heads_config(c);
  const std::int64_t D = c.head_dim, nq = batch_ * seq_ * h.heads * D, nkv = batch_ * seq_ * h.kv_heads * D;
  const std::size_t bytes = alltoall_linear_forward_bytes({batch_, 2 * chunk_, c.heads, c.kv_heads, D});
  DeviceCarver cv = past_staging(heads_scratch(bytes, stream), bytes, nq);
  bf16 *Q = cv.take<bf16>(nq), *O = cv.take<bf16>(nq), *K = cv.take<bf16>(nkv), *V = cv.take<bf16>(nkv);
  // whole sequences start from zeros: the runs' initial states are not used (kept zero, as the
  // block saves them)
  const std::int64_t states = 2 * batch_ * c.kv_heads * D * D;
  KEEL_CUDA_CHECK(cudaMemsetAsync(init, 0, sizeof(float) * static_cast<std::size_t>(states), stream));
  const NcclType b16 = NcclType::kBfloat16;
  to_heads(q, c.heads, D, sizeof(bf16), b16, Q, stream);
  to_heads(k, c.kv_heads, D, sizeof(bf16), b16, K, stream);
  to_heads(v, c.kv_heads, D, sizeof(bf16), b16, V, stream);
  la::forward(h, batch_, seq_, Q, K, V, nullptr, O, workspace, stream);
  from_heads(O, c.heads, D, sizeof(bf16), b16, out, stream);
}

void CudaContextParallel::heads_linear_backward(const la::Config& c, const bf16* q, const bf16* k, const bf16* v,
                                                const bf16* dout, bf16* dq, bf16* dk, bf16* dv, void* workspace,
                                                cudaStream_t stream) {
  const la::Config h = heads_config(c);
  const std::int64_t D = c.head_dim, nq = batch_ * seq_ * h.heads * D, nkv = batch_ * seq_ * h.kv_heads * D;
  const std::size_t bytes = alltoall_linear_backward_bytes({batch_, 2 * chunk_, c.heads, c.kv_heads, D});
  DeviceCarver cv = past_staging(heads_scratch(bytes, stream), bytes, nq);
  bf16 *Q = cv.take<bf16>(nq), *Dout = cv.take<bf16>(nq), *dQ = cv.take<bf16>(nq);
  bf16 *K = cv.take<bf16>(nkv), *V = cv.take<bf16>(nkv), *dK = cv.take<bf16>(nkv), *dV = cv.take<bf16>(nkv);
  const NcclType b16 = NcclType::kBfloat16;
  to_heads(q, c.heads, D, sizeof(bf16), b16, Q, stream);
  to_heads(k, c.kv_heads, D, sizeof(bf16), b16, K, stream);
  to_heads(v, c.kv_heads, D, sizeof(bf16), b16, V, stream);
  to_heads(dout, c.heads, D, sizeof(bf16), b16, Dout, stream);
  la::backward(h, batch_, seq_, Q, K, V, nullptr, Dout, nullptr, dQ, dK, dV, nullptr, workspace, stream);
  from_heads(dQ, c.heads, D, sizeof(bf16), b16, dq, stream);
  from_heads(dK, c.kv_heads, D, sizeof(bf16), b16, dk, stream);
  from_heads(dV, c.kv_heads, D, sizeof(bf16), b16, dv, stream);
}

}  // namespace keel::parallel
