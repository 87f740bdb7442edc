// LASP-2 (arXiv 2502.07563) on CPU ranks: linear attention over the context group, ContextParallel's
// attend_linear / attend_linear_backward (context_parallel.h). One MPI all-gather of the runs'
// memory states per layer in forward, one of the state gradients in backward; no ring. Each
// gather is posted (MPI_Iallgather) as soon as its input exists: with begin_linear before the
// block's q projection, which computes while the states travel (begin_linear_backward before
// the output projection's weight gradient), and waited for by the attend call.
//
// The rank's two zigzag runs of each sequence are chunks r and 2C-1-r of the 2C chunks of L tokens.
// Forward: each run's own state M_j (ops::linear_attention::local_states), gathered; chunk j starts
// from S_j = sum_{i<j} gamma^(L (j-1-i)) M_i, the prefix in sequence order (S_{j+1} = gamma^L S_j
// + M_j), written to the layer's saved `init`; then the runs' outputs from their initial states.
// Backward: each run's initial-state gradient dS_j (init_gradient), gathered; the gradient of M_j is
// the suffix dM_j = sum_{i>j} gamma^(L (i-1-j)) dS_i; backward takes it as dlocal, so dk and dv
// carry both paths. Every rank sums the prefixes in the same order: the same bits everywhere.
#include <cmath>
#include <cstring>

#include "common/error.h"
#include "common/mpi_session.h"
#include "common/watchdog.h"
#include "ops/linear_attention.h"
#include "parallel/context_parallel.h"

namespace keel::parallel {

namespace la = ops::linear_attention;

void ContextParallel::start_gather(const Tensor& mine) {
  const std::int64_t n = mine.numel();
  if (n > INT32_MAX) fail("context parallel: {} floats of LASP-2 states per rank is too large for one MPI call", n);
  recv_.resize(static_cast<std::size_t>(n * size_));
  mpi_check(MPI_Iallgather(mine.data(), static_cast<int>(n), MPI_FLOAT, recv_.data(), static_cast<int>(n), MPI_FLOAT,
                           comm_, &begun_req_),
            "MPI_Iallgather");
}

void ContextParallel::finish_gather(const char* what) {
  PeerWait wait(what);
  mpi_check(MPI_Wait(&begun_req_, MPI_STATUS_IGNORE), "MPI_Wait");
}

std::int64_t ContextParallel::linear_states(const la::Config& c, std::int64_t runs, std::int64_t rows) const {
  if (runs % 2 || rows != runs * chunk_)
    fail("context parallel: linear attention over {} runs of {} rows, expected 2 runs of {} per sequence", runs,
         rows / std::max<std::int64_t>(runs, 1), chunk_);
  return runs * c.kv_heads * std::int64_t(c.head_dim) * c.head_dim;
}

// The states and their gather before the caller's q projection: attend_linear finds them begun.
void ContextParallel::begin_linear(const la::Config& c, std::int64_t runs, const Tensor& k, const Tensor& v) {
  if (ring() || mode_ == ContextMode::kAllToAll) return;
  if (begun_) fail("context parallel: LASP-2's states begun twice without attend_linear between");
  const std::int64_t n = linear_states(c, runs, k.rows());
  states_.resize(static_cast<std::size_t>(n));
  const Tensor M(states_.data(), {runs, c.kv_heads, c.head_dim, c.head_dim});
  la::local_states(c, runs, chunk_, k, v, M);
  start_gather(M);
  begun_ = 1;
}

void ContextParallel::begin_linear_backward(const la::Config& c, std::int64_t runs, const Tensor& q,
                                            const Tensor& dout) {
  if (ring() || mode_ == ContextMode::kAllToAll) return;
  if (begun_) fail("context parallel: LASP-2's state gradients begun with another exchange unfinished");
  const std::int64_t n = linear_states(c, runs, q.rows());
  states_.resize(static_cast<std::size_t>(2 * n));
  const Tensor dS(states_.data(), {runs, c.kv_heads, c.head_dim, c.head_dim});
  la::init_gradient(c, runs, chunk_, q, dout, dS);
  start_gather(dS);
  begun_ = 2;
}

// The gathered per-run blocks [C][B * 2][Hkv][d][d] walked in sequence order for each sequence and
// kv head: fn(j, owner block or nullptr, mine: this rank's block of chunk j or nullptr).
template <typename Fn>
void ContextParallel::walk_chunks(std::int64_t B, std::int64_t hkv, std::int64_t dd, float* local, bool reverse,
                                  Fn&& fn) const {
  const std::int64_t runs = 2 * B, per_rank = runs * hkv * dd;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t g = 0; g < hkv; ++g)
      for (int step = 0; step < 2 * size_; ++step) {
        const int j = reverse ? 2 * size_ - 1 - step : step;
        const int owner = j < size_ ? j : 2 * size_ - 1 - j, seg = j < size_ ? 0 : 1;
        const std::int64_t block = ((b * 2 + seg) * hkv + g) * dd;
        fn(g, recv_.data() + owner * per_rank + block, owner == rank_ ? local + block : nullptr, step == 0);
      }
}

void ContextParallel::attend_linear(const la::Config& c, std::int64_t runs, const Tensor& q, const Tensor& k,
                                    const Tensor& v, const Tensor& init, const Tensor& out) {
  const std::int64_t B = runs / 2, hkv = c.kv_heads, dd = std::int64_t(c.head_dim) * c.head_dim;
  linear_states(c, runs, q.rows());
  require_shape(init, {runs, hkv, c.head_dim, c.head_dim}, "context parallel linear attention init");
  if (ring()) return attend_linear_ring(c, runs, q, k, v, init, out);  // LASP-1 (context_ring.cc)
  if (mode_ == ContextMode::kAllToAll) return attend_linear_heads(c, runs, q, k, v, init, out);
  if (begun_ == 2) fail("context parallel: attend_linear with LASP-2's state gradients begun");
  if (!begun_) begin_linear(c, runs, k, v);
  finish_gather("MPI_Allgather (LASP-2 memory states)");
  begun_ = 0;
  std::vector<float> S(static_cast<std::size_t>(dd));
  walk_chunks(B, hkv, dd, init.data(), /*reverse=*/false, [&](std::int64_t g, const float* Mj, float* mine, bool first) {
    if (first) std::fill(S.begin(), S.end(), 0.f);
    if (mine) std::memcpy(mine, S.data(), sizeof(float) * static_cast<std::size_t>(dd));
    const float decay = static_cast<float>(std::pow(double(c.gamma(static_cast<int>(g))), double(chunk_)));
    for (std::int64_t e = 0; e < dd; ++e) S[static_cast<std::size_t>(e)] = decay * S[static_cast<std::size_t>(e)] + Mj[e];
  });
  la::forward(c, runs, chunk_, q, k, v, init, out);
}

void ContextParallel::attend_linear_backward(const la::Config& c, std::int64_t runs, const Tensor& q, const Tensor& k,
                                             const Tensor& v, const Tensor& init, const Tensor& dout, const Tensor& dq,
                                             const Tensor& dk, const Tensor& dv) {
  if (ring()) return attend_linear_ring_backward(c, runs, q, k, v, init, dout, dq, dk, dv);
  if (mode_ == ContextMode::kAllToAll) return attend_linear_heads_backward(c, runs, q, k, v, init, dout, dq, dk, dv);
  const std::int64_t B = runs / 2, hkv = c.kv_heads, dd = std::int64_t(c.head_dim) * c.head_dim;
  if (begun_ == 1) fail("context parallel: attend_linear_backward with LASP-2's states begun");
  if (!begun_) begin_linear_backward(c, runs, q, dout);
  finish_gather("MPI_Allgather (LASP-2 state gradients)");
  begun_ = 0;
  const Tensor dM(states_.data() + runs * hkv * dd, {runs, hkv, c.head_dim, c.head_dim});
  std::vector<float> D(static_cast<std::size_t>(dd));
  walk_chunks(B, hkv, dd, dM.data(), /*reverse=*/true, [&](std::int64_t g, const float* dSj, float* mine, bool first) {
    if (first) std::fill(D.begin(), D.end(), 0.f);
    if (mine) std::memcpy(mine, D.data(), sizeof(float) * static_cast<std::size_t>(dd));
    const float decay = static_cast<float>(std::pow(double(c.gamma(static_cast<int>(g))), double(chunk_)));
    for (std::int64_t e = 0; e < dd; ++e) D[static_cast<std::size_t>(e)] = decay * D[static_cast<std::size_t>(e)] + dSj[e];
  });
  la::backward(c, runs, chunk_, q, k, v, init, dout, dM, dq, dk, dv, {});
}

}  // namespace keel::parallel
