// Ring attention for context parallelism on CPU ranks (parallel.context_mode: ring): instead of
// all-gathering every rank's k and v, each rank's block (its two zigzag chunks) travels around
// the context group, one hop per step, and this rank's queries attend to one block at a time
// (ops::attention::forward_block at the block's global positions), merged by log-sum-exp. Only
// two blocks of k and v are held at once, against the whole sequence's under the all-gather.
// Forward: C - 1 hops; the next block's transfer (MPI_Isend / MPI_Irecv) runs while this rank
// computes on the current one. Backward: the blocks travel again with their dk, dv
// accumulators; each rank adds its queries' share (ops::attention::backward_block, with the
// forward's final out and lse) and passes the block on; after C hops every block is back home
// with the whole group's dk, dv. In backward the k, v part of each hop runs while the block is
// computed; the dk, dv part goes once this rank has added its share.
//
// Linear attention under the ring mode: LASP-1's point-to-point state passing instead of LASP-2's
// all-gather. The running d x d state walks the 2C chunks in sequence order, rank to rank:
// forward, rank r receives the state before chunk r from rank r - 1 (zeros at rank 0), runs its
// first run from it and passes gamma^L S + M_r on to rank r + 1; the last rank keeps it for its
// own second run (chunk C), whose successor state goes back down, rank r + 1 to rank r, for the
// second runs. Backward walks the chunks in reverse with the state gradients (the suffix sums
// LASP-2 forms from its gathered dS). 2C - 1 sequential hops each way, against LASP-2's one
// all-gather: the schedule LASP-2 is measured against.
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <utility>

#include "common/error.h"
#include "common/mpi_session.h"
#include "common/watchdog.h"
#include "ops/attention.h"
#include "ops/linear_attention.h"
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
    const bool more = s + 1 < size_;  // k, v move on while this block is computed; the last hop carries only dk, dv
    MPI_Request kv[2], acc[2];
    if (more) ring_hop(cur, next, 2 * n, false, kv);
    ops::attention::backward_block(q, Tensor(cur, {B, T, H, D}), Tensor(cur + n, {B, T, H, D}), pos_.data(),
                                   ring_pos_[src].data(), out, lse, dout, scale, dq, bdk, bdv, window);
    for (std::int64_t i = 0; i < 2 * n; ++i) cur[2 * n + i] += block_dkv_[static_cast<std::size_t>(i)];
    if (size_ == 1) break;
    ring_hop(cur + 2 * n, next + 2 * n, 2 * n, true, acc);  // the accumulators just added to
    if (more) ring_wait(kv);
    std::swap(cur, next);
  }
  // `cur` is this rank's own block again, with every rank's share of its dk, dv.
  std::memcpy(dk.data(), cur + 2 * n, sizeof(float) * static_cast<std::size_t>(n));
  std::memcpy(dv.data(), cur + 3 * n, sizeof(float) * static_cast<std::size_t>(n));
}

namespace {
namespace la = ops::linear_attention;

// Run `seg`'s d x d blocks of every sequence, [B][Hkv][d x d], between a [2B, Hkv, d, d] tensor and a
// message buffer.
void pack(const float* runs, std::int64_t B, std::int64_t per_run, int seg, float* msg) {
  for (std::int64_t b = 0; b < B; ++b)
    std::memcpy(msg + b * per_run, runs + (b * 2 + seg) * per_run, sizeof(float) * static_cast<std::size_t>(per_run));
}
void unpack(const float* msg, std::int64_t B, std::int64_t per_run, int seg, float* runs) {
  for (std::int64_t b = 0; b < B; ++b)
    std::memcpy(runs + (b * 2 + seg) * per_run, msg + b * per_run, sizeof(float) * static_cast<std::size_t>(per_run));
}

// The state after a run: gamma_g^L S + M per kv head, over every sequence's block: msg [B][Hkv][dd].
void advance(const la::Config& c, std::int64_t L, std::int64_t B, std::int64_t dd, const float* own, float* msg) {
  const std::int64_t hkv = c.kv_heads;
  for (std::int64_t g = 0; g < hkv; ++g) {
    const float decay = static_cast<float>(std::pow(double(c.gamma(static_cast<int>(g))), double(L)));
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t e = 0; e < dd; ++e) {
        const std::int64_t i = (b * hkv + g) * dd + e;
        msg[i] = decay * msg[i] + own[i];
      }
  }
}
}  // namespace

// One hop of the chain: blocking, from `from` or to `to` (-1: none; a receive from none is zeros).
void ContextParallel::chain_recv(float* msg, std::int64_t n, int from) const {
  if (from < 0) {
    std::fill(msg, msg + n, 0.f);
    return;
  }
  PeerWait wait("MPI_Recv (LASP-1 state ring)");
  mpi_check(MPI_Recv(msg, ring_count(n), MPI_FLOAT, from, 2, comm_, MPI_STATUS_IGNORE), "MPI_Recv");
}

void ContextParallel::chain_send(const float* msg, std::int64_t n, int to) const {
  if (to < 0) return;
  PeerWait wait("MPI_Send (LASP-1 state ring)");
  mpi_check(MPI_Send(msg, ring_count(n), MPI_FLOAT, to, 2, comm_), "MPI_Send");
}

void ContextParallel::attend_linear_ring(const la::Config& c, std::int64_t runs, const Tensor& q, const Tensor& k,
                                         const Tensor& v, const Tensor& init, const Tensor& out) {
  const std::int64_t B = runs / 2, dd = std::int64_t(c.head_dim) * c.head_dim, per_run = c.kv_heads * dd, n = B * per_run;
  states_.resize(static_cast<std::size_t>(runs * per_run + 2 * n));
  float *M = states_.data(), *own = M + runs * per_run, *msg = own + n;
  la::local_states(c, runs, chunk_, k, v, Tensor(M, {runs, c.kv_heads, c.head_dim, c.head_dim}));
  const int last = size_ - 1;
  // First runs, up the ranks: chunk r starts from the state after chunk r - 1.
  chain_recv(msg, n, rank_ - 1);
  unpack(msg, B, per_run, 0, init.data());
  pack(M, B, per_run, 0, own);
  advance(c, chunk_, B, dd, own, msg);
  chain_send(msg, n, rank_ < last ? rank_ + 1 : -1);
  // Second runs, down the ranks: chunk 2C-1-r starts from the state after chunk 2C-2-r (rank
  // r + 1's second run; the last rank's own first run, already in msg).
  if (rank_ < last) chain_recv(msg, n, rank_ + 1);
  unpack(msg, B, per_run, 1, init.data());
  pack(M, B, per_run, 1, own);
  advance(c, chunk_, B, dd, own, msg);
  chain_send(msg, n, rank_ > 0 ? rank_ - 1 : -1);
  la::forward(c, runs, chunk_, q, k, v, init, out);
}

void ContextParallel::attend_linear_ring_backward(const la::Config& c, std::int64_t runs, const Tensor& q,
                                                  const Tensor& k, const Tensor& v, const Tensor& init,
                                                  const Tensor& dout, const Tensor& dq, const Tensor& dk,
                                                  const Tensor& dv) {
  const std::int64_t B = runs / 2, dd = std::int64_t(c.head_dim) * c.head_dim, per_run = c.kv_heads * dd, n = B * per_run;
  states_.resize(static_cast<std::size_t>(2 * runs * per_run + 2 * n));
  float *dS = states_.data(), *dM = dS + runs * per_run, *own = dM + runs * per_run, *msg = own + n;
  la::init_gradient(c, runs, chunk_, q, dout, Tensor(dS, {runs, c.kv_heads, c.head_dim, c.head_dim}));
  const int last = size_ - 1;
  // The chunks in reverse: second runs up the ranks (rank 0's is the sequence's last chunk), then
  // first runs down. dM of a run = the gradient arriving after it; it passes on gamma^L dM + dS.
  chain_recv(msg, n, rank_ > 0 ? rank_ - 1 : -1);
  unpack(msg, B, per_run, 1, dM);
  pack(dS, B, per_run, 1, own);
  advance(c, chunk_, B, dd, own, msg);
  chain_send(msg, n, rank_ < last ? rank_ + 1 : -1);
  if (rank_ < last) chain_recv(msg, n, rank_ + 1);
  unpack(msg, B, per_run, 0, dM);
  pack(dS, B, per_run, 0, own);
  advance(c, chunk_, B, dd, own, msg);
  chain_send(msg, n, rank_ > 0 ? rank_ - 1 : -1);
  la::backward(c, runs, chunk_, q, k, v, init, dout, Tensor(dM, {runs, c.kv_heads, c.head_dim, c.head_dim}), dq, dk,
               dv, {});
}

}  // namespace keel::parallel
