// The GPU twin of ops/sequence_split.h: how this rank's tokens sit in their sequences, as a GPU
// sequence mixer (flash attention, CCA) sees it. Whole sequences by default; under context
// parallelism (parallel/context_parallel_cuda.h) a rank holds segments() runs of consecutive
// tokens per sequence, whose halos it fetches from the neighbouring ranks, and attention reads
// the whole sequence's keys. blocks::cuda::AttentionCore (blocks/cuda/runners.h) is this
// interface. Layout as on the CPU: rows are B sequences x segments() runs x L tokens. Every call
// only enqueues work on `stream` (collectives included).
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/cuda/common.h"
#include "ops/linear_attention.h"

namespace keel::ops::cuda {

class SequenceSplit {
 public:
  virtual ~SequenceSplit() = default;

  virtual int segments() const { return 1; }

  // tails [rows, F] bf16 (rows = B * segments) -> halos [rows, F] bf16: each run's halo is the
  // tail of the run before it in its sequence, zeros where the run starts it. Whole sequences:
  // zeros.
  virtual void halo(const bf16* tails, bf16* halos, std::int64_t rows, std::int64_t F, cudaStream_t stream);
  // Its adjoint: dhalos [rows, F] fp32 -> dtails [rows, F] fp32, OVERWRITTEN. Whole sequences:
  // zeros.
  virtual void halo_backward(const float* dhalos, float* dtails, std::int64_t rows, std::int64_t F,
                             cudaStream_t stream);

  // Causal attention of this rank's queries over the whole sequence (ops/cuda/attention.h's
  // conventions and dtypes): q, out [B, T, Hq, Dh], k, v [B, T, Hkv, Dh] with T this rank's tokens
  // per sequence, lse [B, Hq, T]. Backward: dq, dk, dv of this rank's rows, OVERWRITTEN (dk, dv
  // summed over every rank's queries); workspace of backward_workspace_bytes.
  virtual void forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int B, int T, int Hq,
                       int Hkv, int Dh, float scale, int window, cudaStream_t stream);
  virtual std::size_t backward_workspace_bytes(int B, int T, int Hq, int Hkv, int Dh) const;
  virtual void backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse,
                        const bf16* dout, bf16* dq, bf16* dk, bf16* dv, void* workspace, int B, int T, int Hq, int Hkv,
                        int Dh, float scale, int window, cudaStream_t stream);

  // Causal linear attention of this rank's `runs` = B * segments runs (ops/cuda/linear_attention.h's
  // conventions and dtypes; the CPU twin's contract, ops/sequence_split.h): init fp32
  // [runs, Hkv, d, d], WRITTEN by forward with each run's initial state and read by backward
  // (whole sequences: null, every run starts from zeros). Backward: dq, dk, dv OVERWRITTEN with
  // every path through later runs included. workspace of linear_workspace_bytes.
  virtual std::size_t linear_workspace_bytes(const linear_attention::Config& c, std::int64_t runs,
                                             std::int64_t len) const;
  virtual void attend_linear(const linear_attention::Config& c, std::int64_t runs, std::int64_t len, const bf16* q,
                             const bf16* k, const bf16* v, float* init, bf16* out, void* workspace,
                             cudaStream_t stream);
  virtual void attend_linear_backward(const linear_attention::Config& c, std::int64_t runs, std::int64_t len,
                                      const bf16* q, const bf16* k, const bf16* v, const float* init,
                                      const bf16* dout, bf16* dq, bf16* dk, bf16* dv, void* workspace,
                                      cudaStream_t stream);
  // Optional, as the CPU twin's: the exchange's part that needs only k and v (forward) or q and
  // dout (backward) enqueued now, its collective on a side stream, so that what the caller
  // enqueues next on `stream` overlaps it; the attend call with the same tensors finishes it.
  // Whole sequences (and the other modes): nothing.
  virtual void begin_linear(const linear_attention::Config& c, std::int64_t runs, std::int64_t len, const bf16* k,
                            const bf16* v, cudaStream_t stream) {
    (void)c, (void)runs, (void)len, (void)k, (void)v, (void)stream;
  }
  virtual void begin_linear_backward(const linear_attention::Config& c, std::int64_t runs, std::int64_t len,
                                     const bf16* q, const bf16* dout, cudaStream_t stream) {
    (void)c, (void)runs, (void)len, (void)q, (void)dout, (void)stream;
  }
};

// The whole-sequence split (stateless; shared).
SequenceSplit& whole_sequences();

}  // namespace keel::ops::cuda
