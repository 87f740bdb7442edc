// Head-sharded context parallelism on CPU ranks (parallel.context_mode: alltoall; DeepSpeed-
// Ulysses' schedule, and LASP-2's all-to-all baseline for linear attention). Every rank holds its
// zigzag chunks of every sequence with all heads; one MPI_Alltoall per tensor gives each rank
// the whole sequences of its 1/C of the heads (rank j: query heads [j Hq/C, (j+1) Hq/C) and the
// kv heads they read, [j Hkv/C, (j+1) Hkv/C)), in sequence order. The rank then runs the plain
// op over whole sequences (ops::attention forward/backward, causal and windowed by position;
// ops::linear_attention from a zero state, its chunks over the whole sequence), and one
// MPI_Alltoall brings each output back to the rank holding its tokens. Backward sends q, k, v,
// out, lse and dout the same way and returns dq, dk, dv: every gradient is whole where it lands,
// so nothing is summed. Traffic per layer: q, k, v and out, (C - 1) / C of each, against the
// all-gather's k and v of the whole sequence; memory: whole sequences of 1/C of the heads.
#include <mpi.h>

#include <climits>
#include <cstring>

#include "common/error.h"
#include "common/mpi_session.h"
#include "common/watchdog.h"
#include "ops/attention.h"
#include "ops/linear_attention.h"
#include "parallel/context_parallel.h"

namespace keel::parallel {

namespace la = ops::linear_attention;

namespace {
int a2a_count(std::int64_t n) {
  if (n > INT_MAX) fail("context parallel (alltoall): {} floats per rank in one all-to-all; at most {}", n, INT_MAX);
  return static_cast<int>(n);
}

std::int64_t heads_of(std::int64_t H, int C, const char* what) {
  if (H % C != 0)
    fail("context parallel (alltoall): {} {} do not split over the {} context ranks (parallel.context_mode: alltoall "
         "needs every layer's heads to divide by the context degree)",
         H, what, C);
  return H / C;
}
}  // namespace

void ContextParallel::all_to_all(std::int64_t per_rank, const char* what) {
  a2a_recv_.resize(a2a_send_.size());
  PeerWait wait(what);
  mpi_check(MPI_Alltoall(a2a_send_.data(), a2a_count(per_rank), MPI_FLOAT, a2a_recv_.data(), a2a_count(per_rank),
                         MPI_FLOAT, comm_),
            "MPI_Alltoall");
}

void ContextParallel::to_heads(const float* x, std::int64_t B, std::int64_t H, std::int64_t w, std::vector<float>& whole) {
  const std::int64_t T = 2 * chunk_, h = heads_of(H, size_, "heads"), row = h * w, per_rank = B * T * row;
  a2a_send_.resize(static_cast<std::size_t>(per_rank * size_));
  for (int j = 0; j < size_; ++j)  // rank j's heads of this rank's rows
    for (std::int64_t bt = 0; bt < B * T; ++bt)
      std::memcpy(a2a_send_.data() + j * per_rank + bt * row, x + (bt * H + j * h) * w,
                  sizeof(float) * static_cast<std::size_t>(row));
  all_to_all(per_rank, "MPI_Alltoall (context-parallel heads)");
  whole.resize(static_cast<std::size_t>(B * seq_ * row));
  for (int i = 0; i < size_; ++i)  // rank i's rows of this rank's heads, at their positions
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < T; ++t)
        std::memcpy(whole.data() + seq_row(i, b, t) * row, a2a_recv_.data() + i * per_rank + (b * T + t) * row,
                    sizeof(float) * static_cast<std::size_t>(row));
}

void ContextParallel::from_heads(const std::vector<float>& whole, std::int64_t B, std::int64_t H, std::int64_t w,
                                 float* x) {
  const std::int64_t T = 2 * chunk_, h = heads_of(H, size_, "heads"), row = h * w, per_rank = B * T * row;
  a2a_send_.resize(static_cast<std::size_t>(per_rank * size_));
  for (int i = 0; i < size_; ++i)  // rank i's rows of this rank's heads
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < T; ++t)
        std::memcpy(a2a_send_.data() + i * per_rank + (b * T + t) * row, whole.data() + seq_row(i, b, t) * row,
                    sizeof(float) * static_cast<std::size_t>(row));
  all_to_all(per_rank, "MPI_Alltoall (context-parallel heads back)");
  for (int j = 0; j < size_; ++j)  // rank j's heads of this rank's rows
    for (std::int64_t bt = 0; bt < B * T; ++bt)
      std::memcpy(x + (bt * H + j * h) * w, a2a_recv_.data() + j * per_rank + bt * row,
                  sizeof(float) * static_cast<std::size_t>(row));
}

void ContextParallel::lse_to_heads(const float* lse, std::int64_t B, std::int64_t H, std::vector<float>& whole) {
  const std::int64_t T = 2 * chunk_, h = heads_of(H, size_, "heads"), per_rank = B * h * T;
  a2a_send_.resize(static_cast<std::size_t>(per_rank * size_));
  for (int j = 0; j < size_; ++j)
    for (std::int64_t b = 0; b < B; ++b)
      std::memcpy(a2a_send_.data() + j * per_rank + b * h * T, lse + (b * H + j * h) * T,
                  sizeof(float) * static_cast<std::size_t>(h * T));
  all_to_all(per_rank, "MPI_Alltoall (context-parallel log-sum-exp)");
  whole.resize(static_cast<std::size_t>(B * h * seq_));
  for (int i = 0; i < size_; ++i)
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t g = 0; g < h; ++g)
        for (std::int64_t t = 0; t < T; ++t)
          whole[static_cast<std::size_t>((b * h + g) * seq_ + seq_row(i, 0, t))] =
              a2a_recv_[static_cast<std::size_t>(i * per_rank + (b * h + g) * T + t)];
}

void ContextParallel::lse_from_heads(const std::vector<float>& whole, std::int64_t B, std::int64_t H, float* lse) {
  const std::int64_t T = 2 * chunk_, h = heads_of(H, size_, "heads"), per_rank = B * h * T;
  a2a_send_.resize(static_cast<std::size_t>(per_rank * size_));
  for (int i = 0; i < size_; ++i)
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t g = 0; g < h; ++g)
        for (std::int64_t t = 0; t < T; ++t)
          a2a_send_[static_cast<std::size_t>(i * per_rank + (b * h + g) * T + t)] =
              whole[static_cast<std::size_t>((b * h + g) * seq_ + seq_row(i, 0, t))];
  all_to_all(per_rank, "MPI_Alltoall (context-parallel log-sum-exp back)");
  for (int j = 0; j < size_; ++j)
    for (std::int64_t b = 0; b < B; ++b)
      std::memcpy(lse + (b * H + j * h) * T, a2a_recv_.data() + j * per_rank + b * h * T,
                  sizeof(float) * static_cast<std::size_t>(h * T));
}

void ContextParallel::attend_heads(const Tensor& q, const Tensor& k, const Tensor& v, float scale, int window,
                                   const Tensor& out, const Tensor& lse) {
  const std::int64_t B = q.dim(0), Hq = q.dim(2), Hkv = k.dim(2), D = q.dim(3);
  const std::int64_t hq = heads_of(Hq, size_, "query heads"), hkv = heads_of(Hkv, size_, "kv heads");
  to_heads(q.data(), B, Hq, D, hq_);
  to_heads(k.data(), B, Hkv, D, hk_);
  to_heads(v.data(), B, Hkv, D, hv_);
  ho_.resize(hq_.size());
  hl_.resize(static_cast<std::size_t>(B * hq * seq_));
  ops::attention::forward(Tensor(hq_.data(), {B, seq_, hq, D}), Tensor(hk_.data(), {B, seq_, hkv, D}),
                          Tensor(hv_.data(), {B, seq_, hkv, D}), scale, Tensor(ho_.data(), {B, seq_, hq, D}),
                          Tensor(hl_.data(), {B, hq, seq_}), window);
  from_heads(ho_, B, Hq, D, out.data());
  lse_from_heads(hl_, B, Hq, lse.data());
}

void ContextParallel::attend_heads_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                            const Tensor& lse, const Tensor& dout, float scale, int window,
                                            const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  const std::int64_t B = q.dim(0), Hq = q.dim(2), Hkv = k.dim(2), D = q.dim(3);
  const std::int64_t hq = heads_of(Hq, size_, "query heads"), hkv = heads_of(Hkv, size_, "kv heads");
  to_heads(q.data(), B, Hq, D, hq_);
  to_heads(k.data(), B, Hkv, D, hk_);
  to_heads(v.data(), B, Hkv, D, hv_);
  to_heads(out.data(), B, Hq, D, ho_);
  to_heads(dout.data(), B, Hq, D, hd_);
  lse_to_heads(lse.data(), B, Hq, hl_);
  hdq_.resize(hq_.size());
  hdk_.resize(hk_.size());
  hdv_.resize(hv_.size());
  ops::attention::backward(Tensor(hq_.data(), {B, seq_, hq, D}), Tensor(hk_.data(), {B, seq_, hkv, D}),
                           Tensor(hv_.data(), {B, seq_, hkv, D}), Tensor(ho_.data(), {B, seq_, hq, D}),
                           Tensor(hl_.data(), {B, hq, seq_}), Tensor(hd_.data(), {B, seq_, hq, D}), scale,
                           Tensor(hdq_.data(), {B, seq_, hq, D}), Tensor(hdk_.data(), {B, seq_, hkv, D}),
                           Tensor(hdv_.data(), {B, seq_, hkv, D}), window);
  from_heads(hdq_, B, Hq, D, dq.data());
  from_heads(hdk_, B, Hkv, D, dk.data());
  from_heads(hdv_, B, Hkv, D, dv.data());
}

namespace {
// The linear-attention config of rank `rank`'s heads: 1/C of the query and kv heads, their decays.
la::Config heads_config(const la::Config& c, int C, int rank) {
  la::Config h = c;
  h.heads = static_cast<int>(heads_of(c.heads, C, "query heads"));
  h.kv_heads = static_cast<int>(heads_of(c.kv_heads, C, "kv heads"));
  if (!c.decay.empty())
    h.decay.assign(c.decay.begin() + std::int64_t(rank) * h.kv_heads, c.decay.begin() + std::int64_t(rank + 1) * h.kv_heads);
  return h;
}
}  // namespace

void ContextParallel::attend_linear_heads(const la::Config& c, std::int64_t runs, const Tensor& q, const Tensor& k,
                                          const Tensor& v, const Tensor& init, const Tensor& out) {
  const std::int64_t B = runs / 2, D = c.head_dim;
  const la::Config h = heads_config(c, size_, rank_);
  to_heads(q.data(), B, c.heads, D, hq_);
  to_heads(k.data(), B, c.kv_heads, D, hk_);
  to_heads(v.data(), B, c.kv_heads, D, hv_);
  ho_.resize(hq_.size());
  // whole sequences start from zeros: the runs' initial states are not used (kept zero, as the
  // block saves them)
  init.zero();
  la::forward(h, B, seq_, Tensor(hq_.data(), {B * seq_, h.heads * D}), Tensor(hk_.data(), {B * seq_, h.kv_heads * D}),
              Tensor(hv_.data(), {B * seq_, h.kv_heads * D}), Tensor(), Tensor(ho_.data(), {B * seq_, h.heads * D}));
  from_heads(ho_, B, c.heads, D, out.data());
}

void ContextParallel::attend_linear_heads_backward(const la::Config& c, std::int64_t runs, const Tensor& q,
                                                   const Tensor& k, const Tensor& v, const Tensor& /*init*/,
                                                   const Tensor& dout, const Tensor& dq, const Tensor& dk,
                                                   const Tensor& dv) {
  const std::int64_t B = runs / 2, D = c.head_dim;
  const la::Config h = heads_config(c, size_, rank_);
  to_heads(q.data(), B, c.heads, D, hq_);
  to_heads(k.data(), B, c.kv_heads, D, hk_);
  to_heads(v.data(), B, c.kv_heads, D, hv_);
  to_heads(dout.data(), B, c.heads, D, hd_);
  hdq_.resize(hq_.size());
  hdk_.resize(hk_.size());
  hdv_.resize(hv_.size());
  const std::int64_t N = B * seq_;
  la::backward(h, B, seq_, Tensor(hq_.data(), {N, h.heads * D}), Tensor(hk_.data(), {N, h.kv_heads * D}),
               Tensor(hv_.data(), {N, h.kv_heads * D}), Tensor(), Tensor(hd_.data(), {N, h.heads * D}), Tensor(),
               Tensor(hdq_.data(), {N, h.heads * D}), Tensor(hdk_.data(), {N, h.kv_heads * D}),
               Tensor(hdv_.data(), {N, h.kv_heads * D}), Tensor());
  from_heads(hdq_, B, c.heads, D, dq.data());
  from_heads(hdk_, B, c.kv_heads, D, dk.data());
  from_heads(hdv_, B, c.kv_heads, D, dv.data());
}

}  // namespace keel::parallel
