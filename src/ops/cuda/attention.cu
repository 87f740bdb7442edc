#include "ops/cuda/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/error.h"
#include "ops/cuda/mma_fragments.cuh"

namespace keel::ops::cuda::attention {

namespace {

using namespace mma_frag;  // ops/cuda/mma_fragments.cuh

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The warp-level building blocks (smem_addr, cp.async, ldmatrix, mma) are ops/cuda/mma_fragments.cuh's.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Rows [row0, row0 + rows) of a [T, ...] global matrix with `g_stride` elements between rows,
// kDh columns, into shared memory at row stride `ld`; rows >= T are zero-filled so padded
// rows contribute exact zeros (never garbage) to every MMA.
template <int kDh>
__device__ __forceinline__ void load_rows_async(bf16* s, int ld, const bf16* g, std::int64_t g_stride, int row0, int rows,
                                                int T, int tid, int nthreads) {
  constexpr int kChunks = kDh / 8;  // 16-byte chunks per row
  for (int c = tid; c < rows * kChunks; c += nthreads) {
    const int r = c / kChunks, ch = c % kChunks;
    const int row = row0 + r;
    const bool ok = row < T;
    cp_async_16(s + r * ld + ch * 8, g + (ok ? row : 0) * g_stride + ch * 8, ok ? 16 : 0);
  }
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---------------------------------------------- forward ----------------------------------------------

// 8 warps x 16 query rows; 64-key tiles. Shared memory: the Q tile (reused to stage the output
// for coalesced stores) and two K/V stages. Rows are padded by 8 elements (16 bytes) so the 8
// row addresses of an ldmatrix fall into distinct bank groups. Two blocks per SM: Q's
// fragments are read from shared memory per key tile rather than held in registers, which keeps
// a thread under 128 registers; the second block's warps hide the first's waits (Dh 128 on an
// H100: 174 -> 235 TFLOP/s).
template <int kDh>
struct Fwd {
  static constexpr int kBr = 128, kBc = 64, kWarps = 8, kThreads = kWarps * 32;
  static constexpr int kLd = kDh + 8;
  static constexpr int kSmemBytes = (kBr + 4 * kBc) * kLd * static_cast<int>(sizeof(bf16));
};

// One run of Lq queries at positions p0 .. p0 + Lq - 1 over Tk keys: q, out, lse point at the
// run's first row, and q_rows is the rows per sequence of q, out and lse (their batch stride;
// lse's (b, h) stride). forward() is the run p0 = 0, Lq = q_rows = Tk = T. With out_f32 the
// output goes there in fp32 instead of to out (a ring block, merged in fp32).
template <int kDh>
__global__ void __launch_bounds__(Fwd<kDh>::kThreads, 2)
    forward_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                   bf16* __restrict__ out, float* __restrict__ lse, int Lq, int q_rows, int p0, int Tk, int Hq, int Hkv,
                   int W, float scale_log2, float* __restrict__ out_f32 = nullptr) {
  using C = Fwd<kDh>;
  constexpr int kBr = C::kBr, kBc = C::kBc, kLd = C::kLd;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* q_s = reinterpret_cast<bf16*>(smem);
  bf16* k_s = q_s + kBr * kLd;      // [2][kBc][kLd]
  bf16* v_s = k_s + 2 * kBc * kLd;  // [2][kBc][kLd]

  const int b = blockIdx.x / Hq, h = blockIdx.x % Hq, g = h / (Hq / Hkv);
  const int q0 = (gridDim.y - 1 - blockIdx.y) * kBr;  // a row of the run; longest (last) tiles first
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const std::int64_t q_stride = static_cast<std::int64_t>(Hq) * kDh, kv_stride = static_cast<std::int64_t>(Hkv) * kDh;
  const bf16* q_g = q + (static_cast<std::int64_t>(b) * q_rows * Hq + h) * kDh;
  const bf16* k_g = k + (static_cast<std::int64_t>(b) * Tk * Hkv + g) * kDh;
  const bf16* v_g = v + (static_cast<std::int64_t>(b) * Tk * Hkv + g) * kDh;

  // The query at position t sees keys t - W < j <= t (W = Tk: all of 0..t). Causal: keys past
  // the tile's last query are never read; window: nor key tiles wholly before its first query's
  // window.
  const int kv_end = min(Tk, p0 + min(Lq, q0 + kBr));
  const int j_begin = max(0, p0 + q0 - W + 1) / kBc;
  const int n_kv = (kv_end + kBc - 1) / kBc;

  load_rows_async<kDh>(q_s, kLd, q_g, q_stride, q0, kBr, Lq, tid, C::kThreads);
  const int st0 = j_begin & 1;  // tile j lives in stage j & 1
  load_rows_async<kDh>(k_s + st0 * kBc * kLd, kLd, k_g, kv_stride, j_begin * kBc, kBc, Tk, tid, C::kThreads);
  load_rows_async<kDh>(v_s + st0 * kBc * kLd, kLd, v_g, kv_stride, j_begin * kBc, kBc, Tk, tid, C::kThreads);
  cp_async_commit();

  const int w_row0 = q0 + warp * 16;            // this warp's first query row (of the run)
  const int w_pos0 = p0 + w_row0;               // and its position
  const int row_lo = w_row0 + (lane >> 2);      // rows of accumulator elements 0, 1
  const int row_hi = row_lo + 8;                // rows of accumulator elements 2, 3
  const int pos_lo = p0 + row_lo, pos_hi = p0 + row_hi;
  float o[kDh / 8][4];
#pragma unroll
  for (int n = 0; n < kDh / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  // Running max (log2 units of the scaled score) and sum of the two rows this thread holds.
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

  for (int j = j_begin; j < n_kv; ++j) {
    cp_async_wait_all();
    __syncthreads();  // tile j landed for everyone, and everyone is done with tile j - 1's stage
    if (j + 1 < n_kv) {  // prefetch tile j + 1 into the other stage while computing tile j
      const int st = (j + 1) & 1;
      load_rows_async<kDh>(k_s + st * kBc * kLd, kLd, k_g, kv_stride, (j + 1) * kBc, kBc, Tk, tid, C::kThreads);
      load_rows_async<kDh>(v_s + st * kBc * kLd, kLd, v_g, kv_stride, (j + 1) * kBc, kBc, Tk, tid, C::kThreads);
      cp_async_commit();
    }
    const int kv0 = j * kBc;
    // The whole tile above this warp's diagonal, or before all of its rows' windows.
    if (kv0 > w_pos0 + 15 || kv0 + kBc - 1 <= w_pos0 - W) continue;
    const bf16* ks = k_s + (j & 1) * kBc * kLd;
    const bf16* vs = v_s + (j & 1) * kBc * kLd;

    // s = q k^T for this warp's 16 rows x 64 keys.
    float s[kBc / 8][4];
#pragma unroll
    for (int n = 0; n < kBc / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kDh / 16; ++kk) {
      std::uint32_t qa[4];
      load_a(qa, q_s, kLd, warp * 16, kk * 16, lane);
#pragma unroll
      for (int np = 0; np < kBc / 16; ++np) {
        std::uint32_t bf[4];
        load_b_nk(bf, ks, kLd, np * 16, kk * 16, lane);
        mma(s[2 * np], qa, bf[0], bf[1]);
        mma(s[2 * np + 1], qa, bf[2], bf[3]);
      }
    }

    // Scale into log2 units; mask keys above the diagonal, past the sequence end and before the
    // row's window.
    const bool need_mask = kv0 + kBc - 1 > w_pos0 || kv0 + kBc > Tk || kv0 <= w_pos0 + 15 - W;
#pragma unroll
    for (int n = 0; n < kBc / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[n][e] * scale_log2;
        if (need_mask) {
          const int key = kv0 + n * 8 + 2 * (lane & 3) + (e & 1);
          const int pos = e < 2 ? pos_lo : pos_hi;
          if (key > pos || key >= Tk || key <= pos - W) x = -INFINITY;
        }
        s[n][e] = x;
      }
    }

    // Online softmax: rescale what was accumulated so far to the new running max.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < kBc / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
      mx = quad_max(mx);
      const float m_new = fmaxf(m_run[r], mx);
      // A row whose keys in this tile are all masked (before its window: it sees later tiles;
      // padding rows past Lq) keeps m = -inf; the guard keeps it from producing inf - inf = NaN.
      // Every row below Lq sees itself (its position is < Tk), so its final sum is positive.
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2f(m_run[r] - m_use);
      m_run[r] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < kBc / 8; ++n) {
        s[n][2 * r] = exp2f(s[n][2 * r] - m_use);
        s[n][2 * r + 1] = exp2f(s[n][2 * r + 1] - m_use);
        sum += s[n][2 * r] + s[n][2 * r + 1];
      }
      l_run[r] = l_run[r] * alpha + sum;  // per-thread partial; the quad is summed at the end
#pragma unroll
      for (int n = 0; n < kDh / 8; ++n) {
        o[n][2 * r] *= alpha;
        o[n][2 * r + 1] *= alpha;
      }
    }

    // o += p v: the probabilities go from accumulators straight into A fragments.
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      std::uint32_t a[4];
      acc_to_a(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int np = 0; np < kDh / 16; ++np) {
        std::uint32_t bf[4];
        load_b_kn(bf, vs, kLd, np * 16, kk * 16, lane);
        mma(o[2 * np], a, bf[0], bf[1]);
        mma(o[2 * np + 1], a, bf[2], bf[3]);
      }
    }
  }

  // Normalize; stage the warp's 16 output rows in its own (no longer needed) rows of q_s so the
  // global stores are whole 16-byte vectors.
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] = quad_sum(l_run[r]);
    inv[r] = l_run[r] > 0.f ? 1.f / l_run[r] : 0.f;  // a row that saw no key (a ring block): out 0
  }
  if (out_f32) {  // straight from the accumulators, two floats per store
    float* of = out_f32 + (static_cast<std::int64_t>(b) * q_rows * Hq + h) * kDh;
#pragma unroll
    for (int n = 0; n < kDh / 8; ++n) {
      const int col = n * 8 + 2 * (lane & 3);
      if (row_lo < Lq)
        *reinterpret_cast<float2*>(of + row_lo * q_stride + col) = make_float2(o[n][0] * inv[0], o[n][1] * inv[0]);
      if (row_hi < Lq)
        *reinterpret_cast<float2*>(of + row_hi * q_stride + col) = make_float2(o[n][2] * inv[1], o[n][3] * inv[1]);
    }
  } else {
    bf16* o_s = q_s + warp * 16 * kLd;
#pragma unroll
    for (int n = 0; n < kDh / 8; ++n) {
      const int col = n * 8 + 2 * (lane & 3);
      *reinterpret_cast<std::uint32_t*>(o_s + (lane >> 2) * kLd + col) = pack_bf16(o[n][0] * inv[0], o[n][1] * inv[0]);
      *reinterpret_cast<std::uint32_t*>(o_s + ((lane >> 2) + 8) * kLd + col) =
          pack_bf16(o[n][2] * inv[1], o[n][3] * inv[1]);
    }
    __syncwarp();
    bf16* out_g = out + (static_cast<std::int64_t>(b) * q_rows * Hq + h) * kDh;
    for (int c = lane; c < 16 * (kDh / 8); c += 32) {
      const int r = c / (kDh / 8), ch = c % (kDh / 8);
      if (w_row0 + r < Lq)
        *reinterpret_cast<uint4*>(out_g + (w_row0 + r) * q_stride + ch * 8) =
            *reinterpret_cast<const uint4*>(o_s + r * kLd + ch * 8);
    }
  }
  if ((lane & 3) == 0) {
    float* lse_g = lse + (static_cast<std::int64_t>(b) * Hq + h) * q_rows;
    if (row_lo < Lq) lse_g[row_lo] = l_run[0] > 0.f ? (m_run[0] + log2f(l_run[0])) * kLn2 : -INFINITY;
    if (row_hi < Lq) lse_g[row_hi] = l_run[1] > 0.f ? (m_run[1] + log2f(l_run[1])) * kLn2 : -INFINITY;
  }
}

// ---------------------------------------------- backward ----------------------------------------------

// D_i = dout_i . out_i, one warp per (b, t, h) row, stored [B, Hq, T]. The row loops are
// written for Dh a multiple of 64 (each lane reads bf16 pairs).
__global__ void dot_rows_kernel(const bf16* __restrict__ dout, const bf16* __restrict__ out, float* __restrict__ d,
                                std::int64_t rows, int T, int Hq, int Dh) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(dout + row * Dh);
  const __nv_bfloat162* o = reinterpret_cast<const __nv_bfloat162*>(out + row * Dh);
  float sum = 0.f;
  for (int c = lane; c < Dh / 2; c += 32) {
    const float2 x = __bfloat1622float2(a[c]), y = __bfloat1622float2(o[c]);
    sum += x.x * y.x + x.y * y.y;
  }
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) {
    const std::int64_t h = row % Hq, t = (row / Hq) % T, bb = row / (static_cast<std::int64_t>(Hq) * T);
    d[(bb * Hq + h) * T + t] = sum;
  }
}

// fp32 accumulators -> bf16 gradients, 4 at a time (n is a multiple of 64).
__global__ void to_bf16_kernel(const float* __restrict__ x, bf16* __restrict__ y, std::int64_t n4) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n4) return;
  const float4 f = reinterpret_cast<const float4*>(x)[i];
  uint2 packed;
  packed.x = pack_bf16(f.x, f.y);
  packed.y = pack_bf16(f.z, f.w);
  reinterpret_cast<uint2*>(y)[i] = packed;
}

__device__ __forceinline__ void atomic_add2(float* p, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(p), make_float2(x, y));
#else
  atomicAdd(p, x);
  atomicAdd(p + 1, y);
#endif
}

// 8 warps x 16 keys (a 128-key tile per block), 64-query tiles. Each warp computes the
// transposed tiles s^T = k q^T and dp^T = v dout^T for its 16 keys so that p^T and ds^T are
// already A fragments for dv += p^T dout and dk += ds^T q. dq = ds k needs all 128 keys of the
// tile per query row, so ds^T goes through shared memory once and each warp then owns 16 query
// rows x half the head dim of dq. 128 keys rather than 64 halve the fp32 atomics into dq (one
// set per key tile and query tile) and the Q/dout loads per FLOP. Shared memory: K, V of the
// tile; two stages of Q, dout, lse, D; ds^T.
template <int kDh>
struct Bwd {
  static constexpr int kBr = 64, kBc = 128, kWarps = 8, kThreads = kWarps * 32;
  static constexpr int kRowGroups = kBr / 16, kColGroups = kWarps / kRowGroups;  // of dq = ds k
  static constexpr int kLd = kDh + 8, kDsLd = kBr + 8;
  static constexpr int kSmemBytes = (2 * kBc * kLd + 4 * kBr * kLd + kBc * kDsLd) * static_cast<int>(sizeof(bf16)) +
                                    4 * kBr * static_cast<int>(sizeof(float));
};

// One run of Lq queries at positions p0 .. p0 + Lq - 1 (as forward_kernel's: q, dout, lse,
// d_row and dq_acc point at the run's first row, q_rows rows per sequence) over Tk keys; block y
// is key tile kt0 + y. backward() is the run p0 = 0, Lq = q_rows = Tk = T, kt0 = 0.
template <int kDh>
__global__ void __launch_bounds__(Bwd<kDh>::kThreads)
    backward_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                    const bf16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ d_row,
                    float* __restrict__ dq_acc, float* __restrict__ dk_acc, float* __restrict__ dv_acc, int Lq,
                    int q_rows, int p0, int Tk, int kt0, int Hq, int Hkv, int W, float scale, float scale_log2) {
  using C = Bwd<kDh>;
  constexpr int kBr = C::kBr, kBc = C::kBc, kLd = C::kLd, kDsLd = C::kDsLd;
  static_assert(kBc % kBr == 0, "the first query tile of a key tile is the one starting at the same position");
  static_assert(C::kRowGroups * C::kColGroups == C::kWarps && kDh % (16 * C::kColGroups) == 0, "dq's warp tiling");
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* k_s = reinterpret_cast<bf16*>(smem);
  bf16* v_s = k_s + kBc * kLd;
  bf16* q_s = v_s + kBc * kLd;        // [2][kBr][kLd]
  bf16* do_s = q_s + 2 * kBr * kLd;   // [2][kBr][kLd]
  bf16* ds_s = do_s + 2 * kBr * kLd;  // [kBc][kDsLd]: ds^T of the current pair of tiles
  float* lse_s = reinterpret_cast<float*>(ds_s + kBc * kDsLd);  // [2][kBr], log2 units
  float* dd_s = lse_s + 2 * kBr;                                // [2][kBr]

  const int b = blockIdx.x / Hq, h = blockIdx.x % Hq, g = h / (Hq / Hkv);
  const int kv0 = (kt0 + blockIdx.y) * kBc;  // first key tiles see the most queries: scheduled first
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const std::int64_t q_stride = static_cast<std::int64_t>(Hq) * kDh, kv_stride = static_cast<std::int64_t>(Hkv) * kDh;
  const std::int64_t q_off = (static_cast<std::int64_t>(b) * q_rows * Hq + h) * kDh;
  const std::int64_t kv_off = (static_cast<std::int64_t>(b) * Tk * Hkv + g) * kDh;
  const float* lse_g = lse + (static_cast<std::int64_t>(b) * Hq + h) * q_rows;
  const float* d_g = d_row + (static_cast<std::int64_t>(b) * Hq + h) * q_rows;

  // Key j is seen by the queries at positions j <= t < j + W: the run's query tiles from the one
  // holding position kv0 (the diagonal) to the one holding the tile's last key's last query
  // (W = Tk: to the run's end).
  const int q_end = min(Lq, kv0 + kBc - 1 + W - p0);
  const int n_q = (q_end + kBr - 1) / kBr;
  const int qt0 = max(0, kv0 - p0) / kBr;

  auto load_q_tile = [&](int qt, int st) {
    const int row0 = qt * kBr;
    load_rows_async<kDh>(q_s + st * kBr * kLd, kLd, q + q_off, q_stride, row0, kBr, Lq, tid, C::kThreads);
    load_rows_async<kDh>(do_s + st * kBr * kLd, kLd, dout + q_off, q_stride, row0, kBr, Lq, tid, C::kThreads);
    for (int i = tid; i < kBr; i += C::kThreads) {
      const int row = row0 + i;
      lse_s[st * kBr + i] = row < Lq ? lse_g[row] * kLog2e : 0.f;
      dd_s[st * kBr + i] = row < Lq ? d_g[row] : 0.f;
    }
  };
  load_rows_async<kDh>(k_s, kLd, k + kv_off, kv_stride, kv0, kBc, Tk, tid, C::kThreads);
  load_rows_async<kDh>(v_s, kLd, v + kv_off, kv_stride, kv0, kBc, Tk, tid, C::kThreads);
  load_q_tile(qt0, 0);
  cp_async_commit();

  const int w_key0 = kv0 + warp * 16;
  const int key_lo = w_key0 + (lane >> 2), key_hi = key_lo + 8;
  float dk[kDh / 8][4], dv[kDh / 8][4];
#pragma unroll
  for (int n = 0; n < kDh / 8; ++n) {
    dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = 0.f;
    dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.f;
  }

  for (int qt = qt0; qt < n_q; ++qt) {
    const int st = (qt - qt0) & 1;
    cp_async_wait_all();
    __syncthreads();  // this stage landed; everyone is done with the other stage and with ds_s
    if (qt + 1 < n_q) {
      load_q_tile(qt + 1, st ^ 1);
      cp_async_commit();
    }
    const int q0 = qt * kBr, qp0 = p0 + q0;  // the tile's first row (of the run) and its position
    const bf16* qs = q_s + st * kBr * kLd;
    const bf16* dos = do_s + st * kBr * kLd;
    const float* lses = lse_s + st * kBr;
    const float* dds = dd_s + st * kBr;

    // s^T = k q^T: this warp's 16 keys x 64 queries.
    float p[kBr / 8][4];
#pragma unroll
    for (int n = 0; n < kBr / 8; ++n) p[n][0] = p[n][1] = p[n][2] = p[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kDh / 16; ++kk) {
      std::uint32_t a[4];
      load_a(a, k_s, kLd, warp * 16, kk * 16, lane);
#pragma unroll
      for (int np = 0; np < kBr / 16; ++np) {
        std::uint32_t bf[4];
        load_b_nk(bf, qs, kLd, np * 16, kk * 16, lane);
        mma(p[2 * np], a, bf[0], bf[1]);
        mma(p[2 * np + 1], a, bf[2], bf[3]);
      }
    }
    // p^T = exp(scale s - lse), zero above the diagonal, for query rows past the run's end and
    // for keys before a query's window.
    const bool need_mask = qp0 < w_key0 + 15 || q0 + kBr > Lq || qp0 + kBr - 1 - w_key0 >= W;
#pragma unroll
    for (int n = 0; n < kBr / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = n * 8 + 2 * (lane & 3) + (e & 1);
        float x = exp2f(p[n][e] * scale_log2 - lses[qi]);
        if (need_mask) {
          const int key = e < 2 ? key_lo : key_hi;
          if (key > qp0 + qi || q0 + qi >= Lq || qp0 + qi - key >= W) x = 0.f;
        }
        p[n][e] = x;
      }
    }
    // dv += p^T dout.
#pragma unroll
    for (int kk = 0; kk < kBr / 16; ++kk) {
      std::uint32_t a[4];
      acc_to_a(a, p[2 * kk], p[2 * kk + 1]);
#pragma unroll
      for (int np = 0; np < kDh / 16; ++np) {
        std::uint32_t bf[4];
        load_b_kn(bf, dos, kLd, np * 16, kk * 16, lane);
        mma(dv[2 * np], a, bf[0], bf[1]);
        mma(dv[2 * np + 1], a, bf[2], bf[3]);
      }
    }
    // dp^T = v dout^T, then ds^T = p^T (dp^T - D) in place.
    float ds[kBr / 8][4];
#pragma unroll
    for (int n = 0; n < kBr / 8; ++n) ds[n][0] = ds[n][1] = ds[n][2] = ds[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kDh / 16; ++kk) {
      std::uint32_t a[4];
      load_a(a, v_s, kLd, warp * 16, kk * 16, lane);
#pragma unroll
      for (int np = 0; np < kBr / 16; ++np) {
        std::uint32_t bf[4];
        load_b_nk(bf, dos, kLd, np * 16, kk * 16, lane);
        mma(ds[2 * np], a, bf[0], bf[1]);
        mma(ds[2 * np + 1], a, bf[2], bf[3]);
      }
    }
#pragma unroll
    for (int n = 0; n < kBr / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) ds[n][e] = p[n][e] * (ds[n][e] - dds[n * 8 + 2 * (lane & 3) + (e & 1)]);
    }
    // dk += ds^T q (scaled once at the end); ds^T to shared memory for dq.
#pragma unroll
    for (int kk = 0; kk < kBr / 16; ++kk) {
      std::uint32_t a[4];
      acc_to_a(a, ds[2 * kk], ds[2 * kk + 1]);
      const int row = warp * 16 + (lane >> 2), col = kk * 16 + 2 * (lane & 3);
      *reinterpret_cast<std::uint32_t*>(ds_s + row * kDsLd + col) = a[0];
      *reinterpret_cast<std::uint32_t*>(ds_s + (row + 8) * kDsLd + col) = a[1];
      *reinterpret_cast<std::uint32_t*>(ds_s + row * kDsLd + col + 8) = a[2];
      *reinterpret_cast<std::uint32_t*>(ds_s + (row + 8) * kDsLd + col + 8) = a[3];
#pragma unroll
      for (int np = 0; np < kDh / 16; ++np) {
        std::uint32_t bf[4];
        load_b_kn(bf, qs, kLd, np * 16, kk * 16, lane);
        mma(dk[2 * np], a, bf[0], bf[1]);
        mma(dk[2 * np + 1], a, bf[2], bf[3]);
      }
    }
    __syncthreads();  // ds^T of every warp is in ds_s

    // dq rows 16 * (warp % kRowGroups).. of this query tile, columns of the warp's column
    // group, += scale * ds k, over all kBc keys of the tile.
    constexpr int kDqCols = kDh / C::kColGroups;
    const int dq_row0 = (warp % C::kRowGroups) * 16, dq_col0 = (warp / C::kRowGroups) * kDqCols;
    std::uint32_t ds_frag[kBc / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) load_a_trans(ds_frag[kk], ds_s, kDsLd, dq_row0, kk * 16, lane);
    const int qrow_lo = q0 + dq_row0 + (lane >> 2), qrow_hi = qrow_lo + 8;
    float* dq_lo = dq_acc + q_off + static_cast<std::int64_t>(qrow_lo) * q_stride + dq_col0;
    float* dq_hi = dq_lo + 8 * q_stride;
#pragma unroll
    for (int np = 0; np < kDqCols / 16; ++np) {
      float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int kk = 0; kk < kBc / 16; ++kk) {
        std::uint32_t bf[4];
        load_b_kn(bf, k_s, kLd, dq_col0 + np * 16, kk * 16, lane);
        mma(acc[0], ds_frag[kk], bf[0], bf[1]);
        mma(acc[1], ds_frag[kk], bf[2], bf[3]);
      }
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const int col = np * 16 + x * 8 + 2 * (lane & 3);
        if (qrow_lo < Lq) atomic_add2(dq_lo + col, acc[x][0] * scale, acc[x][1] * scale);
        if (qrow_hi < Lq) atomic_add2(dq_hi + col, acc[x][2] * scale, acc[x][3] * scale);
      }
    }
  }

  // This block's share of dk, dv (one query head of the group): summed over the group's heads
  // by atomics.
  float* dk_lo = dk_acc + kv_off + static_cast<std::int64_t>(key_lo) * kv_stride;
  float* dv_lo = dv_acc + kv_off + static_cast<std::int64_t>(key_lo) * kv_stride;
  const std::int64_t hi = 8 * kv_stride;
#pragma unroll
  for (int n = 0; n < kDh / 8; ++n) {
    const int col = n * 8 + 2 * (lane & 3);
    if (key_lo < Tk) {
      atomic_add2(dk_lo + col, dk[n][0] * scale, dk[n][1] * scale);
      atomic_add2(dv_lo + col, dv[n][0], dv[n][1]);
    }
    if (key_hi < Tk) {
      atomic_add2(dk_lo + hi + col, dk[n][2] * scale, dk[n][3] * scale);
      atomic_add2(dv_lo + hi + col, dv[n][2], dv[n][3]);
    }
  }
}

// Ring blocks: one warp per (b, t, h) row of a run folds the block's (out, lse) into the fp32
// running (acc_out, acc_lse) with log-sum-exp weights; a side of lse -inf contributes nothing.
__global__ void merge_block_kernel(const float* __restrict__ out, const float* __restrict__ lse,
                                   float* __restrict__ acc_out, float* __restrict__ acc_lse, std::int64_t rows,
                                   int q_rows, int Lq, int Hq, int Dh) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const std::int64_t b = row / (std::int64_t(Lq) * Hq);
  const int t = static_cast<int>((row / Hq) % Lq), h = static_cast<int>(row % Hq);
  const std::int64_t l_at = (b * Hq + h) * q_rows + t, o_at = ((b * q_rows + t) * Hq + h) * Dh;
  const float l1 = acc_lse[l_at], l2 = lse[l_at];
  const float m = fmaxf(l1, l2);
  if (m == -INFINITY) return;  // neither side saw a key yet
  const float w1 = l1 == -INFINITY ? 0.f : expf(l1 - m), w2 = l2 == -INFINITY ? 0.f : expf(l2 - m);
  const float inv = 1.f / (w1 + w2);
  for (int i = lane; i < Dh; i += 32)
    acc_out[o_at + i] = (acc_out[o_at + i] * w1 + out[o_at + i] * w2) * inv;
  __syncwarp();
  if (lane == 0) acc_lse[l_at] = m + logf(w1 + w2);
}

// ---------------------------------------------- host side ----------------------------------------------

constexpr int kMaxRuns = 8;

void check_extents(const char* what, int B, int T, int Hq, int Hkv, int Dh) {
  if (B < 0 || T < 0) fail("attention {}: B and T must be >= 0, got B={} T={}", what, B, T);
  if (Dh != 64 && Dh != 128) fail("attention {}: head dim {} is not supported (64 or 128)", what, Dh);
  if (Hq <= 0 || Hkv <= 0 || Hq % Hkv != 0)
    fail("attention {}: {} query heads do not split into groups over {} kv heads", what, Hq, Hkv);
}

void check_window(const char* what, int window) {
  if (window < 0) fail("attention {}: window {} must be >= 0 (0: full causal)", what, window);
}

void check_aligned(const char* what, const char* name, const void* p) {
  if (p == nullptr) fail("attention {}: {} is null", what, name);
  if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) fail("attention {}: {} is not 16-byte aligned", what, name);
}

// Tq queries in `runs` runs of Tq / runs, run s at positions run_start[s].. of Tk keys.
void check_runs(const char* what, int Tq, int Tk, const int* run_start, int runs) {
  if (Tk < 0) fail("attention {}: Tk must be >= 0, got {}", what, Tk);
  if (runs < 1 || runs > kMaxRuns) fail("attention {}: runs must be in [1, {}], got {}", what, kMaxRuns, runs);
  if (run_start == nullptr) fail("attention {}: run_start is null", what);
  if (Tq % runs != 0) fail("attention {}: Tq={} does not split into {} runs", what, Tq, runs);
  const int L = Tq / runs;
  for (int s = 0; s < runs; ++s)
    if (run_start[s] < 0 || static_cast<std::int64_t>(run_start[s]) + L > Tk)
      fail("attention {}: run {} at {} of {} queries does not fit in the {} keys", what, s, run_start[s], L, Tk);
}

constexpr std::size_t align_up(std::size_t n) { return (n + 255) / 256 * 256; }

struct WorkspaceLayout {
  std::size_t d_row = 0, dq = 0, dk = 0, dv = 0, total = 0;  // byte offsets
};

// T_kv: the keys whose dk, dv accumulate in the workspace (0: in the caller's fp32 outputs).
WorkspaceLayout workspace_layout(int B, int Tq, int T_kv, int Hq, int Hkv, int Dh) {
  const std::size_t rows_q = static_cast<std::size_t>(B) * Tq * Hq, rows_kv = static_cast<std::size_t>(B) * T_kv * Hkv;
  WorkspaceLayout w;
  w.d_row = 0;
  w.dq = align_up(rows_q * sizeof(float));
  w.dk = w.dq + align_up(rows_q * Dh * sizeof(float));
  w.dv = w.dk + align_up(rows_kv * Dh * sizeof(float));
  w.total = w.dv + align_up(rows_kv * Dh * sizeof(float));
  return w;
}

// The window the kernels mask with, in [1, T]: W = T is full causal attention (0 or W >= T).
int kernel_window(int window, int T) { return window > 0 && window < T ? window : T; }

// One launch per run (checked by check_runs; L = Tq / runs >= 1); forward() is the run {0} of
// Tq = Tk = T.
template <int kDh>
void launch_forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int B, int Tq, int Tk, int Hq,
                    int Hkv, int W, float scale, const int* run_start, int runs, cudaStream_t stream) {
  using C = Fwd<kDh>;
  KEEL_CUDA_CHECK(
      cudaFuncSetAttribute(forward_kernel<kDh>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes));
  const int L = Tq / runs;
  const dim3 grid(static_cast<unsigned>(B * Hq), static_cast<unsigned>((L + C::kBr - 1) / C::kBr));
  for (int s = 0; s < runs; ++s) {
    const std::int64_t row0 = static_cast<std::int64_t>(s) * L, off = row0 * Hq * kDh;
    forward_kernel<kDh><<<grid, C::kThreads, C::kSmemBytes, stream>>>(
        q + off, k, v, out + off, lse + row0, L, Tq, run_start[s], Tk, Hq, Hkv, W, scale * kLog2e);
    KEEL_CUDA_CHECK_LAUNCH();
  }
}

// The same for the accumulating backward kernel: run s's blocks cover the key tiles from the one
// holding its first query's first key to the one holding its last query.
template <int kDh>
void launch_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse, const float* d_row,
                     float* dq_acc, float* dk_acc, float* dv_acc, int B, int Tq, int Tk, int Hq, int Hkv, int W,
                     float scale, const int* run_start, int runs, cudaStream_t stream, int q_rows = 0) {
  using C = Bwd<kDh>;
  KEEL_CUDA_CHECK(
      cudaFuncSetAttribute(backward_kernel<kDh>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes));
  const int L = Tq / runs;
  if (q_rows == 0) q_rows = Tq;  // the rows per sequence (a ring block's run: more than its own)
  for (int s = 0; s < runs; ++s) {
    const int p0 = run_start[s];
    const int kt0 = (p0 >= W ? p0 - W + 1 : 0) / C::kBc;
    const int kt_end = static_cast<int>(
        std::min<std::int64_t>((std::int64_t(p0) + L + C::kBc - 1) / C::kBc, (std::int64_t(Tk) + C::kBc - 1) / C::kBc));
    if (kt_end <= kt0) continue;  // a ring block wholly before the run's windows
    const dim3 grid(static_cast<unsigned>(B * Hq), static_cast<unsigned>(kt_end - kt0));
    const std::int64_t row0 = static_cast<std::int64_t>(s) * L, off = row0 * Hq * kDh;
    backward_kernel<kDh><<<grid, C::kThreads, C::kSmemBytes, stream>>>(q + off, k, v, dout + off, lse + row0,
                                                                      d_row + row0, dq_acc + off, dk_acc, dv_acc, L,
                                                                      q_rows, p0, Tk, kt0, Hq, Hkv, W, scale,
                                                                      scale * kLog2e);
    KEEL_CUDA_CHECK_LAUNCH();
  }
}

void launch_to_bf16(const float* x, bf16* y, std::size_t n, cudaStream_t stream) {
  const std::int64_t n4 = static_cast<std::int64_t>(n / 4);
  if (n4 == 0) return;
  to_bf16_kernel<<<grid_for(n4, 256), 256, 0, stream>>>(x, y, n4);
  KEEL_CUDA_CHECK_LAUNCH();
}

// Every check of forward()/forward_runs() (B > 0, Tq > 0 here), then the launches.
void forward_checked(const char* what, const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int B,
                     int Tq, int Tk, int Hq, int Hkv, int Dh, float scale, int window, const int* run_start, int runs,
                     cudaStream_t stream) {
  if (static_cast<std::int64_t>(B) * Hq > 0x7fffffff) fail("attention {}: B * Hq = {} is too large", what, B * Hq);
  check_aligned(what, "q", q);
  check_aligned(what, "k", k);
  check_aligned(what, "v", v);
  check_aligned(what, "out", out);
  if (lse == nullptr) fail("attention {}: lse is null", what);
  const int W = kernel_window(window, Tk);
  if (Dh == 64)
    launch_forward<64>(q, k, v, out, lse, B, Tq, Tk, Hq, Hkv, W, scale, run_start, runs, stream);
  else
    launch_forward<128>(q, k, v, out, lse, B, Tq, Tk, Hq, Hkv, W, scale, run_start, runs, stream);
}

// D_i, then the accumulating kernel per run into dq_acc (zeroed, [B, Tq, Hq, Dh]) and dk_acc,
// dv_acc (zeroed, [B, Tk, Hkv, Dh]); B, Tq > 0 and everything checked.
void backward_accumulate(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse,
                         const bf16* dout, float* d_row, float* dq_acc, float* dk_acc, float* dv_acc, int B, int Tq,
                         int Tk, int Hq, int Hkv, int Dh, float scale, int window, const int* run_start, int runs,
                         cudaStream_t stream) {
  const std::int64_t rows_q = static_cast<std::int64_t>(B) * Tq * Hq;
  constexpr int kDotWarps = 8;
  dot_rows_kernel<<<grid_for(rows_q, kDotWarps), kDotWarps * 32, 0, stream>>>(dout, out, d_row, rows_q, Tq, Hq, Dh);
  KEEL_CUDA_CHECK_LAUNCH();

  const int W = kernel_window(window, Tk);
  if (Dh == 64)
    launch_backward<64>(q, k, v, dout, lse, d_row, dq_acc, dk_acc, dv_acc, B, Tq, Tk, Hq, Hkv, W, scale, run_start,
                        runs, stream);
  else
    launch_backward<128>(q, k, v, dout, lse, d_row, dq_acc, dk_acc, dv_acc, B, Tq, Tk, Hq, Hkv, W, scale, run_start,
                         runs, stream);
}

constexpr int kWholeSequence[1] = {0};  // the one run of forward()/backward()

}  // namespace

void forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int B, int T, int Hq, int Hkv, int Dh,
             float scale, int window, cudaStream_t stream) {
  check_extents("forward", B, T, Hq, Hkv, Dh);
  check_window("forward", window);
  if (B == 0 || T == 0) return;
  forward_checked("forward", q, k, v, out, lse, B, T, T, Hq, Hkv, Dh, scale, window, kWholeSequence, 1, stream);
}

void forward_runs(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int B, int Tq, int Tk, int Hq,
                  int Hkv, int Dh, float scale, int window, const int* run_start, int runs, cudaStream_t stream) {
  check_extents("forward_runs", B, Tq, Hq, Hkv, Dh);
  check_window("forward_runs", window);
  check_runs("forward_runs", Tq, Tk, run_start, runs);
  if (B == 0 || Tq == 0) return;
  forward_checked("forward_runs", q, k, v, out, lse, B, Tq, Tk, Hq, Hkv, Dh, scale, window, run_start, runs, stream);
}

std::size_t backward_workspace_bytes(int B, int T, int Hq, int Hkv, int Dh) {
  check_extents("backward", B, T, Hq, Hkv, Dh);
  return workspace_layout(B, T, T, Hq, Hkv, Dh).total;
}

std::size_t backward_runs_workspace_bytes(int B, int Tq, int Tk, int Hq, int Hkv, int Dh) {
  check_extents("backward_runs", B, Tq, Hq, Hkv, Dh);
  if (Tk < 0) fail("attention backward_runs: Tk must be >= 0, got {}", Tk);
  return workspace_layout(B, Tq, 0, Hq, Hkv, Dh).total;
}

void backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse, const bf16* dout, bf16* dq,
              bf16* dk, bf16* dv, void* workspace, int B, int T, int Hq, int Hkv, int Dh, float scale, int window,
              cudaStream_t stream) {
  check_extents("backward", B, T, Hq, Hkv, Dh);
  check_window("backward", window);
  if (B == 0 || T == 0) return;
  const char* names[] = {"q", "k", "v", "out", "dout", "dq", "dk", "dv", "workspace"};
  const void* ptrs[] = {q, k, v, out, dout, dq, dk, dv, workspace};
  for (int i = 0; i < 9; ++i) check_aligned("backward", names[i], ptrs[i]);
  if (lse == nullptr) fail("attention backward: lse is null");

  const WorkspaceLayout w = workspace_layout(B, T, T, Hq, Hkv, Dh);
  char* base = static_cast<char*>(workspace);
  float* d_row = reinterpret_cast<float*>(base + w.d_row);
  float* dq_acc = reinterpret_cast<float*>(base + w.dq);
  float* dk_acc = reinterpret_cast<float*>(base + w.dk);
  float* dv_acc = reinterpret_cast<float*>(base + w.dv);
  // The three accumulators are contiguous: one memset clears them.
  KEEL_CUDA_CHECK(cudaMemsetAsync(dq_acc, 0, w.total - w.dq, stream));
  backward_accumulate(q, k, v, out, lse, dout, d_row, dq_acc, dk_acc, dv_acc, B, T, T, Hq, Hkv, Dh, scale, window,
                      kWholeSequence, 1, stream);

  const std::size_t n_q = static_cast<std::size_t>(B) * T * Hq * Dh, n_kv = static_cast<std::size_t>(B) * T * Hkv * Dh;
  launch_to_bf16(dq_acc, dq, n_q, stream);
  launch_to_bf16(dk_acc, dk, n_kv, stream);
  launch_to_bf16(dv_acc, dv, n_kv, stream);
}

void backward_runs(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse, const bf16* dout,
                   bf16* dq, float* dk, float* dv, void* workspace, int B, int Tq, int Tk, int Hq, int Hkv, int Dh,
                   float scale, int window, const int* run_start, int runs, cudaStream_t stream) {
  check_extents("backward_runs", B, Tq, Hq, Hkv, Dh);
  check_window("backward_runs", window);
  check_runs("backward_runs", Tq, Tk, run_start, runs);
  if (B == 0 || Tk == 0) return;  // (Tk == 0 leaves Tq == 0 too)
  // dk, dv are the sums over the queries: all zero when there are none.
  check_aligned("backward_runs", "dk", dk);
  check_aligned("backward_runs", "dv", dv);
  const std::size_t kv_bytes = static_cast<std::size_t>(B) * Tk * Hkv * Dh * sizeof(float);
  if (Tq == 0) {
    KEEL_CUDA_CHECK(cudaMemsetAsync(dk, 0, kv_bytes, stream));
    KEEL_CUDA_CHECK(cudaMemsetAsync(dv, 0, kv_bytes, stream));
    return;
  }
  const char* names[] = {"q", "k", "v", "out", "dout", "dq", "workspace"};
  const void* ptrs[] = {q, k, v, out, dout, dq, workspace};
  for (int i = 0; i < 7; ++i) check_aligned("backward_runs", names[i], ptrs[i]);
  if (lse == nullptr) fail("attention backward_runs: lse is null");
  if (static_cast<std::int64_t>(B) * Hq > 0x7fffffff) fail("attention backward_runs: B * Hq = {} is too large", B * Hq);

  // dq accumulates in the workspace; dk, dv straight in the caller's fp32 outputs.
  const WorkspaceLayout w = workspace_layout(B, Tq, 0, Hq, Hkv, Dh);
  char* base = static_cast<char*>(workspace);
  float* d_row = reinterpret_cast<float*>(base + w.d_row);
  float* dq_acc = reinterpret_cast<float*>(base + w.dq);
  KEEL_CUDA_CHECK(cudaMemsetAsync(dq_acc, 0, w.total - w.dq, stream));
  KEEL_CUDA_CHECK(cudaMemsetAsync(dk, 0, kv_bytes, stream));
  KEEL_CUDA_CHECK(cudaMemsetAsync(dv, 0, kv_bytes, stream));
  backward_accumulate(q, k, v, out, lse, dout, d_row, dq_acc, dk, dv, B, Tq, Tk, Hq, Hkv, Dh, scale, window, run_start,
                      runs, stream);
  launch_to_bf16(dq_acc, dq, static_cast<std::size_t>(B) * Tq * Hq * Dh, stream);
}

// ---- ring attention's pieces ----

namespace {
// The window of a ring block's kernels: positions are relative to the block's first key, so
// "every earlier key" is no window at all (forward()'s W = T would cut off a block p0 >= T back).
int block_window(int window) { return window > 0 ? window : 1 << 29; }

void check_block(const char* what, int B, int q_rows, int Lq, int p0, int Tk, int Hq, int Hkv, int Dh, int window) {
  check_extents(what, B, q_rows, Hq, Hkv, Dh);
  check_window(what, window);
  if (Lq < 0 || Lq > q_rows || p0 < 0 || Tk < 0)
    fail("attention {}: a run of {} queries (of {} rows) {} positions after a block of {} keys: each must be >= 0 and "
         "the run within its rows",
         what, Lq, q_rows, p0, Tk);
  if (static_cast<std::int64_t>(B) * Hq > 0x7fffffff) fail("attention {}: B * Hq = {} is too large", what, B * Hq);
}
}  // namespace

void forward_block(const bf16* q, const bf16* k, const bf16* v, float* out, float* lse, int B, int q_rows, int Lq,
                   int p0, int Tk, int Hq, int Hkv, int Dh, float scale, int window, cudaStream_t stream) {
  check_block("forward_block", B, q_rows, Lq, p0, Tk, Hq, Hkv, Dh, window);
  if (B == 0 || Lq == 0) return;
  const char* names[] = {"q", "k", "v", "out"};
  const void* ptrs[] = {q, k, v, out};
  for (int i = 0; i < 4; ++i) check_aligned("forward_block", names[i], ptrs[i]);
  if (lse == nullptr) fail("attention forward_block: lse is null");
  const int W = block_window(window);
  const auto launch = [&](auto kernel, int smem, int threads, int br) {
    KEEL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const dim3 grid(static_cast<unsigned>(B * Hq), static_cast<unsigned>((Lq + br - 1) / br));
    kernel<<<grid, threads, smem, stream>>>(q, k, v, nullptr, lse, Lq, q_rows, p0, Tk, Hq, Hkv, W, scale * kLog2e, out);
    KEEL_CUDA_CHECK_LAUNCH();
  };
  if (Dh == 64)
    launch(forward_kernel<64>, Fwd<64>::kSmemBytes, Fwd<64>::kThreads, Fwd<64>::kBr);
  else
    launch(forward_kernel<128>, Fwd<128>::kSmemBytes, Fwd<128>::kThreads, Fwd<128>::kBr);
}

void merge_block(const float* out, const float* lse, float* acc_out, float* acc_lse, int B, int q_rows, int Lq, int Hq,
                 int Dh, cudaStream_t stream) {
  if (B < 0 || Lq < 0 || Lq > q_rows || Hq <= 0 || Dh <= 0)
    fail("attention merge_block: B {}, {} of {} rows, {} heads of {}", B, Lq, q_rows, Hq, Dh);
  const std::int64_t rows = static_cast<std::int64_t>(B) * Lq * Hq;
  if (rows == 0) return;
  constexpr int kWarps = 8;
  merge_block_kernel<<<grid_for(rows, kWarps), kWarps * 32, 0, stream>>>(out, lse, acc_out, acc_lse, rows, q_rows, Lq,
                                                                          Hq, Dh);
  KEEL_CUDA_CHECK_LAUNCH();
}

void dot_rows(const bf16* dout, const bf16* out, float* d_row, int B, int q_rows, int Hq, int Dh, cudaStream_t stream) {
  const std::int64_t rows = static_cast<std::int64_t>(B) * q_rows * Hq;
  if (rows == 0) return;
  constexpr int kDotWarps = 8;
  dot_rows_kernel<<<grid_for(rows, kDotWarps), kDotWarps * 32, 0, stream>>>(dout, out, d_row, rows, q_rows, Hq, Dh);
  KEEL_CUDA_CHECK_LAUNCH();
}

void backward_block(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,
                    const float* d_row, float* dq_acc, float* dk_acc, float* dv_acc, int B, int q_rows, int Lq, int p0,
                    int Tk, int Hq, int Hkv, int Dh, float scale, int window, cudaStream_t stream) {
  check_block("backward_block", B, q_rows, Lq, p0, Tk, Hq, Hkv, Dh, window);
  if (B == 0 || Lq == 0 || Tk == 0) return;
  const char* names[] = {"q", "k", "v", "dout", "dq_acc", "dk_acc", "dv_acc"};
  const void* ptrs[] = {q, k, v, dout, dq_acc, dk_acc, dv_acc};
  for (int i = 0; i < 7; ++i) check_aligned("backward_block", names[i], ptrs[i]);
  if (lse == nullptr || d_row == nullptr) fail("attention backward_block: lse or d_row is null");
  const int W = block_window(window);
  // launch_backward's run loop, for the one run at p0 (q, dout, lse, d_row, dq_acc at its first row)
  const int start[1] = {p0};
  if (Dh == 64)
    launch_backward<64>(q, k, v, dout, lse, d_row, dq_acc, dk_acc, dv_acc, B, Lq, Tk, Hq, Hkv, W, scale, start, 1,
                        stream, q_rows);
  else
    launch_backward<128>(q, k, v, dout, lse, d_row, dq_acc, dk_acc, dv_acc, B, Lq, Tk, Hq, Hkv, W, scale, start, 1,
                         stream, q_rows);
}

}  // namespace keel::ops::cuda::attention
