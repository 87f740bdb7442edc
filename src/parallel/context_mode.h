// parallel.context_mode: how the sequence mixers see the rest of the sequence, and the GPU
// context-parallel core's buffers in the ring and all-to-all modes (context_ring_cuda.cc,
// context_alltoall_cuda.cc): the bytes each call asks for, so that the core allocates them once
// for the widest layer when the mode is chosen, keel train's start-up line shows them and keel
// size counts the same. One rank's view: B sequences of its T tokens (two chunks of T / 2), hq
// query heads and hkv kv heads of dh (this tensor rank's). Regions are 256-byte aligned, as the
// cores carve them. No MPI or CUDA here (keel size uses it on any machine).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace keel::parallel {

enum class ContextMode { kAllGather, kRing, kAllToAll };
// "allgather", "ring", "alltoall"; UsageError naming the word otherwise ("auto" is resolved by
// the callers with auto_context_mode, which needs the model and the layout).
ContextMode parse_context_mode(const std::string& word);
// parallel.context_mode: auto: the k/v ring for a model whose layers are all softmax or CCA
// attention, under context parallelism alone (no tensor or TSP axis): on 2 x H200 at 32K the
// ring ran the ZAYA1-shaped model 1.007x as fast as the all-gather (the all-to-all 0.990x) and
// holds one layer's k/v blocks instead of the whole sequence's (docs/PERFORMANCE.md). The
// all-gather otherwise: LASP-2's one all-gather of states for linear layers (the ring would make
// them LASP-1), and the layouts whose ring has not run on GPUs (with tensor parallelism) or
// that do not take it (TSP).
ContextMode auto_context_mode(bool linear_layers, int tensor, int tsp);
const char* context_mode_name(ContextMode m);
// The GPU core's buffers in each mode, as keel train's start-up line and keel size name them:
// "context-parallel k/v gathers", "context-parallel ring blocks", "context-parallel all-to-all buffers".
const char* context_buffer_name(ContextMode m);

struct ContextExtents {
  std::int64_t batch = 0, tokens = 0;  // B and this rank's T
  std::int64_t hq = 0, hkv = 0, dh = 0;
  std::int64_t q() const { return batch * tokens * hq * dh; }   // bf16 elements of q (and out)
  std::int64_t kv() const { return batch * tokens * hkv * dh; } // of k (and of v)
  std::int64_t lse() const { return batch * hq * tokens; }     // fp32 log-sum-exps
};

std::size_t context_aligned(std::size_t bytes);  // up to 256

// The k/v ring: two blocks of k, v (bf16) and the fp32 running output and log-sum-exp with a
// block's (forward); two blocks of k, v with their fp32 dk, dv accumulators, the fp32 dq, D_i
// and a bf16 staging block (backward).
std::size_t ring_forward_bytes(const ContextExtents& e);
std::size_t ring_backward_bytes(const ContextExtents& e);
// Heads by all-to-all: the send/receive staging and the whole-sequence tensors of this rank's
// heads (softmax: q, out, k, v, lse; backward also dout, dq, dk, dv; linear: q, out, k, v and in
// backward dout, dq, dk, dv).
std::size_t alltoall_forward_bytes(const ContextExtents& e);
std::size_t alltoall_backward_bytes(const ContextExtents& e);
std::size_t alltoall_linear_forward_bytes(const ContextExtents& e);
std::size_t alltoall_linear_backward_bytes(const ContextExtents& e);
// The most any layer's call asks for: what the core allocates for the mode.
std::size_t ring_buffer_bytes(const ContextExtents& e);
std::size_t alltoall_buffer_bytes(const ContextExtents& e, bool softmax, bool linear);

}  // namespace keel::parallel
