// LASP-2's state walk on the GPU (parallel/lasp2_cuda.cc): the gathered per-run d x d blocks of
// every context rank, walked in sequence order; and LASP-1's hop, one rank's step of the state
// chain. CUDA builds only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace keel::parallel::lasp2 {

constexpr int kMaxKvHeads = 64;

// gathered: C ranks x [B * 2 runs, Hkv, dd] fp32 (the all-gather's buffer; rank j's run 0 is chunk
// j, run 1 chunk 2C-1-j). For every sequence b, kv head g and element e, walks the 2C chunks in
// sequence order (reverse: last first) with X = 0 and, at each chunk, first writes X into `mine`
// [B * 2, Hkv, dd] where this rank holds the chunk, then X = decay_L[g] * X + block.
// Forward (prefix): mine = each run's initial state. Backward (reverse, suffix): mine = the
// gradient of each run's own state. decay_L: gamma_g^L per kv head (1 without decay).
struct Decays {
  float g[kMaxKvHeads];
};
void walk(const float* gathered, float* mine, int C, int rank, std::int64_t B, int hkv, std::int64_t dd,
          const Decays& decay_L, bool reverse, cudaStream_t stream);

// One hop of LASP-1's chain (context_mode: ring) over this rank's run `seg` of every sequence:
// msg [B, Hkv, dd] holds the state arriving before the run; it is written into `mine` [B * 2,
// Hkv, dd] at the run, then msg = decay_L[g] * msg + runs[the run] (the state after it).
void hop(float* msg, float* mine, const float* runs, int seg, std::int64_t B, int hkv, std::int64_t dd,
         const Decays& decay_L, cudaStream_t stream);

}  // namespace keel::parallel::lasp2
