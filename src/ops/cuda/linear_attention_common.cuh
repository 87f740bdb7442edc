// The pieces the CUDA linear attention's files share (linear_attention.cu: the output and
// backward kernels and the op's entry points; linear_attention_scan.cu: the state scans;
// linear_attention_pointwise.cu: decode, feature map, norm): the decays by value, the tile
// loads, the extents and their checks, and the scans' entry points. Included only from those .cu
// files; ops/cuda/linear_attention.h has the math and the work split.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "common/error.h"
#include "ops/cuda/linear_attention.h"
#include "ops/cuda/mma_fragments.cuh"

namespace keel::ops::cuda::linear_attention::detail {

using namespace mma_frag;  // ops/cuda/mma_fragments.cuh

constexpr std::size_t kAlign = 256;
constexpr int kStages = 3;  // cp.async stages of the sequential scan

inline std::size_t round_up(std::size_t b) { return (b + kAlign - 1) / kAlign * kAlign; }

// The decays of a call, by value: gamma and log2(gamma) per kv head (lg = 0 exactly for no decay,
// -inf for gamma = 0), so gamma^p = exp2(p lg) (gpow; p = 0 gives exactly 1).
struct Gammas {
  float gamma[kMaxKvHeads];
  float lg[kMaxKvHeads];
};

__device__ __forceinline__ float gpow(float lg, int p) { return p == 0 ? 1.f : exp2f(lg * static_cast<float>(p)); }

// The warp-level building blocks (smem_addr, cp.async, ldmatrix, mma; their fragment layouts)
// are ops/cuda/mma_fragments.cuh's.

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// A packed bf16 pair times (w_lo, w_hi), rounded back to bf16.
__device__ __forceinline__ std::uint32_t scale_pair(std::uint32_t x, float w_lo, float w_hi) {
  const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x));
  return pack_bf16(f.x * w_lo, f.y * w_hi);
}

// A kRows x kCols tile of a row-major bf16 matrix into shared memory (row stride ld):
// s[r][c] = g[r * stride + c] for r < rows and c < cols, exact zeros elsewhere, so padded rows
// (past the run's end) and padded columns (past head_dim) add nothing to any MMA.
// vec (cols == kCols, g and stride 16-byte aligned): cp.async of 16-byte pieces (the caller
// commits, waits and syncs); otherwise plain element loads and stores (the caller syncs).
template <int kRows, int kCols>
__device__ __forceinline__ void load_tile(bf16* s, int ld, const bf16* g, std::int64_t stride, int rows, int cols,
                                          bool vec, int tid, int nthreads) {
  if (vec) {
    constexpr int kPieces = kCols / 8;
    for (int e = tid; e < kRows * kPieces; e += nthreads) {
      const int r = e / kPieces, c8 = e % kPieces * 8;
      const bool ok = r < rows;
      cp_async_16(s + r * ld + c8, g + (ok ? r : 0) * stride + c8, ok ? 16 : 0);
    }
  } else {
    const bf16 zero = __float2bfloat16(0.f);
    for (int e = tid; e < kRows * kCols; e += nthreads) {
      const int r = e / kCols, c = e % kCols;
      s[r * ld + c] = (r < rows && c < cols) ? g[r * stride + c] : zero;
    }
  }
}

// The intra-chunk mask and decay of a 16 x 64 score tile in accumulators (rows i0 = m0 + g and
// i0 + 8, key j = 8 nt + 2c (+1)): s[i][j] = gamma^(i-j) s[i][j] where j <= i, exactly 0 above
// the diagonal. pw[p] = gamma^p.
__device__ __forceinline__ void mask_decay(float (&s)[8][4], int i0, int cq, const float* pw) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = i0 + (e >> 1) * 8, j = nt * 8 + 2 * cq + (e & 1);
      s[nt][e] = j <= i ? pw[i - j] * s[nt][e] : 0.f;
    }
}

// Accumulator rows i0 (elements 0, 1) and i0 + 8 (2, 3) of n-tiles nt, columns col0 + 8 nt and
// col0 + 8 nt + 1, to rows of a token-major bf16 matrix g (row stride `stride`): rows >= rows_valid
// and columns >= d skipped. vec: d == the tile width, every pair in range and 4-byte aligned.
template <int kNt>
__device__ __forceinline__ void store_acc(bf16* g, std::int64_t stride, const float (&acc)[kNt][4], int i0, int col0,
                                          int rows_valid, int d, bool vec) {
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = i0 + 8 * half, col = col0 + 8 * nt;
      if (i >= rows_valid) continue;
      const float v0 = acc[nt][2 * half], v1 = acc[nt][2 * half + 1];
      bf16* p = g + i * stride + col;
      if (vec) {
        *reinterpret_cast<std::uint32_t*>(p) = pack_bf16(v0, v1);
      } else {
        if (col < d) p[0] = __float2bfloat16(v0);
        if (col + 1 < d) p[1] = __float2bfloat16(v1);
      }
    }
}

// ---------------------------------------------- host side ----------------------------------------------

struct Dims {
  int R, L, Hq, Hkv, d, group, NT;
};

inline Dims check(const Config& c, std::int64_t runs, std::int64_t len) {
  if (c.heads <= 0 || c.kv_heads <= 0 || c.heads % c.kv_heads)
    fail("linear attention (CUDA): {} query heads do not split into groups over {} kv heads", c.heads, c.kv_heads);
  if (c.kv_heads > kMaxKvHeads)
    fail("linear attention (CUDA): {} kv heads, at most {} supported", c.kv_heads, kMaxKvHeads);
  if (c.head_dim < 1 || c.head_dim > kMaxHeadDim)
    fail("linear attention (CUDA): head_dim {} unsupported (1..{})", c.head_dim, kMaxHeadDim);
  if (c.chunk < 1) fail("linear attention (CUDA): chunk {} must be >= 1", c.chunk);
  if (!c.decay.empty() && static_cast<int>(c.decay.size()) != c.kv_heads)
    fail("linear attention (CUDA): {} decays for {} kv heads", c.decay.size(), c.kv_heads);
  for (const float gamma : c.decay)
    if (!std::isfinite(gamma) || gamma < 0.f) fail("linear attention (CUDA): decay {} must be finite and >= 0", gamma);
  if (runs < 0 || len < 0) fail("linear attention (CUDA): {} runs of {} tokens", runs, len);
  if (len > (std::int64_t{1} << 30)) fail("linear attention (CUDA): runs of {} tokens are too long", len);
  if (runs * c.kv_heads > 65535)
    fail("linear attention (CUDA): {} runs x {} kv heads exceed 65535 blocks", runs, c.kv_heads);
  Dims s;
  s.R = static_cast<int>(runs);
  s.L = static_cast<int>(len);
  s.Hq = c.heads;
  s.Hkv = c.kv_heads;
  s.d = c.head_dim;
  s.group = c.heads / c.kv_heads;
  s.NT = static_cast<int>((len + kChunk - 1) / kChunk);
  return s;
}

inline Gammas gammas_of(const Config& c) {
  Gammas gm{};
  for (int g = 0; g < c.kv_heads; ++g) {
    const float gamma = c.gamma(g);
    gm.gamma[g] = gamma;
    gm.lg[g] = gamma == 1.f   ? 0.f
               : gamma == 0.f ? -std::numeric_limits<float>::infinity()
                              : static_cast<float>(std::log2(static_cast<double>(gamma)));
  }
  return gm;
}


// The padded head width of the tensor-core kernels.
inline int padded(int d) { return d <= 16 ? 16 : d <= 32 ? 32 : d <= 64 ? 64 : 128; }

inline std::size_t states_bytes(const Dims& s) {
  return round_up(static_cast<std::size_t>(s.R) * s.Hkv * s.NT * s.d * s.d * sizeof(bf16));
}

inline void check_workspace(const void* workspace) {
  if (!workspace || (reinterpret_cast<std::uintptr_t>(workspace) % kAlign))
    fail("linear attention (CUDA): the workspace must be a 256-byte aligned device buffer");
}

// ---- the scans (linear_attention_scan.cu) ----

// The segmented scan's fp32 buffer: its bytes in the workspace (after S_c and Gk_c), and where
// it starts (null when the runs are one segment: the single scan).
std::size_t segment_bytes(const Dims& s);
float* segment_buffer(const Dims& s, void* workspace);
// S_c (bf16, the state before each chunk) of the runs from init (null: zeros).
void scan_states(const Dims& s, const bf16* k, const bf16* v, const float* init, bf16* states, float* seg_buf,
                 const Gammas& gm, cudaStream_t stream);
// Each run's end state from zeros (fp32).
void scan_local(const Dims& s, const bf16* k, const bf16* v, float* final_state, const Gammas& gm,
                cudaStream_t stream);
// dinit = G_{-1} (fp32) alone.
void scan_init_gradient(const Dims& s, const bf16* q, const bf16* dout, float* dinit, const Gammas& gm,
                        cudaStream_t stream);
// Gk_c = G_c + gamma^(L - t1) dlocal (bf16) and dinit (fp32; null: none).
void scan_gradients(const Dims& s, const bf16* q, const bf16* dout, const float* dlocal, bf16* gstates, float* dinit,
                    float* seg_buf, const Gammas& gm, cudaStream_t stream);

}  // namespace keel::ops::cuda::linear_attention::detail
