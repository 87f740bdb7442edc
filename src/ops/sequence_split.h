// How this rank's tokens sit in their sequences, as a sequence mixer (softmax attention, CCA)
// sees it. Whole sequences (the default below): every token of each of the B sequences is here,
// in order. Under context parallelism (parallel/context_parallel.h) a rank holds `segments()`
// runs of consecutive tokens per sequence (zigzag: two), not adjacent to each other, so
//   - the causal convolutions and CCA's value shift read the last tokens before each run: the
//     run's halo, which the split fetches from the rank holding them (zeros where a run starts
//     its sequence), and
//   - attention reads the keys and values of the whole sequence, and
//   - linear attention starts each run from the memory state the tokens before it leave
//     (LASP-2: one all-gather of the runs' states).
// blocks::AttentionCore (blocks/runners.h) is this interface: the plan hands each layer one.
//
// Layout: the [N, X] rows of a mixer input are B sequences x segments() runs x L tokens
// (N = B * segments * L); row (b * segments + s) * L + t is token t of run s of sequence b.
#pragma once

#include "ops/linear_attention.h"
#include "tensor/tensor.h"

namespace keel::ops {

class SequenceSplit {
 public:
  virtual ~SequenceSplit() = default;

  // Runs of consecutive tokens per sequence on this rank (1: whole sequences).
  virtual int segments() const { return 1; }

  // Halo exchange. tails [B * segments, F]: what each run gives the run after it in its
  // sequence (its last rows of something, packed by the caller into F floats). Fills halos
  // [B * segments, F] with, for each run, the tail of the run before it in the sequence, or
  // zeros where the run starts the sequence. Whole sequences: zeros.
  virtual void halo(const Tensor& tails, const Tensor& halos);
  // Its backward: dhalos [B * segments, F] (the gradient of each run's halo) -> dtails
  // [B * segments, F] OVERWRITTEN with the gradient of each run's tail (zeros for the last run
  // of a sequence). Whole sequences: zeros.
  virtual void halo_backward(const Tensor& dhalos, const Tensor& dtails);

  // Causal softmax attention of this rank's queries over the whole sequence's keys and values:
  // q, out [B, T, Hq, Dh], k, v [B, T, Hkv, Dh] (this rank's T = segments * L tokens of each
  // sequence, after RoPE), lse [B, Hq, T]; the result equals the rows of ops::attention::forward
  // over whole sequences (ops/attention.h's conventions, window included). Backward: dq, dk, dv
  // of this rank's rows, OVERWRITTEN (dk, dv summed over every rank's queries).
  virtual void attend(const Tensor& q, const Tensor& k, const Tensor& v, float scale, int window, const Tensor& out,
                      const Tensor& lse);
  virtual void attend_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                               const Tensor& dout, float scale, int window, const Tensor& dq, const Tensor& dk,
                               const Tensor& dv);

  // Causal linear attention (ops/linear_attention.h) of this rank's `runs` = B * segments runs of
  // L tokens: q, out [runs * L, Hq * d], k, v [runs * L, Hkv * d] (feature-mapped). init
  // [runs, Hkv, d, d]: forward WRITES each run's initial state there (the decayed sum of the
  // states of the sequence's earlier tokens) and backward reads it; whole sequences pass it
  // empty (every run starts from zeros). The result equals the rows of linear_attention::forward
  // over whole sequences. Backward: dq, dk, dv of this rank's rows OVERWRITTEN, with every path
  // through later runs' initial states included.
  virtual void attend_linear(const linear_attention::Config& c, std::int64_t runs, const Tensor& q, const Tensor& k,
                             const Tensor& v, const Tensor& init, const Tensor& out);
  // Optional, before attend_linear with the same k and v: the part of the exchange that needs only
  // k and v (LASP-2: each run's memory state, their all-gather started), so that the caller's
  // next work (the q projection) overlaps it; attend_linear then finishes it. Without the call
  // attend_linear does it all. Whole sequences (and the other modes): nothing.
  virtual void begin_linear(const linear_attention::Config& c, std::int64_t runs, const Tensor& k, const Tensor& v) {
    (void)c, (void)runs, (void)k, (void)v;
  }
  virtual void attend_linear_backward(const linear_attention::Config& c, std::int64_t runs, const Tensor& q,
                                      const Tensor& k, const Tensor& v, const Tensor& init, const Tensor& dout,
                                      const Tensor& dq, const Tensor& dk, const Tensor& dv);
  // Backward's begin_linear, from q and dout (LASP-2: each run's initial-state gradient, their
  // all-gather started), before attend_linear_backward with the same q and dout.
  virtual void begin_linear_backward(const linear_attention::Config& c, std::int64_t runs, const Tensor& q,
                                     const Tensor& dout) {
    (void)c, (void)runs, (void)q, (void)dout;
  }
};

// The whole-sequence split (stateless; shared).
SequenceSplit& whole_sequences();

}  // namespace keel::ops
