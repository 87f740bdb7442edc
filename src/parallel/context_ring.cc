// Ring attention for context parallelism on CPU ranks (parallel.context_mode: ring): instead of
// all-gathering every rank's k and v, each rank's block (its two zigzag chunks) travels around
// the context group, one hop per step, and this rank's queries attend to one block at a time
// (ops::attention::forward_block at the block's global positions), merged by log-sum-exp. Only
// two blocks of k and v are held at once, against the whole sequence's under the all-gather.
// Forward: C - 1 hops; the next block's transfer (MPI_Isend / MPI_Irecv) runs while this rank
// computes on the current one. Backward: the blocks travel again with their dk, dv
// accumulators; each rank adds its queries' share (ops::attention::backward_block, with the
// forward's final out and lse) and passes the block on; after C hops every block is back home
// with the whole group's dk, dv. Backward's hops are blocking (the accumulator a rank sends is
// the one it just added to).
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <utility>

#include "common/error.h"
#include "common/mpi_session.h"
#include "common/watchdog.h"
#include "ops/attention.h"
#include "parallel/context_parallel.h"

namespace keel::parallel {

namespace {

int ring_count(std::int64_t n) {
  if (n > INT_MAX) fail("context parallel (ring): a block of {} floats is too large for one MPI call", n);
  return static_cast<int>(n);
}

}  // namespace

void ContextParallel::ring_hop(float* send, float* recv, std::int64_t n, bool wait_now, MPI_Request* reqs) const {
  const int to = (rank_ + 1) % size_, from = (rank_ + size_ - 1) % size_;
  mpi_check(MPI_Irecv(recv, ring_count(n), MPI_FLOAT, from, 1, comm_, &reqs[0]), "MPI_Irecv");
  mpi_check(MPI_Isend(send, ring_count(n), MPI_FLOAT, to, 1, comm_, &reqs[1]), "MPI_Isend");
  if (wait_now) ring_wait(reqs);
}

void ContextParallel::ring_wait(MPI_Request* reqs) const {
  PeerWait wait("MPI_Isend / MPI_Irecv (context-parallel ring)");
  mpi_check(MPI_Waitall(2, reqs, MPI_STATUSES_IGNORE), "MPI_Waitall");
}

void ContextParallel::attend_ring(const Tensor& q, const Tensor& k, const Tensor& v, float scale, int window,
                                  const Tensor& out, const Tensor& lse) {
  const std::int64_t B = k.dim(0), T = k.dim(1), H = k.dim(2), D = k.dim(3), n = k.numel();
  if (T != 2 * chunk_) fail("context parallel: {} tokens per sequence here, expected {}", T, 2 * chunk_);
  require_shape(v, {B, T, H, D}, "context parallel v");
  // Two [k | v] blocks: the one computed on and the one arriving.
  ring_.resize(static_cast<std::size_t>(4 * n));
  float *cur = ring_.data(), *next = cur + 2 * n;
  std::memcpy(cur, k.data(), sizeof(float) * static_cast<std::size_t>(n));
  std::memcpy(cur + n, v.data(), sizeof(float) * static_cast<std::size_t>(n));
  block_out_.resize(static_cast<std::size_t>(out.numel()));
  block_lse_.resize(static_cast<std::size_t>(lse.numel()));
  const Tensor bo(block_out_.data(), {out.dim(0), out.dim(1), out.dim(2), out.dim(3)});
  const Tensor bl(block_lse_.data(), {lse.dim(0), lse.dim(1), lse.dim(2)});
  for (int s = 0; s < size_; ++s) {
    const int src = (rank_ - s + size_) % size_;  // whose block `cur` is
    MPI_Request reqs[2];
    if (s + 1 < size_) ring_hop(cur, next, 2 * n, false, reqs);
    const Tensor bk(cur, {B, T, H, D}), bv(cur + n, {B, T, H, D});
    if (s == 0) {
      ops::attention::forward_block(q, bk, bv, pos_.data(), ring_pos_[src].data(), scale, out, lse, window);
    } else {
      ops::attention::forward_block(q, bk, bv, pos_.data(), ring_pos_[src].data(), scale, bo, bl, window);
      ops::attention::merge(bo, bl, out, lse);
    }
    if (s + 1 < size_) {
      ring_wait(reqs);
      std::swap(cur, next);
    }
  }
}

void ContextParallel::attend_ring_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                           const Tensor& lse, const Tensor& dout, float scale, int window,
                                           const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  const std::int64_t B = k.dim(0), T = k.dim(1), H = k.dim(2), D = k.dim(3), n = k.numel();
  require_shape(dk, {B, T, H, D}, "context parallel dk");
  require_shape(dv, {B, T, H, D}, "context parallel dv");
  // Two [k | v | dk | dv] blocks: the one held and the one arriving.
  ring_.resize(static_cast<std::size_t>(8 * n));
  float *cur = ring_.data(), *next = cur + 4 * n;
  std::memcpy(cur, k.data(), sizeof(float) * static_cast<std::size_t>(n));
  std::memcpy(cur + n, v.data(), sizeof(float) * static_cast<std::size_t>(n));
  std::fill(cur + 2 * n, cur + 4 * n, 0.f);
  block_dkv_.resize(static_cast<std::size_t>(2 * n));
  const Tensor bdk(block_dkv_.data(), {B, T, H, D}), bdv(block_dkv_.data() + n, {B, T, H, D});
  std::fill(dq.data(), dq.data() + dq.numel(), 0.f);
  for (int s = 0; s < size_; ++s) {
    const int src = (rank_ - s + size_) % size_;
    ops::attention::backward_block(q, Tensor(cur, {B, T, H, D}), Tensor(cur + n, {B, T, H, D}), pos_.data(),
                                   ring_pos_[src].data(), out, lse, dout, scale, dq, bdk, bdv, window);
    for (std::int64_t i = 0; i < 2 * n; ++i) cur[2 * n + i] += block_dkv_[static_cast<std::size_t>(i)];
    if (size_ == 1) break;
    MPI_Request reqs[2];
    if (s + 1 < size_) {
      ring_hop(cur, next, 4 * n, true, reqs);
    } else {  // the last hop carries only the accumulators home
      ring_hop(cur + 2 * n, next + 2 * n, 2 * n, true, reqs);
    }
    std::swap(cur, next);
  }
  // `cur` is this rank's own block again, with every rank's share of its dk, dv.
  std::memcpy(dk.data(), cur + 2 * n, sizeof(float) * static_cast<std::size_t>(n));
  std::memcpy(dv.data(), cur + 3 * n, sizeof(float) * static_cast<std::size_t>(n));
}

}  // namespace keel::parallel
