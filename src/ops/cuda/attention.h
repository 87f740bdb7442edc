// Causal grouped-query attention on the GPU: the CUDA twin of ops/attention.h (same math, same
// layouts, same gradient conventions), written as FlashAttention-2-style fused kernels so the
// [T, T] score matrix never exists in memory.
//
// Shapes and dtypes (B sequences of T tokens; the [B*T, heads * Dh] projection outputs seen as
// 4-D, so the heads of one token are interleaved in its row):
//   q, out, dout, dq  [B, T, Hq, Dh]   bf16
//   k, v, dk, dv      [B, T, Hkv, Dh]  bf16
//   lse               [B, Hq, T]       fp32 (log-sum-exp of each query row's scaled scores)
// Query head h reads kv head h / (Hq / Hkv); token t attends to tokens 0..t of its sequence,
// or with a sliding window W > 0 to t - W < j <= t (ops/attention.h; W >= T is full causal);
// scores = scale * q.k (scale = 1/sqrt(Dh) for the usual attention).
// Supported: Dh = 64 or 128, Hq % Hkv == 0, any T >= 1 (B or T == 0 runs nothing). Every
// pointer must be 16-byte aligned (the kernels move 16-byte vectors). Anything else throws
// keel::Error before launching.
//
// Saved for backward: out and lse (forward overwrites both); backward recomputes the
// probabilities p_ij = exp(scale q_i.k_j - lse_i) tile by tile. dq, dk, dv are OVERWRITTEN
// (activation gradients). Accumulation is fp32 throughout; only the MMA operands (q, k, v,
// dout, and the probabilities / score gradients of a tile) are bf16.
//
// Work split (why it is fast): forward runs one block per (sequence, query head, 128-query
// tile), streaming 64-key K/V tiles through shared memory with cp.async double buffering,
// bf16 tensor-core MMAs and an online softmax in fp32 registers; key tiles entirely above the
// causal diagonal are never visited, and the heaviest (last) query tiles are scheduled first.
// A window skips the key tiles wholly before a query tile's first window and masks the tiles
// at its edges elementwise, so a sliding layer costs O(T W), not O(T^2).
// Backward runs one block per (sequence, query head, 64-key tile): dk and dv of the tile live
// in registers over the query tiles below the diagonal that see it (with a window: up to
// W - 1 queries past its last key), dq is added with fp32 atomics into
// the workspace. Because the several query heads of a group write the same dk/dv rows, those
// are summed with fp32 atomics into the workspace too, and a last pass converts dq, dk, dv to
// bf16. Results are therefore deterministic up to fp32 addition order, not bit for bit.
//
// Context parallelism (forward_runs/backward_runs): a rank's queries are `runs` runs of L
// consecutive positions of each sequence over the whole sequence's Tk gathered keys (the rows of
// ops::attention::forward_at/backward_at). The same kernels take the run's first position and
// separate query (L, batch stride Tq) and key (Tk) extents: one launch per run, tiles skipped by
// position exactly as above; dk, dv of all Tk keys are summed over the runs in fp32 and returned
// in fp32 (a caller sums them over ranks before rounding). forward()/backward() are the one run
// at 0 with Tq = Tk = T: the same launches as ever.
//
// All calls only enqueue work on `stream` (no host synchronization).
#pragma once

#include <cstddef>

#include "ops/cuda/common.h"

namespace keel::ops::cuda::attention {

// out, lse overwritten. window: 0 = full causal, W > 0 = the last W tokens.
void forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int B, int T, int Hq, int Hkv, int Dh,
             float scale, int window, cudaStream_t stream);

// Bytes of device scratch backward needs for these extents (fp32 D_i = dout_i . out_i and the
// fp32 dq, dk, dv accumulators, each region 256-byte aligned). Throws on unsupported extents.
std::size_t backward_workspace_bytes(int B, int T, int Hq, int Hkv, int Dh);

// With D_i = dout_i . out_i and p, ds as in ops/attention.h:
//   dq_i = scale sum_j ds_ij k_j,  dk_j = scale sum_i ds_ij q_i,  dv_j = sum_i p_ij dout_i
// dq, dk, dv overwritten; window as forward's. `workspace` (backward_workspace_bytes, 256-byte
// aligned, contents ignored) must not be used by anything else until this call's work on
// `stream` is done.
void backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse, const bf16* dout, bf16* dq,
              bf16* dk, bf16* dv, void* workspace, int B, int T, int Hq, int Hkv, int Dh, float scale, int window,
              cudaStream_t stream);

// Queries in runs over a longer key sequence (context parallelism: this rank's runs of each
// sequence, the whole sequence's gathered keys). q, out, dout, dq [B, Tq, Hq, Dh] bf16 hold `runs`
// runs of L = Tq / runs queries; run s's queries sit at positions run_start[s] .. run_start[s]+L-1
// (run_start: a HOST array of `runs` entries, 1 <= runs <= 8) of the keys k, v [B, Tk, Hkv, Dh]
// (run_start[s] + L <= Tk); lse [B, Hq, Tq] fp32. Each query attends causally (and with the
// window) to keys at positions <= its own: forward_at's rows exactly. With runs = 1,
// run_start = {0}, Tq == Tk it is forward()/backward().
// Any L >= 0 (no tile multiple: each run is its own launch, rows past L masked); runs may overlap
// or come in any order. Tq % runs != 0, runs outside [1, 8], a null run_start, or a run_start[s]
// < 0 or > Tk - L throws keel::Error before launching, as do forward's extent checks.
void forward_runs(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int B, int Tq, int Tk, int Hq,
                  int Hkv, int Dh, float scale, int window, const int* run_start, int runs, cudaStream_t stream);

// Bytes of scratch backward_runs needs (fp32 D_i and dq accumulators for the Tq queries; dk, dv
// accumulate in the caller's outputs).
std::size_t backward_runs_workspace_bytes(int B, int Tq, int Tk, int Hq, int Hkv, int Dh);

// dq [B, Tq, Hq, Dh] bf16 OVERWRITTEN; dk, dv [B, Tk, Hkv, Dh] **fp32** OVERWRITTEN: the sums over
// every run's queries (zero at keys none attends), kept in fp32 so a context-parallel caller can
// sum them over ranks before rounding. Workspace and checks as backward()/forward_runs().
void backward_runs(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse, const bf16* dout,
                   bf16* dq, float* dk, float* dv, void* workspace, int B, int Tq, int Tk, int Hq, int Hkv, int Dh,
                   float scale, int window, const int* run_start, int runs, cudaStream_t stream);

// ---- Ring attention's pieces (context parallelism, parallel.context_mode: ring; the CPU twins
// are ops::attention::forward_block / merge / backward_block) ----
// One run of Lq queries against one block of Tk keys k, v [B, Tk, Hkv, Dh] whose first key sits
// p0 positions before the run's first query (p0 >= 0: no key of the block is in the run's
// future but the causal diagonal; p0 >= Tk: the block is wholly in the past). q, out, dout and
// dq_acc point at the run's first row and lse, d_row at its first column; q_rows is the rows per
// sequence of all of them (their batch stride, and the length of lse's and d_row's (b, h) rows),
// Lq <= q_rows. window as forward's, by position (0: every earlier key).
// forward_block: the run's out (fp32, q's layout: the merge's input, never rounded to bf16) and
// lse OVERWRITTEN with this block's attention alone; a row that sees no key of the block gets out
// 0 and lse -inf.
void forward_block(const bf16* q, const bf16* k, const bf16* v, float* out, float* lse, int B, int q_rows, int Lq,
                   int p0, int Tk, int Hq, int Hkv, int Dh, float scale, int window, cudaStream_t stream);
// The run's rows of acc_out (fp32, q's layout) and acc_lse (lse's) fold in a block's out and lse
// by log-sum-exp weights (a side of lse -inf contributes nothing). From acc_out 0 and acc_lse
// -inf, merging every block of the sequence gives forward's out (in fp32) and lse.
void merge_block(const float* out, const float* lse, float* acc_out, float* acc_lse, int B, int q_rows, int Lq, int Hq,
                 int Dh, cudaStream_t stream);
// Backward's D_i = dout_i . out_i of every row, d_row [B, Hq, q_rows] fp32 (with the final out).
void dot_rows(const bf16* dout, const bf16* out, float* d_row, int B, int q_rows, int Hq, int Dh, cudaStream_t stream);
// This block's share of the gradients, with the FINAL (merged) lse and dot_rows' d_row: dq_acc
// (fp32, the run's rows) and dk_acc, dv_acc (fp32 [B, Tk, Hkv, Dh]) ADDED TO (fp32 atomics, so
// the sums are deterministic only up to addition order). Summed over the blocks: backward's.
void backward_block(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,
                    const float* d_row, float* dq_acc, float* dk_acc, float* dv_acc, int B, int q_rows, int Lq, int p0,
                    int Tk, int Hq, int Hkv, int Dh, float scale, int window, cudaStream_t stream);

}  // namespace keel::ops::cuda::attention
