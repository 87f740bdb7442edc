// Causal linear attention on the GPU (ops/cuda/linear_attention.h has the math and the work split).
#include "ops/cuda/linear_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "common/error.h"
#include "ops/cuda/mma_fragments.cuh"

namespace keel::ops::cuda::linear_attention {

namespace {

using namespace mma_frag;  // ops/cuda/mma_fragments.cuh

constexpr std::size_t kAlign = 256;
constexpr int kStages = 3;  // cp.async stages of the sequential scan

std::size_t round_up(std::size_t b) { return (b + kAlign - 1) / kAlign * kAlign; }

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

// ---------------------------------------------- the scan over chunks ----------------------------------------------
//
// One block per (kT x kT tile of the d x d state, segment of a run, run * Hkv + kv head); warps
// of 16 state rows. A segment is `seg` consecutive chunks of a run (all of them when the run is
// one segment). The tile lives in fp32 MMA accumulators through the segment's chunks, in order
// (or reversed), from the segment's initial tile (init, or zeros):
//   at a chunk's first pair: store the tile (+ gamma^(L - t1) extra) to states[chunk] in bf16,
//                            then tile *= gamma^n
//   for each of `pairs` (A, B) pairs: tile += A~^T B   (A~ row i = w_i a_i, 64 tokens of the chunk)
// and the final tile goes to final_state in fp32. Without a final_state the segment's last chunk
// is only stored (its MMAs would feed nothing). Forward states: A = K, B = V of kv head g,
// w_j = gamma^(n-1-j), in order (S_c, the state before chunk c). Backward: A = Q, B = dO of the
// group's query heads, w_i = gamma^(i+1), reversed (Gk_c, the gradient of the state after chunk c).
// Tiles of A and B stream through kStages cp.async stages; the decay weights are applied to the
// A fragments in registers. kExtra: the `extra` tile is held in registers (the one-segment scan;
// the segmented scan folds it into the segments' initial tiles instead, see scan_gradients).
template <int kT, bool kExtra>
struct Scan {
  static constexpr int kWarps = kT / 16, kThreads = kWarps * 32, kLd = kT + 8, kNt = kT / 8;
  static constexpr int kTile = kChunk * kLd;  // one stage of A or B (elements)
  static constexpr int kSmemBytes = 2 * kStages * kTile * static_cast<int>(sizeof(bf16));
  // Blocks per SM the registers must allow (128: two of 104 KB shared memory, 64: four of 54 KB).
  static constexpr int kMinBlocks = kT == 128 ? 2 : kT == 64 ? 4 : 8;
};

struct ScanArgs {
  const bf16* a;             // token-major [R * L, a_stride]; pair p of kv head g reads head g * pairs + p
  const bf16* b;             // the same, b_stride
  std::int64_t a_stride, b_stride;
  const float* init;         // [R * Hkv, NS, d, d] each segment's starting tile, or null (zeros)
  const float* extra;        // [R * Hkv, d, d] added to the stored states times gamma^(L - t1), or null (kExtra)
  bf16* states;              // [R * Hkv, NT, d, d], or null (not stored)
  float* final_state;        // [R * Hkv, NS, d, d] each segment's end tile, or null
  int Hkv, L, d, NT, seg, NS, pairs;  // seg: chunks per segment, NS: segments per run
  bool reverse, vec;
  bool f2;                   // init, extra, final_state in 8-byte column pairs (d even, 8-byte aligned)
};

template <int kT, bool kExtra>
__global__ void __launch_bounds__(Scan<kT, kExtra>::kThreads, Scan<kT, kExtra>::kMinBlocks)
    scan_kernel(const ScanArgs p, const Gammas gm) {
  using C = Scan<kT, kExtra>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* a_s = reinterpret_cast<bf16*>(smem_raw);  // [kStages][kChunk][kLd]
  bf16* b_s = a_s + kStages * C::kTile;
  __shared__ float pw[kChunk + 1];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, cq = lane & 3;
  const int d = p.d, tiles = (d + kT - 1) / kT, tile = static_cast<int>(blockIdx.x) % (tiles * tiles);
  const int sg = static_cast<int>(blockIdx.x) / (tiles * tiles);
  const int a0 = tile / tiles * kT, b0 = tile % tiles * kT;
  const int task = static_cast<int>(blockIdx.y), r = task / p.Hkv, g = task % p.Hkv;
  const int c_first = sg * p.seg, nc = min(p.NT, c_first + p.seg) - c_first;  // this segment's chunks
  const float lg = gm.lg[g];
  const bool decay = lg != 0.f;
  for (int i = tid; i <= kChunk; i += C::kThreads) pw[i] = gpow(lg, i);

  // This thread's tile elements: state rows ra (acc[nt][0..1]) and ra + 8 ([2..3]), columns
  // cb + 8 nt and cb + 8 nt + 1.
  const int ra = a0 + warp * 16 + gq, cb = b0 + 2 * cq;
  const std::int64_t dd = static_cast<std::int64_t>(d) * d, base = task * dd;
  const std::int64_t seg_base = (static_cast<std::int64_t>(task) * p.NS + sg) * dd;
  // Columns col, col + 1 of row `row` of a d x d fp32 tile t (null: zeros), zeros outside.
  auto load_pair = [&](const float* t, int row, int col, float& x0, float& x1) {
    x0 = x1 = 0.f;
    if (!t || row >= d || col >= d) return;
    const float* q = t + row * d + col;
    if (p.f2) {
      const float2 v = *reinterpret_cast<const float2*>(q);
      x0 = v.x;
      x1 = v.y;
    } else {
      x0 = q[0];
      if (col + 1 < d) x1 = q[1];
    }
  };
  float acc[C::kNt][4], ex[kExtra ? C::kNt : 1][4];
#pragma unroll
  for (int nt = 0; nt < C::kNt; ++nt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = ra + 8 * half, col = cb + 8 * nt;
      load_pair(p.init ? p.init + seg_base : nullptr, row, col, acc[nt][2 * half], acc[nt][2 * half + 1]);
      if constexpr (kExtra)
        load_pair(p.extra ? p.extra + base : nullptr, row, col, ex[nt][2 * half], ex[nt][2 * half + 1]);
    }

  const std::int64_t row0 = static_cast<std::int64_t>(r) * p.L;
  const int total = (p.final_state ? nc : nc - 1) * p.pairs;  // load-and-MMA steps
  const int a_cols = min(kT, d - a0), b_cols = min(kT, d - b0);
  auto chunk_of = [&](int s) {
    const int i = s / p.pairs;
    return p.reverse ? c_first + nc - 1 - i : c_first + i;
  };
  auto issue = [&](int s) {
    const int c = chunk_of(s), head = g * p.pairs + s % p.pairs;
    const int t0 = c * kChunk, n = min(kChunk, p.L - t0);
    const std::int64_t row = row0 + t0, col = static_cast<std::int64_t>(head) * d;
    load_tile<kChunk, kT>(a_s + (s % kStages) * C::kTile, C::kLd, p.a + row * p.a_stride + col + a0, p.a_stride, n,
                          a_cols, p.vec, tid, C::kThreads);
    load_tile<kChunk, kT>(b_s + (s % kStages) * C::kTile, C::kLd, p.b + row * p.b_stride + col + b0, p.b_stride, n,
                          b_cols, p.vec, tid, C::kThreads);
  };
  // The tile (+ gamma^(L - t1) extra) as chunk c's stored state, bf16.
  auto store_state = [&](int c) {
    const int t1 = min(p.L, (c + 1) * kChunk);
    float wx = 0.f;
    if constexpr (kExtra) wx = p.extra ? gpow(lg, p.L - t1) : 0.f;
    bf16* st = p.states + (static_cast<std::int64_t>(task) * p.NT + c) * dd;
#pragma unroll
    for (int nt = 0; nt < C::kNt; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = ra + 8 * half, col = cb + 8 * nt;
        if (row >= d) continue;
        float v0 = acc[nt][2 * half], v1 = acc[nt][2 * half + 1];
        if constexpr (kExtra) {
          v0 += wx * ex[nt][2 * half];
          v1 += wx * ex[nt][2 * half + 1];
        }
        bf16* q = st + static_cast<std::int64_t>(row) * d + col;
        if (p.vec) {
          *reinterpret_cast<std::uint32_t*>(q) = pack_bf16(v0, v1);
        } else {
          if (col < d) q[0] = __float2bfloat16(v0);
          if (col + 1 < d) q[1] = __float2bfloat16(v1);
        }
      }
  };

  for (int s = 0; s < kStages - 1; ++s) {
    if (s < total) issue(s);
    cp_async_commit();
  }
  for (int s = 0; s < total; ++s) {
    cp_async_wait<kStages - 2>();  // step s's tiles have landed (this thread's copies) ...
    __syncthreads();               // ... everyone's; and everyone is done with step s - 1's stage
    if (s + kStages - 1 < total) issue(s + kStages - 1);  // into step s - 1's stage
    cp_async_commit();

    const int c = chunk_of(s);
    const int n = min(kChunk, p.L - c * kChunk);
    if (s % p.pairs == 0) {
      if (p.states) store_state(c);
      if (decay) {
        const float dn = pw[n];
#pragma unroll
        for (int nt = 0; nt < C::kNt; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[nt][e] *= dn;
      }
    }

    const bf16* as = a_s + (s % kStages) * C::kTile;
    const bf16* bs = b_s + (s % kStages) * C::kTile;
#pragma unroll
    for (int kk = 0; kk < kChunk / 16; ++kk) {
      std::uint32_t af[4];
      load_a_trans(af, as, C::kLd, warp * 16, kk * 16, lane);  // A[m = state row][k = token] = a_s[token][row]
      if (decay) {
        // a0, a1 hold tokens i, i + 1; a2, a3 tokens i + 8, i + 9 (i = 16 kk + 2c).
        float w[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int i = kk * 16 + 2 * cq + (u & 1) + (u >> 1) * 8;
          w[u] = p.reverse ? pw[i + 1] : (i < n ? pw[n - 1 - i] : 0.f);
        }
        af[0] = scale_pair(af[0], w[0], w[1]);
        af[1] = scale_pair(af[1], w[0], w[1]);
        af[2] = scale_pair(af[2], w[2], w[3]);
        af[3] = scale_pair(af[3], w[2], w[3]);
      }
#pragma unroll
      for (int np = 0; np < kT / 16; ++np) {
        std::uint32_t bf[4];
        load_b_kn(bf, bs, C::kLd, np * 16, kk * 16, lane);  // B[k = token][n = state column]
        mma(acc[2 * np], af, bf[0], bf[1]);
        mma(acc[2 * np + 1], af, bf[2], bf[3]);
      }
    }
  }
  cp_async_wait<0>();

  if (p.final_state) {
#pragma unroll
    for (int nt = 0; nt < C::kNt; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = ra + 8 * half, col = cb + 8 * nt;
        if (row >= d || col >= d) continue;
        float* q = p.final_state + seg_base + row * d + col;
        if (p.f2) {
          *reinterpret_cast<float2*>(q) = make_float2(acc[nt][2 * half], acc[nt][2 * half + 1]);
        } else {
          q[0] = acc[nt][2 * half];
          if (col + 1 < d) q[1] = acc[nt][2 * half + 1];
        }
      }
  } else if (p.states && nc > 0) {
    store_state(chunk_of((nc - 1) * p.pairs));  // the segment's last chunk: the tile as it stands
  }
}

// The segmented scan's middle phase: each segment's starting tile from the segments' own sums
// M_s (a scan from zeros over the segment), over the segments of a run in order (reversed):
//   x = start (null: zeros);  for each segment s: x_s = x, stored over M_s;  x = gamma^(len_s) x + M_s
// with len_s the segment's tokens. One thread per kV consecutive elements of a (run, kv head)'s
// d x d state (kV = 4: float4 loads and stores); the loads of 8 segments are issued ahead.
template <int kV>
__device__ __forceinline__ void load_v(float (&x)[kV], const float* p) {
  if constexpr (kV == 4) {
    const float4 t = *reinterpret_cast<const float4*>(p);
    x[0] = t.x;
    x[1] = t.y;
    x[2] = t.z;
    x[3] = t.w;
  } else {
    x[0] = *p;
  }
}
template <int kV>
__device__ __forceinline__ void store_v(float* p, const float (&x)[kV]) {
  if constexpr (kV == 4)
    *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
  else
    *p = x[0];
}

template <int kV>
__global__ void segment_prefix_kernel(float* __restrict__ buf, const float* __restrict__ start, std::int64_t n,
                                      int Hkv, int dd, int NS, int seg_tokens, int L, bool reverse, const Gammas gm) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int per = dd / kV;
  const std::int64_t task = i / per;
  const int e = static_cast<int>(i % per) * kV, g = static_cast<int>(task % Hkv);
  const float lg = gm.lg[g];
  const float w_full = gpow(lg, seg_tokens), w_last = gpow(lg, L - (NS - 1) * seg_tokens);
  float x[kV];
  if (start) {
    load_v(x, start + task * dd + e);
  } else {
#pragma unroll
    for (int u = 0; u < kV; ++u) x[u] = 0.f;
  }
  float* row = buf + task * NS * dd + e;
  for (int j0 = 0; j0 < NS; j0 += 8) {
    float m[8][kV];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int j = j0 + u, sgi = reverse ? NS - 1 - j : j;
      if (j < NS) load_v(m[u], row + static_cast<std::int64_t>(sgi) * dd);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int j = j0 + u, sgi = reverse ? NS - 1 - j : j;
      if (j < NS) {
        store_v(row + static_cast<std::int64_t>(sgi) * dd, x);
        const float w = sgi == NS - 1 ? w_last : w_full;
#pragma unroll
        for (int t = 0; t < kV; ++t) x[t] = w * x[t] + m[u][t];
      }
    }
  }
}

// ---------------------------------------------- forward outputs ----------------------------------------------
//
// One block per (chunk, run * Hkv + kv head), 4 warps of 16 query rows; K, V, S_c (bf16) of the
// chunk in shared memory, the group's query heads in turn. Per warp and head:
//   o  = Q S_c                       (fp32 accumulators)
//   o *= gamma^(i+1)                 (row i)
//   s  = Q K^T over keys <= its rows, masked and decayed (mask_decay), rounded to bf16 A fragments
//   o += s V;  out = bf16(o), staged through the warp's own rows of q_s for 16-byte stores.
template <int kD>
struct Out {
  static constexpr int kLd = kD + 8, kThreads = 128, kNt = kD / 8;
  static constexpr int kSmemBytes = (3 * kChunk + kD) * kLd * static_cast<int>(sizeof(bf16));
};

struct OutArgs {
  const bf16 *q, *k, *v;
  const bf16* states;  // [R * Hkv, NT, d, d]
  bf16* out;
  int Hq, Hkv, L, d, NT, group;
  bool vec;
};

// 16 rows of kD columns from shared memory (row stride ld) to a token-major matrix (one warp):
// rows >= rows_valid and columns >= d skipped.
template <int kD>
__device__ __forceinline__ void copy_rows_out(bf16* g, std::int64_t stride, const bf16* s, int ld, int rows_valid, int d,
                                              bool vec, int lane) {
  if (vec) {
    constexpr int kPieces = kD / 8;
    for (int e = lane; e < 16 * kPieces; e += 32) {
      const int r = e / kPieces, c8 = e % kPieces * 8;
      if (r < rows_valid) *reinterpret_cast<uint4*>(g + r * stride + c8) = *reinterpret_cast<const uint4*>(s + r * ld + c8);
    }
  } else {
    for (int e = lane; e < 16 * kD; e += 32) {
      const int r = e / kD, c = e % kD;
      if (r < rows_valid && c < d) g[r * stride + c] = s[r * ld + c];
    }
  }
}

template <int kD>
__global__ void __launch_bounds__(Out<kD>::kThreads) output_kernel(const OutArgs p, const Gammas gm) {
  using C = Out<kD>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* k_s = reinterpret_cast<bf16*>(smem_raw);
  bf16* v_s = k_s + kChunk * C::kLd;
  bf16* q_s = v_s + kChunk * C::kLd;
  bf16* s_s = q_s + kChunk * C::kLd;  // [kD][kLd]: S_c[a][b]
  __shared__ float pw[kChunk + 1];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, cq = lane & 3;
  const int c = static_cast<int>(blockIdx.x), task = static_cast<int>(blockIdx.y), r = task / p.Hkv, g = task % p.Hkv;
  const int d = p.d, t0 = c * kChunk, n = min(kChunk, p.L - t0);
  const std::int64_t row0 = static_cast<std::int64_t>(r) * p.L + t0;
  const std::int64_t qs = static_cast<std::int64_t>(p.Hq) * d, ks = static_cast<std::int64_t>(p.Hkv) * d;
  const std::int64_t dd = static_cast<std::int64_t>(d) * d;

  load_tile<kChunk, kD>(k_s, C::kLd, p.k + row0 * ks + g * d, ks, n, d, p.vec, tid, C::kThreads);
  load_tile<kChunk, kD>(v_s, C::kLd, p.v + row0 * ks + g * d, ks, n, d, p.vec, tid, C::kThreads);
  load_tile<kD, kD>(s_s, C::kLd, p.states + (static_cast<std::int64_t>(task) * p.NT + c) * dd, d, d, d, p.vec, tid,
                    C::kThreads);
  load_tile<kChunk, kD>(q_s, C::kLd, p.q + row0 * qs + static_cast<std::int64_t>(g) * p.group * d, qs, n, d, p.vec,
                        tid, C::kThreads);
  cp_async_commit();
  for (int i = tid; i <= kChunk; i += C::kThreads) pw[i] = gpow(gm.lg[g], i);

  const int m0 = warp * 16, i0 = m0 + gq, i1 = i0 + 8;
  for (int hh = 0; hh < p.group; ++hh) {
    const std::int64_t h = static_cast<std::int64_t>(g) * p.group + hh;
    if (hh > 0) {
      __syncthreads();  // every warp has copied its staged rows of q_s out
      load_tile<kChunk, kD>(q_s, C::kLd, p.q + row0 * qs + h * d, qs, n, d, p.vec, tid, C::kThreads);
      cp_async_commit();
    }
    cp_async_wait<0>();
    __syncthreads();

    float o[C::kNt][4], s[8][4];
#pragma unroll
    for (int nt = 0; nt < C::kNt; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[nt][e] = 0.f;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;

    // o = Q S_c and s = Q K^T (key tiles wholly above this warp's rows skipped), one pass over Q.
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      std::uint32_t qa[4];
      load_a(qa, q_s, C::kLd, m0, kk * 16, lane);
#pragma unroll
      for (int np = 0; np < kD / 16; ++np) {
        std::uint32_t bf[4];
        load_b_kn(bf, s_s, C::kLd, np * 16, kk * 16, lane);  // B[k = a][n = b] = S[a][b]
        mma(o[2 * np], qa, bf[0], bf[1]);
        mma(o[2 * np + 1], qa, bf[2], bf[3]);
      }
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        if (np > warp) continue;  // keys 16 np.. are all after this warp's rows
        std::uint32_t bf[4];
        load_b_nk(bf, k_s, C::kLd, np * 16, kk * 16, lane);  // B[k = a][n = j] = K[j][a]
        mma(s[2 * np], qa, bf[0], bf[1]);
        mma(s[2 * np + 1], qa, bf[2], bf[3]);
      }
    }
    const float w0 = pw[i0 + 1], w1 = pw[i1 + 1];
#pragma unroll
    for (int nt = 0; nt < C::kNt; ++nt) {
      o[nt][0] *= w0;
      o[nt][1] *= w0;
      o[nt][2] *= w1;
      o[nt][3] *= w1;
    }
    mask_decay(s, i0, cq, pw);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if (kk > warp) continue;  // all zeros
      std::uint32_t pa[4];
      acc_to_a(pa, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int np = 0; np < kD / 16; ++np) {
        std::uint32_t bf[4];
        load_b_kn(bf, v_s, C::kLd, np * 16, kk * 16, lane);  // B[k = j][n = b] = V[j][b]
        mma(o[2 * np], pa, bf[0], bf[1]);
        mma(o[2 * np + 1], pa, bf[2], bf[3]);
      }
    }

    // Stage the warp's 16 rows in its own rows of q_s (no other warp reads them), then store.
    __syncwarp();
#pragma unroll
    for (int nt = 0; nt < C::kNt; ++nt) {
      const int col = nt * 8 + 2 * cq;
      *reinterpret_cast<std::uint32_t*>(q_s + i0 * C::kLd + col) = pack_bf16(o[nt][0], o[nt][1]);
      *reinterpret_cast<std::uint32_t*>(q_s + i1 * C::kLd + col) = pack_bf16(o[nt][2], o[nt][3]);
    }
    __syncwarp();
    copy_rows_out<kD>(p.out + (row0 + m0) * qs + h * d, qs, q_s + m0 * C::kLd, C::kLd, n - m0, d, p.vec, lane);
  }
}

// ---------------------------------------------- backward ----------------------------------------------
//
// One block per (chunk, run * Hkv + kv head); 4 row groups of 16 (rw) x kSplit column groups
// (cw) of warps. K, V, then Gk_c (later S_c) of the chunk in shared memory:
//   1. dk = gamma^(n-1-j) (V Gk^T)[j],  dv = gamma^(n-1-j) (K Gk)[j]     (accumulators, kept)
//   then per query head of the group (Q, dO in shared memory):
//   2. P~ = mask(Q K^T) gamma^(i-j), dP~ = mask(dO V^T) gamma^(i-j) to shared memory (bf16)
//   3. dq = gamma^(i+1) (dO S_c^T)[i] + (dP~ K)[i]                      (stored)
//   4. dk += dP~^T Q,  dv += P~^T dO
// and dk, dv stored after the last head.
template <int kD>
struct Bwd {
  static constexpr int kSplit = kD >= 32 ? 2 : 1;
  static constexpr int kWarps = 4 * kSplit, kThreads = 32 * kWarps;
  static constexpr int kCols = kD / kSplit, kNt = kCols / 8;  // per warp
  static constexpr int kLd = kD + 8, kPLd = kChunk + 8;
  static constexpr int kSmemBytes =
      ((4 * kChunk + kD) * kLd + 2 * kChunk * kPLd) * static_cast<int>(sizeof(bf16));
};

struct BwdArgs {
  const bf16 *q, *k, *v, *dout;
  const bf16* states;   // S_c [R * Hkv, NT, d, d]
  const bf16* gstates;  // Gk_c
  bf16 *dq, *dk, *dv;
  int Hq, Hkv, L, d, NT, group;
  bool vec;
};

template <int kD>
__global__ void __launch_bounds__(Bwd<kD>::kThreads) backward_kernel(const BwdArgs p, const Gammas gm) {
  using C = Bwd<kD>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* k_s = reinterpret_cast<bf16*>(smem_raw);
  bf16* v_s = k_s + kChunk * C::kLd;
  bf16* q_s = v_s + kChunk * C::kLd;
  bf16* do_s = q_s + kChunk * C::kLd;
  bf16* m_s = do_s + kChunk * C::kLd;  // [kD][kLd]: Gk_c, then S_c
  bf16* p_s = m_s + kD * C::kLd;       // [kChunk][kPLd]: P~
  bf16* dp_s = p_s + kChunk * C::kPLd; // dP~
  __shared__ float pw[kChunk + 1];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, cq = lane & 3;
  const int rw = warp & 3, cw = warp >> 2, m0 = rw * 16, n_base = cw * C::kCols;
  const int i0 = m0 + gq, i1 = i0 + 8;
  const int c = static_cast<int>(blockIdx.x), task = static_cast<int>(blockIdx.y), r = task / p.Hkv, g = task % p.Hkv;
  const int d = p.d, t0 = c * kChunk, n = min(kChunk, p.L - t0);
  const std::int64_t row0 = static_cast<std::int64_t>(r) * p.L + t0;
  const std::int64_t qs = static_cast<std::int64_t>(p.Hq) * d, ks = static_cast<std::int64_t>(p.Hkv) * d;
  const std::int64_t st_off = (static_cast<std::int64_t>(task) * p.NT + c) * d * d;

  load_tile<kChunk, kD>(k_s, C::kLd, p.k + row0 * ks + g * d, ks, n, d, p.vec, tid, C::kThreads);
  load_tile<kChunk, kD>(v_s, C::kLd, p.v + row0 * ks + g * d, ks, n, d, p.vec, tid, C::kThreads);
  load_tile<kD, kD>(m_s, C::kLd, p.gstates + st_off, d, d, d, p.vec, tid, C::kThreads);
  cp_async_commit();
  for (int i = tid; i <= kChunk; i += C::kThreads) pw[i] = gpow(gm.lg[g], i);
  cp_async_wait<0>();
  __syncthreads();

  // 1. The state path: this warp's rows j of dk, dv, columns n_base..n_base + kCols.
  float dk[C::kNt][4], dv[C::kNt][4];
#pragma unroll
  for (int nt = 0; nt < C::kNt; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[nt][e] = dv[nt][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    std::uint32_t va[4], ka[4];
    load_a(va, v_s, C::kLd, m0, kk * 16, lane);  // A[j][k = b] = V[j][b]
    load_a(ka, k_s, C::kLd, m0, kk * 16, lane);  // A[j][k = a] = K[j][a]
#pragma unroll
    for (int np = 0; np < C::kCols / 16; ++np) {
      std::uint32_t bf[4];
      load_b_nk(bf, m_s, C::kLd, n_base + np * 16, kk * 16, lane);  // B[k = b][n = a] = Gk[a][b]
      mma(dk[2 * np], va, bf[0], bf[1]);
      mma(dk[2 * np + 1], va, bf[2], bf[3]);
      load_b_kn(bf, m_s, C::kLd, n_base + np * 16, kk * 16, lane);  // B[k = a][n = b] = Gk[a][b]
      mma(dv[2 * np], ka, bf[0], bf[1]);
      mma(dv[2 * np + 1], ka, bf[2], bf[3]);
    }
  }
  {
    const float w0 = i0 < n ? pw[n - 1 - i0] : 0.f, w1 = i1 < n ? pw[n - 1 - i1] : 0.f;
#pragma unroll
    for (int nt = 0; nt < C::kNt; ++nt) {
      dk[nt][0] *= w0;
      dk[nt][1] *= w0;
      dk[nt][2] *= w1;
      dk[nt][3] *= w1;
      dv[nt][0] *= w0;
      dv[nt][1] *= w0;
      dv[nt][2] *= w1;
      dv[nt][3] *= w1;
    }
  }
  __syncthreads();  // everyone is done with Gk_c

  load_tile<kD, kD>(m_s, C::kLd, p.states + st_off, d, d, d, p.vec, tid, C::kThreads);
  for (int hh = 0; hh < p.group; ++hh) {
    const std::int64_t h = static_cast<std::int64_t>(g) * p.group + hh;
    load_tile<kChunk, kD>(q_s, C::kLd, p.q + row0 * qs + h * d, qs, n, d, p.vec, tid, C::kThreads);
    load_tile<kChunk, kD>(do_s, C::kLd, p.dout + row0 * qs + h * d, qs, n, d, p.vec, tid, C::kThreads);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    // 2. P~ (which 0) and dP~ (which 1): rows i of this row group, all 64 keys (zeros above the
    // diagonal written too: steps 3 and 4 read whole k-steps).
    for (int which = cw; which < 2; which += C::kSplit) {
      const bf16* am = which ? do_s : q_s;
      const bf16* bm = which ? v_s : k_s;
      bf16* pm = which ? dp_s : p_s;
      float s[8][4];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        std::uint32_t a[4];
        load_a(a, am, C::kLd, m0, kk * 16, lane);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          if (np > rw) continue;
          std::uint32_t bf[4];
          load_b_nk(bf, bm, C::kLd, np * 16, kk * 16, lane);  // B[k][n = j] = K[j][k] (or V)
          mma(s[2 * np], a, bf[0], bf[1]);
          mma(s[2 * np + 1], a, bf[2], bf[3]);
        }
      }
      mask_decay(s, i0, cq, pw);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int col = nt * 8 + 2 * cq;
        *reinterpret_cast<std::uint32_t*>(pm + i0 * C::kPLd + col) = pack_bf16(s[nt][0], s[nt][1]);
        *reinterpret_cast<std::uint32_t*>(pm + i1 * C::kPLd + col) = pack_bf16(s[nt][2], s[nt][3]);
      }
    }
    __syncthreads();

    // 3. dq of this head: rows i, columns n_base..
    {
      float dq[C::kNt][4];
#pragma unroll
      for (int nt = 0; nt < C::kNt; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dq[nt][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        std::uint32_t a[4];
        load_a(a, do_s, C::kLd, m0, kk * 16, lane);  // A[i][k = b] = dO[i][b]
#pragma unroll
        for (int np = 0; np < C::kCols / 16; ++np) {
          std::uint32_t bf[4];
          load_b_nk(bf, m_s, C::kLd, n_base + np * 16, kk * 16, lane);  // B[k = b][n = a] = S[a][b]
          mma(dq[2 * np], a, bf[0], bf[1]);
          mma(dq[2 * np + 1], a, bf[2], bf[3]);
        }
      }
      const float w0 = pw[i0 + 1], w1 = pw[i1 + 1];
#pragma unroll
      for (int nt = 0; nt < C::kNt; ++nt) {
        dq[nt][0] *= w0;
        dq[nt][1] *= w0;
        dq[nt][2] *= w1;
        dq[nt][3] *= w1;
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        if (kk > rw) continue;  // keys after this row group: dP~ is zero there
        std::uint32_t a[4];
        load_a(a, dp_s, C::kPLd, m0, kk * 16, lane);  // A[i][k = j] = dP~[i][j]
#pragma unroll
        for (int np = 0; np < C::kCols / 16; ++np) {
          std::uint32_t bf[4];
          load_b_kn(bf, k_s, C::kLd, n_base + np * 16, kk * 16, lane);  // B[k = j][n = a] = K[j][a]
          mma(dq[2 * np], a, bf[0], bf[1]);
          mma(dq[2 * np + 1], a, bf[2], bf[3]);
        }
      }
      store_acc(p.dq + row0 * qs + h * d, qs, dq, i0, n_base + 2 * cq, n, d, p.vec);
    }

    // 4. dk += dP~^T Q, dv += P~^T dO: rows j of this row group, queries i >= j.
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if (kk < rw) continue;  // queries before this row group: zero
      std::uint32_t a_dp[4], a_p[4];
      load_a_trans(a_dp, dp_s, C::kPLd, m0, kk * 16, lane);  // A[j][k = i] = dP~[i][j]
      load_a_trans(a_p, p_s, C::kPLd, m0, kk * 16, lane);    // A[j][k = i] = P~[i][j]
#pragma unroll
      for (int np = 0; np < C::kCols / 16; ++np) {
        std::uint32_t bf[4];
        load_b_kn(bf, q_s, C::kLd, n_base + np * 16, kk * 16, lane);  // B[k = i][n = a] = Q[i][a]
        mma(dk[2 * np], a_dp, bf[0], bf[1]);
        mma(dk[2 * np + 1], a_dp, bf[2], bf[3]);
        load_b_kn(bf, do_s, C::kLd, n_base + np * 16, kk * 16, lane);  // B[k = i][n = b] = dO[i][b]
        mma(dv[2 * np], a_p, bf[0], bf[1]);
        mma(dv[2 * np + 1], a_p, bf[2], bf[3]);
      }
    }
    __syncthreads();  // before the next head's Q, dO and P~ overwrite these
  }
  store_acc(p.dk + row0 * ks + g * d, ks, dk, i0, n_base + 2 * cq, n, d, p.vec);
  store_acc(p.dv + row0 * ks + g * d, ks, dv, i0, n_base + 2 * cq, n, d, p.vec);
}

// ---------------------------------------------- decode, feature map, norm ----------------------------------------------

// One block per (sequence, kv head); a thread per state column b: M[a][b] = gamma M[a][b] +
// k[a] v[b] (rounded as the CPU op: product and sum separately), then out_h[b] = sum_a q_h[a] M[a][b]
// for the group's query heads (reading back its own column).
__global__ void step_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                            float* __restrict__ state, bf16* __restrict__ out, int Hq, int Hkv, int d, int group,
                            const Gammas gm) {
  const std::int64_t task = blockIdx.x, b = task / Hkv;
  const int g = static_cast<int>(task % Hkv);
  const float gamma = gm.gamma[g];
  float* M = state + task * d * d;
  const bf16* kr = k + (b * Hkv + g) * d;
  const bf16* vr = v + (b * Hkv + g) * d;
  for (int col = threadIdx.x; col < d; col += blockDim.x) {
    const float vb = __bfloat162float(vr[col]);
    for (int a = 0; a < d; ++a) {
      float m = M[a * d + col];
      if (gamma != 1.f) m = __fmul_rn(m, gamma);
      M[a * d + col] = __fadd_rn(m, __fmul_rn(__bfloat162float(kr[a]), vb));
    }
    for (int hh = 0; hh < group; ++hh) {
      const bf16* qr = q + (b * Hq + static_cast<std::int64_t>(g) * group + hh) * d;
      float o = 0.f;
      for (int a = 0; a < d; ++a) o += __bfloat162float(qr[a]) * M[a * d + col];
      out[(b * Hq + static_cast<std::int64_t>(g) * group + hh) * d + col] = __float2bfloat16(o);
    }
  }
}

__global__ void elu1_forward_kernel(const bf16* x, bf16* y, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float a = __bfloat162float(x[i]);
    y[i] = __float2bfloat16(a > 0.f ? a + 1.f : expf(a));
  }
}

__global__ void elu1_backward_kernel(const bf16* y, const bf16* dy, bf16* dx, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float a = __bfloat162float(y[i]);
    dx[i] = __float2bfloat16(__bfloat162float(dy[i]) * (a > 1.f ? 1.f : a));
  }
}

constexpr int kNormWarps = 8;  // rows per block, a warp each

// y may alias x: a lane rereads and rewrites only its own elements.
__global__ void norm_forward_kernel(const bf16* x, std::int64_t M, int d, float eps, bf16* y, float* rstd) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kNormWarps + threadIdx.x / 32;
  if (row >= M) return;  // whole warps
  const int lane = threadIdx.x & 31;
  const bf16* xr = x + row * d;
  bf16* yr = y + row * d;
  float ss = 0.f;
  for (int j = lane; j < d; j += 32) {
    const float a = __bfloat162float(xr[j]);
    ss += a * a;
  }
  ss = warp_sum(ss);
  const float rs = 1.0f / sqrtf(ss / static_cast<float>(d) + eps);
  if (lane == 0) rstd[row] = rs;
  for (int j = lane; j < d; j += 32) yr[j] = __float2bfloat16(__bfloat162float(xr[j]) * rs);
}

// dx may alias dy, as above.
__global__ void norm_backward_kernel(const bf16* y, const float* rstd, const bf16* dy, bf16* dx, std::int64_t M, int d) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kNormWarps + threadIdx.x / 32;
  if (row >= M) return;
  const int lane = threadIdx.x & 31;
  const bf16* yr = y + row * d;
  const bf16* gr = dy + row * d;
  bf16* xr = dx + row * d;
  float dot = 0.f;
  for (int j = lane; j < d; j += 32) dot += __bfloat162float(gr[j]) * __bfloat162float(yr[j]);
  const float m = warp_sum(dot) / static_cast<float>(d), rs = rstd[row];
  for (int j = lane; j < d; j += 32)
    xr[j] = __float2bfloat16(rs * (__bfloat162float(gr[j]) - __bfloat162float(yr[j]) * m));
}

// ---------------------------------------------- host side ----------------------------------------------

struct Dims {
  int R, L, Hq, Hkv, d, group, NT;
};

Dims check(const Config& c, std::int64_t runs, std::int64_t len) {
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

Gammas gammas_of(const Config& c) {
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

bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

// The padded head width of the tensor-core kernels.
int padded(int d) { return d <= 16 ? 16 : d <= 32 ? 32 : d <= 64 ? 64 : 128; }

std::size_t states_bytes(const Dims& s) {
  return round_up(static_cast<std::size_t>(s.R) * s.Hkv * s.NT * s.d * s.d * sizeof(bf16));
}

void check_workspace(const void* workspace) {
  if (!workspace || (reinterpret_cast<std::uintptr_t>(workspace) % kAlign))
    fail("linear attention (CUDA): the workspace must be a 256-byte aligned device buffer");
}

// ---- the scans ----
//
// A run of many chunks is scanned in segments of `seg` consecutive chunks, all in parallel, in
// three launches (the segmented scan), instead of one block walking all its chunks:
//   1. each segment's own sum M_s from zeros (scan_kernel over every segment at once, its
//      final_state the segment buffer; no states);
//   2. segment_prefix_kernel: each segment's starting state from the M_s, in place;
//   3. scan_kernel over every segment again from those starting states, storing the chunks'
//      states (the segment's last chunk only stored: nothing reads the state after it).
// Phases 1 and 3 take one block per (segment, run, kv head) holding the whole padded d x d state
// (tile padded(d), d / 16 warps). The chunks per segment aim at about kSegBlocks blocks per phase
// (R * Hkv * NS), within [kSegMin, kSegMax]; a run that is one segment (NS = 1) takes the single
// scan: one block per (32 x 32 tile of the state, run, kv head; 16 x 16 for d < 32) walking all
// its chunks. local_states and init_gradient (and backward's dinit) always take the single scan:
// they have no workspace for the segment buffer.
constexpr int kSegBlocks = 1024, kSegMin = 4, kSegMax = 32;

struct Segments {
  int seg, NS;  // chunks per segment, segments per run
};

Segments segments_of(const Dims& s) {
  const std::int64_t want = (static_cast<std::int64_t>(s.NT) * s.R * s.Hkv + kSegBlocks - 1) / kSegBlocks;
  const int seg = static_cast<int>(std::min<std::int64_t>(kSegMax, std::max<std::int64_t>(kSegMin, want)));
  return {seg, (s.NT + seg - 1) / seg};
}

// The segment buffer [R, Hkv, NS, d, d] fp32 of the segmented scan, sized for an upper bound of
// R * NS that never decreases as R or NT grow (so neither does workspace_bytes, as before: a
// workspace sized for longer or more runs serves shorter or fewer): R * NS <= R * NT / seg + R,
// and R * NT / seg <= min(R NT / kSegMin, max(R NT / kSegMax, kSegBlocks / Hkv)) whatever seg
// segments_of picks. Runs of at most kSegMin chunks are one segment whatever R: no buffer.
std::size_t segment_bytes(const Dims& s) {
  if (s.NT <= kSegMin) return 0;
  auto ceil_div = [](std::int64_t a, std::int64_t b) { return (a + b - 1) / b; };
  const std::int64_t rn = static_cast<std::int64_t>(s.R) * s.NT;
  const std::int64_t bound =
      std::min(ceil_div(rn, kSegMin), std::max(ceil_div(rn, kSegMax), ceil_div(kSegBlocks, s.Hkv))) + s.R;
  return round_up(sizeof(float) * static_cast<std::size_t>(bound) * s.Hkv * s.d * s.d);
}

// The segment buffer in the workspace, after S_c and Gk_c; null for the single scan (one segment).
float* segment_buffer(const Dims& s, void* workspace) {
  if (segments_of(s).NS < 2) return nullptr;
  return reinterpret_cast<float*>(static_cast<unsigned char*>(workspace) + 2 * states_bytes(s));
}

bool aligned8(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 7u) == 0; }  // null: true

template <int kT, bool kExtra>
void launch_scan_tiles(ScanArgs a, int tasks, const Gammas& gm, cudaStream_t stream) {
  using C = Scan<kT, kExtra>;
  a.f2 = a.d % 2 == 0 && aligned8(a.init) && aligned8(a.extra) && aligned8(a.final_state);
  if (C::kSmemBytes > 48 * 1024)
    KEEL_CUDA_CHECK(
        cudaFuncSetAttribute(scan_kernel<kT, kExtra>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes));
  const int tiles = (a.d + kT - 1) / kT;
  const dim3 grid(static_cast<unsigned>(tiles * tiles * a.NS), static_cast<unsigned>(tasks));
  scan_kernel<kT, kExtra><<<grid, C::kThreads, C::kSmemBytes, stream>>>(a, gm);
  KEEL_CUDA_CHECK_LAUNCH();
}

ScanArgs scan_args(const Dims& s, const bf16* a, const bf16* b, std::int64_t stride, int pairs, bool reverse) {
  ScanArgs p{};
  p.a = a;
  p.b = b;
  p.a_stride = p.b_stride = stride;
  p.Hkv = s.Hkv;
  p.L = s.L;
  p.d = s.d;
  p.NT = s.NT;
  p.pairs = pairs;
  p.reverse = reverse;
  p.vec = aligned16(a) && aligned16(b);
  return p;
}

// The single scan: each run one segment; vec where the tiles are whole and aligned.
void single_scan(const Dims& s, ScanArgs a, const Gammas& gm, cudaStream_t stream) {
  a.seg = s.NT;
  a.NS = 1;
  const int kT = s.d >= 32 ? 32 : 16;
  a.vec = a.vec && s.d % kT == 0;
  if (kT == 32)
    launch_scan_tiles<32, true>(a, s.R * s.Hkv, gm, stream);
  else
    launch_scan_tiles<16, true>(a, s.R * s.Hkv, gm, stream);
}

// One phase (1 or 3) of the segmented scan: a block per (segment, run, kv head), the whole state.
void segment_scan(const Dims& s, ScanArgs a, const Segments& sg, const Gammas& gm, cudaStream_t stream) {
  a.seg = sg.seg;
  a.NS = sg.NS;
  a.extra = nullptr;
  const int kT = padded(s.d);
  a.vec = a.vec && s.d == kT;
  const int tasks = s.R * s.Hkv;
  switch (kT) {
    case 16: launch_scan_tiles<16, false>(a, tasks, gm, stream); break;
    case 32: launch_scan_tiles<32, false>(a, tasks, gm, stream); break;
    case 64: launch_scan_tiles<64, false>(a, tasks, gm, stream); break;
    default: launch_scan_tiles<128, false>(a, tasks, gm, stream); break;
  }
}

// The segmented scan of a (states stored, no final state) from `start` (null: zeros) at the
// run's beginning (in order) or end (reversed), through the segment buffer seg_buf.
void segmented_scan(const Dims& s, const ScanArgs& a, const float* start, float* seg_buf, const Gammas& gm,
                    cudaStream_t stream) {
  const Segments sg = segments_of(s);
  ScanArgs own = a;  // 1. the segments' own sums
  own.init = nullptr;
  own.states = nullptr;
  own.final_state = seg_buf;
  segment_scan(s, own, sg, gm, stream);

  const int dd = s.d * s.d;  // 2. their starting states
  const bool vec = dd % 4 == 0 && (!start || aligned16(start));
  const std::int64_t n = static_cast<std::int64_t>(s.R) * s.Hkv * dd / (vec ? 4 : 1);
  const int seg_tokens = sg.seg * kChunk;
  if (vec)
    segment_prefix_kernel<4><<<grid_for(n, 256), 256, 0, stream>>>(seg_buf, start, n, s.Hkv, dd, sg.NS, seg_tokens,
                                                                     s.L, a.reverse, gm);
  else
    segment_prefix_kernel<1><<<grid_for(n, 256), 256, 0, stream>>>(seg_buf, start, n, s.Hkv, dd, sg.NS, seg_tokens,
                                                                     s.L, a.reverse, gm);
  KEEL_CUDA_CHECK_LAUNCH();

  ScanArgs from = a;  // 3. the chunks' states from them
  from.init = seg_buf;
  from.final_state = nullptr;
  segment_scan(s, from, sg, gm, stream);
}

// S_c (bf16, the state before each chunk) of the runs from init (null: zeros): A = K, B = V, in
// order. seg_buf: the segmented scan's buffer, null for the single scan.
void scan_states(const Dims& s, const bf16* k, const bf16* v, const float* init, bf16* states, float* seg_buf,
                 const Gammas& gm, cudaStream_t stream) {
  ScanArgs a = scan_args(s, k, v, static_cast<std::int64_t>(s.Hkv) * s.d, 1, false);
  a.states = states;
  if (seg_buf) {
    segmented_scan(s, a, init, seg_buf, gm, stream);
  } else {
    a.init = init;
    single_scan(s, a, gm, stream);
  }
}

// Each run's end state from zeros (fp32): the single scan with no states.
void scan_local(const Dims& s, const bf16* k, const bf16* v, float* final_state, const Gammas& gm,
                cudaStream_t stream) {
  ScanArgs a = scan_args(s, k, v, static_cast<std::int64_t>(s.Hkv) * s.d, 1, false);
  a.final_state = final_state;
  single_scan(s, a, gm, stream);
}

// dinit = G_{-1} (fp32) alone: the reverse single scan over A = Q, B = dO with no states (the
// code of init_gradient, and of backward's dinit whichever scan gives its Gk_c).
void scan_init_gradient(const Dims& s, const bf16* q, const bf16* dout, float* dinit, const Gammas& gm,
                        cudaStream_t stream) {
  ScanArgs a = scan_args(s, q, dout, static_cast<std::int64_t>(s.Hq) * s.d, s.group, true);
  a.final_state = dinit;
  single_scan(s, a, gm, stream);
}

// Gk_c = G_c + gamma^(L - t1) dlocal (bf16) and dinit = G_{-1} (fp32; null: none): A = Q, B = dO
// over the group's query heads, chunks last first. The single scan adds dlocal's term to the
// stored states and gives dinit in the same pass (the same bits as scan_init_gradient: the
// stored states do not touch the accumulators); the segmented one starts from dlocal at the runs'
// ends (gamma^(L - t1) is exactly the decay from there) and leaves dinit to scan_init_gradient.
void scan_gradients(const Dims& s, const bf16* q, const bf16* dout, const float* dlocal, bf16* gstates, float* dinit,
                    float* seg_buf, const Gammas& gm, cudaStream_t stream) {
  ScanArgs a = scan_args(s, q, dout, static_cast<std::int64_t>(s.Hq) * s.d, s.group, true);
  a.states = gstates;
  if (seg_buf) {
    segmented_scan(s, a, dlocal, seg_buf, gm, stream);
    if (dinit) scan_init_gradient(s, q, dout, dinit, gm, stream);
  } else {
    a.extra = dlocal;
    a.final_state = dinit;
    single_scan(s, a, gm, stream);
  }
}

template <int kD>
void launch_output(const Dims& s, const OutArgs& a, const Gammas& gm, cudaStream_t stream) {
  using C = Out<kD>;
  KEEL_CUDA_CHECK(cudaFuncSetAttribute(output_kernel<kD>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes));
  const dim3 grid(static_cast<unsigned>(s.NT), static_cast<unsigned>(s.R * s.Hkv));
  output_kernel<kD><<<grid, C::kThreads, C::kSmemBytes, stream>>>(a, gm);
  KEEL_CUDA_CHECK_LAUNCH();
}

template <int kD>
void launch_backward(const Dims& s, const BwdArgs& a, const Gammas& gm, cudaStream_t stream) {
  using C = Bwd<kD>;
  KEEL_CUDA_CHECK(
      cudaFuncSetAttribute(backward_kernel<kD>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes));
  const dim3 grid(static_cast<unsigned>(s.NT), static_cast<unsigned>(s.R * s.Hkv));
  backward_kernel<kD><<<grid, C::kThreads, C::kSmemBytes, stream>>>(a, gm);
  KEEL_CUDA_CHECK_LAUNCH();
}

}  // namespace

std::size_t workspace_bytes(const Config& c, std::int64_t runs, std::int64_t len) {
  const Dims s = check(c, runs, len);
  return 2 * states_bytes(s) + segment_bytes(s);
}

void forward(const Config& c, std::int64_t runs, std::int64_t len, const bf16* q, const bf16* k, const bf16* v,
             const float* init, bf16* out, void* workspace, cudaStream_t stream) {
  const Dims s = check(c, runs, len);
  if (s.R == 0 || s.L == 0) return;
  check_workspace(workspace);
  const Gammas gm = gammas_of(c);
  bf16* states = static_cast<bf16*>(workspace);
  scan_states(s, k, v, init, states, segment_buffer(s, workspace), gm, stream);

  const int kD = padded(s.d);
  OutArgs oa{q, k, v, states, out, s.Hq, s.Hkv, s.L, s.d, s.NT, s.group,
             s.d == kD && aligned16(q) && aligned16(k) && aligned16(v) && aligned16(out)};
  switch (kD) {
    case 16: launch_output<16>(s, oa, gm, stream); break;
    case 32: launch_output<32>(s, oa, gm, stream); break;
    case 64: launch_output<64>(s, oa, gm, stream); break;
    default: launch_output<128>(s, oa, gm, stream); break;
  }
}

void backward(const Config& c, std::int64_t runs, std::int64_t len, const bf16* q, const bf16* k, const bf16* v,
              const float* init, const bf16* dout, const float* dlocal, bf16* dq, bf16* dk, bf16* dv, float* dinit,
              void* workspace, cudaStream_t stream) {
  const Dims s = check(c, runs, len);
  if (s.R == 0) return;
  if (s.L == 0) {  // no tokens: the initial state reaches nothing
    if (dinit)
      KEEL_CUDA_CHECK(cudaMemsetAsync(dinit, 0, sizeof(float) * s.R * s.Hkv * s.d * s.d, stream));
    return;
  }
  check_workspace(workspace);
  const Gammas gm = gammas_of(c);
  bf16* states = static_cast<bf16*>(workspace);
  bf16* gstates = reinterpret_cast<bf16*>(static_cast<unsigned char*>(workspace) + states_bytes(s));

  float* seg_buf = segment_buffer(s, workspace);
  scan_states(s, k, v, init, states, seg_buf, gm, stream);                  // S_c, as forward
  scan_gradients(s, q, dout, dlocal, gstates, dinit, seg_buf, gm, stream);  // Gk_c and dinit

  const int kD = padded(s.d);
  BwdArgs ba{q, k, v, dout, states, gstates, dq, dk, dv, s.Hq, s.Hkv, s.L, s.d, s.NT, s.group,
             s.d == kD && aligned16(q) && aligned16(k) && aligned16(v) && aligned16(dout) && aligned16(dq) &&
                 aligned16(dk) && aligned16(dv)};
  switch (kD) {
    case 16: launch_backward<16>(s, ba, gm, stream); break;
    case 32: launch_backward<32>(s, ba, gm, stream); break;
    case 64: launch_backward<64>(s, ba, gm, stream); break;
    default: launch_backward<128>(s, ba, gm, stream); break;
  }
}

void local_states(const Config& c, std::int64_t runs, std::int64_t len, const bf16* k, const bf16* v, float* states,
                  cudaStream_t stream) {
  const Dims s = check(c, runs, len);
  if (s.R == 0) return;
  if (s.L == 0) {
    KEEL_CUDA_CHECK(cudaMemsetAsync(states, 0, sizeof(float) * s.R * s.Hkv * s.d * s.d, stream));
    return;
  }
  scan_local(s, k, v, states, gammas_of(c), stream);
}

void init_gradient(const Config& c, std::int64_t runs, std::int64_t len, const bf16* q, const bf16* dout, float* dinit,
                   cudaStream_t stream) {
  const Dims s = check(c, runs, len);
  if (s.R == 0) return;
  if (s.L == 0) {
    KEEL_CUDA_CHECK(cudaMemsetAsync(dinit, 0, sizeof(float) * s.R * s.Hkv * s.d * s.d, stream));
    return;
  }
  scan_init_gradient(s, q, dout, dinit, gammas_of(c), stream);
}

void step(const Config& c, std::int64_t B, const bf16* q, const bf16* k, const bf16* v, float* state, bf16* out,
          cudaStream_t stream) {
  const Dims s = check(c, B, 1);
  if (B == 0) return;
  step_kernel<<<static_cast<unsigned>(B * s.Hkv), 128, 0, stream>>>(q, k, v, state, out, s.Hq, s.Hkv, s.d, s.group,
                                                                     gammas_of(c));
  KEEL_CUDA_CHECK_LAUNCH();
}

void feature_forward(Feature f, const bf16* x, bf16* y, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  if (f == Feature::kIdentity) {
    if (x != y) KEEL_CUDA_CHECK(cudaMemcpyAsync(y, x, sizeof(bf16) * n, cudaMemcpyDeviceToDevice, stream));
    return;
  }
  elu1_forward_kernel<<<elementwise_grid(n, 256), 256, 0, stream>>>(x, y, n);
  KEEL_CUDA_CHECK_LAUNCH();
}

void feature_backward(Feature f, const bf16* y, const bf16* dy, bf16* dx, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  if (f == Feature::kIdentity) {
    if (dy != dx) KEEL_CUDA_CHECK(cudaMemcpyAsync(dx, dy, sizeof(bf16) * n, cudaMemcpyDeviceToDevice, stream));
    return;
  }
  elu1_backward_kernel<<<elementwise_grid(n, 256), 256, 0, stream>>>(y, dy, dx, n);
  KEEL_CUDA_CHECK_LAUNCH();
}

void norm_forward(const bf16* x, std::int64_t M, int d, float eps, bf16* y, float* rstd, cudaStream_t stream) {
  if (d < 1) fail("linear attention norm (CUDA): width {} must be >= 1", d);
  if (M <= 0) return;
  norm_forward_kernel<<<grid_for(M, kNormWarps), 32 * kNormWarps, 0, stream>>>(x, M, d, eps, y, rstd);
  KEEL_CUDA_CHECK_LAUNCH();
}

void norm_backward(const bf16* y, const float* rstd, const bf16* dy, bf16* dx, std::int64_t M, int d,
                   cudaStream_t stream) {
  if (d < 1) fail("linear attention norm (CUDA): width {} must be >= 1", d);
  if (M <= 0) return;
  norm_backward_kernel<<<grid_for(M, kNormWarps), 32 * kNormWarps, 0, stream>>>(y, rstd, dy, dx, M, d);
  KEEL_CUDA_CHECK_LAUNCH();
}

}  // namespace keel::ops::cuda::linear_attention
