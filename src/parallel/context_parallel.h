// Context parallelism on CPU ranks (MPI): each sequence's tokens split over the C ranks of the
// context group, for sequences too long for one device. The runners the plan (plan.h) hands
// every block when the mesh's cp degree is above 1.
//
// Partition (zigzag, load-balanced for causal attention): a sequence of S tokens is 2C chunks
// of S / (2C); rank r holds chunks r and 2C-1-r, in that order, so its rows of a micro-batch are
// B sequences x 2 runs x S / (2C) tokens (ops/sequence_split.h's layout). Each rank does the
// same attention work: chunk r attends to r + 1 chunks, chunk 2C-1-r to 2C-r. Positions (RoPE)
// are global (positions()).
//
// Everything per token (embedding, norms, the router, the experts, the LM head) runs on this
// rank's tokens. The sequence mixers need the rest of the sequence:
//   attention   all-gather of every rank's k and v over the group (cheap for ZAYA1's 2 kv heads),
//               then this rank's queries at their global positions over the whole sequence
//               (ops::attention::forward_at). Backward: the same gather, then dk and dv of the
//               whole sequence reduce-scattered back to the ranks that hold those keys.
//               Or a ring (parallel.context_mode: ring; context_ring.cc): the ranks' blocks of
//               k and v travel around the group, one at a time, merged by log-sum-exp; two
//               blocks held at once instead of the whole sequence. Linear layers then pass
//               their states rank to rank (LASP-1) instead of LASP-2's all-gather.
//               Or heads (parallel.context_mode: alltoall; context_alltoall.cc, DeepSpeed-
//               Ulysses' schedule): one all-to-all turns every rank's q, k, v of its tokens and
//               all heads into the whole sequences of 1/C of the heads, the rank attends over
//               them (softmax or linear, from a zero state), and one all-to-all brings the
//               outputs back to the tokens' ranks; backward the same with the gradients. The
//               heads (and kv heads) of every layer must divide by C.
//   linear      LASP-2 (lasp2.cc): linear attention's runs start from the decayed sum of the
//               earlier chunks' memory states, one all-gather of d x d states per layer in forward
//               and one of their gradients in backward.
//   halos       CCA's convolutions and value shift read the last tokens before each run: run
//               r's come from rank r - 1's first run, run 2C-1-r's from rank r + 1's second run
//               (rank C-1: its own first run); one send-receive with each neighbour, mirrored in
//               backward for their gradients.
// The micro-batch's statistics (the linear router's expert counts, the losses) are summed over
// the group: TokenGroup. Gradients of every parameter are partial (this rank's tokens); they sum
// over the data group, which spans dp x cp (mesh.h), like data parallelism's.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "blocks/runners.h"
#include "parallel/context_mode.h"
#include "tensor/tensor.h"

namespace keel::parallel {

// Throws keel::UsageError naming `what` unless a sequence of `seq` tokens splits into 2 * degree
// chunks of at least `min_chunk` tokens (CCA: its convolutions' halo).
void check_context_split(std::int64_t seq, int degree, std::int64_t min_chunk, const std::string& what);

// The positions within its sequence of rank `rank`'s seq / degree tokens: chunk rank, then chunk
// 2 * degree - 1 - rank. degree 1: 0 .. seq - 1.
std::vector<std::int32_t> zigzag_positions(std::int64_t seq, int degree, int rank);

// Sums x[0..n) over the ranks of `context` on the host, in place, each added in rank order: the
// same bits on every rank (MPI_COMM_NULL: nothing to sum).
void sum_over_context(MPI_Comm context, double* x, int n);

class ContextParallel final : public blocks::AttentionCore, public blocks::TokenGroup {
 public:
  // context: the mesh's context group (MPI); seq: the whole sequence's tokens; mode: above.
  ContextParallel(MPI_Comm context, std::int64_t seq, ContextMode mode = ContextMode::kAllGather);
  const std::vector<std::int32_t>& positions() const { return pos_; }
  bool ring() const { return mode_ == ContextMode::kRing; }
  ContextMode mode() const { return mode_; }

  // AttentionCore
  int segments() const override { return 2; }
  void halo(const Tensor& tails, const Tensor& halos) override;
  void halo_backward(const Tensor& dhalos, const Tensor& dtails) override;
  void attend(const Tensor& q, const Tensor& k, const Tensor& v, float scale, int window, const Tensor& out,
              const Tensor& lse) override;
  void attend_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                       const Tensor& dout, float scale, int window, const Tensor& dq, const Tensor& dk,
                       const Tensor& dv) override;
  // LASP-2 (lasp2.cc)
  void attend_linear(const ops::linear_attention::Config& c, std::int64_t runs, const Tensor& q, const Tensor& k,
                     const Tensor& v, const Tensor& init, const Tensor& out) override;
  void attend_linear_backward(const ops::linear_attention::Config& c, std::int64_t runs, const Tensor& q,
                              const Tensor& k, const Tensor& v, const Tensor& init, const Tensor& dout,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv) override;
  // LASP-2's all-gathers started early (MPI_Iallgather), finished by the attend call after
  void begin_linear(const ops::linear_attention::Config& c, std::int64_t runs, const Tensor& k,
                    const Tensor& v) override;
  void begin_linear_backward(const ops::linear_attention::Config& c, std::int64_t runs, const Tensor& q,
                             const Tensor& dout) override;
  // TokenGroup
  int size() const override { return size_; }
  void sum(std::int64_t* x, int n) override;
  // Sums x[0..n) over the group in place, each added in rank order: the same bits on every rank.
  void sum(double* x, int n) const;

 private:
  // Every rank's k and v ([B, S/C, Hkv, Dh] each) -> k_ and v_ [B, S, Hkv, Dh] in sequence order.
  void gather(const Tensor& k, const Tensor& v);
  // The row of a rank's local row (b, t) in the whole sequence's [B, S] rows.
  std::int64_t seq_row(int rank, std::int64_t b, std::int64_t t) const;
  // MPI_Sendrecv of n floats (to / from -1: none; recv is zeroed first).
  void sendrecv(const float* send, int to, float* recv, int from, std::int64_t n) const;
  // halo() (backward false) and halo_backward() (true): in, out [B * 2, F].
  void exchange(const Tensor& in, const Tensor& out, bool backward) const;
  // LASP-2: every rank's `mine` (its runs' d x d blocks) into recv_, rank by rank; start_gather
  // posts it (MPI_Iallgather) and finish_gather waits for it.
  void start_gather(const Tensor& mine);
  void finish_gather(const char* what);
  // LASP-2's check of the runs and the states' floats per rank
  std::int64_t linear_states(const ops::linear_attention::Config& c, std::int64_t runs, std::int64_t rows) const;
  // The gathered blocks of each sequence and kv head in chunk order (reverse: last first):
  // fn(kv head, chunk's block, this rank's block of `local` when it holds the chunk else nullptr,
  // first chunk of the walk).
  template <typename Fn>
  void walk_chunks(std::int64_t B, std::int64_t hkv, std::int64_t dd, float* local, bool reverse, Fn&& fn) const;
  // The ring (context_ring.cc): attend / attend_backward in ring mode; one hop (send n floats to
  // rank + 1, receive n from rank - 1; wait now, or later with ring_wait).
  void attend_ring(const Tensor& q, const Tensor& k, const Tensor& v, float scale, int window, const Tensor& out,
                   const Tensor& lse);
  void attend_ring_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                            const Tensor& dout, float scale, int window, const Tensor& dq, const Tensor& dk,
                            const Tensor& dv);
  void ring_hop(float* send, float* recv, std::int64_t n, bool wait_now, MPI_Request* reqs) const;
  void ring_wait(MPI_Request* reqs) const;
  // LASP-1 (context_ring.cc): linear attention's states passed rank to rank in sequence order.
  void attend_linear_ring(const ops::linear_attention::Config& c, std::int64_t runs, const Tensor& q, const Tensor& k,
                          const Tensor& v, const Tensor& init, const Tensor& out);
  void attend_linear_ring_backward(const ops::linear_attention::Config& c, std::int64_t runs, const Tensor& q,
                                   const Tensor& k, const Tensor& v, const Tensor& init, const Tensor& dout,
                                   const Tensor& dq, const Tensor& dk, const Tensor& dv);
  void chain_recv(float* msg, std::int64_t n, int from) const;
  void chain_send(const float* msg, std::int64_t n, int to) const;
  // By heads (context_alltoall.cc): attention and linear attention over whole sequences of this
  // rank's 1/C of the heads.
  void attend_heads(const Tensor& q, const Tensor& k, const Tensor& v, float scale, int window, const Tensor& out,
                    const Tensor& lse);
  void attend_heads_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                             const Tensor& dout, float scale, int window, const Tensor& dq, const Tensor& dk,
                             const Tensor& dv);
  void attend_linear_heads(const ops::linear_attention::Config& c, std::int64_t runs, const Tensor& q,
                           const Tensor& k, const Tensor& v, const Tensor& init, const Tensor& out);
  void attend_linear_heads_backward(const ops::linear_attention::Config& c, std::int64_t runs, const Tensor& q,
                                    const Tensor& k, const Tensor& v, const Tensor& init, const Tensor& dout,
                                    const Tensor& dq, const Tensor& dk, const Tensor& dv);
  // x [B, T, H, w] of this rank's tokens (rows in zigzag order) -> whole [B, S, H / C, w] of
  // this rank's heads in sequence order; and back (from_heads overwrites x).
  void to_heads(const float* x, std::int64_t B, std::int64_t H, std::int64_t w, std::vector<float>& whole);
  void from_heads(const std::vector<float>& whole, std::int64_t B, std::int64_t H, std::int64_t w, float* x);
  // lse [B, H, T] <-> [B, H / C, S], as above.
  void lse_to_heads(const float* lse, std::int64_t B, std::int64_t H, std::vector<float>& whole);
  void lse_from_heads(const std::vector<float>& whole, std::int64_t B, std::int64_t H, float* lse);
  void all_to_all(std::int64_t per_rank, const char* what);  // a2a_send_ -> a2a_recv_, per_rank floats each

  MPI_Comm comm_;
  int size_ = 1, rank_ = 0;
  std::int64_t seq_, chunk_;  // S, S / (2C)
  std::vector<std::int32_t> pos_;
  std::vector<float> send_, recv_, k_, v_, dk_, dv_, states_;
  // a LASP-2 all-gather begun (begin_linear: 1, begin_linear_backward: 2) and not yet finished
  int begun_ = 0;
  MPI_Request begun_req_ = MPI_REQUEST_NULL;
  ContextMode mode_ = ContextMode::kAllGather;
  std::vector<float> a2a_send_, a2a_recv_, hq_, hk_, hv_, ho_, hl_, hd_, hdq_, hdk_, hdv_;  // by heads
  std::vector<std::vector<std::int32_t>> ring_pos_;  // every rank's positions (ring mode)
  std::vector<float> ring_, block_out_, block_lse_, block_dkv_;
};

}  // namespace keel::parallel
